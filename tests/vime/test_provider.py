"""rl-kernel as vime's ``linear_logp`` provider, through the stand-in of vime's provider boundary;
and the provider's refusals of malformed requests (either boundary).

The boundary (``vime.backends.megatron_utils.linear_logp_provider`` in ``standin/``) follows
RL-Align/vime commit 33254c738f1d43250916ae6887f7981e77dbe411: requests are built with its
dataclasses and answered through its ``compute_linear_logp`` (``auto``/``strict``), with the
stand-in's ``calculate_log_probs_and_entropy`` as vime's native path and as the reference. The
``--selected-logprob-provider`` boundary has its own module, ``test_selected_provider.py``; the
two-rank test here asks both boundaries in the same processes.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import textwrap
from argparse import Namespace
from types import SimpleNamespace
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F

import rl_kernel_vime
from rl_kernel_core import dispatch
from rl_kernel_core.contract import assert_close
from rl_kernel_vime import registry, targets
from rl_kernel_vime.provider import LinearLogpResult, provider
from vime.backends.megatron_utils import linear_logp_provider as boundary
from vime.backends.megatron_utils import selected_logprob_provider as selected_boundary
from vime.backends.megatron_utils import loss as vime_loss
from vime.utils import ppo_utils
from vime_helpers import assert_auto_falls_back, assert_same_gradients, assert_same_logprobs, assert_strict_refuses
from vime_helpers import assert_strict_switch_refuses
from vime_helpers import make_args, make_batch, must_not_run, native_path, packed_fields, random_head, request_fields

F32 = torch.float32
PATH = targets.PROVIDER_PATH


def _request(
    logits,
    targets_,
    *,
    context=None,
    with_entropy=False,
    with_entropy_grad=None,
    keep=None,
    temperature=None,
    layout=None,
):
    return boundary.LinearLogpRequest(
        **request_fields(
            logits,
            targets_,
            with_entropy=with_entropy,
            with_entropy_grad=with_entropy_grad,
            token_layout=layout or boundary.TokenLayout(world_size=1, rank=0, layout="single"),
            log_prob_keep_mask=keep,
            context=context,
            temperature=temperature,
        )
    )


def _args(path: Optional[str] = PATH, mode: str = "auto") -> Namespace:
    return Namespace(linear_logp_provider=path, linear_logp_provider_mode=mode)


def _head_context(h, w, b, **vocab_partition: int) -> boundary.LinearLogpContext:
    """The hidden-state input of a request: ``h``, the LM head ``w``/``b``, and its vocabulary shard."""
    return boundary.LinearLogpContext(
        hidden=h,
        projection=boundary.LinearProjection(weight=w, bias=b),
        vocab_partition=boundary.VocabPartition(**vocab_partition),
    )


def _logits_case(gen, rows=11, vocab=23):
    logits = (3 * torch.randn(rows, vocab, generator=gen)).requires_grad_()
    return logits, torch.randint(0, vocab, (rows,), generator=gen)


@pytest.mark.parametrize("with_entropy, with_entropy_grad", [(False, False), (True, True), (True, False)])
def test_logits_path_matches_vime_native(gen, with_entropy, with_entropy_grad):
    logits, tgt = _logits_case(gen)
    request = _request(logits, tgt, with_entropy=with_entropy, with_entropy_grad=with_entropy_grad)
    result = provider(request)
    assert isinstance(result, LinearLogpResult)  # structural: vime's boundary takes any object with its fields
    want_lp, want_ent = native_path(request)
    assert result.logp.shape == (11, 1) and result.logp.dtype == F32
    assert_same_logprobs((result.logp, result.entropy), (want_lp, want_ent), "logp")
    assert result.entropy is None or result.entropy.requires_grad == with_entropy_grad
    assert result.backend_id == "rl_kernel:" + dispatch.explain("logprob_from_logits").backend
    assert result.contract_id == "rl_kernel_core.contract:logprob:fp32"
    assert result.provenance["op"] == "logprob_from_logits" and result.provenance["input"] == "logits"
    assert_same_gradients([result.logp, result.entropy], [want_lp, want_ent], [logits], ["d logits"], gen)
    assert registry.provider_calls() == {f"{result.backend_id} via logprob_from_logits": 1}


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("temperature", [None, 0.7, "tensor1", "tensorT"])
def test_hidden_path_matches_vime_native_without_reading_logits(gen, bias, with_entropy, temperature):
    """With hidden states and the LM head, logits are never read: they are NaN here."""
    h, w, b, tgt = random_head(gen, bias=bias)
    t = {None: None, 0.7: 0.7, "tensor1": torch.tensor([1.3]), "tensorT": torch.full((9,), 0.8)}[temperature]
    scale = 1.0 if t is None else float(t) if not isinstance(t, torch.Tensor) else float(t.reshape(-1)[0])
    context = _head_context(h, w, b, local_start=0, local_size=29, real_size=27, padded_size=29)
    poisoned = torch.full((9, 29), float("nan"), requires_grad=True)
    result = provider(_request(poisoned, tgt, context=context, with_entropy=with_entropy, temperature=t))
    true_logits = F.linear(h, w, b) / scale
    want_lp, want_ent = native_path(_request(true_logits, tgt, with_entropy=with_entropy))
    assert_same_logprobs((result.logp, result.entropy), (want_lp, want_ent), "logp")
    assert result.backend_id == "rl_kernel:" + dispatch.explain("linear_logprob").backend
    assert result.provenance["op"] == "linear_logprob" and result.provenance["temperature"] == pytest.approx(scale)
    assert result.provenance["vocab_partition"] == {
        "local_start": 0,
        "local_size": 29,
        "real_size": 27,
        "padded_size": 29,
    }
    leaves = [x for x in (h, w, b) if x is not None]
    names = ["d hidden", "d weight", "d bias"]
    assert_same_gradients([result.logp, result.entropy], [want_lp, want_ent], leaves, names, gen)


def test_strict_boundary_accepts_the_result_and_cp_layout_is_recorded(gen):
    logits, tgt = _logits_case(gen)
    layout = boundary.TokenLayout(world_size=2, rank=1, layout="zigzag")
    request = _request(logits, tgt, with_entropy=True, layout=layout)
    got = boundary.compute_linear_logp(args=_args(mode="strict"), request=request, native=must_not_run)
    assert_same_logprobs(got, native_path(request), "logp")
    assert provider(request).provenance["token_layout"] == {"world_size": 2, "rank": 1, "layout": "zigzag"}


def test_no_rows(gen):
    logits = torch.randn(0, 7, generator=gen, requires_grad=True)
    result = provider(_request(logits, torch.zeros(0, dtype=torch.long), with_entropy=True))
    assert result.logp.shape == (0, 1) and result.entropy is not None and result.entropy.shape == (0,)
    assert result.backend_id == "rl_kernel:none (no rows)"


def _keep_mask_request(gen):
    logits, tgt = _logits_case(gen)
    keep = torch.rand(11, 23, generator=gen) > 0.4
    keep[torch.arange(11), tgt] = True
    return _request(logits, tgt, with_entropy=True, keep=keep)


def _per_row_temperature_request(gen):
    h, w, b, tgt = random_head(gen)
    context = _head_context(h, w, b, local_start=0, local_size=29, real_size=29, padded_size=29)
    temperature = torch.rand(9, generator=gen) + 0.5
    return _request(F.linear(h, w, b) / temperature[:, None], tgt, context=context, temperature=temperature)


def _offset_shard_request(gen):
    h, w, b, tgt = random_head(gen)
    context = _head_context(h, w, b, local_start=3, local_size=29, real_size=32, padded_size=32)
    return _request(F.linear(h, w, b), tgt, context=context)


UNSERVED = {
    "top-p replay": (_keep_mask_request, "rollout top-p replay (log_prob_keep_mask) is not supported"),
    "per-row temperature": (_per_row_temperature_request, "per-row temperatures differ"),
    "offset vocab shard": (_offset_shard_request, "is not TP rank 0's contiguous share"),
}


@pytest.mark.parametrize("case", list(UNSERVED))
def test_a_refusal_falls_back_in_auto_and_stops_strict_runs(gen, caplog, monkeypatch, case):
    """A request the provider refuses: vime's native path in ``auto`` mode (the provider's call
    recorded as unavailable), one line in ``strict`` mode, and under ``VIME_RL_KERNEL_STRICT=1``
    an error even in ``auto``."""
    build, reason = UNSERVED[case]
    request = build(gen)
    compute = boundary.compute_linear_logp
    assert_auto_falls_back(compute, _args(), request, reason, caplog)
    ((outcome, count),) = registry.provider_calls().items()
    assert outcome.startswith("unavailable: ") and reason in outcome and count == 1
    start = f"linear_logp provider {PATH!r} is unavailable: rl_kernel_vime: "
    assert_strict_refuses(compute, _args(mode="strict"), request, start, reason)
    assert_strict_switch_refuses(compute, _args(), request, reason, monkeypatch)


def test_switch_makes_it_vime_default_provider(gen):
    """``activate()`` (what ``VIME_RL_KERNEL=1`` runs): vime's own ``get_log_probs_and_entropy``,
    launched without ``--linear-logp-provider``, gets its log-probs from the provider."""
    vime_get = vime_loss.get_log_probs_and_entropy  # vime's function, before the hook replaces it
    rl_kernel_vime.activate()
    key = f"{targets.PROVIDER_BOUNDARY}:linear_logp_provider_path"
    assert rl_kernel_vime.status()["targets"][key] == "live"
    assert boundary.linear_logp_provider_path(Namespace()) == PATH
    assert (
        boundary.linear_logp_provider_path(_args("user.module.provider")) == "user.module.provider"
    )  # the user's flag wins
    logits, batch = make_batch(gen)
    args = make_args(rollout_temperature=0.8)  # no linear_logp_provider attribute: the flag is absent
    kwargs = dict(args=args, **packed_fields(batch), with_entropy=True)
    _, got = vime_get(logits, **kwargs)
    calls = rl_kernel_vime.status()["provider"]["calls"]
    assert calls == {f"rl_kernel:{dispatch.explain('logprob_from_logits').backend} via logprob_from_logits": 1}
    rl_kernel_vime.restore()
    assert boundary.linear_logp_provider_path(Namespace()) is None
    _, want = vime_get(logits, **kwargs)  # vime's native path now
    assert rl_kernel_vime.status()["provider"]["calls"] == calls
    for key_ in ("log_probs", "entropy"):
        for i, (g, w) in enumerate(zip(got[key_], want[key_])):
            assert_close(g, w, "logprob", F32, f"{key_}[{i}]")


def test_switch_off_leaves_vime_untouched(gen):
    assert boundary.linear_logp_provider_path.__module__ == boundary.__name__
    assert boundary.linear_logp_provider_path(Namespace()) is None
    logits, tgt = _logits_case(gen)
    calls = []

    def native(*args: Any, **kwargs: Any):
        calls.append(1)
        return ppo_utils.calculate_log_probs_and_entropy(*args, **kwargs)

    boundary.compute_linear_logp(args=Namespace(), request=_request(logits, tgt), native=native)
    assert calls == [1] and registry.provider_calls() == {}
    assert rl_kernel_vime.status()["targets"][f"{targets.PROVIDER_BOUNDARY}:linear_logp_provider_path"] == "off"


_TP_WORKER = textwrap.dedent(
    """
    import sys
    import torch
    import torch.distributed as dist
    from vime.backends.megatron_utils import linear_logp_provider as boundary
    from vime.backends.megatron_utils import selected_logprob_provider as selected
    from rl_kernel_vime.provider import provider

    rank, store, inputs, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
    case = torch.load(inputs)
    local = case["weight"].shape[0] // 2
    shard = slice(rank * local, (rank + 1) * local)
    h = case["hidden"].clone().requires_grad_()
    w = case["weight"][shard].clone().requires_grad_()
    b = case["bias"][shard].clone().requires_grad_()
    context = boundary.LinearLogpContext(
        hidden=h, projection=boundary.LinearProjection(weight=w, bias=b),
        vocab_partition=boundary.VocabPartition(local_start=rank * local, local_size=local, real_size=2 * local - 3, padded_size=2 * local),
    )
    def request(ctx):
        return boundary.LinearLogpRequest(
            logits=torch.nn.functional.linear(h, w, b).detach() / case["temperature"], target_ids=case["targets"],
            tensor_parallel_group=dist.group.WORLD, token_layout=boundary.TokenLayout(world_size=1, rank=0, layout="single"),
            with_entropy=True, with_entropy_grad=True, chunk_size=-1, context=ctx, temperature=case["temperature"],
        )
    result = provider(request(context))
    ((result.logp.squeeze(-1) * case["g_lp"]).sum() + (result.entropy * case["g_ent"]).sum()).backward()
    def refusal(req):
        try:
            provider(req)
            return ""
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
    refused = refusal(request(None))
    # the --selected-logprob-provider boundary: the flat request vime builds at e0d23180
    h2, w2, b2 = (t.detach().clone().requires_grad_() for t in (h, w, b))
    def flat(**fields):
        return selected.SelectedLogprobRequest(
            logits=torch.nn.functional.linear(h2, w2, b2).detach() / case["temperature"], target_ids=case["targets"],
            tensor_parallel_group=dist.group.WORLD, context_parallel=selected.ContextParallelLayout(world_size=1, rank=0, layout="single"),
            with_entropy=True, with_entropy_grad=True, chunk_size=-1, temperature=case["temperature"],
            global_vocab_size=2 * local, real_vocab_size=2 * local - 3, **fields,
        )
    flat_result = provider(flat(hidden=h2, lm_head_weight=w2, lm_head_bias=b2, vocab_start_index=rank * local))
    ((flat_result.selected_logprobs.squeeze(-1) * case["g_lp"]).sum() + (flat_result.entropy * case["g_ent"]).sum()).backward()
    flat_refused = refusal(flat())
    torch.save(dict(lp=result.logp.detach(), ent=result.entropy.detach(), dh=h.grad, dw=w.grad, db=b.grad, shard=(shard.start, shard.stop),
                    backend_id=result.backend_id, provenance=dict(result.provenance), refused=refused,
                    flat_lp=flat_result.selected_logprobs.detach(), flat_ent=flat_result.entropy.detach(), flat_dh=h2.grad,
                    flat_dw=w2.grad, flat_db=b2.grad, flat_provenance=dict(flat_result.provenance), flat_refused=flat_refused), out)
    dist.barrier()
    dist.destroy_process_group()
    """
)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
def test_vocab_parallel_hidden_path_on_two_gloo_ranks(gen, tmp_path):
    """TP = 2 (gloo, two CPU processes): each rank holds its contiguous LM-head shard; every
    rank's log-probs and entropies equal vime's native path on the full vocabulary, and the
    shard gradients match, through either boundary's request (``LinearLogpRequest.context``, or
    ``SelectedLogprobRequest``'s flat ``hidden``/``lm_head_weight``/``vocab_start_index``);
    logits without hidden states are refused."""
    rows, hidden, vocab = 10, 12, 34
    h, w, b, tgt = random_head(gen, rows=rows, hidden=hidden, vocab=vocab)
    assert b is not None
    case: dict[str, Any] = dict(
        hidden=h.detach(),
        weight=w.detach(),
        bias=b.detach(),
        targets=tgt,
        temperature=0.9,
        g_lp=torch.randn(rows, generator=gen),
        g_ent=torch.randn(rows, generator=gen),
    )
    torch.save(case, tmp_path / "inputs.pt")
    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here / "standin"), str(here.parents[1])])}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _TP_WORKER,
                str(r),
                str(tmp_path / "store"),
                str(tmp_path / "inputs.pt"),
                str(tmp_path / f"out{r}.pt"),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    for proc in procs:
        _, stderr = proc.communicate(timeout=240)
        assert proc.returncode == 0, stderr
    want_lp, want_ent = native_path(_request(F.linear(h, w, b) / 0.9, tgt, with_entropy=True))
    assert want_ent is not None
    leaves = [h, w, b]
    g_want = torch.autograd.grad((want_lp.squeeze(-1) * case["g_lp"]).sum() + (want_ent * case["g_ent"]).sum(), leaves)
    for r in range(2):
        got = torch.load(tmp_path / f"out{r}.pt")
        shard = slice(*got["shard"])
        assert_close(got["lp"], want_lp, "logprob", F32, f"rank {r} logp")
        assert_close(got["ent"], want_ent, "logprob", F32, f"rank {r} entropy")
        assert_close(got["dh"], g_want[0], "gradient", F32, f"rank {r} d hidden")
        assert_close(got["dw"], g_want[1][shard], "gradient", F32, f"rank {r} d weight shard")
        assert_close(got["db"], g_want[2][shard], "gradient", F32, f"rank {r} d bias shard")
        assert got["backend_id"].startswith("rl_kernel:")
        assert got["provenance"]["tp_world_size"] == 2 and got["provenance"]["tp_rank"] == r
        assert got["refused"].startswith(
            "ProviderUnavailable: rl_kernel_vime: vocab-parallel logits (TP=2) without hidden states"
        )
        assert_close(got["flat_lp"], want_lp, "logprob", F32, f"rank {r} selected_logprobs")
        assert_close(got["flat_ent"], want_ent, "logprob", F32, f"rank {r} selected entropy")
        for name, grad, want in (
            ("dh", got["flat_dh"], g_want[0]),
            ("dw", got["flat_dw"], g_want[1][shard]),
            ("db", got["flat_db"], g_want[2][shard]),
        ):
            assert_close(grad, want, "gradient", F32, f"rank {r} selected {name}")
        assert got["flat_provenance"]["boundary"] == "selected_logprob" and got["flat_provenance"]["tp_rank"] == r
        assert got["flat_provenance"]["vocab"] == {
            "vocab_start_index": r * vocab // 2,
            "global_vocab_size": vocab,
            "real_vocab_size": vocab - 3,
        }
        assert got["flat_refused"].startswith(
            "ProviderUnavailable: rl_kernel_vime: vocab-parallel logits (TP=2) without hidden states"
        )


# --- malformed requests: a one-line TypeError/ValueError naming the field, on either boundary ---


def _well_formed(gen, rows: int = 6, hidden: int = 5, vocab: int = 11) -> dict[str, Any]:
    """One well-formed request per boundary and input (vime's own dataclasses)."""
    h, w, b, tgt = random_head(gen, rows=rows, hidden=hidden, vocab=vocab)
    logits = F.linear(h, w, b).detach()
    context = _head_context(h, w, b, local_start=0, local_size=vocab, real_size=vocab - 2, padded_size=vocab)
    cp = selected_boundary.ContextParallelLayout(world_size=1, rank=0, layout="single")

    def flat(**fields: Any) -> selected_boundary.SelectedLogprobRequest:
        return selected_boundary.SelectedLogprobRequest(
            **request_fields(logits, tgt, with_entropy=True, context_parallel=cp, **fields)
        )

    return {
        "linear/logits": _request(logits, tgt, with_entropy=True),
        "linear/hidden": _request(logits, tgt, with_entropy=True, context=context),
        "selected/logits": flat(),
        "selected/hidden": flat(
            hidden=h, lm_head_weight=w, lm_head_bias=b, global_vocab_size=vocab, real_vocab_size=vocab - 2
        ),
    }


KINDS = ["linear/logits", "linear/hidden", "selected/logits", "selected/hidden"]


def _fields(obj: Any) -> dict[str, Any]:
    return (
        {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        if dataclasses.is_dataclass(obj)
        else dict(vars(obj))
    )


def _structural(request: Any, **changes: Any) -> SimpleNamespace:
    """``request`` as a plain object with the same fields (what vime's boundaries accept too), some changed."""
    return SimpleNamespace(**{**_fields(request), **changes})


def _without(obj: Any, path: str) -> SimpleNamespace:
    """``obj`` as plain objects with the field at dotted ``path`` removed."""
    head, _, rest = path.partition(".")
    values = _fields(obj)
    if rest:
        values[head] = _without(values[head], rest)
    else:
        del values[head]
    return SimpleNamespace(**values)


def _refusal(request: Any, kinds: tuple[type, ...] = (TypeError, ValueError)) -> str:
    with pytest.raises(kinds) as info:
        provider(request)
    message = str(info.value)
    assert "\n" not in message, message
    return message


_REQUIRED = ["logits", "target_ids", "tensor_parallel_group", "with_entropy", "with_entropy_grad"]
MISSING = (
    [(kind, name) for kind in KINDS for name in _REQUIRED]
    + [
        (kind, f"token_layout{sub}")
        for kind in ("linear/logits", "linear/hidden")
        for sub in ("", ".world_size", ".rank", ".layout")
    ]
    + [
        (kind, f"context_parallel{sub}")
        for kind in ("selected/logits", "selected/hidden")
        for sub in ("", ".world_size", ".rank", ".layout")
    ]
    + [
        ("linear/hidden", f"context.{sub}")
        for sub in (
            "hidden",
            "projection",
            "projection.weight",
            "vocab_partition",
            "vocab_partition.local_start",
            "vocab_partition.local_size",
            "vocab_partition.real_size",
            "vocab_partition.padded_size",
        )
    ]
)


@pytest.mark.parametrize("kind, path", MISSING)
def test_a_missing_field_is_named(gen, kind, path):
    """A request without a field vime's dataclass always has (a structural request): a TypeError
    naming the field, not an AttributeError from deep inside."""
    message = _refusal(_without(_well_formed(gen)[kind], path), (TypeError,))
    assert message.startswith(f"request.{path} is missing: expected "), message
    assert "without it" in message


def test_a_request_of_neither_boundary_is_named(gen):
    message = _refusal(SimpleNamespace(logits=torch.randn(2, 3, generator=gen)), (TypeError,))
    assert (
        "LinearLogpRequest (with token_layout)" in message
        and "SelectedLogprobRequest (with context_parallel)" in message
    )
    assert "SimpleNamespace" in message


MALFORMED: dict[str, tuple[str, Any, type, str]] = {
    # name: (request kind, changes(request, rows) -> dict, exception, message start)
    "logits 3-D": (
        "linear/logits",
        lambda r, n: {"logits": r.logits[None]},
        ValueError,
        "request.logits must be a [T, V_local] float tensor, got shape",
    ),
    "logits a list": (
        "selected/logits",
        lambda r, n: {"logits": r.logits.tolist()},
        TypeError,
        "request.logits must be a [T, V_local] float tensor, got list",
    ),
    "targets float": (
        "selected/hidden",
        lambda r, n: {"target_ids": r.target_ids.float()},
        TypeError,
        "request.target_ids must be an integer tensor",
    ),
    "targets short": (
        "linear/hidden",
        lambda r, n: {"target_ids": r.target_ids[:-1]},
        ValueError,
        "request.target_ids must have T=",
    ),
    "with_entropy a string": (
        "linear/logits",
        lambda r, n: {"with_entropy": "yes"},
        TypeError,
        "request.with_entropy must be a bool, got str",
    ),
    "cp rank past world": (
        "selected/logits",
        lambda r, n: {"context_parallel": SimpleNamespace(world_size=1, rank=1, layout="single")},
        ValueError,
        "request.context_parallel.rank must be in [0, world_size=1)",
    ),
    "cp layout unknown": (
        "linear/logits",
        lambda r, n: {"token_layout": SimpleNamespace(world_size=2, rank=0, layout="ring")},
        ValueError,
        "request.token_layout.layout must be 'zigzag' or 'allgather' for world_size=2, got 'ring'",
    ),
    "weight without hidden": (
        "selected/hidden",
        lambda r, n: {"hidden": None},
        ValueError,
        "request.hidden must be a tensor when request.lm_head_weight is given",
    ),
    "bias alone": (
        "selected/logits",
        lambda r, n: {"lm_head_bias": torch.zeros(3)},
        ValueError,
        "request.lm_head_bias must be None without",
    ),
    "hidden 1-D": (
        "selected/hidden",
        lambda r, n: {"hidden": r.hidden[0]},
        ValueError,
        "request.hidden must be a [T, H] float tensor, got shape",
    ),
    "vocab start negative": (
        "selected/hidden",
        lambda r, n: {"vocab_start_index": -1},
        ValueError,
        "request.vocab_start_index must be an int >= 0, got -1",
    ),
    "vocab start a float": (
        "selected/hidden",
        lambda r, n: {"vocab_start_index": 0.0},
        TypeError,
        "request.vocab_start_index must be an int >= 0, got float",
    ),
    "real past padded": (
        "selected/hidden",
        lambda r, n: {"real_vocab_size": r.global_vocab_size + 1},
        ValueError,
        "real_vocab_size must be at most global_vocab_size=",
    ),
    "partition width": (
        "linear/hidden",
        lambda r, n: {
            "context": SimpleNamespace(
                **{
                    **_fields(r.context),
                    "vocab_partition": SimpleNamespace(local_start=0, local_size=n + 1, real_size=n, padded_size=n + 1),
                }
            )
        },
        ValueError,
        "request.context.vocab_partition.local_size must equal the LM-head shard's rows",
    ),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_a_malformed_field_is_named(gen, name):
    kind, change, error, start = MALFORMED[name]
    request = _well_formed(gen)[kind]
    message = _refusal(_structural(request, **change(request, request.logits.size(1))), (error,))
    assert message.startswith(start), message


def _bad_temperature(kind: str, gen: torch.Generator, rows: int) -> Any:
    """A temperature of class ``kind``, its free parameters drawn from ``gen``."""
    u = float(torch.rand((), generator=gen))
    index = int(torch.randint(0, rows, (), generator=gen))
    good = 0.25 + 4 * u
    if kind == "nan":
        return math.nan
    if kind == "inf":
        return math.inf if u < 0.5 else -math.inf
    if kind == "negative":
        return -(good if u < 0.5 else int(1 + 100 * u))
    if kind == "zero":
        return 0.0 if u < 0.5 else 0
    if kind == "below the range":  # positive, but 1/t overflows fp32
        return (0.01 + u) * 1e-39
    if kind == "overflowing int":
        return 10 ** int(torch.randint(309, 2000, (), generator=gen))
    if kind == "bool":
        return u < 0.5
    if kind == "string":
        return str(good)
    if kind == "all-NaN tensor":
        return torch.full((rows,) if u < 0.5 else (1,), math.nan)
    if kind == "one bad entry":
        t = torch.full((rows,), good)
        t[index] = [math.nan, math.inf, -good, 0.0][int(4 * u)]
        return t
    if kind == "empty tensor":
        return torch.empty(0)
    if kind == "meta tensor":
        return torch.full((rows,) if u < 0.5 else (1,), good, device="meta")
    if kind == "wrong count":
        return torch.full(
            (rows + 1 + index,) if u < 0.5 or rows <= 2 else (2 + index % (rows - 2),), good
        )  # neither 1 nor T
    if kind == "complex tensor":
        return torch.full((1,), good, dtype=torch.complex64)
    if kind == "bool tensor":
        return torch.ones(1, dtype=torch.bool)
    raise AssertionError(kind)


BAD_TEMPERATURES = {
    "nan": ValueError,
    "inf": ValueError,
    "negative": ValueError,
    "zero": ValueError,
    "below the range": ValueError,
    "overflowing int": ValueError,
    "bool": TypeError,
    "string": TypeError,
    "all-NaN tensor": ValueError,
    "one bad entry": ValueError,
    "empty tensor": ValueError,
    "meta tensor": ValueError,
    "wrong count": ValueError,
    "complex tensor": TypeError,
    "bool tensor": TypeError,
}


@pytest.mark.parametrize("kind", KINDS)
def test_bad_temperatures_are_refused_naming_the_field(gen, kind):
    """Property, over every class of bad temperature (random draws of each class's parameters), on
    both boundaries and both inputs: a one-line error naming ``request.temperature`` before any op
    runs, never a raw ``OverflowError``/meta-tensor error, never "temperatures differ" for NaN,
    never an empty tensor served as 1 (vime's own request checks let NaN and infinity through)."""
    request = _well_formed(gen)[kind]
    rows = request.logits.size(0)
    for bad, error in BAD_TEMPERATURES.items():
        for _ in range(3):
            value = _bad_temperature(bad, gen, rows)
            message = _refusal(_structural(request, temperature=value), (error,))
            assert message.startswith("request.temperature"), (bad, value, message)
    assert registry.provider_calls() == {}  # nothing was served, nothing reported unavailable


def test_an_all_nan_temperature_stops_vime_in_auto_mode(gen):
    """vime's request check lets NaN through (``nan <= 0`` is false): the provider's ValueError
    reaches the user in ``auto`` mode too, instead of a fallback for "temperatures that differ"."""
    request = dataclasses.replace(_well_formed(gen)["linear/hidden"], temperature=torch.full((6,), math.nan))
    with pytest.raises(ValueError, match=r"^request\.temperature\[0\] must be a finite number > 0, got nan$"):
        boundary.compute_linear_logp(args=_args(), request=request, native=must_not_run)


def _good_temperature(gen: torch.Generator, rows: int) -> tuple[Any, float]:
    u = float(torch.rand((), generator=gen))
    value = 0.2 + 3 * float(torch.rand((), generator=gen))
    form = int(4 * u)
    if form == 0:
        return value, value
    if form == 1:
        n = 1 + int(3 * float(torch.rand((), generator=gen)))
        return n, float(n)
    dtype = (torch.float32, torch.float64)[int(2 * float(torch.rand((), generator=gen)))]
    t = torch.full((1,) if form == 2 else (rows,), value, dtype=dtype)
    return t, float(t[0])


@pytest.mark.parametrize("kind", KINDS)
def test_good_temperatures_are_served(gen, kind):
    """Property: a number, an int, a 1-element or an equal ``[T]`` tensor (random values and
    dtypes) divides the hidden-state logits; with logits the temperature is vime's (already
    applied) and the logits are scored as given."""
    request = _well_formed(gen)[kind]
    rows = request.logits.size(0)
    for _ in range(4):
        value, scale = _good_temperature(gen, rows)
        result = provider(_structural(request, temperature=value))
        logp = result.logp if kind.startswith("linear") else result.selected_logprobs
        if kind.endswith("hidden"):
            want_lp, _ = native_path(_request(request.logits / scale, request.target_ids))
            assert result.provenance["temperature"] == pytest.approx(scale, rel=1e-12)
        else:
            want_lp, _ = native_path(_request(request.logits, request.target_ids))
            assert result.provenance["temperature"] == "applied by vime"
        assert_close(logp, want_lp, "logprob", F32, f"{kind} logp at temperature {value}")
