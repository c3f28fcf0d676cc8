"""The two layouts the consistency chain compares over a ``transformers`` vision-language model
(Qwen2-VL / Qwen2.5-VL style): ``generate`` over a KV cache (rollout) and one padded training
forward. The model follows the batch-invariant mode through
:func:`rl_kernel_core.batch_invariant_mode.api_vlm.use_mode_vlm`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from rl_kernel_core.tools.consistency.chain import selected_logprobs


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
        prompt = self.input_ids[: self.prompt_len]
        types = self.mm_token_type_ids[: self.prompt_len]
        return Sample(
            torch.cat([prompt, response_ids.to(prompt)]),
            torch.cat([types, torch.zeros_like(response_ids, dtype=types.dtype)]),
            self.pixel_values,
            self.image_grid_thw,
            self.prompt_len,
        )


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
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "mm_token_type_ids": types,
        "pixel_values": torch.cat([s.pixel_values for s in samples]),
        "image_grid_thw": torch.cat([s.image_grid_thw for s in samples]),
    }


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
        rows = logits[b, start + s.prompt_len - 1 : start + len(s.input_ids) - 1]
        out.append(selected_logprobs(rows, s.input_ids[s.prompt_len :].to(rows.device)))
    return out


def generate_logprobs(
    model, prompts: Sequence[Sample], max_new_tokens: int, pad_id: int, suppress_ids: Sequence[int] = ()
) -> tuple[list[Sample], list[torch.Tensor]]:
    """Rollout: ``model.generate`` (greedy, KV cache, left-padded prompts, exactly
    ``max_new_tokens`` tokens each; ``suppress_ids`` are never generated: image placeholders)
    over ``prompts`` in one batch. Returns each prompt followed by its response, and per sample
    the fp32 ``[max_new_tokens]`` log-probs of the response tokens under the step's logits."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    kwargs = _to(pad(prompts, "left", pad_id), model)
    out = model.generate(
        **kwargs,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=pad_id,
        suppress_tokens=list(suppress_ids) or None,
        output_logits=True,
        return_dict_in_generate=True,
    )
    width = kwargs["input_ids"].shape[1]
    tokens = out.sequences[:, width:]
    logprobs = selected_logprobs(torch.stack(out.logits, 1), tokens)
    return [p.response(tokens[b].cpu()) for b, p in enumerate(prompts)], list(logprobs.unbind(0))


def image_prompt(
    text_ids: Sequence[Sequence[int]],
    grids: Sequence[tuple[int, int, int]],
    config,
    generator: Optional[torch.Generator] = None,
) -> Sample:
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
    patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    ids, types, pixels = list(text_ids[0]), [0] * len(text_ids[0]), []
    for (t, h, w), text in zip(grids, text_ids[1:]):
        if t != 1 or h % merge or w % merge:
            raise ValueError(f"grids: an image grid needs t == 1 and h, w multiples of {merge}, got {(t, h, w)}")
        n = h * w // merge**2
        ids += [config.vision_start_token_id] + [config.image_token_id] * n + [config.vision_end_token_id] + list(text)
        types += [0] + [1] * n + [0] + [0] * len(text)
        pixels.append(torch.randn(h * w, patch, generator=generator))
    return Sample(
        torch.tensor(ids), torch.tensor(types), torch.cat(pixels), torch.tensor([list(g) for g in grids]), len(ids)
    )
