"""``python -m rl_kernel_vime``: install the start-up file, or report which hooks are live.

* ``install-pth [--site-dir DIR]``: copy ``rl_kernel_vime.pth`` into ``DIR`` (default: this
  interpreter's site-packages). Installs that already ship it (a wheel built from this
  repository) need nothing; an editable install made by a setuptools without the ``.pth`` step
  needs this once.
* ``status``: import vime's target modules (as training would) and print
  :func:`rl_kernel_vime.status` as JSON, with the import error of any module that failed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import sysconfig
from pathlib import Path
from typing import Optional, Sequence

import rl_kernel_vime
from rl_kernel_vime import targets

PTH_NAME = "rl_kernel_vime.pth"


def install_pth(site_dir: Optional[str] = None) -> Path:
    """Copy the packaged ``.pth`` into ``site_dir`` (default: purelib); return the written path."""
    target_dir = Path(site_dir or sysconfig.get_paths()["purelib"])
    if not target_dir.is_dir():
        raise ValueError(f"site_dir must be an existing directory, got {str(target_dir)!r}")
    target = target_dir / PTH_NAME
    shutil.copyfile(Path(rl_kernel_vime.__file__).parent / PTH_NAME, target)
    return target


def report() -> dict:
    """:func:`rl_kernel_vime.status` after importing vime's target modules; failures under ``import_errors``."""
    errors = {}
    for name in sorted(targets.MODULES):
        try:
            importlib.import_module(name)
        except Exception as exc:  # reported, not raised: the point is to see what is missing
            errors[name] = f"{type(exc).__name__}: {exc}"
    return {**rl_kernel_vime.status(), "import_errors": errors}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m rl_kernel_vime", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    pth = sub.add_parser("install-pth", help="write rl_kernel_vime.pth into site-packages")
    pth.add_argument("--site-dir", default=None, help="target directory (default: this interpreter's site-packages)")
    sub.add_parser("status", help="import vime's target modules and print which hooks are live")
    args = parser.parse_args(argv)
    if args.command == "install-pth":
        print(install_pth(args.site_dir))
    else:
        print(json.dumps(report(), indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
