"""The markdown table of ``bench_linear_logprob.py --part logprob`` results against the peers.

Reads one or more of its JSON files (e.g. one per ``--grid`` run and input regime) and prints one
row per (shape, input regime), N then D then V ascending: the GEMM floor of the run, every
method's forward+backward median (ms; ours with its TF/s), and the forward medians of ours,
Liger's CuTe path and QuACK. Bold marks the fastest method with per-token outputs and a per-token
upstream gradient (ours, eager, CCE, Liger's Triton and CuTe paths); ``-`` a method that did not
run at that shape (refused, or not asked for). The results folder's README quotes its output:

    python benchmarks/table_linear_peers.py benchmarks/results/linear_h200/peers_grid_b3b49c0/*.json
"""

from __future__ import annotations

import argparse
import json
import sys

COLUMNS = ["ours", "eager", "cce", "liger_flce", "liger_cute", "liger_cute_flce", "quack"]
PER_TOKEN = ["ours", "eager", "cce", "liger_flce", "liger_cute"]
HEADER = (
    "| N, D, V | inputs | GEMM | ours fwd+bwd (TF/s) | eager | CCE | Liger Triton | Liger CuTe | Liger CuTe FLCE* "
    "| QuACK* | ours fwd | Liger CuTe fwd | QuACK fwd* |"
)


def _dims(shape: str) -> tuple[int, int, int]:
    d, v, n = (int(part[1:]) for part in shape.split("_"))
    return n, d, v


def table(paths: list[str]) -> list[str]:
    """The table's lines (header first) from the result files at ``paths``."""
    floor: dict[str, float] = {}
    cells: dict[tuple[str, str], dict[tuple[str, str], float]] = {}
    tflops: dict[tuple[str, str], float] = {}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for r in json.load(f)["results"]:
                if r["part"] == "floor":
                    floor[r["shape"]] = r["median_ms"]
                elif r["part"] in ("forward", "fwd+bwd") and "median_ms" in r:
                    key = (r["shape"], r["inputs"])
                    cells.setdefault(key, {})[(r["method"], r["part"])] = r["median_ms"]
                    if r["method"] == "ours" and r["part"] == "fwd+bwd":
                        tflops[key] = r["tflops"]
    lines = [HEADER, "| " + " | ".join(["---"] * (HEADER.count("|") - 1)) + " |"]
    for (shape, inputs), v in sorted(cells.items(), key=lambda kv: (*_dims(kv[0][0]), kv[0][1])):
        n, d, vocab = _dims(shape)

        def ms(method: str, part: str) -> str:
            return "-" if (method, part) not in v else f"{v[(method, part)]:.1f}"

        timed = [(v[(m, "fwd+bwd")], m) for m in PER_TOKEN if (m, "fwd+bwd") in v]
        best = min(timed)[1] if timed else None
        row = [f"**{ms(m, 'fwd+bwd')}**" if m == best else ms(m, "fwd+bwd") for m in COLUMNS]
        row[0] += f" ({tflops[(shape, inputs)]:.0f})"
        lines.append(
            f"| {n}, {d}, {vocab} | {inputs} | {floor[shape]:.1f} | "
            + " | ".join(row)
            + f" | {ms('ours', 'forward')} | {ms('liger_cute', 'forward')} | {ms('quack', 'forward')} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results", nargs="+", help="bench_linear_logprob.json files")
    print("\n".join(table(p.parse_args(argv).results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
