"""benchmarks/bench_e2e.py on CPU: the Lightning harness at a tiny config (rounds, spreads, best
plan per budget, the planner set against the grid, JSON, markdown and plot), and the Megatron
harness' per-round pairing (swiglu_train/bench/e2e*.py)."""

import json
import statistics
from pathlib import Path

import pytest
from helpers import watch_planner_builds
from test_scripts import load_script
from typer.testing import CliRunner

from swiglu_train.bench.e2e.lightning import budget_plans, parse_budgets
from swiglu_train.bench.e2e.megatron import megatron_rows
from swiglu_train.bench.e2e.plot import plot_budgets
from swiglu_train.bench.e2e.report import block_costs, lightning_markdown
from swiglu_train.bench.e2e.rounds import machine_id, rows
from swiglu_train.memory.budget import ESTIMATE
from swiglu_train.ops import use_backend

TINY = (
    "model: {hidden_size: 64, ffn_hidden_size: 160, num_heads: 2, num_layers: 2}\n"
    "data: {seq_length: 32, micro_batch_size: 2}\n"
)


def tiny_normal_grid(tmp_path: Path) -> tuple:
    """(bench_e2e, its lightning arguments, the --json path): the tiny config, normal alone,
    no checkpointing, 1 warm-up and 1 timed step; the caller adds rounds and the planner."""
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY)
    out = tmp_path / "e2e.json"
    args = ["lightning", "--config", str(config), "--impls", "normal", "--warmup", "1"]
    args += ["--steps", "1", "--checkpoint-layers", "0", "--json", str(out)]
    return load_script("bench_e2e"), args, out


def test_lightning_rounds_spreads_budgets_and_planner(tmp_path: Path) -> None:
    bench = load_script("bench_e2e")
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY)
    out = {s: tmp_path / f"e2e.{s}" for s in ("json", "md", "png")}
    args = ["lightning", "--config", str(config), "--impls", "normal,drop_h", "--warmup", "1"]
    args += ["--steps", "1", "--checkpoint-layers", "0,2", "--json", str(out["json"])]
    runner = CliRunner()
    with use_backend("torch"):  # the interpreter would make the steps crawl
        # two rounds, then a third added by a second call (a GPU run split across calls)
        result = runner.invoke(bench.app, [*args, "--rounds", "2"])
        assert result.exit_code == 0, result.output
        args += ["--rounds", "1", "--append", "--planner", "--budgets-gb", "1,0.001"]
        outputs = ["--md", str(out["md"]), "--plot", str(out["png"])]
        result = runner.invoke(bench.app, [*args, *outputs])
        assert result.exit_code == 0, result.output
        other = runner.invoke(bench.app, [*args[:-3], "--warmup", "2"])  # other settings
    assert isinstance(other.exception, ValueError)
    assert "was made with other settings: {'warmup_steps': (1, 2)}" in str(other.exception)
    r = json.loads(out["json"].read_text())
    assert r["memory"] == ESTIMATE and r["rounds"] == 3 and r["device"] == "cpu"
    configs = {(i, n) for i in ("normal", "drop_h") for n in (0, 2)}
    for round_ in range(3):  # every configuration once per round
        mine = [(p["impl"], p["checkpoint_layers"]) for p in r["points"] if p["round"] == round_]
        assert sorted(mine) == sorted(configs)
    rows = {(x["impl"], x["checkpoint_layers"]): x for x in r["rows"]}
    assert set(rows) == configs
    for x in rows.values():
        assert x["rounds"] == 3 and x["out_of_memory"] == 0 and x["mfu"] is None  # no GPU
        for key in ("tokens_per_s", "peak_MiB", "after_forward_MiB"):
            assert x[key]["min"] <= x[key]["median"] <= x[key]["max"]
        assert x["peak_MiB"]["min"] == x["peak_MiB"]["max"]  # the CPU estimate is exact
    for impl in ("normal", "drop_h"):  # both blocks checkpointed: less memory
        assert rows[impl, 2]["peak_MiB"]["max"] < rows[impl, 0]["peak_MiB"]["max"]
    ample, tight = r["budgets"]
    for impl, best in ample["best_per_impl"].items():  # the fastest of the grid, all fit
        fastest = max((rows[impl, n] for n in (0, 2)), key=lambda x: x["tokens_per_s"]["median"])
        assert best["checkpoint_layers"] == fastest["checkpoint_layers"]
    assert set(ample["best_per_impl"]) == {"normal", "drop_h"}
    assert ample["planner"]["probes"] == 2  # one per impl: nothing needs checkpointing
    assert ample["planner"]["checkpoint_layers"] == 0
    assert ample["planner"]["pick_vs_best_in_grid"] > 0
    here = machine_id()  # one machine ran every point: no ratio is flagged as across two
    assert {p["machine"] for p in r["points"]} == {here} and here.startswith("cpu:")
    assert all(x["machines"] == [here] for x in rows.values())
    assert ample["best_drop_h_vs_normal_machines"] == [here]
    assert ample["planner"]["pick_vs_best_machines"] == [here]
    assert tight["best_per_impl"] == {} and tight["best"] is None
    assert tight["planner"]["error"].startswith("nothing fits the memory budget of 1 MiB")
    md = out["md"].read_text()
    assert "| normal | 2 |" in md and "3 rounds interleaved, 1 warm-up + 1 timed steps" in md
    assert "Points from" not in md and "across machines" not in md
    assert out["png"].read_bytes().startswith(b"\x89PNG")


