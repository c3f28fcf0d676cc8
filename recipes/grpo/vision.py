"""The embedded GRPO engine for an image-text model (:class:`VisionEngine`): a transformers
Qwen2-VL policy, prompts laid out by its processor, rewards from :mod:`grpo.vision_data`.

Two processors, as in a real deployment: the rollout side's lays out the prompts it generates
from; the trainer's re-encodes each prompt for the training forward (by default the same
settings; ``training_max_pixels`` gives the trainer's image processor another resolution budget).
Before the first step's log-probs and update, :meth:`VisionEngine.check` runs rl-kernel's
processor-layout parity (:func:`rl_kernel_core.tools.multimodal.parity.check`) on the first batch: token
ids, image-token insertion, the 3-D rotary positions each side feeds the model, attention masks,
media and loss spans (the response tokens). A mismatch raises
:class:`~rl_kernel_core.tools.multimodal.parity.ParityError` naming the first mismatched span, and the
run stops before any training.

Batch-invariant mode: :func:`rl_kernel_core.batch_invariant_mode.api_vlm.use_mode_vlm` (attention of the
language model and the vision tower, the patch embedding), so rollout and training log-probs are
bitwise equal (``logprob_diff`` 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from rl_kernel_core.tools.multimodal import parity
from rl_kernel_core.tools.multimodal.schema import MultimodalBatch

from . import embedded, vision_data, vision_model


@dataclass
class Encoded:
    """One side's prompts, per row unpadded: ``ids``/``types`` ``[P_b]`` (token ids,
    ``mm_token_type_ids``), ``pixels`` ``[n_b, K]`` and ``grid`` ``[I_b, 3]``."""

    ids: list[torch.Tensor]
    types: list[torch.Tensor]
    pixels: list[torch.Tensor]
    grid: list[torch.Tensor]


def _messages(problem: vision_data.VisualProblem) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": problem.prompt}]}]


class VisionEngine(embedded.Engine):
    """:class:`~grpo.embedded.Engine` for a Qwen2-VL policy (see the module docstring)."""

    def __init__(
        self,
        model_dir: Path,
        cfg: embedded.GRPOConfig,
        side: embedded.Path_,
        device: torch.device,
        cross_check: Optional[embedded.Path_] = None,
        training_max_pixels: Optional[int] = None,
    ):
        self.training_max_pixels = training_max_pixels
        super().__init__(model_dir, cfg, side, device, cross_check)
        self.drop_ids = self._media_ids()  # a response holding a placeholder would be read as an image

    def load(self, model_dir: Path):
        from transformers import AutoModelForImageTextToText

        self.processor = vision_model.load_processor(model_dir)
        self.training_processor = vision_model.load_processor(model_dir, self.training_max_pixels)
        model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
        return self.processor.tokenizer, model

    def _media_ids(self) -> torch.Tensor:
        config = self.model.config
        return torch.tensor(
            [config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id],
            device=self.device,
        )

    def use_mode(self) -> None:
        from rl_kernel_core.batch_invariant_mode.api_vlm import use_mode_vlm

        use_mode_vlm(self.model)

    def _encode(self, processor, problems: list) -> tuple[Encoded, dict]:
        from PIL import Image

        texts = [
            processor.apply_chat_template(_messages(p), tokenize=False, add_generation_prompt=True) for p in problems
        ]
        enc = processor(
            text=texts,
            images=[Image.fromarray(np.asarray(p.image)) for p in problems],
            return_tensors="pt",
            padding=True,
            padding_side="left",
        )
        mask = enc["attention_mask"].bool()
        patches = enc["image_grid_thw"].prod(-1).tolist()  # one image per prompt
        return Encoded(
            [row[m] for row, m in zip(enc["input_ids"], mask)],
            [row[m] for row, m in zip(enc["mm_token_type_ids"], mask)],
            list(enc["pixel_values"].split(patches)),
            list(enc["image_grid_thw"].split(1)),
        ), enc

    def _rope_index(
        self, ids: torch.Tensor, types: torch.Tensor, grid: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """The model's 3-D rotary positions ``[3, B, L]`` of a padded batch (transformers' ``get_rope_index``)."""
        return self.model.model.get_rope_index(ids, mm_token_type_ids=types, image_grid_thw=grid, attention_mask=mask)[
            0
        ]

    def encode(self, problems: list) -> embedded.Prompts:
        rollout, enc = self._encode(self.processor, problems)
        training, _ = self._encode(self.training_processor, problems)
        dev = self.device
        ids, mask, types = enc["input_ids"].to(dev), enc["attention_mask"].to(dev), enc["mm_token_type_ids"].to(dev)
        grid = enc["image_grid_thw"].to(dev)
        positions = self._rope_index(ids, types, grid, mask)
        return embedded.Prompts(
            ids,
            mask,
            positions,
            {"pixel_values": enc["pixel_values"].to(dev), "image_grid_thw": grid, "mm_token_type_ids": types},
            context={"rollout": rollout, "training": training, "prefill_positions": positions},
        )

    def model_inputs(self, ro: embedded.Rollout, sl: slice) -> dict:
        """The training side's layout of rows ``sl``: the trainer's encoding of each prompt,
        left-padded to the slice's longest, then the response (``[S, P' + R]``)."""
        enc: Encoded = ro.context["training"]
        rows = range(*sl.indices(ro.response_ids.shape[0]))
        width = max(enc.ids[b].shape[0] for b in rows)
        dev = self.device
        ids = torch.full((len(rows), width), self.tokenizer.pad_token_id, dtype=torch.long, device=dev)
        types = torch.zeros_like(ids)
        mask = torch.zeros_like(ids)
        for i, b in enumerate(rows):
            n = enc.ids[b].shape[0]
            ids[i, width - n :], types[i, width - n :], mask[i, width - n :] = enc.ids[b], enc.types[b], 1
        ids = torch.cat([ids, ro.response_ids[sl]], 1)
        mask = torch.cat([mask, ro.response_mask[sl].to(mask.dtype)], 1)
        types = torch.cat([types, torch.zeros_like(ro.response_ids[sl])], 1)
        grid = torch.cat([enc.grid[b] for b in rows]).to(dev)
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "mm_token_type_ids": types,
            "image_grid_thw": grid,
            "pixel_values": torch.cat([enc.pixels[b] for b in rows]).to(dev),
            "position_ids": self._rope_index(ids, types, grid, mask),
        }

    def score(self, text: str, problem) -> float:
        return vision_data.score(text, problem, self.cfg.format_score)

    def check(self, step: int, ro: embedded.Rollout) -> None:
        """Step 0: processor-layout parity of the rollout's batch against the trainer's (raises
        :class:`~rl_kernel_core.tools.multimodal.parity.ParityError` on the first mismatch)."""
        if step != 0:
            return
        parity.check(*self.parity_batches(ro))

    def parity_batches(self, ro: embedded.Rollout) -> tuple[MultimodalBatch, MultimodalBatch]:
        """``(rollout, training)`` :class:`~rl_kernel_core.tools.multimodal.schema.MultimodalBatch` es of
        ``ro``: each side's token ids, mask, pixels, grids and the positions it feeds the model;
        the loss spans are the response tokens."""
        s = ro.response_ids.shape[0]
        rollout_enc: Encoded = ro.context["rollout"]
        prefill = ro.context["prefill_positions"]
        steps = torch.arange(1, ro.response_ids.shape[1] + 1, device=prefill.device)
        rollout_positions = torch.cat([prefill, prefill[..., -1:] + steps], -1)  # what generate() fed the model
        grid = torch.cat(rollout_enc.grid)
        lengths = ro.response_mask.sum(1).tolist()  # 0 where the first sampled token was dropped
        spans = [[(int(ro.prompt_mask[b].sum()), n)] if n else [] for b, n in enumerate(lengths)]
        rollout = MultimodalBatch.from_processor(
            self.processor,
            {
                "input_ids": ro.input_ids.cpu(),
                "attention_mask": ro.attention_mask.cpu(),
                "pixel_values": torch.cat(rollout_enc.pixels),
                "image_grid_thw": grid.cpu(),
                "position_ids": (rollout_positions * ro.attention_mask).cpu(),
            },
            loss_spans=spans,
        )
        train = self.model_inputs(ro, slice(0, s))
        train_enc: Encoded = ro.context["training"]
        train_spans = [[(train_enc.ids[b].shape[0], n)] if n else [] for b, n in enumerate(lengths)]
        training = MultimodalBatch.from_processor(
            self.training_processor,
            {
                "input_ids": train["input_ids"].cpu(),
                "attention_mask": train["attention_mask"].cpu(),
                "pixel_values": train["pixel_values"].cpu(),
                "image_grid_thw": train["image_grid_thw"].cpu(),
                "position_ids": (train["position_ids"] * train["attention_mask"]).cpu(),
            },
            loss_spans=train_spans,
        )
        return rollout, training
