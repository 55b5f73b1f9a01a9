"""The inference benchmark: its pure-python pieces on fake timings, a CPU smoke run, CUDA graphs."""

import json

import numpy as np
import pytest
import torch
from conftest import HAS_CUDA
from helpers import dispatch_table
from typer.testing import CliRunner

from swiglu_train.bench.inference import dispatch as fit
from swiglu_train.bench.inference import run as bench
from swiglu_train.bench.inference import variants as iv
from swiglu_train.cli import app
from swiglu_train.ops import dispatch


@pytest.fixture(autouse=True)
def _no_measured_table():
    """The dispatched variant ("ours") takes the default rules, whatever the shipped table holds."""
    with dispatch.use_table(dispatch_table()):
        yield


def test_build_row_takes_the_faster_eager_and_pairs_ratios():
    times = {  # ms per call over 3 samples; sample 2 ran slow for everyone
        "eager_fused": np.array([1.0, 1.0, 3.0]),
        "eager_separate": np.array([0.8, 0.9, 2.7]),
        "ours": np.array([0.4, 0.5, 0.9]),
        "gemm_only": np.array([0.2, 0.4, 0.6]),
    }
    row = bench.build_row("gated", "7b", 16, 3584, 18944, times, {"ours": 1e-3}, {"quack": "x"})
    assert [row[k] for k in ("table", "model", "M", "K", "N")] == ["gated", "7b", 16, 3584, 18944]
    assert row["eager_variant"] == "eager_separate" and row["eager_ms"] == 0.9
    assert row["ours_ms"] == 0.5 and row["ours_rel_err"] == 1e-3
    # paired: median of (0.8/0.4, 0.9/0.5, 2.7/0.9) = 2.0, not 0.9/0.5 = 1.8 of the medians
    assert row["ours_speedup_vs_eager"] == pytest.approx(2.0)
    assert row["ours_over_gemm_only"] == pytest.approx(np.median([2.0, 1.25, 1.5]))
    assert "eager_fused_speedup_vs_eager" not in row and row["skipped"] == {"quack": "x"}
    with pytest.raises(RuntimeError, match="eager reference did not run"):
        bench.build_row("mlp", "7b", 1, 8, 8, {"ours": times["ours"]}, {}, {})


def test_fit_dispatch_takes_the_fastest_timed_candidate_per_shape_and_m():
    def row(table, k, m, **ms):
        return {"table": table, "K": k, "N": 2 * k, "M": m} | {f"{n}_ms": v for n, v in ms.items()}

    rows = [
        row("mlp", 8, 16, fused_mlp=1.0, gated_linear=2.0, cublas_act_linear=3.0, ours=0.5),
        row("mlp", 8, 1, fused_mlp=1.0, gated_linear=1.25, eager=0.1),  # not candidates
        row("mlp", 8, 4096, gated_linear=2.0, cublas_act_linear=1.0),  # fused_mlp skipped
        row("mlp", 16, 1, gated_linear=1.0),  # one candidate timed: no runner-up
        row("mlp", 16, 2, eager=1.0),  # none timed: no entry
        row("gated", 8, 1, gated_triton=3.0, cublas_act=2.0, gated_linear=0.1),
    ]
    entry = fit.fit_dispatch(rows)
    assert entry == {
        "8x16": {
            "gated": {"1": _entry("cublas", 2.0, "gated", 1.5)},
            "mlp": {
                "1": _entry("fused_mlp", 1.0, "gated", 1.25),
                "16": _entry("fused_mlp", 1.0, "gated", 2.0),
                "4096": _entry("cublas", 1.0, "gated", 2.0),
            },
        },
        "16x32": {"mlp": {"1": _entry("gated", 1.0, None, None)}},
    }
    assert list(entry["8x16"]["mlp"]) == ["1", "16", "4096"]  # by M, whatever the row order
    result = {"gpu": "cpu", "commit": "abc", "meta": {"dtype": "fp32"}, "dispatch": entry}
    with dispatch.use_table(fit.dispatch_table(result, "test")):  # the runtime reads it back
        paths = [dispatch.choose("mlp", 8, 16, m) for m in (1, 16, 4096)]
        assert paths == ["fused_mlp", "fused_mlp", "cublas"]
        assert dispatch.choose("gated", 8, 16, 1) == "cublas"


