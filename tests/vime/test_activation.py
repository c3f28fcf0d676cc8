"""The switch, end to end: a fresh interpreter processes the packaged ``rl_kernel_vime.pth`` the
way site-packages does (``site.addsitedir``), then imports the stand-in vime modules."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import rl_kernel_vime

PACKAGE_DIR = Path(rl_kernel_vime.__file__).parent
STANDIN = Path(__file__).parent / "standin"

PROBE = r"""
import argparse, json, sys
import vime.backends.megatron_utils.linear_logp_provider as boundary
import vime.backends.megatron_utils.loss as loss
import vime.backends.megatron_utils.model as model
import vime.utils.ppo_utils as ppo


def snapshot():
    fns = {
        "ppo.calculate_log_probs_and_entropy": ppo.calculate_log_probs_and_entropy,
        "ppo.compute_approx_kl": ppo.compute_approx_kl,
        "ppo.compute_policy_loss": ppo.compute_policy_loss,
        "loss.calculate_log_probs_and_entropy": loss.calculate_log_probs_and_entropy,
        "loss.compute_approx_kl": loss.compute_approx_kl,
        "loss.get_log_probs_and_entropy": loss.get_log_probs_and_entropy,
        "loss.policy_loss_function": loss.policy_loss_function,
        "model.train_one_step": model.train_one_step,
        "boundary.linear_logp_provider_path": boundary.linear_logp_provider_path,
    }
    out = {"owner": {k: f.__module__ for k, f in fns.items()},
           "provider_without_flag": boundary.linear_logp_provider_path(argparse.Namespace(linear_logp_provider=None)),
           "same_object_in_loss": loss.compute_approx_kl is ppo.compute_approx_kl,
           "rl_kernel_modules": sorted(m for m in sys.modules if m.startswith("rl_kernel"))}
    if "rl_kernel_vime" in sys.modules:
        import rl_kernel_vime
        out["status"] = rl_kernel_vime.status()
    return out


result = {"at_import": snapshot()}
if LATE:  # the hook-flag route: --custom-megatron-init-path rl_kernel_vime.hooks.megatron_init
    import argparse, rl_kernel_vime.hooks
    rl_kernel_vime.hooks.megatron_init(argparse.Namespace())
    result["after_megatron_init"] = snapshot()
