"""The embedded GRPO engine: one process, a ``transformers`` causal LM, rollout with a KV cache.

One step: sample ``prompts_per_step`` problems, generate ``group_size`` responses each (left-padded
prompts, incremental decoding over a KV cache, each sampled token's log-prob kept), score them
with the GSM8K scorer, compute group advantages, recompute old (and reference) log-probs without
grad, then one policy update over micro-batches with gradient accumulation (clipped loss, KL and
entropy terms) and AdamW.

The two log-prob/loss paths the recipe compares:

* ``off`` is what a user writes with plain PyTorch/transformers: the model's full logits,
  ``log_softmax(logits.float()).gather``, entropy from the logits, the clipped loss in eager ops.
* ``on`` is rl-kernel: log-probs and entropy from the final hidden states and the LM head with
  :func:`rl_kernel_core.linear_logprob` (no ``[tokens, vocab]`` logits),
  :func:`rl_kernel_core.loss` and :func:`rl_kernel_core.group_advantages`.

The sampler is a separate choice (``torch`` or ``rl-kernel``), the same in both runs, so the first
step's samples are identical off and on. Every step writes one profiler record.

``batch_invariant`` (``--batch-invariant``) runs each step inside
:func:`rl_kernel_core.batch_invariant`: the model's matmuls, norms and log-softmax take the
batch-invariant kernels, its attention is :func:`rl_kernel_core.varlen_attention`
(:func:`rl_kernel_core.batch_invariant_mode.api_hf.use_mode_attention`), and the rollout records each sampled
token's log-prob with the same head function (and kernels) the trainer recomputes it with, from the
decode step's final hidden state. A token then gets the same bits in the rollout (a KV-cache decode
step over the whole batch) and in the recomputation (one forward per micro-batch): the step's
``logprob_diff`` is exactly 0.
"""

from __future__ import annotations

import contextlib
import copy
import random
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

import torch

import rl_kernel_core as rk
from rl_kernel_core import profiling

from . import scoring
from .data import Problem

_SEED_MOD = 2**62


@dataclass(frozen=True)
class GRPOConfig:
    """Hyperparameters of one embedded GRPO run (the same for the off and on runs)."""

    steps: int = 20
    prompts_per_step: int = 8
    group_size: int = 4
    max_prompt_tokens: int = 256
    max_new_tokens: int = 32
    temperature: float = 1.0
    lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    micro_batch: int = 16
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    reward_method: str = "flexible"
    format_score: float = 0.1
    sampler: str = "torch"
    gradient_checkpointing: bool = False
    batch_invariant: bool = False
    weight_check_every: int = 0  # the verl engine's on run only (the embedded engine syncs no weights)
    seed: int = 0


@dataclass
class Prompts:
    """A step's encoded prompts: ``ids``/``mask`` ``[S, P]`` left-padded; ``position_ids`` for the
    prefill (None: :func:`positions` of the mask); ``inputs``: more prefill keyword arguments;
    ``context``: kept on the :class:`Rollout` for the engine's training inputs."""

    ids: torch.Tensor
    mask: torch.Tensor
    position_ids: Optional[torch.Tensor] = None
    inputs: Optional[dict] = None
    context: Any = None


@dataclass
class Rollout:
    """A batch of generated sequences: ``[S, P]`` left-padded prompts and ``[S, R]`` responses."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    rollout_logprob: torch.Tensor
    context: Any = None  # what an engine's training inputs need besides the tokens (a VLM's media)

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.response_mask], dim=1)

    @property
    def targets(self) -> torch.Tensor:
        """Response tokens with ``-100`` where the sequence had already ended."""
        return self.response_ids.masked_fill(self.response_mask == 0, -100)


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids for a left-padded attention mask (0 at each row's first real token)."""
    return (mask.long().cumsum(-1) - 1).clamp_min(0)


# ---------------------------------------------------------------------------------------------
# sampling


def torch_sampler(generator: torch.Generator, temperature: float) -> Callable:
    """Plain PyTorch sampling from the tempered softmax; returns (tokens, log-probs)."""

    def draw(logits: torch.Tensor, row_seeds: torch.Tensor, position: int):
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
        tokens = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)

    return draw


