"""Compile the CUDA extensions from ``native/csrc`` and say whether they can be, without loading them.

The sources form :data:`GROUPS`, one extension each (``rl_kernel_native_<group>``: the group's
``.cu`` file and its ``bind_<group>.cpp``), so the first call of an op compiles only that op's
group. JIT builds go to :func:`group_dir` (one folder per group in :func:`build_dir`, under
``$RL_KERNEL_CACHE`` or ``~/.cache/rl-kernel/native``; ``torch.utils.cpp_extension``: ninja, nvcc);
a changed source or header is rebuilt. Nothing here compiles at import: the native backend's module of an op calls
:func:`build` for its group when dispatch imports it, on the first call of that op.
``rl-kernel info`` reads :func:`status`, which never builds.

Command line (``python -m rl_kernel_core.native`` runs the same):

- ``build [--verbose] [--jobs N] [GROUP ...]``: compile every group (or those named) ahead of time
  (a Docker build step, or before a multi-process job so no rank builds at start) into the same
  cache, N groups at once; exits non-zero with the reason when it cannot. It needs the toolchain,
  not a GPU: set ``TORCH_CUDA_ARCH_LIST`` (e.g. ``9.0``) where no device is visible. Processes
  building one group wait on ``torch.utils.cpp_extension``'s lock file in that group's folder.
- ``check [--arch 90] [--jobs 2]``: compile every source for one architecture without linking,
  even with a CPU-only PyTorch (CI runs it).
- ``where``: print the build folder.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Optional, Sequence

import torch

from rl_kernel_core import ops

# A checkout (or editable install) builds from the repository's native/csrc; a wheel carries a
# copy inside the package (setup.py puts it there).
_PACKAGE_DIR = Path(__file__).resolve().parent
SOURCE_DIR = next(
    (d for d in (_PACKAGE_DIR.parent / "native" / "csrc", _PACKAGE_DIR / "native_csrc") if d.is_dir()),
    _PACKAGE_DIR.parent / "native" / "csrc",
)
EXTENSION_PREFIX = "rl_kernel_native_"
LAUNCH_GROUP = "triton_launch"
"""The group with no op of its own: C++ launches of the batch-invariant mode's compiled Triton
kernels (:mod:`rl_kernel_core.batch_invariant_mode.triton_launch`)."""
SM90A_SOURCES: dict[str, tuple[str, ...]] = {"linear_logprob": ("linear_sm90.cu",)}
"""``{group: its sources with Hopper-only code}`` (wgmma, TMA, ``setmaxnreg``): compiled for
``sm_90a`` where the group is built for a compute capability 9.0 device (:func:`sm90a_flags`); for
any other target their kernels are empty and their host code refuses to launch them."""
GROUPS: dict[str, tuple[str, ...]] = {
    **{group: (f"{group}.cu", *SM90A_SOURCES.get(group, ()), f"bind_{group}.cpp") for group in ops.native_groups()},
    LAUNCH_GROUP: (f"bind_{LAUNCH_GROUP}.cpp",),
}
"""``{group: its sources in native/csrc}``: each group is one extension, holding the kernels of the
ops whose :attr:`rl_kernel_core.ops.OpSpec.native_group` it is (``loss``: ``ratio_kl`` and
``policy_loss``), and :data:`LAUNCH_GROUP`."""
_ERROR_TAIL_CHARS = 4000


def cache_dir() -> Path:
    """Where JIT builds of the extension are kept (``$RL_KERNEL_CACHE`` or ``~/.cache/rl-kernel/native``)."""
    return Path(os.environ.get("RL_KERNEL_CACHE", Path.home() / ".cache" / "rl-kernel" / "native"))


class UnsafeCacheError(RuntimeError):
    """The build cache is not private to this user (the message says why and what to do)."""


def check_cache_dir() -> None:
    """Refuse a build cache another user could write into.

    The extension is loaded from the cache as native code, so :func:`cache_dir` and
    :func:`build_dir` must, where they exist, be directories owned by this user and not writable
    by group or others. Raises :class:`UnsafeCacheError` naming the directory, the problem and
    the fix.
    """
    uid = os.getuid()
    for path in (cache_dir(), build_dir(), *(group_dir(g) for g in GROUPS)):
        try:
            info = path.lstat()
        except FileNotFoundError:
            continue
        where = f"the rl-kernel build cache {str(path)!r} (RL_KERNEL_CACHE)"
        if not path.is_dir() or path.is_symlink():
            raise UnsafeCacheError(f"{where} is not a directory; point RL_KERNEL_CACHE at a directory of your own")
        if info.st_uid != uid:
            raise UnsafeCacheError(
                f"{where} is owned by uid {info.st_uid}, not by you (uid {uid}): another user could replace the "
                "extension this process loads; point RL_KERNEL_CACHE at a directory you own"
            )
        if info.st_mode & 0o022:
            raise UnsafeCacheError(
                f"{where} is writable by {'group and others' if info.st_mode & 0o022 == 0o022 else 'group' if info.st_mode & 0o020 else 'others'} "
                f"(mode {oct(info.st_mode & 0o777)}): another user could replace the extension this process loads; "
                f"run chmod go-w {str(path)!r} or point RL_KERNEL_CACHE at a private directory"
            )


def build_dir() -> Path:
    """This environment's build folder in :func:`cache_dir`: one per PyTorch, CUDA and Python version."""
    tag = f"torch{torch.__version__}-cuda{torch.version.cuda}-py{sys.version_info.major}{sys.version_info.minor}"
    return cache_dir() / tag.replace("+", "_")


