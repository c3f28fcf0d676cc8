"""A small host tensor to the device without a host sync, for the hooks' per-step inputs."""

from __future__ import annotations

import torch


def to_device_async(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device``; to CUDA through pinned memory, copied asynchronously
    (a plain ``.to`` from pageable memory waits for the stream)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
