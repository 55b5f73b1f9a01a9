"""Why drop_h's in-place activation backward runs ~1.3x the same kernel out of place (issue 18).

probe_step_gap_h200.json measured, on fresh inputs each call, 0.175 ms in place against 0.131 ms
out of place at [M 4096, F 11008]. This probe splits the in-place call into its two aliasings
and tries tiles, each call on inputs no earlier call has written, paired in random order:
  inplace[tile]       the kernel with INPLACE=True (grad_preact over preact, h over grad_h);
  out_of_place[tile]  INPLACE=False into fresh buffers;
  alias_preact        INPLACE=False, grad_preact over preact, h into a fresh buffer;
  alias_h             INPLACE=False, grad_preact into a fresh buffer, h over grad_h;
  alias_both          INPLACE=False with both outputs aliased as drop_h aliases them;
  evict_first         the in-place kernel with evict_first loads (this script's copy).
Each aliased variant's result is checked against the out-of-place one on the same inputs.

    python scripts/probe_inplace_backward.py --out $OUT/probe_inplace_backward_h200.json
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch
import triton
import triton.language as tl

from swiglu_train.bench.mlp import environment
from swiglu_train.bench.timing import paired_fresh_calls
from swiglu_train.files import write_json_atomic
from swiglu_train.kernels import swiglu

TILES = ((1, 1024, 4), (1, 2048, 4), (1, 2048, 8), (1, 4096, 8), (2, 2048, 8), (1, 8192, 16))


@triton.jit
def _bwd_evict_first(
    preact_ptr, grad_h_ptr, M, F, stride_preact, stride_grad_h,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """swiglu._swiglu_bwd_kernel's in-place path with loads marked evict_first."""
    rows, cols, mask = swiglu._tile(tl.program_id(0), M, F, BLOCK_M, BLOCK_N)
    gate_ptrs = preact_ptr + rows * stride_preact + cols
    grad_h_ptrs = grad_h_ptr + rows * stride_grad_h + cols
    gate = tl.load(gate_ptrs, mask=mask, eviction_policy="evict_first").to(tl.float32)
    up = tl.load(gate_ptrs + F, mask=mask, eviction_policy="evict_first").to(tl.float32)
    grad_h = tl.load(grad_h_ptrs, mask=mask, eviction_policy="evict_first").to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-gate))
    dtype = preact_ptr.dtype.element_ty
    h = swiglu._silu_times_up(gate, up, dtype)
    tl.store(grad_h_ptrs, h.to(dtype), mask=mask)
    tl.store(gate_ptrs, (grad_h * up * sig * (1.0 + gate * (1.0 - sig))).to(dtype), mask=mask)
    tl.store(gate_ptrs + F, (grad_h * gate * sig).to(dtype), mask=mask)


def bwd(preact, grad_h, grad_preact, h, tile, inplace: bool) -> None:
    m, f = grad_h.shape
    bm, bn, warps = tile
    grid = (triton.cdiv(m, bm) * triton.cdiv(f, bn),)
    swiglu._swiglu_bwd_kernel[grid](
        preact, grad_h, grad_preact, h, m, f,
        preact.stride(0), grad_h.stride(0), grad_preact.stride(0), h.stride(0),
        WRITE_H=True, INPLACE=inplace, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps,
    )  # fmt: skip


def variants(m: int, f: int) -> dict:
    dev, dt = "cuda", torch.bfloat16
    new_pre, new_h = (
        torch.empty(m, 2 * f, device=dev, dtype=dt),
        torch.empty(m, f, device=dev, dtype=dt),
    )
    rule = swiglu.tile(m, f, swiglu.BWD_TILE)
    calls = {}
    for t in TILES:
        key = "x".join(map(str, t))
        calls[f"inplace[{key}]"] = lambda p, g, t=t: bwd(p, g, p, g, t, True)
        calls[f"out_of_place[{key}]"] = lambda p, g, t=t: bwd(p, g, new_pre, new_h, t, False)
    calls["alias_preact"] = lambda p, g: bwd(p, g, p, new_h, rule, False)
    calls["alias_h"] = lambda p, g: bwd(p, g, new_pre, g, rule, False)
    calls["alias_both"] = lambda p, g: bwd(p, g, p, g, rule, False)

    def evict(p, g):
        grid = (triton.cdiv(m, rule[0]) * triton.cdiv(f, rule[1]),)
        _bwd_evict_first[grid](
            p, g, m, f, p.stride(0), g.stride(0),
            BLOCK_M=rule[0], BLOCK_N=rule[1], num_warps=rule[2],
        )  # fmt: skip

    calls["evict_first"] = evict
    return calls, new_pre, new_h


def check(calls: dict, new_pre, new_h, m: int, f: int) -> dict:
    """Max abs difference of each variant's (grad_preact, h) from out of place, same inputs."""
    p0 = torch.randn(m, 2 * f, device="cuda", dtype=torch.bfloat16)
    g0 = torch.randn(m, f, device="cuda", dtype=torch.bfloat16)
    bwd(p0, g0, new_pre, new_h, swiglu.tile(m, f, swiglu.BWD_TILE), False)
    want_pre, want_h = new_pre.clone(), new_h.clone()
    diffs = {}
    for name, fn in calls.items():
        p, g = p0.clone(), g0.clone()
        fn(p, g)
        got_pre = (
            p if name.startswith(("inplace", "alias_preact", "alias_both", "evict")) else new_pre
        )
        got_h = g if name.startswith(("inplace", "alias_h", "alias_both", "evict")) else new_h
        diffs[name] = max(
            (got_pre.float() - want_pre.float()).abs().max().item(),
            (got_h.float() - want_h.float()).abs().max().item(),
        )
    return diffs


def probe(m: int, f: int, samples: int, seed: int) -> dict:
    calls, new_pre, new_h = variants(m, f)
    diffs = check(calls, new_pre, new_h, m, f)
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def fresh() -> tuple:
        return (
            torch.randn(m, 2 * f, device="cuda", dtype=torch.bfloat16, generator=gen),
            torch.randn(m, f, device="cuda", dtype=torch.bfloat16, generator=gen),
        )

    times = paired_fresh_calls(calls, fresh, samples, torch.device("cuda"), seed)
    moved = 6 * m * f * 2
    return {
        "M": m, "F": f, "rule_tile": list(swiglu.tile(m, f, swiglu.BWD_TILE)),
        "variants": {
            n: {"ms": float(np.median(t)), "GBps": moved / float(np.median(t)) / 1e6,
                "max_abs_diff_vs_out_of_place": diffs[n]}
            for n, t in times.items()
        },
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["4096,11008", "8192,14336", "8000,11008"])
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes]
    result = {
        "command": "python " + " ".join(sys.argv),
        **environment(torch.device("cuda"), None),
        "shapes": [probe(m, f, args.samples, args.seed) for m, f in shapes],
    }
    write_json_atomic(args.out, result)
    for s in result["shapes"]:
        print(f"M {s['M']} F {s['F']} rule {s['rule_tile']}")
        for n, v in sorted(s["variants"].items(), key=lambda kv: kv[1]["ms"]):
            print(
                f"  {n:24s} {v['ms']:.4f} ms {v['GBps']:.0f} GB/s"
                f" diff {v['max_abs_diff_vs_out_of_place']:.3g}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
