"""Weight-sync check: do vLLM's weights hold the trainer's bits?

After a trainer pushes weights into a running vLLM engine (verl's weight sync), any parameter
whose bits changed on the way (a dtype round trip, a fused copy, a stale shard) breaks the
rollout/training identity silently. The check compares per-row bit digests
(:mod:`rl_kernel_core.digest`) of the engine's parameters, computed inside each worker, with the
trainer's parameters rearranged into vLLM's layout (:data:`STACKED`); only the digests cross
processes. Cheap enough to run every N steps; nothing runs it unless asked.

Two callers: :func:`check` for a ``vllm.LLM`` in the trainer's process, and the verl adapter
(:mod:`rl_kernel_verl.weight_check`), which digests the tensors verl pushes as they stream
(:func:`trainer_digest`) and reads the engine's side through a file (:func:`save_engine_view`),
because verl's rollout server drops what ``collective_rpc`` returns.

The engine holds a weight in its own dtype (``dtype`` of the engine: bf16 under an fp32 trainer),
so the bits it should hold are the trainer's rounded to that dtype: :func:`trainer_digest` digests
the trainer's tensor cast to the engine parameter's dtype (what a mixed-precision trainer's forward
uses too). Covered: the Llama/Qwen2/Qwen3 parameter layout (what
:mod:`rl_kernel_vllm.batch_invariant` covers) at tensor-parallel size 1. The rows vLLM adds to pad
the vocabulary are not compared; a tied LM head is compared under both names.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

import torch

from rl_kernel_core.digest import mismatches, named_digests, row_digests

STACKED: dict[str, tuple[str, ...]] = {
    ".qkv_proj.": (".q_proj.", ".k_proj.", ".v_proj."),
    ".gate_up_proj.": (".gate_proj.", ".up_proj."),
}
"""vLLM's fused parameter -> the checkpoint parameters stacked into it, in row order."""


def _engine_parameters(worker: Any) -> Iterable[tuple[str, torch.Tensor]]:
    # remove_duplicate=False: a tied LM head is listed under its own name too, as a trainer's state dict lists it
    return worker.model_runner.get_model().named_parameters(remove_duplicate=False)


def engine_digests(worker: Any) -> dict[str, torch.Tensor]:
    """Run inside a vLLM worker (``LLM.collective_rpc(engine_digests)``): its model's parameter digests."""
    return named_digests(_engine_parameters(worker))


def save_engine_view(worker: Any, path: str, digests: bool) -> None:
    """Run inside a vLLM worker (``collective_rpc``): ``torch.save`` to ``path`` ``{"dtypes": {name:
    dtype}, "digests": engine_digests(worker) or None}``, for callers whose RPC route drops return
    values. ``digests`` False: the dtypes only (no pass over the weights)."""
    dtypes = {name: p.dtype for name, p in _engine_parameters(worker)}
    torch.save({"dtypes": dtypes, "digests": engine_digests(worker) if digests else None}, path)


def _stacked_in(name: str) -> Optional[tuple[str, str]]:
    """``(fused, member)`` when checkpoint parameter ``name`` is a block of a fused vLLM parameter."""
    for fused, members in STACKED.items():
        for member in members:
            if member in name:
                return fused, member
    return None


def engine_name(name: str) -> str:
    """vLLM's name of the parameter a checkpoint parameter is loaded into (``q_proj`` -> ``qkv_proj``)."""
    stacked = _stacked_in(name)
    return name if stacked is None else name.replace(stacked[1], stacked[0])


def trainer_digest(name: str, tensor: torch.Tensor, engine_dtypes: Mapping[str, torch.dtype]) -> torch.Tensor:
    """``row_digests`` of the trainer's ``tensor`` (checkpoint name ``name``) in the dtype the engine
    holds it in (``engine_dtypes``: engine name -> dtype; a name the engine lacks keeps the tensor's
    dtype, and the comparison reports it missing). On ``tensor``'s device.

    Raises:
        TypeError, ValueError: ``tensor`` is one :func:`rl_kernel_core.digest.row_digests` refuses
            (not a tensor, sparse, quantized, meta); the message starts with ``name``.
    """
    dtype: Optional[torch.dtype] = engine_dtypes.get(engine_name(name))
    floating = isinstance(tensor, torch.Tensor) and tensor.is_floating_point()
    try:
        return row_digests(tensor, dtype if floating else None)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{name}: {exc}") from None


def in_engine_layout(digests: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint-named digests rearranged under vLLM's parameter names (stacked blocks concatenated)."""
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, digest in digests.items():
        stacked = _stacked_in(name)
        if stacked is None:
            out[name] = digest
        else:
            parts.setdefault(engine_name(name), {})[stacked[1]] = digest
    for fused_name, blocks in parts.items():
        fused = next(f for f in STACKED if f in fused_name)
        missing = [m for m in STACKED[fused] if m not in blocks]
        if missing:
            raise ValueError(f"{fused_name}: the trainer's parameters lack {', '.join(m.strip('.') for m in missing)}")
        out[fused_name] = torch.cat([blocks[m] for m in STACKED[fused]])
    return out


def compare(trainer: dict[str, torch.Tensor], engine: Mapping[str, torch.Tensor]) -> list[str]:
    """Lines naming every parameter whose bits differ between the trainer's checkpoint-named
    digests and the engine's (:func:`engine_digests`), or that one side lacks; empty when every
    bit agrees. The engine's vocabulary-padding rows (past the trainer's row count) are ignored."""
    reference = in_engine_layout(trainer)
    engine = dict(engine)
    for name, digest in engine.items():
        if name in reference and digest.shape[0] > reference[name].shape[0]:
            engine[name] = digest[: reference[name].shape[0]]
    return mismatches(reference, engine)


def check(llm: Any, trainer_params: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Lines naming every parameter whose bits differ between ``llm`` (a ``vllm.LLM``) and the
    trainer's parameters (``named_parameters(remove_duplicate=False)`` or state-dict items, in
    the engine's dtype); empty when every bit agrees.

    Raises:
        ValueError: the engine runs with tensor parallelism (each worker holds a shard).
    """
    per_worker = llm.collective_rpc(engine_digests)
    if len(per_worker) != 1:
        raise ValueError(f"the weight check covers tensor-parallel size 1; this engine has {len(per_worker)} workers")
    return compare(named_digests(trainer_params), per_worker[0])
