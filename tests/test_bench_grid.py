"""The model-grid benchmark: the model list, chunking, a real CPU run, merge, auto's evaluation.

The evaluation of impl="auto" needs allocator readings and GPU time, which only CUDA has: it is
tested on a real CPU grid run whose device name, memory readings, GPU and host times and the
auto-model record are then set as an H200 run would have them (``as_h200``); every ratio stays
the measured one. The committed H200 grid is judged again and must read as committed.
"""

import copy
import json
import os
import re
import sys
from importlib import resources
from pathlib import Path

import pytest
import torch
from helpers import auto_model
from matplotlib.figure import Figure
from typer.testing import CliRunner

from swiglu_train.bench.grid import auto as grid_auto
from swiglu_train.bench.grid.crossover import CrossoverConfig
from swiglu_train.bench.grid.models import (
    MODELS,
    GridShape,
    Model,
    grid_shapes,
    select_models,
    shapes_for,
)
from swiglu_train.bench.grid.plan import (
    PREWARM_POINT_S,
    SHAPE_COMPILE_S,
    GridConfig,
    GridPoint,
    parse_chunk,
    split_chunks,
)
from swiglu_train.bench.grid.plot import plot_grid
from swiglu_train.bench.grid.report import to_markdown
from swiglu_train.bench.grid.run import merge_results, missing_points, run_grid
from swiglu_train.bench.mlp.run import BenchConfig
from swiglu_train.bench.prewarm import WORKER_START_S
from swiglu_train.cli import app
from swiglu_train.layers.auto import AutoModel, resolve
from swiglu_train.layers.auto_fit import fit_auto_model
from swiglu_train.layers.auto_rule import ImplStats

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()
IMPLS = ("normal", "drop_h", "save_factors")
# after-forward bytes per M·D and per M·F (x, preact, and h but for drop_h), scaled up 1000x
# so that the tiny shapes read whole MiB
MEMORY = {"normal": (2e3, 6e3), "drop_h": (2e3, 4e3), "save_factors": (2e3, 6e3)}
# GPU time over the floor an H200 run would read, c + a/D (save_factors fastest at D = 16)
GPU_TERMS = {"normal": (1.0, 0.8), "drop_h": (1.01, 0.8), "save_factors": (1.03, 0.16)}
# families a and b share (16, 40); b also has (24, 48); c alone has (32, 64)
TINY = (
    Model("a-1", "a", "org/a-1", 16, 40),
    Model("b-1", "b", "org/b-1", 16, 40),
    Model("b-2", "b", "org/b-2", 24, 48),
    Model("c-1", "c", "org/c-1", 32, 64),
)


def quiet(label, total):
    return lambda: None


@pytest.fixture(scope="module")
def tiny_run() -> dict:
    """A real grid run on CPU: 3 shapes x 2 M, our three portable impls and Liger, made absent
    (it is a test dependency) so that a peer that cannot run is seen reported, not dropped."""
    cfg = GridConfig(
        grid_shapes(TINY), m=(24, 40), variants=(*IMPLS, "liger"), samples=3, warmup=1,
        dtype="fp32", device="cpu",
    )  # fmt: skip
    with pytest.MonkeyPatch.context() as absent:
        for name in [m for m in sys.modules if m.split(".")[0] == "liger_kernel"]:
            absent.delitem(sys.modules, name)
        absent.setitem(sys.modules, "liger_kernel", None)
        return run_grid(cfg, quiet)


def as_h200(result: dict, table_points=((24, 16, 40),)) -> dict:
    """The CPU run with what only an H200 run records: device, memory, GPU-bound step times
    (the floor at 800 TFLOP/s, each impl's GPU time from GPU_TERMS), the model auto read."""
    out = copy.deepcopy(result)
    meta = out["meta"]
    meta |= {"device_name": "NVIDIA H200", "gpu_family": "H200", "quack_available": False}
    meta["command"] = "swiglu-train bench-grid --device cpu"  # run_grid called directly: None
    meta["auto_table"] = {
        "file": "auto_h200.json",
        "commit": "abc1234",
        "device_name": "NVIDIA H200",
        "dtype": "bf16",
        "points": [list(p) for p in table_points],
    }
    for r in out["rows"]:
        c, a = GPU_TERMS[r["variant"]]
        per_md, per_mf = MEMORY[r["variant"]]
        r["after_forward_MiB"] = (per_md * r["M"] * r["D"] + per_mf * r["M"] * r["F"]) / 2**20
        r["peak_MiB"] = 2 * r["after_forward_MiB"]
        r["floor_ms"] = 18 * r["M"] * r["D"] * r["F"] / 800e9
        r["gpu_ms"], r["host_ms"] = (c + a / r["D"]) * r["floor_ms"], r["floor_ms"] / 10
    out["auto_eval"] = grid_auto.evaluate_auto(out)
    return out


