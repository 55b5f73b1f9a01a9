"""``bench-moe``'s result as markdown, and results of separate runs merged into one.

SonicMoE runs in a process of its own (``sonic.py`` says why), so a full comparison is two
runs on one GPU: the merge keeps the first run's rows and adds, at each point, the variants
the first did not run. Every row keeps its ratio to the floor measured in its own run.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

PROVENANCE = ("command", "commit", "date", "device_name", "versions", "variants")
SAME_KEYS = ("device_name", "dtype", "tokens")  # what runs must share to merge


def merge_results(results: Sequence[dict]) -> dict:
    """One result from runs on the same GPU at the same dtype and tokens; a variant measured
    at a point by two runs keeps the first run's row. Rows and skips name their run."""
    if not results:
        raise ValueError("nothing to merge")
    merged = copy.deepcopy(results[0])
    first = merged["meta"]
    first["runs"] = []
    merged["rows"], merged["skipped"] = [], []
    for other in results:
        meta = other["meta"]
        pairs = [(key, first[key], meta[key]) for key in SAME_KEYS]
        pairs.append(("router_weights_on", weights_on(first), weights_on(meta)))
        for key, mine, theirs in pairs:
            if theirs != mine:
                raise ValueError(f"cannot merge runs with {key} {mine!r} and {theirs!r}")
        base = len(first["runs"])  # a merged result brings its runs, its rows naming theirs
        first["runs"] += meta.get("runs") or [{key: meta.get(key) for key in PROVENANCE}]
        have, points = _measured(merged), {_point(p) for p in merged["points"]}
        merged["points"] += [p for p in other["points"] if _point(p) not in points]
        merged["rows"] += [_run(r, base) for r in other["rows"] if _key(r) not in have]
        merged["skipped"] += [_run(s, base) for s in other["skipped"]]
    measured = _measured(merged)
    merged["skipped"] = [s for s in merged["skipped"] if _key(s) not in measured]
    first["variants"] = list(dict.fromkeys(v for run in first["runs"] for v in run["variants"]))
    return merged


def weights_on(meta: dict) -> str:
    """Which side of the experts the run's router weight scales; results from before the
    input side was offered put it on the output."""
    return meta.get("router_weights_on", "output")


def _run(entry: dict, base: int) -> dict:
    return entry | {"run": base + entry.get("run", 0)}


def _point(point: dict) -> tuple[str, str]:
    return point["model"], point["routing"]


def _key(row: dict) -> tuple[str, str, str]:
    return row["model"], row["routing"], row["variant"]


def _measured(result: dict) -> set[tuple[str, str, str]]:
    return {_key(r) for r in result["rows"]}


def to_markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [
        f"Routed SwiGLU experts, one layer: T = {meta['tokens']} tokens, {meta['dtype']}, on "
        f"{meta['device_name']}, commit {meta['commit']}, {meta['samples']} paired samples per "
        f"point. The router weight scales each expert's {weights_on(meta)}"
        + (" (as Llama-4's does)." if weights_on(meta) == "input" else "."),
        "",
        "`step ÷ floor` is the median over paired samples of the training step (forward + "
        "backward, with the gradients of x, the router weights and the expert weights) over "
        "the six grouped GEMMs alone in the same sample. `after-fwd` is what the step holds "
        "between forward and backward (with y), `peak` the most it holds during the step "
        "(CUDA only; `model`: what the drop_h impls' size model in ops/experts_peak gives). "
        f"`y err` is the largest absolute error of y against the {meta['reference']}"
        "; `ok` means y and every gradient are within a relative error of "
        f"{_tolerances(meta)}.",
        "",
        "Each step is queued behind a spin kernel, as training's host runs ahead of the GPU; "
        "† marks a step that reads GPU values on the host (its group sizes), timed from an "
        "idle GPU instead, since it waits there in training too.",
    ]
    rows_at: dict[tuple[str, str], list[dict]] = {}
    for row in result["rows"]:
        rows_at.setdefault((row["model"], row["routing"]), []).append(row)
    for point in result["points"]:
        lines += ["", _heading(point), ""]
        lines += [
            "| variant | step ms | step ÷ floor | fwd ms | bwd ms | after-fwd MiB | peak MiB "
            "| y err | worst grad err | ok |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows_at.get((point["model"], point["routing"]), []):
            lines.append(
                f"| {r['variant']}{' †' if r.get('waits_on_gpu') else ''} "
                f"| {r['full_ms']:.3f} | {r['full_over_floor']:.3f} "
                f"| {r['fwd_ms']:.3f} | {r['bwd_ms']:.3f} | {_mib(r['after_forward_MiB'])} "
                f"| {_peak(r)} | {_err(r.get('y_max_abs_err'))} "
                f"| {_err(_worst_grad(r))} | {_ok(r)} |"
            )
    if result["skipped"]:
        lines += ["", "Not measured:", ""]
        lines += [
            f"- {s['model']} {s['routing']}, {s['variant']}: {s['reason']}"
            for s in result["skipped"]
        ]
    commands = [run["command"] for run in meta.get("runs", [])] or [meta["command"]]
    lines += ["", *(f"Command: `{c}`" for c in commands)]
    return "\n".join(lines) + "\n"


def _heading(point: dict) -> str:
    rows = point["rows_per_expert"]
    return (
        f"### {point['model']}, {point['routing']}: D={point['D']} F={point['F']} "
        f"E={point['E']} k={point['k']}; rows per expert {rows['min']} to {rows['max']} "
        f"(mean {rows['mean']:.0f}, {rows['empty_experts']} empty)"
    )


def _tolerances(meta: dict) -> str:
    tol = meta["tolerance"]
    return f"{tol['others']:g} (gradients of the `+fp8` variants: {tol['+fp8']:g})"


def _worst_grad(row: dict) -> float | None:
    errors = [row.get(f"{k}_rel_err") for k in ("grad_x", "grad_router", "grad_fc1", "grad_fc2")]
    known = [e for e in errors if e is not None]
    return max(known) if known else None


def _mib(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def _peak(row: dict) -> str:
    """The measured peak, and the size model's beside it where the row has one."""
    model = row.get("peak_model_MiB")
    return _mib(row["peak_MiB"]) + ("" if model is None else f" (model {model:.1f})")


def _err(value: float | None) -> str:
    return "—" if value is None else f"{value:.2g}"


def _ok(row: dict) -> str:
    return "" if "ok" not in row else ("yes" if row["ok"] else "**no**")
