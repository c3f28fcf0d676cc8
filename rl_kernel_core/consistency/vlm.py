"""A ``transformers`` vision-language model (Qwen2-VL / Qwen2.5-VL style: vision tower, patch
merger, language model with 3-D multimodal rotary positions) in batch-invariant mode, and the two
layouts the consistency chain compares: ``generate`` over a KV cache (rollout) and one padded
training forward.

:func:`use_mode_vlm` makes a model follow the mode:

* attention, the language model's (causal) and the vision tower's (full attention over each
  image's patches), through :func:`rl_kernel_core.consistency.hf.use_mode_attention` (transformers'
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
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from rl_kernel_core.consistency import hf
from rl_kernel_core.consistency.chain import selected_logprobs
from rl_kernel_core.invariance import is_batch_invariant

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
    return (type(conv) in _MODE_CONVS and tuple(conv.kernel_size) == tuple(conv.stride)
            and not isinstance(conv.padding, str) and all(p == 0 for p in conv.padding)
            and all(d == 1 for d in conv.dilation) and conv.groups == 1 and conv.padding_mode == "zeros")


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
                raise ValueError(f"model: convolution {name!r} ({sub}) is not a patchify convolution (kernel == "
                                 "stride, no padding, dilation 1, one group); batch-invariant mode does not cover it")
            sub.__class__ = _MODE_CONVS[type(sub)]
            switched.append(name)
    return switched


def use_mode_vlm(model) -> list[str]:
    """Make a transformers VLM follow batch-invariant mode: its attention implementation becomes
    ``rl_kernel_varlen`` (:func:`~rl_kernel_core.consistency.hf.use_mode_attention`, language model
    and vision tower) and its patch embedding :func:`use_mode_patch_convolutions`'s. Idempotent;
    returns the switched convolutions' module names."""
    switched = use_mode_patch_convolutions(model)
    hf.use_mode_attention(model)
    return switched


@dataclass(frozen=True)
class Sample:
    """One multimodal sequence as a processor lays it out, unpadded.

    ``input_ids`` ``[L]`` int64: the prompt (text and image placeholder tokens) then the response;
    ``mm_token_type_ids`` ``[L]`` int: 0 text, 1 image (transformers' convention, from which the
    model builds its 3-D rotary positions); ``pixel_values`` ``[P, K]`` float: the images' patches,
    flattened as the processor flattens them; ``image_grid_thw`` ``[I, 3]`` int64: each image's
    (t, h, w) patch grid; ``prompt_len``: the tokens before the response.
    """

    input_ids: torch.Tensor
    mm_token_type_ids: torch.Tensor
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    prompt_len: int

    def response(self, response_ids: torch.Tensor) -> "Sample":
        """This prompt followed by ``response_ids`` ``[R]`` (text tokens)."""
        prompt = self.input_ids[:self.prompt_len]
        types = self.mm_token_type_ids[:self.prompt_len]
        return Sample(torch.cat([prompt, response_ids.to(prompt)]),
                      torch.cat([types, torch.zeros_like(response_ids, dtype=types.dtype)]),
                      self.pixel_values, self.image_grid_thw, self.prompt_len)


