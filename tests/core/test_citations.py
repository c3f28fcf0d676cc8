"""Every file path, module, function and environment variable that the docs cite resolves in this tree.

Read: README.md, CONTRIBUTING.md, docs/*.md (the whole text) and the comments of native/csrc.

- **Paths** (``native/csrc/loss.cu``, ``rl_kernel_core/<family>.py``, ``bind_<family>.cpp``,
  ``opdef/<family>.py``; ``<...>`` and ``*`` match any name part): one whose first part is a
  top-level entry of the repository names a tracked file or folder from the root; a Markdown link
  target, from the citing file's folder; a partial path whose first part is a folder of a package
  or of ``native/`` (``reference/``, ``opdef/``, ``csrc/``), the end of a tracked path; a bare
  file name (``bindings.cpp``, ``bench_losses_h100.json``: a whole code span, or a source file
  anywhere in a CUDA comment), a tracked file of that name. Anything else (another project's path
  such as ``verl/trainer/...``, a metric such as ``actor/pg_loss``, a user's ``result.json``) is
  not a path of this tree.
- **Dotted names** ``rl_kernel_<package>.module.name``: a module or package of this tree, then a
  name it defines at top level (function, class, assignment, import; for ``rl_kernel_core``, a
  lazy export read from the manifest of ops), then a member of that class.
- **Code names**: a Markdown code span that is a name (``_stats_kernel``, ``dispatch.explain``,
  ``linear_chunks.tuned(...)``): each snake_case identifier in it occurs in the code (``.py``,
  CUDA/C++, shell, TOML files), so a renamed or removed function is not cited. Names of other
  projects that the docs cite are listed in ``OTHER_PROJECTS_NAMES``.
- **Homes**: a file cited with the names it holds (``rl_kernel_core/loss.py`` (``ratio_kl``,
  ``policy_loss``), or ``chunk_bytes`` in ``rl_kernel_core/linear/chunks.py``) defines each of them
  (a Python file: a function, class, assignment or import anywhere in it; another source: the word).
- **Import claims**: ``file.py`` imports / does not import / never imports / imports nothing of
  ``module`` agrees with the file's import statements (a function's lazy import counts).
- **Environment variables** ``RL_KERNEL_*`` / ``VIME_RL_KERNEL*``: read somewhere, i.e. they occur in
  a string literal of the code that is not a docstring, or in a shell line that is not a comment;
  in a test module only a key read from ``os.environ`` counts (one that a test merely sets is not
  read). A cited ``RL_KERNEL_VLLM*`` needs one variable of that family.
"""

from __future__ import annotations

import ast
import fnmatch
import re
import subprocess
from collections.abc import Sequence
from functools import cache
from pathlib import Path, PurePosixPath

import pytest

from rl_kernel_core import ops

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("rl_kernel_core", "rl_kernel_vllm", "rl_kernel_verl", "rl_kernel_vime")
CODE_SUFFIXES = (".py", ".cu", ".cuh", ".cpp", ".h", ".sh", ".toml", ".txt")
SOURCE_SUFFIXES = ("py", "cu", "cuh", "cpp", "h", "sh")
FILE_SUFFIXES = (*SOURCE_SUFFIXES, "md", "txt", "toml", "json", "png")
OTHER_PROJECTS_NAMES = {"self_attn": "a Hugging Face decoder layer's attention module"}

_PLACEHOLDER = r"<[^<>`\n]*>"
_PART = rf"(?:[\w.*-]|{_PLACEHOLDER})+"
_PATH = re.compile(rf"(?<![\w./<>-])(?:\.\./)*{_PART}(?:/{_PART})+/?")
_FILE = re.compile(rf"(?:[\w*-]|{_PLACEHOLDER})+\.(?:{'|'.join(FILE_SUFFIXES)})")
_SOURCE_IN_COMMENT = re.compile(rf"(?<![\w./<>-])(?:[\w*-]|{_PLACEHOLDER})+\.(?:{'|'.join(SOURCE_SUFFIXES)})(?![\w/])")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_DOTTED = re.compile(rf"\b(?:{'|'.join(PACKAGES)})(?:\.\w+)+")
_CODE_SPAN = re.compile(r"`([^`\n]+)`")
_NAME_SPAN = re.compile(r"[\w.]+(?=\(.*\)$|$)")
_CODE_NAME = re.compile(r"_?[a-z][a-z0-9]*(?:_[a-z0-9]+)+")
_ENV = re.compile(r"(?<![\w$])(?:VIME_)?RL_KERNEL\w*\*?")


