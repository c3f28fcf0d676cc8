"""verl 0.9.1's real FSDP engine on CPU: the set-up the verl adapter tests share.

Imported by ``conftest.py`` (pytest) and by ``fsdp2_two_ranks.py`` (a ``torch.distributed.run``
script), before anything picks verl's device platform:

* ``VERL_PLATFORM=cpu`` with the CPU platform of ``recipes/grpo/verl_cpu.py`` registered in
  verl's ``PlatformRegistry``, and ``VERL_ENGINE_DEVICE=cuda`` so ``EngineRegistry`` hands out
  the FSDP engine verl registers for CUDA;
* tiny random Qwen2 models (tied and untied embeddings) built from a config with transformers and
  saved to a directory: no hub download, no tokenizer (``load_tokenizer=False``);
* verl's own Hydra config (``ppo_trainer``) composed with overrides: fp32, sdpa attention, no
  remove-padding, no torch.compile.

Workers are verl's ``ActorRolloutRefWorker`` (role ``actor`` or ``ref``) called directly, so the
path is verl's: ``init_model`` → ``TrainingWorker`` → ``EngineRegistry.new`` → ``FSDPEngineWithLMHead``,
and ``compute_log_prob`` / ``compute_ref_log_prob`` / ``update_actor`` → ``infer_batch`` /
``train_batch``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

os.environ["VERL_PLATFORM"] = "cpu"
os.environ["VERL_ENGINE_DEVICE"] = "cuda"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VERL_LOGGING_LEVEL", "WARN")

import verl  # noqa: E402,F401

# verl's loader imports the verl.plugins entry points at the end of `import verl`; nothing before
# this line imported rl_kernel_verl, so this records whether verl loaded the plugin.
LOADED_BY_VERL = "rl_kernel_verl" in sys.modules

import torch  # noqa: E402

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "recipes")
)
from grpo import verl_cpu as cpu_platform  # noqa: E402,F401  (registers verl's CPU platform, unpinned offload)

VOCAB = 96
BASE_OVERRIDES = (
    "actor_rollout_ref.model.use_remove_padding=False",
    "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
    "+actor_rollout_ref.model.load_tokenizer=False",
    "actor_rollout_ref.model.enable_gradient_checkpointing=False",
    "actor_rollout_ref.actor.strategy=fsdp2",
    "actor_rollout_ref.actor.use_torch_compile=False",
    "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
    "actor_rollout_ref.ref.fsdp_config.use_torch_compile=False",
    "+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
    "+actor_rollout_ref.ref.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.n=1",
    "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_coef=0.1",
    "actor_rollout_ref.actor.entropy_coeff=0.01",
    "actor_rollout_ref.actor.clip_ratio_c=3.0",
    "actor_rollout_ref.actor.optim.lr=0.0",  # gradients are compared; the weights stay as saved
)
SWITCH_ON = "+actor_rollout_ref.model.fused_kernel_options.use_rl_kernel_backend=True"


TINY: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=64
)
"""What the tiny models share."""


def save_tiny_qwen2(path: str, *, tied: bool, seed: int = 0) -> str:
    """A tiny random Qwen2 causal LM (vocab 96, hidden 64, 2 layers) saved to ``path``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**TINY, num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)
    return _save_random(Qwen2ForCausalLM, config, path, seed)


def save_tiny_qwen3_moe(path: str, *, seed: int = 0) -> str:
    """A tiny random Qwen3-MoE causal LM (vocab 96, hidden 64, 2 layers of 8 experts, top-2,
    renormalised; its routers spread like the head) saved to ``path``."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    experts: dict[str, Any] = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    attention: dict[str, Any] = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    config = Qwen3MoeConfig(**TINY, **attention, **experts, tie_word_embeddings=False)
    return _save_random(Qwen3MoeForCausalLM, config, path, seed)


def _save_random(model_class, config, path: str, seed: int) -> str:
    torch.manual_seed(seed)
    model = model_class(config)
    with torch.no_grad():  # spread the head (and MoE routers) so log-probs, gradients and routing vary by token
        model.lm_head.weight.normal_(0.0, 0.5)
        for module in model.modules():
            if type(module).__name__ == "Qwen3MoeTopKRouter":
                module.weight.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return path


def compose_config(model_dir: str, *overrides: str):
    """verl's ``ppo_trainer`` Hydra config with the CPU test overrides, then ``overrides`` (which win)."""
    from hydra import compose, initialize_config_dir
    import verl.trainer.config as trainer_config

    def key(override: str) -> str:
        return override.split("=", 1)[0].lstrip("+~")

    replaced = {key(o) for o in overrides}
    base = [o for o in BASE_OVERRIDES if key(o) not in replaced]
    with initialize_config_dir(config_dir=os.path.dirname(trainer_config.__file__), version_base=None):
        return compose(
            config_name="ppo_trainer", overrides=[f"actor_rollout_ref.model.path={model_dir}", *base, *overrides]
        )


