"""Contract stand-in for ``vime.backends.megatron_utils.model`` (not vime): one training step.

slime's ``train_one_step`` runs Megatron's pipeline schedule; this keeps its signature and its
return convention — ``(metrics: dict[str, float], grad_norm)``, the metrics being the
micro-batch loss metrics summed and divided by the step's denominator — for one process and
no pipeline. ``model`` maps a batch's ``tokens [1, T]`` to logits ``[1, T, V]`` fp32.
"""

from argparse import Namespace
from collections.abc import Iterator
from typing import Any

import torch

from vime.backends.megatron_utils.loss import loss_function


def train_one_step(
    args: Namespace,
    rollout_id: int,
    step_id: int,
    data_iterator: Iterator[dict[str, Any]],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    opt_param_scheduler: Any,
    num_microbatches: int,
    step_global_batch_size: int,
) -> tuple[dict[str, float], float]:
    """Forward/backward over ``num_microbatches`` batches, one optimizer step, reduced metrics."""
    optimizer.zero_grad()
    keys = None
    total = None
    for _ in range(num_microbatches):
        batch = next(data_iterator)
        logits = model(batch["tokens"])
        loss, _normalizer, log = loss_function(args, batch, num_microbatches, step_global_batch_size, logits)
        loss.backward()
        keys = log["keys"]
        total = log["values"] if total is None else total + log["values"]
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
    optimizer.step()
    if opt_param_scheduler is not None:
        opt_param_scheduler.step(increment=step_global_batch_size)
    assert keys is not None and total is not None, "num_microbatches must be >= 1"
    denominator = total[0] if args.calculate_per_token_loss else step_global_batch_size
    return {key: float(value / denominator) for key, value in zip(keys, total[1:])}, grad_norm
