"""The report of ``sweep_moe_gemm_configs.py``: one GEMM's timings at one point as JSON rows,
the best config per (model, routing, GEMM) read off them, and the markdown and progress lines
made from that. Kept apart from the timing so that the files the rule is fitted from (and the
tables the docs cite) are built, and tested on CPU, from rows alone.

Ratios are medians of per-sample ratios (``over_torch``, ``over_default``); a config that failed
to run or to match the default keeps its row, with ``failed`` its reason and no time.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, fields

import numpy as np
from moe_gemm_candidates import GATHERED, VARLEN_K, Config, GemmOperands, Point, output_tiles

FIELDS = tuple(f.name for f in fields(Config))


def rows_of(
    p: Point, op: GemmOperands, times: dict, errors: dict, failed: dict, default: Config
) -> list[dict]:
    """The JSON rows of one GEMM at one point: torch, the default, each candidate."""
    sizes, (m, n, k) = p.rows_per_expert, op.mnk
    base = {
        "model": p.shape.name, "routing": p.routing, "D": p.shape.d, "F": p.shape.f,
        "E": p.shape.e, "k": p.shape.k, "gemm": op.name, "M": m, "N": n, "K": k,
        "varlen": "k" if op.name in VARLEN_K else "m", "gathered": op.name in GATHERED,
        "rows_per_expert": {"min": min(sizes), "median": float(np.median(sizes)),
                            "mean": float(np.mean(sizes)), "max": max(sizes),
                            "empty": sizes.count(0)},
    }  # fmt: skip
    out = []
    for name in [*times, *failed]:
        c = None if name == "torch" else default if name == "default" else Config.parse(name)
        row = base | {"config": name} | (asdict(c) if c else dict.fromkeys(FIELDS))
        row["tiles"] = output_tiles(op.name, sizes, m, n, c) if c else None
        t = times.get(name)
        row |= {
            "ms": None if t is None else float(np.median(t)),
            "over_torch": None if t is None else float(np.median(t / times["torch"])),
            "over_default": None if t is None else float(np.median(t / times["default"])),
            "rel_err": errors.get(name), "exact": errors.get(name) == 0.0,
            "failed": failed.get(name),
        }  # fmt: skip
        out.append(row)
    return out


def summarize(rows: Sequence[dict]) -> list[dict]:
    """Per (model, routing, gemm), in run order: its torch and default rows, the quack row
    (default included) with the lowest paired ratio to the default, and its failures."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["routing"], r["gemm"]), []).append(r)
    out = []
    for group in groups.values():
        timed = {r["config"]: r for r in group if r["failed"] is None}
        quack = [r for name, r in timed.items() if name != "torch"]
        out.append({"torch": timed["torch"], "default": timed["default"],
                    "best": min(quack, key=lambda r: r["over_default"]),
                    "failed": [r for r in group if r["failed"] is not None]})  # fmt: skip
    return out


def kind_table(groups: Sequence[dict]) -> list[str]:
    """Per GEMM kind, over the points: the default's and the best config's ratios."""
    lines = ["| gemm | points | default ÷ torch | best ÷ default (median, min) | best ÷ torch | "
             "best config most often |", "|---|---|---|---|---|---|"]  # fmt: skip
    for gemm in dict.fromkeys(g["best"]["gemm"] for g in groups):
        mine = [g for g in groups if g["best"]["gemm"] == gemm]
        best = [g["best"]["over_default"] for g in mine]
        ((label, times),) = Counter(g["best"]["config"] for g in mine).most_common(1)
        lines.append(
            f"| {gemm} | {len(mine)} | {np.median([g['default']['over_torch'] for g in mine]):.3f}"
            f" | {np.median(best):.3f} ({min(best):.3f}) | "
            f"{np.median([g['best']['over_torch'] for g in mine]):.3f} | {label} ({times}) |"
        )
    return lines