def rl_kernel_sampler(temperature: float) -> Callable:
    """``rl_kernel_core.sample`` with a seed per (row, position): draws independent of the batch."""

    def draw(logits: torch.Tensor, row_seeds: torch.Tensor, position: int):
        seeds = (row_seeds * 1_000_003 + position) % _SEED_MOD
        return rk.sample(logits.float(), temperature=temperature, seeds=seeds)

    return draw


@torch.no_grad()
def generate(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_id: int,
    draw: Callable,
    row_seeds: torch.Tensor,
    head_logprob: Optional[Callable] = None,
    position_ids: Optional[torch.Tensor] = None,
    prompt_inputs: Optional[dict] = None,
    drop_ids: Optional[torch.Tensor] = None,
) -> Rollout:
    """Incremental decoding over a KV cache from left-padded prompts ``[S, P]``.

    Each row stops after its first ``eos_id`` (which is kept as its last response token);
    ``rollout_logprob`` holds each sampled token's log-prob as the sampler computed it, or, with
    ``head_logprob(model, hidden [S, 1, D], tokens [S, 1]) -> [S, 1]``, as that head function
    computes it from the step's final hidden state.

    ``position_ids``: the prompts' positions, ``[S, P]`` (default :func:`positions` of the mask)
    or a multimodal model's ``[3, S, P]`` rotary index; each decode step takes the last column's
    plus one. ``prompt_inputs``: more keyword arguments of the prefill forward (a VLM's
    ``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids``). ``drop_ids`` (int64 ``[K]``):
    tokens that end a row where they are sampled without being kept (masked out, as after its
    end): a VLM's media placeholders, which a response cannot hold (the trainer would read one as
    an image's token).
    """
    from transformers import DynamicCache

    def forward(**kwargs):
        """``(last position's logits [S, V], its final hidden state [S, 1, D] or None)``."""
        if head_logprob is None:
            return model(**kwargs, logits_to_keep=1).logits[:, -1], None
        hidden = model.base_model(**kwargs).last_hidden_state[:, -1:]
        return model.get_output_embeddings()(hidden)[:, -1], hidden

    cache = DynamicCache(config=model.config)
    pos = positions(prompt_mask) if position_ids is None else position_ids
    logits, hidden = forward(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        position_ids=pos,
        past_key_values=cache,
        use_cache=True,
        **(prompt_inputs or {}),
    )
    s = prompt_ids.shape[0]
    alive = torch.ones(s, dtype=torch.bool, device=prompt_ids.device)
    mask, tokens, logprobs, masks = prompt_mask, [], [], []
    next_pos = pos[..., -1:] + 1
    for t in range(max_new_tokens):
        tok, lp = draw(logits, row_seeds, t)
        if head_logprob is not None:
            lp = head_logprob(model, hidden, tok[:, None])[:, 0]
        if drop_ids is not None:
            alive = alive & ~torch.isin(tok, drop_ids)
        tok = torch.where(alive, tok, torch.full_like(tok, eos_id))
        tokens.append(tok)
        logprobs.append(torch.where(alive, lp.float(), torch.zeros_like(lp, dtype=torch.float32)))
        masks.append(alive.to(prompt_mask.dtype))
        alive = alive & (tok != eos_id)
        if t + 1 == max_new_tokens or not bool(alive.any()):
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        logits, hidden = forward(
            input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos, past_key_values=cache, use_cache=True
        )
        next_pos = next_pos + 1
    return Rollout(prompt_ids, prompt_mask, torch.stack(tokens, 1), torch.stack(masks, 1), torch.stack(logprobs, 1))


# ---------------------------------------------------------------------------------------------
# the two log-prob / loss paths


def plain_head_logprob(logits, targets, temperature, with_entropy):
    """``log_softmax(logits.float()).gather`` and entropy from the logits ``[..., R, V]`` (off path)."""
    logits = logits.float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    lp = logp.gather(-1, targets.clamp_min(0)[..., None]).squeeze(-1)
    lp = lp.masked_fill(targets == -100, 0.0)
    if not with_entropy:
        return lp, None
    entropy = torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)
    return lp, entropy


