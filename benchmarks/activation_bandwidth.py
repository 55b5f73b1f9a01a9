"""Achieved bandwidth of the SwiGLU activation kernels against the GPU's measured copy bandwidth.

For each [M, F] it times (CUDA events, median of --samples calls on data far past L2):
  copy      torch's device-to-device copy of a 4 GiB buffer: the ceiling the others are read
            against (the same for every shape); copy_same, one of the forward's bytes;
  ours      the package kernels as they launch (the tile rule of kernels/swiglu.py);
  ours[c]   the forward and recompute-backward kernels under other tiles (BLOCK_M, BLOCK_N,
            warps), to check the rule against the best tile at each shape;
  fwd_fp8, bwd_fp8  the FP8-saved drop_h's kernels (kernels/swiglu_fp8.py) under their rule
            and under other tiles (BLOCK_N a multiple of the 128-column scale block);
  liger     Liger-Kernel's fused gate-up kernels (one row per program), where installed.
Bandwidth counts bytes read plus bytes written, like the copy's.

    python benchmarks/activation_bandwidth.py --json OUT.json [--shapes M,F ...]
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch
import triton

from swiglu_train.bench.results import write_probe_result
from swiglu_train.kernels import swiglu, swiglu_fp8
from swiglu_train.kernels.fp8_format import FP8_DTYPE, SCALE_DTYPE, saved_shapes

SHAPES = ((11136, 14336), (8192, 14336), (8000, 11008), (4096, 8192), (16384, 18944), (8192, 28672))


def time_ms(fn, samples: int, batch: int = 10) -> float:
    """Median per-call ms over ``samples`` batches of ``batch`` back-to-back calls: the host
    queues ahead of the GPU, as in training, so launch latency is not counted."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(batch):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / batch)
    return statistics.median(times)


def forced(kernel, config: dict):
    """The kernel launched with one tile instead of the rule's."""
    bm, bn = config["BLOCK_M"], config["BLOCK_N"]

    def launch(grid_mf, *args, **kwargs):
        m, f = grid_mf
        grid = (triton.cdiv(m, bm) * triton.cdiv(f, bn),)
        kernel[grid](*args, **kwargs, **config)

    return launch


TILES = ((1, 16384, 16), (1, 8192, 16), (1, 4096, 16), (2, 4096, 16), (1, 2048, 8), (1, 1024, 4),
         (2, 2048, 4), (2, 1024, 4), (4, 512, 4), (4, 1024, 8), (8, 512, 8), (32, 128, 4),
         (1, 4096, 8), (1, 2048, 4), (4, 2048, 8))  # fmt: skip


def candidate_configs() -> list[dict]:
    return [{"BLOCK_M": m, "BLOCK_N": n, "num_warps": w} for m, n, w in TILES]


FP8_TILES = ((8, 128, 4), (4, 256, 4), (2, 512, 4), (1, 1024, 4), (1, 2048, 4), (1, 2048, 8),
             (2, 2048, 8), (1, 4096, 4), (1, 4096, 8), (1, 4096, 16), (2, 4096, 16),
             (1, 8192, 8), (1, 8192, 16))  # fmt: skip


def probe_fp8(m: int, f: int, preact, h, grad_h, samples: int, row) -> None:
    """The FP8-saved kernels' rows: the rule's tile, then each of FP8_TILES forced."""
    el = preact.element_size()
    q_shape, scale_shape = saved_shapes(m, f)
    q = torch.empty(q_shape, device="cuda", dtype=FP8_DTYPE)
    scales = torch.empty(scale_shape, device="cuda", dtype=SCALE_DTYPE)
    grad_preact = torch.empty_like(preact)
    saved = q.numel() + 2 * scales.numel()
    fwd_bytes, bwd_bytes = 3 * m * f * el + saved, 4 * m * f * el + saved
    swiglu_fp8.swiglu_forward_fp8(preact, h, q, scales)
    rule = "[{}x{}w{}]".format
    fwd_rule = rule(*swiglu_fp8.fp8_tile(m, f, swiglu_fp8.FP8_FWD_TILE))
    bwd_rule = rule(*swiglu_fp8.fp8_tile(m, f, swiglu.BWD_TILE))
    ms = time_ms(lambda: swiglu_fp8.swiglu_forward_fp8(preact, h, q, scales), samples)
    row("fwd_fp8", f"ours (rule {fwd_rule})", ms, fwd_bytes)
    ms = time_ms(lambda: swiglu_fp8.swiglu_backward_fp8(q, scales, grad_h, grad_preact), samples)
    row("bwd_fp8", f"ours (rule {bwd_rule})", ms, bwd_bytes)
    code, bits = q.view(torch.uint8), scales.view(torch.int16)
    for bm, bn, warps in FP8_TILES:
        cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "INTERPRET": False}
        fwd = forced(swiglu_fp8._swiglu_fwd_fp8_kernel, cfg)
        bwd = forced(swiglu_fp8._swiglu_bwd_fp8_kernel, cfg)
        fwd_call = functools.partial(
            fwd, (m, f), preact, h, code, bits, m, f, preact.stride(0), h.stride(0),
            code.stride(0), bits.stride(0),
        )  # fmt: skip
        bwd_call = functools.partial(
            bwd, (m, f), code, bits, grad_h, grad_preact, m, f, code.stride(0), bits.stride(0),
            grad_h.stride(0), grad_preact.stride(0),
        )  # fmt: skip
        row("fwd_fp8", "ours" + rule(bm, bn, warps), time_ms(fwd_call, samples), fwd_bytes)
        row("bwd_fp8", "ours" + rule(bm, bn, warps), time_ms(bwd_call, samples), bwd_bytes)


