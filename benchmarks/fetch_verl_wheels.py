"""Fetch the wheels ``benchmarks/gpu_verl_actor.sh`` installs on the GPU machine, checked against
``benchmarks/gpu_verl_wheels.txt``.

    python3 benchmarks/fetch_verl_wheels.py [DIR]      (default .verl-wheels, git-ignored)
    python3 benchmarks/fetch_verl_wheels.py --ray-parts .ray   (the `parts` line: ray's untrimmed wheel
        in parts of at most 54 MiB, .ray/p0, .ray/p1, ..., for benchmarks/gpu_recipe_verl.sh)

Every line of the list but two is a wheel from the package index, fetched as is (``pip download
--no-deps --only-binary=:all:`` for CPython 3.12 on manylinux x86-64). The two others are made
here from index files whose sha256 this script pins:

* ``antlr4-python3-runtime 4.9.3`` (omegaconf 2.3 needs exactly 4.9.x) has no wheel on the index:
  it is built from its sdist (pure Python, ``pip wheel --no-deps``, ``SOURCE_DATE_EPOCH`` fixed).
* ``ray 2.60.0``'s wheel is 76 MiB, over what one GPU call carries. ``import verl`` imports ray
  (``verl/protocol.py``) and verl's worker classes import ``ray.util``, but a world-size-1 actor
  never starts a Ray cluster, so the wheel is rewritten without the Java jar, the cluster daemons
  (``gcs_server``, ``raylet``) and the dashboard's web client (:data:`RAY_DROPPED`); ``ray.init()``
  cannot work from it. ``RECORD`` loses their lines; nothing else changes.

Lines of kind ``parts`` (ray's untrimmed wheel, which verl's PPO trainer needs: it starts a Ray
cluster) are fetched only with ``--ray-parts DIR``, split into ``DIR/p0``, ``DIR/p1``, ... of at most
:data:`PART_BYTES` each, so that one GPU call carries one folder.

A file whose sha256 differs from the list is an error naming it (a rebuilt wheel on another
machine can differ in its zip bytes: then carry the files made here).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
LIST = os.path.join(HERE, "gpu_verl_wheels.txt")
PLATFORM = [
    "--python-version",
    "3.12",
    "--implementation",
    "cp",
    "--platform",
    "manylinux_2_28_x86_64",
    "--platform",
    "manylinux2014_x86_64",
    "--platform",
    "manylinux_2_17_x86_64",
]
ANTLR_SDIST = (
    "antlr4-python3-runtime-4.9.3.tar.gz",
    "f224469b4168294902bb1efa80a8bf7855f24c99aef99cbefc1bcd3cce77881b",
)
RAY_UPSTREAM = (
    "ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl",
    "b951b40965947a63615830916be04f26440d234de1e9a29dbf2155d03fa9ad2a",
)
RAY_DROPPED = (
    "ray/jars/",
    "ray/core/src/ray/gcs/gcs_server",
    "ray/core/src/ray/raylet/raylet",
    "ray/dashboard/client/build/",
)
PART_BYTES = 54 * 2**20  # a carried folder per part, under one GPU call's 64 MiB
EPOCH = "315532800"  # 1980-01-01, the earliest time a zip entry can hold


def read_list(path: str = LIST) -> list[tuple[str, str, str, str]]:
    """``(kind, name==version, file, sha256)`` per line of the list (``#`` lines are comments)."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip() or line.startswith("#"):
                continue
            fields = line.split()
            if len(fields) != 4 or "==" not in fields[1] or len(fields[3]) != 64:
                raise ValueError(f"{path}:{number}: expected 'KIND NAME==VERSION FILE SHA256', got {line.strip()!r}")
            rows.append((fields[0], fields[1], fields[2], fields[3]))
    return rows


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def expect(path: str, want: str) -> None:
    """Raise unless ``path``'s sha256 is ``want``."""
    got = sha256(path)
    if got != want:
        raise SystemExit(f"{path}: sha256 {got}, expected {want} ({os.path.basename(LIST)})")


def pip_download(spec: str, dest: str, *extra: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *extra, "-d", dest, spec], check=True)


