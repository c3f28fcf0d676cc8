"""rl-kernel as vime's ``--selected-logprob-provider``, through the stand-in of that boundary.

The boundary (``vime.backends.megatron_utils.selected_logprob_provider`` in ``standin/``) follows
RL-Align/vime commit e0d231806e06a3000b9ba4f5be4bd7ba235dfcdc: requests are vime's flat
``SelectedLogprobRequest`` (tempered logits; optionally ``hidden``, ``lm_head_weight``,
``lm_head_bias``, ``vocab_start_index``, ``global_vocab_size``, ``real_vocab_size``, and the
rollout ``temperature``), answered through its ``compute_selected_logprobs`` (``auto``/``strict``),
with the stand-in's ``calculate_log_probs_and_entropy`` as vime's native path and as the
reference. The same provider serves ``--linear-logp-provider`` (``test_provider.py``; the two-rank
test there asks both boundaries).
"""

from __future__ import annotations

import sys
from argparse import Namespace
from types import SimpleNamespace
from typing import Any, Optional, Union

import pytest
import torch
import torch.nn.functional as F

import rl_kernel_vime
from rl_kernel_core import dispatch
from rl_kernel_core.contract import assert_close
from rl_kernel_vime import fallback, registry, targets
from rl_kernel_vime.provider import ProviderUnavailable, SelectedLogprobResult, provider
from vime.backends.megatron_utils import loss as vime_loss
from vime.backends.megatron_utils import selected_logprob_provider as boundary
from vime_helpers import assert_auto_falls_back, assert_same_gradients, assert_same_logprobs, assert_strict_refuses
from vime_helpers import assert_strict_switch_refuses
from vime_helpers import make_args, make_batch, must_not_run, native_path, packed_fields, random_head, request_fields

F32 = torch.float32
PATH = targets.PROVIDER_PATH
SINGLE = boundary.ContextParallelLayout(world_size=1, rank=0, layout="single")


def _request(logits, targets_, *, with_entropy=False, with_entropy_grad=None, keep=None, layout=SINGLE, **fields: Any):
    return boundary.SelectedLogprobRequest(
        **request_fields(
            logits,
            targets_,
            with_entropy=with_entropy,
            with_entropy_grad=with_entropy_grad,
            context_parallel=layout,
            log_prob_keep_mask=keep,
            **fields,
        )
    )


def _native(logits, targets_, **flags: Any) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """vime's native path on ``logits`` and ``targets_`` (``with_entropy``, ``with_entropy_grad``)."""
    return native_path(SimpleNamespace(**request_fields(logits, targets_, **flags)))


def _args(path: Optional[str] = PATH, mode: str = "auto") -> Namespace:
    return Namespace(selected_logprob_provider=path, selected_logprob_provider_mode=mode)


@pytest.mark.parametrize("with_entropy, with_entropy_grad", [(False, False), (True, True), (True, False)])
def test_logits_request_matches_vime_native(gen, with_entropy, with_entropy_grad):
    """Without hidden states: the tempered logits scored as given. vime sets ``temperature`` to
    the rollout temperature on every request; it is not applied a second time."""
    logits = (3 * torch.randn(11, 23, generator=gen)).requires_grad_()
    tgt = torch.randint(0, 23, (11,), generator=gen)
    request = _request(
        logits,
        tgt,
        with_entropy=with_entropy,
        with_entropy_grad=with_entropy_grad,
        temperature=0.8,
        global_vocab_size=23,
        real_vocab_size=20,
        metadata={"logits_are_temperature_scaled": True},
    )
    lp, ent = boundary.compute_selected_logprobs(args=_args(mode="strict"), request=request, native=must_not_run)
    want_lp, want_ent = _native(logits, tgt, with_entropy=with_entropy, with_entropy_grad=with_entropy_grad)
    assert lp.shape == (11, 1) and lp.dtype == F32
    assert_same_logprobs((lp, ent), (want_lp, want_ent), "selected_logprobs")
    assert ent is None or ent.requires_grad == with_entropy_grad
    result = provider(request)
    assert isinstance(result, SelectedLogprobResult) and not hasattr(result, "logp")
    assert result.backend_id == "rl_kernel:" + dispatch.explain("logprob_from_logits").backend
    assert result.contract_id == "rl_kernel_core.contract:logprob:fp32"
    assert result.provenance["boundary"] == "selected_logprob" and result.provenance["op"] == "logprob_from_logits"
    assert result.provenance["temperature"] == "applied by vime"
    assert result.provenance["context_parallel"] == {"world_size": 1, "rank": 0, "layout": "single"}
    assert_same_gradients([lp, ent], [want_lp, want_ent], [logits], ["d logits"], gen)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7, "tensor1", "tensorT"])
