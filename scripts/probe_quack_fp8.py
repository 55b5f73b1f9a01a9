"""drop_h_quack with its saved preactivation in FP8 (issue 19) on CUDA: the fc1 epilogue's bytes
against the torch reference of the paired format, the gradients against float64, and the step
paired against bf16 drop_h_quack, drop_h's FP8 path and the six-GEMM floor.

Format check (``--check-shape``, bias on and off): the epilogue's copy and scales against
``ops.fp8_paired.quantize_paired`` of the fp32 GEMM x @ W1ᵀ (+ b) (the same math on an fp32
preactivation whose sums ran in another order, so a code may differ by one step where a value
sits at a rounding boundary), each restored value within 2**-4 of the preactivation or 2**-10
of its scale, and h against SwiGLU of that preactivation. Gradients: relative (Frobenius)
error of y, grad_x, grad_W1, grad_W2 against float64 on the same bf16 values.

Timing (``--shapes``): one layer's fwd+bwd, bf16, no bias, 30 paired samples, queued;
``[tile=N]`` pins the fc1 epilogue's N tile (both widths, so the rule's pick meets the other),
``[rows/N]`` the backward chunks' alignment (the rule's is 256 rows). After-forward and peak
are allocator MiB above the step's start, parameter grads reset. ``--step-only`` skips the
format checks and errors.

    python scripts/probe_quack_fp8.py --out $OUT/probe_quack_fp8_h200.json --profile
"""

from __future__ import annotations

import functools
import sys
import traceback
from unittest import mock

import numpy as np
import torch
import torch.nn.functional as F
from probe_fp8_chunks import layer_case

from swiglu_train.bench.mlp import floor_case, git_commit, shape_probe_args, write_probe_result
from swiglu_train.bench.timing import (
    PHASES,
    Clock,
    kernel_timeline,
    memory_mib,
    paired_fresh_calls,
    paired_samples,
    run_once,
)
from swiglu_train.bench.variants import LayerWeights
from swiglu_train.files import write_json_atomic
from swiglu_train.ops import quack_fp8_saved
from swiglu_train.ops.fp8_chunks import backward_row_chunks
from swiglu_train.ops.fp8_paired import (
    deinterleave,
    dequantize_paired,
    interleave,
    quantize_paired,
)
from swiglu_train.ops.fp8_saved import drop_h_fp8_mlp, recompute_from
from swiglu_train.ops.quack_fp8_saved import (
    drop_h_quack_fp8_mlp,
    fp8_fc1_config,
    quack_dswiglu_fp8_,
    quack_swiglu_fp8_,
)
from swiglu_train.ops.quack_mlp import drop_h_quack_mlp, require_quack
from swiglu_train.ops.reference import swiglu


def fc1_tile(tile_n: int):
    """Pin the FP8 fc1 epilogue's N tile for the calls inside (a probe's knob, not an API)."""
    rule = quack_fp8_saved._fc1_tile
    return mock.patch.object(quack_fp8_saved, "_fc1_tile", lambda x, w: (tile_n, *rule(x, w)[1:]))


def chunk_align(rows: int):
    """Pin drop_h_quack+fp8's backward chunk alignment for the calls inside (a probe's knob)."""
    aligned = functools.partial(quack_fp8_saved.backward_row_chunks, align=rows)
    return mock.patch.object(quack_fp8_saved, "backward_row_chunks", aligned)


def pinned(knob, mlp):
    """mlp run inside the ``knob`` patch, made afresh per call."""

    def run(*args):
        with knob():
            return mlp(*args)

    return run


def drop_h_fp8_aligned(rows: int):
    """drop_h's FP8 path with its backward chunks in whole ``rows``."""

    def run(x, w1, b1, w2, b2):
        ffn, out, itemsize = w1.shape[0] // 2, w2.shape[0], x.element_size()
        lengths = backward_row_chunks(*x.shape, ffn, out, itemsize, align=rows)
        return drop_h_fp8_mlp(x, w1, b1, w2, b2, backward_rows=lengths)

    return run


UNFUSED = functools.partial(drop_h_quack_fp8_mlp, fused_backward=False)
FUSED_VARIANTS = {"drop_h_quack+fp8": drop_h_quack_fp8_mlp}


