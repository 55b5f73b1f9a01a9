"""The model grid as markdown: ratio tables per M, the memory table, and auto's evaluation."""

from __future__ import annotations

from collections.abc import Sequence

from swiglu_train.bench.grid import missing_points


def to_markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [
        f"One SwiGLU MLP layer (O = D), {meta['dtype']}, on {meta['device_name']}, commit "
        f"{meta['commit']}, {meta['samples']} paired samples per point.",
        "",
        "Each cell is the median over paired samples of the training step (forward + backward) "
        "over the six-GEMM floor's in the same sample: lower is faster, **bold** is the fastest "
        "at the point, — did not run (see the skips below). `auto` is the impl "
        '`ParMLP(impl="auto", tokens_hint=M)` resolves to on the device measured, with that '
        "impl's ratio.",
    ]
    lines += _ratio_tables(result)
    lines += _memory_table(result)
    lines += _auto_section(result.get("auto_eval"), meta.get("auto_table"))
    lines += _skips(result)
    lines += ["", f"Command: `{meta['command']}`"]
    return "\n".join(lines) + "\n"


def _by_point(rows: Sequence[dict]) -> dict[tuple, dict[str, dict]]:
    points: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        points.setdefault((r["M"], r["D"], r["F"]), {})[r["variant"]] = r
    return points


def _ratio_tables(result: dict) -> list[str]:
    variants, rows = result["meta"]["variants"], _by_point(result["rows"])
    lines = []
    for m in sorted({p["M"] for p in result["points"]}):
        lines += ["", f"### M = {m}", ""]
        lines += [
            f"| models | D | F | floor ms | {' | '.join(variants)} | auto |",
            "|---" * (len(variants) + 5) + "|",
        ]
        for p in (p for p in result["points"] if p["M"] == m):
            measured = rows.get((p["M"], p["D"], p["F"]), {})
            best = min((r["ratio_to_floor"] for r in measured.values()), default=None)
            cells = [_ratio_cell(measured.get(name), best) for name in variants]
            pick = p["auto"]["impl"]
            picked = measured.get(pick)
            auto = f"{pick} " + (
                "(not measured)" if picked is None else f"{picked['ratio_to_floor']:.3f}"
            )
            floor_ms = next(iter(measured.values()))["floor_ms"] if measured else None
            floor = "—" if floor_ms is None else f"{floor_ms:.3f}"
            lines.append(
                f"| {', '.join(p['models'])} | {p['D']} | {p['F']} | {floor} "
                f"| {' | '.join(cells)} | {auto} |"
            )
    return lines


def _ratio_cell(row: dict | None, best: float | None) -> str:
    if row is None:
        return "—"
    ratio = row["ratio_to_floor"]
    return f"**{ratio:.3f}**" if ratio == best else f"{ratio:.3f}"


def _memory_table(result: dict) -> list[str]:
    variants, rows = result["meta"]["variants"], result["rows"]
    lines = ["", "### Memory", ""]
    if not any(r["after_forward_MiB"] is not None for r in rows):
        return [*lines, "No allocator readings: the run was not on CUDA."]
    lines += [
        "MiB above the inputs, weights and grad_output: after forward / peak during backward.",
        "",
        f"| models | M | D | F | {' | '.join(variants)} |",
        "|---" * (len(variants) + 4) + "|",
    ]
    by_point = _by_point(rows)
    for p in result["points"]:
        measured = by_point.get((p["M"], p["D"], p["F"]), {})
        cells = [_mib(measured.get(name)) for name in variants]
        lines.append(
            f"| {', '.join(p['models'])} | {p['M']} | {p['D']} | {p['F']} | {' | '.join(cells)} |"
        )
    return lines


def _mib(row: dict | None) -> str:
    if row is None or row["after_forward_MiB"] is None:
        return "—"
    return f"{row['after_forward_MiB']:.0f} / {row['peak_MiB']:.0f}"


