"""The adapters' shared toolkit: targets by import path, idempotent patches, exact restore,
import hooks, the strict switch. Exercised on throwaway modules written to a temporary directory."""

import importlib
import logging
import subprocess
import sys
import textwrap

import pytest

from rl_kernel_core import adapters
from rl_kernel_core.switches import SwitchError

FRAMEWORK = """
class Base:
    def inherited(self):
        return "base"


class Engine(Base):
    def run(self, x):
        return x + 1

    @staticmethod
    def helper(x):
        return x * 2

    @classmethod
    def new(cls):
        return cls()


def compute(x):
    return x - 1
"""
CONSUMER = "from fw.core import compute\n"


@pytest.fixture
def fw(tmp_path, monkeypatch):
    """A package ``fw`` with ``fw.core`` (the framework) and ``fw.user`` (imports by name), fresh per test."""
    pkg = tmp_path / "fw"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "core.py").write_text(textwrap.dedent(FRAMEWORK))
    (pkg / "user.py").write_text(CONSUMER)
    (pkg / "late.py").write_text(CONSUMER)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [n for n in sys.modules if n == "fw" or n.startswith("fw.")]:
        monkeypatch.delitem(sys.modules, name)
    yield importlib.import_module("fw.core")
    for name in [n for n in sys.modules if n == "fw" or n.startswith("fw.")]:
        del sys.modules[name]


def test_resolve_and_locate(fw):
    assert adapters.resolve("fw.core:Engine.run") is fw.Engine.run
    assert adapters.resolve("fw.core:Engine.inherited") is fw.Base.inherited  # reading: inherited is fine
    owner, name, stored = adapters.locate("fw.core:Engine.helper")
    assert owner is fw.Engine and name == "helper" and isinstance(stored, staticmethod)  # the raw entry
    assert adapters.locate("fw.core:compute") == (fw, "compute", fw.compute)


@pytest.mark.parametrize(
    "target, says",
    [
        ("fw.nope:X", "fw.nope:X: cannot import fw.nope (ModuleNotFoundError"),
        ("fw.core:Nope.run", "fw.core:Nope.run: fw.core has no attribute 'Nope'"),
        ("fw.core:Engine.inherited", "fw.core:Engine.inherited: Engine defines no attribute 'inherited'"),
        ("fw.core:nope", "fw.core:nope: fw.core defines no attribute 'nope'"),
    ],
)
def test_locate_names_what_is_missing(fw, target, says):
    with pytest.raises(adapters.TargetMissing) as info:
        adapters.locate(target)
    assert str(info.value).startswith(says)


@pytest.mark.parametrize("target", ["fw.core.Engine.run", ":run", "fw.core:"])
def test_malformed_target(fw, target):
    with pytest.raises(ValueError, match="package.module:Attr.path"):
        adapters.resolve(target)


def test_install_is_idempotent_and_restore_is_exact(fw):
    before = dict(vars(fw.Engine)), fw.compute
    patches = adapters.Patches()

    def wrap_method(original):
        def run(self, x):
            return original(self, x) * 10

        return run

    assert patches.install("fw.core:Engine.run", wrap_method) == "patched"
    assert patches.install("fw.core:Engine.run", wrap_method) == "already patched"
    assert (
        patches.install("fw.core:Engine.helper", lambda raw: staticmethod(lambda x: raw.__func__(x) + 100)) == "patched"
    )
    assert patches.install("fw.core:Engine.new", lambda raw: classmethod(lambda cls: "new")) == "patched"
    assert patches.install("fw.core:compute", lambda original: lambda x: original(x) * 3) == "patched"
    assert fw.Engine().run(1) == 20 and fw.Engine.helper(1) == 102 and fw.Engine.new() == "new" and fw.compute(5) == 12
    assert getattr(vars(fw.Engine)["run"], adapters.ORIGINAL_ATTR) is before[0]["run"]
    assert len(patches) == 4
    patches.restore()
    assert dict(vars(fw.Engine)) == before[0] and fw.compute is before[1]
    assert len(patches) == 0
    patches.restore()  # a second restore changes nothing
    assert dict(vars(fw.Engine)) == before[0]


