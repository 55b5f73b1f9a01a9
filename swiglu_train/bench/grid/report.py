"""The model grid as markdown: ratio tables per M, the memory table, and auto's evaluation."""

from __future__ import annotations

from collections.abc import Sequence

from swiglu_train.bench.grid.run import missing_points


def to_markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [
        f"One SwiGLU MLP layer (O = D), {meta['dtype']}, on {meta['device_name']}, commit "
        f"{meta['commit']}, {meta['samples']} paired samples per point.",
        "",
        "Each cell is the median over paired samples of the training step (forward + backward) "
        "over the six-GEMM floor's in the same sample: lower is faster, **bold** is the fastest "
        "at the point, — did not run (see the skips below). `auto, run` is the impl "
        '`ParMLP(impl="auto", tokens_hint=M)` resolved to on the device measured, during the '
        "run, with that impl's ratio; `auto, model` is the shipped cost model's pick there "
        "(with every impl the run had).",
    ]
    choices = meta.get("gemm_choices")  # older results: the defaults, unrecorded
    if choices:
        skipped = meta.get("pretune_skipped")
        why = f" --pretune was asked for, and skipped: {skipped}." if skipped else ""
        lines += ["", f"The quack impls' plain GEMMs ran on: {choices}.{why}"]
    lines += _ratio_tables(result)
    lines += _pretune_table(result)
    lines += _memory_table(result)
    lines += _auto_section(result.get("auto_eval"), meta.get("auto_table"))
    lines += _skips(result)
    lines += ["", f"Command: `{meta['command']}`"]
    return "\n".join(lines) + "\n"


