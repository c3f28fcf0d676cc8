"""Argument checks shared by the public ops.

Every failure raises ``TypeError`` (wrong type or dtype) or ``ValueError`` (wrong shape, device,
range, value) with a message that names the argument, what was expected and what was found.
Nothing here casts or moves tensors.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

import torch

from .switches import env_flag

FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
INDEX_DTYPES: tuple[torch.dtype, ...] = (torch.int64, torch.int32)


def _names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def brief(value: object) -> str:
    """``value`` as an error message shows what it got: on one line of at most 80 characters, a
    tensor as its dtype and shape (never its elements), anything else as its repr."""
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).replace("torch.", "")
        return f"{'an' if dtype[0] in 'aeiou' else 'a'} {dtype} tensor of shape {tuple(value.shape)}"
    text = " ".join(repr(value).split())
    return text if len(text) <= 80 else text[:77] + "..."


def tensor(
    name: str,
    value: object,
    *,
    dtypes: Optional[Sequence[torch.dtype]] = None,
    ndim: Optional[int] = None,
    min_ndim: Optional[int] = None,
) -> torch.Tensor:
    """Check that ``value`` is a dense (strided) tensor with an allowed dtype and rank; return it.

    Meta tensors pass: the ops that never read a value back run on them (shapes only), and
    :func:`needs_data` refuses them where a value must be read."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.layout != torch.strided:
        raise TypeError(
            f"{name} must be a dense (strided) tensor, got layout {str(value.layout).replace('torch.', '')}"
        )
    if dtypes is not None and value.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in ({_names(dtypes)}), got {str(value.dtype).replace('torch.', '')}")
    if ndim is not None and value.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(value.shape)}")
    if min_ndim is not None and value.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dims, got shape {tuple(value.shape)}")
    return value


def optional_tensor(name: str, value: object, **kwargs) -> Optional[torch.Tensor]:
    """Like :func:`tensor`, but ``None`` passes through."""
    return None if value is None else tensor(name, value, **kwargs)


def same_device(reference_name: str, reference: torch.Tensor, **others: Optional[torch.Tensor]) -> None:
    """Every tensor in ``others`` must live on ``reference``'s device."""
    for name, t in others.items():
        if t is not None and t.device != reference.device:
            raise ValueError(f"{name} must be on {reference_name}'s device {reference.device}, got {t.device}")


def shape(name: str, t: torch.Tensor, expected: Sequence[int], expected_text: Optional[str] = None) -> None:
    """``t`` must have exactly shape ``expected``."""
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {expected_text or tuple(expected)}, got {tuple(t.shape)}")


def same_shape(reference_name: str, reference: torch.Tensor, **others: Optional[torch.Tensor]) -> None:
    """Every tensor in ``others`` must have ``reference``'s shape."""
    for name, t in others.items():
        if t is not None and t.shape != reference.shape:
            raise ValueError(
                f"{name} must have the shape of {reference_name} {tuple(reference.shape)}, got {tuple(t.shape)}"
            )


def lm_head_inputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    targets: torch.Tensor,
    *,
    min_ndim: int,
    vocab_name: str,
) -> None:
    """The inputs of an op on an LM head: ``hidden [..., D]`` float with at least ``min_ndim``
    dims, ``weight [V, D]`` and ``bias [V]`` (or None) in its dtype, integer ``targets`` of its
    leading shape, all on one device, ``D`` and ``V`` at least 1. ``vocab_name`` is what the
    messages call ``V`` (``V_local`` for one tensor-parallel shard of the head). Target ids are
    not read here (:func:`target_ids` does that, one host sync)."""
    tensor("hidden", hidden, dtypes=FLOAT_DTYPES, min_ndim=min_ndim)
    tensor("weight", weight, dtypes=(hidden.dtype,), ndim=2)
    optional_tensor("bias", bias, dtypes=(hidden.dtype,), ndim=1)
    tensor("targets", targets, dtypes=INDEX_DTYPES)
    same_device("hidden", hidden, weight=weight, bias=bias, targets=targets)
    dim = hidden.shape[-1]
    vocab = weight.shape[0]
    if dim == 0:
        raise ValueError(f"hidden's last dim D must be >= 1, got shape {tuple(hidden.shape)}")
    shape("weight", weight, (vocab, dim), f"[{vocab_name}, D={dim}]")
    if vocab == 0:
        raise ValueError(f"weight must hold at least one vocab row, got shape {tuple(weight.shape)}")
    if bias is not None:
        shape("bias", bias, (vocab,), f"[{vocab_name}={vocab}]")
    shape("targets", targets, hidden.shape[:-1], f"hidden's leading shape {tuple(hidden.shape[:-1])}")


ID_CHECKS = ("host", "device")
"""Where :func:`target_ids` checks: ``"host"`` raises a ValueError (one device→host sync),
``"device"`` asserts on the device (no sync; a bad id aborts the CUDA context)."""


def target_ids(name: str, targets: torch.Tensor, vocab: int, ignore_index: int, where: str = "host") -> None:
    """Every id in ``targets`` is in ``[0, vocab)`` or equals ``ignore_index``.

    ``where="host"`` costs one device→host sync (a single flag; the range for the message is read
    only when the check fails); the public ops do this by default because an out-of-range id would
    otherwise read out of bounds inside a kernel. ``where="device"``, and any check under
    ``torch.compile``, is a device-side assert instead (no sync, no graph break), failing at run
    time: for callers whose ids come from their own sampler, in a loop a sync would stall.
    """
    if where not in ID_CHECKS:
        raise ValueError(f"id_check must be one of {ID_CHECKS}, got {where!r}")
    if targets.numel() == 0:
        return
    needs_data(name, targets, "its ids are checked against the vocab")
    bad = ((targets < 0) | (targets >= vocab)) & (targets != ignore_index)
    if where == "device" or torch.compiler.is_compiling():
        torch._assert_async(~bad.any(), f"{name} ids must be in [0, {vocab}) or equal ignore_index={ignore_index}")
        return
    if bool(bad.any()):
        ids = targets[bad]
        raise ValueError(
            f"{name} ids must be in [0, {vocab}) or equal ignore_index={ignore_index}, "
            f"got {ids.numel()} outside it, in [{int(ids.min())}, {int(ids.max())}]"
        )