def test_a_planner_pick_off_the_grid_is_measured_in_as_many_rounds(tmp_path, monkeypatch):
    """The grid holds no checkpointing (0) and the budget is under its peak: the planner picks
    1 or 2 checkpointed blocks (by its own timing), which the grid lacks, and the harness
    measures the pick once per round so far, so it has a median of its own to set against the
    best. No model is ever built while another lives (the allocator's peaks are absolute: a
    held one would count in them)."""
    built = watch_planner_builds(monkeypatch)
    bench, args, out = tiny_normal_grid(tmp_path)
    runner = CliRunner()
    with use_backend("torch"):
        result = runner.invoke(bench.app, [*args, "--rounds", "2"])
        assert result.exit_code == 0, result.output
        [none] = json.loads(out.read_text())["rows"]
        budget_MiB = 0.95 * none["peak_MiB"]["max"]  # both blocks checkpointed: 0.79x of it
        more = ["--rounds", "1", "--append", "--planner", "--budgets-gb", repr(budget_MiB / 1024)]
        result = runner.invoke(bench.app, [*args, *more])
        assert result.exit_code == 0, result.output
    r = json.loads(out.read_text())
    [plan] = r["budgets"]
    pick = plan["planner"]
    assert pick["impl"] == "normal" and pick["checkpoint_layers"] in (1, 2), pick
    # The pick is the smallest peak within the planner's tie of its fastest, which may be
    # another count than that fastest (its best_per_impl): both are measured, nothing else.
    n, fastest = pick["checkpoint_layers"], pick["best_per_impl"]["normal"]
    planned = {n, fastest}
    assert planned <= {1, 2}
    added = [p for p in r["points"] if p.get("planned")]
    assert {p["checkpoint_layers"] for p in added} == planned
    for count in planned:
        mine = [p for p in added if p["checkpoint_layers"] == count]
        assert sorted(p["round"] for p in mine) == [0, 1, 2]
        row = next(x for x in r["rows"] if x["checkpoint_layers"] == count)
        assert row["rounds"] == 3 and row["peak_MiB"]["max"] <= budget_MiB
    best = plan["best_per_impl"]["normal"]
    assert best["checkpoint_layers"] in planned  # the grid's 0 does not fit; the plans do
    medians = {x["checkpoint_layers"]: x["tokens_per_s"]["median"] for x in r["rows"]}
    assert pick["pick_vs_best_in_grid"] == medians[n] / best["tokens_per_s"]
    assert pick["pick_vs_best_in_grid"] <= 1.0
    assert len(built) == 4  # two grid calls, the planner, the pick's rounds: one model each


