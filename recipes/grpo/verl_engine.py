"""The recipe's verl engine: GSM8K as verl's parquet, ``python -m verl.trainer.main_ppo`` with
GRPO settings and the verl adapter's switch off or on, and verl's per-step metrics as profiler
step records.

verl writes one JSON line per step through its ``file`` logger (``trainer.logger`` with
``file``; the path from ``VERL_FILE_LOGGER_PATH``): ``{"step": n, "data": {metric: value}}``.
:func:`metrics_to_record` maps verl's stage timers (``timing_s/<stage>``, seconds) onto the
profiler's shared region names (ms) and its data metrics onto the record's fields, so
``rl_kernel_core.tools.report`` compares two verl runs as it compares two embedded ones.

On a machine without a GPU the run uses verl's FSDP2 engine on CPU (:mod:`grpo.verl_cpu`,
registered in every process through ``VERL_USE_EXTERNAL_MODULES``) and vLLM's CPU build as the
rollout server, fp32 throughout.

``batch_invariant`` (``--batch-invariant``) makes the on run rl-kernel's train = rollout
identity: the verl adapter's batch-invariant option on the trainer
(``rl_kernel_batch_invariant=True``, which turns the backend on) and ``RL_KERNEL_VLLM=1
RL_KERNEL_VLLM_BATCH_INVARIANT=1`` in the environment of every process of the run, so verl's vLLM
rollout server takes them. verl's own train/rollout metric (``training/rollout_probs_diff_max``,
computed from the rollout's and the old-log-prob pass's log-probs of every response token) is then
exactly 0 on every step. The off run is verl untouched: the control group.

verl's vLLM server masks the ids past the tokenizer's (its ``monkey_patch_model``), so the rollout
samples and scores over the tokenizer's ids while verl's own trainer normalises over the model's
whole vocabulary (the adapter's batch-invariant option normalises over the tokenizer's ids, like
the rollout). The tiny preset's model has no ids past its tokenizer; a model that has (the
``qwen3-0.6b`` preset, a real checkpoint padded past its tokenizer) shows verl's own rollout and
training log-probs differing per token, by about ``log(vocab / tokenizer size)`` for a
random-weight model (``rollout_log_ppl_abs_diff`` in the step records).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from .data import HUB_DATASET, Problem

RECIPES = Path(__file__).resolve().parent.parent
SWITCH = "+actor_rollout_ref.model.fused_kernel_options.use_rl_kernel_backend"
BATCH_INVARIANT = "+actor_rollout_ref.model.fused_kernel_options.rl_kernel_batch_invariant=True"
WEIGHT_CHECK = "+actor_rollout_ref.model.fused_kernel_options.rl_kernel_weight_check_every"
VLLM_BATCH_INVARIANT = {"RL_KERNEL_VLLM": "1", "RL_KERNEL_VLLM_BATCH_INVARIANT": "1"}
VLLM_FUNCTION_RPC = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
"""What the weight check needs in verl's vLLM server: it runs a function in the vLLM worker."""

# verl stage timer -> the profiler's region name. update_actor is verl's whole policy update
# (forward, loss, backward, optimizer step), recorded as ``update``; the report sums it into the
# actor update like the embedded engine's separate regions.
TIMERS = {
    "gen": "rollout",
    "old_log_prob": "old_logprob",
    "ref": "ref_logprob",
    "update_actor": "update",
    "update_weights": "weight_sync",
    "step": "step",
    "reward": "reward",
    "adv": "advantages",
}

RL_KERNEL_PREFIX = "rl_kernel/"
BACKEND_PREFIX = RL_KERNEL_PREFIX + "backend/"