def ratios(result: dict, m: int, d: int, f: int) -> dict[str, float]:
    return {
        r["variant"]: r["ratio_to_floor"]
        for r in result["rows"]
        if (r["M"], r["D"], r["F"]) == (m, d, f)
    }


# the model list


def test_the_model_list_is_valid():
    shapes = grid_shapes()
    assert len(shapes) >= 12
    pairs = [(s.d, s.f) for s in shapes]
    assert len(set(pairs)) == len(pairs)
    for m in MODELS:
        for size in (m.d, m.f):
            assert isinstance(size, int) and not isinstance(size, bool) and size > 0
        assert m.family and "/" in m.repo and "gemma" not in m.name.lower()
    assert len({m.name for m in MODELS}) == len(MODELS)
    for m in MODELS:  # each model is on exactly the grid shape of its sizes
        [shape] = [s for s in shapes if m.name in s.models]
        assert (shape.d, shape.f) == (m.d, m.f) and m.family in shape.families
    products = [d * f for d, f in pairs]
    assert products == sorted(products)


def test_models_sharing_a_shape_are_one_point_naming_all():
    by_pair = {(s.d, s.f): s for s in grid_shapes()}
    assert by_pair[(4096, 14336)].models == ("llama3-8b", "mistral-7b")
    assert by_pair[(4096, 11008)].families == ("llama2", "yi", "olmo2")
    assert by_pair[(8192, 28672)].models == ("llama2-70b", "llama3-70b")


def test_select_models_and_explicit_shapes():
    picked = select_models(["mistral-7b", "llama2-7b", "llama3-8b"])
    assert [(s.d, s.f) for s in picked] == [(4096, 11008), (4096, 14336)]
    assert picked[1].models == ("llama3-8b", "mistral-7b")  # every model of the shape
    with pytest.raises(ValueError, match=r"unknown models \['gemma-7b'\]; choose from qwen2.5"):
        select_models(["gemma-7b"])
    listed, custom = shapes_for([(4096, 11008), (16, 40), (16, 40)])
    assert listed.models == ("llama2-7b", "yi-6b", "olmo2-7b")
    assert custom == GridShape(16, 40, ("16x40",), ("16x40",))


# chunks


def test_split_chunks_is_an_ordered_partition_with_the_least_largest_chunk():
    shape = GridShape(8, 8, ("x",), ("x",))
    points = [GridPoint(m, shape) for m in (1, 2, 3, 4, 5, 6)]
    costs = {1: 5.0, 2: 1.0, 3: 1.0, 4: 1.0, 5: 4.0, 6: 2.0}
    chunks = split_chunks(points, 3, lambda run: sum(costs[p.m] for p in run))
    assert [[p.m for p in c] for c in chunks] == [[1], [2, 3, 4], [5, 6]]  # largest: 6
    assert split_chunks(points, 1, len) == [points]
    with pytest.raises(ValueError, match="6 grid points cannot be split into 7 chunks"):
        split_chunks(points, 7, len)


def test_default_grid_in_two_chunks_with_a_prewarm():
    cfg = GridConfig(grid_shapes(), chunk=(1, 2), prewarm_workers=8)
    first, second = cfg.chunks()
    assert first + second == cfg.all_points() and len(cfg.all_points()) == 3 * len(grid_shapes())
    assert 8000 in cfg.m and 8000 % 128  # an M that is no multiple of 128
    assert cfg.points() == first and max(cfg.chunk_s(first), cfg.chunk_s(second)) < 540