def group_dir(group: str) -> Path:
    """The build folder of one group's extension in :func:`build_dir`.

    One folder per group because ``torch.utils.cpp_extension`` locks a build folder, not an
    extension: a process that finds the lock held waits for it and then loads its own extension,
    so with one shared folder a process wanting group A waited out another's build of group B and
    then failed to load A, never built (the GPU tests' parallel workers did exactly that).
    """
    return build_dir() / group


def sources(group: Optional[str] = None) -> list[Path]:
    """The sources of ``group`` (None: every ``*.cu`` and ``*.cpp`` in ``native/csrc``)."""
    if not SOURCE_DIR.is_dir():
        return []
    if group is not None:
        return [SOURCE_DIR / name for name in GROUPS[group]]
    return sorted(SOURCE_DIR.glob("*.cu")) + sorted(SOURCE_DIR.glob("*.cpp"))


def _cpu_only_reason() -> Optional[str]:
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return f"PyTorch {torch.__version__} is a CPU-only build"
    return None


def toolchain_reason() -> Optional[str]:
    """Why the extension cannot be compiled here (PyTorch build, nvcc, ninja, sources), or None."""
    if _cpu_only_reason():
        return _cpu_only_reason()
    from torch.utils import cpp_extension

    if torch.version.cuda is not None and cpp_extension.CUDA_HOME is None:
        return "nvcc was not found (set CUDA_HOME to a CUDA toolkit, or put nvcc on PATH)"
    if not cpp_extension.is_ninja_available():
        return "ninja was not found (pip install ninja): torch.utils.cpp_extension needs it to build"
    if not any(p.suffix == ".cu" for p in sources()):
        return "no CUDA sources (*.cu) in native/csrc of this installation"
    return None


def unavailable_reason() -> Optional[str]:
    """Why the native extension cannot be built and used here, or None when a build can be attempted."""
    if _cpu_only_reason():
        return _cpu_only_reason()
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    return toolchain_reason()


def is_built(group: str) -> bool:
    """Whether ``group``'s extension has a build in the cache (it may still be rebuilt on load if its sources changed)."""
    return (group_dir(group) / f"{EXTENSION_PREFIX}{group}.so").is_file()


def status() -> str:
    """One line on the extensions here, without building or loading them: why they cannot be used,
    or which groups are built (a cached build whose sources changed is rebuilt on first use)."""
    reason = unavailable_reason()
    if reason is not None:
        return f"unavailable: {reason}"
    built = [g for g in GROUPS if is_built(g)]
    how = "a group compiles on the first call of one of its ops (minutes), or ahead of time with 'python -m rl_kernel_core.native build'"
    if not built:
        return f"not built yet: {how}"
    missing = [g for g in GROUPS if g not in built]
    return f"built in {build_dir()}: {', '.join(built)}" + (
        f"; not built yet: {', '.join(missing)} ({how})" if missing else ""
    )


