"""The bytes bound on `drop_h`'s step-time gap to Liger's in-place SwiGLU (issue 46, item 3).

Why: the issue's target is "drop_h <= Liger + the bytes bound, on both GPUs". Both run the same
six cuBLAS GEMMs; they differ only in their activation kernels, which are memory-bound. So the
part of the gap that bytes explain is the HBM traffic drop_h's kernels move beyond Liger's,
divided by the bandwidth those kernels reach, as a share of the six-GEMM floor. This script
counts that traffic from the code (the counts below), reads the committed model grids and the
bandwidths measured in the repo, and prints, per grid point, the measured gap against the bound.
It runs on CPU in a second; it measures nothing itself.

Traffic per element of the [M, F] activation, in bf16 elements (2 bytes), one training step:

drop_h (ops/mlp.py ``_DropH``, kernels/swiglu.py; fused_forward off, as ParMLP runs it)
    forward   ``_swiglu_fwd_kernel``: reads preact [M, 2F] (2), writes h (1); h goes to fc2
              and is not saved (preact is).
    backward  ``_swiglu_bwd_kernel`` in place (WRITE_H, INPLACE): reads preact (2) and grad_h
              (1), writes grad_preact over preact (2) and h over grad_h (1), for grad_W2.
    total 9.
Liger 0.8.5 (``LigerFusedGateUpSiLUMulFunction.apply(preact, True)``, bench/mlp/variants.py)
    forward   ``_swiglu_fused_gate_up_forward_kernel``: reads [gate | up] (2), writes c = h (1);
              the Function saves preact, fc2's F.linear saves h.
    backward  ``_swiglu_fused_gate_up_backward_kernel`` with dy = y (in place): reads dc = grad_h
              (1) and [gate | up] (2), writes d[gate | up] over it (2); h is not written.
    total 8.
Neither makes a copy: the preact is one contiguous [M, 2F] buffer read by column offset
(no split, no ``.contiguous()``, no cat), grad_h comes contiguous out of its GEMM, and both
variants' parameter grads are fresh each step (the harness resets them to None). `normal`
(ours, h saved by fc2, ``_swiglu_bwd_kernel`` without WRITE_H) also moves 8, so
``normal - Liger`` is a control: same bytes and GEMMs, only the kernels' code and host path
differ, so it shows the noise of a point.

The bound, in points (percent of the floor):
    bound = 100 * (9 - 8) * M * F * 2 bytes / B / floor_ms
with B the bandwidth the activation kernels reach on the GPU, measured in the repo:
    H200  4.30 TB/s, a 4 GiB device copy (activation_bandwidth_h200.json; our kernels run at
          0.97-0.99 of it at training shapes);
    H100  3.20 TB/s, our ``_swiglu_fwd_kernel`` at Qwen3-30B-A3B's experts (R = 65536 rows,
          F = 768: 302 MB in 94.3 us, profile_qwen3_h100.txt); no copy is measured on the H100.
The datasheet bandwidths (H100 SXM 3.35 TB/s, H200 4.8) give a smaller bound, also reported.

    python benchmarks/bytes_bound.py [--json benchmarks/results/grid/bytes_bound.json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path
from typing import Any

from swiglu_train.files import write_json_atomic

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BYTES_PER_ELEMENT = 2  # bf16

# HBM traffic per [M, F] element of one step, by kernel: (read, written), in elements.
TRAFFIC: dict[str, dict[str, tuple[int, int]]] = {
    "drop_h": {"forward": (2, 1), "backward": (3, 3)},
    "liger": {"forward": (2, 1), "backward": (3, 2)},
    "normal": {"forward": (2, 1), "backward": (3, 2)},
}
DATASHEET_TBPS = {"h100": 3.35, "h200": 4.8}
COMMAND = "python benchmarks/bytes_bound.py --json benchmarks/results/grid/bytes_bound.json"
GRIDS = {"h100": RESULTS / "grid" / "grid_h100.json", "h200": RESULTS / "grid" / "grid_h200.json"}
MIN_D, MIN_M = 2048, 4096  # issue 46's target region
SLACK_POINTS = 0.3  # a second count, within this many points of the bound
WORST_KEYS = ("M", "D", "F", "gap_points", "bound_points", "excess_points",
              "control_normal_minus_liger")  # fmt: skip


def elements(variant: str) -> int:
    """Total elements read and written per [M, F] element in one step."""
    return sum(r + w for r, w in TRAFFIC[variant].values())


def h200_copy_tbps() -> tuple[float, str]:
    """The H200's copy ceiling: the median of the 4 GiB copies in activation_bandwidth_h200."""
    path = RESULTS / "activation" / "activation_bandwidth_h200.json"
    rows = json.loads(path.read_text())["rows"]
    gbps = statistics.median(r["GBps"] for r in rows if r["kernel"] == "copy")
    return gbps / 1e3, f"{path.relative_to(ROOT)}: 4 GiB device copy, median of its rows"