@cache
def tracked() -> tuple[str, ...]:
    """The tracked files (and the untracked ones git does not ignore), relative to the root."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return tuple(sorted(p for p in out.splitlines() if (ROOT / p).exists()))


@cache
def tracked_entries() -> frozenset[str]:
    """Every tracked file and every folder above one."""
    entries: set[str] = set()
    for path in tracked():
        parts = PurePosixPath(path).parts
        entries.update("/".join(parts[: i + 1]) for i in range(len(parts)))
    return frozenset(entries)


def _glob(pattern: str) -> str:
    return re.sub(_PLACEHOLDER, "*", pattern.rstrip("/"))


def _comments(text: str) -> str:
    """The ``//`` and ``/* */`` comments of a C++/CUDA source."""
    return "\n".join(m.group(0) for m in re.finditer(r"//[^\n]*|/\*.*?\*/", text, re.S))


def cited_texts() -> list[tuple[str, str]]:
    """``(file, text)`` of every file whose citations are checked."""
    docs = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
    texts = [(str(p.relative_to(ROOT)), p.read_text()) for p in docs]
    for p in sorted((ROOT / "native" / "csrc").iterdir()):
        texts.append((str(p.relative_to(ROOT)), _comments(p.read_text())))
    return texts


def unresolved_path(cited: str, citing: str, link: bool) -> bool:
    """Whether ``cited`` (in file ``citing``; ``link``: a Markdown link target) is a path of this
    tree that names nothing tracked."""
    pattern = _glob(cited)
    entries = tracked_entries()
    if link:
        target = (ROOT / citing).parent / pattern
        try:
            pattern = str(target.resolve().relative_to(ROOT))
        except ValueError:  # outside the repository
            return False
        return not fnmatch.filter(entries, pattern)
    first = pattern.split("/")[0]
    if "/" not in pattern:
        return not any(fnmatch.fnmatch(PurePosixPath(p).name, pattern) for p in tracked())
    if first in {PurePosixPath(e).parts[0] for e in entries}:
        return not fnmatch.filter(entries, pattern)
    if first not in package_folders():
        return False
    return not any(fnmatch.fnmatch(e, f"*/{pattern}") for e in entries)


@cache
def package_folders() -> frozenset[str]:
    """The names of the folders inside the packages and ``native/``."""
    return frozenset(
        PurePosixPath(e).name
        for e in tracked_entries()
        if e.startswith((*PACKAGES, "native")) and "/" in e and (ROOT / e).is_dir()
    )


def test_cited_paths_exist():
    missing = []
    for citing, text in cited_texts():
        links = {m.group(1).split("#")[0] for m in _LINK.finditer(text)} - {""}
        for target in sorted(t for t in links if "://" not in t and not t.startswith("mailto:")):
            if unresolved_path(target, citing, link=True):
                missing.append(f"{citing}: link {target}")
        bare = (
            [m.group(0) for m in _SOURCE_IN_COMMENT.finditer(text)]
            if not citing.endswith(".md")
            else [m.group(1) for m in _CODE_SPAN.finditer(text) if _FILE.fullmatch(m.group(1))]
        )
        paths = [m.group(0) for m in _PATH.finditer(text) if "://" not in text[max(0, m.start() - 12) : m.start()]]
        for cited in [*paths, *bare]:
            if cited not in links and unresolved_path(cited, citing, link=False):
                missing.append(f"{citing}: {cited}")
    assert not missing, "cited paths that name nothing in this tree:\n" + "\n".join(sorted(set(missing)))


# ---------------------------------------------------------------- dotted names