def test_a_near_tie_goes_to_the_path_with_fewer_launches():
    def row(table, m, **ms):
        return {"table": table, "K": 8, "N": 16, "M": m} | {f"{n}_ms": v for n, v in ms.items()}

    rows = [
        row("mlp", 1, fused_mlp=1.0, gated_linear=1.015),  # tied: gated + cuBLAS, 2 launches
        row("mlp", 16, fused_mlp=1.0, gated_linear=1.03),  # past NEAR_TIE: the faster
        row("gated", 1, cublas_act=1.0, gated_triton=1.02),  # NEAR_TIE itself still ties
        row("gated", 16, quack_act=1.0, gated_triton=1.01),  # one launch each: the faster
    ]
    fitted = fit.fit_dispatch(rows)["8x16"]
    assert fitted["mlp"]["1"] == _entry("gated", 1.015, "fused_mlp", 0.9852)
    assert fitted["mlp"]["16"]["path"] == "fused_mlp"
    assert fitted["gated"]["1"] == _entry("gated", 1.02, "cublas", 0.9804)
    assert fitted["gated"]["16"]["path"] == "quack"


def test_quack_s_fallback_is_the_near_tie_rule_without_quack():
    """quack ties cuBLAS (1.9 %) but not the gated GEMM (3.5 %); without quack the gated GEMM
    ties cuBLAS (1.6 %) with fewer launches, so it, not the runner-up, is the fallback."""
    rows = [
        {"table": "gated", "K": 8, "N": 16, "M": 1}
        | {"quack_act_ms": 1.0, "cublas_act_ms": 1.019, "gated_triton_ms": 1.035}
    ]
    entry = fit.fit_dispatch(rows)["8x16"]["gated"]["1"]
    assert (entry["path"], entry["runner_up"], entry["fallback"]) == ("quack", "cublas", "gated")
    alone = fit.fit_dispatch([{k: v for k, v in rows[0].items() if k != "quack_act_ms"}])
    assert alone["8x16"]["gated"]["1"]["path"] == entry["fallback"]  # a machine without quack


def test_merge_joins_runs_split_by_model_and_refits_the_dispatch():
    def part(model, k, ms, gpu="H200", commit="abc"):
        rows = [
            {"table": "mlp", "model": model, "K": k, "N": 2 * k, "M": 1}
            | {"fused_mlp_ms": ms, "gated_linear_ms": 1.0, "eager_ms": 2.0}
            | {"fused_mlp_speedup_vs_eager": 2.0 / ms, "gated_linear_speedup_vs_eager": 2.0}
        ]
        meta = {"dtype": "bf16", "models": [model]}
        return {"gpu": gpu, "commit": commit, "meta": meta, "rows": rows, "command": model}

    merged = fit.merge_results([part("a", 8, 0.5), part("b", 16, 2.0)])
    assert [r["model"] for r in merged["rows"]] == ["a", "b"]
    assert merged["dispatch"]["8x16"]["mlp"]["1"]["path"] == "fused_mlp"
    assert merged["dispatch"]["16x32"]["mlp"]["1"]["path"] == "gated"
    assert [p["models"] for p in merged["meta"]["parts"]] == [["a"], ["b"]]
    assert merged["command"] == "a && b"
    assert (
        merged["dispatch_judged_in_sample"]["mlp"]["geomean_speedup_vs_eager"] == 2.828
    )  # sqrt(4 * 2)
    with pytest.raises(ValueError, match="different gpus"):
        fit.merge_results([part("a", 8, 0.5), part("b", 16, 2.0, gpu="A100")])
    with pytest.raises(ValueError, match="different commits"):
        fit.merge_results([part("a", 8, 0.5), part("b", 16, 2.0, commit="def")])
    with pytest.raises(ValueError, match="more than one run"):
        fit.merge_results([part("a", 8, 0.5), part("a", 8, 0.7)])


