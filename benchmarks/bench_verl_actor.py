"""verl's FSDP2 actor on one device: verl's default head, verl's fused kernels and rl-kernel's switch.

One process, world size 1 (nccl on CUDA, gloo on CPU with verl's CPU platform from
``recipes/grpo/verl_cpu.py``). A random-weight Qwen3 or Qwen3-MoE checkpoint at the chosen shapes
(``make_random_model.write_random_model``, bf16 weights; ``qwen3-30b-a3b-8l``: Qwen3-30B-A3B's widths
at 8 layers) is loaded by verl's own
``ActorRolloutRefWorker`` from verl's ``ppo_trainer`` Hydra config, as ``main_ppo`` builds it:
FSDP2, bf16 mixed precision (verl's default), gradient checkpointing, no tokenizer. Per layout

* ``packed``: ``use_remove_padding=True`` with dynamic batch size (``--max-token-len`` tokens per
  micro-batch), what verl's GRPO examples run;
* ``padded``: ``use_remove_padding=False``, fixed micro-batches of ``--micro-batch-size``
  sequences (default: the largest divisor of the batch with at most ``--max-token-len`` tokens);

and per variant

* ``verl_default``: verl as shipped (logits, ``log_softmax``, verl's ``ppo_loss``);
* ``verl_fused_triton``: ``use_fused_kernels=True`` with ``fused_kernel_options.impl_backend=triton``
  (verl's Triton linear cross-entropy);
* ``rl_kernel``: ``+actor_rollout_ref.model.fused_kernel_options.use_rl_kernel_backend=True``;
* ``rl_kernel_batch_invariant``: ``+actor_rollout_ref.model.fused_kernel_options.rl_kernel_batch_invariant=True``
  (the backend in rl-kernel's batch-invariant mode: the trainer's side of rollout = training;
  its ``update_mode_cost`` in the summary is its ``update_actor`` time over ``rl_kernel``'s);

it times ``compute_log_prob`` (the old-log-prob pass; the reference pass is the same computation
on a forward-only engine) and ``update_actor`` (one mini-batch of the whole batch, one optimizer
step) over one GRPO batch: ``--prompts`` prompts x ``--samples`` responses, prompts of
``prompt-len/2..prompt-len`` tokens shared by their group, responses of ``response-len/4..
response-len`` tokens (one per group full length), random token ids, GRPO advantages
(``rl_kernel_core.group_advantages``) of random 0/1 rewards, old log-probs = the default variant's
log-probs plus N(0, 0.1^2) noise (so the clip acts on some tokens), reference log-probs likewise,
KL loss ``low_var_kl`` 0.001, entropy coefficient 0 (verl's GRPO example settings).

Timing (bf16): a first call of each op (warm-up: compilation, autotuning, allocator growth), then
``--warmup`` more, then the median of ``--reps`` calls (CUDA events on GPU, wall clock on CPU), then
one call for memory: ``torch.cuda.max_memory_allocated`` during it minus the memory allocated
before it (null on CPU). Times include verl's host-side packing of the batch, as in training.

Checks: a separate worker per variant and layout with fp32 compute (verl's
``fsdp_config.mixed_precision`` all fp32) on the first ``--check-prompts`` prompts' groups, against
``verl_default``'s, with ``rl_kernel_core.contract``'s fp32 rows as the CPU tier's tests: response
log-probs and entropies (``logprob``), ``update_actor``'s loss metrics and grad norm
(``reduction``) and every parameter's gradient before the optimizer step (``gradient``). Not in
bf16: verl's bf16 path without flash-attn takes log-probs from a bf16 ``log_softmax``
(``logprobs_from_logits_v2``), already outside the bf16 contract. For ``rl_kernel`` the adapter's
``status()`` must show its hooks live and every micro-batch served by rl-kernel, in both runs; for
the others no engine is hooked and no ``rl_kernel/`` metric appears.

``--max-microbatch``: for each variant, ``update_actor`` with its micro-batch doubled until CUDA
runs out of memory, or until one micro-batch holds the whole batch; the largest that ran is
recorded, in tokens per micro-batch, with the number of micro-batches each step ran (the proof
that the setting took effect) and its peak extra memory. ``--search-layout padded`` (the default) doubles the sequences
per micro-batch; ``packed`` doubles ``max_token_len_per_gpu``. The default is padded because with
``sdpa`` transformers attends over a packed micro-batch through an ``N x N`` mask (the sequences
found from the position ids), whose memory would decide the search at large N.

``--profile TOP``: after timing, one more ``compute_log_prob`` and ``update_actor`` per variant
under ``torch.profiler``, recording the TOP operators and kernels by self device time (kernel
names carry their dtype), to find where a slow path spends its time.

A variant that cannot run here (verl's Triton kernels without Triton, say) is recorded as
unavailable with its error; nothing is substituted for it. Results go to
``<out>/bench_verl_actor_<shape>_<parts>.json`` (``<parts>`` ending in ``-<variant>`` when
``--variants`` names one), rewritten after every measurement.

    python benchmarks/bench_verl_actor.py --model-shape qwen3-1.7b --out benchmarks/results --max-microbatch
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from make_random_model import PRESETS, architecture, write_random_model  # noqa: E402

from rl_kernel_core import contract  # noqa: E402
from rl_kernel_core.tools import bench  # noqa: E402

VARIANTS: dict[str, tuple[str, ...]] = {
    "verl_default": (),
    "verl_fused_triton": (
        "actor_rollout_ref.model.use_fused_kernels=True",
        "actor_rollout_ref.model.fused_kernel_options.impl_backend=triton",
    ),
    "rl_kernel": ("+actor_rollout_ref.model.fused_kernel_options.use_rl_kernel_backend=True",),
    "rl_kernel_batch_invariant": ("+actor_rollout_ref.model.fused_kernel_options.rl_kernel_batch_invariant=True",),
}
HOOKED = ("rl_kernel", "rl_kernel_batch_invariant")  # the variants whose engines rl-kernel's adapter hooks
BASELINE = "verl_default"
LAYOUTS = ("packed", "padded")
FP32 = "+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}"
LOSS_METRICS = ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower", "kl_loss", "loss")
TEMPERATURE = 1.0


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--model-shape",
        choices=sorted(PRESETS),
        default="qwen3-0.6b",
        help="shapes of the random model (Qwen3, or Qwen3-MoE for the presets with experts)",
    )
    p.add_argument("--model-dir", help="where to write (or reuse) the random checkpoint; default a temporary directory")
    p.add_argument("--out", default=os.environ.get("OUT", os.path.join(HERE, "results")), help="directory of the JSON")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {list(VARIANTS)}; {BASELINE} first")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma list of {list(LAYOUTS)}, or 'none'")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--samples", type=int, default=8, help="responses per prompt (rollout.n)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--response-len", type=int, default=512)
    p.add_argument("--max-token-len", type=int, default=16384, help="tokens per micro-batch (dynamic batch size)")
    p.add_argument("--micro-batch-size", type=int, help="sequences per micro-batch of the padded layout")
    p.add_argument(
        "--attn-implementation", default="sdpa", help="the model's attention (flash_attention_2 needs flash-attn)"
    )
    p.add_argument("--warmup", type=int, default=0, help="calls after the check call, before timing")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument(
        "--max-microbatch", action="store_true", help="search the largest micro-batch each variant fits (CUDA)"
    )
    p.add_argument("--max-microbatch-limit", type=int, default=1 << 20, help="stop doubling past this many tokens")
    p.add_argument(
        "--search-layout",
        choices=LAYOUTS,
        default="padded",
        help="layout of the search (padded: sdpa over a packed micro-batch masks N x N, which would dominate)",
    )
    p.add_argument(
        "--check-prompts", type=int, default=2, help="prompts (with their samples) of the fp32 check run; 0: none"
    )
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="TOP",
        help="after timing, profile one compute_log_prob and one update_actor call per variant and record "
        "the TOP operators and kernels by self device time (self CPU time on CPU); 0: no profile",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.profile < 0:
        p.error(f"--profile must be >= 0, got {args.profile}")
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown or not args.variants or (args.check_prompts and args.variants[0] != BASELINE):
        raise SystemExit(
            f"--variants: expected a comma list of {list(VARIANTS)}, starting with {BASELINE} unless "
            f"--check-prompts is 0 (the checks compare against it), got {','.join(args.variants) or 'nothing'}"
        )
    # verl's use_fused_kernels patches the model class's forward for the whole process
    # (monkey_patch.patch_forward_with_backends), so no variant may be built after it
    args.variants.sort(key=lambda v: v == "verl_fused_triton")
    args.layouts = [] if args.layouts == "none" else [x for x in args.layouts.split(",") if x]
    if [x for x in args.layouts if x not in LAYOUTS]:
        raise SystemExit(f"--layouts: expected a comma list of {list(LAYOUTS)} or 'none', got {','.join(args.layouts)}")
    for name in ("prompts", "samples", "prompt_len", "response_len", "max_token_len", "reps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
    if not 0 <= args.check_prompts <= args.prompts:
        raise SystemExit(f"--check-prompts: expected 0..--prompts ({args.prompts}), got {args.check_prompts}")
    if args.warmup < 0:
        raise SystemExit(f"--warmup: expected >= 0, got {args.warmup}")
    seq = args.prompt_len + args.response_len
    if args.max_token_len < seq:
        raise SystemExit(f"--max-token-len: expected >= prompt-len + response-len = {seq}, got {args.max_token_len}")
    n = args.prompts * args.samples
    if args.micro_batch_size is None:
        fits = max(1, args.max_token_len // seq)
        args.micro_batch_size = max(d for d in range(1, n + 1) if n % d == 0 and d <= fits)
    elif args.micro_batch_size < 1 or n % args.micro_batch_size:
        raise SystemExit(
            f"--micro-batch-size: expected a divisor of prompts x samples = {n}, got {args.micro_batch_size}"
        )
    if args.max_microbatch and args.device != "cuda":
        raise SystemExit("--max-microbatch: runs until CUDA runs out of memory; expected --device cuda, got cpu")
    return args


# -- verl set-up ------------------------------------------------------------------------------


def import_verl(device: str) -> dict[str, Any]:
    """Import verl (and, on CPU, register verl's CPU platform before verl picks one); then the
    adapter. Returns how the adapter was loaded."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VERL_LOGGING_LEVEL", "WARN")
    if device == "cpu":
        os.environ.update(VERL_PLATFORM="cpu", VERL_ENGINE_DEVICE="cuda")
    import verl  # noqa: F401

    loaded_by_verl = "rl_kernel_verl" in sys.modules  # verl imports its verl.plugins entry points
    if device == "cpu":
        sys.path.insert(0, os.path.join(REPO, "recipes"))
        from grpo import verl_cpu  # noqa: F401  (the CPU platform; unpinned offload)
    import rl_kernel_verl  # (registers when verl did not load it: an install without entry points)

    from rl_kernel_verl.switch import BATCH_INVARIANT_OVERRIDE

    for variant, switch in (
        ("rl_kernel", rl_kernel_verl.OVERRIDE),
        ("rl_kernel_batch_invariant", BATCH_INVARIANT_OVERRIDE),
    ):
        if VARIANTS[variant] != (switch,):
            raise RuntimeError(f"the {variant} variant's override {VARIANTS[variant]} is not the switch {switch}")
    return {"loaded_by_verl_entry_point": loaded_by_verl}


