"""Can drop_h hide its activation kernels behind its GEMMs on a second CUDA stream (issue 18)?

drop_h's activation kernels run at 96-98 % of the copy bandwidth, yet they are what puts it
over Liger and over 1.03x the floor: they move bytes while the tensor cores idle, and the GEMMs
leave HBM nearly idle. Splitting the step into row chunks makes the chain fc1 -> act -> fc2
(and grad_h -> act backward -> grad_x) a pipeline: chunk i's activation kernel can run on a
side stream while chunk i+1's GEMM runs. grad_W1 and grad_W2 reduce over rows, so they stay
whole GEMMs at the end. This probe measures, paired in random order against the six-GEMM floor,
drop_h and Liger:
  * concurrency alone: the fc1 GEMM and an activation forward on other buffers, serial and on
    two streams (side stream at high and at equal priority);
  * ``pipe[c,prio]``: drop_h's step done by hand in c row chunks with the activations on a side
    stream; ``pipe[1,serial]`` is the same code with no chunks or stream, to separate the
    by-hand step from the overlap.

    python scripts/probe_stream_overlap.py --shapes 8192,4096,14336 --out $OUT/probe.json
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from swiglu_train.bench.mlp import (
    BenchConfig,
    Case,
    available_cases,
    environment,
    floor_case,
    layer_inputs,
    shape_probe_args,
)
from swiglu_train.bench.timing import Clock, paired_fresh_calls, paired_samples, run_once
from swiglu_train.files import write_json_atomic
from swiglu_train.kernels import swiglu
from swiglu_train.ops import reference


def row_chunks(m: int, chunks: int) -> list[slice]:
    """``chunks`` row ranges, multiples of 128 rows but the last."""
    step = -(-m // chunks // 128) * 128
    return [slice(s, min(s + step, m)) for s in range(0, m, step)]


class Pipeline:
    """drop_h's step by hand over row chunks, activations on ``side`` (None: all serial)."""

    def __init__(self, x, w1, w2, grad_y, chunks: int, side: torch.cuda.Stream | None) -> None:
        self.x, self.w1, self.w2, self.grad_y = x.detach(), w1.detach(), w2.detach(), grad_y
        self.rows, self.side = row_chunks(x.shape[0], chunks), side

    def _act(self, fn, after: torch.cuda.Event) -> torch.cuda.Event:
        if self.side is None:
            fn()
            return after
        self.side.wait_event(after)
        with torch.cuda.stream(self.side):
            fn()
        done = torch.cuda.Event()
        done.record(self.side)
        return done

    def forward(self):
        x, w1, w2 = self.x, self.w1, self.w2
        m, f = x.shape[0], w2.shape[1]
        preact = x.new_empty(m, 2 * f)
        h = x.new_empty(m, f)
        y = x.new_empty(m, w2.shape[0])
        acts = []
        for i, r in enumerate(self.rows):
            torch.mm(x[r], w1.t(), out=preact[r])
            ev = torch.cuda.Event()
            ev.record()
            acts.append(self._act(lambda r=r: swiglu.swiglu_forward(preact[r], h[r]), ev))
            if i:
                self._fc2(acts[i - 1], self.rows[i - 1], h, y)
        self._fc2(acts[-1], self.rows[-1], h, y)
        return preact, y

    def _fc2(self, act_done, r, h, y) -> None:
        torch.cuda.current_stream().wait_event(act_done)
        torch.mm(h[r], self.w2.t(), out=y[r])

    def backward(self, saved) -> tuple:
        """(grad_x, grad_W1, grad_W2); preact becomes grad_preact in place."""
        preact, _ = saved
        x, w2, grad_y = self.x, self.w2, self.grad_y
        grad_h = x.new_empty(x.shape[0], w2.shape[1])
        grad_x = torch.empty_like(x)
        acts = []
        for i, r in enumerate(self.rows):
            torch.mm(grad_y[r], w2, out=grad_h[r])
            ev = torch.cuda.Event()
            ev.record()
            bwd = lambda r=r: swiglu.swiglu_backward(preact[r], grad_h[r], preact[r], grad_h[r])  # noqa: E731
            acts.append(self._act(bwd, ev))
            if i:
                self._grad_x(acts[i - 1], self.rows[i - 1], preact, grad_x)
        self._grad_x(acts[-1], self.rows[-1], preact, grad_x)
        if self.side is not None:
            torch.cuda.current_stream().wait_stream(self.side)
        return grad_x, preact.t() @ x, grad_y.t() @ grad_h  # grad_h now holds h

    def _grad_x(self, act_done, r, grad_preact, grad_x) -> None:
        torch.cuda.current_stream().wait_event(act_done)
        torch.mm(grad_preact[r], self.w1, out=grad_x[r])


def pipeline_case(name, weights, x, grad_y, chunks: int, priority: str | None) -> Case:
    side = None
    if priority is not None:
        _, high = torch.cuda.Stream.priority_range()
        side = torch.cuda.Stream(priority=high if priority == "high" else 0)
    p = Pipeline(x, weights.fc1, weights.fc2, grad_y, chunks, side)
    return Case(name, p.forward, p.backward, lambda: None)


