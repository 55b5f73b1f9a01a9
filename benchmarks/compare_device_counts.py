"""Each impl's run on 4 GPUs against its run on 1 GPU at the same global batch: the loss step by
step (the runs see the same rows, so the curves should agree to the reduction order), tokens/s,
after-forward and peak MiB.

    python3 benchmarks/compare_device_counts.py DIR --json OUT.json

DIR holds pretrain --summary-json files named lightning_4gpu_IMPL.json and lightning_1gpu_IMPL.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from swiglu_train.files import write_json_atomic

KEYS = ("tokens_per_s", "after_forward_MiB", "peak_MiB")


def compare(root: Path) -> dict[str, dict]:
    out = {}
    for four in sorted(root.glob("lightning_4gpu_*.json")):
        one = four.with_name(four.name.replace("4gpu", "1gpu"))
        if not one.exists():
            continue
        a, b = json.loads(four.read_text()), json.loads(one.read_text())
        steps = sorted(set(a["losses"]) & set(b["losses"]), key=int)
        if not steps:
            continue
        diffs = [abs(a["losses"][s] - b["losses"][s]) for s in steps]
        row = {
            "steps": len(steps),
            "step0_abs_loss_diff": diffs[0],
            "max_abs_loss_diff": max(diffs),
        }
        row["median_abs_loss_diff"] = statistics.median(diffs)
        for n, run in ((4, a), (1, b)):
            row |= {f"{k}_{n}gpu": run[k] for k in KEYS}
        out[a["mlp_impl"]] = row
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    rows = compare(args.dir)
    for impl, row in rows.items():
        print(impl, row)
    write_json_atomic(args.json, rows)


if __name__ == "__main__":
    main()