def init_process_group(device: str) -> None:
    """World size 1, the environment verl's ``Worker`` reads, nccl on CUDA and gloo on CPU (a
    process group of world size 1 that exists already, a test's, is used as it is)."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError(
                f"bench_verl_actor runs in one process: expected world size 1, got {dist.get_world_size()}"
            )
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    os.environ.update(
        WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port
    )
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
    )


def overrides(args: argparse.Namespace, model_dir: str, layout: str, variant: str) -> list[str]:
    """The Hydra overrides of ``verl.trainer.main_ppo`` for this run (verl's defaults elsewhere)."""
    packed = layout == "packed"
    out = [
        f"actor_rollout_ref.model.path={model_dir}",
        "+actor_rollout_ref.model.load_tokenizer=False",
        f"+actor_rollout_ref.model.override_config.attn_implementation={args.attn_implementation}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        f"actor_rollout_ref.model.use_remove_padding={packed}",
        "actor_rollout_ref.actor.strategy=fsdp2",
        f"actor_rollout_ref.actor.use_dynamic_bsz={packed}",
        f"actor_rollout_ref.rollout.log_prob_use_dynamic_bsz={packed}",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={args.max_token_len}",
        f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={args.max_token_len}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro_batch_size}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={args.micro_batch_size}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        f"actor_rollout_ref.rollout.n={args.samples}",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.entropy_coeff=0",
    ]
    if args.device == "cpu":  # torch.compile on CPU needs a C++ toolchain and minutes; the GPU keeps verl's default
        out += [
            "actor_rollout_ref.actor.use_torch_compile=False",
            "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
        ]
    return out + list(VARIANTS[variant])


