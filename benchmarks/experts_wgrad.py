"""drop_h's fc1 weight gradient, gathered inside a Triton GEMM against gathered first, paired.

At each MoE model's expert shape and routing (T tokens, bf16), three calls make the same
grad_W1 [E, 2F, D] from grad_preact [R, 2F] and x [T, D] (R = T·k rows sorted by expert):

  gather+grouped_mm   drop_h's default: x's rows gathered to [R, D], then torch's grouped GEMM
                      (the [R, D] buffer is live beside both weight gradients at the peak);
  gathered_triton     ``kernels.experts_wgrad``: the rows read through the token index inside
                      the GEMM, nothing gathered (drop_h with ``gathered_wgrad=True``);
  grouped_mm          the floor: torch's grouped GEMM alone on rows gathered outside the timing.

Each sample times every call once in a fresh random order (CUDA events around each, the GPU
synchronized between), over --samples samples; the medians and each call's ratio to the floor
go to the JSON and markdown with the command, commit and GPU. ``extra MiB`` is what each call
allocates beyond its output (the gathered rows for the first).

    python benchmarks/experts_wgrad.py --json OUT.json [--md OUT.md] [--models a,b] [--tokens T]
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch

from swiglu_train.bench.moe.routing import ROUTINGS, make_routing
from swiglu_train.bench.moe.shapes import DEFAULT_MODELS, select_models
from swiglu_train.bench.results import write_probe_result
from swiglu_train.kernels.experts_wgrad import gathered_weight_grad
from swiglu_train.ops.experts_routing import grouped_weight_grad, route

CALLS = ("gather+grouped_mm", "gathered_triton", "grouped_mm")
FLOOR = "grouped_mm"


def operands(shape, routing: str, tokens: int, device: torch.device) -> dict:
    """The call's tensors at one point: grad_preact, x, the plan's token index and offsets."""
    indices, weights = make_routing(routing, tokens, shape.e, shape.k, seed=0, device=device)
    plan = route(indices, weights, shape.e)
    rows = tokens * shape.k
    grad_preact = torch.randn(rows, 2 * shape.f, device=device, dtype=torch.bfloat16)
    x = torch.randn(tokens, shape.d, device=device, dtype=torch.bfloat16)
    return {"grad_preact": grad_preact, "x": x, "plan": plan, "xg": x.index_select(0, plan.token)}


def calls(ops: dict) -> dict:
    grad_preact, x, plan, xg = ops["grad_preact"], ops["x"], ops["plan"], ops["xg"]
    return {
        "gather+grouped_mm": lambda: grouped_weight_grad(
            grad_preact, x.index_select(0, plan.token), plan.offsets
        ),
        "gathered_triton": lambda: gathered_weight_grad(grad_preact, x, plan.token, plan.offsets),
        "grouped_mm": lambda: grouped_weight_grad(grad_preact, xg, plan.offsets),
    }


def extra_mib(fn, out_bytes: int) -> float:
    """MiB the call's peak allocates beyond its output."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    del out
    return (torch.cuda.max_memory_allocated() - base - out_bytes) / 2**20


def time_point(fns: dict, samples: int, seed: int) -> dict[str, list[float]]:
    """Milliseconds of each call per sample, the calls in a fresh random order each sample."""
    rng, names = np.random.default_rng(seed), list(fns)
    times = {name: [] for name in names}
    for fn in fns.values():  # compile, autotune, warm the allocator
        fn()
    for _ in range(samples):
        for i in rng.permutation(len(names)):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fns[names[i]]()
            end.record()
            end.synchronize()
            times[names[i]].append(start.elapsed_time(end))
    return times


def measure(models: list[str], tokens: int, samples: int) -> list[dict]:
    device, rows = torch.device("cuda"), []
    for shape in select_models(models):
        for routing in ROUTINGS:
            ops = operands(shape, routing, tokens, device)
            fns = calls(ops)
            out_bytes = shape.e * 2 * shape.f * shape.d * 2
            reference = fns[FLOOR]().float()
            error = (fns["gathered_triton"]().float() - reference).norm() / reference.norm()
            times = time_point(fns, samples, seed=len(rows))
            medians = {name: statistics.median(t) for name, t in times.items()}
            for name in CALLS:
                rows.append({
                    "model": shape.name, "D": shape.d, "F": shape.f, "E": shape.e, "k": shape.k,
                    "T": tokens, "routing": routing, "call": name, "ms": medians[name],
                    "over_floor": medians[name] / medians[FLOOR],
                    "extra_MiB": extra_mib(fns[name], out_bytes),
                    "rel_err_vs_floor": float(error) if name == "gathered_triton" else 0.0,
                })  # fmt: skip
                print(f"[{shape.name} {routing}] {name}: {medians[name]:.3f} ms", flush=True)
            del ops, fns, reference
            torch.cuda.empty_cache()
    return rows


def to_markdown(result: dict) -> str:
    lines = [
        f"fc1 weight gradient of the routed experts on {result['gpu']}, commit "
        f"{result['commit']}, {result['samples']} paired samples (medians).",
        "",
        "| model | routing | call | ms | ÷ floor | extra MiB | rel err |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['model']} | {r['routing']} | {r['call']} | {r['ms']:.3f} | "
            f"{r['over_floor']:.3f} | {r['extra_MiB']:.0f} | {r['rel_err_vs_floor']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--md")
    parser.add_argument("--models", default=",".join(m for m in DEFAULT_MODELS[:5]))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--commit")
    args = parser.parse_args()
    rows = measure(args.models.split(","), args.tokens, args.samples)
    write_probe_result(
        "benchmarks/experts_wgrad.py", rows, args.samples, args.commit, args.json, args.md,
        to_markdown,
    )  # fmt: skip


if __name__ == "__main__":
    main()