def rl_kernel_head_logprob(hidden, head, targets, temperature, with_entropy):
    """:func:`rl_kernel_core.linear_logprob` on hidden states ``[..., R, D]`` and the LM head (on path)."""
    if torch.is_autocast_enabled(hidden.device.type):
        # the dtype autocast gives the LM head's matmul on the off path
        hidden = hidden.to(torch.get_autocast_dtype(hidden.device.type))
    weight = head.weight.to(hidden.dtype)
    bias = None if head.bias is None else head.bias.to(hidden.dtype)
    out = rk.linear_logprob(hidden, weight, targets, bias=bias, temperature=temperature, return_entropy=with_entropy)
    return out if with_entropy else (out, None)


def plain_head(model, hidden, targets, temperature):
    """The off path's log-probs of ``targets [S, R]`` from final hidden states ``[S, R, D]``."""
    return plain_head_logprob(model.get_output_embeddings()(hidden), targets, temperature, False)[0]


def rl_kernel_head(model, hidden, targets, temperature):
    """The on path's log-probs of ``targets [S, R]`` from final hidden states ``[S, R, D]``."""
    return rl_kernel_head_logprob(hidden, model.get_output_embeddings(), targets, temperature, False)[0]


def plain_logprob(model, inputs: dict, targets, temperature, with_entropy):
    """The model's full logits on ``inputs`` (its keyword arguments: ``input_ids`` ``[S, P + R]``,
    ``attention_mask``, positions, media), then :func:`plain_head_logprob` on the response
    positions of ``targets`` ``[S, R]``."""
    r = targets.shape[1]
    logits = model(**inputs).logits
    return plain_head_logprob(logits[:, -r - 1 : -1], targets, temperature, with_entropy)


def rl_kernel_logprob(model, inputs: dict, targets, temperature, with_entropy):
    """The base model's final hidden states, then :func:`rl_kernel_head_logprob` (no logits)."""
    r = targets.shape[1]
    hidden = model.base_model(**inputs).last_hidden_state
    return rl_kernel_head_logprob(
        hidden[:, -r - 1 : -1], model.get_output_embeddings(), targets, temperature, with_entropy
    )