def build_worker(config_overrides: list[str]):
    """verl's ``ActorRolloutRefWorker`` (role ``actor``) from ``ppo_trainer`` with ``config_overrides``."""
    from hydra import compose, initialize_config_dir
    import verl.trainer.config as trainer_config
    from verl.workers.engine_workers import ActorRolloutRefWorker

    with initialize_config_dir(config_dir=os.path.dirname(trainer_config.__file__), version_base=None):
        config = compose(config_name="ppo_trainer", overrides=config_overrides)
    worker = ActorRolloutRefWorker(config=config.actor_rollout_ref, role="actor")
    worker.init_model()
    return worker


# -- the GRPO batch -----------------------------------------------------------------------------


def grpo_batch(args: argparse.Namespace, vocab: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A padded rollout batch as verl's trainer holds it (CPU tensors, left-padded prompts,
    right-padded responses), plus ``advantages`` ``[B, response_len]`` (GRPO, random 0/1 rewards)."""
    from rl_kernel_core import group_advantages
    from rl_kernel_verl.rollout import padded_rollout

    p, r, g = args.prompt_len, args.response_len, args.samples
    prompt_len = torch.randint(max(1, p // 2), p + 1, (args.prompts,), generator=gen).repeat_interleave(g)
    response_len = torch.randint(max(1, r // 4), r + 1, (args.prompts, g), generator=gen)
    response_len[:, 0] = r
    prompts = torch.randint(0, vocab, (args.prompts, p), generator=gen).repeat_interleave(g, dim=0)
    responses = torch.randint(0, vocab, (args.prompts * g, r), generator=gen)
    batch = padded_rollout(prompts, responses, prompt_len, response_len.flatten())
    rewards = torch.randint(0, 2, (args.prompts * g,), generator=gen).float()
    batch["advantages"] = group_advantages(rewards, group_size=g)[:, None] * batch["response_mask"]
    return batch


def engine_batch(tensors: dict[str, torch.Tensor], **meta: Any):
    """verl's no-padding TensorDict of ``tensors`` with ``meta``, as the trainer sends a worker."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    td = left_right_2_no_padding(tu.get_tensordict({k: v.clone() for k, v in tensors.items()}))
    tu.assign_non_tensor(td, **meta)
    return td