def _module_file(dotted: str) -> Path | None:
    base = ROOT.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _defined(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """Names bound at the top of ``body``: functions, classes, assignments, imports."""
    names: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update({(a.asname or a.name).split(".")[0]: node for a in node.names})
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update({n.id: node for n in ast.walk(target) if isinstance(n, ast.Name)})
        elif isinstance(node, (ast.If, ast.Try)):
            names.update(_defined(node.body))
    return names


def resolves(dotted: str) -> bool:
    """Whether ``dotted`` names a module of this tree, a name it defines or a member of that name."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        module = _module_file(".".join(parts[:split]))
        if module is not None:
            break
    else:
        return False
    rest = parts[split:]
    if module == ROOT / "rl_kernel_core" / "__init__.py" and len(rest) == 1 and rest[0] in ops.exports():
        return True
    body = ast.parse(module.read_text()).body
    for name in rest:
        node = _defined(body).get(name)
        if node is None:
            return False
        if not isinstance(node, ast.ClassDef):
            return name == rest[-1]
        body = node.body
    return True


def test_cited_modules_and_functions_exist():
    files = {PurePosixPath(p).name for p in tracked()}
    missing = [
        f"{citing}: {m.group(0)}"
        for citing, text in cited_texts()
        for m in _DOTTED.finditer(text)
        if m.group(0) not in files and not resolves(m.group(0))
    ]
    assert not missing, "cited names that this tree does not define:\n" + "\n".join(sorted(set(missing)))


# ---------------------------------------------------------------- names in code spans


@cache
def code_words() -> frozenset[str]:
    words: set[str] = set()
    for path in tracked():
        if path.endswith(CODE_SUFFIXES) and not path.startswith("docs/"):
            words.update(re.findall(r"\w+", (ROOT / path).read_text(errors="replace")))
    return frozenset(words)


def test_code_names_in_the_docs_occur_in_the_code():
    missing = []
    for citing, text in cited_texts():
        if not citing.endswith(".md"):
            continue
        for span in _CODE_SPAN.finditer(text):
            name_part = _NAME_SPAN.match(span.group(1))
            if name_part is None or _FILE.fullmatch(span.group(1)):
                continue
            for name in _CODE_NAME.findall(name_part.group(0)):
                if name not in code_words() and name not in OTHER_PROJECTS_NAMES:
                    missing.append(f"{citing}: {name} (in `{span.group(1)}`)")
    assert not missing, "names in code spans that occur nowhere in the code:\n" + "\n".join(sorted(set(missing)))


# ---------------------------------------------------------------- homes and import claims

_NAME_IN_SPAN = r"`([A-Za-z_]\w*)(?:\(\))?`"
_HOME_LIST = re.compile(rf"`([^`\s]+\.(?:py|cu|cuh|h|cpp))` \(((?:{_NAME_IN_SPAN}(?:, | and | or )?)+)\)")
_NAME_IN_HOME = re.compile(rf"{_NAME_IN_SPAN} in `([^`\s]+\.(?:py|cu|cuh|h|cpp))`")
_IMPORT_CLAIM = re.compile(r"`([^`\s]+\.py)` (does not import|never imports|imports nothing of|imports) `([^`\s]+)`")


def cited_file(cited: str) -> Path | None:
    """The tracked file ``cited`` names: the path from the root, else the one tracked path that ends
    with it; None for a pattern, another project's path or an ambiguous name."""
    if "<" in cited or "*" in cited:
        return None
    matches = [p for p in tracked() if p == cited or p.endswith("/" + cited)]
    return ROOT / matches[0] if len(matches) == 1 else None


def defines(path: Path, name: str) -> bool:
    """Whether the source ``path`` defines ``name`` (Python) or holds it as a word (other sources)."""
    text = path.read_text()
    if path.suffix != ".py":
        return re.search(rf"\b{re.escape(name)}\b", text) is not None
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
            (a.asname or a.name).split(".")[0] == name for a in node.names
        ):
            return True
        if isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Store):
            if (node.id if isinstance(node, ast.Name) else node.attr) == name:
                return True
    return False


def home_claims(text: str) -> list[tuple[str, str]]:
    """``(file, name)`` for every name ``text`` places in a file."""
    claims = [(m.group(1), n) for m in _HOME_LIST.finditer(text) for n in re.findall(_NAME_IN_SPAN, m.group(2))]
    return claims + [(m.group(2), m.group(1)) for m in _NAME_IN_HOME.finditer(text)]


def test_cited_homes_define_their_names():
    wrong = []
    for citing, text in cited_texts():
        for cited, name in home_claims(text):
            path = cited_file(cited)
            if path is not None and path.suffix in (".py", ".cu", ".cuh", ".h", ".cpp") and not defines(path, name):
                wrong.append(f"{citing}: `{name}` is not in {cited}")
    assert not wrong, "names placed in a file that does not hold them:\n" + "\n".join(sorted(set(wrong)))