def point_tables(groups: Sequence[dict]) -> list[str]:
    """The six GEMMs' sums per point, then each point's GEMMs."""
    points: dict[tuple, list[dict]] = {}
    for g in groups:
        points.setdefault((g["best"]["model"], g["best"]["routing"]), []).append(g)
    lines = ["The GEMMs of each point (sums of median ms):", "",
             "| model | routing | torch ms | default ÷ torch | best per GEMM ÷ torch |",
             "|---|---|---|---|---|"]  # fmt: skip
    for (model, routing), mine in points.items():
        torch_ms, default_ms, best_ms = (sum(g[k]["ms"] for g in mine)
                                         for k in ("torch", "default", "best"))  # fmt: skip
        lines.append(f"| {model} | {routing} | {torch_ms:.3f} | {default_ms / torch_ms:.3f} | "
                     f"{best_ms / torch_ms:.3f} |")  # fmt: skip
    for (model, routing), mine in points.items():
        s = mine[0]["torch"]["rows_per_expert"]
        lines += ["", f"#### {model}, {routing}: rows per expert {s['min']} / {s['median']:.0f} / "
                  f"{s['max']} (min / median / max), {s['empty']} empty", "",
                  "| gemm | MxNxK | torch ms | default ms | ÷ torch | best | best ms | "
                  "÷ default | ÷ torch | failed |",
                  "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for g in mine:
            t, d, b = g["torch"], g["default"], g["best"]
            lines.append(
                f"| {t['gemm']} | {t['M']}x{t['N']}x{t['K']} | {t['ms']:.3f} | {d['ms']:.3f} "
                f"| {d['over_torch']:.3f} | {b['config']} | {b['ms']:.3f} | "
                f"{b['over_default']:.3f} | {b['over_torch']:.3f} | {len(g['failed'])} |"
            )
    return lines


def to_markdown(result: dict) -> str:
    groups = summarize(result["rows"])
    lines = [
        f"### quack configs for drop_h_quack's six varlen GEMMs ({result['gpu']}, "
        f"{result['sm_count']} SMs, {result['commit']})", "",
        f"T = {result['tokens']} tokens, bf16, {result['samples']} paired samples, every call "
        "from a cold L2. ÷ torch: over `torch._grouped_mm` on pre-gathered operands (the MoE "
        f"floor's GEMM); ÷ default: over quack's untuned default ({result['default']}), which "
        "drop_h_quack ships. Medians of per-sample ratios; best: the lowest ÷ default, the "
        "default itself where no candidate beats it.", "",
        *kind_table(groups), "", *point_tables(groups),
    ]  # fmt: skip
    failures = [r for g in groups for r in g["failed"]]
    if failures:
        lines += ["", "Configs that did not run or did not match the default:", "",
                  "| model | routing | gemm | config | why |", "|---|---|---|---|---|"]  # fmt: skip
        lines += [f"| {r['model']} | {r['routing']} | {r['gemm']} | {r['config']} | "
                  f"{r['failed'].replace('|', '/')} |" for r in failures]  # fmt: skip
    if result["errors"]:
        lines += ["", "GEMMs not measured:", ""]
        lines += [
            f"- {e['model']} {e['routing']} {e['gemm']}: {e['error']}" for e in result["errors"]
        ]
    return "\n".join(lines) + "\n"


def progress(model: str, routing: str, gemm: str, rows: list[dict], errors: list) -> str:
    if not rows:
        return f"{model} {routing} {gemm}: {errors[-1]['error']}"
    (g,) = summarize(rows)
    t, d, b = g["torch"], g["default"], g["best"]
    return (f"{model} {routing} {gemm} {t['M']}x{t['N']}x{t['K']}: torch {t['ms']:.3f} ms, default "
            f"÷ torch {d['over_torch']:.3f}, best {b['config']} ÷ default {b['over_default']:.3f}, "
            f"÷ torch {b['over_torch']:.3f}, {len(g['failed'])} failed")  # fmt: skip