def build_worker(model_dir: str, role: str, *overrides: str):
    """An initialised verl ``ActorRolloutRefWorker`` for ``role`` on the model in ``model_dir``."""
    from verl.workers.engine_workers import ActorRolloutRefWorker

    config = compose_config(model_dir, *overrides)
    worker = ActorRolloutRefWorker(config=config.actor_rollout_ref, role=role)
    worker.init_model()
    return worker


def engine_of(worker):
    """The verl engine inside a worker (actor's, else ref's)."""
    return worker.actor.engine if worker.actor is not None else worker.ref.engine


def random_rollout(generator: torch.Generator, batch: int = 4, prompt: int = 5, response: int = 6) -> dict:
    """A padded rollout batch as verl's trainer holds it: left-padded prompts, right-padded responses.

    Lengths and token ids are random (every prompt and response non-empty).
    """
    from rl_kernel_verl.rollout import padded_rollout

    prompt_len = torch.randint(1, prompt + 1, (batch,), generator=generator)
    response_len = torch.randint(1, response + 1, (batch,), generator=generator)
    response_len[0] = response  # at least one full-length response
    prompts = torch.randint(0, VOCAB, (batch, prompt), generator=generator)
    responses = torch.randint(0, VOCAB, (batch, response), generator=generator)
    return padded_rollout(prompts, responses, prompt_len, response_len)


def to_engine_batch(tensors: dict, **meta):
    """verl's no-padding TensorDict for a worker call (``left_right_2_no_padding``) plus ``meta``."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    td = tu.get_tensordict({k: v.clone() for k, v in tensors.items()})
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(td, **meta)
    return td


def infer(worker, rollout: dict, temperature, ref: bool = False):
    """``compute_log_prob`` (or ``compute_ref_log_prob``) on ``rollout``.

    ``temperature``: a float, or None when ``rollout`` carries a per-sample ``temperature`` tensor.
    Returns ``(log_probs, entropy or None, metrics)``, the per-token values packed over prompt +
    response as verl returns them.
    """
    from verl.utils import tensordict_utils as tu

    meta = {} if temperature is None else {"temperature": temperature}
    batch = to_engine_batch(rollout, calculate_entropy=not ref, compute_loss=False, **meta)
    out = worker.compute_ref_log_prob(batch) if ref else worker.compute_log_prob(batch)
    entropy = None if ref else tu.get(out, "entropy").values()
    return tu.get(out, "log_probs").values(), entropy, tu.get(out, "metrics")


def policy_inputs(worker, rollout: dict, temperature: float, generator: torch.Generator) -> dict:
    """``old_log_probs``, ``advantages``, ``ref_log_prob`` ``[bsz, response_len]`` for ``rollout``.

    Near the worker's current log-probs, so that some tokens are clipped (row 0's third token at
    least: ratio e^1 with a positive advantage), some dual-clipped (row 0's first two: ratio
    e^1.5 > clip_ratio_c with negative advantages) and the KL is small. Row 0's response is full
    length (:func:`random_rollout`), so those tokens count whatever the seed.
    """
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    batch = to_engine_batch(rollout, calculate_entropy=False, compute_loss=False, temperature=temperature)
    current = no_padding_2_padding(tu.get(worker.compute_log_prob(batch), "log_probs"), to_engine_batch(rollout))
    shift = 0.5 * torch.randn(current.shape, generator=generator)
    shift[0, :2] = -1.5
    shift[0, 2] = -1.0
    advantages = torch.randn(current.shape, generator=generator)
    advantages[0, :2] = -advantages[0, :2].abs()
    advantages[0, 2] = advantages[0, 2].abs()
    return {
        "old_log_probs": current + shift,
        "advantages": advantages,
        "ref_log_prob": current + 0.2 * torch.randn(current.shape, generator=generator),
    }


def update_actor(worker, rollout: dict, per_token: dict, temperature: float, world_size: int = 1):
    """One ``update_actor`` (one mini-batch, one optimizer step) on this rank's ``rollout``.

    Returns ``(metrics, grads)``: verl's metrics and every parameter's full gradient as it was
    before the optimizer step (verl zeroes gradients when train mode exits).
    """
    from torch.distributed.tensor import DTensor
    from verl.utils import tensordict_utils as tu

    global_batch = rollout["input_ids"].shape[0] * world_size
    batch = to_engine_batch(
        {**rollout, **per_token},
        calculate_entropy=True,
        compute_loss=True,
        temperature=temperature,
        global_batch_size=global_batch,
        mini_batch_size=global_batch,
        epochs=1,
        seed=1,
        dataloader_kwargs={"shuffle": False},
    )
    engine = engine_of(worker)
    grads = {}

    def capture_then_step():
        for name, p in engine.module.named_parameters():
            grads[name] = (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
        return type(engine).optimizer_step(engine)

    engine.optimizer_step = capture_then_step
    try:
        metrics = tu.get(worker.update_actor(batch), "metrics")
    finally:
        del engine.optimizer_step
    return metrics, grads
