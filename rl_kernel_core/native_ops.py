"""The native CUDA kernels as ``torch.library`` custom ops, and their registration as the ``native`` backend.

Imported by :mod:`rl_kernel_core.native` once the extension is built (importing this module
first builds it the same way). Each op pairs a forward and a backward custom op
(``rl_kernel::native_*``) with the schemas of the Triton ones; the fake implementations and the
autograd glue are shared with them (:mod:`rl_kernel_core._custom_ops`), so
``torch.compile(fullgraph=True)`` traces through these ops and AOTAutograd sees their backward.

Registered backend implementations (signatures in :mod:`rl_kernel_core.logprob`,
:mod:`rl_kernel_core.policy_loss` and :mod:`rl_kernel_core.advantages`): ``logprob_from_logits``,
``ratio_kl``, ``policy_loss``, ``group_advantages``, and ``linear_logprob``, whose chunk driver,
autograd node and cuBLAS products are the Triton backend's chunked route
(:mod:`rl_kernel_core.triton.linear_logprob`) with the per-chunk pass replaced by the CUDA one
(:class:`NativeChunkBuffers`). The kernels (``native/csrc``) compute in fp32
(``group_advantages`` in fp64, as the reference) and reduce in a fixed order without float
atomics: results are bitwise equal run to run. ``supports`` refuses fp64 log-probs/logits (use
``backend="torch"``) and gradients the kernels do not form.

``auto``: :data:`MEASURED_PREFERENCE` holds, per GPU architecture (compute capability), the
backend order each op's ``auto`` follows, from the native-vs-Triton timings recorded in
``benchmarks/results/bench_native_h100.json``; on an architecture not in it, dispatch's default
order (native first) applies, except for the ops in :data:`UNMEASURED_PREFERENCE` (Triton first).
"""

from __future__ import annotations

from typing import Optional

import torch

from rl_kernel_core import _custom_ops as glue
from rl_kernel_core import dispatch
from rl_kernel_core.loss_codes import AGG_CODES, ESTIMATOR_CODES, KL_CODES
from rl_kernel_core.native import EXTENSION as _ext
from rl_kernel_core.triton import _linear_kernels as LK
from rl_kernel_core.triton import linear_logprob as triton_linear

Tensor = torch.Tensor

# codes of the C++ entry points (native/csrc/ops.h)

MEASURED_PREFERENCE: dict[str, dict[str, tuple[str, ...]]] = {
    # H100 (sm_90), benchmarks/results/bench_native_h100.json: logprob_from_logits fwd+bwd (N=8192,
    # V=151936, bf16) native 2.79 ms / triton 3.11 ms; policy_loss fwd+bwd (1M tokens, CUDA graph)
    # native 32.8 us / triton 23.3 us; ratio_kl fwd+bwd (1M, CUDA graph) native 51.9 us / triton
    # 47.5 us; group_advantages (64k rewards by index) native 0.28 ms / triton 0.49 ms;
    # linear_logprob (N=16384, D=4096, V=128256: 2 no-grad forwards + 1 fwd+bwd with entropy)
    # native 192.5 ms / triton 178.5 ms
    "9.0": {
        "logprob_from_logits": ("native", "triton", "torch"),
        "policy_loss": ("triton", "native", "torch"),
        "ratio_kl": ("triton", "native", "torch"),
        "group_advantages": ("native", "triton", "torch"),
        "linear_logprob": ("triton", "native", "torch"),
    },
}
"""``{compute capability: {op: auto order}}``: the faster of native and triton first, as measured by ``benchmarks/bench_native.py``."""


def _kl(kl_type: str) -> tuple[int, bool]:
    """``(base estimator code, straight-through k2 gradient)`` for a canonical ``kl_type``."""
    plus = kl_type.endswith("+")
    return KL_CODES[kl_type.rstrip("+")], plus


# ---------------------------------------------------------------- logprob_from_logits