def copy_ms(samples: int) -> tuple[float, int]:
    """A 4 GiB device-to-device copy: (ms, bytes read plus written)."""
    src = torch.empty(2**31, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), samples)
    return ms, 2 * src.numel() * src.element_size()


def probe_shape(m: int, f: int, samples: int) -> list[dict]:
    dev, dt = "cuda", torch.bfloat16
    el = torch.finfo(dt).bits // 8
    preact = torch.randn(m, 2 * f, device=dev, dtype=dt)
    h = torch.empty(m, f, device=dev, dtype=dt)
    grad_h = torch.randn(m, f, device=dev, dtype=dt)
    grad_preact = torch.empty_like(preact)
    rows = []

    def row(kernel: str, variant: str, ms: float, bytes_moved: int) -> None:
        rows.append(
            {
                "M": m,
                "F": f,
                "kernel": kernel,
                "variant": variant,
                "ms": ms,
                "GBps": bytes_moved / ms / 1e6,
            }
        )

    fwd_bytes, bwd_bytes = 3 * m * f * el, 6 * m * f * el
    bwd_noh_bytes, factors_bytes = 5 * m * f * el, 5 * m * f * el
    ms, moved = copy_ms(samples)
    row("copy", "torch", ms, moved)
    src = torch.empty(fwd_bytes // 2 // el, device=dev, dtype=dt)
    dst = torch.empty_like(src)
    row("copy_same", "torch", time_ms(lambda: dst.copy_(src), samples), fwd_bytes)

    row("fwd", "ours", time_ms(lambda: swiglu.swiglu_forward(preact, h), samples), fwd_bytes)
    row(
        "bwd_recompute",
        "ours",
        time_ms(lambda: swiglu.swiglu_backward(preact, grad_h, grad_preact, h), samples),
        bwd_bytes,
    )
    row(
        "bwd_recompute_inplace",
        "ours",
        time_ms(lambda: swiglu.swiglu_backward(preact, grad_h, preact, grad_h), samples),
        bwd_bytes,
    )  # drop_h's call: grad_preact over preact, h over grad_h (values drift; timing does not)
    row(
        "bwd",
        "ours",
        time_ms(lambda: swiglu.swiglu_backward(preact, grad_h, grad_preact, None), samples),
        bwd_noh_bytes,
    )
    row(
        "factors",
        "ours",
        time_ms(lambda: swiglu.swiglu_factors_(preact, h, 128), samples),
        factors_bytes,
    )
    for cfg in candidate_configs():
        name = f"ours[{cfg['BLOCK_M']}x{cfg['BLOCK_N']}w{cfg['num_warps']}]"
        fwd = forced(swiglu._swiglu_fwd_kernel, cfg)
        bwd = forced(swiglu._swiglu_bwd_kernel, cfg)
        ms = time_ms(
            lambda fwd=fwd: fwd((m, f), preact, h, m, f, preact.stride(0), h.stride(0)),
            samples,
        )
        row("fwd", name, ms, fwd_bytes)
        ms = time_ms(
            lambda bwd=bwd: bwd(
                (m, f), preact, grad_h, grad_preact, h, m, f, preact.stride(0), grad_h.stride(0),
                grad_preact.stride(0), h.stride(0), WRITE_H=True, INPLACE=False,
            ),
            samples,
        )  # fmt: skip
        row("bwd_recompute", name, ms, bwd_bytes)
    probe_fp8(m, f, preact, h, grad_h, samples, row)
    try:
        from liger_kernel.ops.swiglu import (
            swiglu_fused_gate_up_backward,
            swiglu_fused_gate_up_forward,
        )
    except ImportError:
        return rows
    row("fwd", "liger", time_ms(lambda: swiglu_fused_gate_up_forward(preact), samples), fwd_bytes)
    row(
        "bwd",
        "liger",
        time_ms(lambda: swiglu_fused_gate_up_backward(preact, grad_h, in_place=True), samples),
        bwd_noh_bytes,
    )
    return rows


def to_markdown(result: dict) -> str:
    lines = ["| M | F | kernel | variant | ms | GB/s | ÷ copy |", "|---|---|---|---|---|---|---|"]
    copy = {(r["M"], r["F"]): r["GBps"] for r in result["rows"] if r["kernel"] == "copy"}
    for r in result["rows"]:
        share = r["GBps"] / copy[(r["M"], r["F"])]
        lines.append(
            f"| {r['M']} | {r['F']} | {r['kernel']} | {r['variant']} | {r['ms']:.4f} "
            f"| {r['GBps']:.0f} | {share:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", default=[f"{m},{f}" for m, f in SHAPES])
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--commit")
    parser.add_argument("--json", required=True)
    parser.add_argument("--md")
    args = parser.parse_args()
    rows = []
    for spec in args.shapes:
        m, f = (int(v) for v in spec.split(","))
        rows += probe_shape(m, f, args.samples)
        torch.cuda.empty_cache()
    result = write_probe_result(
        "benchmarks/activation_bandwidth.py", rows, args.samples, args.commit, args.json,
        args.md, to_markdown,
    )  # fmt: skip
    print(to_markdown(result))


if __name__ == "__main__":
    main()