def plain_group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages in eager PyTorch: (r - group mean) / (group std + eps)."""
    g = rewards.view(-1, group_size)
    return ((g - g.mean(-1, keepdim=True)) / (g.std(-1, keepdim=True) + eps)).view(-1)


def plain_policy_loss(lp, old_lp, adv, mask, *, ref_lp, entropy, cfg: GRPOConfig, scale: float):
    """The clipped surrogate with dual clip, low-variance KL and entropy terms in eager ops.

    Token-mean over ``mask``, multiplied by ``scale`` (this micro-batch's share of the tokens).
    Returns the scaled loss and detached metrics named as :func:`rl_kernel_core.loss`'s.
    """
    m = mask.float()
    count = m.sum().clamp_min(1.0)

    def mean(x):
        return (x * m).sum() / count

    with profiling.region("ratio_kl"):
        log_ratio = (lp - old_lp).clamp(-20.0, 20.0)
        ratio = log_ratio.exp()
        kl = None
        if ref_lp is not None:
            d = ref_lp - lp
            kl = (d.exp() - d - 1).clamp(-10.0, 10.0)
    with profiling.region("loss"):
        pg1 = -adv * ratio
        pg2 = -adv * ratio.clamp(1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high)
        pg = torch.maximum(pg1, pg2)
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * cfg.clip_ratio_c), pg)
        loss = mean(pg)
        metrics = {
            "pg_loss": loss.detach(),
            "pg_clipfrac": mean((pg2 > pg1).float()).detach(),
            "ppo_kl": mean(-log_ratio).detach(),
        }
        if kl is not None:
            kl_loss = mean(kl)
            loss = loss + cfg.kl_coef * kl_loss
            metrics["kl_loss"] = kl_loss.detach()
        if entropy is not None:
            ent = mean(entropy)
            loss = loss - cfg.entropy_coef * ent
            metrics["entropy"] = ent.detach()
    return loss * scale, metrics


def rl_kernel_policy_loss(lp, old_lp, adv, mask, *, ref_lp, entropy, cfg: GRPOConfig, scale: float):
    """The same loss through :func:`rl_kernel_core.loss` (ratio, KL and loss fused)."""
    with profiling.region("loss"):
        loss, metrics = rk.policy_loss(
            lp,
            old_lp,
            adv,
            mask,
            ref_logprob=ref_lp,
            clip_ratio_low=cfg.clip_ratio_low,
            clip_ratio_high=cfg.clip_ratio_high,
            clip_ratio_c=cfg.clip_ratio_c,
            kl_type="low_var_kl",
            kl_coef=cfg.kl_coef if ref_lp is not None else 0.0,
            entropy=entropy,
            entropy_coef=cfg.entropy_coef,
            loss_agg_mode="token-mean",
        )
    return loss * scale, metrics


@dataclass(frozen=True)
class Path_:
    """One side of the comparison: how log-probs, advantages and the loss are computed."""

    name: str
    logprob: Callable
    advantages: Callable
    loss: Callable
    head: Callable


OFF = Path_("off", plain_logprob, plain_group_advantages, plain_policy_loss, plain_head)
ON = Path_(
    "on",
    rl_kernel_logprob,
    lambda rewards, g: rk.group_advantages(rewards, group_size=g, estimator="grpo"),
    rl_kernel_policy_loss,
    rl_kernel_head,
)


# ---------------------------------------------------------------------------------------------
# the loop


class Engine:
    """Holds the policy, the optional frozen reference, the optimizer and the tokenized prompts.

    A text causal LM; a subclass serving another kind of model overrides :meth:`load`,
    :meth:`use_mode`, :meth:`encode`, :meth:`model_inputs`, :meth:`score` and :meth:`check`.
    """

    def __init__(
        self, model_dir: Path, cfg: GRPOConfig, side: Path_, device: torch.device, cross_check: Optional[Path_] = None
    ):
        self.cfg, self.side, self.device, self.cross_check = cfg, side, device, cross_check
        self.drop_ids: Optional[torch.Tensor] = None  # generate()'s: tokens a response cannot hold
        torch.manual_seed(cfg.seed)
        self.tokenizer, self.model = self.load(model_dir)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = self.model.to(device)
        if cfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model.config.use_cache = True
        if cfg.batch_invariant:
            self.use_mode()
        self.ref = None
        if cfg.kl_coef > 0:
            self.ref = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.autocast = (
            torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
        )
        if cfg.sampler == "torch":
            gen = torch.Generator(device=device)
            gen.manual_seed(cfg.seed)
            self.draw = torch_sampler(gen, cfg.temperature)
        elif cfg.sampler == "rl-kernel":
            self.draw = rl_kernel_sampler(cfg.temperature)
        else:
            raise ValueError(f"sampler must be 'torch' or 'rl-kernel', got {cfg.sampler!r}")

    def load(self, model_dir: Path):
        """``(tokenizer, fp32 model)`` from ``model_dir``."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        return (
            AutoTokenizer.from_pretrained(model_dir),
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        )

    def use_mode(self) -> None:
        """Make the policy's attention follow batch-invariant mode."""
        from rl_kernel_core.batch_invariant_mode.api_hf import use_mode_attention

        use_mode_attention(self.model)

    def prompt_text(self, problem: Problem) -> str:
        if self.tokenizer.chat_template:
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": problem.prompt}], tokenize=False, add_generation_prompt=True
            )
        return problem.prompt + "\n"

    def encode(self, problems: list) -> Prompts:
        """The left-padded prompts of ``problems`` (one row each), on the engine's device."""
        enc = self.tokenizer(
            [self.prompt_text(p) for p in problems],
            return_tensors="pt",
            padding=True,
            truncation=True,
            max_length=self.cfg.max_prompt_tokens,
            add_special_tokens=False,
        )
        return Prompts(enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device))

    def model_inputs(self, ro: Rollout, sl: slice) -> dict:
        """The policy's keyword arguments for rows ``sl`` of ``ro``'s prompts and responses."""
        attn = ro.attention_mask[sl]
        return {"input_ids": ro.input_ids[sl], "attention_mask": attn, "position_ids": positions(attn)}

    def score(self, text: str, problem) -> float:
        """The reward of response ``text`` to ``problem``."""
        return scoring.compute_score(text, problem.ground_truth, self.cfg.reward_method, self.cfg.format_score)

    def check(self, step: int, ro: Rollout) -> None:
        """Called after each rollout, before any log-prob or update; raises to stop the run (the
        text engine has nothing to check)."""

    def _batches(self, n: int):
        mb = self.cfg.micro_batch
        return [slice(i, min(i + mb, n)) for i in range(0, n, mb)]

    @torch.no_grad()
    def _recompute(self, model, ro: Rollout, side: Path_, with_entropy: bool = False):
        targets = ro.targets
        lps, ents = [], []
        for sl in self._batches(targets.shape[0]):
            with self.autocast:
                lp, ent = side.logprob(
                    model, self.model_inputs(ro, sl), targets[sl], self.cfg.temperature, with_entropy
                )
            lps.append(lp.float())
            ents.append(None if ent is None else ent.float())
        return (torch.cat(lps), torch.cat(ents)) if with_entropy else torch.cat(lps)

    @torch.no_grad()
    def _evaluate(self, side: Path_, ro: Rollout, advantages: torch.Tensor) -> dict:
        """``side``'s old log-probs, log-probs, entropy and loss on ``ro`` without a update."""
        old_lp = self._recompute(self.model, ro, side)
        ref_lp = None if self.ref is None else self._recompute(self.ref, ro, side)
        lp, entropy = self._recompute(self.model, ro, side, with_entropy=True)
        mask = ro.response_mask.bool()
        adv = advantages[:, None].expand_as(lp).float()
        loss, _ = side.loss(lp, old_lp, adv, mask, ref_lp=ref_lp, entropy=entropy, cfg=self.cfg, scale=1.0)
        return {"old_logprob": old_lp.cpu(), "logprob": lp.cpu(), "entropy": entropy.cpu(), "loss": float(loss)}

    def step(self, step: int, problems: list[Problem]) -> dict:
        """One GRPO step on ``problems``; returns the step's fields (the profiler adds timings)."""
        with rk.batch_invariant(self.cfg.batch_invariant):
            return self._step(step, problems)

    def _step(self, step: int, problems: list[Problem]) -> dict:
        cfg, side, dev = self.cfg, self.side, self.device
        g = cfg.group_size
        prompts = self.encode([p for p in problems for _ in range(g)])
        s = prompts.ids.shape[0]
        row_seeds = torch.tensor(
            [((cfg.seed * 1_000_003 + step) * 100_003 + i) % _SEED_MOD for i in range(s)], dtype=torch.int64, device=dev
        )

        self.model.eval()
        with profiling.region("rollout"), self.autocast:
            ro = generate(
                self.model,
                prompts.ids,
                prompts.mask,
                max_new_tokens=cfg.max_new_tokens,
                eos_id=self.tokenizer.eos_token_id,
                draw=self.draw,
                row_seeds=row_seeds,
                head_logprob=partial(_head_logprob, side.head, cfg.temperature) if cfg.batch_invariant else None,
                position_ids=prompts.position_ids,
                prompt_inputs=prompts.inputs,
                drop_ids=self.drop_ids,
            )
        ro.context = prompts.context
        self.check(step, ro)
        responses = self.tokenizer.batch_decode(
            [row[m.bool()].tolist() for row, m in zip(ro.response_ids.cpu(), ro.response_mask.cpu())],
            skip_special_tokens=True,
        )
        scores = [self.score(text, p) for text, p in zip(responses, (p for p in problems for _ in range(g)))]
        rewards = torch.tensor(scores, dtype=torch.float32, device=dev)
        advantages = side.advantages(rewards, g)
        equal = (rewards.view(-1, g) == rewards.view(-1, g)[:, :1]).all(-1)

        with profiling.region("old_logprob"):
            old_lp = self._recompute(self.model, ro, side)
        ref_lp = None
        if self.ref is not None:
            with profiling.region("ref_logprob"):
                ref_lp = self._recompute(self.ref, ro, side)

        # step 0 only: the other side's values on these samples and weights (a comparison; the
        # off side may not fit a micro-batch the on side fits, which is then recorded)
        cross = None
        if step == 0 and self.cross_check is not None:
            try:
                cross = self._evaluate(self.cross_check, ro, advantages)
            except torch.OutOfMemoryError as exc:
                cross = {"error": f"{self.cross_check.name} path out of memory: {str(exc).splitlines()[0]}"}

        self.model.train()
        mask = ro.response_mask.bool()
        total = mask.sum().clamp_min(1)
        targets = ro.targets
        metric_sums: dict[str, float] = {}
        first = {}
        for i, sl in enumerate(self._batches(s)):
            scale = float(mask[sl].sum() / total)
            adv = advantages[sl, None].expand_as(targets[sl]).float()
            with profiling.region("logprob"), self.autocast:
                lp, entropy = side.logprob(self.model, self.model_inputs(ro, sl), targets[sl], cfg.temperature, True)
            loss, metrics = side.loss(
                lp,
                old_lp[sl],
                adv,
                mask[sl],
                entropy=entropy,
                cfg=cfg,
                scale=scale,
                ref_lp=None if ref_lp is None else ref_lp[sl],
            )
            with profiling.region("backward"):
                loss.backward()
            for k, v in metrics.items():
                metric_sums[k] = metric_sums.get(k, 0.0) + float(v) * scale
            metric_sums["loss"] = metric_sums.get("loss", 0.0) + float(loss.detach())
            if step == 0:
                first.setdefault("logprob", []).append(lp.detach().float().cpu())
                first.setdefault("entropy", []).append(entropy.detach().float().cpu())
        with profiling.region("update"):
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

        n_resp = int(total)
        diff = (ro.rollout_logprob - old_lp).abs()[mask]
        fields = {
            "tokens": int(ro.attention_mask.sum()),
            "response_tokens": n_resp,
            "response_length": n_resp / s,
            "reward": float(rewards.mean()),
            "accuracy": float((rewards == 1.0).float().mean()),
            "logprob_diff": float(diff.mean()) if diff.numel() else 0.0,
            "logprob_diff_max": float(diff.max()) if diff.numel() else 0.0,
            "grad_norm": float(grad_norm),
            # the groups whose advantages differ in meaning off and on (a float residue vs 0)
            "equal_reward_groups": int(equal.sum()),
            "equal_reward_advantage_max": float(advantages.view(-1, g)[equal].abs().max())
            if bool(equal.any())
            else 0.0,
            **metric_sums,
        }
        if self.ref is None:
            fields.pop("kl_loss", None)
        else:
            fields["kl"] = fields["kl_loss"]
        if step == 0:
            fields["_first_step"] = {
                "response_ids": ro.response_ids.cpu(),
                "response_mask": ro.response_mask.cpu(),
                "old_logprob": old_lp.cpu(),
                "rollout_logprob": ro.rollout_logprob.cpu(),
                "logprob": torch.cat(first["logprob"]),
                "entropy": torch.cat(first["entropy"]),
                "loss": fields["loss"],
            }
            if cross is not None:
                fields["_first_step"]["cross_check"] = cross
        return fields


