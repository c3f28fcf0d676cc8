"""A ``transformers`` vision-language model (Qwen2-VL / Qwen2.5-VL style: vision tower, patch
merger, language model with 3-D multimodal rotary positions) in batch-invariant mode. The two
layouts the consistency chain compares over such a model (``generate`` over a KV cache, one padded
training forward) are in :mod:`rl_kernel_core.tools.consistency.vlm`.

:func:`use_mode_vlm` makes a model follow the mode:

* attention, the language model's (causal) and the vision tower's (full attention over each
  image's patches), through :func:`rl_kernel_core.batch_invariant_mode.api_hf.use_mode_attention` (transformers'
  attention-interface registry: ``varlen_attention`` while the mode is on, ``sdpa`` while off);
* the patch embedding: a convolution whose kernel equals its stride (one output per patch, no
  padding, dilation or groups) is a product of each flattened patch with the flattened kernel.
  While the mode is on it runs as that product (``F.linear``, which the mode routes onto the
  batch-invariant matmul), so a patch's embedding does not depend on how many patches (images)
  share the call; library convolutions pick their algorithm from the call's shape. While the mode is
  off it is the library convolution.

Everything else is covered by the mode's ``aten`` routing (projections, MLPs, the merger's linears,
RMSNorm, LM head, log-softmax) or is row-wise already (LayerNorm, activations, rotary embeddings,
the scatter of image features into the text embeddings).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from rl_kernel_core.batch_invariant_mode import api_hf as hf
from rl_kernel_core.batch_invariant_mode.api import is_batch_invariant

_CONV_TYPES = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)


def _patch_product(conv: torch.nn.modules.conv._ConvNd, x: torch.Tensor) -> torch.Tensor:
    """``conv(x)`` for a patchify convolution as one product per patch: ``x`` ``[B, C, S_1..S_k]``
    -> ``[B, E, S_1 // K_1, .., S_k // K_k]`` (a trailing remainder is dropped, as the
    convolution drops it)."""
    kernel = conv.kernel_size
    k = len(kernel)
    grid = [s // kk for s, kk in zip(x.shape[2:], kernel)]
    for d, (g, kk) in enumerate(zip(grid, kernel)):
        x = x.narrow(2 + d, 0, g * kk)
    shape = [x.shape[0], x.shape[1]]
    for g, kk in zip(grid, kernel):
        shape += [g, kk]
    # [B, C, g1, k1, .., gk, kk] -> [B, g1..gk, C, k1..kk]: a patch's values in the kernel's order
    order = [0] + [2 + 2 * i for i in range(k)] + [1] + [3 + 2 * i for i in range(k)]
    patches = x.reshape(shape).permute(order).reshape(-1, conv.in_channels * math.prod(kernel))
    out = F.linear(patches, conv.weight.reshape(conv.out_channels, -1), conv.bias)
    return out.reshape(x.shape[0], *grid, conv.out_channels).movedim(-1, 1)


def _mode_conv_class(base: type) -> type:
    class ModePatchConv(base):
        """A patchify convolution: the per-patch product while batch-invariant mode is on
        (:func:`use_mode_vlm`), the library convolution while off."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if is_batch_invariant():
                return _patch_product(self, x)
            return super().forward(x)

    ModePatchConv.__name__ = ModePatchConv.__qualname__ = f"ModePatch{base.__name__}"
    return ModePatchConv


_MODE_CONVS: dict[type, type] = {base: _mode_conv_class(base) for base in _CONV_TYPES}


def _is_patchify(conv: torch.nn.modules.conv._ConvNd) -> bool:
    return (
        type(conv) in _MODE_CONVS
        and tuple(conv.kernel_size) == tuple(conv.stride)
        and not isinstance(conv.padding, str)
        and all(p == 0 for p in conv.padding)
        and all(d == 1 for d in conv.dilation)
        and conv.groups == 1
        and conv.padding_mode == "zeros"
    )


def use_mode_patch_convolutions(module: torch.nn.Module) -> list[str]:
    """Make each patchify convolution in ``module`` (kernel == stride, no padding, dilation 1,
    one group) compute the per-patch product while batch-invariant mode is on, the library
    convolution while off. The convolutions keep their parameters, names and state-dict keys (only
    their class changes), so an optimizer or a checkpoint sees the same model. Idempotent.
    Returns the switched convolutions' module names.

    Raises ``ValueError`` when ``module`` has a convolution that is not a patchify one: its result
    would depend on the library's algorithm choice, which the mode does not reach.
    """
    switched = []
    for name, sub in module.named_modules():
        if isinstance(sub, tuple(_MODE_CONVS.values())):
            switched.append(name)
        elif isinstance(sub, torch.nn.modules.conv._ConvNd):
            if not _is_patchify(sub):
                raise ValueError(
                    f"model: convolution {name!r} ({sub}) is not a patchify convolution (kernel == "
                    "stride, no padding, dilation 1, one group); batch-invariant mode does not cover it"
                )
            sub.__class__ = _MODE_CONVS[type(sub)]
            switched.append(name)
    return switched


def use_mode_vlm(model) -> list[str]:
    """Make a transformers VLM follow batch-invariant mode: its attention implementation becomes
    ``rl_kernel_varlen`` (:func:`~rl_kernel_core.batch_invariant_mode.api_hf.use_mode_attention`, language model
    and vision tower) and its patch embedding :func:`use_mode_patch_convolutions`'s. Idempotent;
    returns the switched convolutions' module names."""
    switched = use_mode_patch_convolutions(model)
    hf.use_mode_attention(model)
    return switched