def h100_kernel_tbps() -> tuple[float, str]:
    """The H100's rate of our forward kernel at Qwen3-30B-A3B's experts, from the profile's
    ``_swiglu_fwd_kernel`` rows (self CUDA time over calls): T = 8192 tokens x k = 8 rows of
    [gate | up] with F = 768, 3 elements of traffic each."""
    path = RESULTS / "moe" / "profile_qwen3_h100.txt"
    rows, ffn = 8192 * 8, 768
    per_call_us = []
    for line in path.read_text().splitlines():
        if line.strip().startswith("_swiglu_fwd_kernel"):
            fields = line.split()
            self_cuda, calls = fields[6], int(fields[-1])
            per_call_us.append(float(re.sub("us$", "", self_cuda)) / calls)
    if not per_call_us:
        raise ValueError(f"no _swiglu_fwd_kernel row in {path}")
    bytes_moved = sum(TRAFFIC["drop_h"]["forward"]) * rows * ffn * BYTES_PER_ELEMENT
    us = statistics.median(per_call_us)
    source = (
        f"{path.relative_to(ROOT)}: _swiglu_fwd_kernel, {bytes_moved / 1e6:.0f} MB in {us:.1f} us"
    )
    return bytes_moved / (us * 1e-6) / 1e12, source


def bound_points(m: int, f: int, floor_ms: float, tbps: float) -> float:
    """The extra bytes of drop_h over Liger, at ``tbps``, in percent of the floor."""
    extra = (elements("drop_h") - elements("liger")) * m * f * BYTES_PER_ELEMENT
    return 100 * extra / (tbps * 1e12) * 1e3 / floor_ms