def _logprob_from_logits_fwd(
    logits: Tensor, targets: Tensor, temperature: float, ignore_index: int, return_entropy: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """``(logprob [N], entropy [N] or [0], lse [N])`` fp32 from ``logits [N, V]`` (one read; see ``native/csrc/logprob.cu``)."""
    logprob, entropy, lse = _ext.logprob_fwd(logits, targets, temperature, ignore_index, return_entropy)
    return logprob, entropy, lse


def _logprob_from_logits_bwd(
    logits: Tensor, targets: Tensor, lse: Tensor, entropy: Tensor,
    grad_logprob: Optional[Tensor], grad_entropy: Optional[Tensor], temperature: float, ignore_index: int,
) -> Tensor:
    """``d/d logits`` ``[N, V]`` in the logits' dtype, the softmax recomputed from ``logits`` and ``lse``."""
    return _ext.logprob_bwd(logits, targets, lse, entropy, grad_logprob, grad_entropy, temperature, ignore_index)


_logprob_from_logits_op = glue.define_differentiable_op(
    "native_logprob_from_logits", _logprob_from_logits_fwd, glue.logprob_fake,
    _logprob_from_logits_bwd, glue.logprob_backward_fake, glue.logprob_setup, glue.logprob_backward,
)


logprob_from_logits = dispatch.register("logprob_from_logits", "native", supports=glue.logprob_supports("native"))(
    glue.logprob_impl(_logprob_from_logits_op)
)


# ---------------------------------------------------------------- ratio_kl


def _ratio_kl_fwd(logprob: Tensor, old_logprob: Tensor, ref_logprob: Tensor, kl_type: str) -> tuple[Tensor, Tensor]:
    """``(ratio, kl)`` fp32 of the input shape."""
    ratio, kl = _ext.ratio_kl_fwd(logprob, old_logprob, ref_logprob, _kl(kl_type)[0])
    return ratio, kl


def _ratio_kl_bwd(
    logprob: Tensor, old_logprob: Tensor, ref_logprob: Tensor,
    grad_ratio: Optional[Tensor], grad_kl: Optional[Tensor], kl_type: str,
) -> Tensor:
    """``d/d logprob`` of ``sum(grad_ratio·ratio + grad_kl·kl)`` in ``logprob``'s dtype (None counts as 0)."""
    code, plus = _kl(kl_type)
    return _ext.ratio_kl_bwd(logprob, old_logprob, ref_logprob, grad_ratio, grad_kl, code, plus)


_ratio_kl_op = glue.define_differentiable_op(
    "native_ratio_kl", _ratio_kl_fwd, glue.ratio_kl_fake, _ratio_kl_bwd, glue.ratio_kl_backward_fake,
    glue.ratio_kl_setup, glue.ratio_kl_backward,
)


ratio_kl = dispatch.register("ratio_kl", "native", supports=glue.ratio_kl_supports("native"))(glue.ratio_kl_impl(_ratio_kl_op))


# ---------------------------------------------------------------- policy_loss


def _policy_loss_fwd(
    logprob: Tensor, old_logprob: Tensor, advantages: Tensor, mask: Tensor, ref_logprob: Tensor,
    entropy: Optional[Tensor], rollout_is_weights: Optional[Tensor],
    clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: Optional[float], kl_type: str,
    kl_coef: float, entropy_coef: float, loss_agg_mode: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(loss [], metrics [6], seq_weight [S], totals [2])`` fp32 over ``[S, T]`` tensors; metrics in :data:`rl_kernel_core.policy_loss.METRIC_NAMES` order."""
    loss, metrics, seq_weight, totals = _ext.policy_loss_fwd(
        logprob, old_logprob, advantages, mask, ref_logprob, entropy, rollout_is_weights,
        clip_ratio_low, clip_ratio_high, clip_ratio_c, _kl(kl_type)[0], kl_coef, entropy_coef, AGG_CODES[loss_agg_mode],
    )
    return loss, metrics, seq_weight, totals


def _policy_loss_bwd(
    grad_loss: Tensor, logprob: Tensor, old_logprob: Tensor, advantages: Tensor, mask: Tensor, ref_logprob: Tensor,
    rollout_is_weights: Optional[Tensor], seq_weight: Tensor, totals: Tensor,
    clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: Optional[float], kl_type: str,
    kl_coef: float, entropy_coef: float, loss_agg_mode: str,
    need_logprob_grad: bool, entropy_dtype: Optional[torch.dtype],
) -> tuple[Tensor, Tensor]:
    """``(d loss / d logprob, d loss / d entropy)`` in logprob's / ``entropy_dtype``; one not asked for is an empty ``[0]`` tensor."""
    grad_lp = torch.empty(logprob.shape, dtype=logprob.dtype, device=logprob.device) if need_logprob_grad else None
    grad_ent = torch.empty(logprob.shape, dtype=entropy_dtype, device=logprob.device) if entropy_dtype is not None else None
    code, plus = _kl(kl_type)
    _ext.policy_loss_bwd(
        grad_loss, logprob, old_logprob, advantages, mask, ref_logprob, rollout_is_weights, seq_weight, totals,
        clip_ratio_low, clip_ratio_high, clip_ratio_c, code, plus, kl_coef, entropy_coef, AGG_CODES[loss_agg_mode],
        grad_lp, grad_ent,
    )
    empty = logprob.new_empty(0)
    return (empty if grad_lp is None else grad_lp), (empty.clone() if grad_ent is None else grad_ent)


_policy_loss_op = glue.define_differentiable_op(
    "native_policy_loss", _policy_loss_fwd, glue.policy_loss_fake, _policy_loss_bwd, glue.policy_loss_backward_fake,
    glue.policy_loss_setup, glue.policy_loss_backward,
)


policy_loss = dispatch.register(
    "policy_loss", "native", supports=glue.policy_loss_supports("native")
)(glue.policy_loss_impl(_policy_loss_op))


# ---------------------------------------------------------------- group_advantages


@torch.library.custom_op("rl_kernel::native_group_advantages", mutates_args=())
def group_advantages_op(
    rewards: Tensor, group_size: Optional[int], group_index: Optional[Tensor], estimator: str, norm_by_std: bool, eps: float
) -> Tensor:
    """Advantages ``[N]`` (fp32; fp64 for fp64 rewards), group statistics in fp64."""
    return _ext.group_advantages(rewards, group_size, group_index, ESTIMATOR_CODES[estimator], norm_by_std, eps)


group_advantages_op.register_fake(glue.group_advantages_fake)


group_advantages = dispatch.register("group_advantages", "native")(glue.group_advantages_impl(group_advantages_op))


# ---------------------------------------------------------------- linear_logprob


class NativeChunkBuffers(LK.ChunkBuffers):
    """The chunked route's buffers (cuBLAS fp32 logits per fixed-size chunk of rows) with the CUDA
    per-chunk pass of ``native/csrc/linear_logprob.cu``: one block per row computes LSE, target
    logit and entropy, or overwrites the fp32 logits with ``dl`` in place."""

    @staticmethod
    def route_for(hidden: Tensor) -> str:
        """Always ``"chunked"``, for every pass: the CUDA pass reads the cuBLAS logits chunk."""
        return "chunked"

    def stats(
        self, x: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor, n: int,
        inv_temp: float, ignore_index: int, lp: Tensor, ent: Optional[Tensor], lse: Tensor,
    ) -> None:
        """``lp``, ``lse`` and (unless None) ``ent`` (fp32 ``[n]``) of the first ``n`` rows of the logits chunk ``x``."""
        _ext.linear_chunk_stats(x, bias, targets, inv_temp, ignore_index, lp, ent, lse)

    def grad_pass(
        self, x: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor, n: int,
        inv_temp: float, ignore_index: int, lse: Tensor, ent: Optional[Tensor],
        g_lp: Tensor, g_ent: Optional[Tensor],
    ) -> None:
        """``self.dl[:n]`` (in place over the logits chunk ``x``) from the saved ``lse``/``ent`` and fp32 ``g_lp``/``g_ent``."""
        _ext.linear_chunk_grad(x, self.dl, bias, targets, lse, None if g_ent is None else ent, g_lp, g_ent, inv_temp, ignore_index)


def _linear_logprob_supports(hidden, weight, targets, bias, temperature, ignore_index, return_entropy, tp_group) -> Optional[str]:
    reason = glue.fp64_reason("native", hidden=hidden)
    if reason is None and tp_group is not None:
        reason = "the native linear_logprob is single-process; tp_group (vocab parallel) needs backend='triton' or 'torch'"
    if reason is None and hidden.is_cuda and not LK.fp32_logits_supported(hidden.device, hidden.dtype):
        reason = f"this torch's cuBLAS mm cannot write fp32 logits from {str(hidden.dtype).replace('torch.', '')} operands (mm(out_dtype=)), which the native chunk pass reads"
    return reason


@dispatch.register("linear_logprob", "native", supports=_linear_logprob_supports)
def linear_logprob(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Optional[Tensor],
    temperature: float,
    ignore_index: int,
    return_entropy: bool,
    tp_group: Optional["torch.distributed.ProcessGroup"],
) -> tuple[Tensor, Optional[Tensor]]:
    """Validated CUDA ``hidden [N, D]``, ``weight [V, D]``, ``targets [N]`` → ``(logprob [N], entropy [N] or None)``, fp32.

    16-bit or fp32 ``hidden``/``weight``/``bias`` (one dtype); ``targets`` in ``[0, V)`` or
    ``ignore_index`` (0 log-prob, 0 entropy, no gradient). Per fixed-size chunk of rows (a function
    of V only), cuBLAS writes fp32 logits and one CUDA pass forms the statistics or, in the
    backward, the logit gradient in place; then ``dh = dl W`` and ``dW += dl^T h`` (cuBLAS).
    Differentiable in ``hidden``, ``weight`` and ``bias`` when grad mode is on and one requires
    grad; otherwise forward-only, nothing saved. Deterministic; a row's log-prob, entropy and
    ``dh`` do not depend on N or on the other rows. ``tp_group`` must be None (``supports``).
    """
    return triton_linear.run_chunked(hidden, weight, targets, bias, temperature, ignore_index, return_entropy, tp_group, NativeChunkBuffers)


# ---------------------------------------------------------------- auto order on this GPU


UNMEASURED_PREFERENCE: dict[str, tuple[str, ...]] = {"linear_logprob": ("triton", "native", "torch")}
"""``{op: auto order}`` on every architecture until ``MEASURED_PREFERENCE`` has a measurement of the op there."""


def _apply_measured_preference() -> None:
    for op, order in UNMEASURED_PREFERENCE.items():
        dispatch.set_preference(op, order)
    major, minor = torch.cuda.get_device_capability()
    for op, order in MEASURED_PREFERENCE.get(f"{major}.{minor}", {}).items():
        dispatch.set_preference(op, order)


_apply_measured_preference()
