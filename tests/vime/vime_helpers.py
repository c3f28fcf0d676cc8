"""Builders and checks shared by the vime adapter tests: vime's arguments, a packed random
micro-batch (and its per-sample fields as ``get_log_probs_and_entropy`` takes them), a random LM
head, the fields of vime's log-prob requests and its native path on them; the comparisons of
log-probs and of gradients under a random upstream gradient, and what either provider boundary
does in ``auto`` and ``strict`` mode and under ``VIME_RL_KERNEL_STRICT=1`` when the provider
refuses."""

import re
from argparse import Namespace
from collections.abc import Sequence
from typing import Any, Callable, Optional

import pytest
import torch

from rl_kernel_core.contract import assert_close
from rl_kernel_vime.fallback import FallbackError
from vime.utils import ppo_utils

LogProbs = tuple[torch.Tensor, Optional[torch.Tensor]]


def make_args(**overrides) -> Namespace:
    """vime's (slime's) arguments that the hooked functions read, with typical GRPO values."""
    values = dict(
        rollout_temperature=1.0,
        log_probs_chunk_size=-1,
        eps_clip=0.2,
        eps_clip_high=0.28,
        eps_clip_c=None,
        entropy_coef=0.0,
        use_kl_loss=False,
        kl_loss_type="low_var_kl",
        kl_loss_coef=0.0,
        use_rollout_logprobs=False,
        advantage_estimator="grpo",
        calculate_per_token_loss=False,
        loss_type="policy_loss",
        custom_loss_function_path=None,
        tensor_model_parallel_size=1,
        context_parallel_size=1,
    )
    values.update(overrides)
    return Namespace(**values)


def make_batch(
    generator: torch.Generator, vocab: int = 17, num_samples: int = 4, pad: int = 2, device: str = "cpu"
) -> tuple[torch.Tensor, dict]:
    """A packed micro-batch: samples of different lengths, padding at the end, random masks.

    Returns ``(logits [1, T, vocab] fp32 requiring grad, batch dict as vime's loss receives it)``,
    drawn on the CPU (the same values for every device) and placed on ``device``.
    """
    totals = [int(n) for n in torch.randint(4, 12, (num_samples,), generator=generator)]
    responses = [int(torch.randint(1, t, (1,), generator=generator)) for t in totals]
    num_rows = sum(totals) + pad
    logits = (3 * torch.randn(1, num_rows, vocab, generator=generator)).to(device).requires_grad_()

    def per_sample(scale: float, shift: float) -> list[torch.Tensor]:
        return [scale * torch.randn(r, generator=generator) + shift for r in responses]

    masks = [(torch.rand(r, generator=generator) > 0.25).float() for r in responses]
    masks[0][0] = 0.0  # at least one masked token
    batch: dict[str, Any] = {
        "unconcat_tokens": [torch.randint(0, vocab, (t,), generator=generator) for t in totals],
        "total_lengths": totals,
        "response_lengths": responses,
        "loss_masks": masks,
        "advantages": per_sample(1.0, 0.0),
        "log_probs": per_sample(0.5, -3.0),
        "ref_log_probs": per_sample(0.5, -3.0),
        "rollout_log_probs": per_sample(0.5, -3.0),
    }
    batch = {
        k: [t.to(device) for t in v] if k not in ("total_lengths", "response_lengths") else v for k, v in batch.items()
    }
    return logits, batch


def packed_fields(batch: dict) -> dict[str, Any]:
    """``batch``'s per-sample fields that vime's ``get_log_probs_and_entropy`` takes as keywords:
    ``unconcat_tokens``, ``total_lengths``, ``response_lengths``."""
    return {name: batch[name] for name in ("unconcat_tokens", "total_lengths", "response_lengths")}


def random_head(
    generator: torch.Generator, rows: int = 9, hidden: int = 13, vocab: int = 29, bias: bool = True
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """``(hidden [rows, hidden], weight [vocab, hidden], bias [vocab] or None, targets [rows])``: fp32
    leaves requiring grad (logits of std about 3) and int64 targets."""
    h = torch.randn(rows, hidden, generator=generator).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=generator) / hidden**0.5 * 3).requires_grad_()
    b = torch.randn(vocab, generator=generator).requires_grad_() if bias else None
    return h, w, b, torch.randint(0, vocab, (rows,), generator=generator)


def request_fields(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    *,
    with_entropy: bool = False,
    with_entropy_grad: Optional[bool] = None,
    **fields: Any,
) -> dict[str, Any]:
    """The fields both of vime's request classes have, as its loss fills them on one tensor-parallel
    rank (no group, ``chunk_size`` -1, no keep mask; ``with_entropy_grad`` defaults to
    ``with_entropy``), then ``fields``: the boundary's own, or replacements."""
    return {
        "logits": logits,
        "target_ids": target_ids,
        "tensor_parallel_group": None,
        "with_entropy": with_entropy,
        "with_entropy_grad": with_entropy if with_entropy_grad is None else with_entropy_grad,
        "chunk_size": -1,
        "log_prob_keep_mask": None,
        **fields,
    }