def test_judge_table_scores_a_shipped_table_on_another_run(tmp_path):
    """Out of sample: the shipped table's picks, timed in this run, whatever this run's refit
    would pick; rows keep their in-sample fields."""

    def result(fused_ms, gpu="H200"):
        rows = [
            {"table": "mlp", "model": "a", "K": 8, "N": 16, "M": 1, "eager_ms": 2.0, "skipped": {}}
            | {"eager_variant": "eager"}
            | {"fused_mlp_ms": fused_ms, "gated_linear_ms": 1.0, "gemm_only_ms": 0.8}
            | {"fused_mlp_speedup_vs_eager": 2.0 / fused_ms, "gated_linear_speedup_vs_eager": 2.0}
        ]
        meta = {"dtype": "bf16", "models": ["a"]}
        return {"gpu": gpu, "commit": "abc", "meta": meta, "rows": rows, "command": "a"}

    shipped = fit.dispatch_table(fit.merge_results([result(0.5)]), "fit run")  # fused_mlp wins
    (tmp_path / "table.json").write_text(json.dumps(shipped))
    (tmp_path / "run.json").write_text(json.dumps(result(1.6)))  # now fused_mlp loses
    out = tmp_path / "out.json"
    args = ["bench-inference", "--merge", str(tmp_path / "run.json"), "--json", str(out)]
    cli = CliRunner().invoke(app, [*args, "--judge-table", str(tmp_path / "table.json")])
    assert cli.exit_code == 0, cli.output
    saved = json.loads(out.read_text())
    outside = saved["dispatch_judged_out_of_sample"]
    assert outside["table"].endswith("table.json") and outside["table_commit"] == "abc"
    assert outside["judged"]["mlp"]["geomean_speedup_vs_eager"] == 1.25  # fused_mlp: 2 / 1.6
    assert outside["judged"]["mlp"]["max_over_gemm_only"] == 2.0
    assert saved["rows"][0]["dispatched_path"] == "gated"  # the in-sample refit's pick
    assert "judged on this run's rows (out of sample)" in cli.output
    (tmp_path / "table.json").write_text(json.dumps(shipped | {"gpu": "A100"}))
    cli = CliRunner().invoke(app, [*args, "--judge-table", str(tmp_path / "table.json")])
    assert cli.exit_code != 0 and "was fit on A100 bf16; this run is H200 bf16" in cli.output


def test_judge_table_takes_the_paths_dispatch_would_at_any_shape_and_m():
    """Out of sample, each row gets what ops.dispatch serves with the table: the nearest shape
    and M, and a quack entry's fallback where this run did not time quack;
    a pick this run did not time is named, not judged on the other rows alone."""

    def row(model, k, n, m, **ms):
        speedups = {f"{v}_speedup_vs_eager": 2.0 / t for v, t in ms.items()}
        base = {"table": "gated", "model": model, "K": k, "N": n, "M": m, "eager_ms": 2.0}
        return base | {f"{v}_ms": t for v, t in ms.items()} | speedups

    def result(rows):
        return {"gpu": "H200", "commit": "abc", "meta": {"dtype": "bf16"}, "rows": rows}

    fitted = fit.merge_results([result([  # quack at M=1 (falling back to gated), cuBLAS at 16
        row("a", 8, 16, 1, quack_act=1.0, gated_triton=1.1, cublas_act=1.5),
        row("a", 8, 16, 16, quack_act=2.0, gated_triton=3.0, cublas_act=1.0),
    ])])  # fmt: skip
    table = fit.dispatch_table(fitted, "fit run")
    assert table["shapes"]["8x16"]["gated"]["1"]["fallback"] == "gated"
    run = result(
        [  # no quack here; M=4 and 8x32 were never measured by the table's run
            row("b", 8, 16, 1, gated_triton=1.0, cublas_act=2.0),
            row("b", 8, 16, 4, gated_triton=1.0, cublas_act=0.5),
            row("c", 8, 32, 16, gated_triton=4.0, cublas_act=1.0),
        ]
    )
    judged = fit.judge_table(run, table, "t.json")["judged"]["gated"]
    assert judged["rows"] == 3  # gated (fallback), gated (nearest M is 1), cublas (nearest shape)
    assert judged["geomean_speedup_vs_eager"] == 2.0  # 2/1, 2/1, 2/1
    del run["rows"][2]["cublas_act_ms"]
    with pytest.raises(ValueError, match="picks cublas for gated 8x32 at c M=16, which this run"):
        fit.judge_table(run, table, "t.json")