def test_set_of_an_absent_attribute_is_deleted_again(fw):
    patches = adapters.Patches()
    patches.set(fw.Engine, "inherited", lambda self: "shadow")
    patches.set(fw, "added", 1)
    assert fw.Engine().inherited() == "shadow" and fw.added == 1
    patches.restore()
    assert "inherited" not in vars(fw.Engine) and fw.Engine().inherited() == "base" and not hasattr(fw, "added")


def test_rebind_and_restore_by_name_imports(fw):
    user = importlib.import_module("fw.user")
    original = fw.compute
    patches = adapters.Patches()
    patches.install("fw.core:compute", lambda o: lambda x: "hooked")
    hook = fw.compute
    assert patches.rebind([(original, hook)], "fw") == ["fw.user.compute"]
    assert user.compute is hook
    late = importlib.import_module("fw.late")  # imported after the patch: binds the hook itself
    assert late.compute is hook
    restored = []
    patches.on_restore(lambda: restored.append(True))
    patches.restore()
    assert fw.compute is original and user.compute is original and late.compute is original and restored == [True]


def test_import_hook_runs_after_the_module_and_restore_removes_it(fw):
    seen = []
    patches = adapters.Patches()
    hook = patches.add_import_hook(
        adapters.ImportHook(["fw.user"], lambda module: seen.append((module.__name__, module.compute)))
    )
    assert sys.meta_path[0] is hook
    user = importlib.import_module("fw.user")
    assert seen == [("fw.user", fw.compute)] and user.__spec__ is not None
    # the hooked loader hands what it does not define (get_filename here) to the real one
    assert getattr(user.__spec__.loader, "get_filename")("fw.user").endswith("user.py")
    patches.restore()
    assert hook not in sys.meta_path


def test_import_hook_once_and_before(fw):
    once = adapters.ImportHook(["fw.user"], lambda module: None, once=True)
    once.install()
    importlib.import_module("fw.user")
    assert once not in sys.meta_path

    def refuse(name):
        raise ImportError(f"refused {name}")

    gate = adapters.ImportHook(["fw.late"], lambda module: pytest.fail("must not run"), before=refuse)
    gate.install()
    try:
        with pytest.raises(ImportError, match="refused fw.late"):
            importlib.import_module("fw.late")
        assert "fw.late" not in sys.modules
    finally:
        gate.remove()


def test_strict_switch_uses_the_one_parser():
    assert adapters.strict_switch("X_STRICT", {}) is False
    assert adapters.strict_switch("X_STRICT", {"X_STRICT": " Yes "}) is True
    with pytest.raises(SwitchError, match="X_STRICT must be one of .*'garbage'"):
        adapters.strict_switch("X_STRICT", {"X_STRICT": "garbage"})


def test_refuse_or_warn(caplog):
    logger = logging.getLogger("rl_kernel.test_adapters")
    with pytest.raises(adapters.TargetMissing, match="gone"):
        adapters.refuse_or_warn("gone", strict=True, error=adapters.TargetMissing, logger=logger)
    with caplog.at_level(logging.WARNING, logger=logger.name):
        for _ in range(3):
            adapters.refuse_or_warn(
                "moved away", strict=False, error=adapters.TargetMissing, logger=logger, hint="set X=1"
            )
    assert [r.getMessage() for r in caplog.records] == ["moved away (set X=1)"]


def test_toolkit_imports_without_torch():
    """The adapters read their switches at process start: these modules must not load torch."""
    code = "import sys, rl_kernel_core.adapters, rl_kernel_core.switches; print(sorted(m for m in sys.modules if m.startswith(('torch', 'rl_kernel'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['rl_kernel_core', 'rl_kernel_core.adapters', 'rl_kernel_core.switches']"


def test_public_api_still_resolves():
    import rl_kernel_core as rk
    import rl_kernel_core.loss.api  # noqa: F401  (the family's package, named for no public function)

    assert callable(rk.policy_loss) and rk.policy_loss.__module__ == "rl_kernel_core.loss.api"
    assert set(rk.__all__) <= set(dir(rk))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        rk.nope
