"""Native ``linear_logprob``: the chunked route with the CUDA per-chunk pass of
``native/csrc/linear_logprob.cu``, as the custom op ``rl_kernel::native_linear_logprob`` and its
backward (schemas and autograd glue in :mod:`rl_kernel_core.linear.opdef`), registered as the
``native`` backend. Importing this module builds the ``linear_logprob`` extension.

Per fixed-size chunk of rows (a function of V only) cuBLAS writes fp32 logits
(:mod:`rl_kernel_core.linear.chunks`, the driver the Triton backend uses too) and one CUDA pass
forms the statistics or, in the backward, the logit gradient in place; then ``dh = dl W`` and
``dW += dl^T h`` (cuBLAS). Deterministic; a row's log-prob, entropy and ``dh`` do not depend on
N or on the other rows. Single-process only (``supports`` refuses ``tp_group``).
"""

from __future__ import annotations

from typing import Optional

import torch

from rl_kernel_core import dispatch
from rl_kernel_core.linear import chunks as LC
from rl_kernel_core.linear import opdef
from rl_kernel_core.native import extension
from rl_kernel_core.opdef import fp64_reason

Tensor = torch.Tensor
_ext = extension("linear_logprob")
ROUTE = "chunked"
"""The native passes read the cuBLAS fp32 logits chunk, for every pass."""


def _stats(chunk: LC.Chunk, lp: Tensor, ent: Optional[Tensor], lse: Tensor) -> None:
    """``lp``, ``lse`` and (unless None) ``ent`` (fp32 ``[n]``) of the first ``n`` rows of the logits
    chunk ``chunk.x``: one block per row."""
    _ext.linear_chunk_stats(chunk.x, chunk.bias, chunk.targets, chunk.inv_temp, chunk.ignore_index, lp, ent, lse)


def _grad(chunk: LC.Chunk, lse: Tensor, ent: Optional[Tensor], g_lp: Tensor, g_ent: Optional[Tensor]) -> Tensor:
    """``dl`` written in place over the logits chunk ``chunk.x`` from the saved ``lse``/``ent`` and fp32
    ``g_lp``/``g_ent``: one block per row."""
    ent_used = None if g_ent is None else ent
    _ext.linear_chunk_grad(
        chunk.x, chunk.buf.dl, chunk.bias, chunk.targets, lse, ent_used, g_lp, g_ent, chunk.inv_temp, chunk.ignore_index
    )
    return chunk.buf.padded_dl(chunk.n)


PASSES = LC.ChunkPasses(stats=_stats, grad=_grad)
"""The CUDA per-chunk passes the chunk driver runs on the chunked route."""


def _forward(hidden, weight, bias, targets, temperature, ignore_index, return_entropy, tp_group, tuning):
    """The forward custom op's body (schema :data:`rl_kernel_core.linear.opdef.LINEAR_SCHEMA`; ``tp_group`` is None)."""
    with LC.tuning_of(tuning):
        return LC.linear_forward(
            hidden, weight, bias, targets, temperature, ignore_index, return_entropy, ROUTE, PASSES
        )


def _backward(*args):
    """The backward custom op's body (arguments: :class:`~rl_kernel_core.linear.chunks.BackwardArgs`):
    ``(dh, dW, db)``, ``[0]`` where not asked for."""
    call = LC.BackwardArgs(*args)
    with LC.tuning_of(call.tuning):  # autograd may run the backward on another thread: the forward's tuning, named
        return LC.linear_backward(call, ROUTE, PASSES)


def _supports(hidden, weight, targets, bias, temperature, ignore_index, return_entropy, tp_group) -> Optional[str]:
    reason = fp64_reason("native", hidden=hidden)
    if reason is None and tp_group is not None:
        reason = (
            "the native linear_logprob is single-process; tp_group (vocab parallel) needs backend='triton' or 'torch'"
        )
    if reason is None and hidden.is_cuda and not LC.fp32_logits_supported(hidden.device, hidden.dtype):
        reason = f"this torch's cuBLAS mm cannot write fp32 logits from {str(hidden.dtype).replace('torch.', '')} operands (mm(out_dtype=)), which the native chunk pass reads"
    return reason


linear_logprob = dispatch.register("linear_logprob", "native", supports=_supports)(
    opdef.define_linear_logprob("native_linear_logprob", _forward, _backward)
)
