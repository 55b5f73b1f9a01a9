"""Probe: the gated GEMM with Triton's Hopper warp specialization vs its current configs.

    python3 scripts/probe_gated_ws.py --json OUT.json

Each config runs in its own subprocess with a timeout (a warp-specialized kernel that
deadlocks must not take the session with it) and is checked against cuBLAS fc1 + activation.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

SHAPES = [  # (M, K, F, aux, chunk-or-0 for canonical)
    (11136, 3584, 14336, "none", 128),
    (11136, 3584, 14336, "factors", 128),
    (11136, 3584, 14336, "preact", 0),
    (4096, 3584, 18944, "none", 0),
    (512, 3584, 18944, "none", 0),
    (2048, 896, 4864, "none", 0),
    (512, 8192, 29568, "none", 0),
]
CONFIGS = [  # BLOCK_M, BLOCK_N, BLOCK_K, stages, warps, persistent, ws
    (128, 128, 64, 3, 8, False, False),
    (64, 128, 64, 3, 4, True, True),
    (64, 128, 64, 4, 4, True, True),
    (64, 128, 128, 2, 4, True, True),
    (64, 64, 64, 4, 4, True, True),
    (64, 64, 128, 3, 4, True, True),
    (64, 128, 64, 3, 4, False, True),
]


def worker(cfg: tuple) -> None:
    for shape in SHAPES:
        print(json.dumps(probe_shape(cfg, *shape)), flush=True)


def probe_shape(cfg: tuple, m: int, k: int, f: int, aux: str, chunk: int) -> dict:
    import torch
    import torch.nn.functional as F
    import triton
    from triton.tools.tensor_descriptor import TensorDescriptor

    from swiglu_train.kernels import gated_gemm as g
    from swiglu_train.layers.layout import CANONICAL, Layout, order
    from swiglu_train.ops.activation import swiglu_fwd

    bm, bn, bk, stages, warps, persistent, ws = cfg
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(2 * f, k, device="cuda") / k**0.5).to(torch.bfloat16)
    c = chunk or f
    wp = w if c == f else w[order(2 * f, CANONICAL, Layout("packed", c)).cuda()].contiguous()
    h = x.new_empty(m, f)
    a = x.new_empty(m, 2 * f)
    outs = (h, h, h) if aux == "none" else (h, a, a)
    if aux != "none" and c == f:
        outs = (h, a[:, :f], a[:, f:])
    wide = c == bn and not ws
    boxes = [[bm, bk], [2 * bn if wide else bn, bk], [bm, bn], [bm, bn], [bm, bn]]
    descs = [TensorDescriptor.from_tensor(t, b) for t, b in zip((x, wp, *outs), boxes, strict=True)]
    tiles = triton.cdiv(m, bm) * triton.cdiv(f, bn)
    grid = (min(tiles, g._num_sms(0)) if persistent else tiles,)

    def run() -> None:
        g._gated_gemm_kernel.fn[grid](
            *descs[:2], wp, *descs[2:], m, k, f, x.stride(0), wp.stride(0), h.stride(0),
            a.stride(0), g.m_bucket(m), HAS_BIAS=False, AUX=g.AUX_KINDS[aux], CHUNK=c,
            USE_TMA=True, UPCAST=False, IEEE=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            GROUP_M=8, PERSISTENT=persistent, WARP_SPECIALIZE=ws, num_warps=warps,
            num_stages=stages,
        )  # fmt: skip

    row = {"M": m, "K": k, "F": f, "aux": aux, "chunk": c, "config": cfg}
    try:
        run()
        torch.cuda.synchronize()
    except Exception as e:  # a probe reports every failure and moves on
        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        return row
    expected = swiglu_fwd(F.linear(x, w)).float()
    row["rel_err"] = ((h.float() - expected).norm() / expected.norm()).item()
    row["ms"] = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")
    row["cublas_fc1_ms"] = triton.testing.do_bench(
        lambda: F.linear(x, w), warmup=25, rep=100, return_mode="median"
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help="one config, as JSON (internal)")
    parser.add_argument("--json", default="probe_ws.json")
    parser.add_argument("--timeout", type=int, default=150)
    args = parser.parse_args()
    if args.worker:
        worker(tuple(json.loads(args.worker)))
        return
    rows = []
    for cfg in CONFIGS:
        cmd = [sys.executable, __file__, "--worker", json.dumps(cfg)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            out, err = done.stdout, done.stderr
        except subprocess.TimeoutExpired as e:
            out, err = (e.stdout or b"").decode(), f"timeout after {args.timeout} s"
        got = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        rows += got
        for r in got:
            print(r, flush=True)
        if len(got) < len(SHAPES):
            print(f"config {cfg}: {len(got)}/{len(SHAPES)} shapes; stderr tail:\n{err[-1500:]}")
            rows.append({"config": cfg, "incomplete": err[-1500:]})
    with open(args.json, "w") as fh:
        json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
