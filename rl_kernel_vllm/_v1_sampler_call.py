"""The arguments of a call of vLLM V1's ``Sampler.forward`` or ``Sampler.sample`` that the hooks read."""

from __future__ import annotations

import inspect
from typing import Any


def sampler_call_arguments(
    signature: inspect.Signature, sampler: Any, args: tuple, kwargs: dict
) -> tuple[Any, Any, str]:
    """``(logits, sampling_metadata, logprobs mode)`` of ``method(sampler, *args, **kwargs)``, the
    method's ``signature`` binding them by name whether passed by position or keyword; the mode is
    the call's ``logprobs_mode_override`` when given, else the sampler's ``logprobs_mode``."""
    bound = signature.bind(sampler, *args, **kwargs)
    mode = bound.arguments.get("logprobs_mode_override") or sampler.logprobs_mode
    return bound.arguments["logits"], bound.arguments["sampling_metadata"], mode
