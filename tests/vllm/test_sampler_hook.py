"""The log-prob and sampler hooks around vLLM's real V1 ``Sampler`` (in this process, no engine).

vLLM's ``Sampler.forward`` is called unpatched and through :func:`rl_kernel_vllm.logprobs.wrap_v1_forward`
on the same random logits and the same RNG state, with batches that mix temperatures, greedy
rows and penalties (which vLLM applies to the logits in place). The wrapped call must sample the
same tokens with the same ranks, and return the trainer's definition of their log-probs (checked
against an fp64 reference within the contract). The sampler hook is installed on one ``Sampler``
instance only (an instance attribute), so vLLM's class stays untouched in this process.
"""

from __future__ import annotations

import types

import pytest
import torch

import rl_kernel_core
from rl_kernel_core import contract
from rl_kernel_vllm.logprobs import effective_temperatures, mode_temperatures, trainer_logprobs, wrap_v1_forward
from rl_kernel_vllm.sampler import SEED_BOUND, wrap_v1_sample

sampler_mod = pytest.importorskip("vllm.v1.sample.sampler")
from vllm.v1.sample.logits_processor import LogitsProcessors  # noqa: E402
from vllm.v1.sample.metadata import SamplingMetadata  # noqa: E402

VOCAB = 97
TEMPERATURES = [0.6, 1.0, 1.4, 0.0, 0.6, 2.0]  # row 3 is greedy