# verl metric -> record field
FIELDS = {
    "critic/score/mean": "reward",
    "response_length/mean": "response_length",
    "actor/loss": "loss",  # the whole loss (policy, KL and entropy terms), as the embedded engine's
    "actor/pg_loss": "pg_loss",
    "actor/entropy": "entropy",
    "actor/kl_loss": "kl",
    "actor/ppo_kl": "ppo_kl",
    "actor/pg_clipfrac": "pg_clipfrac",
    "actor/grad_norm": "grad_norm",
    "training/rollout_probs_diff_mean": "rollout_probs_diff",
    "training/rollout_probs_diff_max": "rollout_probs_diff_max",
    "rollout_corr/log_ppl_abs_diff": "rollout_log_ppl_abs_diff",
}


def gsm8k_rows(problems: Sequence[Problem], split: str) -> list[dict[str, Any]]:
    """verl's GSM8K rows (as ``examples/data_preprocess/gsm8k.py`` writes them) for ``problems``."""
    return [
        {
            "data_source": HUB_DATASET,
            "prompt": [{"role": "user", "content": p.prompt}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": p.ground_truth},
            "extra_info": {"split": split, "index": i, "answer": p.answer, "question": p.question},
        }
        for i, p in enumerate(problems)
    ]


def write_parquet(problems: Sequence[Problem], data_dir: Path, val_count: int = 8) -> tuple[Path, Path]:
    """``train.parquet`` (all ``problems``) and ``test.parquet`` (the first ``val_count``) in ``data_dir``."""
    import pandas as pd

    data_dir.mkdir(parents=True, exist_ok=True)
    paths = data_dir / "train.parquet", data_dir / "test.parquet"
    pd.DataFrame(gsm8k_rows(problems, "train")).to_parquet(paths[0])
    pd.DataFrame(gsm8k_rows(problems[:val_count], "test")).to_parquet(paths[1])
    return paths


def overrides(
    cfg: dict, rl_kernel_on: bool, model_dir: Path, train: Path, val: Path, run_dir: Path, device: str
) -> list[str]:
    """The Hydra overrides of ``main_ppo`` for one GRPO run of the recipe's config ``cfg``.

    One optimizer step per training step (mini-batch = all prompts of the step), ``G =
    group_size`` samples per prompt from vLLM, KL to the reference as a loss term (``low_var_kl``;
    the reference policy only when ``kl_coef > 0``, as in the embedded engine),
    verl's GSM8K rows scored by the recipe's scorer (:func:`grpo.scoring.verl_compute_score`).
    ``device`` ``"cpu"`` adds what the CPU run needs (fp32, sdpa attention without remove-padding,
    eager vLLM without sleep mode). The on run of a ``cfg["batch_invariant"]`` config adds the
    adapter's batch-invariant option, that of a ``cfg["weight_check_every"]`` config its weight check.
    """
    prompts, group = cfg["prompts_per_step"], cfg["group_size"]
    micro = max(1, min(cfg["micro_batch"], prompts * group))
    args = [
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=False",
        "algorithm.norm_adv_by_std_in_grpo=True",
        f"data.train_files={train}",
        f"data.val_files={val}",
        f"data.train_batch_size={prompts}",
        f"data.max_prompt_length={cfg['max_prompt_tokens']}",
        f"data.max_response_length={cfg['max_new_tokens']}",
        "data.filter_overlong_prompts=True",
        "data.truncation=error",
        f"data.seed={cfg['seed']}",
        "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={model_dir}",
        f"actor_rollout_ref.model.enable_gradient_checkpointing={cfg['gradient_checkpointing']}",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.ref.strategy=fsdp2",
        f"actor_rollout_ref.actor.optim.lr={cfg['lr']}",
        f"actor_rollout_ref.actor.optim.weight_decay={cfg['weight_decay']}",
        f"actor_rollout_ref.actor.grad_clip={cfg['grad_clip']}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
        "actor_rollout_ref.actor.ppo_epochs=1",
        f"actor_rollout_ref.actor.use_kl_loss={cfg['kl_coef'] > 0}",
        f"actor_rollout_ref.actor.kl_loss_coef={cfg['kl_coef']}",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        f"actor_rollout_ref.actor.entropy_coeff={cfg['entropy_coef']}",
        f"actor_rollout_ref.actor.clip_ratio_low={cfg['clip_ratio_low']}",
        f"actor_rollout_ref.actor.clip_ratio_high={cfg['clip_ratio_high']}",
        f"actor_rollout_ref.actor.clip_ratio_c={cfg['clip_ratio_c']}",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={micro}",
        "actor_rollout_ref.rollout.name=vllm",
        f"actor_rollout_ref.rollout.n={group}",
        f"actor_rollout_ref.rollout.temperature={cfg['temperature']}",
        f"actor_rollout_ref.rollout.seed={cfg['seed']}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "reward.num_workers=1",
        f"reward.custom_reward_function.path={RECIPES / 'grpo' / 'scoring.py'}",
        "reward.custom_reward_function.name=verl_compute_score",
        f"+reward.custom_reward_function.reward_kwargs.method={cfg['reward_method']}",
        f"+reward.custom_reward_function.reward_kwargs.format_score={cfg['format_score']}",
        f"{SWITCH}={rl_kernel_on}",
        *([BATCH_INVARIANT] if rl_kernel_on and cfg["batch_invariant"] else []),
        *([f"{WEIGHT_CHECK}={cfg['weight_check_every']}"] if rl_kernel_on and cfg.get("weight_check_every") else []),
        f"trainer.total_training_steps={cfg['steps']}",
        "trainer.total_epochs=1000",
        "trainer.use_v1=False",
        "trainer.nnodes=1",
        "trainer.n_gpus_per_node=1",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.resume_mode=disable",
        "trainer.logger=[console,file]",
        "trainer.project_name=rl_kernel_grpo_gsm8k",
        f"trainer.experiment_name={'on' if rl_kernel_on else 'off'}",
        f"trainer.default_local_dir={run_dir / 'checkpoints'}",
        # verl's default is flash_attention_2, whose package is optional in verl and has no wheel for every torch/CUDA
        # pair; sdpa runs wherever torch does, on both sides of the comparison
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
    ]
    if device == "cpu":
        fp32 = "{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}"
        args += [
            "trainer.device=cpu",
            "actor_rollout_ref.model.use_remove_padding=False",
            "actor_rollout_ref.actor.use_torch_compile=False",
            "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
            "actor_rollout_ref.ref.fsdp_config.use_torch_compile=False",
            f"+actor_rollout_ref.actor.fsdp_config.mixed_precision={fp32}",
            f"+actor_rollout_ref.ref.fsdp_config.mixed_precision={fp32}",
            "actor_rollout_ref.rollout.dtype=float32",
            "actor_rollout_ref.rollout.enforce_eager=True",
            "actor_rollout_ref.rollout.free_cache_engine=False",
            "+actor_rollout_ref.rollout.enable_sleep_mode=False",  # vLLM's CPU platform has no sleep mode
            f"actor_rollout_ref.rollout.max_num_batched_tokens={max(512, cfg['max_prompt_tokens'] + cfg['max_new_tokens'])}",
            "ray_kwargs.ray_init.num_cpus=8",
            "+ray_kwargs.ray_init.num_gpus=1",
        ]
    return args


def command(
    cfg: dict, rl_kernel_on: bool, model_dir: Path, train: Path, val: Path, run_dir: Path, device: str
) -> list[str]:
    """The exact command line of one run: ``python -m verl.trainer.main_ppo`` + :func:`overrides`."""
    return [
        sys.executable,
        "-m",
        "verl.trainer.main_ppo",
        *overrides(cfg, rl_kernel_on, model_dir, train, val, run_dir, device),
    ]


def environment(
    run_dir: Path, device: str, batch_invariant: bool = False, weight_check: bool = False
) -> dict[str, str]:
    """The run's environment: the file logger's path, ``grpo`` importable in every process, with
    ``batch_invariant`` the vLLM plugin's batch-invariant mode (:data:`VLLM_BATCH_INVARIANT`), with
    ``weight_check`` what the weight check needs in verl's vLLM server (:data:`VLLM_FUNCTION_RPC`) and,
    on CPU, verl's CPU platform (:mod:`grpo.verl_cpu`, imported by every process that imports
    verl, before the modules the caller's ``VERL_USE_EXTERNAL_MODULES`` names) and vLLM's KV-cache
    size (GiB)."""
    env = dict(os.environ)
    if batch_invariant:
        env.update(VLLM_BATCH_INVARIANT)
    if weight_check:
        env.update(VLLM_FUNCTION_RPC)
    env["VERL_FILE_LOGGER_PATH"] = str(run_dir / "verl_metrics.jsonl")
    env["PYTHONPATH"] = os.pathsep.join([str(RECIPES), str(RECIPES.parent), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if device == "cpu":
        modules = ",".join(filter(None, ["grpo.verl_cpu", env.get("VERL_USE_EXTERNAL_MODULES")]))
        env.update(
            {
                "VERL_PLATFORM": "cpu",
                "VERL_ENGINE_DEVICE": "cuda",
                "VERL_USE_EXTERNAL_MODULES": modules,
                "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            }
        )
        env.pop("CUDA_VISIBLE_DEVICES", None)  # Ray checks its logical GPU count against it
    return env


def _number(value: Any) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def metrics_to_record(step: int, metrics: dict[str, Any], backend: str) -> dict[str, Any]:
    """One profiler step record from verl's metrics of one training step.

    ``step`` is 0-based (verl counts from 1). ``regions`` (ms) come from ``timing_s/<stage>``
    through :data:`TIMERS`; ``tokens`` is ``perf/total_num_tokens`` (prompt + response tokens of
    the step) and ``tokens_per_s`` those over the step time; ``peak_vram_gib`` verl's
    ``actor/perf/max_memory_allocated_gb`` when a GPU reported one; the fields of :data:`FIELDS`; and
    every ``rl_kernel/*`` metric the adapter adds (verl logs the actor's as ``actor/rl_kernel/*``;
    the record keeps them as ``rl_kernel/*``).
    """
    regions = {}
    for timer, region in TIMERS.items():
        seconds = _number(metrics.get(f"timing_s/{timer}"))
        if seconds is not None:
            regions[region] = seconds * 1e3
    record: dict[str, Any] = {"step": step, "regions": regions}
    tokens = _number(metrics.get("perf/total_num_tokens"))
    if tokens is not None:
        record["tokens"] = int(tokens)
        record["tokens_per_s"] = tokens / (regions["step"] / 1e3) if regions.get("step") else None
    # GiB (verl divides by 1024**3): the actor worker's peak over its update, logged under actor/
    peak = _number(metrics.get("actor/perf/max_memory_allocated_gb"))
    if peak:
        record["peak_vram_gib"] = peak
    for key, field in FIELDS.items():
        value = _number(metrics.get(key))
        if value is not None:
            record[field] = value
    for key, value in metrics.items():
        name = key.removeprefix("actor/")
        if name.startswith(RL_KERNEL_PREFIX) and _number(value) is not None:
            record[name] = float(value)
    record["backend"] = backend
    return record


def convert_log(verl_log: Path, step_log: Path, backend: str) -> int:
    """Rewrite verl's file-logger JSONL as a profiler step log; returns the number of steps."""
    n = 0
    with open(verl_log, encoding="utf-8") as src, open(step_log, "w", encoding="utf-8") as dst:
        for line in src:
            if not line.strip():
                continue
            entry = json.loads(line)
            if not any(k.startswith("timing_s/") for k in entry["data"]):
                continue  # a validation-only entry
            dst.write(json.dumps(metrics_to_record(int(entry["step"]) - 1, entry["data"], backend)) + "\n")
            n += 1
    return n


def vocabulary_note(model_dir: Path) -> Optional[str]:
    """A Markdown line for the report when the tokenizer covers fewer ids than the model's
    vocabulary (see the module docstring); None when it covers them all.

    The per-token gap is ``-log(1 - p)``, ``p`` the trainer's probability of the masked ids:
    ``log(vocab / ids)`` for a uniform distribution, which a random-weight model is close to.
    """
    from transformers import AutoConfig, AutoTokenizer

    ids = len(AutoTokenizer.from_pretrained(model_dir))
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    if ids >= vocab:
        return None
    return (
        f"- vocabulary: the tokenizer covers {ids} of the model's {vocab} ids; verl's vLLM server masks the "
        f"others and its trainer does not, so rollout and training log-probs differ per token by -log(1 - the "
        f"trainer's probability of those ids): log({vocab}/{ids}) = {math.log(vocab / ids):.3f} for a uniform "
        f"distribution, which a random-weight model is close to (`rollout_log_ppl_abs_diff`)"
    )


def backends(step_log: Path) -> dict[str, str]:
    """``{op: backend}`` from the ``rl_kernel/backend/<op>/<backend>`` fields of a step log (the
    backends ``rl_kernel_core.dispatch`` chose in verl's actor worker; empty with the switch off)."""
    chosen = {}
    for line in Path(step_log).read_text(encoding="utf-8").splitlines():
        for key in json.loads(line):
            if key.startswith(BACKEND_PREFIX):
                op, backend = key[len(BACKEND_PREFIX) :].split("/", 1)
                chosen[op] = backend
    return chosen


def run_verl(
    cfg: dict, out_dir: Path, rl_kernel_on: bool, model_dir: Path, problems: Sequence[Problem], device: str = "cpu"
) -> dict[str, Any]:
    """Train ``cfg["steps"]`` GRPO steps with verl's trainer, switch off or on (on and
    ``cfg["batch_invariant"]``: both batch-invariant switches, see the module docstring).

    Writes ``out_dir/verl-<side>/`` (the parquet data, verl's console log ``verl.log`` and metrics
    ``verl_metrics.jsonl``) and ``out_dir/<side>.jsonl`` (the step records). Returns ``{"command",
    "rl_kernel_environment", "returncode", "steps", "log", "backends"}`` (the run's ``RL_KERNEL_*``
    variables; ``backends``: :func:`backends` of the step log); a failed run keeps its console log
    and the steps it logged.
    """
    side = "on" if rl_kernel_on else "off"
    run_dir = Path(out_dir) / f"verl-{side}"
    run_dir.mkdir(parents=True, exist_ok=True)
    train, val = write_parquet(problems, run_dir / "data")
    cmd = command(cfg, rl_kernel_on, Path(model_dir), train, val, run_dir, device)
    env = environment(
        run_dir,
        device,
        batch_invariant=rl_kernel_on and cfg["batch_invariant"],
        weight_check=rl_kernel_on and bool(cfg.get("weight_check_every")),
    )
    verl_log = Path(env["VERL_FILE_LOGGER_PATH"])
    verl_log.unlink(missing_ok=True)
    with open(run_dir / "verl.log", "w", encoding="utf-8") as console:
        proc = subprocess.run(cmd, env=env, cwd=run_dir, stdout=console, stderr=subprocess.STDOUT)
    step_log = Path(out_dir) / f"{side}.jsonl"
    steps = convert_log(verl_log, step_log, side) if verl_log.is_file() else 0
    return {
        "command": cmd,
        "rl_kernel_environment": {k: v for k, v in env.items() if k.startswith("RL_KERNEL_")},
        "returncode": proc.returncode,
        "steps": steps,
        "log": str(run_dir / "verl.log"),
        "backends": backends(step_log) if steps else {},
    }