def pad(samples: Sequence[Sample], side: str, pad_id: int) -> dict[str, torch.Tensor]:
    """The model's keyword arguments for ``samples`` padded on ``side`` (``"left"``/``"right"``)
    to ``[B, L_max]``: ``input_ids``, ``attention_mask`` (1 real, 0 pad), ``mm_token_type_ids``
    (0 at pads), ``pixel_values`` ``[sum P, K]`` and ``image_grid_thw`` ``[sum I, 3]`` in sample order."""
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    if not samples:
        raise ValueError("samples must hold at least one sample, got none")
    width = max(len(s.input_ids) for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    types = torch.zeros_like(ids)
    for b, s in enumerate(samples):
        cols = slice(width - len(s.input_ids), width) if side == "left" else slice(0, len(s.input_ids))
        ids[b, cols], mask[b, cols], types[b, cols] = s.input_ids, 1, s.mm_token_type_ids
    return {"input_ids": ids, "attention_mask": mask, "mm_token_type_ids": types,
            "pixel_values": torch.cat([s.pixel_values for s in samples]),
            "image_grid_thw": torch.cat([s.image_grid_thw for s in samples])}


def _to(kwargs: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    device = next(model.parameters()).device
    return {k: v.to(device) for k, v in kwargs.items()}


def training_logprobs(model, samples: Sequence[Sample], side: str, pad_id: int) -> list[torch.Tensor]:
    """One forward over ``samples`` padded on ``side`` (positions from the model's own 3-D rotary
    index); per sample, fp32 ``[L_b - prompt_len_b]``: the log-probs of its response tokens."""
    kwargs = _to(pad(samples, side, pad_id), model)
    logits = model(**kwargs, use_cache=False).logits
    width = kwargs["input_ids"].shape[1]
    out = []
    for b, s in enumerate(samples):
        start = width - len(s.input_ids) if side == "left" else 0
        rows = logits[b, start + s.prompt_len - 1:start + len(s.input_ids) - 1]
        out.append(selected_logprobs(rows, s.input_ids[s.prompt_len:].to(rows.device)))
    return out


def generate_logprobs(model, prompts: Sequence[Sample], max_new_tokens: int, pad_id: int,
                      suppress_ids: Sequence[int] = ()) -> tuple[list[Sample], list[torch.Tensor]]:
    """Rollout: ``model.generate`` (greedy, KV cache, left-padded prompts, exactly
    ``max_new_tokens`` tokens each; ``suppress_ids`` are never generated: image placeholders)
    over ``prompts`` in one batch. Returns each prompt followed by its response, and per sample
    the fp32 ``[max_new_tokens]`` log-probs of the response tokens under the step's logits."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    kwargs = _to(pad(prompts, "left", pad_id), model)
    out = model.generate(**kwargs, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=pad_id, suppress_tokens=list(suppress_ids) or None,
                         output_logits=True, return_dict_in_generate=True)
    width = kwargs["input_ids"].shape[1]
    tokens = out.sequences[:, width:]
    logprobs = selected_logprobs(torch.stack(out.logits, 1), tokens)
    return [p.response(tokens[b].cpu()) for b, p in enumerate(prompts)], list(logprobs.unbind(0))


def image_prompt(text_ids: Sequence[Sequence[int]], grids: Sequence[tuple[int, int, int]], config,
                 generator: Optional[torch.Generator] = None) -> Sample:
    """A prompt of text pieces around images, as Qwen2-VL's processor lays one out:
    ``text_ids[0]``, then per image ``<vision_start>``, its ``t*h*w // merge**2`` image tokens,
    ``<vision_end>`` and the next text piece (``len(text_ids) == len(grids) + 1``). ``grids`` are the
    images' (t, h, w) patch grids (t == 1: images); ``pixel_values`` are drawn from ``generator``
    (``N(0, 1)``, the processor's normalised range). ``config``: the model's (``image_token_id``,
    ``vision_start_token_id``, ``vision_end_token_id``, ``vision_config``)."""
    if not grids:
        raise ValueError("grids must hold at least one image grid, got none")
    if len(text_ids) != len(grids) + 1:
        raise ValueError(f"text_ids must hold one more piece than grids ({len(grids) + 1}), got {len(text_ids)}")
    vision = config.vision_config
    merge = vision.spatial_merge_size
    patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    ids, types, pixels = list(text_ids[0]), [0] * len(text_ids[0]), []
    for (t, h, w), text in zip(grids, text_ids[1:]):
        if t != 1 or h % merge or w % merge:
            raise ValueError(f"grids: an image grid needs t == 1 and h, w multiples of {merge}, got {(t, h, w)}")
        n = h * w // merge ** 2
        ids += [config.vision_start_token_id] + [config.image_token_id] * n + [config.vision_end_token_id] + list(text)
        types += [0] + [1] * n + [0] + [0] * len(text)
        pixels.append(torch.randn(h * w, patch, generator=generator))
    return Sample(torch.tensor(ids), torch.tensor(types), torch.cat(pixels), torch.tensor([list(g) for g in grids]), len(ids))
