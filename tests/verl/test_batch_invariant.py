"""The batch-invariant option (``rl_kernel_batch_invariant``) on verl's real FSDP2 engine: the
log-probs of the old-log-prob pass and of the training pass are, bit for bit, the rollout's
definition (the model under ``rl_kernel_core.batch_invariant`` with the mode's attention, its
logits in the model dtype, ``logprob_from_logits`` at the temperature), computed here one
sequence at a time as a reference; padded and packed (``use_remove_padding``) layouts alike,
entropy asked or not, over the tokenizer's ids when the tokenizer covers fewer than the model's;
tiny Qwen2 models tied and untied, and a tiny Qwen3-MoE (its sparse blocks run the mode's router,
experts and combine in verl's engine as in the rollout).
"""

from __future__ import annotations

import types

import pytest
import torch
from verl_cpu import (
    VOCAB,
    build_worker as build_uncached,
    engine_of,
    infer,
    random_rollout,
    to_engine_batch,
    update_actor,
)

import rl_kernel_core as rk
from rl_kernel_core.batch_invariant_mode.api_hf import use_mode_attention, use_row_parallel_split

BATCH_INVARIANT = "+actor_rollout_ref.model.fused_kernel_options.rl_kernel_batch_invariant=True"
PACKED = "actor_rollout_ref.model.use_remove_padding=True"
SPLIT = "+actor_rollout_ref.model.fused_kernel_options.rl_kernel_row_parallel_split=2"