def test_hidden_request_matches_vime_native_without_reading_logits(gen, bias, with_entropy, temperature):
    """With ``hidden``/``lm_head_weight``/``lm_head_bias`` the logits are never read (NaN here):
    one ``linear_logprob`` call at the request's temperature, over the padded vocabulary as vime's
    native function scores it (``real_vocab_size`` is recorded, not used to mask)."""
    h, w, b, tgt = random_head(gen, bias=bias)
    forms: dict[Any, Union[float, torch.Tensor]] = {
        1.0: 1.0,
        0.7: 0.7,
        "tensor1": torch.tensor([1.3]),
        "tensorT": torch.full((9,), 0.8),
    }
    t = forms[temperature]
    scale = float(t.reshape(-1)[0]) if isinstance(t, torch.Tensor) else float(t)
    poisoned = torch.full((9, 29), float("nan"), requires_grad=True)
    vocab = {"vocab_start_index": 0, "global_vocab_size": 29, "real_vocab_size": 27}
    head = {"hidden": h, "lm_head_weight": w, "lm_head_bias": b}
    request = _request(poisoned, tgt, with_entropy=with_entropy, temperature=t, **head, **vocab)
    lp, ent = boundary.compute_selected_logprobs(args=_args(mode="strict"), request=request, native=must_not_run)
    want_lp, want_ent = _native(F.linear(h, w, b) / scale, tgt, with_entropy=with_entropy)
    assert_same_logprobs((lp, ent), (want_lp, want_ent), "selected_logprobs")
    result = provider(request)
    assert result.backend_id == "rl_kernel:" + dispatch.explain("linear_logprob").backend
    assert result.provenance["op"] == "linear_logprob" and result.provenance["temperature"] == pytest.approx(scale)
    assert result.provenance["vocab"] == vocab
    leaves = [x for x in (h, w, b) if x is not None]
    names = ["d hidden", "d lm_head_weight", "d lm_head_bias"]
    assert_same_gradients([lp, ent], [want_lp, want_ent], leaves, names, gen)


def test_an_earlier_request_without_structural_fields_is_served(gen):
    """A request as the boundary's commit ec2dda81 builds it (no ``hidden``/``lm_head_*``/vocab/
    ``temperature`` fields at all): served through the logits."""
    logits = 3 * torch.randn(7, 13, generator=gen)
    tgt = torch.randint(0, 13, (7,), generator=gen)
    metadata = {"logits_are_temperature_scaled": True}
    fields = request_fields(logits, tgt, with_entropy=True, with_entropy_grad=False, context_parallel=SINGLE)
    result = provider(SimpleNamespace(**fields, metadata=metadata))
    want = _native(logits, tgt, with_entropy=True)
    assert_same_logprobs((result.selected_logprobs, result.entropy), want, "selected_logprobs")


