"""The end-to-end runs as markdown: a row per configuration with its median [min, max] over
rounds; for Lightning, what a checkpointed block costs and frees under each impl, the best
plan per impl at each budget and the planner's pick."""

from __future__ import annotations

import json


def lightning_markdown(result: dict) -> str:
    a = result.get("accumulate_grad_batches", 1)  # older runs: one micro-batch a step
    batch = f" x {a} per optimizer step" if a > 1 else ""
    head = (
        f"### Lightning e2e: {result['config']} at seq {result['seq_length']}, micro-batch "
        f"{result['micro_batch_size']}{batch}, {result['precision']}, {result['device']}\n\n"
        f"{result['rounds']} rounds interleaved, {result['warmup_steps']} warm-up + "
        f"{result['timed_steps']} timed steps each; median [min, max] over rounds; memory: "
        f"{result['memory']}. {_commits(result)}; `{result['command']}`\n\n"
    )
    labels = machine_labels(result["points"])
    many = len(labels) > 1  # then each row and each ratio says which machines measured it
    lines = [_machines_line(labels), ""] if many else []
    lines += [
        "| impl | checkpointed | tokens/s | MFU | optimizer ms | after-fwd MiB | peak MiB |"
        + (" machine |" if many else ""),
        "|---|---|---|---|---|---|---|" + ("---|" if many else ""),
    ]
    for r in sorted(result["rows"], key=lambda r: (r["impl"], r["checkpoint_layers"])):
        mfu = "—" if r["mfu"] is None else f"{r['mfu']:.1%}"
        lines.append(
            f"| {r['impl']} | {r['checkpoint_layers']} | {_fmt(r['tokens_per_s'])} | "
            f"{mfu} | {_fmt(_ms(r.get('optimizer_s')), 1)} | {_fmt(r['after_forward_MiB'])} | "
            f"{_fmt(r['peak_MiB'])} |" + (f" {_letters(r, labels)} |" if many else "")
        )
    lines += _block_cost_lines(block_costs(result["rows"]))
    for b in result["budgets"]:
        lines += [
            "",
            f"Budget {b['budget_GiB']:g} GiB, best plan per impl: "
            + "; ".join(
                f"{i} {v['checkpoint_layers']} blocks {v['tokens_per_s']:,.0f} tokens/s"
                for i, v in b["best_per_impl"].items()
            )
            or "none fits",
        ]
        if "best_drop_h_vs_normal" in b:
            across = b.get("best_drop_h_vs_normal_machines", [])
            flag = f" (across machines {_letters({'machines': across}, labels)}: not like-for-like)"
            ratio = f"best drop_h* ÷ best normal: {b['best_drop_h_vs_normal']:.3f}"
            lines.append(ratio + (flag if len(across) > 1 else ""))
        if "planner" in b:
            lines.append(f"planner: {json.dumps(b['planner'])}")
    return head + "\n".join(lines) + "\n"


def block_costs(rows: list[dict]) -> dict[str, dict]:
    """Per impl, from its rows at 0 and at the most checkpointed blocks n (medians): the step
    time a checkpointed block adds (a share of the unchecked step's), the after-forward MiB it
    frees, and its tokens/s over normal's at 0 and at n blocks. What the memory can buy
    follows: an impl that holds k MiB less unchecked lets about k / (normal's MiB a block)
    fewer blocks be checkpointed, each worth normal's cost a block; and a ratio to normal
    that falls from 0 to n blocks is a cost of that impl's recompute."""
    by_impl: dict[str, dict[int, dict]] = {}
    for r in rows:
        if r["tokens_per_s"] is not None and r["after_forward_MiB"] is not None:
            by_impl.setdefault(r["impl"], {})[r["checkpoint_layers"]] = r
    normal = by_impl.get("normal", {})
    out = {}
    for impl, counts in by_impl.items():
        n = max(counts)
        if 0 not in counts or n == 0:
            continue
        t0, tn = (counts[k]["tokens_per_s"]["median"] for k in (0, n))
        m0, mn = (counts[k]["after_forward_MiB"]["median"] for k in (0, n))
        costs = {
            "blocks": n,
            "step_time_per_block": (t0 / tn - 1) / n,
            "MiB_per_block": (m0 - mn) / n,
        }
        if 0 in normal and n in normal:
            costs["vs_normal_unchecked"] = t0 / normal[0]["tokens_per_s"]["median"]
            costs["vs_normal_checkpointed"] = tn / normal[n]["tokens_per_s"]["median"]
        out[impl] = costs
    return out


