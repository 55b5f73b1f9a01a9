"""The Lightning end-to-end harness: whole optimizer steps of the pretraining module, impl x
checkpointed blocks, in rounds; each impl's best plan per memory budget, and the planner's pick.

Every round visits the impls in a fresh random order, builds each one's model once on the
device, and runs each checkpointed-blocks count of the grid, in random order, for the warm-up
steps and then the timed ones, through the planner's own measurer
(swiglu_train/integrations/lightning/planner.py), so the figures are the ones it decides from.
A step is the global batch, accumulated in micro-batches (forward, backward), then clipping and
AdamW once; tokens/s counts the global batch's tokens over that step, timed as the measurer
does (its first micro-batch, one accumulating one standing for the rest, and the optimizer
step). Per configuration: tokens/s, the optimizer step's time, after-forward and peak MiB as
min/median/max over rounds, and MFU where the GPU's peak is known. On CUDA the memory is the
allocator's peak; on the CPU the planner's estimate.

The planner bisects to the fewest checkpointed blocks that fit, which a coarse grid may not
hold: its pick and each impl's best plan at the budget, where the grid lacks them, are then
measured as the grid's points were, once per round so far, so that every impl is compared at
its own best count, by medians alike.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch

from swiglu_train.bench.e2e.rounds import (
    device_name,
    machine_id,
    machines,
    next_rounds,
    parse_list,
    rows,
)
from swiglu_train.bench.results import git_commit
from swiglu_train.integrations.lightning.config import PretrainConfig, load_config
from swiglu_train.integrations.lightning.planner import Steps, measurer
from swiglu_train.integrations.lightning.precision import resolve_precision
from swiglu_train.memory.budget import ALLOCATOR, ESTIMATE
from swiglu_train.memory.plan import NoPlanFits, accumulation, choose_plan, search

# Dense bf16 tensor-core peaks (the SXM datasheets), for MFU; other devices get none.
PEAK_FLOPS = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}


def configure(
    config: str,
    seq_length: int | None,
    micro_batch_size: int | None,
    global_batch_size: int | None,
    impls: str | None,
) -> PretrainConfig:
    """The packaged config or YAML file, with the command line's overrides."""
    cfg = load_config(config)
    if seq_length is not None:
        cfg.data.seq_length = seq_length
        cfg.model.max_seq_length = max(cfg.model.max_seq_length, seq_length)
    if micro_batch_size is not None:
        cfg.data.micro_batch_size = micro_batch_size
    if global_batch_size is not None:
        try:
            cfg.train.accumulate_grad_batches = accumulation(
                global_batch_size, cfg.data.micro_batch_size
            )
        except ValueError as e:
            raise ValueError(f"--global-batch-size {global_batch_size}: {e}") from None
    cfg.train.plan_impls = parse_list(impls) if impls else None
    return cfg


def lightning_settings(
    config: str, cfg: PretrainConfig, names: list[str], grid: list[int], warmup: int, steps: int
) -> dict:
    """What a run is measured with: rounds added to it later must be measured alike."""
    return {"config": config, "seq_length": cfg.data.seq_length, "grid": grid,
            "micro_batch_size": cfg.data.micro_batch_size, "impls": names,
            "accumulate_grad_batches": cfg.train.accumulate_grad_batches,
            "warmup_steps": warmup, "timed_steps": steps, "device": device_name()}  # fmt: skip