def test_grid_and_crossover_points_run_one_layer_with_their_settings():
    """Both sweeps measure each (M, D, F) as one layer with O = D, under their own settings."""
    settings = {"samples": 7, "warmup": 1, "dtype": "fp32", "device": "cpu", "seed": 3}
    want = BenchConfig(shape=(24, 16, 40, 16), variants=IMPLS, stack_layers=0, **settings)
    grid = GridConfig(grid_shapes(TINY), variants=list(IMPLS), **settings)
    assert grid.bench_config(GridPoint(24, GridShape(16, 40, ("a-1",), ("a",)))) == want
    crossover = CrossoverConfig(m=(24,), shapes=((16, 40),), impls=list(IMPLS), **settings)
    assert crossover.bench_config((24, 16, 40)) == want


def test_estimates_charge_a_compile_per_shape_in_the_timing_pass_or_the_prewarm():
    shapes = grid_shapes(TINY)  # 3 shapes x 2 M
    plain = GridConfig(shapes, m=(24, 40))
    warm = GridConfig(shapes, m=(24, 40), prewarm_workers=2)
    points = plain.all_points()
    timing = sum(plain.estimate_s(p) for p in points)
    assert plain.chunk_s(points) == pytest.approx(timing + 3 * SHAPE_COMPILE_S)
    assert [c for _, c in plain.compiling(points)] == [True, False] * 3
    assert [c for _, c in warm.compiling(points)] == [False] * 6 and plain.prewarm_s(points) == 0
    # a shape: its compile and its 2 points' warm-up (steps of ~ns here), in one worker
    shape_s = SHAPE_COMPILE_S + 2 * PREWARM_POINT_S
    assert warm.prewarm_s(points) == pytest.approx(WORKER_START_S + 2 * shape_s)  # 3 on 2
    three = GridConfig(shapes, m=(24, 40), prewarm_workers=3)
    assert three.prewarm_s(points) == pytest.approx(WORKER_START_S + shape_s)
    assert warm.chunk_s(points) == pytest.approx(warm.prewarm_s(points) + timing)


@pytest.mark.parametrize(
    ("value", "error"), [("2", "expected I/N"), ("3/2", "between 1 and N"), ("0/1", "between")]
)
def test_parse_chunk_errors(value, error):
    with pytest.raises(ValueError, match=error):
        parse_chunk(value)
    assert parse_chunk("2/3") == (2, 3)


# a real run on CPU


def test_cpu_run_records_every_point_variant_and_auto_pick(tiny_run):
    result = tiny_run
    dims = [(p["M"], p["D"], p["F"]) for p in result["points"]]
    assert dims == [(m, d, f) for d, f in [(16, 40), (24, 48), (32, 64)] for m in (24, 40)]
    assert result["meta"]["complete"] and result["skipped_points"] == []
    assert missing_points(result) == []
    for m, d, f in dims:
        assert set(ratios(result, m, d, f)) == set(IMPLS)
    assert all(r["ratio_to_floor"] > 0 and r["rel_err_vs_reference"] < 1e-5 for r in result["rows"])
    first = result["points"][0]
    assert first["models"] == ["a-1", "b-1"] and first["families"] == ["a", "b"]
    assert first["skipped"]["liger"].startswith("not importable")
    assert first["auto"]["impl"] == "drop_h" and "not on a CUDA device" in first["auto"]["reason"]
    assert result["auto_eval"] == {
        "skipped": "needs a CUDA run: the model is fitted from allocator readings"
    }


def test_markdown_and_plot_of_a_cpu_run(tiny_run):
    text = to_markdown(tiny_run)
    assert "### M = 24" in text and "### M = 40" in text
    line = next(x for x in text.splitlines() if x.startswith("| a-1, b-1 | 16 | 40 |"))
    measured = ratios(tiny_run, 24, 16, 40)
    assert f"**{min(measured.values()):.3f}**" in line
    assert line.endswith(f"| drop_h {measured['drop_h']:.3f} | — |")  # run's pick; no model
    assert "No allocator readings" in text
    assert "- liger at every point: not importable" in text
    fig = plot_grid(tiny_run)
    assert isinstance(fig, Figure)
    axes = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in axes] == ["M = 24 tokens", "M = 40 tokens"]
    labels = {line.get_label() for ax in axes for line in ax.get_lines()}
    assert {*IMPLS, "auto's pick"} <= labels and "liger" not in labels
    assert axes[0].get_ylabel().startswith("step ÷ six-GEMM floor")
    assert axes[-1].get_xticklabels()[0].get_text() == "16x40\na-1 +1"


