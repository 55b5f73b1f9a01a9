"""Where a variant's step time over the six-GEMM floor goes (issue 18), on the GPU.

For each [M, D, F] shape and variant (the floor first) it measures, paired and in random order:
  * the step timed two ways: queued (behind a spin kernel, as ``bench`` now times) and idle
    (the first event recorded on an idle GPU, as ``bench`` timed before), with the host's time
    to queue the step: their difference is host latency a training step would hide;
  * a torch.profiler breakdown of one step into its kernels (mean µs per step by kernel name)
    and the GPU's idle gaps inside the step;
and, per shape, the activation kernels alone on fresh inputs each call: drop_h's backward in
place (grad_preact over preact, h over grad_h, the call drop_h makes) against the same kernel
out of place, and Liger's in-place backward, so no sample runs on inputs an earlier one wrote.

    python scripts/probe_step_gap.py --shapes 4096,4096,11008 8192,4096,14336 --samples 30 \
        --out $OUT/probe_step_gap_h200.json
"""

from __future__ import annotations

import collections
import json
import sys

import numpy as np
import torch

from swiglu_train.bench.mlp import (
    BenchConfig,
    available_cases,
    environment,
    floor_case,
    layer_inputs,
    shape_probe_args,
)
from swiglu_train.bench.timing import (
    Clock,
    kernel_timeline,
    paired_fresh_calls,
    paired_samples,
    run_once,
)
from swiglu_train.files import write_json_atomic
from swiglu_train.kernels import swiglu

VARIANTS = ("normal", "drop_h", "save_factors", "drop_h_quack", "save_factors_quack")
PEERS = ("liger", "quack")


def kernel_breakdown(case, steps: int = 5) -> dict:
    """Mean µs per step of each kernel, its launches in a step summed, and the kernels' sum
    (the GPU's busy time)."""
    per_kernel: dict[str, float] = collections.defaultdict(float)
    for kernel in kernel_timeline(case, steps):
        per_kernel[kernel["name"]] += kernel["us"]
    busy = sum(per_kernel.values())
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])
    return {"busy_us": busy, "kernels": [{"name": n, "us": round(us, 1)} for n, us in top]}


def fresh_input_kernels(m: int, f: int, samples: int, seed: int) -> dict:
    """Median ms of each activation-backward call, each sample on inputs no call has written."""
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(seed)

    def pair():
        return (
            torch.randn(m, 2 * f, device=dev, dtype=dt, generator=g),
            torch.randn(m, f, device=dev, dtype=dt, generator=g),
        )

    out_preact = torch.empty(m, 2 * f, device=dev, dtype=dt)
    out_h = torch.empty(m, f, device=dev, dtype=dt)
    calls = {
        "ours_inplace": lambda p, gh: swiglu.swiglu_backward(p, gh, p, gh),
        "ours_out_of_place": lambda p, gh: swiglu.swiglu_backward(p, gh, out_preact, out_h),
        "ours_forward": lambda p, gh: swiglu.swiglu_forward(p, gh),
    }
    try:
        from liger_kernel.ops.swiglu import swiglu_fused_gate_up_backward

        calls["liger_inplace"] = lambda p, gh: swiglu_fused_gate_up_backward(p, gh, in_place=True)
    except ImportError:
        pass
    for fn in calls.values():  # compile
        fn(*pair())
    times = paired_fresh_calls(calls, pair, samples, torch.device("cuda"), seed)
    el = 2
    moved = {"ours_inplace": 6, "ours_out_of_place": 6, "ours_forward": 3, "liger_inplace": 5}
    return {
        name: {
            "ms": float(np.median(t)),
            "GBps": moved[name] * m * f * el / float(np.median(t)) / 1e6,
        }
        for name, t in times.items()
    }


def probe_shape(m: int, d: int, f: int, variants: list[str], samples: int, seed: int) -> dict:
    torch.manual_seed(seed)
    cfg = BenchConfig(shape=(m, d, f, d), variants=variants, samples=samples)
    weights, x, grad_y = layer_inputs(cfg, 1)
    cases, skipped = available_cases(variants, weights, x, grad_y)
    floor = floor_case(weights[0], x, grad_y)
    working = [floor]
    for case in cases:
        try:
            for _ in range(3):
                run_once(case, Clock(torch.device("cuda")))
            working.append(case)
        except Exception as e:  # a broken peer is reported, not allowed to sink the probe
            skipped[case.name] = f"failed: {type(e).__name__}: {e}"
    for _ in range(3):
        run_once(floor, Clock(torch.device("cuda")))
    dev = torch.device("cuda")
    queued = paired_samples(working, samples, dev, seed, queued=True)
    idle = paired_samples(working, samples, dev, seed + 1, queued=False)
    rows = {}
    for case in working:
        q, i = queued[case.name], idle[case.name]
        rows[case.name] = {
            "queued_full_ms": float(np.median(q["full"])),
            "queued_over_floor": float(np.median(q["full"] / queued["floor"]["full"])),
            "queued_fwd_ms": float(np.median(q["fwd"])),
            "queued_bwd_ms": float(np.median(q["bwd"])),
            "idle_full_ms": float(np.median(i["full"])),
            "idle_over_floor": float(np.median(i["full"] / idle["floor"]["full"])),
            "idle_fwd_ms": float(np.median(i["fwd"])),
            "host_ms": float(np.median(q["host"])),
            "profile": kernel_breakdown(case),
        }
    return {
        "M": m, "D": d, "F": f, "variants": rows, "skipped": skipped,
        "activation_kernels_fresh_inputs": fresh_input_kernels(m, f, samples, seed),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    more = {"--variants": {"default": ",".join(VARIANTS + PEERS)}}
    args, shapes = shape_probe_args(__doc__, ["4096,4096,11008", "8192,4096,14336"], argv, **more)
    variants = args.variants.split(",")
    result = {
        "command": "python " + " ".join(sys.argv),
        **environment(torch.device("cuda"), None),
        "samples": args.samples,
        "shapes": [probe_shape(m, d, f, variants, args.samples, args.seed) for m, d, f in shapes],
    }
    write_json_atomic(args.out, result)
    for s in result["shapes"]:
        print(f"[{s['M']}, {s['D']}, {s['F']}] skipped: {s['skipped']}")
        for name, r in s["variants"].items():
            top = ", ".join(f"{k['name'][:40]} {k['us']}" for k in r["profile"]["kernels"][:6])
            print(
                f"  {name:20s} queued {r['queued_over_floor']:.3f} idle {r['idle_over_floor']:.3f}"
                f" host {r['host_ms']:.3f} ms busy {r['profile']['busy_us']:.0f} us | {top}"
            )
        print("  fresh-input kernels:", json.dumps(s["activation_kernels_fresh_inputs"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