def test_judge_dispatch_scores_the_fitted_choice_in_sample():
    def row(model, m, cand, speedup, **ms):
        base = {"table": "gated", "model": model, "K": 8, "N": 16, "M": m}
        return base | {f"{n}_ms": v for n, v in ms.items()} | {f"{cand}_speedup_vs_eager": speedup}

    rows = [  # M=1: gated_triton wins at 2x eager; M=16: cublas_act wins, slower than compile
        row("a", 1, "gated_triton", 2.0, gated_triton=1.0, cublas_act=1.5, eager=2.0,
            compile=1.8, gemm_only=0.8),
        row("a", 16, "cublas_act", 0.5, gated_triton=3.0, cublas_act=2.0, eager=2.1,
            compile=1.9, gemm_only=1.0),
    ]  # fmt: skip
    judged = fit.judge_dispatch(rows, fit.fit_dispatch(rows))["gated"]
    assert judged["rows"] == 2 and judged["geomean_speedup_vs_eager"] == 1.0  # sqrt(2 * 0.5)
    assert judged["max_over_gemm_only"] == 2.0 and judged["max_over_gemm_only_at"] == "a M=16"
    assert judged["slower_than_eager_and_compile"] == ["a M=16: 1.053x"]
    assert [r["dispatched_path"] for r in rows] == ["gated", "cublas"]
    assert rows[0]["dispatched_over_best_baseline"] == pytest.approx(1.0 / 1.8)


def test_plot_draws_every_timed_line_against_the_gemms_alone():
    from swiglu_train.bench.inference.plot import plot_inference

    def row(table, model, m, **ms):
        return {"table": table, "model": model, "M": m, "gemm_only_ms": 2.0} | {
            f"{n}_ms": v for n, v in ms.items()
        }

    rows = [row("gated", "7b", m, eager=3.0, gated_triton=2.2, dispatched=2.2) for m in (1, 16)]
    rows += [row("mlp", "7b", 1, eager=2.4, fused_mlp=2.1), row("gated", "72b", 1, eager=2.0)]
    fig = plot_inference({"rows": rows})
    gated_7b, gated_72b, mlp_7b, _ = fig.axes[:4]
    lines = {line.get_label(): list(line.get_ydata()) for line in gated_7b.get_lines()}
    assert lines["eager (faster variant)"] == [1.5, 1.5]
    assert lines["candidate: gated"] == [1.1, 1.1] and "candidate: cublas" not in lines
    assert [line.get_label() for line in mlp_7b.get_lines()][:2] == [
        "eager (faster variant)",
        "candidate: fused_mlp",
    ]
    assert gated_72b.get_title() == "fc1 + SwiGLU, 72b"


def test_a_quack_winner_records_the_fastest_path_without_quack():
    def row(m, **ms):
        return {"table": "gated", "K": 8, "N": 16, "M": m} | {f"{n}_ms": v for n, v in ms.items()}

    rows = [
        row(512, quack_act=1.0, gated_triton=1.3, cublas_act=1.2),
        row(1, quack_act=1.0),  # nothing to fall back to where quack is missing: no entry
        row(2, quack_act=2.0, gated_triton=1.0),
    ]
    fitted = fit.fit_dispatch(rows)["8x16"]["gated"]
    assert fitted == {
        "2": _entry("gated", 1.0, "quack", 2.0),
        "512": _entry("quack", 1.0, "cublas", 1.2) | {"fallback": "cublas"},
    }
    result = {
        "gpu": "cpu",
        "commit": "abc",
        "meta": {"dtype": "fp32"},
        "dispatch": {"8x16": {"gated": fitted}},
    }
    with dispatch.use_table(fit.dispatch_table(result, "test")):
        assert dispatch.choose("gated", 8, 16, 512, lambda: True) == "quack"
        assert dispatch.choose("gated", 8, 16, 512) == "cublas"