# auto's evaluation


def test_judge_the_tolerance_and_the_memory_rule():
    stats = {
        "normal": ImplStats(1.05, 990.0),
        "drop_h": ImplStats(1.058, 685.0),
        "save_factors": ImplStats(1.02, 700.0),
    }
    slow = grid_auto.judge("drop_h", stats)
    assert slow["fastest"] == "save_factors" and slow["rule_pick"] == "save_factors"
    assert slow["pick_over_fastest"] == pytest.approx(1.058 / 1.02)
    assert not slow["within_tolerance"] and not slow["pick_is_rule"]
    tie = grid_auto.judge("normal", {k: stats[k] for k in ("normal", "drop_h")})
    assert tie["within_tolerance"] and tie["rule_pick"] == "drop_h"  # 1.058 <= 1.05 * 1.01
    assert tie["rule_after_forward_MiB"] == 685.0 and not tie["pick_is_rule"]
    absent = grid_auto.judge("drop_h_quack", stats)
    assert absent["pick_ratio"] is None and not absent["within_tolerance"]


def test_picks_during_the_run_are_judged_and_flagged_in_sample(tiny_run):
    evaluation = as_h200(tiny_run)["auto_eval"]
    during = evaluation["during_run"]
    assert len(during) == 6
    for e in during:
        measured = ratios(tiny_run, e["M"], e["D"], e["F"])
        fastest = min(measured, key=measured.get)
        assert e["pick"] == "drop_h" and e["fastest"] == fastest  # the CPU run's fallback
        assert e["pick_over_fastest"] == pytest.approx(measured["drop_h"] / measured[fastest])
        assert e["within_tolerance"] == (measured["drop_h"] <= measured[fastest] * 1.01)
        assert e["in_sample"] == ((e["D"], e["F"]) == (16, 40))
    out = evaluation["during_run_out_of_sample_summary"]
    assert out["picks"] == 4
    assert out["within_tolerance"] == sum(e["within_tolerance"] for e in during[2:])


def test_the_shipped_model_is_judged_at_every_point(tiny_run):
    """The package's H200 model was fitted at D 896-8192: the tiny grid's D 16-32 are out of
    its reach, so it falls back, out of sample; a model fitted from the tiny grid itself,
    judged in its place, predicts every point in sample."""
    result = as_h200(tiny_run)
    shipped = result["auto_eval"]["shipped"]
    package_file = resources.files("swiglu_train.layers") / "auto_h200.json"
    assert shipped["file"] == "auto_h200.json"
    assert shipped["commit"] == json.loads(package_file.read_text())["commit"]
    assert list(shipped["points"]) == ["without_quack"]  # the run had no quack
    for e in shipped["points"]["without_quack"]:
        assert e["pick"] == "drop_h" and "D=" in e["reason"] and "outside the range" in e["reason"]
        assert not e["in_sample"] and e["predicted_ratio"] is None
    fitted = AutoModel.from_dict(fit_auto_model(result, "fit"))
    mine = grid_auto.evaluate_auto(result, (fitted, "tiny.json"))["shipped"]
    assert mine["file"] == "tiny.json"
    entries = mine["points"]["without_quack"]
    assert [e["pick"] for e in entries] == ["save_factors"] * 2 + ["normal"] * 4
    for e in entries:
        auto = resolve(e["M"], e["D"], e["F"], "NVIDIA H200", fitted, quack=False)
        assert e["in_sample"] and e["pick"] == auto.impl and e["reason"] == auto.reason
        c, a = GPU_TERMS[e["pick"]]
        assert e["predicted_ratio"] == pytest.approx(c + a / e["D"], rel=1e-4)
    assert mine["summary"]["without_quack"]["picks"] == 6
    assert mine["out_of_sample_summary"]["without_quack"]["picks"] == 0