def log_prob_call(worker, batch: dict[str, torch.Tensor]) -> Callable[[], Any]:
    """One ``compute_log_prob`` with the trainer's old-log-prob meta."""
    meta = dict(calculate_entropy=True, calculate_sum_pi_squared=False, compute_loss=False, temperature=TEMPERATURE)
    return lambda: worker.compute_log_prob(engine_batch(batch, **meta))


def update_call(worker, batch: dict[str, torch.Tensor], **extra_meta: Any) -> Callable[[], Any]:
    """One ``update_actor`` with the trainer's meta: the whole batch is one mini-batch."""
    n = batch["input_ids"].shape[0]
    meta = dict(
        calculate_entropy=False,
        distillation_use_topk=False,
        distillation_only=False,
        global_batch_size=n,
        mini_batch_size=n,
        epochs=1,
        seed=1,
        dataloader_kwargs={"shuffle": False},
        compute_loss=True,
        temperature=TEMPERATURE,
        **extra_meta,
    )
    return lambda: worker.update_actor(engine_batch(batch, **meta))


class MicroBatchCounter:
    """Counts the micro-batches the worker's engine runs (its ``forward_step`` calls, through an
    adapter's hook if there is one) from now on, for the worker's remaining life: proof that a
    search step's micro-batch setting took effect."""

    def __init__(self, worker) -> None:
        engine = worker.actor.engine
        inner = engine.forward_step
        self.count = 0

        def forward_step(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return inner(*args, **kwargs)

        engine.forward_step = forward_step

    def take(self) -> int:
        """The count since the last take."""
        count, self.count = self.count, 0
        return count


def response_values(out, batch: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    """``out[key]`` at the response tokens, ``[tokens]`` fp32 on CPU."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    padded = no_padding_2_padding(tu.get(out, key), engine_batch(batch))
    return padded.float().cpu()[batch["response_mask"].bool()]


def update_with_grads(worker, batch: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """``update_actor`` once; returns verl's metrics and every parameter's full gradient (fp32, CPU)
    as it was before the optimizer step (verl zeroes gradients when train mode exits)."""
    from torch.distributed.tensor import DTensor
    from verl.utils import tensordict_utils as tu

    engine = worker.actor.engine
    grads: dict[str, torch.Tensor] = {}

    def capture_then_step():
        for name, p in engine.module.named_parameters():
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            grads[name] = g.float().cpu()
        return type(engine).optimizer_step(engine)

    engine.optimizer_step = capture_then_step
    try:
        metrics = tu.get(update_call(worker, batch)(), "metrics")
    finally:
        del engine.optimizer_step
    return metrics, grads


# -- checks ---------------------------------------------------------------------------------


def check_gradients(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Every parameter's gradient against the baseline's (``gradient``, fp32): the worst one and
    the failures."""
    if got.keys() != want.keys():
        return {"within_contract": False, "error": f"parameters differ: {sorted(got.keys() ^ want.keys())[:5]}"}
    rows = {
        name: contract.verdict(got[name], want[name], "gradient", torch.float32, name=f"grad {name}") for name in want
    }
    worst = max(rows, key=lambda k: rows[k]["worst_fraction"])
    failures = [r["error"] for r in rows.values() if not r["within_contract"]]
    return {
        "within_contract": not failures,
        "parameters": len(rows),
        "worst": {"parameter": worst, **rows[worst]},
        "failures": failures[:5],
    }


def hooks_report(worker, variant: str, metric_keys: list[str]) -> dict[str, Any]:
    """The adapter's ``status()`` for this engine: live hooks (in the mode or not, as the variant
    asks) for the :data:`HOOKED` variants, none otherwise."""
    import rl_kernel_verl

    engine = worker.actor.engine
    status = rl_kernel_verl.status()
    mine = [e for e in status["engines"] if e["engine"] == f"{type(engine).__name__}@{id(engine):#x}"]
    ours = sorted(k for k in metric_keys if k.startswith("rl_kernel/"))
    if variant not in HOOKED:
        return {
            "probe": status["probe"],
            "engine_hooked": bool(mine),
            "rl_kernel_metrics": ours,
            "ok": not mine and not ours and status["probe"] == "live",
        }
    entry = mine[0] if mine else None
    ok = (
        entry is not None
        and status["probe"] == "live"
        and entry["forward"] == "live"
        and set(entry["hooks"].values()) == {"live"}
        and entry["micro_batches_served"] > 0
        and not entry["micro_batches_on_verl_path"]
        and entry["batch_invariant"] == (variant == "rl_kernel_batch_invariant")
    )
    return {"probe": status["probe"], "engine": entry, "rl_kernel_metrics": ours, "ok": ok}


# -- measuring --------------------------------------------------------------------------------


class Recorder:
    """The result document, rewritten after every measurement (a cut-off run keeps what it measured)."""

    def __init__(self, path: str, doc: dict) -> None:
        self.path, self.doc = path, doc
        self.flush()

    def flush(self) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "w", encoding="utf-8") as f:
            json.dump(self.doc, f, indent=1)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(fn: Callable[[], Any], device: torch.device, args: argparse.Namespace, tokens: int) -> dict[str, Any]:
    """Median time of ``fn`` (after ``--warmup`` calls) and the peak extra memory of one more call."""
    row: dict[str, Any] = dict(bench.time_ms(fn, device, warmup=args.warmup, reps=args.reps))
    row["tokens_per_s"] = tokens / (row["median_ms"] / 1e3)
    row["peak_extra_gib"] = bench.peak_extra_gib(fn, device)
    return row


def profile_call(fn: Callable[[], Any], device: torch.device, top: int) -> dict[str, Any]:
    """One call of ``fn`` under ``torch.profiler``: the ``top`` operators and kernels by self device
    time (by self CPU time on CPU), with their call counts and CPU totals, and the call's wall time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    wall_ms = (time.perf_counter() - start) * 1e3
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:top]
    return {
        "sorted_by": key,
        "wall_ms_under_profiler": wall_ms,
        "top": [
            {"name": e.key, "calls": e.count, "self_ms": getattr(e, key) / 1e3, "cpu_total_ms": e.cpu_time_total / 1e3}
            for e in events
        ],
    }


def per_token_inputs(batch: dict, log_probs: torch.Tensor, seed: int) -> None:
    """Add ``old_log_probs`` and ``ref_log_prob`` ``[B, response_len]`` to ``batch``: the baseline's
    response log-probs plus independent N(0, 0.1^2) noise (zero past each response)."""
    gen = torch.Generator().manual_seed(seed)
    mask = batch["response_mask"].bool()
    current = torch.zeros(mask.shape)
    current[mask] = log_probs
    batch["old_log_probs"] = (current + 0.1 * torch.randn(current.shape, generator=gen)) * mask
    batch["ref_log_prob"] = (current + 0.1 * torch.randn(current.shape, generator=gen)) * mask


def check_variant(args, model_dir: str, layout: str, variant: str, batch: dict, reference: dict) -> dict[str, Any]:
    """The off-vs-on checks of one variant on ``batch`` with fp32 compute (the contract's fp32 rows,
    as the CPU tier's tests): response log-probs and entropies, ``update_actor``'s loss metrics,
    grad norm and every parameter's gradient against ``verl_default``'s; the adapter's status."""
    from verl.utils import tensordict_utils as tu

    if variant != BASELINE and not reference:
        raise RuntimeError(f"no {BASELINE} check run on the {layout} layout to compare with (see its row)")
    row: dict[str, Any] = {"checks": {}}
    worker = build_worker(overrides(args, model_dir, layout, variant) + [FP32])
    try:
        out = log_prob_call(worker, batch)()
        log_probs, entropy = response_values(out, batch, "log_probs"), response_values(out, batch, "entropy")
        metric_keys = list(tu.get(out, "metrics"))
        if "old_log_probs" not in batch:
            per_token_inputs(batch, log_probs, args.seed + 1)
        metrics, grads = update_with_grads(worker, batch)
        metric_keys += list(metrics)
        row["hooks"] = hooks_report(worker, variant, metric_keys)
    finally:
        worker = None
        free(torch.device(args.device))
    if variant == BASELINE:
        reference.update(log_probs=log_probs, entropy=entropy, metrics=metrics, grads=grads)
        return row
    checks = row["checks"]
    checks["log_probs"] = contract.verdict(log_probs, reference["log_probs"], "logprob", torch.float32, "log_probs")
    checks["entropy"] = contract.verdict(entropy, reference["entropy"], "logprob", torch.float32, "entropy")
    want = reference["metrics"]
    for key in [k for k in LOSS_METRICS if k in want] + ["grad_norm"]:
        if key in metrics:
            checks[key] = contract.verdict(
                torch.tensor(metrics[key], dtype=torch.float64),
                torch.tensor(want[key], dtype=torch.float64),
                "reduction",
                torch.float32,
                key,
            )
        else:
            checks[key] = {"within_contract": False, "error": f"{key} missing from update_actor's metrics"}
    checks["gradients"] = check_gradients(grads, reference["grads"])
    return row


def time_variant(args, device: torch.device, model_dir: str, layout: str, variant: str, batch: dict) -> dict[str, Any]:
    """``compute_log_prob`` and ``update_actor`` of one variant on ``batch`` in verl's bf16: a first
    call each (warm-up), then :func:`measure`; the adapter's status."""
    from verl.utils import tensordict_utils as tu

    row: dict[str, Any] = {}
    tokens = int(batch["attention_mask"].sum())
    worker = build_worker(overrides(args, model_dir, layout, variant))
    try:
        out = log_prob_call(worker, batch)()
        metric_keys = list(tu.get(out, "metrics"))
        if "old_log_probs" not in batch:
            per_token_inputs(batch, response_values(out, batch, "log_probs"), args.seed + 2)
        row["log_prob"] = measure(log_prob_call(worker, batch), device, args, tokens)
        metric_keys += list(tu.get(update_call(worker, batch)(), "metrics"))
        row["update"] = measure(update_call(worker, batch), device, args, tokens)
        row["hooks"] = hooks_report(worker, variant, metric_keys)
        if args.profile:
            row["profile"] = {
                "log_prob": profile_call(log_prob_call(worker, batch), device, args.profile),
                "update": profile_call(update_call(worker, batch), device, args.profile),
            }
    finally:
        worker = None
        free(device)
    return row


def scrub(text: str) -> str:
    """``text`` without this machine's paths: installed files relative to their site directory,
    the checkout's relative to it, the temporary model directory as ``<model_dir>``."""
    text = re.sub(r"[^\s\"']*/(site|dist)-packages/", "", text).replace(REPO + os.sep, "")
    return re.sub(r"[^\s\"']*/bench-verl-[^\s\"'/]*", "<model_dir>", text)


def error_record(exc: BaseException) -> dict[str, Any]:
    """An exception as recorded in the results: its message and the last frames, scrubbed."""
    frames = traceback.format_exception(exc, limit=-6)
    return {"error": scrub(f"{type(exc).__name__}: {exc}"), "traceback": [scrub(f) for f in frames[-7:-1]]}


def guarded(row: dict, key: str, fn: Callable[[], dict], rec: Recorder) -> None:
    """``row[key] = fn()``; an exception is recorded there instead (with where it came from)."""
    try:
        row[key] = {"status": "ok", **fn()}
    except Exception as exc:  # recorded with the error, never replaced by another path
        row[key] = {"status": "unavailable", **error_record(exc)}
    rec.flush()


def leading_sequences(batch: dict, layout: str, tokens: int) -> dict:
    """The fewest leading sequences of ``batch`` that hold ``tokens`` tokens (packed: real tokens;
    padded: rows x padded length), the whole batch at most."""
    mask = batch["attention_mask"]
    per_row = mask.sum(1) if layout == "packed" else torch.full((mask.shape[0],), mask.shape[1])
    rows = min(int(torch.searchsorted(per_row.cumsum(0), tokens)) + 1, mask.shape[0])
    return {k: v[:rows] for k, v in batch.items()}


def search_microbatch(args, device, model_dir: str, variant: str, batch: dict, rec: Recorder) -> dict:
    """The largest micro-batch ``update_actor`` fits: doubled until CUDA runs out of memory or one
    micro-batch holds the whole batch. ``--search-layout packed`` doubles ``max_token_len_per_gpu``
    from ``--max-token-len``; ``padded`` doubles ``micro_batch_size_per_gpu`` from
    ``--micro-batch-size`` (tokens: sequences x padded length). Both are keys verl's worker takes
    from the batch before its config. Each step updates on the batch's leading sequences that fill
    two micro-batches (:func:`leading_sequences`): a micro-batch's memory is the same as in the whole
    batch, and a step costs two micro-batches, not the batch."""
    layout = args.search_layout
    seq = args.prompt_len + args.response_len
    row: dict[str, Any] = {"variant": variant, "layout": layout, "tried": [], "largest_fitting_tokens": None}
    total = int(batch["attention_mask"].sum()) if layout == "packed" else batch["attention_mask"].numel()
    worker = None
    try:
        worker = build_worker(overrides(args, model_dir, layout, variant))
        if "old_log_probs" not in batch:  # no timing run before this one
            per_token_inputs(batch, response_values(log_prob_call(worker, batch)(), batch, "log_probs"), args.seed + 2)
        size = args.max_token_len if layout == "packed" else args.micro_batch_size
        counter = MicroBatchCounter(worker)
        while (tokens := size if layout == "packed" else size * seq) <= args.max_microbatch_limit:
            meta = {"max_token_len_per_gpu": size} if layout == "packed" else {"micro_batch_size_per_gpu": size}
            part = leading_sequences(batch, layout, 2 * tokens)
            fn = update_call(worker, part, **meta)
            try:
                if not row["tried"]:
                    fn()  # the first update creates the optimizer's state: not part of a micro-batch's memory
                counter.take()
                if device.type == "cuda":
                    peak = bench.peak_extra_gib(fn, device)
                else:  # no memory to measure (a test of the mechanics): the step still runs and is counted
                    fn()
                    peak = None
            except Exception as exc:  # the end of the search: out of memory, or an error recorded as such
                oom = isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()
                row["tried"].append(
                    {
                        "tokens": tokens,
                        **meta,
                        "fits": False,
                        "out_of_memory": oom,
                        "error": scrub(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"),
                    }
                )
                break
            row["tried"].append(
                {
                    "tokens": tokens,
                    **meta,
                    "fits": True,
                    "peak_extra_gib": peak,
                    "micro_batches": counter.take(),
                    "sequences": part["input_ids"].shape[0],
                }
            )
            row["largest_fitting_tokens"] = tokens
            if tokens >= total:
                row["note"] = f"one micro-batch holds the whole batch ({total} tokens): the limit is higher"
                break
            size *= 2
            rec.flush()
    except Exception as exc:  # recorded, as in guarded()
        row.update(error_record(exc))
    finally:
        worker = None
        free(device)
        rec.flush()
    return row


# -- report -----------------------------------------------------------------------------------


def summary(results: list[dict]) -> list[dict]:
    """Per layout and variant: time and memory ratios against the baseline on the same layout; for
    ``rl_kernel_batch_invariant`` also ``update_mode_cost`` and ``log_prob_mode_cost``, its times
    over ``rl_kernel``'s (what the mode costs the trainer)."""
    timed = lambda variant: {
        r["layout"]: r["timing"]
        for r in results  # noqa: E731
        if r["variant"] == variant and r.get("timing", {}).get("status") == "ok"
    }
    base, backend = timed(BASELINE), timed("rl_kernel")
    rows = []
    for r in results:
        t, b = r.get("timing", {}), base.get(r["layout"])
        if t.get("status") != "ok" or b is None or r["variant"] == BASELINE:
            continue
        row = {"layout": r["layout"], "variant": r["variant"]}
        for op in ("log_prob", "update"):
            row[f"{op}_speedup"] = b[op]["median_ms"] / t[op]["median_ms"]
            if t[op]["peak_extra_gib"] is not None and b[op]["peak_extra_gib"]:
                row[f"{op}_peak_memory_ratio"] = t[op]["peak_extra_gib"] / b[op]["peak_extra_gib"]
            if r["variant"] == "rl_kernel_batch_invariant" and r["layout"] in backend:
                row[f"{op}_mode_cost"] = t[op]["median_ms"] / backend[r["layout"]][op]["median_ms"]
        rows.append(row)
    return rows


def passed(row: dict) -> bool:
    """The variant's checks ran and held, and its hooks were as expected in every run it made."""
    check, timing = row.get("check", {}), row.get("timing", {})
    checked = (
        check.get("status") == "ok"
        and all(c.get("within_contract") for c in check["checks"].values())
        and check["hooks"]["ok"]
    )
    return (
        (checked or check.get("status", "").startswith("skipped"))
        and timing.get("status") == "ok"
        and timing["hooks"]["ok"]
    )


def print_table(doc: dict) -> None:
    gib = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    print(
        f"{'layout':7} {'variant':25} {'logprob ms':>11} {'GiB+':>7} {'update ms':>11} {'GiB+':>7}  checks (fp32, vs {BASELINE})"
    )
    for r in doc["results"]:
        t, c = r.get("timing", {}), r.get("check", {})
        verdict = (
            "reference"
            if r["variant"] == BASELINE and c.get("status") == "ok"
            else "passed"
            if passed(r)
            else f"FAILED {c.get('error', t.get('error', ''))[:70]}"
        )
        if t.get("status") == "ok":
            print(
                f"{r['layout']:7} {r['variant']:25} {t['log_prob']['median_ms']:11.1f} {gib(t['log_prob']['peak_extra_gib']):>7} "
                f"{t['update']['median_ms']:11.1f} {gib(t['update']['peak_extra_gib']):>7}  {verdict}"
            )
        else:
            print(f"{r['layout']:7} {r['variant']:25} unavailable: {t.get('error', '')[:100]}")
    for row in doc.get("summary", []):
        if "update_mode_cost" in row:
            print(
                f"batch-invariant mode, {row['layout']}: update_actor {row['update_mode_cost']:.2f}x, "
                f"compute_log_prob {row['log_prob_mode_cost']:.2f}x the rl_kernel variant's time"
            )
    for m in doc["max_microbatch"]:
        print(f"max micro-batch {m['variant']:25} {m['largest_fitting_tokens']} tokens {m.get('error', '')}")


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    loading = import_verl(args.device)
    init_process_group(args.device)
    import importlib.metadata as md

    model_dir = args.model_dir or tempfile.mkdtemp(prefix=f"bench-verl-{args.model_shape}-")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        write_random_model(args.model_shape, model_dir, dtype="bfloat16", seed=args.seed)
    parts = "-".join(args.layouts or ["nolayout"]) + ("-search" if args.max_microbatch else "")
    if len(args.variants) == 1:  # one process per variant (the GPU script's search): a file each
        parts += f"-{args.variants[0]}"
    versions = {name: md.version(name) for name in ("verl", "transformers", "tensordict", "ray", "hydra-core")}
    doc: dict[str, Any] = {
        "benchmark": "verl FSDP2 actor: compute_log_prob and update_actor, verl default vs verl fused kernels vs rl-kernel (and in its batch-invariant mode)",
        "command": bench.command_line().replace(model_dir, "<model_dir>"),
        "environment": {**bench.environment(device), **versions},
        "settings": {
            "model_shape": args.model_shape,
            "architecture": architecture(args.model_shape),
            "model_config": PRESETS[args.model_shape],
            "weights": "random N(0, 0.02), bf16",
            "compute_dtype": "bfloat16 (verl's FSDP2 mixed precision default)",
            "gradient_checkpointing": True,
            "attn_implementation": args.attn_implementation,
            "prompts": args.prompts,
            "samples": args.samples,
            "prompt_len": args.prompt_len,
            "response_len": args.response_len,
            "max_token_len": args.max_token_len,
            "padded_micro_batch_size": args.micro_batch_size,
            "warmup_after_first_call": args.warmup,
            "reps": args.reps,
            "profile_top": args.profile,
            "temperature": TEMPERATURE,
            "loss": "GRPO, one mini-batch, kl low_var_kl 0.001, entropy_coeff 0",
            "seed": args.seed,
            "checks": f"fp32 compute on the first {args.check_prompts} prompts' groups, contract fp32 rows, against {BASELINE}",
            "variant_order": "use_fused_kernels patches the model class's forward for the whole process, so its variant runs last",
        },
        "plugin": loading,
        "results": [],
        "max_microbatch": [],
    }
    rec = Recorder(os.path.join(args.out, f"bench_verl_actor_{args.model_shape}_{parts}.json"), doc)
    batch = grpo_batch(args, PRESETS[args.model_shape]["vocab_size"], torch.Generator().manual_seed(args.seed))
    check_batch = {k: v[: args.check_prompts * args.samples] for k, v in batch.items()}
    doc["settings"].update(tokens=int(batch["attention_mask"].sum()), response_tokens=int(batch["response_mask"].sum()))
    references: dict[str, dict] = {layout: {} for layout in args.layouts}
    for variant in args.variants:
        for layout in args.layouts:
            row: dict[str, Any] = {"layout": layout, "variant": variant, "overrides": list(VARIANTS[variant])}
            doc["results"].append(row)
            if not args.check_prompts:
                row["check"] = {"status": "skipped (--check-prompts 0)", "checks": {}}
            else:
                guarded(
                    row,
                    "check",
                    lambda: check_variant(args, model_dir, layout, variant, check_batch, references[layout]),
                    rec,
                )
            guarded(row, "timing", lambda: time_variant(args, device, model_dir, layout, variant, batch), rec)
            doc["summary"] = summary(doc["results"])
            rec.flush()
        if args.max_microbatch:
            doc["max_microbatch"].append(search_microbatch(args, device, model_dir, variant, batch, rec))
    rec.flush()
    print_table(doc)
    print(f"wrote {rec.path}")
    # verl's own fused kernels may be unavailable (recorded); every other variant must run and pass
    return 1 if [r for r in doc["results"] if r["variant"] != "verl_fused_triton" and not passed(r)] else 0


if __name__ == "__main__":
    sys.exit(main())