def _block_cost_lines(costs: dict[str, dict]) -> list[str]:
    if not costs:
        return []
    lines = [
        "",
        "What a checkpointed block costs and frees, from each impl's rows at 0 and at its most "
        "checkpointed blocks (medians):",
        "",
        "| impl | blocks | step time a block adds | after-fwd MiB a block frees | ÷ normal, "
        "unchecked | ÷ normal, all those blocks checkpointed |",
        "|---|---|---|---|---|---|",
    ]
    for impl, c in sorted(costs.items()):
        ratios = [c.get(k) for k in ("vs_normal_unchecked", "vs_normal_checkpointed")]
        lines.append(
            f"| {impl} | {c['blocks']} | {c['step_time_per_block']:.2%} | "
            f"{c['MiB_per_block']:,.0f} | "
            + " | ".join("—" if v is None else f"{v:.3f}" for v in ratios)
            + " |"
        )
    return lines


def machine_labels(points: list[dict]) -> dict[str, str]:
    """A letter per machine the points ran on, in order of first appearance."""
    seen = dict.fromkeys(p["machine"] for p in points if p.get("machine"))
    return {m: chr(ord("A") + i) for i, m in enumerate(seen)}


def _machines_line(labels: dict[str, str]) -> str:
    return (
        f"Points from {len(labels)} machines of that model: "
        + ", ".join(f"{v} = {k}" for k, v in labels.items())
        + ". Their clocks differ, so a ratio of two rows from different machines is not "
        "like-for-like; the last column says which measured each row."
    )


def _letters(row: dict, labels: dict[str, str]) -> str:
    return "+".join(labels[m] for m in row.get("machines", ())) or "—"


def _commits(result: dict) -> str:
    """The commit, or each commit that measured points when rounds were added from another."""
    seen = list(dict.fromkeys(p["commit"] for p in result["points"] if p.get("commit")))
    if len(seen) > 1:
        return f"Commits {', '.join(seen)} (each point names its own)"
    return f"Commit {result['commit']}"


def megatron_markdown(result: dict) -> str:
    lines = [
        f"### Megatron recipe e2e, {result['device']}: `{' '.join(result['recipe_args'])}`",
        "",
        f"{result['rounds']} rounds interleaved, {result['warmup_steps']} warm-up + "
        f"{result['timed_steps']} timed steps per run; median [min, max] over rounds. "
        f"{_commits(result)}; `{result['command']}`. GC ms/step: the host's time in Python's "
        "garbage collector inside a timed step, mean over the timed steps. Collate ms: the "
        "DataLoader's collate of a step's batches, median over the timed steps (the GPU waits "
        "on it).",
        "",
        "| impl | tokens/s | ÷ stock (paired) | GC ms/step | collate ms | after-fwd MiB "
        "| peak MiB | warm-up tokens/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        warm = ", ".join(f"{v:,.0f}" for v in r["warmup_tokens_per_s_median"])
        lines.append(
            f"| {r['impl']} | {_fmt(r['tokens_per_s'])} | {_fmt(r['vs_stock'], 3)} | "
            f"{_fmt(r.get('gc_ms_per_step'), 1)} | {_fmt(r.get('collate_ms'), 1)} | "
            f"{_fmt(r['after_forward_MiB'])} | "
            f"{_fmt(r['peak_MiB'])} | {warm} |"
        )
    return "\n".join(lines) + "\n"


def _fmt(s: dict | None, digits: int = 0) -> str:
    if s is None:
        return "—"
    return f"{s['median']:,.{digits}f} [{s['min']:,.{digits}f}, {s['max']:,.{digits}f}]"


def _ms(s: dict | None) -> dict | None:
    return None if s is None else {k: v * 1e3 for k, v in s.items()}