def _entry(path, ms, runner_up, ratio):
    return {"path": path, "ms": ms, "runner_up": runner_up, "runner_up_ratio": ratio}


def test_candidates_are_the_dispatch_paths_and_timed_variants():
    """The table the bench fits must name exactly the paths the runtime dispatches among."""
    for table, candidates in iv.CANDIDATES.items():
        assert tuple(candidates) == dispatch.PATHS[table]
        assert set(candidates.values()) <= set(iv.TABLES[table]) - {"ours"}
        assert set(iv.LAUNCHES[table]) == set(candidates)  # every path ranks on a near-tie


def test_reps_models_and_markdown():
    assert bench.choose_reps(0.01, 4) == 128 and bench.choose_reps(0.3, 4) == 8
    assert bench.choose_reps(50.0, 1) == 1 and bench.choose_reps(50.0, 3) == 3
    assert bench.parse_model("72b") == (8192, 29568) and bench.parse_model("96x160") == (96, 160)
    with pytest.raises(ValueError, match="unknown model '7B'"):
        bench.parse_model("7B")
    times = {"eager": np.array([2.0]), "ours": np.array([1.0])}
    row = bench.build_row("mlp", "7b", 1, 3584, 18944, times, {}, {"quack": "not importable"})
    row["ours_path"] = "fused_mlp"
    fitted = {"3584x18944": {"mlp": {"1": _entry("fused_mlp", 0.1, "gated", 1.4)}}}
    fitted["3584x18944"]["mlp"]["16"] = _entry("gated", 0.2, None, None)
    md = bench.to_markdown({"rows": [row], "dispatch": fitted})
    assert "| 7b | 1 | **2** | 1 | 2 | — | fused_mlp |" in md
    assert "- mlp/quack skipped at 1 shape(s): not importable" in md
    assert "- 3584x18944 mlp: 1 fused_mlp (gated: 1.40x), 16 gated" in md
    assert "fc1 + SwiGLU" not in md  # no gated rows, no gated table


def test_wrong_or_failing_variants_are_not_timed():
    def broken(x, w):
        raise RuntimeError("kernel exploded")

    variants = {
        "eager": iv.MLP["eager"](),
        "ours": lambda x, w: iv.MLP["eager"]()(x, w) * 1.1,
        "fused_mlp": broken,
        "gemm_only": iv.MLP["gemm_only"](),  # a floor: its output is not compared
    }
    cfg = bench.InferenceBenchConfig(samples=2, dtype="fp32", device="cpu")
    copies = bench.weight_copies(16, 24, torch.float32, torch.device("cpu"))
    row = bench.measure("mlp", "16x24", 3, variants, copies, cfg, {"quack": "not importable"})
    assert row["skipped"]["ours"].startswith("rejected: rel err 0.1")
    assert row["skipped"]["fused_mlp"] == "failed: RuntimeError: kernel exploded"
    assert row["skipped"]["quack"] == "not importable"
    assert "ours_ms" not in row and "fused_mlp_ms" not in row
    assert row["eager_ms"] > 0 and row["gemm_only_ms"] > 0 and "gemm_only_rel_err" not in row
    assert row["ours_path"] == "fused_mlp" and row["reps"] == 1 and row["weight_copies"] == 1