def test_leave_one_family_out_models_hold_out_every_shape_of_the_family(tiny_run):
    result = as_h200(tiny_run)
    shapes = {f: {(d, f_) for _, d, f_ in grid_auto.lofo_model(result, f).points} for f in "ac"}
    assert shapes == {"a": {(24, 48), (32, 64)}, "c": {(16, 40), (24, 48)}}
    with pytest.raises(ValueError, match="c \\+ a/D needs two D or more"):
        grid_auto.lofo_model(result, "b")  # only (32, 64) is left
    evaluation = {e["family"]: e for e in result["auto_eval"]["lofo"]}
    assert evaluation["b"]["skipped"].startswith("no model to fit: normal: GPU-bound points")
    judged = {
        f: [(p["M"], p["D"], p["F"]) for p in evaluation[f]["points"]["without_quack"]]
        for f in "ac"
    }
    assert judged == {"a": [(24, 16, 40), (40, 16, 40)], "c": [(24, 32, 64), (40, 32, 64)]}
    for family in "ac":
        model = grid_auto.lofo_model(result, family)
        assert evaluation[family]["model_shapes"] == sorted(shapes[family])
        for p in evaluation[family]["points"]["without_quack"]:
            auto = resolve(p["M"], p["D"], p["F"], "NVIDIA H200", model, quack=False)
            assert p["pick"] == auto.impl and p["reason"] == auto.reason
            assert not p["in_sample"] and (p["D"], p["F"]) not in shapes[family]
    assert result["auto_eval"]["lofo_summary"]["without_quack"]["picks"] == 4


def test_a_family_with_every_shape_has_no_model_to_fit(tiny_run):
    result = as_h200(tiny_run)
    for p in result["points"]:
        p["families"] = [*p["families"], "all"]
    with pytest.raises(ValueError, match="no rows of our impls"):
        grid_auto.lofo_model(result, "all")
    [entry] = [e for e in grid_auto.evaluate_auto(result)["lofo"] if e["family"] == "all"]
    assert entry["skipped"].startswith("no model to fit: no rows") and "points" not in entry


def test_with_quack_in_the_run_both_impl_sets_are_judged(tiny_run):
    """Judged on a CPU machine, a model's quack impl stays eligible when the run had quack,
    and the portable impls are judged again as on a machine without it."""
    result = as_h200(tiny_run)
    result["meta"]["quack_available"] = True
    quack_fastest = auto_model({"normal": (1.05, 6.0), "drop_h_quack": (1.0, 4.0)})
    evaluation = grid_auto.evaluate_auto(result, (AutoModel.from_dict(quack_fastest), "q.json"))
    assert evaluation["impl_sets"] == ["with_quack", "without_quack"]
    shipped = evaluation["shipped"]["points"]
    assert {e["pick"] for e in shipped["with_quack"]} == {"drop_h_quack"}  # not measured:
    assert all(e["pick_ratio"] is None and not e["within_tolerance"] for e in shipped["with_quack"])
    assert {e["pick"] for e in shipped["without_quack"]} == {"normal"}
    assert set(evaluation["lofo_summary"]) == {"with_quack", "without_quack"}


def test_a_run_of_some_variants_judges_auto_only_among_those_timed(tiny_run):
    """A grid of a few variants (bench-grid --variants): an impl set none of whose impls ran is
    not judged, where it used to stop the run's report with an empty min()."""
    result = as_h200(tiny_run)
    result["rows"] = [r for r in result["rows"] if r["variant"] in ("drop_h", "liger")]
    result["meta"]["variants"] = ["drop_h", "liger"]
    evaluation = grid_auto.evaluate_auto(result)
    assert evaluation["impl_sets"] == ["without_quack"]
    assert {e["fastest"] for e in evaluation["during_run"]} == {"drop_h"}
    result["meta"] |= {"variants": ["quack", "liger"], "quack_available": True}
    result["rows"] = [r for r in result["rows"] if r["variant"] == "liger"]
    skipped = grid_auto.evaluate_auto(result)["skipped"]
    assert skipped == "no impl of ours was timed (only ['quack', 'liger']): nothing to pick"