def _auto_section(evaluation: dict | None, table: dict | None) -> list[str]:
    lines = ["", '### impl="auto" against the fastest impl', ""]
    if evaluation is None:
        return [*lines, "Not evaluated: the run did not finish (merge its chunks)."]
    if "skipped" in evaluation:
        return [*lines, f"Not evaluated: {evaluation['skipped']}."]
    tolerance = f"{evaluation['tolerance']:.0%}"
    lines += [
        f"A pick passes when its ratio is within {tolerance} of the fastest of our impls at the "
        f"point (peers excluded: auto picks among our impls). The rule: the fastest, or among "
        f"impls within {tolerance} of it the one with the least after-forward memory.",
        "",
    ]
    source = "no table" if table is None else f"{table['file']}, commit {table['commit']}"
    lines += [
        f"**Shipped table** ({source}): {_count(evaluation['shipped_summary'])}; out of sample "
        f"(the point's D, F not in the table): "
        f"{_count(evaluation['shipped_out_of_sample_summary'])}.",
        "",
        f"| M | D | F | models | D, F in table | pick | fastest | pick ÷ fastest "
        f"| within {tolerance} | rule's pick |",
        "|---" * 10 + "|",
    ]
    for e in evaluation["shipped"]:
        in_table = {None: "—", True: "yes (in sample)", False: "no"}[e["shape_in_table"]]
        lines.append(
            f"| {e['M']} | {e['D']} | {e['F']} | {', '.join(e['models'])} | {in_table} "
            f"| {_judged(e)} |"
        )
    lines += [
        "",
        f"**Leave one family out** (a table fitted from the grid without any shape of the "
        f"family): {_count(evaluation['lofo_summary'])}.",
        "",
        f"| family left out | M | D | F | pick | fastest | pick ÷ fastest | within {tolerance} "
        "| rule's pick |",
        "|---" * 9 + "|",
    ]
    skipped = []
    for family in evaluation["lofo"]:
        if "skipped" in family:
            skipped.append(f"- {family['family']}: {family['skipped']}")
        for e in family.get("points", []):
            lines.append(f"| {family['family']} | {e['M']} | {e['D']} | {e['F']} | {_judged(e)} |")
    return lines + (["", *skipped] if skipped else [])


def _judged(e: dict) -> str:
    over = "—" if e["pick_over_fastest"] is None else f"{e['pick_over_fastest']:.3f}"
    verdict = "yes" if e["within_tolerance"] else "**no**"
    return f"{e['pick']} | {e['fastest']} | {over} | {verdict} | {e['rule_pick']}"


def _count(summary: dict) -> str:
    text = f"{summary['within_tolerance']}/{summary['picks']} picks within tolerance"
    worst = summary["worst"]
    if worst is not None:
        text += (
            f", worst {worst['pick_over_fastest']:.3f} ({worst['pick']} against "
            f"{worst['fastest']} at M={worst['M']} D={worst['D']} F={worst['F']})"
        )
    return text


def _skips(result: dict) -> list[str]:
    """Variants skipped (one line per variant and reason, naming its points unless it is all
    of them), whole points skipped, and planned points never reached."""
    where: dict[tuple[str, str], list[str]] = {}
    for p in result["points"]:
        for name, why in p["skipped"].items():
            point = f"M={p['M']} D={p['D']} F={p['F']}"
            where.setdefault((name, why.splitlines()[0]), []).append(point)
    lines = []
    for (name, why), points in where.items():
        at = "every point" if len(points) == len(result["points"]) else "; ".join(points)
        lines.append(f"- {name} at {at}: {why}")
    for p in result["skipped_points"]:
        lines.append(f"- M={p['M']} D={p['D']} F={p['F']}, every variant: {p['reason']}")
    for m, d, f in missing_points(result):
        lines.append(f"- M={m} D={d} F={f}: not measured (its chunk stopped before it)")
    return ["", "Skipped:", "", *lines] if lines else []