def sm90a_flags(group: str) -> list[str]:
    """The extra nvcc flags that give ``group``'s :data:`SM90A_SOURCES` their ``sm_90a`` code.

    With ``TORCH_CUDA_ARCH_LIST`` unset and a compute capability 9.0 device visible, the group is
    built for ``sm_90a`` alone (an arch flag here makes torch add none of its own); with the list
    set, it decides (``9.0a`` in it builds the code). ``RLK_SM90A_BUILT`` tells the sources
    that their Hopper code is in the build. Empty for a group without such sources or no such target.
    """
    if group not in SM90A_SOURCES:
        return []
    listed = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if listed is not None:
        return ["-DRLK_SM90A_BUILT"] if "9.0a" in listed.replace(" ", ";").split(";") else []
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        return ["-gencode=arch=compute_90a,code=sm_90a", "-DRLK_SM90A_BUILT"]
    return []


def build(group: str, verbose: bool = False) -> ModuleType:
    """Compile (or load the cached build of) the extension of ``group`` (a key of :data:`GROUPS`) and return it.

    Raises:
        UnsafeCacheError: the cache is not private to this user (:func:`check_cache_dir`).
        RuntimeError: the build failed; the message ends with the tail of the compiler output.
    """
    from torch.utils import cpp_extension

    if group not in GROUPS:
        raise ValueError(f"group must be one of {list(GROUPS)}, got {group!r}")
    check_cache_dir()
    out = group_dir(group)
    cache_dir().mkdir(mode=0o700, parents=True, exist_ok=True)
    build_dir().mkdir(mode=0o700, exist_ok=True)
    out.mkdir(mode=0o700, exist_ok=True)
    # torch rebuilds a JIT extension when its sources or flags change, not its headers: the
    # headers' digest goes into the flags so that editing a .cuh/.h also triggers a rebuild.
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(SOURCE_DIR.glob("*.*h")))).hexdigest()[:16]
    headers_flag = f"-DRL_KERNEL_HEADERS_DIGEST={digest}"
    try:
        return cpp_extension.load(
            name=EXTENSION_PREFIX + group,
            sources=[str(p) for p in sources(group)],
            extra_cflags=["-O3", headers_flag],
            extra_cuda_cflags=["-O3", headers_flag, *sm90a_flags(group)],
            with_cuda=True,  # the CUDA headers also for a group of C++ sources only
            build_directory=str(out),
            verbose=verbose,
        )
    except Exception as exc:
        text = str(exc)
        tail = text if len(text) <= _ERROR_TAIL_CHARS else "..." + text[-_ERROR_TAIL_CHARS:]
        raise RuntimeError(
            f"building the native extension {group!r} in {out} failed ({type(exc).__name__}): {tail}"
        ) from exc


def _compile_command(source: Path, obj: Path, arch: str, include_dirs: Sequence[Path]) -> list[str]:
    import sysconfig

    from torch.utils import cpp_extension

    includes = [f"-I{d}" for d in (*include_dirs, *cpp_extension.include_paths(), sysconfig.get_paths()["include"])]
    defines = [
        f"-DTORCH_EXTENSION_NAME={EXTENSION_PREFIX}{source.stem.removeprefix('bind_')}",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
    ]
    nvcc = os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc") if cpp_extension.CUDA_HOME else "nvcc"
    if source.suffix == ".cu":
        return [
            nvcc,
            "-c",
            f"-arch=sm_{arch}",
            "-std=c++17",
            *cpp_extension.COMMON_NVCC_FLAGS,
            *defines,
            *includes,
            str(source),
            "-o",
            str(obj),
        ]
    # nvcc hands a .cpp to the host compiler with the CUDA headers (cuda.h) on its include path
    return [nvcc, "-c", "-Xcompiler", "-fPIC", "-std=c++17", *defines, *includes, str(source), "-o", str(obj)]


