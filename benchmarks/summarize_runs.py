"""Collect the recipes' --summary-json files into one committed results file and a table.

    python3 benchmarks/summarize_runs.py --title "125M Lightning, H200" --command "..." \
        --commit SHA --json benchmarks/results/X.json --md benchmarks/results/X.md RUN.json...

Runs of the same impl are rounds of one paired design (impls alternated within a round), so
each impl's tokens/s is also reported as the median of its per-round ratio to ``normal``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

import torch

from swiglu_train.files import atomic_write, write_json_atomic
from swiglu_train.layers.registry import impl_label

ROUND = re.compile(r"_(\d+)\.json$")


def load(paths: list[str]) -> list[dict]:
    runs = []
    for path in paths:
        run = json.loads(Path(path).read_text())
        match = ROUND.search(path)
        run["round"] = int(match.group(1)) if match else 1
        # a row of its own for FP8-saved or FP8-GEMM runs, named as the planner and bench name them
        run["mlp_impl"] = impl_label(run["mlp_impl"], run.get("saved_fp8"), run.get("float8"))
        runs.append(run)
    return runs


def table(runs: list[dict], baseline: str = "normal") -> list[dict]:
    """One row per impl: medians over rounds, and the paired ratio of tokens/s to the
    baseline impl's run of the same round."""
    normal = {r["round"]: r["tokens_per_s"] for r in runs if r["mlp_impl"] == baseline}
    normal = {k: v for k, v in normal.items() if v}
    rows = []
    for impl in dict.fromkeys(r["mlp_impl"] for r in runs):
        mine = [r for r in runs if r["mlp_impl"] == impl]
        ratios = [r["tokens_per_s"] / normal[r["round"]] for r in mine
                  if r["round"] in normal and r["tokens_per_s"]]  # fmt: skip
        rows.append({
            "mlp_impl": impl,
            "rounds": len(mine),
            "tokens_per_s": _median(r["tokens_per_s"] for r in mine),
            "tokens_per_s_vs_normal": statistics.median(ratios) if ratios else None,
            "after_forward_MiB": _median(r["after_forward_MiB"] for r in mine),
            "peak_MiB": _median(r["peak_MiB"] for r in mine),
            "initial_loss": mine[0]["initial_loss"],
            "final_loss": _median(r["final_loss"] for r in mine),
        })  # fmt: skip
    return rows


def _median(values) -> float | None:
    """The median, or None where a run did not measure it (memory on the CPU, a run too short
    for tokens/s)."""
    values = list(values)
    return None if any(v is None for v in values) else statistics.median(values)


def _cell(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def markdown(title: str, rows: list[dict], baseline: str = "normal") -> str:
    lines = [
        f"### {title}",
        "",
        f"| impl | rounds | tokens/s | ÷ {baseline} (paired) | after-fwd MiB | peak MiB | loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{r['tokens_per_s_vs_normal']:.3f}" if r["tokens_per_s_vs_normal"] else "—"
        lines.append(
            f"| {r['mlp_impl']} | {r['rounds']} | {_cell(r['tokens_per_s'], '.0f')} | {ratio} "
            f"| {_cell(r['after_forward_MiB'], '.1f')} | {_cell(r['peak_MiB'], '.1f')} "
            f"| {_cell(r['initial_loss'], '.3f')} → {_cell(r['final_loss'], '.3f')} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--title", required=True)
    parser.add_argument("--command", required=True, help="the command that produced the runs")
    parser.add_argument("--commit", required=True)
    parser.add_argument("--gpu", help="the GPU's name (default: this machine's CUDA device)")
    parser.add_argument("--baseline", default="normal", help="the impl tokens/s are paired with")
    parser.add_argument("--json", required=True)
    parser.add_argument("--md", required=True)
    args = parser.parse_args()
    runs = load(args.runs)
    rows = table(runs, args.baseline)
    gpu = args.gpu or (torch.cuda.get_device_name() if torch.cuda.is_available() else None)
    if gpu is None:
        parser.error("--gpu: no CUDA device here to name; pass the GPU the runs ran on")
    meta = {"title": args.title, "command": args.command, "commit": args.commit, "gpu": gpu}
    write_json_atomic(Path(args.json), {"meta": meta, "rows": rows, "runs": runs})
    with atomic_write(Path(args.md)) as f:
        f.write(markdown(args.title, rows, args.baseline))


if __name__ == "__main__":
    main()