CHECK_VALUES_ENV = "RL_KERNEL_CHECK_VALUES"
"""A boolean switch (:mod:`rl_kernel_core.switches`): on, the values of GPU tensors are checked
too (:func:`non_negative_weights`), at one device->host sync per check."""


def values_checked(t: torch.Tensor) -> bool:
    """Whether value checks read ``t``: always on CPU (no sync), elsewhere only with
    ``RL_KERNEL_CHECK_VALUES`` on (read at each call; an unaccepted spelling raises ``SwitchError``)."""
    return t.device.type == "cpu" or env_flag(CHECK_VALUES_ENV)


def non_negative_weights(name: str, weights: torch.Tensor) -> None:
    """Every entry of a float weight tensor is >= 0 (NaN fails); a bool tensor passes.

    CPU tensors are always checked (no sync). Other devices are checked only when
    ``RL_KERNEL_CHECK_VALUES`` is on, since the check reads a flag back to the host (one sync, which
    the losses otherwise never make); under ``torch.compile`` it is a device-side assert.
    """
    if weights.dtype == torch.bool or weights.numel() == 0 or weights.is_meta:
        return
    if not values_checked(weights):
        return
    bad = ~(weights >= 0)
    if torch.compiler.is_compiling():
        torch._assert_async(~bad.any(), f"{name} weights must be >= 0 and not NaN")
        return
    if bool(bad.any()):
        values = weights[bad]
        nan = int(values.isnan().sum())
        low = values[~values.isnan()]
        smallest = f", the smallest {low.min().item():.6g}" if low.numel() else ""
        raise ValueError(
            f"{name} weights must be >= 0 and not NaN, got {values.numel()} entries outside it ({nan} NaN{smallest})"
        )


def needs_data(name: str, t: torch.Tensor, why: str) -> None:
    """``t`` is not a meta tensor (shape without data), outside ``torch.compile`` (whose fake
    tensors are not meta tensors and pass anyway); ``why`` says what reads its values."""
    if t.is_meta and not torch.compiler.is_compiling():
        raise ValueError(f"{name} must hold data ({why}), got a meta tensor of shape {tuple(t.shape)}")


def number(name: str, value: float, expected: str = "a finite number") -> float:
    """A finite int or float, as a float; an int beyond the float range is refused as infinity
    is. ``expected`` is what the message says ``name`` must be."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    try:
        converted = float(value)
    except OverflowError:
        raise ValueError(f"{name} must be {expected}, got an int of {int(value).bit_length()} bits") from None
    if not math.isfinite(converted):
        raise ValueError(f"{name} must be {expected}, got {value}")
    return converted


def positive(name: str, value: float) -> float:
    """A finite number > 0."""
    converted = number(name, value, "a finite number > 0")
    if not converted > 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return converted


SMALLEST_TEMPERATURE: float = torch.finfo(torch.float32).tiny
"""The smallest temperature the ops take: the smallest normal fp32, ``2**-126`` (about 1.18e-38).
The kernels scale logits by ``1 / temperature`` in fp32; below it the temperature itself is a
subnormal fp32 and, further down, that reciprocal overflows, which would turn the logits into
inf/NaN."""

LARGEST_TEMPERATURE: float = 1.0 / SMALLEST_TEMPERATURE
"""The largest temperature the ops take: ``2**126`` (about 8.51e37), the reciprocal of
:data:`SMALLEST_TEMPERATURE`. Above it ``1 / temperature`` is a subnormal fp32 or rounds to 0, and a
factor of 0 turns the kernels' ``-inf`` entries (masked logits, padded lanes) into NaN."""


def temperature_bounds(name: str) -> str:
    """The accepted temperatures as error messages state them."""
    return (
        f">= {SMALLEST_TEMPERATURE:.8g} and <= {LARGEST_TEMPERATURE:.8g} (2**-126 and 2**126, so that "
        f"{name} and 1/{name} are normal fp32 numbers)"
    )


def temperature(name: str, value: float) -> float:
    """A number in ``[SMALLEST_TEMPERATURE, LARGEST_TEMPERATURE]``, so that it and ``1 / value`` are
    normal fp32 numbers."""
    value = positive(name, value)
    if not SMALLEST_TEMPERATURE <= value <= LARGEST_TEMPERATURE:
        raise ValueError(f"{name} must be {temperature_bounds(name)}, got {value!r}")
    return value


def int64(name: str, value: int) -> int:
    """An ``int`` (not a bool) in the int64 range (ids are compared against it as int64)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    lo, hi = -(2**63), 2**63 - 1
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in the int64 range [{lo}, {hi}], got {value}")
    return value


def non_negative(name: str, value: float) -> float:
    """A finite number >= 0."""
    converted = number(name, value, "a finite number >= 0")
    if not converted >= 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")
    return converted


def choice(name: str, value: str, allowed: Sequence[str]) -> str:
    """``value`` must be one of ``allowed``."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")
    return value