def concurrency(m: int, d: int, f: int, samples: int, seed: int) -> dict:
    """ms of the fc1 GEMM and an activation forward (other buffers): alone, serial, and on two
    streams at high and equal side priority."""
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(m, d, device=dev, dtype=dt)
    w1 = torch.randn(2 * f, d, device=dev, dtype=dt)
    out = torch.empty(m, 2 * f, device=dev, dtype=dt)
    h = torch.empty(m, f, device=dev, dtype=dt)
    _, high = torch.cuda.Stream.priority_range()
    sides = {"high": torch.cuda.Stream(priority=high), "equal": torch.cuda.Stream(priority=0)}

    def gemm(_):
        torch.mm(x, w1.t(), out=out)

    def act(p):
        swiglu.swiglu_forward(p, h)

    def together(side):
        def call(p):
            ev = torch.cuda.Event()
            ev.record()
            side.wait_event(ev)
            torch.mm(x, w1.t(), out=out)
            with torch.cuda.stream(side):
                swiglu.swiglu_forward(p, h)
            torch.cuda.current_stream().wait_stream(side)

        return call

    calls = {
        "gemm": gemm,
        "act": act,
        "serial": lambda p: (gemm(p), act(p)),
        "streams_high": together(sides["high"]),
        "streams_equal": together(sides["equal"]),
    }
    gen = torch.Generator(device=dev).manual_seed(seed)

    def fresh():
        return (torch.randn(m, 2 * f, device=dev, dtype=dt, generator=gen),)

    for fn in calls.values():
        fn(*fresh())
    times = paired_fresh_calls(calls, fresh, samples, torch.device(dev), seed)
    return {name: float(np.median(t)) for name, t in times.items()}


VARIANTS = {
    "pipe[1,serial]": (1, None),
    "pipe[2,high]": (2, "high"),
    "pipe[4,high]": (4, "high"),
    "pipe[2,equal]": (2, "equal"),
    "pipe[4,equal]": (4, "equal"),
    "pipe[8,high]": (8, "high"),
}


def probe_shape(m: int, d: int, f: int, samples: int, seed: int) -> dict:
    torch.manual_seed(seed)
    cfg = BenchConfig(shape=(m, d, f, d), variants=("drop_h", "liger"), samples=samples)
    weights, x, grad_y = layer_inputs(cfg, 1)
    cases, skipped = available_cases(cfg.variants, weights, x, grad_y)
    cases += [pipeline_case(n, weights[0], x, grad_y, c, p) for n, (c, p) in VARIANTS.items()]
    floor = floor_case(weights[0], x, grad_y)
    errors = check(weights[0], x, grad_y)
    dev = torch.device("cuda")
    for case in [floor, *cases]:
        for _ in range(3):
            run_once(case, Clock(dev))
    times = paired_samples([floor, *cases], samples, dev, seed)
    rows = {
        c.name: {
            "full_ms": float(np.median(times[c.name]["full"])),
            "over_floor": float(np.median(times[c.name]["full"] / times["floor"]["full"])),
            "fwd_ms": float(np.median(times[c.name]["fwd"])),
            "bwd_ms": float(np.median(times[c.name]["bwd"])),
            "host_ms": float(np.median(times[c.name]["host"])),
        }
        for c in [floor, *cases]
    }
    return {
        "M": m, "D": d, "F": f, "rows": rows, "skipped": skipped, "pipe_rel_err": errors,
        "concurrency_ms": concurrency(m, d, f, samples, seed),
    }  # fmt: skip


def check(weights, x, grad_y) -> dict:
    """Relative error of each pipeline's y, grad_x, grad_W1, grad_W2 against fp32 autograd."""
    xr = x.detach().float().requires_grad_()
    w1 = weights.fc1.detach().float().requires_grad_()
    w2 = weights.fc2.detach().float().requires_grad_()
    y = reference.mlp(xr, w1, None, w2, None)
    y.backward(grad_y.float())
    errors = {}
    for name, (chunks, prio) in VARIANTS.items():
        case = pipeline_case(name, weights, x, grad_y, chunks, prio)
        saved = case.forward()
        got = case.backward(saved)
        torch.cuda.synchronize()
        pairs = zip((saved[1], *got), (y, xr.grad, w1.grad, w2.grad), strict=True)
        errors[name] = max(float((a.float() - b).norm() / b.norm()) for a, b in pairs)
    return errors


def main(argv: list[str] | None = None) -> int:
    args, shapes = shape_probe_args(__doc__, ["8192,4096,14336", "4096,4096,11008"], argv)
    result = {
        "command": "python " + " ".join(sys.argv),
        **environment(torch.device("cuda"), None),
        "samples": args.samples,
        "shapes": [probe_shape(m, d, f, args.samples, args.seed) for m, d, f in shapes],
    }
    write_json_atomic(args.out, result)
    for s in result["shapes"]:
        print(f"[{s['M']}, {s['D']}, {s['F']}] skipped {s['skipped']} err {s['pipe_rel_err']}")
        for name, r in s["rows"].items():
            print(
                f"  {name:16s} {r['over_floor']:.3f} full {r['full_ms']:.3f} fwd {r['fwd_ms']:.3f}"
                f" bwd {r['bwd_ms']:.3f} host {r['host_ms']:.3f}"
            )
        print("  concurrency ms:", s["concurrency_ms"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
