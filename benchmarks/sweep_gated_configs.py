"""Every config of the gated GEMM at inference shapes, timed as the inference bench times
(CUDA graphs over weight copies that overflow L2, paired samples in random order, per-call
medians), against the cuBLAS fc1 GEMM alone and the autotuner's own pick.

    python benchmarks/sweep_gated_configs.py [--shapes M,K,F ...] [--extra-tiles BM,BN,BK,S,W,P ...]
        [--samples 30] --json OUT.json [--md OUT.md]

The autotuner times candidates one launch at a time with a cold L2, which at 5-10 us kernels
is mostly launch and flush; this shows what each config costs where the dispatch table is
judged. ``--extra-tiles`` adds candidates outside the kernel's list (BLOCK_M, BLOCK_N,
BLOCK_K, stages, warps, persistent 0/1), so a tile can be tried before it joins the list.
Pinning is off while the sweep runs; ``fit_gated_tile_rule.py`` judges the kernel's tile rule
(``swiglu_train.kernels.gated_tiles``) on the result.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
import triton

from swiglu_train.bench.inference.run import (
    QWEN_MLP,
    call_ms,
    capture,
    choose_reps,
    rel_err,
    weight_copies,
)
from swiglu_train.bench.results import write_probe_result
from swiglu_train.bench.timing import Case, paired_samples
from swiglu_train.kernels import gated_autotune, gated_gemm, gated_kernels, gated_tiles
from swiglu_train.kernels.runtime import m_bucket
from swiglu_train.ops import reference

REL_ERR_LIMIT = 1e-2  # bf16: a few roundings of h
SMALL_QWEN = [f"{m},{k},{f}" for k, f in QWEN_MLP.values() for m in (1, 16, 128)]


def extra_config(spec: str) -> triton.Config:
    bm, bn, bk, stages, warps, persistent = map(int, spec.split(","))
    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "PERSISTENT": bool(persistent)},
        num_stages=stages,
        num_warps=warps,
        pre_hook=gated_autotune.set_block_shapes,
    )


def tile(c: triton.Config) -> dict:
    """The config's tile, recorded with each row."""
    blocks = {k: c.kwargs[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "PERSISTENT")}
    return blocks | {"num_stages": c.num_stages, "num_warps": c.num_warps}


def label(c: triton.Config) -> str:
    k = c.kwargs
    tail = "p" if k["PERSISTENT"] else ""
    return f"{k['BLOCK_M']}x{k['BLOCK_N']}x{k['BLOCK_K']}s{c.num_stages}w{c.num_warps}{tail}"


def candidates(m: int, f: int, weight: torch.Tensor, extra: list[triton.Config]) -> list:
    """The kernel's own pruning of its list plus the extra tiles, for this shape."""
    named = {"F": f, "b_ptr": weight, "M_BUCKET": m_bucket(m)}
    return gated_autotune.prune_configs(gated_autotune.autotune_configs() + extra, named, CHUNK=f)


def measure(m: int, k: int, f: int, samples: int, seed: int, extra: list) -> dict:
    device = torch.device("cuda")
    copies = weight_copies(k, f, torch.bfloat16, device)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    expected = reference.swiglu(torch.nn.functional.linear(x.double(), copies[0].fc1.double()))
    kernel = gated_kernels._gated_gemm_kernel
    own = list(kernel.configs)

    def gated(i: int) -> torch.Tensor:
        return gated_gemm.gated_gemm(x, copies[i % len(copies)].fc1, None, chunk=f)[0]

    calls = {"cublas_fc1": lambda i: torch.nn.functional.linear(x, copies[i % len(copies)].fc1)}
    reps = choose_reps(call_ms(lambda: calls["cublas_fc1"](0), device), len(copies))
    replays, errors, tiles = {}, {}, {}
    try:
        for config in candidates(m, f, copies[0].fc1, extra):
            kernel.configs = [config]  # one config: the autotuner launches it as is
            errors[label(config)] = rel_err(gated(0), expected)
            replays[label(config)] = capture(gated, reps, device)
            tiles[label(config)] = tile(config)
    finally:
        kernel.configs = own
    kernel.cache.clear()
    errors["autotuned"] = rel_err(gated(0), expected)
    picked = label(kernel.best_config)
    replays["autotuned"] = capture(gated, reps, device)
    replays["cublas_fc1"] = capture(calls["cublas_fc1"], reps, device)
    bad = {n: e for n, e in errors.items() if not e <= REL_ERR_LIMIT}
    if bad:
        raise AssertionError(f"M={m} K={k} F={f}: wrong h under {bad}")
    cases = [Case(n, r, lambda _: None, lambda: None) for n, r in replays.items()]
    times = paired_samples(cases, samples, device, seed)
    base = times["cublas_fc1"]["fwd"]
    over = {n: float(np.median(t["fwd"] / base)) for n, t in times.items() if n != "cublas_fc1"}
    ms = {n: float(np.median(t["fwd"])) / reps for n, t in times.items()}
    configs = {n: r for n, r in over.items() if n != "autotuned"}
    best = min(configs, key=configs.get)
    return {
        "M": m, "K": k, "F": f, "ms": ms, "over_gemm_only": over, "autotuned": picked,
        "best": best, "autotuned_over_best": over["autotuned"] / over[best], "reps": reps,
        "tiles": tiles,
    }  # fmt: skip


def to_markdown(result: dict) -> str:
    lines = [f"### gated GEMM configs ÷ cuBLAS fc1 alone ({result['gpu']}, {result['commit']})"]
    for r in result["rows"]:
        lines += ["", f"M={r['M']} K={r['K']} F={r['F']}: cuBLAS {r['ms']['cublas_fc1']:.5f} ms, "
                  f"autotuner picked {r['autotuned']} ({r['over_gemm_only']['autotuned']:.3f})",
                  "", "| config | ms | ÷ gemm_only |", "|---|---|---|"]  # fmt: skip
        for n, ratio in sorted(r["over_gemm_only"].items(), key=lambda kv: kv[1]):
            lines.append(f"| {n} | {r['ms'][n]:.5f} | {ratio:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", default=SMALL_QWEN, help="M,K,F triples")
    parser.add_argument("--extra-tiles", nargs="*", default=[], help="BM,BN,BK,stages,warps,p")
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--commit")
    parser.add_argument("--json", required=True)
    parser.add_argument("--md")
    args = parser.parse_args()
    extra = [extra_config(s) for s in args.extra_tiles]
    rows = []
    for shape in args.shapes:
        with gated_tiles.autotune_only():  # the configs as given, and the autotuner's own
            rows.append(measure(*map(int, shape.split(",")), args.samples, args.seed, extra))
        r = rows[-1]
        print(f"M={r['M']} K={r['K']} F={r['F']}: best {r['best']} "
              f"{r['over_gemm_only'][r['best']]:.3f}, autotuned {r['autotuned']} "
              f"{r['over_gemm_only']['autotuned']:.3f}", flush=True)  # fmt: skip
    write_probe_result(
        f"benchmarks/{Path(__file__).name}",
        rows,
        args.samples,
        args.commit,
        args.json,
        args.md,
        to_markdown,
    )


if __name__ == "__main__":
    main()
