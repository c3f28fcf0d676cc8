"""End to end with a real vLLM engine on CPU: the log-probs it returns, with the plugin on and off.

Two engines run (each in its own subprocess, at the same time): one with ``RL_KERNEL_VLLM=1``
and every implemented hook on (log-probs, LM head, batch-invariant mode), one without. Both serve the same seeded requests (mixed temperatures, greedy, top-k/top-p,
penalties, top-k log-probs) in one batch. The trainer's side is recomputed here the way a trainer
does it: the ``transformers`` model's final-norm hidden states of prompt + completion, through
the LM head weight, by ``rl_kernel_core.linear_logprob`` at the request's temperature.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vllm_tiny_model
from rl_kernel_core import contract
from vllm_engine_requests import (
    MAX_TOKENS,
    REQUESTS,
    effective_temperature,
    engine_env,
    make_requests,
    recompute_logprobs,
    returned,
)

HERE = Path(__file__).resolve().parent
ENGINE_TIMEOUT_S = 420
TOL = contract.tolerance("logprob", torch.float32)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, module_seed):
    """Build the model, run the ON and OFF engines concurrently, return their reports."""
    seed = module_seed
    root = tmp_path_factory.mktemp("vllm_engine")
    model_dir = root / "model"
    vocab = vllm_tiny_model.build(model_dir, seed)
    requests = make_requests(seed, vocab)
    procs = {}
    for name, on in (("on", True), ("off", False)):
        # The on engine asks for processed log-probs, the mode in which the plugin returns the
        # trainer's definition; the off engine keeps vLLM's default (raw, pre-temperature).
        engine = {"max_model_len": 64, "max_num_seqs": 8, **({"logprobs_mode": "processed_logprobs"} if on else {})}
        spec = root / f"{name}_spec.json"
        spec.write_text(json.dumps({"model": str(model_dir), "requests": requests, "engine": engine}))
        log = open(root / f"{name}.log", "w")
        cmd = [sys.executable, str(HERE / "vllm_engine_run.py"), str(spec), str(root / f"{name}.json")]
        env = engine_env(on, root / f"{name}_steps.jsonl")
        procs[name] = (subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root), log)
    reports = {}
    for name, (proc, log) in procs.items():
        rc: int | str
        try:
            rc = proc.wait(timeout=ENGINE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "timeout"
        log.close()
        text = (root / f"{name}.log").read_text()
        if rc != 0:
            pytest.fail(f"engine {name} exited with {rc}; log tail:\n{text[-4000:]}")
        report = json.loads((root / f"{name}.json").read_text())
        report["log"] = text
        steps = root / f"{name}_steps.jsonl"
        report["steps"] = [json.loads(line) for line in steps.read_text().splitlines()] if steps.exists() else None
        reports[name] = report
        print(f"engine {name}: {report['seconds']}")
    reports["requests"] = requests
    reports["model"] = vllm_tiny_model.load(model_dir)
    return reports


def _outside(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    expected = expected.double()
    return (actual - expected).abs() > TOL.atol + TOL.rtol * expected.abs()


def test_every_request_generated(runs):
    for name in ("on", "off"):
        for result in runs[name]["results"]:
            assert len(result["token_ids"]) == MAX_TOKENS
            assert len(result["logprobs"]) == MAX_TOKENS


def test_plugin_live_in_engine_core_and_worker(runs):
    report = runs["on"]
    driver = report["driver_pid"]
    for worker in report["workers"]:
        assert worker["pid"] != driver
        status = worker["status"]
        assert status["registered"] and status["enabled"]
        assert {h for h, info in status["hooks"].items() if info["live"]} == {"logprobs", "lm_head"}
        assert "v1" in status["hooks"]["logprobs"]["runners"]
        assert worker["sampler_forward_patched"]
        assert worker["runner_sampler_type"] == "vllm.v1.sample.sampler.Sampler"
        assert worker["logits_processor_types"] == [
            "rl_kernel_vllm.lm_head._make_class.<locals>.RLKernelLogitsProcessor"
        ]
    # The engine core is not reachable by collective_rpc; its own log line names its pid.
    core = re.findall(
        r"\(EngineCore[^)]*pid=(\d+)\).*rl_kernel_vllm \(pid (\d+), vllm [^)]*\): live hooks: logprobs, lm_head",
        report["log"],
    )
    assert core and all(a == b and int(a) != driver for a, b in core), report["log"][-3000:]


def test_plugin_off_leaves_worker_untouched(runs):
    for worker in runs["off"]["workers"]:
        assert worker["status"]["registered"], "vLLM did not call the plugin's register()"
        assert not worker["status"]["enabled"]
        assert not worker["sampler_forward_patched"]
        assert worker["logits_processor_types"] == ["vllm.model_executor.layers.logits_processor.LogitsProcessor"]
        assert not worker["rl_kernel_core_imported"], "the plugin imported rl_kernel_core ops while off"
    assert "live hooks" not in runs["off"]["log"]


def test_sampled_tokens_do_not_depend_on_the_plugin(runs):
    # The hook changes returned values only, never what is sampled (all requests are seeded).
    assert [r["token_ids"] for r in runs["on"]["results"]] == [r["token_ids"] for r in runs["off"]["results"]]


def test_on_logprobs_equal_trainer_definition(runs):
    model = runs["model"]
    for request, result in zip(runs["requests"], runs["on"]["results"]):
        params = request["params"]
        ids, got = returned(result, sampled_only=params["logprobs"] == 0)
        if params["logprobs"]:
            assert ids.shape[1] >= params["logprobs"]  # sampled + top-k (fewer columns when it is in the top-k)
        want = recompute_logprobs(
            model, request["prompt_token_ids"], result["token_ids"], ids, effective_temperature(params)
        )
        contract.assert_close(got, want, "logprob", torch.float32, name=f"on, request {params}")


def test_off_returns_vllms_raw_pre_temperature_logprobs(runs):
    model = runs["model"]
    gaps = {}
    for request, result in zip(runs["requests"], runs["off"]["results"]):
        params = request["params"]
        ids, got = returned(result, sampled_only=True)
        raw = recompute_logprobs(model, request["prompt_token_ids"], result["token_ids"], ids, 1.0)
        contract.assert_close(got, raw, "logprob", torch.float32, name=f"off vs T=1, request {params}")
        temperature = effective_temperature(params)
        if temperature != 1.0:
            trained = recompute_logprobs(model, request["prompt_token_ids"], result["token_ids"], ids, temperature)
            gaps[temperature] = (got - trained.double()).abs().max().item()
            assert _outside(got, trained).any(), (
                f"T={temperature}: vLLM's raw values fall within the contract of the trainer's"
            )
    print(f"max |vLLM raw - trainer| by temperature: {gaps}")
    assert len(gaps) == 4


def test_step_records_only_when_on(runs):
    # RL_KERNEL_PROFILE is set for both engines; only the plugin writes records, and only when on.
    assert runs["off"]["steps"] is None
    steps = runs["on"]["steps"]
    worker_pids = {w["pid"] for w in runs["on"]["workers"]}
    assert steps and len(steps) >= MAX_TOKENS  # one record per engine step that returned log-probs
    for record in steps:
        assert set(record["regions"]) == {"logprob"} and record["regions"]["logprob"] >= 0
        assert 1 <= record["tokens"] <= len(REQUESTS)
        assert record["source"] == "vllm.sampler" and record["pid"] in worker_pids
    assert sum(r["tokens"] for r in steps) == MAX_TOKENS * len(REQUESTS)