def imported_modules(path: Path) -> set[str]:
    """The modules ``path`` imports anywhere (relative imports resolved against its package)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


def import_claim_holds(cited: str, verb: str, target: str) -> bool | None:
    """Whether ``cited`` (a Python file) ``verb`` (imports / does not import / ...) ``target`` (a
    dotted module or a path); None where ``cited`` names no single tracked file."""
    path = cited_file(cited)
    if path is None:
        return None
    name = target.removesuffix("/").removesuffix(".py").replace("/", ".")
    imports = any(m == name or m.startswith(name + ".") or f".{name}." in f".{m}." for m in imported_modules(path))
    return imports if verb == "imports" else not imports


def test_import_claims_hold():
    wrong = [
        f"{citing}: {m.group(0)}"
        for citing, text in cited_texts()
        for m in _IMPORT_CLAIM.finditer(text)
        if import_claim_holds(*m.groups()) is False
    ]
    assert not wrong, "claims about imports that the code contradicts:\n" + "\n".join(sorted(set(wrong)))


def test_home_and_import_rules():
    assert home_claims(
        "`rl_kernel_core/loss.py` (`ratio_kl`, `policy_loss`) and `chunk_rows` in `linear_chunks.py`"
    ) == [
        ("rl_kernel_core/loss.py", "ratio_kl"),
        ("rl_kernel_core/loss.py", "policy_loss"),
        ("linear_chunks.py", "chunk_rows"),
    ]
    linear_sm90 = cited_file("rl_kernel_core/linear/triton_sm90.py")
    assert linear_sm90 is not None and defines(linear_sm90, "serves") and not defines(linear_sm90, "_TILE")
    assert defines(ROOT / "native/csrc/tuning.h", "kSm90BlockN")
    assert import_claim_holds("linear/triton_sm90.py", "imports", "rl_kernel_core.native") is True
    assert import_claim_holds("rl_kernel_core/linear/chunks.py", "never imports", "rl_kernel_core/triton/") is True
    assert import_claim_holds("rl_kernel_core/linear/chunks.py", "imports", "triton") is False
    assert (
        import_claim_holds("rl_kernel_core/linear/opdef.py", "imports nothing of", "rl_kernel_core.linear.chunks")
        is False
    )
    assert import_claim_holds("<family>.py", "imports", "torch") is None


# ---------------------------------------------------------------- environment variables


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def _environ_keys(tree: ast.AST) -> list[ast.expr]:
    """The keys read from the environment: ``*.environ.get(KEY)``, ``os.getenv(KEY)``, ``*.environ[KEY]``, ``KEY in *.environ``."""
    keys: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            owner = ast.unparse(node.func.value)
            if (node.func.attr == "get" and owner.endswith("environ")) or (
                node.func.attr == "getenv" and owner == "os"
            ):
                keys.append(node.args[0])
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("environ"):
            keys.append(node.slice)
        elif isinstance(node, ast.Compare) and any(ast.unparse(c).endswith("environ") for c in node.comparators):
            keys.append(node.left)
    return keys


@cache
def read_variables() -> frozenset[str]:
    """The variable names in the code's string literals (docstrings aside; in test modules, the keys
    read from the environment) and in its shell lines (comments aside)."""
    found: set[str] = set()
    for path in tracked():
        text = (ROOT / path).read_text(errors="replace")
        if path.endswith(".py"):
            tree = ast.parse(text)
            literals: Sequence[ast.AST]
            if PurePosixPath(path).name.startswith("test_"):
                literals = _environ_keys(tree)
            else:
                skip = _docstrings(tree)
                literals = [n for n in ast.walk(tree) if id(n) not in skip]
            for node in literals:
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    found.update(_ENV.findall(node.value))
        elif path.endswith(".sh"):
            for line in text.splitlines():
                found.update(_ENV.findall(line.split("#")[0]))
    return frozenset(v.rstrip("*") for v in found)


def test_cited_environment_variables_are_read():
    missing = []
    for citing, text in cited_texts():
        for var in _ENV.findall(text):
            if var.endswith("*"):
                ok = any(v.startswith(var[:-1]) for v in read_variables())
            else:
                ok = var in read_variables()
            if not ok:
                missing.append(f"{citing}: {var}")
    assert not missing, "cited environment variables that no code reads:\n" + "\n".join(sorted(set(missing)))


@pytest.mark.parametrize(
    "cited,citing,link,expected",
    [
        ("rl_kernel_core/linear/chunks.py", "README.md", False, False),
        ("rl_kernel_core/<family>.py", "README.md", False, False),
        ("bind_<family>.cpp", "CONTRIBUTING.md", False, False),
        ("opdef/<family>.py", "CONTRIBUTING.md", False, False),
        ("../README.md", "docs/native.md", True, False),
        ("rl_kernel_core/triton/policy_loss.py", "README.md", False, True),
        ("triton/policy_loss.py", "README.md", False, True),
        ("bindings.cpp", "native/csrc/ops.h", False, True),
        ("backends.md", "docs/vllm.md", True, False),
        ("slime/utils/ppo_utils.py", "docs/vime.md", False, False),
        ("verl/trainer/ppo/core_algos.py", "docs/semantics.md", False, False),
    ],
)
def test_path_rules(cited, citing, link, expected):
    assert unresolved_path(cited, citing, link) is expected


def test_name_rules():
    assert resolves("rl_kernel_core.linear.chunks.tuned") and resolves("rl_kernel_core.dispatch.Decision.backend")
    assert resolves("rl_kernel_core.group_advantages") and resolves("rl_kernel_core.native")
    assert not resolves("rl_kernel_core.native_ops") and not resolves("rl_kernel_core.dispatch.no_such_function")
