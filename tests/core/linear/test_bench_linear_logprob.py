"""``benchmarks/bench_linear_logprob.py`` runs on CPU at a tiny shape (Triton in its interpreter):
both input regimes in one run, a ``d<D>_v<V>_n<N>`` shape name, TF/s and the floor ratio on
every timed row, and a peer that cannot be imported recorded as one error row per shape with its
import error (a smoke test of the script; no timing is asserted)."""

import importlib
import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_linear_logprob.py"
PEERS = ["liger_flce", "cce", "liger_cute", "liger_cute_flce", "quack"]


def _load():
    spec = importlib.util.spec_from_file_location("bench_linear_logprob", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _import_error(module_name: str) -> str | None:
    try:
        importlib.import_module(module_name)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def test_bench_linear_logprob_tiny_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    module = _load()
    argv = [
        "--device",
        "cpu",
        "--shapes",
        "d32_v500_n96",
        "--inputs",
        "flat,peaked",
        "--part",
        "logprob,accuracy",
        "--methods",
        ",".join(["ours", "eager", *PEERS]),
        "--warmup",
        "0",
        "--reps",
        "1",
        "--acc-rows",
        "32",
        "--out",
        str(tmp_path),
    ]
    assert module.main(argv) == 0
    doc = json.loads((tmp_path / "bench_linear_logprob.json").read_text())
    assert doc["environment"]["device"] == "cpu" and doc["settings"]["inputs"] == ["flat", "peaked"]
    assert "fwd+bwd" in " ".join(doc["settings"]["flops"]) and set(doc["peer_versions"]) == set(module.PEER_PACKAGES)
    rows = doc["results"]
    n, d, v = 96, 32, 500
    for row in rows:
        if "median_ms" in row:
            gemms = 4 if row["part"] == "fwd+bwd" else 1
            assert row["tflops"] == round(2 * gemms * n * d * v / row["median_ms"] / 1e9, 1), row
            assert row["part"] == "floor" or row["x_floor"] > 0, row
    for regime in ("flat", "peaked"):
        for method in ("ours", "eager"):
            timed = {
                r["part"] for r in rows if r.get("method") == method and r.get("inputs") == regime and "median_ms" in r
            }
            assert timed == {"forward", "fwd+bwd"}, (method, regime)
            acc = [r for r in rows if r["part"] == "accuracy" and r["method"] == method and r["inputs"] == regime]
            assert len(acc) == 1 and acc[0]["logprob"]["max_abs"] < 0.1, acc
    for peer in PEERS:
        expected = _import_error(module.PEER_MODULES[peer])
        mine = [r for r in rows if r.get("method") == peer]
        if expected is None:
            assert mine, peer  # installed: timed, or an error row from the call itself
            continue
        assert mine == [
            {
                "part": "logprob",
                "shape": "d32_v500_n96",
                "N": n,
                "D": d,
                "V": v,
                "inputs": ["flat", "peaked"],
                "method": peer,
                "unavailable": True,
                "error": expected,
            }
        ]


def test_grid_and_bad_options(capsys):
    module = _load()
    grid = module.grid_shapes()
    assert len(grid) == 16 and "d1024_v151936_n4096" in grid
    assert {module.shape_of(name) for name in grid} == {
        (n, d, v) for d in (896, 1024, 2048, 4096) for v in (128256, 151936) for n in (4096, 16384)
    }
    assert module.shape_of("tiny") == module.SHAPES["tiny"]
    for argv, says in (
        (["--inputs", "flat,sharp"], "--inputs"),
        (["--methods", "ours,nope"], "--methods"),
        (["--shapes", "d1_v2"], "--shapes"),
        (["--grid", "x"], "--grid"),
        (["--grid", "--shapes", "tiny"], "--grid"),
    ):
        with pytest.raises(SystemExit):
            module.main(["--device", "cpu", *argv])
        assert says in capsys.readouterr().err.splitlines()[-1]


@pytest.mark.parametrize(
    "folder, rows",
    [
        ("peers_grid_b3b49c0", 24),  # 16 shapes flat, 8 of them peaked too
    ],
)
def test_the_peer_tables_are_the_committed_results(folder, rows):
    """The peer table in the README of a folder of committed H200 results is
    ``benchmarks/table_linear_peers.py`` over that folder's JSON, line for line: no number in it is
    typed by hand."""
    root = SCRIPT.parents[1]
    spec = importlib.util.spec_from_file_location("table_linear_peers", root / "benchmarks" / "table_linear_peers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = sorted(str(p) for p in (root / "benchmarks" / "results" / "linear_h200" / folder).glob("*.json"))
    lines = module.table(results)
    assert len(lines) == 2 + rows
    docs = (
        (root / "benchmarks" / "results" / "linear_h200" / folder / "README.md")
        .read_text(encoding="utf-8")
        .splitlines()
    )
    starts = [i for i, line in enumerate(docs) if line == lines[2]]  # the table's first data row
    assert len(starts) == 1 and docs[starts[0] - 2 : starts[0] - 2 + len(lines)] == lines