print("RESULT " + json.dumps(result))
"""


@pytest.fixture(scope="module")
def site_dir(tmp_path_factory):
    """A directory holding the packaged .pth, processed as a site directory by the probe."""
    path = tmp_path_factory.mktemp("site")
    shutil.copy(PACKAGE_DIR / "rl_kernel_vime.pth", path / "rl_kernel_vime.pth")
    return path


def _env(env_extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIME_RL_KERNEL", "RL_KERNEL_PROFILE"))}
    env.update(env_extra)
    env["PYTHONPATH"] = os.pathsep.join([str(STANDIN), str(PACKAGE_DIR.parent)])
    return env


def _start(site_dir, env_extra, body):
    code = f"import site; site.addsitedir({str(site_dir)!r})\n" + body
    return subprocess.Popen(
        [sys.executable, "-c", code], env=_env(env_extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


HEAVY = {  # each imports torch: started together, read by the tests below
    "off_then_flag": ({"VIME_RL_KERNEL_OPS": "ratio_kl"}, True),  # the switch unset; OPS alone does nothing
    "on": ({"VIME_RL_KERNEL": "1"}, False),
}


@pytest.fixture(scope="module")
def probes(site_dir):
    procs = {name: _start(site_dir, env, f"LATE = {late}\n" + PROBE) for name, (env, late) in HEAVY.items()}
    outs = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=180)
        outs[name] = (proc.returncode, stdout, stderr)
    return outs


def _result(outcome):
    returncode, stdout, stderr = outcome
    assert returncode == 0, stderr
    (line,) = [l for l in stdout.splitlines() if l.startswith("RESULT ")]
    return json.loads(line[len("RESULT ") :])


REPLACED = [
    "ppo.calculate_log_probs_and_entropy",
    "ppo.compute_approx_kl",
    "loss.calculate_log_probs_and_entropy",
    "loss.compute_approx_kl",
    "loss.get_log_probs_and_entropy",
    "loss.policy_loss_function",
    "model.train_one_step",
    "boundary.linear_logp_provider_path",
]


def test_off_changes_nothing_and_imports_nothing(probes):
    out = _result(probes["off_then_flag"])["at_import"]
    assert out["rl_kernel_modules"] == []
    assert all(owner.startswith("vime.") for owner in out["owner"].values())
    assert out["same_object_in_loss"]
    assert out["provider_without_flag"] is None  # vime runs its native log-probs


START_UP = ["rl_kernel_core", "rl_kernel_core.adapters", "rl_kernel_core.switches"]  # standard library only
ON_AT_START_UP = START_UP + [
    "rl_kernel_vime",
    "rl_kernel_vime._bootstrap",
    "rl_kernel_vime.config",
    "rl_kernel_vime.registry",
    "rl_kernel_vime.targets",
]


@pytest.mark.parametrize("value, expected", [("0", []), ("off", ON_AT_START_UP), ("1", ON_AT_START_UP)])
def test_start_up_cost(site_dir, value, expected):
    """At interpreter start the switch costs an environment lookup (``0``/unset) or a few
    standard-library modules (any other value): torch and rl_kernel_core's ops load only when a
    vime module does, and only with the switch on."""
    body = "import json, sys; print(json.dumps(sorted(m for m in sys.modules if m.startswith(('rl_kernel', 'torch')))))"
    proc = _start(site_dir, {"VIME_RL_KERNEL": value}, body)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    loaded = json.loads(stdout.strip())
    assert not [m for m in loaded if m.startswith("torch")]
    assert set(loaded) <= set(expected + ["rl_kernel_vime.fallback"])
    assert bool(loaded) == (value != "0")


def test_off_with_malformed_switches_leaves_vime_alone(site_dir):
    """``VIME_RL_KERNEL=off`` with a bad ``VIME_RL_KERNEL_OPS``: vime imports, untouched."""
    env = {"VIME_RL_KERNEL": "off", "VIME_RL_KERNEL_OPS": "logprob,lossy", "VIME_RL_KERNEL_STRICT": "garbage"}
    proc = _start(site_dir, env, "LATE = False\n" + PROBE)
    stdout, stderr = proc.communicate(timeout=180)
    out = _result((proc.returncode, stdout, stderr))["at_import"]
    assert all(owner.startswith("vime.") for owner in out["owner"].values()), out["owner"]
    assert out["same_object_in_loss"]
    assert not [m for m in out["rl_kernel_modules"] if m.startswith(("rl_kernel_vime.patch", "rl_kernel_vime.hooks"))]
    assert "status" not in out or not out["status"]["enabled"]


def test_on_replaces_the_functions_as_vime_imports_them(probes):
    out = _result(probes["on"])["at_import"]
    for name in REPLACED:
        assert out["owner"][name] == "rl_kernel_vime.hooks", name
    assert out["owner"]["ppo.compute_policy_loss"] == "vime.utils.ppo_utils"  # not replaced: see targets.NOT_REPLACED
    assert out["provider_without_flag"] == "rl_kernel_vime.provider.provider"  # rl-kernel is vime's default provider
    status = out["status"]
    assert status["enabled"] and status["ops"] == ["grpo_loss", "logprob", "ratio_kl"]
    assert set(status["targets"].values()) == {"live"}
    assert status["provider"] == {"path": "rl_kernel_vime.provider.provider", "calls": {}}


def test_ops_selects_and_late_activation_patches_loaded_modules(probes):
    """VIME_RL_KERNEL_OPS=ratio_kl; the hook-flag route (activate() after vime is imported)."""
    out = _result(probes["off_then_flag"])["after_megatron_init"]
    assert out["owner"]["ppo.compute_approx_kl"] == out["owner"]["loss.compute_approx_kl"] == "rl_kernel_vime.hooks"
    assert out["owner"]["loss.policy_loss_function"] == "vime.backends.megatron_utils.loss"
    assert out["owner"]["model.train_one_step"] == "rl_kernel_vime.hooks"  # step timing is always on
    assert out["status"]["targets"]["vime.backends.megatron_utils.loss:policy_loss_function"].startswith("off")
    assert out["owner"]["boundary.linear_logp_provider_path"] == "vime.backends.megatron_utils.linear_logp_provider"
    assert out["provider_without_flag"] is None  # the logprob op is not selected: no default provider


def test_invalid_switch_fails_the_vime_import_loudly(site_dir):
    proc = _start(
        site_dir, {"VIME_RL_KERNEL": "1", "VIME_RL_KERNEL_OPS": "logprob,lossy"}, "import vime.utils.ppo_utils"
    )
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert "ImportError" in stderr and "VIME_RL_KERNEL_OPS" in stderr and "lossy" in stderr


def test_restore_puts_every_binding_back_and_removes_the_import_hook(monkeypatch):
    """In this process: activate, import vime (a module importing by name included), restore."""
    import importlib

    from rl_kernel_core import adapters
    from rl_kernel_vime import hooks

    for name in list(sys.modules):
        if name == "vime" or name.startswith("vime."):
            monkeypatch.delitem(sys.modules, name)
    rl_kernel_vime.activate()
    ppo = importlib.import_module("vime.utils.ppo_utils")
    loss = importlib.import_module("vime.backends.megatron_utils.loss")
    assert ppo.compute_approx_kl is hooks.compute_approx_kl and loss.compute_approx_kl is hooks.compute_approx_kl
    assert [f for f in sys.meta_path if isinstance(f, adapters.ImportHook)]
    rl_kernel_vime.restore()
    assert not [f for f in sys.meta_path if isinstance(f, adapters.ImportHook)]
    assert ppo.compute_approx_kl.__module__ == "vime.utils.ppo_utils"
    assert loss.compute_approx_kl is ppo.compute_approx_kl  # the by-name import is vime's function again
    assert loss.policy_loss_function.__module__ == loss.__name__
    assert not rl_kernel_vime.status()["enabled"]
    model = importlib.import_module("vime.backends.megatron_utils.model")  # imported after restore: untouched
    assert model.train_one_step.__module__ == model.__name__


def test_install_pth_command_writes_the_packaged_file(tmp_path):
    from rl_kernel_vime.__main__ import main

    assert main(["install-pth", "--site-dir", str(tmp_path)]) == 0
    assert (tmp_path / "rl_kernel_vime.pth").read_bytes() == (PACKAGE_DIR / "rl_kernel_vime.pth").read_bytes()
    with pytest.raises(ValueError, match="site_dir"):
        main(["install-pth", "--site-dir", str(tmp_path / "absent")])


def test_status_command_imports_vime_and_reports(capsys):
    from rl_kernel_vime.__main__ import main

    assert main(["status"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["import_errors"] == {} and not out["enabled"]
    assert set(out["targets"]) == {
        f"{m}:{a}"
        for m, a in [
            ("vime.utils.ppo_utils", "calculate_log_probs_and_entropy"),
            ("vime.utils.ppo_utils", "compute_approx_kl"),
            ("vime.backends.megatron_utils.loss", "get_log_probs_and_entropy"),
            ("vime.backends.megatron_utils.loss", "policy_loss_function"),
            ("vime.backends.megatron_utils.model", "train_one_step"),
            ("vime.backends.megatron_utils.linear_logp_provider", "linear_logp_provider_path"),
        ]
    }
    assert "vime.utils.ppo_utils:compute_policy_loss" in out["not_replaced"]


def _fresh_vime_counting_ratio_kl(monkeypatch) -> list:
    """Drops vime's modules (the next import loads them afresh) and counts rl-kernel's ``ratio_kl``
    calls of the hooks: the returned list gets a 1 per call."""
    from rl_kernel_vime import hooks

    for name in list(sys.modules):
        if name == "vime" or name.startswith("vime."):
            monkeypatch.delitem(sys.modules, name)
    calls: list = []
    ratio_kl = hooks.rk.ratio_kl

    def counted(*a, **k):
        calls.append(1)
        return ratio_kl(*a, **k)

    monkeypatch.setattr(hooks.rk, "ratio_kl", counted)
    return calls


def test_a_hook_imported_by_name_elsewhere_calls_vime_after_restore(monkeypatch):
    """A module outside vime that took the hook by name while it was live (restore cannot rebind
    it) runs vime's function after restore(), as status() then says."""
    import importlib

    import torch

    calls = _fresh_vime_counting_ratio_kl(monkeypatch)
    rl_kernel_vime.activate()
    held = importlib.import_module("vime.utils.ppo_utils").compute_approx_kl  # `from ... import` in a user module
    lp, base = torch.randn(5), torch.randn(5)
    held(lp, base, "low_var_kl")
    assert calls == [1]
    rl_kernel_vime.restore()
    assert rl_kernel_vime.status()["targets"]["vime.utils.ppo_utils:compute_approx_kl"] == "restored"
    vime_kl = importlib.import_module("vime.utils.ppo_utils").compute_approx_kl
    assert vime_kl is not held and torch.equal(held(lp, base, "low_var_kl"), vime_kl(lp, base, "low_var_kl"))
    assert calls == [1]  # rl-kernel was not called again
    rl_kernel_vime.activate()  # on again: the held hook serves again
    held(lp, base, "low_var_kl")
    assert calls == [1, 1]