def run_lightning(
    cfg: PretrainConfig,
    settings: dict,
    points: list[dict],
    *,
    rounds: int,
    seed: int,
    budgets_gb: str,
    planner: bool,
    command: str,
    commit: str | None,
    on_point: Callable[[list[dict]], None] = lambda _: None,
) -> dict:
    """Measure ``rounds`` rounds after ``points`` (an earlier run's, or none), then the rows and
    MFU over all of them and each budget's plans (``budgets_gb``: see ``parse_budgets``).
    ``on_point(points so far)`` after each measured point (``e2e.point_writer``)."""
    names, grid = settings["impls"], settings["grid"]
    commit = commit or git_commit()  # the caller names the tree it ran: a copy's .git may lag
    tags = {"commit": commit, "machine": machine_id()}  # each point's own
    schedule, order = next_rounds(points, rounds, seed)
    points = list(points)
    steps = Steps(settings["warmup_steps"], settings["timed_steps"])
    measure = measurer(cfg, steps, log=print)
    for r in schedule:
        for impl in order.sample(names, len(names)):
            for n in order.sample(grid, len(grid)):
                points.append(_point(r, impl, n, measure(impl, n)) | tags)
                on_point(points)
    table = _table(points, cfg)
    # the budgets fall between the grid's own peaks, whatever the planner adds below
    budgets = parse_budgets(budgets_gb, [r for r in table if r["checkpoint_layers"] in grid])
    # The peaks are the allocator's, absolute: the grid's model and optimizer, still held by
    # its measurer, would count in every peak the planner measures. Release them first.
    del measure
    gc.collect()  # Lightning's wrappers hold cycles
    picks = planner_picks(budgets, names, cfg) if planner else [None] * len(budgets)
    gc.collect()  # the planner's last model, likewise
    measured = {(r["impl"], r["checkpoint_layers"]) for r in table}
    unmeasured = sorted({c for p in picks if p and "impl" in p for c in _planned(p)} - measured)
    if unmeasured:  # each planned count gets a median of its own, as many rounds as the grid's
        measure = measurer(cfg, steps, log=print)
        for r in range(schedule.stop):
            for impl, n in order.sample(unmeasured, len(unmeasured)):
                point = _point(r, impl, n, measure(impl, n))
                points.append(point | {"planned": True} | tags)
                on_point(points)
        table = _table(points, cfg)
    plans = [budget_plans(b, table, pick) for b, pick in zip(budgets, picks, strict=True)]
    return settings | {
        "command": command,
        "commit": commit,  # each point's own too: rounds added later may be another's
        "memory": ALLOCATOR if torch.cuda.is_available() else ESTIMATE,
        "model": {
            k: getattr(cfg.model, k)
            for k in ("hidden_size", "ffn_hidden_size", "num_layers", "num_heads")
        },
        "precision": resolve_precision(cfg.train.precision),
        "rounds": schedule.stop,
        "flops_per_token": flops_per_token(cfg.model, cfg.data.seq_length),
        "peak_flops": peak_flops(),
        "rows": table,
        "budgets": plans,
        "points": points,
    }


def _planned(pick: dict) -> set[tuple[str, int]]:
    """The pick and each impl's best plan at its budget: every impl is then compared at its
    own best block count, not at the grid's nearest (a coarse grid favours the impl whose
    count the planner happened to pick)."""
    return {(pick["impl"], pick["checkpoint_layers"]), *pick["best_per_impl"].items()}


def _point(round_: int, impl: str, n: int, p) -> dict:
    return {
        "round": round_,
        "impl": impl,
        "checkpoint_layers": n,
        "peak_MiB": p.peak_MiB,
        "tokens_per_s": p.tokens_per_s,
        "optimizer_s": p.optimizer_s,
        "after_forward_MiB": p.after_forward_MiB,
    }


def _table(points: list[dict], cfg: PretrainConfig) -> list[dict]:
    """One row per (impl, checkpointed blocks), with MFU where the GPU's peak is known."""
    table = rows(points, ("impl", "checkpoint_layers"))
    flops, peak = flops_per_token(cfg.model, cfg.data.seq_length), peak_flops()
    for r in table:
        rate = r["tokens_per_s"]
        r["mfu"] = rate["median"] * flops / peak if rate and peak else None
    return table


def best_per_impl(table: list[dict], budget_MiB: float) -> dict[str, dict]:
    """Each impl's fastest configuration (median tokens/s) whose largest peak fits."""
    best: dict[str, dict] = {}
    for r in table:
        if r["peak_MiB"] is None or r["out_of_memory"] or r["peak_MiB"]["max"] > budget_MiB:
            continue
        mine = best.get(r["impl"])
        if mine is None or r["tokens_per_s"]["median"] > mine["tokens_per_s"]["median"]:
            best[r["impl"]] = r
    return best