def native_path(request: Any) -> LogProbs:
    """vime's native function (the stand-in's ``calculate_log_probs_and_entropy``) on a request, as
    its boundary calls it on one tensor-parallel rank: ``(log-probs [T, 1], entropy [T] or None)``."""
    return ppo_utils.calculate_log_probs_and_entropy(
        request.logits,
        request.target_ids,
        None,
        with_entropy=request.with_entropy,
        with_entropy_grad=request.with_entropy_grad,
        chunk_size=-1,
        log_prob_keep_mask=request.log_prob_keep_mask,
    )


def assert_same_logprobs(got: LogProbs, want: LogProbs, name: str) -> None:
    """``(log-probs, entropy or None)`` pairs agree within the contract's fp32 ``logprob`` row; an
    entropy on both sides or on neither."""
    (lp, ent), (want_lp, want_ent) = got, want
    assert_close(lp, want_lp, "logprob", torch.float32, name)
    assert (ent is None) == (want_ent is None)
    if ent is not None and want_ent is not None:
        assert_close(ent, want_ent, "logprob", torch.float32, "entropy")


def assert_auto_falls_back(
    compute: Callable[..., LogProbs], args: Namespace, request: Any, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A boundary's ``compute`` (``compute_linear_logp``, ``compute_selected_logprobs``) in ``auto``
    mode, its provider refusing ``request``: vime's native path answers, called once, and vime's
    warning names ``reason``."""
    calls = []

    def native(*args: Any, **kwargs: Any) -> LogProbs:
        calls.append(1)
        return ppo_utils.calculate_log_probs_and_entropy(*args, **kwargs)

    lp, ent = compute(args=args, request=request, native=native)
    want_lp, want_ent = native_path(request)
    assert calls == [1]
    assert torch.equal(lp, want_lp) and (ent is None) == (want_ent is None)
    assert any(reason in r.getMessage() for r in caplog.records), caplog.text


def assert_strict_refuses(
    compute: Callable[..., LogProbs], args: Namespace, request: Any, start: str, reason: str
) -> None:
    """A boundary's ``compute`` in ``strict`` mode, its provider refusing ``request``: one line that
    starts with ``start`` and names ``reason``, and vime's native path never runs."""
    with pytest.raises(RuntimeError) as info:
        compute(args=args, request=request, native=must_not_run)
    message = str(info.value)
    assert message.startswith(start) and reason in message, message
    assert "\n" not in message


def assert_strict_switch_refuses(
    compute: Callable[..., LogProbs], args: Namespace, request: Any, reason: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under ``VIME_RL_KERNEL_STRICT=1`` a boundary's ``compute``, its provider refusing ``request``,
    stops even in ``auto`` mode: a ``FallbackError`` naming ``reason`` and the switch, and vime's
    native path never runs."""
    monkeypatch.setenv("VIME_RL_KERNEL_STRICT", "1")
    with pytest.raises(FallbackError, match=f"{re.escape(reason)}.*VIME_RL_KERNEL_STRICT=1"):
        compute(args=args, request=request, native=must_not_run)


def assert_same_gradients(
    got: Sequence[Optional[torch.Tensor]],
    want: Sequence[Optional[torch.Tensor]],
    inputs: Sequence[torch.Tensor],
    names: Sequence[str],
    generator: torch.Generator,
) -> None:
    """``got``'s gradients in ``inputs`` equal ``want``'s (the contract's fp32 ``gradient`` row),
    each input named by ``names``, under one random upstream gradient drawn from ``generator``: every
    output that requires grad is weighted by N(0, 1) values of its shape, the same for both sides
    (None outputs and outputs without grad are skipped)."""
    seed = int(torch.randint(0, 2**31, (1,), generator=generator))

    def grads(outputs: Sequence[Optional[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
        upstream = torch.Generator().manual_seed(seed)
        terms = [
            (torch.randn(o.shape, generator=upstream) * o).sum() for o in outputs if o is not None and o.requires_grad
        ]
        return torch.autograd.grad(torch.stack(terms).sum(), inputs)

    for name, g, w in zip(names, grads(got), grads(want)):
        assert_close(g, w, "gradient", torch.float32, name)


def must_not_run(*args: Any, **kwargs: Any) -> Any:
    """A stand-in for vime's native path where the provider must answer or vime refuse."""
    raise AssertionError("vime's native path ran where the provider should have answered or vime refused")
