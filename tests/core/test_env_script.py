"""scripts/env.sh: one cached environment per tier, requirement lists and checkout. Two clones
never share one (an editable install points at one checkout, so a shared environment ran whichever
clone installed itself last); a symlink to a clone is the same clone. Nothing is built here
(``--path`` prints the path only)."""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _clone(where: Path, requirements: str = "torch\n") -> Path:
    """A stand-in checkout: the script and one requirement list (tier ``t``)."""
    (where / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "env.sh", where / "scripts" / "env.sh")
    (where / "requirements").mkdir()
    (where / "requirements" / "t.txt").write_text(requirements)
    return where


def _path(clone: Path, cache: Path, tier: str = "t") -> str:
    proc = subprocess.run(
        ["bash", str(clone / "scripts" / "env.sh"), "--path", tier],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "RL_KERNEL_ENV_CACHE": str(cache)},
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_two_clones_never_share_an_environment(tmp_path):
    cache = tmp_path / "cache"
    a, b = _clone(tmp_path / "a"), _clone(tmp_path / "b")
    path_a, path_b = _path(a, cache), _path(b, cache)
    assert re.fullmatch(re.escape(str(cache)) + r"/t-[0-9a-f]{12}", path_a), path_a
    assert path_a != path_b  # the same requirement lists, another checkout
    assert _path(a, cache) == path_a  # stable
    (tmp_path / "link").symlink_to(a)
    assert _path(tmp_path / "link", cache) == path_a  # a symlink to a clone is that clone
    (a / "requirements" / "t.txt").write_text("torch\nnumpy\n")
    assert _path(a, cache) != path_a  # the requirement lists still key it
    assert not cache.exists()  # --path builds nothing


def test_checkout_key_property(tmp_path, seed):
    """Property: clones at random paths (spaces, non-ASCII, nested), with random but equal
    requirement lists, get pairwise different environments."""
    rng = random.Random(seed)
    cache = tmp_path / "cache"
    requirements = "".join(rng.choice(["torch\n", "numpy==2.0\n", "# comment\n", "triton\n"]) for _ in range(4))
    names: set[str] = set()
    while len(names) < 6:
        names.add(
            "/".join(
                "".join(rng.choice("ab c_é-1") for _ in range(rng.randint(1, 6))).strip() or "x"
                for _ in range(rng.randint(1, 2))
            )
        )
    paths = [_path(_clone(tmp_path / "clones" / name, requirements), cache) for name in sorted(names)]
    assert len(set(paths)) == len(paths), (paths, f"seed={seed}")


def test_this_checkouts_environment_path(tmp_path):
    path = _path(ROOT, tmp_path / "cache", "core")
    assert re.fullmatch(re.escape(str(tmp_path / "cache")) + r"/core-[0-9a-f]{12}", path), path
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "env.sh"), "--path", "no-such-tier"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and proc.stderr.strip().startswith("no requirement list ")