def compare(gpu: str, tbps: float) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per-point rows and the GPU's summary, over the grid points with D >= 2048, M >= 4096."""
    grid = json.loads(GRIDS[gpu].read_text())
    by_key = {(r["M"], r["D"], r["F"], r["variant"]): r for r in grid["rows"]}
    points = sorted({(m, d, f) for m, d, f, _ in by_key if d >= MIN_D and m >= MIN_M})
    rows = []
    for m, d, f in points:
        drop_h, liger, normal = (by_key[(m, d, f, v)] for v in ("drop_h", "liger", "normal"))
        floor_ms = drop_h["floor_ms"]
        gap = 100 * (drop_h["ratio_to_floor"] - liger["ratio_to_floor"])
        bound = bound_points(m, f, floor_ms, tbps)
        rows.append({
            "M": m, "D": d, "F": f, "floor_ms": round(floor_ms, 4),
            "drop_h": round(drop_h["ratio_to_floor"], 4),
            "liger": round(liger["ratio_to_floor"], 4),
            "gap_points": round(gap, 3), "bound_points": round(bound, 3),
            "excess_points": round(gap - bound, 3),
            "bound_datasheet_points": round(bound_points(m, f, floor_ms, DATASHEET_TBPS[gpu]), 3),
            "control_normal_minus_liger": round(
                100 * (normal["ratio_to_floor"] - liger["ratio_to_floor"]), 3
            ),
            "drop_h_minus_normal": round(
                100 * (drop_h["ratio_to_floor"] - normal["ratio_to_floor"]), 3
            ),
        })  # fmt: skip
    excess = [r["excess_points"] for r in rows]
    worst = sorted(rows, key=lambda r: r["excess_points"], reverse=True)[:3]
    summary = {
        "grid": str(GRIDS[gpu].relative_to(ROOT)),
        "grid_commit": grid["meta"]["commit"],
        "device_name": grid["meta"]["device_name"],
        "points": len(rows),
        "within_bound": sum(e <= 0 for e in excess),
        "within_bound_plus_slack": sum(e <= SLACK_POINTS for e in excess),
        "within_datasheet_bound": sum(r["gap_points"] <= r["bound_datasheet_points"] for r in rows),
        "slack_points": SLACK_POINTS,
        "median_excess_points": round(statistics.median(excess), 3),
        "worst_excess": [{k: r[k] for k in WORST_KEYS} for r in worst],
        "median_gap_points": round(statistics.median(r["gap_points"] for r in rows), 3),
        "median_bound_points": round(statistics.median(r["bound_points"] for r in rows), 3),
        "median_excess_over_normal_points": round(
            statistics.median(r["drop_h_minus_normal"] - r["bound_points"] for r in rows), 3
        ),
    }
    return rows, summary


def print_table(gpu: str, tbps: float, rows: list[dict[str, Any]], summary: dict) -> None:
    print(f"\n{gpu.upper()} ({summary['device_name']}, grid {summary['grid_commit']}), "
          f"B = {tbps:.2f} TB/s")  # fmt: skip
    print(f"{'M':>6} {'D':>5} {'F':>6} {'floor ms':>9} {'gap':>6} {'bound':>6} {'excess':>7} "
          f"{'normal-liger':>13}")  # fmt: skip
    for r in rows:
        print(f"{r['M']:>6} {r['D']:>5} {r['F']:>6} {r['floor_ms']:>9.3f} {r['gap_points']:>6.2f} "
              f"{r['bound_points']:>6.2f} {r['excess_points']:>7.2f} "
              f"{r['control_normal_minus_liger']:>13.2f}")  # fmt: skip
    print(f"gap <= bound at {summary['within_bound']} of {summary['points']} "
          f"(within +{SLACK_POINTS} points: {summary['within_bound_plus_slack']}; "
          f"datasheet bound: {summary['within_datasheet_bound']}); median excess "
          f"{summary['median_excess_points']:+.2f}, worst "
          f"{summary['worst_excess'][0]['excess_points']:+.2f} points")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the rows and summaries here")
    args = parser.parse_args()
    bandwidths = {"h100": h100_kernel_tbps(), "h200": h200_copy_tbps()}
    out: dict[str, Any] = {
        "question": "Is drop_h's gap to Liger's in-place SwiGLU what its extra bytes explain?",
        "command": COMMAND,
        "formula": "bound_points = 100 * (9 - 8) * M * F * 2 B / bandwidth / floor_ms",
        "traffic_elements_per_MF": {v: TRAFFIC[v] for v in TRAFFIC},
        "region": f"D >= {MIN_D}, M >= {MIN_M}",
        "gpus": {},
    }
    for gpu, (tbps, source) in bandwidths.items():
        rows, summary = compare(gpu, tbps)
        print_table(gpu, tbps, rows, summary)
        out["gpus"][gpu] = {
            "bandwidth_TBps": round(tbps, 3), "bandwidth_source": source,
            "datasheet_TBps": DATASHEET_TBPS[gpu], "summary": summary, "rows": rows,
        }  # fmt: skip
    if args.json:
        write_json_atomic(args.json, out)


if __name__ == "__main__":
    main()