def _reference(
    model_dir: str, rollout: dict, temperature: float, vocab_size: int = VOCAB, row_split: int = 1
) -> list[torch.Tensor]:
    """Per sequence, each token's log-prob of the next one (fp32), from the model alone in the
    mode: the definition vLLM's rollout returns under ``RL_KERNEL_VLLM_BATCH_INVARIANT=1`` (at tensor
    parallel size ``row_split``)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    use_mode_attention(model)
    use_row_parallel_split(model, row_split)
    out = []
    with torch.no_grad(), rk.batch_invariant():
        for ids, mask in zip(rollout["input_ids"], rollout["attention_mask"]):
            ids = ids[mask.bool()]
            logits = model(input_ids=ids[None], use_cache=False).logits[0, :-1]
            logits[:, vocab_size:] = float("-inf")
            out.append(rk.logprob_from_logits(logits, ids[1:], temperature=temperature))
    return out


def _per_sequence(values: torch.Tensor, rollout: dict) -> list[torch.Tensor]:
    """verl's per-token values packed over each sequence's real tokens -> per sequence, without the
    last token (whose label is the next sequence's first token)."""
    lengths = rollout["attention_mask"].sum(1).tolist()
    return [v[:-1] for v in values.split(lengths)]


def _log_probs(worker, rollout: dict, temperature: float, entropy: bool) -> torch.Tensor:
    from verl.utils import tensordict_utils as tu

    batch = to_engine_batch(rollout, calculate_entropy=entropy, compute_loss=False, temperature=temperature)
    return tu.get(worker.compute_log_prob(batch), "log_probs").values()


@pytest.mark.parametrize("model", ["tied", "untied", "moe"])
def test_old_log_prob_pass_is_the_rollout_definition_bitwise(build_worker, model_dirs, seed, model):
    padded = build_worker(model, "actor", BATCH_INVARIANT)
    packed = build_worker(model, "actor", BATCH_INVARIANT, PACKED)
    g = torch.Generator().manual_seed(seed)
    rollout = random_rollout(g, batch=6)
    temperature = float(torch.empty(()).uniform_(0.5, 1.5, generator=g))

    if model == "moe":  # the engine's sparse blocks run the mode's router, experts and combine
        blocks = [m for m in engine_of(padded).module.modules() if type(m).__name__ == "Qwen3MoeSparseMoeBlock"]
        assert len(blocks) == 2 and all(getattr(b, "_rl_kernel_mode_moe", False) for b in blocks), blocks
    lp, entropy, metrics = infer(padded, rollout, temperature)
    lp_packed, entropy_packed, _ = infer(packed, rollout, temperature)
    lp_alone = _log_probs(padded, rollout, temperature, entropy=False)

    for b, (got, want) in enumerate(
        zip(_per_sequence(lp, rollout), _reference(model_dirs[model], rollout, temperature))
    ):
        assert torch.equal(got, want), f"sequence {b}: verl's log-probs differ from the rollout definition"
    assert torch.equal(lp_packed, lp) and torch.equal(entropy_packed, entropy)
    assert torch.equal(lp_alone, lp)  # entropy asked or not: the same bits
    assert metrics["rl_kernel/batch_invariant"] == [1.0]
    assert any(k.startswith("rl_kernel/backend/logprob_from_logits/") for k in metrics)
    assert not rk.is_batch_invariant()  # the mode is on only inside the engine's calls


def test_training_pass_gives_the_old_log_prob_pass_bits(build_worker, seed):
    """``update_actor``'s forward (two sequences per micro-batch, autograd on) against the
    old-log-prob pass (all four at once): old/new ratio exactly 1, so ``ppo_kl``, the clip
    fractions and the KL loss to an identical reference are exactly 0."""
    from verl.workers.utils.padding import no_padding_2_padding
    from verl.utils import tensordict_utils as tu

    worker = build_worker(
        "untied", "actor", BATCH_INVARIANT, "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4"
    )
    g = torch.Generator().manual_seed(seed)
    rollout = random_rollout(g, batch=4)
    batch = to_engine_batch(rollout, calculate_entropy=False, compute_loss=False, temperature=0.7)
    current = no_padding_2_padding(tu.get(worker.compute_log_prob(batch), "log_probs"), to_engine_batch(rollout))
    per_token = {
        "old_log_probs": current,
        "ref_log_prob": current,
        "advantages": torch.randn(current.shape, generator=g),
    }
    metrics, _ = update_actor(worker, rollout, per_token, 0.7)
    for key in ("actor/ppo_kl", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "kl_loss"):
        assert metrics[key] == [0.0], (key, metrics[key])


def test_a_padded_forward_runs_packed_with_the_models_own_positions(model_dirs, seed):
    """The option's forward of a padded batch (``attention_mask [B, T]``) computes the real tokens
    packed; without ``position_ids`` it takes the positions the model would (0..T-1 per row): each
    right-padded sequence gets the bits it gets alone, and padding gets 0."""
    from transformers import AutoModelForCausalLM

    from rl_kernel_verl.forward import Request, _logits_logprob

    model = AutoModelForCausalLM.from_pretrained(model_dirs["untied"], dtype=torch.float32).eval()
    use_mode_attention(model)
    g = torch.Generator().manual_seed(seed)
    lengths = [7, 3, 5]
    ids = torch.randint(0, VOCAB, (len(lengths), max(lengths)), generator=g)
    mask = torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]
    labels = torch.roll(ids, -1, dims=1)
    with torch.no_grad(), rk.batch_invariant():
        lp, entropy = _logits_logprob(
            model, {"input_ids": ids, "attention_mask": mask.long()}, labels, 0.8, Request(return_entropy=False)
        )
        for b, n in enumerate(lengths):
            alone = model(input_ids=ids[b : b + 1, :n], use_cache=False).logits[0]
            assert torch.equal(lp[b, :n], rk.logprob_from_logits(alone, labels[b, :n], temperature=0.8)), (
                f"sequence {b}"
            )
    assert entropy is None and not lp[~mask].any()


def test_log_probs_normalise_over_the_tokenizers_ids(tmp_path, seed):
    """With a tokenizer shorter than the model's vocabulary, ids past it get probability 0, as
    verl's vLLM server gives them (``monkey_patch_compute_logits``)."""
    import verl_cpu
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    model_dir = verl_cpu.save_tiny_qwen2(str(tmp_path), tied=False, seed=seed % 1000)
    words = {f"w{i}": i for i in range(64)}
    PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="w0")), eos_token="w1", pad_token="w1"
    ).save_pretrained(model_dir)
    worker = build_uncached(model_dir, "actor", BATCH_INVARIANT, "+actor_rollout_ref.model.load_tokenizer=True")
    engine = engine_of(worker)
    ids = len(engine.model_config.tokenizer)  # what verl's vLLM server masks past (a Qwen2 tokenizer adds one)
    assert ids < VOCAB and engine._rl_kernel.vocab_size == ids
    g = torch.Generator().manual_seed(seed)
    rollout = random_rollout(g)
    for key in ("input_ids", "prompts", "responses"):
        rollout[key] = rollout[key] % ids
    lp, entropy, _ = infer(worker, rollout, 1.0)
    for got, want in zip(_per_sequence(lp, rollout), _reference(model_dir, rollout, 1.0, vocab_size=ids)):
        assert torch.equal(got, want)
    whole = _reference(model_dir, rollout, 1.0)
    assert all((a > b).all() for a, b in zip(_per_sequence(lp, rollout), whole))  # the masked ids held mass
    assert torch.isfinite(entropy).all()