def check_format(m: int, d: int, f: int, bias: bool, tile_n: int) -> dict:
    """The epilogue's copy, scales and h against the torch reference on its fp32 preact."""
    x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
    w1 = torch.randn(2 * f, d, device="cuda", dtype=torch.bfloat16) / d**0.5
    b1 = torch.randn(2 * f, device="cuda", dtype=torch.bfloat16) if bias else None
    h = torch.empty(m, f, device="cuda", dtype=torch.bfloat16)
    q = torch.empty(m, 2 * f, device="cuda", dtype=torch.float8_e4m3fn)
    scales = torch.empty(m, 2 * f // 128, device="cuda", dtype=torch.bfloat16)
    with fc1_tile(tile_n):
        quack_swiglu_fp8_(x, w1, b1, h, q, scales)
    preact = x.float() @ w1.float().t() + (0 if b1 is None else b1.float())
    q_ref, s_ref = quantize_paired(interleave(preact))
    restored = dequantize_paired(q, scales)
    paired = interleave(preact)
    bound = 2.0**-4 * paired.abs() + 2.0**-10 * scales.float().repeat_interleave(128, dim=1)
    ulp_bf16 = (s_ref.float() - scales.float()).abs() / s_ref.float()
    return {
        "shape": [m, d, f], "bias": bias, "tile_n": tile_n,
        "codes_differing": float((q.view(torch.uint8) != q_ref.view(torch.uint8)).float().mean()),
        "scales_differing": float((scales != s_ref).float().mean()),
        "scale_max_rel_diff": float(ulp_bf16.max()),
        "restored_within_bound": bool(((restored - paired).abs() <= bound).all()),
        "restored_max_err_over_bound": float(((restored - paired).abs() / bound).max()),
        "h_rel_err": float((h.float() - swiglu(preact)).norm() / swiglu(preact).norm()),
    }  # fmt: skip


def check_backward(m: int, d: int, f: int) -> dict:
    """The grad_h epilogue's h and grad_preact against the torch path on the same copy, with
    grad_h in fp32 (the epilogue's accumulator); NaN gate or up codes in a few pairs."""
    preact = torch.randn(m, 2 * f, device="cuda") * 3
    q, scales = quantize_paired(interleave(preact))
    nan_rows = torch.arange(0, m, 97, device="cuda")
    q.view(torch.uint8)[nan_rows, 1] = 0x7F  # up of feature 0 NaN
    q.view(torch.uint8)[nan_rows, 4] = 0xFF  # gate of feature 2 NaN
    grad_y = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
    w2 = (torch.randn(d, f, device="cuda") / f**0.5).bfloat16()
    h = torch.empty(m, f, device="cuda", dtype=torch.bfloat16)
    grad_preact = torch.empty(m, 2 * f, device="cuda", dtype=torch.bfloat16)
    quack_dswiglu_fp8_(q, scales, grad_y, w2, h, grad_preact)
    grad_h = grad_y.float() @ w2.float()
    h_ref, gp_ref = recompute_from(deinterleave(dequantize_paired(q, scales)), grad_h)

    def rel(a, b):
        ok = b.isfinite()
        return float((a.float()[ok] - b[ok]).norm() / b[ok].norm())

    return {
        "shape": [m, d, f],
        "h_rel_err": rel(h, h_ref),
        "grad_preact_rel_err": rel(grad_preact, gp_ref),
        "h_nan_match": bool(torch.equal(h.isnan(), h_ref.isnan())),
        "grad_nan_match": bool(torch.equal(grad_preact.isnan(), gp_ref.isnan())),
    }


def grad_errors(m: int, d: int, f: int) -> dict:
    """Relative errors of y and the grads against float64, per impl, on the same bf16 values."""
    torch.manual_seed(1)
    x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
    w1 = (torch.randn(2 * f, d, device="cuda") / d**0.5).bfloat16()
    w2 = (torch.randn(d, f, device="cuda") / f**0.5).bfloat16()
    gy = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)

    def run(mlp, dtype):
        xs, a, b = (t.detach().to(dtype).requires_grad_() for t in (x, w1, w2))
        y = mlp(xs, a, None, b, None)
        y.backward(gy.to(dtype))
        return [t.double() for t in (y, xs.grad, a.grad, b.grad)]

    def reference(x, w1, b1, w2, b2):
        return F.linear(swiglu(F.linear(x, w1)), w2)

    ref = run(reference, torch.float64)
    out = {}
    for name, mlp in (
        ("drop_h_quack", drop_h_quack_mlp),
        ("drop_h+fp8", drop_h_fp8_mlp),
        ("dhq+fp8[unfused]", UNFUSED),
        *FUSED_VARIANTS.items(),
    ):
        got = run(mlp, torch.bfloat16)
        out[name] = {
            k: float((g - r).norm() / r.norm())
            for k, g, r in zip(("y", "grad_x", "grad_W1", "grad_W2"), got, ref, strict=True)
        }
    return {"shape": [m, d, f], "rel_err": out}