def check(arch: str = "90", jobs: int = 2) -> list[str]:
    """Compile every source to an object file for ``sm_<arch>`` without linking or loading it.

    Needs nvcc and a C++ compiler, no GPU and no CUDA build of PyTorch: with a CPU-only PyTorch
    the one header its build does not generate (``c10/cuda/impl/cuda_cmake_macros.h``) is
    supplied. Returns one error message per source that failed (compiler output tail); empty
    when all compiled.
    """
    import shutil
    import subprocess
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    from torch.utils import cpp_extension

    if shutil.which("nvcc") is None and cpp_extension.CUDA_HOME is None:
        return ["nvcc was not found (set CUDA_HOME to a CUDA toolkit, or put nvcc on PATH)"]
    if not sources():
        return [f"no sources in {SOURCE_DIR}"]
    with tempfile.TemporaryDirectory(prefix="rl-kernel-native-check-") as tmp:
        shim = Path(tmp) / "include"
        macros = "c10/cuda/impl/cuda_cmake_macros.h"
        if not any((Path(d) / macros).is_file() for d in cpp_extension.include_paths()):
            (shim / macros).parent.mkdir(parents=True)
            (shim / macros).write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")

        hopper = {name for names in SM90A_SOURCES.values() for name in names}

        def compile_one(src: Path) -> Optional[str]:
            # the Hopper sources' kernels are empty for plain sm_90: check their real code
            target = f"{arch}a" if arch == "90" and src.name in hopper else arch
            cmd = _compile_command(src, Path(tmp) / f"{src.name}.o", target, [shim])
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode == 0:
                return None
            out = (proc.stdout + proc.stderr)[-_ERROR_TAIL_CHARS:]
            return f"{src.name}: exit {proc.returncode}: {out}"

        with ThreadPoolExecutor(max(1, jobs)) as pool:
            return [e for e in pool.map(compile_one, sources()) if e]


def _build_in_processes(groups: Sequence[str], jobs: int, verbose: bool) -> int:
    """Build each group in a process of its own, ``jobs`` at a time; non-zero when any failed."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    def build_one(group: str) -> int:
        cmd = [sys.executable, "-m", "rl_kernel_core.native", "build", *(["--verbose"] if verbose else []), group]
        return subprocess.run(cmd).returncode

    with ThreadPoolExecutor(jobs) as pool:
        codes = list(pool.map(build_one, groups))
    return 1 if any(codes) else 0


def main(argv: Sequence[str]) -> int:
    from rl_kernel_core.argtypes import integer

    parser = argparse.ArgumentParser(
        prog="python -m rl_kernel_core.native", description="rl-kernel native CUDA extension"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("build", help="compile the extensions ahead of time into the cache")
    p.add_argument("--verbose", action="store_true", help="show the compiler commands and output")
    p.add_argument(
        "--jobs", type=integer(1), default=1, help="groups built at once, each in its own process (default 1)"
    )
    p.add_argument("groups", nargs="*", metavar="GROUP", help=f"groups to build (default: all of {', '.join(GROUPS)})")
    sub.add_parser("where", help="print the build folder")
    p = sub.add_parser(
        "check", help="compile every source for one GPU architecture without a GPU (no link, nothing loaded)"
    )
    p.add_argument("--arch", default="90", help="compute capability without the dot (default 90: H100/H200)")
    p.add_argument("--jobs", type=integer(1), default=2, help="sources compiled at once")
    args = parser.parse_args(argv)
    unknown = [g for g in getattr(args, "groups", []) if g not in GROUPS]
    if unknown:
        parser.error(f"GROUP must be among {list(GROUPS)}, got {unknown}")
    if args.command == "check":
        errors = check(args.arch, args.jobs)
        for e in errors:
            print(f"rl-kernel native check: {e}", file=sys.stderr)
        if not errors:
            print(f"rl-kernel native check: {len(sources())} sources compiled for sm_{args.arch}")
        return 1 if errors else 0
    if args.command == "where":
        print(build_dir())
        return 0
    try:
        check_cache_dir()
    except UnsafeCacheError as exc:
        print(f"rl-kernel native: cannot build: {exc}", file=sys.stderr)
        return 1
    reason = toolchain_reason()
    if reason:
        print(f"rl-kernel native: cannot build: {reason}", file=sys.stderr)
        return 1
    groups = list(args.groups or GROUPS)
    if args.jobs > 1 and len(groups) > 1:
        return _build_in_processes(groups, args.jobs, args.verbose)
    for group in groups:
        try:
            module = build(group, verbose=args.verbose)
        except RuntimeError as exc:
            print(f"rl-kernel native: {exc}", file=sys.stderr)
            return 1
        print(f"rl-kernel native: built {module.__file__}")
    return 0