def test_zero_rounds_add_the_planner_s_plans_to_an_earlier_run_s_rounds(tmp_path):
    """--rounds 0 --append --planner: no grid point is measured again; the plans the planner
    finds off the grid are measured once per earlier round, and each point names its commit
    (here two, so the report names both). Without an earlier run, 0 rounds are refused."""
    bench, args, out = tiny_normal_grid(tmp_path)
    runner = CliRunner()
    with use_backend("torch"):
        refused = runner.invoke(bench.app, [*args, "--rounds", "0", "--planner"])
        assert isinstance(refused.exception, ValueError)
        assert str(refused.exception).startswith("--rounds 0 measures only the planner's plans")
        result = runner.invoke(bench.app, [*args, "--rounds", "2", "--commit", "aaa1111"])
        assert result.exit_code == 0, result.output
        [none] = json.loads(out.read_text())["rows"]
        budget_GiB = 0.95 * none["peak_MiB"]["max"] / 1024
        more = ["--rounds", "0", "--append", "--planner", "--budgets-gb", repr(budget_GiB)]
        more += ["--commit", "bbb2222", "--md", str(tmp_path / "e2e.md")]
        result = runner.invoke(bench.app, [*args, *more])
        assert result.exit_code == 0, result.output
    r = json.loads(out.read_text())
    grid = [p for p in r["points"] if not p.get("planned")]
    planned = [p for p in r["points"] if p.get("planned")]
    assert [(p["round"], p["commit"]) for p in grid] == [(0, "aaa1111"), (1, "aaa1111")]
    pick = r["budgets"][0]["planner"]  # its count and its fastest (may differ by the tie rule)
    counts = {pick["checkpoint_layers"], pick["best_per_impl"]["normal"]}
    assert sorted((p["round"], p["checkpoint_layers"], p["commit"]) for p in planned) == sorted(
        (round_, n, "bbb2222") for round_ in (0, 1) for n in counts
    )
    assert r["rounds"] == 2 and r["commit"] == "bbb2222"
    assert (
        "Commits aaa1111, bbb2222 (each point names its own)" in (tmp_path / "e2e.md").read_text()
    )


def test_the_planner_measures_each_configuration_once_across_budgets(tmp_path, monkeypatch):
    """A profile does not depend on the budget: at an ample budget and at one nothing fits,
    the searches read 1 and 2 profiles per impl, and only the 2 distinct ones are measured."""
    from swiglu_train.bench.e2e import lightning as e2e_lightning

    config = tmp_path / "tiny.yaml"
    config.write_text(TINY)
    cfg = e2e_lightning.configure(str(config), None, None, None, "normal,drop_h")
    measured, real_measurer = [], e2e_lightning.measurer

    def counting(*args, **kwargs):  # the real measurer, its calls counted
        measure = real_measurer(*args, **kwargs)
        return lambda impl, n: measured.append((impl, n)) or measure(impl, n)

    monkeypatch.setattr(e2e_lightning, "measurer", counting)
    with use_backend("torch"):
        ample, tight = e2e_lightning.planner_picks([1024.0, 1.0], ["normal", "drop_h"], cfg)
    assert (ample["probes"], tight["probes"]) == (2, 4)
    assert ample["best_per_impl"] == {"normal": 0, "drop_h": 0}  # each measured in rounds later
    assert tight["error"].startswith("nothing fits the memory budget of 1 MiB")
    assert sorted(measured) == sorted({(i, n) for i in ("normal", "drop_h") for n in (0, 2)})