def _pretune_table(result: dict) -> list[str]:
    """Per pretuned point, the library each GEMM ran on and its time over static quack's."""
    points = [p for p in result["points"] if p.get("pretuned")]
    failed = [p for p in result["points"] if p.get("pretune_error")]
    if not points and not failed:
        return []
    lines = ["", "### GEMM libraries pretuned per point", "",
             "Library chosen, and cuBLAS / quack static, quack dynamic / quack static "
             "(paired medians).", "",
             "| M | D | F | GEMM | runs on | cuBLAS ÷ quack | dynamic ÷ static |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for p in points:
        for g in p["pretuned"]:
            dynamic = g["quack_dynamic_over_quack"]
            dynamic = "failed" if dynamic is None else f"{dynamic:.3f}"
            lines.append(
                f"| {p['M']} | {p['D']} | {p['F']} | {g['gemm']} | {g['backend']} | "
                f"{g['cublas_over_quack']:.3f} | {dynamic} |"
            )
    for p in failed:
        lines.append(f"\nPretune failed at [{p['M']}, {p['D']}, {p['F']}] (timed on the "
                     f"defaults): {p['pretune_error']}")  # fmt: skip
    return lines


def _by_point(rows: Sequence[dict]) -> dict[tuple, dict[str, dict]]:
    points: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        points.setdefault((r["M"], r["D"], r["F"]), {})[r["variant"]] = r
    return points


def _ratio_tables(result: dict) -> list[str]:
    variants, rows = result["meta"]["variants"], _by_point(result["rows"])
    model_picks = _model_picks(result.get("auto_eval"))
    lines = []
    for m in sorted({p["M"] for p in result["points"]}):
        lines += ["", f"### M = {m}", ""]
        lines += [
            f"| models | D | F | floor ms | {' | '.join(variants)} | auto, run | auto, model |",
            "|---" * (len(variants) + 6) + "|",
        ]
        for p in (p for p in result["points"] if p["M"] == m):
            dims = (p["M"], p["D"], p["F"])
            measured = rows.get(dims, {})
            best = min((r["ratio_to_floor"] for r in measured.values()), default=None)
            cells = [_ratio_cell(measured.get(name), best) for name in variants]
            floor_ms = next(iter(measured.values()))["floor_ms"] if measured else None
            floor = "—" if floor_ms is None else f"{floor_ms:.3f}"
            auto = [
                _pick_cell(pick, measured) for pick in (p["auto"]["impl"], model_picks.get(dims))
            ]
            lines.append(
                f"| {', '.join(p['models'])} | {p['D']} | {p['F']} | {floor} "
                f"| {' | '.join(cells)} | {' | '.join(auto)} |"
            )
    return lines


def _model_picks(evaluation: dict | None) -> dict[tuple, str]:
    """The shipped model's pick per point, with every impl the run had; none unjudged."""
    if not evaluation or "skipped" in evaluation or "skipped" in evaluation["shipped"]:
        return {}
    entries = evaluation["shipped"]["points"][evaluation["impl_sets"][0]]
    return {(e["M"], e["D"], e["F"]): e["pick"] for e in entries}


def _pick_cell(pick: str | None, measured: dict[str, dict]) -> str:
    if pick is None:
        return "—"
    picked = measured.get(pick)
    return f"{pick} " + ("(not measured)" if picked is None else f"{picked['ratio_to_floor']:.3f}")


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


SET_LABELS = {"with_quack": "with quack", "without_quack": "without quack (portable impls only)"}


def _auto_section(evaluation: dict | None, table: dict | None) -> list[str]:
    lines = ["", '### impl="auto" against the fastest impl', ""]
    if evaluation is None:
        return [*lines, "Not evaluated: the run did not finish (merge its chunks)."]
    if "skipped" in evaluation:
        return [*lines, f"Not evaluated: {evaluation['skipped']}."]
    tolerance = f"{evaluation['tolerance']:.0%}"
    lines += [
        f"A pick passes when its measured ratio is within {tolerance} of the fastest of the "
        f"impls auto could pick at the point (peers excluded). The rule's pick, on the "
        f"measurements: the fastest, or among impls within {tolerance} of it the one with the "
        f"least after-forward memory. Auto's cost model predicts each impl's step and applies "
        f"the same rule to its predictions, with a {evaluation['predicted_tie']:.1%} tie "
        f"(`swiglu_train/layers/auto.py`). Without quack, auto and the fastest are among the "
        f"portable impls only.",
        "",
    ]
    source = "no file" if table is None else f"{table['file']}, commit {table['commit']}"
    lines += [
        f"- **Picked during the run** (what ParMLP resolved to on the GPU, from {source}): "
        f"{_count(evaluation['during_run_summary'])}; out of sample (the point's D, F not "
        f"in that file): {_count(evaluation['during_run_out_of_sample_summary'])}.",
    ]
    shipped, sets = evaluation["shipped"], evaluation["impl_sets"]
    if "skipped" in shipped:
        lines.append(f"- **Shipped model**: not evaluated: {shipped['skipped']}.")
    else:
        entries = shipped["points"][sets[0]]
        inside = sum(e["in_sample"] for e in entries)
        lines.append(
            f"- **Shipped model** ({shipped['file']}, fitted from measurements at commit "
            f"{shipped['commit']}; {inside} of the {len(entries)} points in sample): "
            + "; ".join(f"{SET_LABELS[s]}: {_count(shipped['summary'][s])}" for s in sets)
            + "."
        )
        if inside < len(entries):
            lines[-1] += " Out of sample: " + "; ".join(
                f"{SET_LABELS[s]}: {_count(shipped['out_of_sample_summary'][s])}" for s in sets
            )
    lines += [
        "- **Leave one family out** (a model fitted from the grid without any shape of the "
        "family predicts its points: every pick out of sample): "
        + "; ".join(f"{SET_LABELS[s]}: {_count(evaluation['lofo_summary'][s])}" for s in sets)
        + ".",
        "",
        "#### Picked during the run",
        "",
        f"| M | D | F | models | D, F in file | pick | fastest | pick ÷ fastest "
        f"| within {tolerance} | rule's pick |",
        "|---" * 10 + "|",
    ]
    for e in evaluation["during_run"]:
        in_table = {None: "—", True: "yes (in sample)", False: "no"}[e["in_sample"]]
        lines.append(
            f"| {e['M']} | {e['D']} | {e['F']} | {', '.join(e['models'])} | {in_table} "
            f"| {_judged(e)} |"
        )
    for s in sets if "skipped" not in shipped else ():
        lines += [
            "",
            f"#### Shipped model, {SET_LABELS[s]}",
            "",
            f"| M | D | F | models | in sample | pick | predicted | fastest | pick ÷ fastest "
            f"| within {tolerance} | rule's pick |",
            "|---" * 11 + "|",
        ]
        for e in shipped["points"][s]:
            lines.append(
                f"| {e['M']} | {e['D']} | {e['F']} | {', '.join(e['models'])} "
                f"| {'yes' if e['in_sample'] else 'no'} | {_judged(e, predicted=True)} |"
            )
    skipped = []
    for s in sets:
        lines += [
            "",
            f"#### Leave one family out, {SET_LABELS[s]}",
            "",
            f"| family left out | M | D | F | pick | predicted | fastest | pick ÷ fastest "
            f"| within {tolerance} | rule's pick |",
            "|---" * 10 + "|",
        ]
        for family in evaluation["lofo"]:
            if "skipped" in family and s == sets[0]:
                skipped.append(f"- {family['family']}: {family['skipped']}")
            for e in family.get("points", {}).get(s, []):
                lines.append(
                    f"| {family['family']} | {e['M']} | {e['D']} | {e['F']} "
                    f"| {_judged(e, predicted=True)} |"
                )
    return lines + (["", *skipped] if skipped else [])


def _judged(e: dict, predicted: bool = False) -> str:
    over = "—" if e["pick_over_fastest"] is None else f"{e['pick_over_fastest']:.3f}"
    verdict = "yes" if e["within_tolerance"] else "**no**"
    cells = [e["pick"]]
    if predicted:  # None: a fallback, which predicts nothing
        cells.append("—" if e["predicted_ratio"] is None else f"{e['predicted_ratio']:.3f}")
    return " | ".join([*cells, e["fastest"], over, verdict, e["rule_pick"]])


def _count(summary: dict) -> str:
    text = f"{summary['within_tolerance']}/{summary['picks']} within tolerance"
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