def time_shape(shape: tuple[int, ...], samples: int, seed: int, profile: bool) -> list[dict]:
    m, d, f = shape[:3]
    torch.manual_seed(seed)
    w = LayerWeights.random(d, f, d, torch.bfloat16, "cuda")
    x = torch.randn(m, d, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    grad_y = torch.randn(m, d, dtype=torch.bfloat16, device="cuda")
    variants = {
        "drop_h_quack": drop_h_quack_mlp,
        "drop_h+fp8": drop_h_fp8_mlp,
        "drop_h+fp8[rows/128]": drop_h_fp8_aligned(128),
        "dhq+fp8[unfused]": UNFUSED,
        "dhq+fp8[unfused, tile=128]": pinned(functools.partial(fc1_tile, 128), UNFUSED),
        **FUSED_VARIANTS,
        **{
            f"{k}[rows/128]": pinned(functools.partial(chunk_align, 128), v)
            for k, v in FUSED_VARIANTS.items()
        },
        **{
            f"{k}[tile={n}]": pinned(functools.partial(fc1_tile, n), v)
            for k, v in FUSED_VARIANTS.items()
            for n in quack_fp8_saved.FP8_FC1_TILES_N
        },
    }
    cases = [floor_case(w, x, grad_y)]
    cases += [layer_case(name, mlp, w, x, grad_y) for name, mlp in variants.items()]
    device = torch.device("cuda")
    for case in cases:
        run_once(case, Clock(device))
    memory = {case.name: memory_mib(case, device) for case in cases[1:]}
    times = paired_samples(cases, samples, device, seed)
    rows = []
    for case in cases[1:]:
        t = times[case.name]
        row = {"shape": list(shape), "variant": case.name}
        row |= {f"{p}_ms": float(np.median(t[p])) for p in PHASES}
        for base in ("floor", "drop_h_quack"):
            row[f"full_over_{base}"] = float(np.median(t["full"] / times[base]["full"]))
        row["after_forward_MiB"], row["peak_MiB"] = memory[case.name]
        if profile:
            row["kernels"] = kernel_timeline(case)
        rows.append(row)
    return rows


def time_fc1(shape: tuple[int, ...], samples: int, seed: int) -> dict:
    """fc1's GEMM alone over all M rows, paired: quack's gated GEMM as drop_h_quack runs it
    (its default 128 x 192 pingpong tile, the bf16 preactivation stored), and the FP8
    epilogue at the rule's tile, at 128 x 128 pingpong, with 64-column groups (twice the
    scales) at quack's default 128 x 192 pingpong tile, and at the two other tiles that hold
    whole 128-column groups: 64 x 256 pingpong and 256 x 128 cooperative. Median
    microseconds; a tile that fails to build is listed under "failed"."""
    epi = quack_fp8_saved._epilogues()
    m, d, f = shape[:3]
    torch.manual_seed(seed)
    x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
    w1 = (torch.randn(2 * f, d, device="cuda") / d**0.5).bfloat16()
    h = x.new_empty(m, f)
    q = torch.empty(m, 2 * f, device="cuda", dtype=torch.float8_e4m3fn)

    def fp8(group: int, config):
        scales = x.new_empty(m, 2 * f // group)
        return lambda: epi.swiglu_fp8_saved_epilogue(
            x, w1.t(), out={"D": q, "h": h}, scales=scales, inv_scale=group, tuned=False,
            concat_layout=("B",), config=config,
        )  # fmt: skip

    def gated():
        require_quack().gemm_gated(
            x, w1.t(), activation="swiglu", tuned=False, concat_layout=("B",)
        )  # fmt: skip

    from quack.gemm_config import GemmConfig

    def tile(tile_m: int, tile_n: int, pingpong: bool):
        return GemmConfig(
            tile_m=tile_m, tile_n=tile_n, pingpong=pingpong, cluster_m=2, cluster_n=1,
            is_dynamic_persistent=False,
        )  # fmt: skip

    calls = {
        "quack gated (drop_h_quack)": gated,
        "fp8, the rule": fp8(128, fp8_fc1_config(*quack_fp8_saved._fc1_tile(x, w1))),
        "fp8, 128 x 128 pingpong": fp8(128, fp8_fc1_config(128, 2, 1)),
        "fp8, 64-column groups, 128 x 192 pingpong": fp8(64, fp8_fc1_config(192, 2, 1)),
        "fp8, 64 x 256 pingpong": fp8(128, tile(64, 256, True)),
        "fp8, 256 x 128 cooperative": fp8(128, tile(256, 128, False)),
    }
    failed = {}
    for name, call in list(calls.items()):  # a config quack cannot build is reported, not fatal
        try:
            call()
        except Exception as error:
            failed[name] = f"{type(error).__name__}: {str(error)[-600:]}"
            del calls[name]
    times = paired_fresh_calls(calls, tuple, samples, torch.device("cuda"), seed)
    medians = {k: float(np.median(v)) * 1e3 for k, v in times.items()}
    return {"shape": list(shape), **medians, "failed": failed}


def to_markdown(result: dict) -> str:
    lines = [
        f"# drop_h_quack with the FP8-saved preactivation, {result['gpu']}",
        "",
        f"`{result['command']}` at commit {result['commit']}, {result['samples']} paired samples.",
        "",
        "| shape | variant | fwd ms | bwd ms | full ÷ floor | full ÷ drop_h_quack "
        "| after-fwd MiB | peak MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['shape']} | {r['variant']} | {r['fwd_ms']:.3f} | {r['bwd_ms']:.3f} "
            f"| {r['full_over_floor']:.3f} | {r['full_over_drop_h_quack']:.4f} "
            f"| {r['after_forward_MiB']:.1f} | {r['peak_MiB']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    args, shapes = shape_probe_args(
        __doc__, ["11136,3584,14336", "8000,4096,14336"],
        **{"--profile": {"action": "store_true"}, "--md": {},
           "--fc1-only": {"action": "store_true"},
           "--step-only": {"action": "store_true", "help": "the step timing alone"}},
    )  # fmt: skip
    if args.fc1_only:  # the fc1 GEMM's tiles and groups alone
        fc1 = [time_fc1(s, args.samples, args.seed) for s in shapes]
        for row in fc1:
            print(row)
        write_json_atomic(
            args.out,
            {
                "command": "python scripts/probe_quack_fp8.py " + " ".join(sys.argv[1:]),
                "commit": git_commit(),
                "gpu": torch.cuda.get_device_name(),
                "fc1_us": fc1,
            },
        )
        return
    checks, errors = [], []
    if not args.step_only:
        checks, errors = format_and_errors()
    rows = [r for s in shapes for r in time_shape(s, args.samples, args.seed, args.profile)]
    result = write_probe_result(
        "scripts/probe_quack_fp8.py", rows, args.samples, git_commit(), args.out, args.md,
        to_markdown,
    )  # fmt: skip
    result["format_checks"], result["grad_errors"] = checks, errors
    write_json_atomic(args.out, result)
    print(to_markdown(result))


def format_and_errors() -> tuple[list[dict], list[dict]]:
    """The format checks (the fused backward's too, unless it fails to build) and the
    gradients' errors against float64."""
    checks = [check_format(1000, 512, 1408, bias, t) for bias in (False, True) for t in (256, 128)]
    for c in checks:
        print(c)
    try:  # a fused backward that fails to build still leaves the rest of the probe to run
        checks += [check_backward(1000, 512, 1408), check_backward(777, 256, 192)]
        print(checks[-2:])
    except Exception:
        fused_error = traceback.format_exc()
        print(fused_error)
        checks.append({"fused_backward_error": fused_error[-4000:]})
        FUSED_VARIANTS.clear()
    errors = [grad_errors(4096, 1024, 2816), grad_errors(8000, 4096, 14336)]
    for e in errors:
        print(e)
    return checks, errors


if __name__ == "__main__":
    main()
