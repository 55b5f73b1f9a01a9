"""Step time and memory of drop_h with its saved preactivation in FP8, run in chunks (issue
19), paired against bf16 drop_h and the six-GEMM floor at one shape, on CUDA.

Variants, each one layer's fwd+bwd on the same weights and inputs (bf16, no bias):
  drop_h          the bf16 impl (in place);
  fp8             saved_fp8's function as ParMLP runs it (``ops.fp8_chunks``' rules: forward
                  rows per chunk, and the backward's growing chunks, each freeing its copy);
  fp8[kept]       the backward in the chunks that would fit were the copy held whole through
                  its loop (inplace=False's: more, smaller), after the same forward;
  fp8[rows=N]     N rows per chunk in forward and backward (N >= M: one chunk).
Issue 19's targets at the seed shape: fp8's full step within drop_h's + 1 % (``full_over_drop_h``
<= 1.01), its peak at most drop_h's, after forward at most 390 MiB. After-forward and peak are
allocator MiB above the step's start, parameter grads reset (``bench.timing.memory_mib``).

    python scripts/probe_fp8_chunks.py --profile --rows 2816 11136 \\
        --json $OUT/probe_fp8_chunks_h200.json --md $OUT/probe_fp8_chunks_h200.md
"""

from __future__ import annotations

import argparse
import functools

import numpy as np
import torch

from swiglu_train.bench.mlp import floor_case, git_commit, write_probe_result
from swiglu_train.bench.timing import (
    PHASES,
    Case,
    Clock,
    kernel_timeline,
    memory_mib,
    paired_samples,
    run_once,
)
from swiglu_train.bench.variants import LayerWeights
from swiglu_train.ops.fp8_chunks import backward_row_chunks, rows_per_chunk
from swiglu_train.ops.fp8_saved import drop_h_fp8_mlp
from swiglu_train.ops.mlp import drop_h_mlp

SEED_SHAPE = (11136, 3584, 14336, 3584)  # M, D, F, O


def layer_case(name: str, mlp, w: LayerWeights, x: torch.Tensor, grad_y: torch.Tensor) -> Case:
    def reset() -> None:
        x.grad = w.fc1.grad = w.fc2.grad = None

    forward = functools.partial(mlp, x, w.fc1, None, w.fc2, None)
    return Case(name, forward, lambda y: y.backward(grad_y), reset)


def rows_table(times: dict, memory: dict) -> list[dict]:
    """Per variant: median ms per phase, paired medians over the floor and over drop_h."""
    rows = []
    for name, t in times.items():
        if name == "floor":
            continue
        row = {"variant": name, **{f"{p}_ms": float(np.median(t[p])) for p in PHASES}}
        for base in ("floor", "drop_h"):
            row[f"full_over_{base}"] = float(np.median(t["full"] / times[base]["full"]))
        row["after_forward_MiB"], row["peak_MiB"] = memory[name]
        rows.append(row)
    return rows


def to_markdown(result: dict) -> str:
    lines = [
        f"# FP8-saved drop_h in row chunks, {result['gpu']}",
        "",
        f"`{result['command']}` at commit {result['commit']}, {result['samples']} paired samples.",
        "",
        "| variant | fwd ms | bwd ms | full ms | full ÷ floor | full ÷ drop_h | after-fwd MiB "
        "| peak MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['variant']} | {r['fwd_ms']:.3f} | {r['bwd_ms']:.3f} | {r['full_ms']:.3f} "
            f"| {r['full_over_floor']:.3f} | {r['full_over_drop_h']:.4f} "
            f"| {r['after_forward_MiB']:.1f} | {r['peak_MiB']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shape", type=int, nargs=4, default=SEED_SHAPE, metavar=("M", "D", "F", "O")
    )
    parser.add_argument("--rows", type=int, nargs="*", default=[], help="fixed rows per chunk")
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", required=True)
    parser.add_argument("--md")
    parser.add_argument(
        "--profile", action="store_true", help="add each variant's kernels in launch order"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs CUDA: this probe times GPU kernels")
    m, d, f, o = args.shape
    device, dtype = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(args.seed)
    w = LayerWeights.random(d, f, o, dtype, "cuda")
    x = torch.randn(m, d, dtype=dtype, device=device, requires_grad=True)
    grad_y = torch.randn(m, o, dtype=dtype, device=device)
    kept = backward_row_chunks(m, d, f, o, 2, freed=False)  # the chunks without freeing
    variants = {
        "drop_h": drop_h_mlp,
        "fp8": drop_h_fp8_mlp,
        "fp8[kept]": functools.partial(drop_h_fp8_mlp, backward_rows=kept),
    }
    for n in args.rows:
        variants[f"fp8[rows={n}]"] = functools.partial(drop_h_fp8_mlp, chunk_rows=n)
    cases = [floor_case(w, x, grad_y)]
    cases += [layer_case(name, mlp, w, x, grad_y) for name, mlp in variants.items()]
    for case in cases:  # compiles, cuBLAS workspaces and heuristics before anything is read
        run_once(case, Clock(device))
    memory = {case.name: memory_mib(case, device) for case in cases[1:]}
    times = paired_samples(cases, args.samples, device, args.seed)
    rows = rows_table(times, memory)
    if args.profile:  # after the timing, so that the profiler cannot disturb it
        timelines = {case.name: kernel_timeline(case) for case in cases[1:]}
        for row in rows:
            row["kernels"] = timelines[row["variant"]]
    for row in rows:
        if row["variant"] == "fp8":
            row["rows_forward"] = rows_per_chunk(m, d, f, o, 2)
            row["rows_backward"] = backward_row_chunks(m, d, f, o, 2)
        if row["variant"] == "fp8[kept]":
            row["rows_backward"] = kept
    result = write_probe_result(
        "scripts/probe_fp8_chunks.py", rows, args.samples, git_commit(), args.json, args.md,
        to_markdown,
    )  # fmt: skip
    print(to_markdown(result))


if __name__ == "__main__":
    main()