@pytest.mark.parametrize("with_context", [False, True])
def test_vime_loss_asks_the_provider_through_the_selected_boundary(gen, with_context):
    """vime's ``get_log_probs_and_entropy`` with ``--selected-logprob-provider`` (strict): the
    tempered logits, or, with the model's ``linear_logp_context``, the hidden states and LM head;
    the per-sample log-probs and entropies equal vime's native path's."""
    rows_hidden, vocab = 6, 17
    logits, batch = make_batch(gen, vocab=vocab)
    num_rows = logits.size(1)
    context = None
    if with_context:  # the logits the model would produce from these hidden states
        h, w, b, _ = random_head(gen, rows=num_rows, hidden=rows_hidden, vocab=vocab)
        context = {
            "hidden": h,
            "lm_head_weight": w,
            "lm_head_bias": b,
            "vocab_start_index": 0,
            "global_vocab_size": vocab,
            "real_vocab_size": vocab,
        }
        logits = F.linear(h, w, b).detach()[None].requires_grad_()
    kwargs = dict(**packed_fields(batch), with_entropy=True)
    args = make_args(rollout_temperature=0.8, selected_logprob_provider=PATH, selected_logprob_provider_mode="strict")
    _, got = vime_loss.get_log_probs_and_entropy(logits, args=args, linear_logp_context=context, **kwargs)
    op = "linear_logprob" if with_context else "logprob_from_logits"
    assert registry.provider_calls() == {f"rl_kernel:{dispatch.explain(op).backend} via {op}": 1}
    _, want = vime_loss.get_log_probs_and_entropy(logits, args=make_args(rollout_temperature=0.8), **kwargs)
    for key in ("log_probs", "entropy"):
        for i, (g, w_) in enumerate(zip(got[key], want[key])):
            assert_close(g, w_, "logprob", F32, f"{key}[{i}]")


def test_the_hook_takes_vime_calls_without_a_linear_logp_context(gen):
    """vime at e0d23180 passes ``linear_logp_context`` to ``get_log_probs_and_entropy`` (None
    when the model captured no LM head). With the switch on, the hook scores a call whose
    context is None itself; a call with hidden states goes to vime's function (logged as a
    fallback), which hands them to the provider named by ``--selected-logprob-provider``."""
    rl_kernel_vime.activate()
    logits, batch = make_batch(gen, vocab=17)
    kwargs = dict(**packed_fields(batch), with_entropy=True)
    args = make_args(rollout_temperature=0.8, selected_logprob_provider=PATH)
    _, got = vime_loss.get_log_probs_and_entropy(logits, args=args, linear_logp_context=None, **kwargs)
    assert fallback.counts() == {} and registry.provider_calls() == {}  # the hook's own op call
    h, w, b, _ = random_head(gen, rows=logits.size(1), hidden=6, vocab=17)
    context = {"hidden": h, "lm_head_weight": w, "lm_head_bias": b, "vocab_start_index": 0}
    _, via_boundary = vime_loss.get_log_probs_and_entropy(
        F.linear(h, w, b).detach()[None], args=args, linear_logp_context=context, **kwargs
    )
    assert fallback.counts() == {"logprob": {"argument linear_logp_context is set and not supported": 1}}
    assert registry.provider_calls() == {
        f"rl_kernel:{dispatch.explain('linear_logprob').backend} via linear_logprob": 1
    }
    rl_kernel_vime.restore()
    _, want = vime_loss.get_log_probs_and_entropy(logits, args=make_args(rollout_temperature=0.8), **kwargs)
    for key in ("log_probs", "entropy"):
        for i, (g, w_) in enumerate(zip(got[key], want[key])):
            assert_close(g, w_, "logprob", F32, f"{key}[{i}]")
    assert len(via_boundary["log_probs"]) == len(want["log_probs"])


def _keep_mask(gen):
    logits = 3 * torch.randn(11, 23, generator=gen)
    tgt = torch.randint(0, 23, (11,), generator=gen)
    keep = torch.rand(11, 23, generator=gen) > 0.4
    keep[torch.arange(11), tgt] = True
    return _request(logits, tgt, with_entropy=True, keep=keep, temperature=1.0)


def _hidden_fields(gen, **fields: Any):
    h, w, b, tgt = random_head(gen)
    return _request(F.linear(h, w, b).detach(), tgt, hidden=h, lm_head_weight=w, lm_head_bias=b, **fields)