def test_cli_smoke_on_cpu(tmp_path):
    out, md = tmp_path / "inference.json", tmp_path / "inference.md"
    table = tmp_path / "table" / "inference_dispatch_cpu.json"
    args = ["bench-inference", "--device", "cpu", "--dtype", "fp32", "--models", "32x48"]
    args += ["--m", "1,20", "--samples", "2", "--variants"]
    args += ["ours,fused_mlp,gated_linear,cublas_act_linear,gated_triton,cublas_act,quack_act"]
    args += ["--json", str(out), "--md", str(md), "--dispatch-table", str(table)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    payload = json.loads(out.read_text())
    assert payload["gpu"] == "cpu" and payload["command"] and payload["meta"]["samples"] == 2
    rows = payload["rows"]
    expected = [(table, m) for table in ("gated", "mlp") for m in (1, 20)]
    assert [(r["table"], r["M"]) for r in rows] == expected
    for r in rows:
        assert r["eager_ms"] > 0 and r["ours_ms"] > 0 and r["ours_rel_err"] < 1e-5
    assert [r["ours_path"] for r in rows] == ["gated", "gated", "fused_mlp", "gated"]
    for r in rows:  # every candidate but quack's (no GPU, no quack here) ran, and agrees
        names = [n for p, n in iv.CANDIDATES[r["table"]].items() if p != dispatch.QUACK]
        assert all(r[f"{n}_rel_err"] < 1e-5 for n in names)
        assert f"{iv.CANDIDATES[r['table']][dispatch.QUACK]}_ms" not in r
    assert "| 32x48 | 20 |" in md.read_text() and "- 32x48 mlp: 1 " in md.read_text()
    fitted = json.loads(table.read_text())
    assert fitted["shapes"] == payload["dispatch"] and fitted["gpu"] == "cpu"
    assert fitted["source"] == "swiglu-train bench-inference, inference.json"
    assert {k: list(v) for k, v in fitted["shapes"]["32x48"].items()} == {
        "gated": ["1", "20"],
        "mlp": ["1", "20"],
    }
    assert dispatch.read_table(table).shapes.keys() == {(32, 48)}
    assert not list(tmp_path.rglob("*.tmp"))  # written through renamed temporary files
    merged_table = tmp_path / "merged.json"  # a run split by model merges back, with no timing
    plot = tmp_path / "inference.png"
    merge = ["bench-inference", "--merge", str(out), "--dispatch-table", str(merged_table)]
    result = CliRunner().invoke(app, [*merge, "--plot", str(plot)])
    assert result.exit_code == 0, result.output
    assert json.loads(merged_table.read_text())["shapes"] == fitted["shapes"]
    assert plot.read_bytes().startswith(b"\x89PNG")
    twice = ["bench-inference", "--merge", str(out), "--merge", str(out)]
    result = CliRunner().invoke(app, twice, env={"COLUMNS": "300"})  # the message on one line
    assert result.exit_code != 0 and "more than one run" in result.output


def test_cli_rejects_unknown_names():
    result = CliRunner().invoke(app, ["bench-inference", "--models", "7b,9b"])
    assert result.exit_code != 0 and "unknown model '9b'" in result.output
    result = CliRunner().invoke(app, ["bench-inference", "--variants", "ours,liger2"])
    assert result.exit_code != 0 and "unknown variants ['liger2']" in result.output


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_graph_replays_every_call_and_times_a_row():
    counter = torch.zeros((), device="cuda")
    replay = bench.capture(lambda i: counter.add_(i), 5, torch.device("cuda"))
    counter.zero_()
    replay()
    torch.cuda.synchronize()
    assert counter.item() == 0 + 1 + 2 + 3 + 4
    cfg = bench.InferenceBenchConfig(samples=3, dtype="bf16", device="cuda")
    copies = bench.weight_copies(896, 4864, torch.bfloat16, torch.device("cuda"))
    assert len(copies) >= 2  # 26 MB of weights: copies overflow the L2
    variants, skipped = bench.build_variants("mlp", ["ours", "fused_mlp", "gemm_only"])
    with torch.inference_mode():
        row = bench.measure("mlp", "0.5b", 1, variants, copies, cfg, skipped)
    assert row["reps"] % len(copies) == 0
    for name in ("eager", "ours", "fused_mlp", "gemm_only"):
        assert row[f"{name}_ms"] > 0, row["skipped"]
    assert row["ours_path"] == "fused_mlp" and row["fused_mlp_rel_err"] < 1e-2
