"""Drift probe across the engine boundary: the first module whose output differs between vLLM's
forward and the trainer's, on one sequence.

vLLM runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, tensor parallel size 1) with the
plugin's switches from the environment; forward hooks on its decoder modules record every row of
a one-request prefill of the sequence (``max_tokens=1``, so no decode step runs), keyed by the
positions the model receives (the logits: the last position's, the only row vLLM computes). The transformers model of the same checkpoint runs one forward of
the same ids under ``rk.batch_invariant()`` with the same hooks. The points compared, in forward
order, per layer: the input norm, the q/k/v projections, the attention core (rotary embedding
included), the output projection, the post-attention norm, the MLP's output (a dense MLP's or a sparse MoE block's); then the
final norm and the logits. :func:`compare_points` names the first point whose rows differ.

A divergence that this prefill does not show lies in a path it does not take (a decode step, a
chunked prefill, a CUDA-graph replay, a batch of several requests); the result says so.

``python -m rl_kernel_vllm.drift --model DIR --ids 1,2,3 --out drift.json [--engine JSON] [--dtype D]``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from rl_kernel_vllm.switches import environment_without_switches

_captured: dict[str, list[torch.Tensor]] = {}  # point name -> rows of each forward call, in order


def _first(value: Any) -> Optional[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return None


def _record(name: str, pick: Callable[[Any, Any], Optional[torch.Tensor]]) -> Callable[..., None]:
    def hook(module, inputs, output):
        t = pick(inputs, output)
        if t is not None:
            _captured.setdefault(name, []).append(t.detach().reshape(t.shape[0], -1).float().cpu())

    return hook


def _out(inputs, output):
    return _first(output)


def _in(inputs, output):
    return _first(inputs)


# point -> (vLLM module suffix, which tensor), per layer; transformers' points follow from these
VLLM_POINTS: tuple[tuple[str, str, Callable], ...] = (
    ("input_layernorm", "input_layernorm", _out),
    ("qkv", "self_attn.qkv_proj", _out),
    ("attention", "self_attn.attn", _out),
    ("o_proj", "self_attn.o_proj", _out),
    ("post_attention_layernorm", "post_attention_layernorm", _out),
    ("mlp", "mlp", _out),
)
HF_POINTS: dict[str, tuple[tuple[str, Callable], ...]] = {
    "input_layernorm": (("input_layernorm", _out),),
    "qkv": (("self_attn.q_proj", _out), ("self_attn.k_proj", _out), ("self_attn.v_proj", _out)),
    "attention": (("self_attn.o_proj", _in),),
    "o_proj": (("self_attn.o_proj", _out),),
    "post_attention_layernorm": (("post_attention_layernorm", _out),),
    "mlp": (("mlp", _out),),
}


def _hook_vllm(model: Any) -> list[str]:
    """Hook vLLM's decoder modules (``model.layers.i.*``, ``model.norm``, the logits processor) and
    the positions the model receives; returns the point names in forward order."""
    _captured.clear()
    inner = model.model
    # the decoder model's own __call__ is vLLM's compile wrapper (no module hooks): its first layer's get the positions
    inner.layers[0].register_forward_pre_hook(
        lambda module, args, kwargs: _captured.setdefault("positions", []).append(
            (kwargs["positions"] if "positions" in kwargs else args[0]).detach().reshape(-1).cpu()
        ),
        with_kwargs=True,
    )
    names = []
    for i, layer in enumerate(inner.layers):
        for point, suffix, pick in VLLM_POINTS:
            module = layer.get_submodule(suffix)
            module.register_forward_hook(_record(f"layers.{i}.{point}", pick))
            names.append(f"layers.{i}.{point}")
    inner.norm.register_forward_hook(_record("norm", _out))
    model.logits_processor.register_forward_hook(_record("logits", _out))
    return names + ["norm", "logits"]


def _take(model: Any) -> dict[str, list[torch.Tensor]]:
    """What the hooks recorded (CPU tensors), handed back and forgotten."""
    taken = dict(_captured)
    _captured.clear()
    return taken


def _hf_points(model, ids: list[int], device: str) -> dict[str, torch.Tensor]:
    import rl_kernel_core as rk

    captured: dict[str, dict[str, torch.Tensor]] = {}

    def keep(point: str, part: str, pick: Callable) -> Callable[..., None]:
        def hook(module, inputs, output):
            t = pick(inputs, output)
            captured.setdefault(point, {})[part] = t.detach().reshape(-1, t.shape[-1]).float().cpu()

        return hook

    handles = []
    for i, layer in enumerate(model.model.layers):
        for point, parts in HF_POINTS.items():
            for suffix, pick in parts:
                handles.append(
                    layer.get_submodule(suffix).register_forward_hook(keep(f"layers.{i}.{point}", suffix, pick))
                )
    handles.append(model.model.norm.register_forward_hook(keep("norm", "norm", _out)))
    handles.append(model.lm_head.register_forward_hook(keep("logits", "lm_head", _out)))
    try:
        with torch.no_grad(), rk.batch_invariant():
            model(input_ids=torch.tensor([ids], device=device))
    finally:
        for h in handles:
            h.remove()
    return {point: torch.cat(list(parts.values()), dim=-1) for point, parts in captured.items()}


def compare_points(
    names: Sequence[str], engine: dict[str, torch.Tensor], trainer: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """Per point the largest |engine - trainer| over the rows; the first point that differs (its name,
    the first differing position and the largest gap), or None."""
    drifts: dict[str, Optional[float]] = {}
    first: Optional[dict[str, Any]] = None
    for name in names:
        a, b = engine.get(name), trainer.get(name)
        if a is None or b is None or a.shape != b.shape:
            drifts[name] = None
            continue
        diff = (a - b).abs()
        gap = float(diff.max()) if diff.numel() else 0.0
        drifts[name] = gap
        if first is None and bool((a != b).any()):
            rows = (a != b).any(-1).nonzero()
            first = {"point": name, "position": int(rows[0]), "max_gap": gap}
    return {"first_divergent": first, "drifts": drifts}


def probe(model_dir: str, ids: list[int], dtype: str, device: str, engine: Optional[dict] = None) -> dict[str, Any]:
    """Run the prefill of ``ids`` through vLLM (this process) and the trainer; see the module docstring."""
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    from rl_kernel_core.batch_invariant_mode.api_hf import use_mode_attention

    engine = {
        k: v
        for k, v in (engine or {}).items()
        if k not in ("tensor_parallel_size", "enable_chunked_prefill", "max_num_batched_tokens")
    }
    engine.setdefault("max_model_len", max(len(ids) + 1, 16))
    engine["distributed_executor_backend"] = "uni"  # the worker, and so its hooks, in this process
    engine["enforce_eager"] = True  # module hooks see eager forwards only (the mode's prefill is eager anyway)
    llm = LLM(model=model_dir, dtype=dtype, enable_chunked_prefill=False, **engine)
    names = llm.apply_model(_hook_vllm)[0]
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1), use_tqdm=False)
    captured = llm.apply_model(_take)[0]
    positions = torch.cat(captured.pop("positions"))
    rows = len(ids)
    if not torch.equal(positions[:rows], torch.arange(rows)):
        raise RuntimeError(
            f"the engine's prefill rows are not positions 0..{rows - 1}: {positions[:rows].tolist()[:20]}"
        )
    ours = {name: torch.cat(parts)[:rows] for name, parts in captured.items()}
    del llm
    loaded: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model = loaded.to(device).eval()
    use_mode_attention(model)
    trainer = _hf_points(model, ids, device)
    # vLLM computes the logits of the last prompt position only
    ours["logits"], trainer["logits"] = ours["logits"][-1:], trainer["logits"][-1:]
    result = compare_points(names, ours, trainer)
    result["path"] = "one-request eager prefill, tensor parallel size 1, no chunking"
    return result


def first_divergent_for_draw(
    spec: dict[str, Any], model_dir: str, on_report: dict[str, Any], device: str, work: Path
) -> Optional[dict[str, Any]]:
    """:func:`probe` (in a fresh process, switches on) on a failing draw's first mismatching sequence,
    up to the mismatching token; None when the report has no mismatch (a prompt-token mismatch only)."""
    mismatch = on_report.get("first_mismatch")
    if not mismatch:
        return None
    ids = mismatch["prompt"] + mismatch["tokens"][:-1]
    out = work / "drift.json"
    env = environment_without_switches()
    env.update(RL_KERNEL_VLLM="1", RL_KERNEL_VLLM_BATCH_INVARIANT="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    cmd = [
        sys.executable,
        "-m",
        "rl_kernel_vllm.drift",
        "--model",
        model_dir,
        "--ids",
        ",".join(map(str, ids)),
        "--out",
        str(out),
        "--dtype",
        spec["model"]["dtype"],
        "--device",
        device,
        "--engine",
        json.dumps(spec["engine"]),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        return {"error": f"drift probe exit {proc.returncode}: {(proc.stdout + proc.stderr)[-1500:]}"}
    result = json.loads(out.read_text())
    first = result["first_divergent"]
    return {
        "sequence": mismatch["sample"],
        "token_index": mismatch["token_index"],
        "path": result["path"],
        "first_divergent": first
        if first is not None
        else "none on this path (the divergence is in a decode step, a chunked prefill, a graph replay or a batch)",
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rl_kernel_vllm.drift", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--ids", required=True, help="comma-separated token ids of the sequence")
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--engine", default="{}", help="extra vllm.LLM keyword arguments, a JSON object")
    args = parser.parse_args(argv)
    try:
        ids = [int(x) for x in args.ids.split(",")]
    except ValueError:
        parser.error(f"--ids: expected comma-separated integers, got {args.ids[:80]!r}")
    engine = json.loads(args.engine)
    if not isinstance(engine, dict):
        parser.error(f"--engine: expected a JSON object, got {type(engine).__name__}")
    result = probe(args.model, ids, args.dtype, args.device, engine)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["first_divergent"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
