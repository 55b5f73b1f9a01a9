"""quack (static and dynamic schedule) against cuBLAS on every GEMM choice of the quack impls
(``ops.gemm_choice``), at the model grid's shapes: the evidence for each GEMM's default
library (issue 18).

A default holds for every shape no one pretuned, so it should be the library that wins at
most shapes users train, not at one. This times each GEMM the way ``swiglu-train pretune``
does (paired, random order, batches between events) at every (M, D, F) of the grid, in a
throwaway cache, and summarises per GEMM: how often cuBLAS, and quack's dynamic schedule, is
more than 1 % faster or slower than quack's static one, and the median ratio. Set
``gemm_choice.DEFAULTS`` from the summary.

    python benchmarks/gemm_defaults.py --json $OUT/probe_gemm_defaults_h200.json
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from collections.abc import Sequence

import numpy as np
import torch

from swiglu_train.bench.grid.models import grid_shapes
from swiglu_train.bench.results import environment, git_commit
from swiglu_train.files import write_json_atomic

GRID_M = (4096, 8000, 16384)


def summarise(rows: Sequence[dict], margin: float) -> dict[str, dict]:
    """Per GEMM, for cuBLAS and for quack's dynamic schedule against quack's static one: shapes
    measured, wins and losses past ``margin``, the median and range of the paired ratio, and
    the library that wins more often (static quack on a tie)."""
    out = {}
    for gemm in sorted({r["gemm"] for r in rows}):
        mine = [r for r in rows if r["gemm"] == gemm]
        out[gemm] = {"shapes": len(mine)}
        for other in ("cublas", "quack_dynamic"):
            ratios = np.array([r[f"{other}_over_quack"] for r in mine
                               if r[f"{other}_over_quack"] is not None])  # fmt: skip
            if not len(ratios):  # that library failed at every shape
                out[gemm][other] = {"wins": 0, "losses": 0, "failed": len(mine)}
                continue
            wins, losses = int((ratios < 1 - margin).sum()), int((ratios > 1 + margin).sum())
            out[gemm][other] = {
                "wins": wins, "losses": losses, "median_over_quack": float(np.median(ratios)),
                "min": float(ratios.min()), "max": float(ratios.max()),
            }  # fmt: skip
        wins = {lib: s["wins"] - s["losses"] for lib, s in out[gemm].items() if lib != "shapes"}
        best = max(wins, key=wins.get)
        out[gemm]["majority"] = best if wins[best] > 0 else "quack"
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--m", type=int, nargs="*", default=list(GRID_M))
    parser.add_argument("--samples", type=int, default=30)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: this probe needs a CUDA GPU")
    os.environ["SWIGLU_TRAIN_CACHE_DIR"] = tempfile.mkdtemp()  # never the user's cache
    from swiglu_train.bench.pretune.measure import MARGIN, pretune
    from swiglu_train.ops import gemm_choice

    gemm_choice.forget()
    shapes = [(m, s.d, s.f, s.d) for s in grid_shapes() for m in args.m]
    rows = []
    for shape in shapes:  # one shape at a time, so a call cut short keeps what it measured
        for r in pretune([shape], list(gemm_choice.IMPL_GEMMS), torch.bfloat16, args.samples):
            rows.append({"M": shape[0], "D": shape[1], "F": shape[2], **dataclasses.asdict(r)})
            print(f"{shape} {r.gemm}: cuBLAS / quack {r.cublas_over_quack:.3f}, dynamic / static "
                  f"{r.quack_dynamic_over_quack}", r.failed or "", flush=True)  # fmt: skip
        result = {
            "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
            "commit": git_commit(), "environment": environment(torch.device("cuda"), None),
            "dtype": "bf16", "samples": args.samples, "margin": MARGIN,
            "defaults_now": dict(gemm_choice.DEFAULTS),
            "summary": summarise(rows, MARGIN), "rows": rows,
        }  # fmt: skip
        write_json_atomic(args.json, result)
    for gemm, s in result["summary"].items():
        print(gemm, s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
