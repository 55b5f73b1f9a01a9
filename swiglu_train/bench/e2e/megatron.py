"""The Megatron end-to-end harness: each round runs recipes/pretrain_megatron.py once per impl,
in a fresh random order, each a process of its own (the launcher), and reads its summary:
tokens/s is the median over the steps after the warm-up, and the warm-up steps' own rates are
kept, since compilation (stock's torch.compile'd bias-SwiGLU) lands there."""

from __future__ import annotations

import json
import shlex
import statistics
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from swiglu_train.bench.e2e.host_samples import sampled, top_frames
from swiglu_train.bench.e2e.rounds import device_name, machine_id, next_rounds, rows, spread
from swiglu_train.bench.results import git_commit


def megatron_settings(names: list[str], recipe_args: list[str], warmup: int, steps: int) -> dict:
    """What a run is measured with: rounds added to it later must be measured alike."""
    return {"impls": names, "recipe_args": recipe_args, "warmup_steps": warmup,
            "timed_steps": steps, "device": device_name()}  # fmt: skip


def run_megatron(
    settings: dict,
    points: list[dict],
    *,
    launcher: str,
    rounds: int,
    seed: int,
    command: str,
    commit: str | None,
    profiles: dict[str, Path] | None = None,
    host_samples: Path | None = None,
    native_samples: bool = False,
    on_point: Callable[[list[dict]], None] = lambda _: None,
) -> dict:
    """Run ``rounds`` rounds after ``points`` (an earlier run's, or none), the recipe's summary
    read back from each, then the rows over all of them. ``profiles`` (impl -> JSON path): the
    first run of that impl whose path does not exist yet also profiles its last timed step
    (``--profile-step``), so no extra process is launched; one step of 20 under the profiler
    barely moves the median. ``host_samples`` (a folder): every run under py-spy, its raw
    stacks kept there as IMPL_roundR.txt and the top frames of its steps (``run_step``) in the
    point (``host_samples``), at about 1 % of a core; ``native_samples``: with C and C++
    frames (py-spy ``--native``). ``on_point(points so far)`` after each run."""
    names, warmup, steps = settings["impls"], settings["warmup_steps"], settings["timed_steps"]
    commit = commit or git_commit()  # the caller names the tree it ran: a copy's .git may lag
    schedule, order = next_rounds(points, rounds, seed)
    points = list(points)
    with tempfile.TemporaryDirectory() as scratch:
        for r in schedule:
            for impl in order.sample(names, len(names)):
                summary = Path(scratch) / f"{impl}_{r}.json"
                run = [
                    *shlex.split(launcher),
                    "--mlp-impl",
                    impl,
                    "--max-steps",
                    str(warmup + steps),
                    "--warmup-steps",
                    str(warmup),
                    "--summary-json",
                    str(summary),
                    "--output-dir",
                    str(Path(scratch) / "runs"),
                    *settings["recipe_args"],
                ]
                profile = (profiles or {}).get(impl)
                if profile is not None and not profile.exists():
                    last = str(warmup + steps - 1)
                    run += ["--profile-step", last, "--profile-json", str(profile)]
                if host_samples is not None:
                    host_samples.mkdir(parents=True, exist_ok=True)
                    path = host_samples / f"{impl}_round{r}.txt"
                    run = sampled(run, path, native=native_samples)
                done = subprocess.run(run, capture_output=True, text=True)
                if done.returncode:
                    raise RuntimeError(f"{shlex.join(run)} failed:\n{done.stderr[-3000:]}")
                s = json.loads(summary.read_text())
                rates = s["step_tokens_per_s"]
                held = _median_phases(s["step_schedule_host"][s["warmup_steps"] :])
                print(f"round {r} {impl}: {s['tokens_per_s']:,.0f} tokens/s; schedule",
                      {k: round(v, 4) for k, v in held.items()}, s["host_threads"])  # fmt: skip
                points.append(
                    {
                        "round": r,
                        "impl": impl,
                        "tokens_per_s": s["tokens_per_s"],
                        "warmup_tokens_per_s": rates[: s["warmup_steps"]],
                        # each timed step's: a run's slow steps may be all or some of them
                        "timed_tokens_per_s": rates[s["warmup_steps"] :],
                        "after_forward_MiB": s["after_forward_MiB"],
                        "peak_MiB": s["peak_MiB"],
                        "final_loss": s["final_loss"],
                        "gc_ms_per_step": s["gc_ms_per_step"],
                        # the timed steps' median host time per phase of the step
                        "phases_s": _median_phases(s["step_phases_s"][s["warmup_steps"] :]),
                        # and what held the schedule: collate, copy, forward, thread CPU
                        "schedule_host": held,
                        "host_threads": s["host_threads"],
                        # torch.compile's workers ended after the warm-up (None: kept)
                        "compile_workers_released": s["compile_workers_released"],
                        "commit": commit,
                        "machine": machine_id(),  # the ratio to stock pairs within a round
                    }
                )
                if host_samples is not None:
                    raw = host_samples / f"{impl}_round{r}.txt"
                    points[-1]["host_samples"] = top_frames(raw, top=40, within="run_step")
                on_point(points)
    return settings | {
        "command": command,
        "commit": commit,
        "rounds": schedule.stop,
        "rows": megatron_rows(points),
        "points": points,
    }


def megatron_rows(points: list[dict]) -> list[dict]:
    """Per impl: the spreads, the ratio to stock's tokens/s paired per round, and the median
    rate of each warm-up step (where compilation and autotuning show)."""
    table = rows(points, ("impl",))
    base = {p["round"]: p["tokens_per_s"] for p in points if p["impl"] == "stock"}
    for r in table:
        mine = [p for p in points if p["impl"] == r["impl"]]
        r["gc_ms_per_step"] = spread([p.get("gc_ms_per_step") for p in mine])  # older: none
        # the batch's collate in a timed step (median): where a slowed host shows first
        r["collate_ms"] = spread([1e3 * p["schedule_host"]["collate_s"] for p in mine
                                  if "collate_s" in p.get("schedule_host", {})])  # fmt: skip
        r["vs_stock"] = spread([p["tokens_per_s"] / base[p["round"]] for p in mine
                                if p["round"] in base])  # fmt: skip
        warm = [p["warmup_tokens_per_s"] for p in mine]
        r["warmup_tokens_per_s_median"] = [statistics.median(s) for s in zip(*warm, strict=False)]
    return table


def _median_phases(steps: list[dict]) -> dict:
    """Per phase (or host figure) of a step (``step.run_step``), the median over ``steps``."""
    return {k: statistics.median(step[k] for step in steps) for k in steps[0]}