def test_markdown_of_the_evaluation(tiny_run):
    result = as_h200(tiny_run)
    text = to_markdown(result)
    assert "- **Picked during the run** (what ParMLP resolved to on the GPU, from " in text
    assert "auto_h200.json, commit abc1234): " in text
    e = result["auto_eval"]["during_run"][0]
    verdict = "yes" if e["within_tolerance"] else "**no**"
    row = (
        f"| 24 | 16 | 40 | a-1, b-1 | yes (in sample) | drop_h | {e['fastest']} "
        f"| {e['pick_over_fastest']:.3f} | {verdict} | {e['rule_pick']} |"
    )
    assert row in text.splitlines()
    assert "#### Shipped model, without quack (portable impls only)" in text
    assert "#### Leave one family out, without quack (portable impls only)" in text
    lofo = result["auto_eval"]["lofo"][0]["points"]["without_quack"][0]  # family a
    assert any(
        x.startswith(f"| a | 24 | 16 | 40 | {lofo['pick']} | {lofo['predicted_ratio']:.3f} |")
        for x in text.splitlines()
    )
    assert "- b: no model to fit: normal: GPU-bound points" in text
    assert "| a-1, b-1 | 24 | 16 | 40 | 6 / 12 | 4 / 9 | 6 / 12 | — |" in text.splitlines()


def test_the_committed_quack_regrid_reads_as_judged_now():
    """grid_quack_h200 timed four variants: its report is the committed one, and auto is
    judged only among the two impls of ours it timed."""
    grid = json.loads((ROOT / "benchmarks/results/grid/grid_quack_h200.json").read_text())
    assert grid["meta"]["variants"] == ["drop_h_quack", "save_factors_quack", "quack", "liger"]
    evaluation = grid_auto.evaluate_auto(grid)
    assert json.loads(json.dumps(evaluation)) == grid["auto_eval"]
    assert evaluation["impl_sets"] == ["with_quack"]
    assert to_markdown(grid) == (ROOT / "benchmarks/results/grid/grid_quack_h200.md").read_text()


def test_the_committed_h200_grid_reads_as_judged_now():
    """Judged again with the shipped model, the committed grid's evaluation and markdown are
    the committed ones (the LOFO and shipped summaries the docs quote among them)."""
    grid = json.loads((ROOT / "benchmarks/results/grid/grid_h200.json").read_text())
    evaluation = grid_auto.evaluate_auto(grid)
    assert json.loads(json.dumps(evaluation)) == grid["auto_eval"]
    assert to_markdown(grid) == (ROOT / "benchmarks/results/grid/grid_h200.md").read_text()
    lofo = evaluation["lofo_summary"]
    line = next(x for x in to_markdown(grid).splitlines() if "**Leave one family out**" in x)
    for name, label in (("with_quack", "with quack"), ("without_quack", "without quack")):
        count = f"{lofo[name]['within_tolerance']}/{lofo[name]['picks']} within tolerance"
        assert f"{label}" in line and count in line
    assert lofo["with_quack"]["picks"] == lofo["without_quack"]["picks"] == 57


# the command and merge


def cli_chunk(tmp_path, monkeypatch, chunk: str, name: str) -> dict:
    out = tmp_path / f"{name}.json"
    args = ["bench-grid", "--device", "cpu", "--dtype", "fp32", "--shapes", "16x40,32x64"]
    args += ["--m", "24", "--variants", "normal,drop_h", "--samples", "2", "--warmup", "1"]
    args += ["--chunk", chunk, "--json", str(out)]
    monkeypatch.setattr("sys.argv", ["swiglu-train", *args])  # what the result records
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def chunks(tmp_path_factory):
    path = tmp_path_factory.mktemp("grid")
    with pytest.MonkeyPatch.context() as mp:
        return path, [cli_chunk(path, mp, c, n) for c, n in (("1/2", "a"), ("2/2", "b"))]