def _head_logprob(head: Callable, temperature: float, model, hidden, tokens):
    return head(model, hidden, tokens, temperature)


def problem_schedule(problems: list[Problem], cfg: GRPOConfig) -> list[list[Problem]]:
    """The problems of each step: a seeded shuffle, the same for the off and on runs."""
    order = list(range(len(problems)))
    random.Random(cfg.seed).shuffle(order)
    need = cfg.steps * cfg.prompts_per_step
    order = (order * (need // max(len(order), 1) + 1))[:need]
    return [
        [problems[i] for i in order[k * cfg.prompts_per_step : (k + 1) * cfg.prompts_per_step]]
        for k in range(cfg.steps)
    ]


class StepProgress:
    """The run's progress: a tqdm bar on a terminal (or a notebook), and on a stream that is not one
    (a log file, a pipe) plain lines instead of the bar's carriage-return frames, which pile up into
    one long line: the first step, about every tenth of the run (:data:`PLAIN_LINES` lines in
    all) and the last, each ``GRPO [side] step k/N: reward R, step_ms T``."""

    PLAIN_LINES = 10

    def __init__(self, desc: str, total: int, enabled: bool, stream: Any = None):
        from tqdm.auto import tqdm
        from tqdm.autonotebook import tqdm as notebook_tqdm

        self.stream = sys.stderr if stream is None else stream
        self.desc, self.total, self.done = desc, total, 0
        isatty = getattr(self.stream, "isatty", None)
        terminal = bool(isatty()) if callable(isatty) else False
        notebook = notebook_tqdm.__module__ == "tqdm.notebook"  # a widget there, no frames written
        self.bar = tqdm(
            total=total, desc=desc, unit="step", file=self.stream, disable=not (enabled and (terminal or notebook))
        )
        self.plain = enabled and not (terminal or notebook)
        self.every = max(1, -(-total // self.PLAIN_LINES))

    def step(self, **fields: str) -> None:
        """One step done; ``fields`` (name -> formatted value) are shown beside it."""
        self.done += 1
        self.bar.set_postfix(**fields)
        self.bar.update(1)
        if self.plain and (self.done == 1 or self.done % self.every == 0 or self.done == self.total):
            shown = ", ".join(f"{name} {value}" for name, value in fields.items())
            print(
                f"{self.desc} step {self.done}/{self.total}" + (f": {shown}" if shown else ""),
                file=self.stream,
                flush=True,
            )

    def close(self) -> None:
        self.bar.close()


def run(
    model_dir: Path,
    problems: list,
    cfg: GRPOConfig,
    side: Path_,
    log_path: Path,
    device: torch.device,
    progress: bool = True,
    cross_check: Optional[Path_] = None,
    engine_class: type = Engine,
) -> dict:
    """Train ``cfg.steps`` GRPO steps, one profiler record per step appended to ``log_path``.

    With ``cross_check`` (the other side), step 0 also evaluates that side's old log-probs,
    log-probs, entropy and loss on the same samples and weights, under ``first_step["cross_check"]``.

    A CUDA out-of-memory error ends the run early; it is recorded as a step with ``"oom": true``
    and the error text, and the function returns normally. Returns ``{"steps", "oom",
    "first_step"}`` where ``first_step`` holds step 0's tensors (samples, log-probs, entropy, loss).
    ``engine_class``: the :class:`Engine` (or a subclass, for another kind of model) to train with.
    """
    engine = engine_class(model_dir, cfg, side, device, cross_check)
    profiling.enable(str(log_path))
    first_step: Optional[dict] = None
    oom: Optional[str] = None
    schedule = problem_schedule(problems, cfg)
    bar = StepProgress(f"GRPO [{side.name}]", len(schedule), progress)
    try:
        for step, batch in enumerate(schedule):
            try:
                with profiling.region("step"):
                    fields = engine.step(step, batch)
            except torch.OutOfMemoryError as exc:
                oom = str(exc).splitlines()[0]
                engine.optimizer.zero_grad(set_to_none=True)
                profiling.step_end(step=step, oom=True, error=oom, backend=side.name)
                break
            first_step = fields.pop("_first_step", first_step)
            record = profiling.step_end(step=step, backend=side.name, **fields)
            bar.step(reward=f"{record['reward']:.3f}", step_ms=f"{record['regions']['step']:.0f}")
    finally:
        profiling.disable()
        bar.close()
    return {"steps": cfg.steps, "oom": oom, "first_step": first_step}