def _metadata(
    temps: list[float], num_logprobs, *, penalties: bool, seed: int, top_k=None, top_p=None
) -> SamplingMetadata:
    n = len(temps)
    gen = torch.Generator().manual_seed(seed)
    presence = torch.zeros(n)
    repetition = torch.ones(n)
    if penalties:
        presence[::2] = 0.7
        repetition[1::2] = 1.3
    return SamplingMetadata(
        temperature=torch.tensor(temps, dtype=torch.float32),
        all_greedy=all(t < 1e-5 for t in temps),
        all_random=all(t >= 1e-5 for t in temps),
        top_p=top_p,
        top_k=top_k,
        generators={i: torch.Generator().manual_seed(seed + i) for i in range(n)},
        max_num_logprobs=num_logprobs,
        no_penalties=not penalties,
        prompt_token_ids=torch.randint(0, VOCAB, (n, 5), generator=gen),
        frequency_penalties=torch.zeros(n),
        presence_penalties=presence,
        repetition_penalties=repetition,
        output_token_ids=[torch.randint(0, VOCAB, (3,), generator=gen).tolist() for _ in range(n)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


def _run(forward, sampler, logits: torch.Tensor, temps, num_logprobs, penalties: bool, seed: int):
    torch.manual_seed(seed)
    return forward(sampler, logits.clone(), _metadata(temps, num_logprobs, penalties=penalties, seed=seed))


def _reference(logits: torch.Tensor, ids: torch.Tensor, temps, mode: str = "processed_logprobs") -> torch.Tensor:
    t = torch.tensor(mode_temperatures(mode, temps), dtype=torch.float64)[:, None]
    return torch.log_softmax(logits.double() / t, dim=-1).gather(1, ids.long())


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("penalties", [False, True])
def test_wrapped_sampler_values_follow_the_mode(mode, dtype, penalties, seed):
    """raw_logprobs: vLLM's pre-temperature definition; processed_logprobs: the trainer's."""
    sampler = sampler_mod.Sampler(logprobs_mode=mode)
    original = sampler_mod.Sampler.__dict__["forward"]
    original = getattr(original, "__rl_kernel_original__", original)
    logits = (torch.randn(len(TEMPERATURES), VOCAB) * 3).to(dtype)
    theirs = _run(original, sampler, logits, TEMPERATURES, 2, penalties, seed)
    ours = _run(wrap_v1_forward(original), sampler, logits, TEMPERATURES, 2, penalties, seed)

    assert torch.equal(ours.sampled_token_ids, theirs.sampled_token_ids)
    lt_ours, lt_theirs = ours.logprobs_tensors, theirs.logprobs_tensors
    assert torch.equal(lt_ours.logprob_token_ids, lt_theirs.logprob_token_ids)
    assert torch.equal(lt_ours.selected_token_ranks, lt_theirs.selected_token_ranks)
    assert lt_ours.logprobs.dtype == torch.float32
    want = _reference(logits, lt_ours.logprob_token_ids, TEMPERATURES, mode)
    contract.assert_close(lt_ours.logprobs, want, "logprob", dtype, name=f"{mode} {dtype}")
    tol = contract.tolerance("logprob", dtype)
    gap = (lt_theirs.logprobs.double() - want).abs() > tol.atol + tol.rtol * want.abs()
    if mode == "raw_logprobs":
        # raw keeps vLLM's definition (before temperature and penalties): vLLM's values agree
        assert not gap.any()
    else:
        # processed: the trainer's definition, not vLLM's (which applies penalties too)
        trainer = _reference(logits, lt_ours.logprob_token_ids, TEMPERATURES, "processed_logprobs")
        contract.assert_close(lt_ours.logprobs, trainer, "logprob", dtype, name=f"{mode} {dtype} trainer")
        if penalties:
            assert gap.any()


@pytest.mark.parametrize(
    "num_logprobs, mode",
    [(None, "raw_logprobs"), (-1, "raw_logprobs"), (1, "raw_logits"), (1, "processed_logits")],
)
def test_requests_the_hook_does_not_cover_are_vllms(num_logprobs, mode, seed):
    sampler = sampler_mod.Sampler(logprobs_mode=mode)
    original = sampler_mod.Sampler.__dict__["forward"]
    original = getattr(original, "__rl_kernel_original__", original)
    logits = torch.randn(len(TEMPERATURES), VOCAB) * 3
    theirs = _run(original, sampler, logits, TEMPERATURES, num_logprobs, False, seed)
    ours = _run(wrap_v1_forward(original), sampler, logits, TEMPERATURES, num_logprobs, False, seed)
    assert torch.equal(ours.sampled_token_ids, theirs.sampled_token_ids)
    if num_logprobs is None:
        assert ours.logprobs_tensors is None and theirs.logprobs_tensors is None
    else:
        for a, b in zip(ours.logprobs_tensors[:3], theirs.logprobs_tensors[:3]):
            assert torch.equal(a, b)


def test_row_values_do_not_depend_on_the_batch(seed):
    # A row's value is bitwise the same alone and inside a mixed-temperature batch.
    logits = torch.randn(len(TEMPERATURES), VOCAB) * 3
    ids = torch.randint(0, VOCAB, (len(TEMPERATURES), 3))
    temps = effective_temperatures(TEMPERATURES)
    batch = trainer_logprobs(logits, ids, temps)
    for i in range(len(temps)):
        alone = trainer_logprobs(logits[i : i + 1], ids[i : i + 1], temps[i : i + 1])
        assert torch.equal(alone[0], batch[i]), f"row {i}"


def test_trainer_logprobs_checks_shapes():
    logits = torch.randn(3, VOCAB)
    with pytest.raises(ValueError, match=r"token_ids must be \[N=3, K\]"):
        trainer_logprobs(logits, torch.zeros(3, dtype=torch.int64), [1.0] * 3)
    with pytest.raises(ValueError, match="temperatures must hold N=3 values, got 2"):
        trainer_logprobs(logits, torch.zeros(3, 1, dtype=torch.int64), [1.0] * 2)


# --- sampler hook ------------------------------------------------------------------------------

TOP_K = [VOCAB, 5, VOCAB, VOCAB, 3, VOCAB]  # vLLM stores "no top-k" as the vocab size
TOP_P = [1.0, 1.0, 0.8, 1.0, 0.9, 1.0]


def _sampler_with_hook(mode: str = "raw_logprobs"):
    sampler = sampler_mod.Sampler(logprobs_mode=mode)
    original = sampler_mod.Sampler.__dict__["sample"]
    original = getattr(original, "__rl_kernel_original__", original)
    sampler.sample = types.MethodType(wrap_v1_sample(original), sampler)
    return sampler


def _sample_rows(sampler, logits, rows: list[int], seed: int, num_logprobs=None) -> torch.Tensor:
    """Tokens for ``rows`` of ``logits`` sampled as one batch; row ``r`` keeps request seed ``seed + r``."""
    meta = _metadata(
        [TEMPERATURES[r] for r in rows],
        num_logprobs,
        penalties=False,
        seed=seed,
        top_k=torch.tensor([TOP_K[r] for r in rows], dtype=torch.int32),
        top_p=torch.tensor([TOP_P[r] for r in rows], dtype=torch.float32),
    )
    meta.generators = {i: torch.Generator().manual_seed(seed + r) for i, r in enumerate(rows)}
    return sampler.forward(logits[rows].clone(), meta).sampled_token_ids[:, 0]


def test_seeded_token_does_not_depend_on_batch_or_position(seed):
    sampler = _sampler_with_hook()
    logits = torch.randn(len(TEMPERATURES), VOCAB) * 2
    rows = list(range(len(TEMPERATURES)))
    batch = _sample_rows(sampler, logits, rows, seed)
    reversed_batch = _sample_rows(sampler, logits, rows[::-1], seed)
    assert torch.equal(reversed_batch, batch.flip(0))
    for r in rows:
        assert torch.equal(_sample_rows(sampler, logits, [r], seed), batch[r : r + 1]), f"row {r}"


def test_tokens_reproduce_offline_with_rl_kernel_sample(seed):
    sampler = _sampler_with_hook()
    logits = torch.randn(len(TEMPERATURES), VOCAB) * 2
    rows = list(range(len(TEMPERATURES)))
    tokens = _sample_rows(sampler, logits, rows, seed)
    seeds = torch.tensor(
        [int(torch.randint(0, SEED_BOUND, (1,), generator=torch.Generator().manual_seed(seed + r))) for r in rows]
    )
    want, _ = rl_kernel_core.sample(
        logits,
        temperature=torch.tensor(TEMPERATURES),
        top_k=torch.tensor(TOP_K),
        top_p=torch.tensor(TOP_P, dtype=torch.float64),
        seeds=seeds,
    )
    assert torch.equal(tokens, want)
    assert int(tokens[3]) == int(logits[3].argmax())  # greedy row
    for r in (1, 4):  # top-k rows
        assert int(tokens[r]) in logits[r].topk(TOP_K[r]).indices.tolist()


def test_processed_logprobs_batches_are_sampled_by_vllm(seed):
    ours = _sampler_with_hook("processed_logprobs")
    theirs = sampler_mod.Sampler(logprobs_mode="processed_logprobs")
    logits = torch.randn(len(TEMPERATURES), VOCAB) * 2
    rows = list(range(len(TEMPERATURES)))
    torch.manual_seed(seed)
    a = _sample_rows(ours, logits, rows, seed, num_logprobs=1)
    torch.manual_seed(seed)
    b = _sample_rows(theirs, logits, rows, seed, num_logprobs=1)
    assert torch.equal(a, b)


def test_warm_up_runs_the_kernels_once_per_logits_kind(monkeypatch):
    """The hook's first-call warm-up (vLLM's dummy sampler run): every kernel once per device,
    dtype and vocab size, on the logits it is given, with token id 0; later calls do nothing."""
    from rl_kernel_vllm import logprobs

    monkeypatch.setattr(logprobs, "_warmed", set())
    calls: list[object] = []
    logits = torch.randn(3, VOCAB)
    logprobs.warm_up(logits, lambda x, ids: calls.append((x is logits, ids.tolist())))
    logprobs.warm_up(logits.clone(), lambda x, ids: calls.append("again"))
    logprobs.warm_up(logits.double(), lambda x, ids: calls.append("fp64"))
    logprobs.warm_up(torch.randn(3, VOCAB + 1), lambda x, ids: calls.append("another vocab"))
    assert calls == [(True, [0, 0, 0]), "fp64", "another vocab"]


def test_the_wrapped_v1_sampler_warms_up_on_its_first_call(monkeypatch, seed):
    """vLLM's first sampler call (its dummy run, which asks for no log-probs) compiles the hook's kernels."""
    from rl_kernel_vllm import logprobs

    monkeypatch.setattr(logprobs, "_warmed", set())
    sampler = sampler_mod.Sampler(logprobs_mode="processed_logprobs")
    original = sampler_mod.Sampler.__dict__["forward"]
    original = getattr(original, "__rl_kernel_original__", original)
    logits = torch.randn(len(TEMPERATURES), VOCAB)
    _run(wrap_v1_forward(original), sampler, logits, TEMPERATURES, None, False, seed)
    assert logprobs._warmed == {(logits.device, logits.dtype, VOCAB)}