def test_cli_chunks_and_merge(chunks, tmp_path):
    path, (a, b) = chunks
    assert [(p["D"], p["F"]) for p in a["points"]] == [(16, 40)]
    assert [(p["D"], p["F"]) for p in b["points"]] == [(32, 64)]
    assert a["meta"]["chunk"] == "1/2"
    assert a["meta"]["command"].endswith(f"--chunk 1/2 --json {path / 'a.json'}")
    out = tmp_path / "merged.json"
    args = ["bench-grid", "--merge", str(path / "a.json"), str(path / "b.json")]
    args += ["--json", str(out), "--md", str(tmp_path / "m.md"), "--plot", str(tmp_path / "m.png")]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    merged = json.loads(out.read_text())
    assert [(p["M"], p["D"], p["F"]) for p in merged["points"]] == [(24, 16, 40), (24, 32, 64)]
    assert len(merged["rows"]) == 4 and merged["meta"]["complete"]
    assert [c["chunk"] for c in merged["meta"]["chunks"]] == ["1/2", "2/2"]
    assert merged["meta"]["command"] == f"{a['meta']['command']} && {b['meta']['command']}"
    assert "| 16x40 | 16 | 40 |" in (tmp_path / "m.md").read_text()
    assert (tmp_path / "m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_prewarm_times_the_same_points_and_records_itself(chunks, tmp_path):
    """--prewarm-workers 2: the points are first run in worker processes, then the same points
    and variants are timed as in the chunks run without a pre-warm."""
    _, (a, b) = chunks
    out = tmp_path / "warm.json"
    args = ["bench-grid", "--device", "cpu", "--dtype", "fp32", "--shapes", "16x40,32x64"]
    args += ["--m", "24", "--variants", "normal,drop_h", "--samples", "2", "--warmup", "1"]
    result = runner.invoke(app, [*args, "--prewarm-workers", "2", "--json", str(out)])
    assert result.exit_code == 0, result.output
    warm = json.loads(out.read_text())

    def measured(r: dict) -> dict:
        return {
            (p["M"], p["D"], p["F"]): sorted(
                row["variant"] for row in r["rows"] if (row["M"], row["D"], row["F"]) == dims
            )
            for p in r["points"]
            for dims in [(p["M"], p["D"], p["F"])]
        }

    assert measured(warm) == measured(a) | measured(b)
    assert list(measured(warm)) == [(24, 16, 40), (24, 32, 64)] and warm["meta"]["complete"]
    assert [p["skipped"] for p in warm["points"]] == [a["points"][0]["skipped"], {}]
    record = warm["meta"]["prewarm"]
    assert record["workers"] == 2 and record["points"] == 2 and record["worker_errors"] == []
    assert 0 < record["elapsed_s"] <= warm["meta"]["elapsed_s"]
    assert a["meta"]["prewarm"] == {"workers": 0, "estimated_s": 0, "elapsed_s": 0.0}
    text = re.sub(r"\s+", " ", result.output)
    pids = re.findall(r"\[pre-warm [12]/2\] M=24 D=(\d+) F=\d+: \d+ s in worker (\d+)", text)
    assert sorted(d for d, _ in pids) == ["16", "32"]
    assert all(int(pid) != os.getpid() for _, pid in pids) and "not warmed" not in text


def test_cli_merge_fits_the_auto_model_and_judges_it(tiny_run, tmp_path, monkeypatch):
    """--auto-model: the model fitted from the merged rows is written, cites the command, and
    is the one judged as shipped; the merged file merged again alone stays as it is."""
    chunk = tmp_path / "h200.json"
    chunk.write_text(json.dumps(as_h200(tiny_run)))
    out, model_path = tmp_path / "merged.json", tmp_path / "auto_tiny.json"
    args = ["bench-grid", "--merge", str(chunk), "--json", str(out)]
    args += ["--auto-model", str(model_path)]
    monkeypatch.setattr("sys.argv", ["swiglu-train", *args])
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    merged, written = json.loads(out.read_text()), json.loads(model_path.read_text())
    assert written["command"] == "swiglu-train " + " ".join(args)
    assert written == fit_auto_model(merged, written["command"])
    shipped = merged["auto_eval"]["shipped"]
    assert shipped["file"] == "auto_tiny.json" and shipped["command"] == written["command"]
    assert all(e["in_sample"] for e in shipped["points"]["without_quack"])
    again = merge_results({"merged.json": merged})
    assert {k: again[k] for k in ("meta", "points", "rows", "skipped_points")} == {
        k: merged[k] for k in ("meta", "points", "rows", "skipped_points")
    }
    assert again["auto_eval"]["shipped"]["file"] == "auto_h200.json"  # the package's, now


def test_cli_auto_model_needs_cuda_readings(chunks, tmp_path):
    path, _ = chunks
    out, model_path = tmp_path / "m.json", tmp_path / "auto.json"
    args = ["bench-grid", "--merge", str(path / "a.json"), str(path / "b.json")]
    result = runner.invoke(app, [*args, "--json", str(out), "--auto-model", str(model_path)])
    assert result.exit_code == 2
    assert "needs CUDA readings" in re.sub(r"\s+", " ", result.output)
    assert json.loads(out.read_text())["meta"]["chunk"] == "merged"  # written all the same
    assert not model_path.exists()
    result = runner.invoke(app, ["bench-grid", "--device", "cpu", "--auto-model", "a.json"])
    assert result.exit_code == 2
    assert "an auto model is fitted from CUDA readings" in re.sub(r"\s+", " ", result.output)


@pytest.mark.parametrize(
    ("key", "value", "error"),
    [
        ("dtype", "bf16", "different dtype"),
        ("device_name", "NVIDIA H200", "different device_name"),
        ("commit", "0000000", "different commit"),
    ],
)
def test_merge_refuses_chunks_of_different_runs(chunks, key, value, error):
    _, (a, b) = chunks
    other = copy.deepcopy(b)
    other["meta"][key] = value
    with pytest.raises(ValueError, match=error) as e:
        merge_results({"a.json": a, "b.json": other})
    assert "a.json:" in str(e.value) and "b.json:" in str(e.value)


def test_merge_refuses_a_point_twice_and_other_files(chunks, tmp_path):
    path, (a, _) = chunks
    with pytest.raises(ValueError, match=r"M=24 D=16 F=40 is measured in both a\.json and c\.json"):
        merge_results({"a.json": a, "c.json": a})
    bogus = tmp_path / "x.json"
    bogus.write_text(json.dumps({"rows": []}))
    result = runner.invoke(app, ["bench-grid", "--merge", str(path / "a.json"), str(bogus)])
    assert result.exit_code == 2
    assert "not a bench-grid --json result: missing keys ['meta', 'points', 'skipped_points']" in (
        re.sub(r"\s+", " ", result.output)
    )


def test_merge_lists_points_a_chunk_never_reached(chunks):
    _, (a, b) = chunks
    cut = copy.deepcopy(b)
    cut["points"], cut["rows"], cut["meta"]["complete"] = [], [], False
    merged = merge_results({"a.json": a, "b.json": cut})
    assert not merged["meta"]["complete"] and missing_points(merged) == [(24, 32, 64)]
    assert "- M=24 D=32 F=64: not measured (its chunk stopped before it)" in to_markdown(merged)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--models", "gemma-7b"], "unknown models ['gemma-7b']"),
        (["--models", "llama2-7b", "--shapes", "16x40"], "give --models or --shapes, not both"),
        (["--chunk", "3/2"], "I must be between 1 and N"),
        (["--shapes", "16x40", "--m", "24", "--chunk", "1/2"], "cannot be split into 2 chunks"),
        (["--variants", "normal,nope"], "unknown variants ['nope']"),
    ],
)
def test_cli_rejects_bad_arguments(args, message):
    result = runner.invoke(app, ["bench-grid", "--device", "cpu", *args])
    assert result.exit_code == 2 and message in re.sub(r"\s+", " ", result.output)


