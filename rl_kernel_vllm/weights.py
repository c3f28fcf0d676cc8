"""Weight-sync check: do vLLM's weights hold the trainer's bits?

After a trainer pushes weights into a running vLLM engine (verl's weight sync), any parameter
whose bits changed on the way (a dtype round trip, a fused copy, a stale shard) breaks the
rollout/training identity silently. :func:`check` compares per-row bit digests
(:mod:`rl_kernel_core.digest`) of the engine's parameters, computed inside each worker, with the
trainer's parameters rearranged into vLLM's layout (:data:`STACKED`); only the digests cross
processes. Cheap enough to run every N steps; nothing runs it unless asked.

Covered: the Llama/Qwen2/Qwen3 parameter layout (what :mod:`rl_kernel_vllm.batch_invariant`
covers) at tensor-parallel size 1. The rows vLLM adds to pad the vocabulary are not compared.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from rl_kernel_core.digest import mismatches, named_digests

STACKED: dict[str, tuple[str, ...]] = {
    ".qkv_proj.": (".q_proj.", ".k_proj.", ".v_proj."),
    ".gate_up_proj.": (".gate_proj.", ".up_proj."),
}
"""vLLM's fused parameter -> the checkpoint parameters stacked into it, in row order."""


def engine_digests(worker: Any) -> dict[str, torch.Tensor]:
    """Run inside a vLLM worker (``LLM.collective_rpc(engine_digests)``): its model's parameter digests."""
    return named_digests(worker.model_runner.get_model().named_parameters())


def in_engine_layout(digests: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint-named digests rearranged under vLLM's parameter names (stacked blocks concatenated)."""
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, digest in digests.items():
        for fused, members in STACKED.items():
            member = next((m for m in members if m in name), None)
            if member is not None:
                parts.setdefault(name.replace(member, fused), {})[member] = digest
                break
        else:
            out[name] = digest
    for fused_name, blocks in parts.items():
        fused = next(f for f in STACKED if f in fused_name)
        missing = [m for m in STACKED[fused] if m not in blocks]
        if missing:
            raise ValueError(f"{fused_name}: the trainer's parameters lack {', '.join(m.strip('.') for m in missing)}")
        out[fused_name] = torch.cat([blocks[m] for m in STACKED[fused]])
    return out


def check(llm: Any, trainer_params: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Lines naming every parameter whose bits differ between ``llm`` (a ``vllm.LLM``) and the
    trainer's ``named_parameters()``; empty when every bit agrees.

    Raises:
        ValueError: the engine runs with tensor parallelism (each worker holds a shard).
    """
    reference = in_engine_layout(named_digests(trainer_params))
    per_worker = llm.collective_rpc(engine_digests)
    if len(per_worker) != 1:
        raise ValueError(f"the weight check covers tensor-parallel size 1; this engine has {len(per_worker)} workers")
    engine = dict(per_worker[0])
    for name, digest in engine.items():  # vocabulary padding: rows past the checkpoint's
        if name in reference and digest.shape[0] > reference[name].shape[0]:
            engine[name] = digest[: reference[name].shape[0]]
    return mismatches(reference, engine)