USER_MODULE = """
from vime.utils.ppo_utils import compute_approx_kl


def kl(log_probs, log_probs_base):
    return compute_approx_kl(log_probs, log_probs_base, "low_var_kl")
"""


def _user_module(tmp_path, monkeypatch, name):
    """A user's module outside vime that did ``from vime.utils.ppo_utils import compute_approx_kl``."""
    import importlib

    (tmp_path / f"{name}.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return importlib.import_module(name)


def test_a_user_module_importing_by_name_runs_rl_kernel_only_while_live(monkeypatch, tmp_path, gen):
    """Two user modules did ``from vime.utils.ppo_utils import compute_approx_kl``: one before the
    hooks were enabled (it holds vime's function, which nothing rebinds outside vime: it never
    runs rl-kernel), one while they were live (it holds the hook). The hook checks its target's
    live flag on every call: after ``restore()``, and after a later activation that leaves the
    ``ratio_kl`` op off (``status()`` then says the target is off), it passes straight through to
    vime's function; only an activation that patches the target in again makes it serve."""
    import importlib

    import torch

    from rl_kernel_vime import hooks

    calls = _fresh_vime_counting_ratio_kl(monkeypatch)
    key = "vime.utils.ppo_utils:compute_approx_kl"
    before = _user_module(tmp_path, monkeypatch, "user_kl_before_enabling")
    rl_kernel_vime.activate()
    during = _user_module(tmp_path, monkeypatch, "user_kl_while_enabled")
    vime_kl = rl_kernel_vime.registry.original(key)
    assert before.compute_approx_kl is vime_kl and during.compute_approx_kl is hooks.compute_approx_kl
    lp, base = torch.randn(7, generator=gen), torch.randn(7, generator=gen)
    want = vime_kl(lp, base, "low_var_kl")
    assert torch.equal(before.kl(lp, base), want) and calls == []
    during.kl(lp, base)
    assert calls == [1]

    rl_kernel_vime.restore()
    assert not rl_kernel_vime.status()["enabled"] and rl_kernel_vime.status()["targets"][key] == "restored"
    assert torch.equal(during.kl(lp, base), want) and calls == [1]

    monkeypatch.setenv("VIME_RL_KERNEL_OPS", "logprob")  # on again, without the ratio_kl op
    rl_kernel_vime.activate()
    status = rl_kernel_vime.status()
    assert status["enabled"] and status["targets"][key].startswith("off")
    assert importlib.import_module("vime.utils.ppo_utils").compute_approx_kl is vime_kl
    assert torch.equal(during.kl(lp, base), want) and calls == [1]  # vime's function, as status() says

    rl_kernel_vime.restore()
    monkeypatch.delenv("VIME_RL_KERNEL_OPS")
    rl_kernel_vime.activate()  # ratio_kl selected: patched in again, the held hook serves again
    assert rl_kernel_vime.status()["targets"][key] == "live"
    during.kl(lp, base)
    before.kl(lp, base)
    assert calls == [1, 1]