def test_lightning_steps_accumulate_to_the_global_batch(tmp_path: Path) -> None:
    """--global-batch-size 4 at micro-batch 2: two micro-batches per optimizer step, as the
    planner's measurer runs them; the optimizer's time is reported; a global batch the
    micro-batch does not divide is refused."""
    bench = load_script("bench_e2e")
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY)
    out = {s: tmp_path / f"e2e.{s}" for s in ("json", "md")}
    args = ["lightning", "--config", str(config), "--impls", "normal", "--warmup", "0"]
    args += ["--steps", "1", "--checkpoint-layers", "0", "--rounds", "1"]
    runner = CliRunner()
    with use_backend("torch"):
        bad = runner.invoke(bench.app, [*args, "--global-batch-size", "5"])
        result = runner.invoke(bench.app, [*args, "--global-batch-size", "4", "--json",
                                           str(out["json"]), "--md", str(out["md"])])  # fmt: skip
    assert isinstance(bad.exception, ValueError)
    assert str(bad.exception) == ("--global-batch-size 5: the global batch 5 is not divisible "
                                  "by the micro-batch 2: accumulation must be whole")  # fmt: skip
    assert result.exit_code == 0, result.output
    r = json.loads(out["json"].read_text())
    assert r["accumulate_grad_batches"] == 2 and r["micro_batch_size"] == 2
    [point] = r["points"]
    assert point["optimizer_s"] > 0 and point["tokens_per_s"] > 0
    assert r["rows"][0]["optimizer_s"]["median"] == point["optimizer_s"]
    md = out["md"].read_text()
    assert "micro-batch 2 x 2 per optimizer step" in md and "| optimizer ms |" in md


def test_auto_budgets_fall_between_the_grids_peaks() -> None:
    table = [{"peak_MiB": {"max": v}} for v in (10_240.0, 30_720.0, 51_100.0)] + [
        {"peak_MiB": None}  # out of memory every round
    ]
    assert parse_budgets("auto:3", table) == [20_455, 30_670, 40_885]
    assert parse_budgets("40,60.5", table) == [40_960, 61_952]


def test_megatron_rows_pair_each_round_with_stock() -> None:
    recorded = {  # (round, impl): tokens/s, warm-up steps' tokens/s
        (0, "stock"): (100.0, [10.0, 90.0]),
        (0, "drop_h"): (110.0, [50.0, 100.0]),
        (1, "stock"): (120.0, [12.0, 110.0]),
        (1, "drop_h"): (126.0, [60.0, 120.0]),
    }
    points = [
        {"round": r, "impl": impl, "tokens_per_s": rate, "warmup_tokens_per_s": warm,
         "after_forward_MiB": 1.0, "peak_MiB": 2.0}
        for (r, impl), (rate, warm) in recorded.items()
    ]  # fmt: skip
    rows = {x["impl"]: x for x in megatron_rows(points)}
    # paired: 1.10 and 1.05, median 1.075 (unpaired medians would give 118 / 110)
    assert rows["drop_h"]["vs_stock"] == {"min": 1.05, "median": pytest.approx(1.075),
                                          "max": pytest.approx(1.1)}  # fmt: skip
    assert rows["stock"]["vs_stock"]["median"] == 1.0
    assert rows["stock"]["warmup_tokens_per_s_median"] == [11.0, 100.0]
    assert rows["drop_h"]["tokens_per_s"] == {"min": 110.0, "median": 118.0, "max": 126.0}
    assert rows["stock"]["collate_ms"] is None  # points from before the schedule was split
    points[0]["schedule_host"] = {"collate_s": 0.067}  # stock, round 0
    points[2]["schedule_host"] = {"collate_s": 0.004}  # stock, round 1
    collate = {x["impl"]: x["collate_ms"] for x in megatron_rows(points)}
    assert collate["stock"] == {"min": 4.0, "median": pytest.approx(35.5), "max": 67.0}
    assert collate["drop_h"] is None


