"""The causal-LM forward a switched-on engine's model runs: hidden states → ``linear_logprob``.

It returns what verl's fused-kernel branch of ``FSDPEngineWithLMHead.prepare_model_outputs``
reads (``CausalLMOutputForPPO`` with ``log_probs`` and ``entropy``), so verl keeps doing all the
unpadding, sequence-parallel gathering and nesting; no ``[N, V]`` logits tensor is formed.

Under the batch-invariant option (:attr:`Request.batch_invariant`) the log-probs take the
definition vLLM's rollout returns under ``RL_KERNEL_VLLM_BATCH_INVARIANT=1`` instead: the model's
own forward to its logits, in the model's dtype, the ids past the rollout's vocabulary set to
``-inf`` (verl's vLLM server does that to every step's logits), then
``rl_kernel_core.logprob_from_logits`` at the temperature. ``linear_logprob`` never rounds the
logits to the model dtype, so it gives other bits; the logits definition costs the ``[N, V]``
logits in the model dtype (what verl's own path holds, without its fp32 ``log_softmax`` copy).

The forward is bound to the model *instance* (the class is left alone). It only takes the
rl-kernel path when the engine hook passes a :class:`Request` (the ``rl_kernel`` keyword);
without one it calls the class's own forward, so a micro-batch the adapter does not serve runs
exactly verl's code.

LM head under FSDP: verl's FSDP2 wraps an untied ``lm_head`` as its own FSDP unit, so outside
that unit's forward its weight is a sharded ``DTensor`` (verl issue 5633). Reading the weight
directly would bypass FSDP's all-gather and its gradient reduce-scatter. The head computation is
therefore run *as the head module's forward* (:func:`_run_as_forward`): FSDP unshards the weight
before it, reshards after, and reduces the weight's gradient exactly as for a normal call (FSDP2,
tied or untied, tested on one and two ranks; an FSDP1-wrapped head is called through its wrapper
the same way, untested because verl's FSDP1 path does not run on CPU). A weight that is still a
``DTensor`` inside that call (a tensor-parallel plan, not FSDP) is gathered with
``full_tensor()``, which is differentiable.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.distributed.tensor import DTensor

from rl_kernel_core import adapters, linear_logprob, logprob_from_logits, profiling
from rl_kernel_verl import targets


@dataclass(frozen=True)
class Request:
    """What the engine hook asks the forward for (passed as the ``rl_kernel`` keyword).

    ``batch_invariant``: log-probs from the logits (the rollout's definition; the engine hook runs
    the call in batch-invariant mode). ``vocab_size``: with it, ids ``>= vocab_size`` get
    probability 0, as verl's vLLM server gives them (the tokenizer's length); None: every id.
    """

    return_entropy: bool
    batch_invariant: bool = False
    vocab_size: Optional[int] = None


def unsupported_reason(module: torch.nn.Module) -> Optional[str]:
    """Why this model cannot take the rl-kernel forward, or None when it can.

    Supported: text causal LMs built as ``model`` (the decoder returning hidden states) plus a
    linear ``lm_head`` (Qwen2/Qwen3/Llama/Mistral style). Vision-language models are not.
    """
    config = getattr(module, "config", None)
    if config is not None and getattr(config, "vision_config", None) is not None:
        return f"{type(module).__name__} is a vision-language model"
    head = getattr(module, "lm_head", None)
    if not isinstance(getattr(module, "model", None), torch.nn.Module) or head is None:
        return f"{type(module).__name__} has no .model/.lm_head pair"
    if not isinstance(getattr(head, "weight", None), torch.Tensor) or head.weight.dim() != 2:
        return f"{type(module).__name__}.lm_head has no 2-D weight"
    return None


def install(module: torch.nn.Module) -> None:
    """Bind the rl-kernel forward to ``module`` (an instance attribute; idempotent)."""
    if (
        isinstance(module.__dict__.get("forward"), types.MethodType)
        and module.__dict__["forward"].__func__ is causal_lm_forward
    ):
        return
    module.forward = types.MethodType(causal_lm_forward, module)


def causal_lm_forward(self: torch.nn.Module, *args: Any, rl_kernel: Optional[Request] = None, **kwargs: Any):
    """Decoder → hidden states → per-token log-probs (and entropies) of the shifted labels (with
    ``rl_kernel.batch_invariant``: the model's logits → ``logprob_from_logits``).

    Keyword arguments are those verl's fused branch passes: ``input_ids [B, T]`` (or ``[1, nnz]``
    packed), ``attention_mask``, ``position_ids``, ``temperature`` (float) and ``shift_labels``
    (int ``[B, T]``: the next-token id of every position, as verl's logits path labels them; the
    engine hook always supplies them). Returns ``CausalLMOutputForPPO`` with fp32 ``log_probs``
    and ``entropy`` (None unless requested) of ``input_ids``' shape.
    """
    if rl_kernel is None:
        return type(self).forward(self, *args, **kwargs)
    if args:
        raise TypeError("the rl-kernel forward takes keyword arguments only (verl passes them by name)")
    output_type = adapters.resolve(targets.PPO_OUTPUT)
    labels = kwargs.pop("shift_labels")
    temperature = float(kwargs.pop("temperature", 1.0))
    for unused in ("return_dict", "use_cache"):
        kwargs.pop(unused, None)
    if rl_kernel.batch_invariant:
        log_probs, entropy = _logits_logprob(self, kwargs, labels, temperature, rl_kernel)
        return output_type(log_probs=log_probs, entropy=entropy)
    outputs = self.get_submodule("model")(use_cache=False, **kwargs)
    hidden = outputs[0]
    with profiling.region("logprob", hidden.device):
        log_probs, entropy = _run_as_forward(
            self.get_submodule("lm_head"), _head_logprob, hidden, labels, temperature, rl_kernel.return_entropy
        )
    return output_type(log_probs=log_probs, entropy=entropy, hidden_states=getattr(outputs, "hidden_states", None))


def _logits_logprob(model: torch.nn.Module, kwargs: dict, labels: torch.Tensor, temperature: float, request: Request):
    """The model's own forward to its logits ``[B, T, V]`` (model dtype), ids ``>= vocab_size``
    masked to ``-inf``, then ``logprob_from_logits``: fp32 ``[B, T]`` log-probs and entropies (None
    unless requested; the log-probs have the same bits either way; 0 at padding).

    A padded batch (verl without ``use_remove_padding``: ``attention_mask [B, T]``) runs packed, its
    real tokens in one row with their positions, as verl's ``use_remove_padding`` layout passes them:
    the mode gives a token the same bits in either layout, and the padding tokens then cost no
    matmul rows."""
    real = kwargs.get("attention_mask")
    if real is not None and real.dim() == 2 and real.shape[0] > 1:
        real = real.bool()
        tokens = real.flatten().nonzero().flatten()  # the one host sync: the packed length
        positions = kwargs.get("position_ids")
        if positions is None:  # what the model would use for the padded rows: 0..T-1 in each
            positions = torch.arange(real.shape[1], device=real.device).expand(real.shape)
        packed = lambda t: t.flatten().index_select(0, tokens)[None]  # noqa: E731
        kwargs = {
            **kwargs,
            "input_ids": packed(kwargs["input_ids"]),
            "position_ids": packed(positions),
            "attention_mask": None,
        }
        labels = packed(labels)
    else:
        real = None
    logits = type(model).forward(model, use_cache=False, **kwargs).logits
    with profiling.region("logprob", logits.device):
        if request.vocab_size is not None and request.vocab_size < logits.shape[-1]:
            logits[..., request.vocab_size :] = float("-inf")
        with torch.autocast(logits.device.type, enabled=False):
            out = logprob_from_logits(logits, labels, temperature=temperature, return_entropy=request.return_entropy)
    values = out if request.return_entropy else (out,)
    if real is not None:
        values = tuple(v.new_zeros(real.shape).masked_scatter(real, v) for v in values)
    return values if request.return_entropy else (values[0], None)


def _head_logprob(
    head: torch.nn.Linear, hidden: torch.Tensor, labels: torch.Tensor, temperature: float, return_entropy: bool
):
    """The head's work inside its (FSDP-managed) forward: layout and dtype, then ``linear_logprob``."""
    weight, bias = head.weight, getattr(head, "bias", None)
    if isinstance(weight, DTensor):
        weight = weight.full_tensor()
        bias = bias.full_tensor() if isinstance(bias, DTensor) else bias
    device_type = hidden.device.type
    # Under verl's mixed-precision autocast the logits path runs the head in the autocast dtype;
    # take the same operands, then keep autocast away from linear_logprob's fp32 accumulation.
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    else:
        dtype = weight.dtype
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    bias = None if bias is None else bias.to(dtype)
    with torch.autocast(device_type, enabled=False):
        out = linear_logprob(hidden, weight, labels, bias=bias, temperature=temperature, return_entropy=return_entropy)
    return out if return_entropy else (out, None)


def _run_as_forward(head: torch.nn.Module, fn, *args):
    """Call ``fn(inner, *args)`` as ``head``'s forward so FSDP's hooks wrap it like a real call.

    ``inner`` is the module whose parameters ``fn`` reads: ``head`` itself (plain module or
    FSDP2 ``fully_shard``), or the module an FSDP1 wrapper holds.
    """
    inner = getattr(head, "_fsdp_wrapped_module", head)
    had_forward = "forward" in inner.__dict__
    saved = inner.__dict__.get("forward")
    inner.forward = types.MethodType(lambda mod, *a: fn(mod, *a), inner)
    try:
        return head(*args)
    finally:
        if had_forward:
            inner.forward = saved
        else:
            del inner.forward