def flops_per_token(cfg, seq: int) -> float:
    """Model FLOPs of a training step per token (PaLM's 6N + 12·L·D·S; recompute not counted):
    N the matmul weights a token goes through (blocks and head; the embedding is a lookup; in
    an MoE model, the router and its top-k experts)."""
    d, f, layers = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_layers
    experts = cfg.num_experts
    mlp = 3 * d * f * cfg.moe_top_k + d * experts if experts else 3 * d * f
    weights = layers * (4 * d * d + mlp) + d * cfg.vocab_size
    return 6 * weights + 12 * layers * d * seq


def peak_flops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def parse_budgets(value: str, table: list[dict]) -> list[float]:
    """MiB: a list of GiB, or ``auto:K``: K budgets evenly between the smallest and the
    largest peak of the grid (whole MiB), where impls need different checkpointing."""
    if not value.startswith("auto:"):
        return [gb * 1024 for gb in parse_list(value, float)]
    peaks = [r["peak_MiB"]["max"] for r in table if r["peak_MiB"]]
    k, low, high = int(value.removeprefix("auto:")), min(peaks), max(peaks)
    return [float(round(low + (high - low) * (i + 1) / (k + 1))) for i in range(k)]


def budget_plans(budget_MiB: float, table: list[dict], pick: dict | None) -> dict:
    """At one budget: each impl's best measured configuration, the fastest of them, best
    drop_h* over best normal, and the planner's ``pick`` (when it ran) set against them."""
    best = best_per_impl(table, budget_MiB)
    out = {
        "budget_GiB": budget_MiB / 1024,
        "best_per_impl": {
            i: {
                "checkpoint_layers": r["checkpoint_layers"],
                "tokens_per_s": r["tokens_per_s"]["median"],
                "peak_MiB": r["peak_MiB"]["max"],
            }
            for i, r in best.items()
        },
    }
    top = max(best.values(), key=lambda r: r["tokens_per_s"]["median"], default=None)
    out["best"] = (
        None
        if top is None
        else {"impl": top["impl"], "checkpoint_layers": top["checkpoint_layers"]}
    )
    if "normal" in best and top is not None:
        drop = [r for i, r in best.items() if i.startswith("drop_h")]
        if drop:
            top_drop = max(drop, key=lambda r: r["tokens_per_s"]["median"])
            out["best_drop_h_vs_normal"] = (
                top_drop["tokens_per_s"]["median"] / best["normal"]["tokens_per_s"]["median"]
            )
            # medians of two machines differ by their clocks too: the ratio then says so
            out["best_drop_h_vs_normal_machines"] = machines(top_drop, best["normal"])
    if pick is not None:
        same = next(
            (r for r in table if (r["impl"], r["checkpoint_layers"])
             == (pick.get("impl"), pick.get("checkpoint_layers"))),
            None,
        )  # fmt: skip
        ratio, spans = None, []
        if same is not None and top is not None and same["tokens_per_s"]:
            ratio = same["tokens_per_s"]["median"] / top["tokens_per_s"]["median"]
            spans = machines(same, top)
        out["planner"] = pick | {"pick_vs_best_in_grid": ratio, "pick_vs_best_machines": spans}
    return out


def planner_picks(budgets: list[float], names: list[str], cfg: PretrainConfig) -> list[dict]:
    """The planner's pick at each budget (MiB): its own short steps and bisection, as
    ``pretrain --activation-checkpointing auto`` runs them. A profile does not depend on the
    budget, so each (impl, blocks) is measured once for all the budgets; ``probes`` counts
    the profiles each budget's search read."""
    layers = cfg.model.num_layers
    measure = measurer(cfg, Steps(), log=print)
    profiles = {}

    def once(impl: str, n: int):
        if (impl, n) not in profiles:
            profiles[impl, n] = measure(impl, n)
        return profiles[impl, n]

    picks = []
    for budget in budgets:
        print(f"planner at {budget / 1024:g} GiB")
        probes = search(names, layers, budget, once)
        try:
            plan = choose_plan(probes, budget, layers)
        except NoPlanFits as e:
            picks.append({"error": str(e), "probes": len(probes)})
            continue
        picks.append(
            {
                "impl": plan.impl,
                "checkpoint_layers": plan.checkpoint_layers,
                "why": plan.why,
                "probes": len(probes),
                "pick_tokens_per_s": plan.tokens_per_s,  # the planner's own short measurement
                "best_per_impl": {p.impl: p.checkpoint_layers for p in plan.best_per_impl},
            }
        )
    return picks