@pytest.mark.slow
def test_megatron_rounds_on_cpu_profile_a_step_inside_a_measured_run(tmp_path, monkeypatch):
    """The real recipe (CPU shims, tests/megatron_recipe_cpu.py) under the harness: one round
    of stock and normal, paired; stock's run also profiles its last timed step, so no extra
    process runs; an impl to profile that is not measured is refused."""
    import sys

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the torch path: the kernels are tested elsewhere
    monkeypatch.chdir(tmp_path)
    bench = load_script("bench_e2e")
    torchrun = Path(sys.executable).with_name("torchrun")
    cpu_recipe = Path(__file__).with_name("megatron_recipe_cpu.py")
    launcher = f"{torchrun} --standalone --nproc-per-node 1 {cpu_recipe}"
    tiny = ["--device", "cpu", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size"]
    tiny += ["96", "--num-attention-heads", "4", "--seq-length", "32", "--vocab-size", "128"]
    # four timed steps: py-spy, sampling at 100 Hz beside a loaded CI machine's other workers,
    # caught none of two ~10 ms steps there
    args = ["megatron", "--impls", "stock,normal", "--rounds", "1", "--warmup", "1", "--steps"]
    args += ["4", "--launcher", launcher, "--json", "m.json", "--commit", "ccc3333"]
    runner = CliRunner()
    bad = runner.invoke(bench.app, [*args, "--profile-impls", "drop_h", "--", *tiny])
    assert isinstance(bad.exception, ValueError)
    assert str(bad.exception) == "--profile-impls drop_h: each must be one of --impls stock,normal"
    bad = runner.invoke(bench.app, [*args, "--sample-native", "--", *tiny])
    assert isinstance(bad.exception, ValueError) and "--sample-host DIR" in str(bad.exception)
    assert not (tmp_path / "m.json").exists()  # refused before any run
    # --manual-gc: Megatron-LM's switch, passed through to every run; no collection lands in
    # a step, so the runs' GC time is exactly zero
    extra = ["--profile-impls", "stock", "--profile-dir", "p", "--sample-host", "h"]
    result = runner.invoke(bench.app, [*args, *extra, "--", *tiny, "--manual-gc"])
    assert result.exit_code == 0, result.output
    r = json.loads((tmp_path / "m.json").read_text())
    assert sorted((p["impl"], p["round"], p["commit"]) for p in r["points"]) == [
        ("normal", 0, "ccc3333"), ("stock", 0, "ccc3333")
    ]  # fmt: skip
    rows = {x["impl"]: x for x in r["rows"]}
    stock, normal = (p["tokens_per_s"] for i in ("stock", "normal") for p in r["points"]
                     if p["impl"] == i)  # fmt: skip
    assert rows["normal"]["vs_stock"]["median"] == pytest.approx(normal / stock)
    assert [p["gc_ms_per_step"] for p in r["points"]] == [0.0, 0.0]
    assert all(len(p["timed_tokens_per_s"]) == 4 for p in r["points"])
    phases = [p["phases_s"] for p in r["points"]]
    assert all(set(x) == {"schedule_s", "optimizer_s", "sync_s"} for x in phases)
    assert all(0 <= v < 60 for x in phases for v in x.values())
    held = [p["schedule_host"] for p in r["points"]]
    for h, x in zip(held, phases, strict=True):
        assert 0 < h["collate_s"] + h["copy_s"] + h["forward_s"] < x["schedule_s"]
    assert "'schedule_cpu_s'" in result.output  # each run's line names what held it
    assert all(p["host_threads"]["torch_threads"] >= 1 for p in r["points"])
    # released after the warm-up step, a count of ended processes (0 where none was started)
    assert all(p["compile_workers_released"] >= 0 for p in r["points"])
    assert all(statistics.median(p["timed_tokens_per_s"]) == p["tokens_per_s"] for p in r["points"])
    assert rows["stock"]["gc_ms_per_step"] == {"min": 0.0, "median": 0.0, "max": 0.0}
    assert "GC ms/step" in result.output and "collate ms" in result.output
    stock_point = next(p for p in r["points"] if p["impl"] == "stock")
    collate_s = stock_point["schedule_host"]["collate_s"]  # one round: the row's median is it
    assert rows["stock"]["collate_ms"]["median"] == pytest.approx(1e3 * collate_s)
    profile = json.loads((tmp_path / "p" / "profile_megatron_stock.json").read_text())
    assert (profile["step"], profile["mlp_impl"]) == (4, "stock")  # the last timed step
    assert profile["unit"] == "op (self time)" and profile["total_us"] > 0
    assert not (tmp_path / "p" / "profile_megatron_normal.json").exists()
    # every run sampled by py-spy (the test extra installs it): its stacks kept, and the
    # frames of its steps
    assert sorted(f.name for f in (tmp_path / "h").iterdir()) == [
        "normal_round0.txt", "stock_round0.txt"
    ]  # fmt: skip
    for point in r["points"]:
        frames = [f["frame"] for f in point["host_samples"]["frames"]]
        assert point["host_samples"]["samples"] > 0 and frames[0].startswith("run_step (")
        assert point["host_samples"]["frames"][0]["share"] == 1.0  # the step and below only
        assert not any(f.startswith("main (") for f in frames)
        leaves = point["host_samples"]["leaves"]
        assert leaves and sum(f["share"] for f in leaves) <= 1.0 + 1e-9


def test_a_call_stopped_mid_round_keeps_its_points_for_the_next(tmp_path, monkeypatch):
    """The JSON is written after every point: a call killed at its time bound (here, the third
    point raises) leaves the points it measured, and the next call's --append adds to them."""
    from swiglu_train.bench.e2e import lightning as e2e_lightning

    bench, args, out = tiny_normal_grid(tmp_path)
    args[args.index("0")] = "0,1"  # --checkpoint-layers: two configurations a round
    real_measurer, calls = e2e_lightning.measurer, []

    def stopping(*a, **kw):
        measure = real_measurer(*a, **kw)

        def once(impl, n):
            calls.append((impl, n))
            if len(calls) == 3:
                raise RuntimeError("killed at the call's time bound")
            return measure(impl, n)

        return once

    monkeypatch.setattr(e2e_lightning, "measurer", stopping)
    with use_backend("torch"):
        stopped = CliRunner().invoke(bench.app, [*args, "--rounds", "2"])
        assert isinstance(stopped.exception, RuntimeError)
        kept = json.loads(out.read_text())
        assert kept["partial"] and [p["round"] for p in kept["points"]] == [0, 0]
        assert {p["checkpoint_layers"] for p in kept["points"]} == {0, 1}
        monkeypatch.setattr(e2e_lightning, "measurer", real_measurer)
        added = CliRunner().invoke(bench.app, [*args, "--rounds", "1", "--append"])
    assert added.exit_code == 0, added.output
    r = json.loads(out.read_text())
    assert "partial" not in r and r["rounds"] == 2
    assert r["points"][:2] == kept["points"]  # the stopped call's points, as measured
    assert [p["round"] for p in r["points"][2:]] == [1, 1]


def test_block_costs_read_each_impl_s_unchecked_and_most_checkpointed_rows() -> None:
    def row(impl: str, n: int, tokens: float | None, mib: float) -> dict:
        spread = {"min": tokens, "median": tokens, "max": tokens} if tokens else None
        return {"impl": impl, "checkpoint_layers": n, "tokens_per_s": spread,
                "after_forward_MiB": {"min": mib, "median": mib, "max": mib}}  # fmt: skip

    rows = [
        row("normal", 0, 1000.0, 500.0), row("normal", 2, 900.0, 300.0),
        row("normal", 4, 800.0, 100.0), row("drop_h", 0, 1010.0, 420.0),
        row("drop_h", 4, 760.0, 100.0), row("lonely", 0, 500.0, 50.0),
        row("oom", 0, None, 900.0), row("oom", 4, 700.0, 100.0),
    ]  # fmt: skip
    costs = block_costs(rows)
    assert set(costs) == {"normal", "drop_h"}  # one row, or no unchecked figure: no slope
    expected = {"blocks": 4, "step_time_per_block": (1000 / 800 - 1) / 4, "MiB_per_block": 100.0}
    expected |= {"vs_normal_unchecked": 1.0, "vs_normal_checkpointed": 1.0}
    assert costs["normal"] == pytest.approx(expected)
    assert costs["drop_h"]["step_time_per_block"] == pytest.approx((1010 / 760 - 1) / 4)
    assert costs["drop_h"]["MiB_per_block"] == pytest.approx(80.0)
    assert costs["drop_h"]["vs_normal_unchecked"] == pytest.approx(1.01)
    assert costs["drop_h"]["vs_normal_checkpointed"] == pytest.approx(0.95)


def test_a_ratio_of_rows_from_two_machines_is_flagged_in_the_json_and_the_markdown() -> None:
    """Rounds added by a later call ran on another GPU: the budget's best normal came from one
    machine and the best drop_h from the other, so their ratio mixes two machines' clocks."""

    def point(impl: str, n: int, tokens: float, peak: float, machine: str) -> dict:
        return {"round": 0, "impl": impl, "checkpoint_layers": n, "tokens_per_s": tokens,
                "optimizer_s": 0.1, "after_forward_MiB": peak / 2, "peak_MiB": peak,
                "commit": "abc", "machine": machine}  # fmt: skip

    points = [
        point("normal", 0, 1000.0, 900.0, "GPU-a"), point("drop_h", 0, 1010.0, 800.0, "GPU-a"),
        point("normal", 1, 900.0, 600.0, "GPU-b"), point("drop_h", 1, 910.0, 550.0, "GPU-a"),
    ]  # fmt: skip
    table = [r | {"mfu": None} for r in rows(points, ("impl", "checkpoint_layers"))]
    across = budget_plans(700.0, table, None)  # only the checkpointed rows fit
    assert across["best_drop_h_vs_normal"] == pytest.approx(910 / 900)
    assert across["best_drop_h_vs_normal_machines"] == ["GPU-a", "GPU-b"]
    alike = budget_plans(1000.0, table, None)  # the unchecked rows, both from GPU-a
    assert alike["best_drop_h_vs_normal_machines"] == ["GPU-a"]
    result = {"config": "tiny", "seq_length": 32, "micro_batch_size": 2, "precision": "32",
              "device": "H200", "rounds": 1, "warmup_steps": 1, "timed_steps": 1,
              "memory": ESTIMATE, "command": "bench", "commit": "abc", "points": points,
              "rows": table, "budgets": [across, alike]}  # fmt: skip
    md = lightning_markdown(result)
    assert "Points from 2 machines of that model: A = GPU-a, B = GPU-b." in md
    assert "| normal | 1 | 900 [900, 900] |" in md and md.count(" B |") == 1
    assert md.count(f"best drop_h* ÷ best normal: {910 / 900:.3f} (across machines A+B") == 1
    assert f"best drop_h* ÷ best normal: {1010 / 1000:.3f}\n" in md
    title = plot_budgets(result).axes[0].get_title()
    assert title.endswith("; points from 2 machines: the markdown says which")


def test_a_gpu_is_named_by_its_uuid_or_else_its_model_and_host(monkeypatch) -> None:
    """The CUDA branch, on this CPU: torch's device properties stand in for a GPU's."""
    import socket
    from types import SimpleNamespace

    import torch

    props = SimpleNamespace(name="NVIDIA H200", uuid="5f0c-77")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    assert machine_id() == "GPU-5f0c-77"
    del props.uuid  # a build whose properties lack it
    assert machine_id() == f"NVIDIA H200 on {socket.gethostname()}"
