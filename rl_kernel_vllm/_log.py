"""The plugin's logger: a child of vLLM's ``vllm`` logger, so its lines share vLLM's handler,
format and ``VLLM_LOGGING_LEVEL``."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("vllm.plugins.rl_kernel")

_seen: set[str] = set()


def log_once(key: str, message: str, *args: Any) -> None:
    """Log ``message % args`` at INFO the first time ``key`` is seen in this process."""
    if key not in _seen:
        _seen.add(key)
        logger.info(message, *args)
