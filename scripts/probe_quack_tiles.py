"""quack's gated projection at up to 512 rows, under its SM90 default and under each N-clustered
tile, against the cuBLAS fc1 GEMM alone: does the wave-fill rule (`quack_mlp.small_m_tile_n`)
pick the fastest config? Timed as the inference bench times (CUDA graphs over weight copies
that overflow L2, paired samples in random order, per-call medians).

    python scripts/probe_quack_tiles.py [--models 0.5b,7b,32b,72b] [--m 128,256,384,512]
        [--extra-tiles 64,96] [--samples 30] --json OUT.json [--md OUT.md]

``--extra-tiles`` adds N tiles outside the rule's set (quack's SM90 space stops at 128): a
candidate that quack cannot compile or that computes a wrong h is listed as unsupported,
not timed. Whether one beats the rule's pick shows in ``rule ÷ best``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from swiglu_train.bench.inference import (
    QWEN_MLP,
    call_ms,
    capture,
    choose_reps,
    parse_model,
    rel_err,
    weight_copies,
)
from swiglu_train.bench.mlp import write_probe_result
from swiglu_train.bench.timing import Case, paired_samples
from swiglu_train.ops import reference
from swiglu_train.ops.quack_mlp import (
    SMALL_M_TILES_N,
    n_clustered_config,
    quack_gated_h,
    small_m_tile_n,
)

REL_ERR_LIMIT = 1e-2  # bf16: a few roundings of h


def configs(extra: tuple[int, ...] = ()) -> dict[str, object | None]:
    """Every config the rule can pick, by the name the rows use ("default": quack's own),
    then the extra N tiles."""
    tiles = SMALL_M_TILES_N + tuple(n for n in extra if n not in SMALL_M_TILES_N)
    return {"default": None} | {f"n{n}": n_clustered_config(n) for n in tiles}


def measure(model: str, m: int, samples: int, seed: int, extra: tuple[int, ...] = ()) -> dict:
    d, f = parse_model(model)
    device = torch.device("cuda")
    copies = weight_copies(d, f, torch.bfloat16, device)
    x = torch.randn(m, d, device=device, dtype=torch.bfloat16)
    expected = reference.swiglu(F.linear(x.double(), copies[0].fc1.double()))
    calls = {"cublas_fc1": lambda i: F.linear(x, copies[i % len(copies)].fc1)}
    unsupported = {}
    for name, config in configs(extra).items():
        tile = None if name == "default" else int(name[1:])
        candidate = tile in extra and tile not in SMALL_M_TILES_N  # the rule's own must work
        try:
            h = quack_gated_h(x, copies[0].fc1, None, False, config)
            error = rel_err(h, expected)
        except Exception as e:  # an extra tile quack cannot build: reported, not timed
            if not candidate:
                raise
            unsupported[name] = f"{type(e).__name__}: {e}"[:300]
            continue
        if not error <= REL_ERR_LIMIT:
            if not candidate:
                raise AssertionError(f"{model} M={m} {name}: rel err {error:.3g}")
            unsupported[name] = f"rel err {error:.3g}"
            continue
        calls[name] = lambda i, c=config: quack_gated_h(
            x, copies[i % len(copies)].fc1, None, False, c
        )
    reps = choose_reps(call_ms(lambda: calls["cublas_fc1"](0), device), len(copies))
    replays = {name: capture(call, reps, device) for name, call in calls.items()}
    cases = [Case(name, replay, lambda _: None, lambda: None) for name, replay in replays.items()]
    times = paired_samples(cases, samples, device, seed)
    base = times["cublas_fc1"]["fwd"]
    ms = {n: float(np.median(t["fwd"])) / reps for n, t in times.items()}
    over_gemm = {
        n: float(np.median(t["fwd"] / base)) for n, t in times.items() if n != "cublas_fc1"
    }
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    tile_n = small_m_tile_n(m, 2 * f, sms)
    rule = "default" if tile_n is None else f"n{tile_n}"
    best = min(over_gemm, key=over_gemm.get)
    return {
        "model": model, "M": m, "K": d, "F": f, "ms": ms, "over_gemm_only": over_gemm,
        "rule": rule, "best": best, "rule_over_best": over_gemm[rule] / over_gemm[best],
        "default_over_rule": over_gemm["default"] / over_gemm[rule], "unsupported": unsupported,
    }  # fmt: skip


def to_markdown(result: dict) -> str:
    rows = result["rows"]
    names = list(dict.fromkeys(n for r in rows for n in (*r["over_gemm_only"], *r["unsupported"])))
    head = "| model | M | " + " | ".join(names) + " | rule | best | rule ÷ best |"
    lines = [
        f"### quack gated projection ÷ cuBLAS fc1 GEMM alone ({result['gpu']}, {result['commit']})",
        "",
        head,
        "|" + "---|" * (len(names) + 5),
    ]
    for r in rows:
        cells = " | ".join(_ratio(r["over_gemm_only"].get(n)) for n in names)
        lines.append(
            f"| {r['model']} | {r['M']} | {cells} | {r['rule']} | {r['best']} "
            f"| {r['rule_over_best']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"  # "—": quack could not run that tile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(QWEN_MLP))
    parser.add_argument("--m", default="128,256,384,512")
    parser.add_argument("--extra-tiles", default="", help="N tiles beyond the rule's, e.g. 64,96")
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--commit")
    parser.add_argument("--json", required=True)
    parser.add_argument("--md")
    args = parser.parse_args()
    extra = tuple(int(n) for n in args.extra_tiles.split(",") if n)
    rows = []
    for model in args.models.split(","):
        for m in map(int, args.m.split(",")):
            rows.append(measure(model, m, args.samples, args.seed, extra))
            r = rows[-1]
            print(f"{model:5s} M={m:4d} rule {r['rule']:8s} best {r['best']:8s} "
                  f"rule/best {r['rule_over_best']:.3f} default/rule {r['default_over_rule']:.3f}",
                  flush=True)  # fmt: skip
    write_probe_result(
        f"scripts/{Path(__file__).name}",
        rows,
        args.samples,
        args.commit,
        args.json,
        args.md,
        to_markdown,
    )


if __name__ == "__main__":
    main()
