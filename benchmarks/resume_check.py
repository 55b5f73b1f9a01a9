"""A resumed run's losses against the full run's, step by step: a checkpoint resumes the run only
if the steps after it repeat the full run's losses (to the nondeterminism of the kernels).

    python3 benchmarks/resume_check.py FULL.log RESUMED.log LABEL --out resume_checks.jsonl

Each log is a recipe's stdout, whose steps print as ``step N loss X``. The check is printed and
appended to --out as one JSON line (full, resumed, rel_diff per step).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


def losses(log: Path) -> dict[int, float]:
    text = log.read_text() if log.exists() else ""
    return {int(s): float(v) for s, v in re.findall(r"^step (\d+) loss ([\d.]+)", text, re.M)}


def check(full_log: Path, resumed_log: Path, label: str) -> dict:
    full, resumed = losses(full_log), losses(resumed_log)
    rel = {s: abs(resumed[s] - full[s]) / full[s] for s in sorted(resumed) if s in full}
    return {"label": label, "full": full, "resumed": resumed, "rel_diff": rel}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("full", type=Path)
    parser.add_argument("resumed", type=Path)
    parser.add_argument("label")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    result = check(args.full, args.resumed, args.label)
    rel = {s: f"{d:.2e}" for s, d in result["rel_diff"].items()}
    print(args.label, "resumed steps", sorted(result["resumed"]), "rel diff per step", rel)
    with open(args.out, "a") as f:
        f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