def test_cli_dry_run_prints_the_plan_without_running():
    result = runner.invoke(app, ["bench-grid", "--dry-run", "--chunk", "2/2", "--m", "8000"])
    assert result.exit_code == 0, result.output
    assert re.search(r"chunk 2/2: \d+ points, ~\d+ s <- this chunk", result.output)
    assert "M=8000 D=8192 F=28672 (llama2-70b, llama3-70b)" in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer without CUDA")
def test_cli_without_cuda_says_so_before_running(tmp_path):
    out = tmp_path / "grid.json"
    result = runner.invoke(app, ["bench-grid", "--json", str(out)])
    assert result.exit_code == 2 and "CUDA is not available" in result.output
    assert not out.exists()


def test_results_from_before_the_gemm_choices_record_still_merge(chunks):
    """Grids measured before bench-grid recorded its GEMM choices ran the defaults: their
    chunks merge among themselves, and not with a chunk that records the choices."""
    _, (a, b) = chunks
    old_a, old_b = copy.deepcopy(a), copy.deepcopy(b)
    for part in (old_a, old_b):
        del part["meta"]["gemm_choices"]
    merged = merge_results({"a.json": old_a, "b.json": old_b})
    assert merged["meta"]["complete"] and "gemm_choices" not in merged["meta"]
    with pytest.raises(ValueError, match="different gemm_choices"):
        merge_results({"a.json": old_a, "b.json": b})
