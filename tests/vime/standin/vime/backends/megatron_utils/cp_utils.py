"""Contract stand-in for ``vime.backends.megatron_utils.cp_utils`` (not vime): the loss reducer.

As slime's ``get_sum_of_sample_mean`` with one context-parallel rank.
"""

from typing import Callable

import torch


def get_sum_of_sample_mean(
    total_lengths: list[int],
    response_lengths: list[int],
    loss_masks: list[torch.Tensor],
    calculate_per_token_loss: bool = False,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """A reducer over packed per-token values ``x [sum(response_lengths)]``.

    Default: the sum over samples of each sample's masked token mean (denominator clamped to 1).
    ``calculate_per_token_loss``: the masked sum over all tokens.
    """

    def sum_of_sample_mean(x: torch.Tensor) -> torch.Tensor:
        return sum(
            (x_i * mask_i).sum() / torch.clamp_min(mask_i.sum(), 1)
            for x_i, mask_i in zip(x.split(response_lengths, dim=0), loss_masks)
        )

    def sum_of_token(x: torch.Tensor) -> torch.Tensor:
        return sum((x_i * mask_i).sum() for x_i, mask_i in zip(x.split(response_lengths, dim=0), loss_masks))

    return sum_of_token if calculate_per_token_loss else sum_of_sample_mean