def test_row_parallel_split_gives_a_tp2_rollouts_definition(build_worker, model_dirs, seed):
    """``rl_kernel_row_parallel_split=2``: verl's old-log-prob pass gives, bit for bit, the log-probs
    of the model whose o_proj/down_proj are two ranks' sum (what a TP=2 vLLM rollout computes under
    the mode), not the unsplit model's."""
    worker = build_worker("untied", "actor", BATCH_INVARIANT, SPLIT)
    assert engine_of(worker)._rl_kernel.row_split == 2
    g = torch.Generator().manual_seed(seed)
    rollout = random_rollout(g)
    lp, _, _ = infer(worker, rollout, 0.9)
    got = _per_sequence(lp, rollout)
    split = _reference(model_dirs["untied"], rollout, 0.9, row_split=2)
    for b, (a, want) in enumerate(zip(got, split)):
        assert torch.equal(a, want), f"sequence {b}: verl's log-probs differ from the TP=2 definition"
    whole = _reference(model_dirs["untied"], rollout, 0.9)
    assert not all(torch.equal(a, w) for a, w in zip(got, whole))


def test_row_parallel_split_needs_the_mode_and_a_positive_size():
    from rl_kernel_verl import switch

    for n in (2, 4):
        with pytest.raises(
            ValueError, match=f"rl_kernel_row_parallel_split={n} reproduces a TP={n} rollout bit for bit only"
        ):
            switch.read({"fused_kernel_options": {"use_rl_kernel_backend": True, "rl_kernel_row_parallel_split": n}})
        assert (
            switch.read(
                {"fused_kernel_options": {"rl_kernel_batch_invariant": True, "rl_kernel_row_parallel_split": n}}
            ).row_split
            == n
        )
    for bad in (0, -4):
        with pytest.raises(ValueError, match=f"rl_kernel_row_parallel_split must be an integer >= 1 .*got {bad}"):
            switch.read(
                {"fused_kernel_options": {"rl_kernel_batch_invariant": True, "rl_kernel_row_parallel_split": bad}}
            )


@pytest.mark.parametrize("value", [2.0, 1.0, True, "2", [2], None])
def test_row_parallel_split_must_be_an_int(value):
    """``2.0`` equals 2, so ``in (1, 2)`` let it through and the first forward failed slicing with
    it; it is refused up front, naming the option, the value and its type."""
    from rl_kernel_verl import switch

    with pytest.raises(ValueError) as info:
        switch.read(
            {"fused_kernel_options": {"rl_kernel_batch_invariant": True, "rl_kernel_row_parallel_split": value}}
        )
    message = str(info.value)
    assert message.startswith("fused_kernel_options.rl_kernel_row_parallel_split must be an integer >= 1")
    assert message.endswith(f"got {value!r} ({type(value).__name__})") and "\n" not in message, message


def test_a_fallback_is_an_error(build_worker, seed):
    worker = build_worker("tied", "actor", BATCH_INVARIANT)
    rollout = random_rollout(torch.Generator().manual_seed(seed))
    rollout["temperature"] = torch.empty(rollout["input_ids"].shape[0]).uniform_(0.5, 1.5)
    with pytest.raises(RuntimeError, match="rl_kernel_batch_invariant is set but per-sample temperature tensors"):
        infer(worker, rollout, None)


def test_sequence_parallelism_is_refused():
    from rl_kernel_verl import engine

    assert engine._batch_invariant_reason(types.SimpleNamespace(ulysses_sequence_parallel_size=1)) is None
    reason = engine._batch_invariant_reason(types.SimpleNamespace(ulysses_sequence_parallel_size=2))
    assert reason is not None and "ulysses_sequence_parallel_size=2" in reason
