"""The end-to-end runs as markdown: a row per configuration with its median [min, max] over
rounds; for Lightning, the best plan per impl at each budget and the planner's pick."""

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
    lines = [
        "| impl | checkpointed | tokens/s | MFU | optimizer ms | after-fwd MiB | peak MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(result["rows"], key=lambda r: (r["impl"], r["checkpoint_layers"])):
        mfu = "—" if r["mfu"] is None else f"{r['mfu']:.1%}"
        lines.append(
            f"| {r['impl']} | {r['checkpoint_layers']} | {_fmt(r['tokens_per_s'])} | "
            f"{mfu} | {_fmt(_ms(r.get('optimizer_s')), 1)} | {_fmt(r['after_forward_MiB'])} | "
            f"{_fmt(r['peak_MiB'])} |"
        )
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
            lines.append(f"best drop_h* ÷ best normal: {b['best_drop_h_vs_normal']:.3f}")
        if "planner" in b:
            lines.append(f"planner: {json.dumps(b['planner'])}")
    return head + "\n".join(lines) + "\n"


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