def build_antlr(dest: str, work: str) -> str:
    """The antlr4 4.9.3 wheel built from its pinned sdist; returns its path.

    Raises:
        SystemExit: this Python cannot build wheels without build isolation (it needs setuptools
            >= 70.1, or setuptools with the ``wheel`` package).
    """
    import importlib.util

    if importlib.util.find_spec("setuptools.command.bdist_wheel") is None and importlib.util.find_spec("wheel") is None:
        raise SystemExit(
            f"{sys.executable}: building antlr4-python3-runtime 4.9.3's wheel needs setuptools >= 70.1 or the "
            "wheel package in this Python; run this script with a Python that has one"
        )
    pip_download("antlr4-python3-runtime==4.9.3", work, "--no-binary=:all:")
    sdist = os.path.join(work, ANTLR_SDIST[0])
    expect(sdist, ANTLR_SDIST[1])
    env = {**os.environ, "SOURCE_DATE_EPOCH": EPOCH}
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", dest, sdist],
        check=True,
        env=env,
    )
    return os.path.join(dest, "antlr4_python3_runtime-4.9.3-py3-none-any.whl")


def trim_wheel(source: str, target: str, dropped: tuple[str, ...]) -> None:
    """Copy the wheel ``source`` to ``target`` without the members under ``dropped`` (prefixes),
    their ``RECORD`` lines removed; every other member keeps its name, time, mode and bytes."""
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as out:
        for info in src.infolist():
            if info.filename.startswith(dropped):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                kept = [line for line in data.decode().splitlines(keepends=True) if not line.startswith(dropped)]
                data = "".join(kept).encode()
            out.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)


def split_parts(path: str, dest: str) -> list[str]:
    """``path`` cut into ``dest/p0/<name>.part0``, ``dest/p1/<name>.part1``, ... of at most
    :data:`PART_BYTES`; their concatenation in folder order is the file. Returns the part paths."""
    parts = []
    with open(path, "rb") as f:
        for i, chunk in enumerate(iter(lambda: f.read(PART_BYTES), b"")):
            folder = os.path.join(dest, f"p{i}")
            os.makedirs(folder, exist_ok=True)
            part = os.path.join(folder, f"{os.path.basename(path)}.part{i}")
            with open(part, "wb") as out:
                out.write(chunk)
            parts.append(part)
    return parts


def fetch_parts(rows: list[tuple[str, str, str, str]], dest: str) -> int:
    """The ``parts`` lines' wheels, checked, split into ``dest`` (see :func:`split_parts`)."""
    with tempfile.TemporaryDirectory() as work:
        for _kind, spec, file, want in rows:
            pip_download(spec, work, "--only-binary=:all:", *PLATFORM)
            path = os.path.join(work, file)
            expect(path, want)
            parts = split_parts(path, dest)
            print(f"{file}: {len(parts)} parts in {dest} ({', '.join(os.path.relpath(x, dest) for x in parts)})")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dest", nargs="?", default=".verl-wheels", help="folder for the wheels (git-ignored)")
    p.add_argument(
        "--ray-parts", metavar="DIR", help="instead: the `parts` lines' wheels, in parts under DIR (git-ignored)"
    )
    args = p.parse_args(argv)
    rows = read_list()
    if args.ray_parts:
        return fetch_parts([r for r in rows if r[0] == "parts"], args.ray_parts)
    rows = [r for r in rows if r[0] == "main"]
    os.makedirs(args.dest, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        for _kind, spec, file, want in rows:
            path = os.path.join(args.dest, file)
            if not (os.path.exists(path) and sha256(path) == want):
                name = spec.split("==")[0]
                if name == "antlr4-python3-runtime":
                    build_antlr(args.dest, work)
                elif name == "ray":
                    pip_download(spec, work, "--only-binary=:all:", *PLATFORM)
                    upstream = os.path.join(work, RAY_UPSTREAM[0])
                    expect(upstream, RAY_UPSTREAM[1])
                    trim_wheel(upstream, path, RAY_DROPPED)
                else:
                    pip_download(spec, args.dest, "--only-binary=:all:", *PLATFORM)
            expect(path, want)
    total = sum(os.path.getsize(os.path.join(args.dest, f)) for _, _, f, _ in rows)
    print(f"{len(rows)} wheels in {args.dest}, {total / 2**20:.1f} MiB, sha256 as listed in {os.path.relpath(LIST)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