UNSERVED = {
    "top-p replay": (_keep_mask, "rollout top-p replay (log_prob_keep_mask) is not supported"),
    "per-row temperature": (
        lambda gen: _hidden_fields(gen, temperature=torch.rand(9, generator=gen) + 0.5, global_vocab_size=29),
        "per-row temperatures differ",
    ),
    "offset vocab shard": (
        lambda gen: _hidden_fields(gen, vocab_start_index=3, global_vocab_size=32),
        "is not TP rank 0's contiguous share",
    ),
    "padded beyond the shards": (
        lambda gen: _hidden_fields(gen, global_vocab_size=32),
        "vocab shard [0, 29) of 32 is not TP rank 0's",
    ),
}


@pytest.mark.parametrize("case", list(UNSERVED))
def test_a_refusal_falls_back_in_auto_and_stops_strict_runs(gen, caplog, monkeypatch, case):
    """vime recognises the refusal by its ``selected_logprob_provider_unavailable`` marker (the
    provider never imports vime's exception class): it runs its native function in ``auto`` mode,
    logging why, stops in one line in ``strict`` mode, and under ``VIME_RL_KERNEL_STRICT=1`` stops
    even in ``auto``."""
    build, reason = UNSERVED[case]
    request = build(gen)
    with pytest.raises(ProviderUnavailable) as info:
        provider(request)
    assert not isinstance(info.value, boundary.SelectedLogprobProviderUnavailable)
    assert info.value.selected_logprob_provider_unavailable is True
    compute = boundary.compute_selected_logprobs
    assert_auto_falls_back(compute, _args(), request, reason, caplog)
    start = f"selected-logprob provider {PATH!r} is unavailable: rl_kernel_vime: "
    assert_strict_refuses(compute, _args(mode="strict"), request, start, reason)
    assert_strict_switch_refuses(compute, _args(), request, reason, monkeypatch)


def test_the_provider_needs_no_vime_to_answer(gen, monkeypatch):
    """With every vime module unimportable, plain-object requests of either boundary are answered
    (the results are this package's classes, with vime's field names) and a refusal is raised
    with both boundaries' markers: vime is needed only to call the provider, never by it."""
    for name in [m for m in sys.modules if m == "vime" or m.startswith("vime.")] + ["vime"]:
        monkeypatch.setitem(sys.modules, name, None)  # importing any of them now raises ImportError
    h, w, b, tgt = random_head(gen)
    logits = F.linear(h, w, b).detach()
    cp = SimpleNamespace(world_size=2, rank=1, layout="allgather")
    common = request_fields(logits, tgt, temperature=0.9, metadata={})
    vocab = {"vocab_start_index": 0, "global_vocab_size": 29, "real_vocab_size": 29}
    flat = SimpleNamespace(**common, context_parallel=cp, hidden=h, lm_head_weight=w, lm_head_bias=b, **vocab)
    context = SimpleNamespace(
        hidden=h,
        projection=SimpleNamespace(weight=w, bias=b),
        vocab_partition=SimpleNamespace(local_start=0, local_size=29, real_size=29, padded_size=29),
    )
    structural = SimpleNamespace(**common, token_layout=cp, context=context)
    want_lp, _ = _native(F.linear(h, w, b) / 0.9, tgt)
    selected = provider(flat)
    assert_close(selected.selected_logprobs, want_lp, "logprob", F32, "selected_logprobs")
    linear = provider(structural)
    assert_close(linear.logp, want_lp, "logprob", F32, "logp")
    assert (
        selected.provenance["context_parallel"]
        == linear.provenance["token_layout"]
        == {"world_size": 2, "rank": 1, "layout": "allgather"}
    )
    with pytest.raises(ProviderUnavailable) as info:
        provider(SimpleNamespace(**{**vars(flat), "vocab_start_index": 3, "global_vocab_size": 32}))
    assert info.value.linear_logp_provider_unavailable and info.value.selected_logprob_provider_unavailable
    assert all(sys.modules[name] is None for name in sys.modules if name == "vime" or name.startswith("vime."))
