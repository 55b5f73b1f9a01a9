"""The inference benchmark: its pure-python pieces on fake timings, a CPU smoke run, CUDA graphs."""

import json

import numpy as np
import pytest
import torch
from conftest import HAS_CUDA
from typer.testing import CliRunner

from swiglu_train.bench import inference as bench
from swiglu_train.bench import inference_variants as iv
from swiglu_train.cli import app


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


def test_suggested_crossover_is_the_first_run_of_wins():
    def row(k, m, fused, gated):
        return {"table": "mlp", "K": k, "N": 2 * k, "M": m}, fused, gated

    shapes = [
        row(8, 16, 1.0, 2.0),
        row(8, 1, 1.0, 2.0),
        row(8, 128, 3.0, 2.0),
        row(16, 1, 1.0, 2.0),
        row(16, 16, 2.0, 2.0),
        row(16, 128, 1.0, 2.0),  # a win after a loss does not extend the run
        row(32, 1, 3.0, 2.0),
    ]
    rows = [r | {"fused_mlp_ms": fused, "gated_linear_ms": gated} for r, fused, gated in shapes]
    rows += [
        {"table": "mlp", "K": 64, "N": 128, "M": 1, "gated_linear_ms": 1.0},
        {"table": "gated", "K": 8, "N": 16, "M": 512, "fused_mlp_ms": 0.1, "gated_linear_ms": 1},
    ]
    assert bench.suggest_fused_max_m(rows) == {"8x16": 16, "16x32": 1, "32x64": 0}


def test_reps_models_and_markdown():
    assert bench.choose_reps(0.01, 4) == 128 and bench.choose_reps(0.3, 4) == 8
    assert bench.choose_reps(50.0, 1) == 1 and bench.choose_reps(50.0, 3) == 3
    assert bench.parse_model("72b") == (8192, 29568) and bench.parse_model("96x160") == (96, 160)
    with pytest.raises(ValueError, match="unknown model '7B'"):
        bench.parse_model("7B")
    times = {"eager": np.array([2.0]), "ours": np.array([1.0])}
    row = bench.build_row("mlp", "7b", 1, 3584, 18944, times, {}, {"quack": "not importable"})
    row["ours_path"] = "fused_mlp"
    result = {"rows": [row], "suggested_fused_mlp_max_m": {"3584x18944": 16}}
    md = bench.to_markdown(result)
    assert "| 7b | 1 | **2** | 1 | 2 | — | fused_mlp |" in md
    assert "- mlp/quack skipped at 1 shape(s): not importable" in md
    assert "FUSED_MLP_MAX_M = {(3584, 18944): 16}" in md
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
    args = ["bench-inference", "--device", "cpu", "--dtype", "fp32", "--models", "32x48"]
    args += ["--m", "1,20", "--samples", "2", "--variants", "ours,fused_mlp,gated_linear"]
    result = CliRunner().invoke(app, [*args, "--json", str(out), "--md", str(md)])
    assert result.exit_code == 0, result.output
    payload = json.loads(out.read_text())
    assert payload["gpu"] == "cpu" and payload["command"] and payload["meta"]["samples"] == 2
    rows = payload["rows"]
    expected = [(table, m) for table in ("gated", "mlp") for m in (1, 20)]
    assert [(r["table"], r["M"]) for r in rows] == expected
    for r in rows:
        assert r["eager_ms"] > 0 and r["ours_ms"] > 0 and r["ours_rel_err"] < 1e-5
    assert [r["ours_path"] for r in rows[2:]] == ["fused_mlp", "gated"]
    assert rows[3]["fused_mlp_rel_err"] < 1e-5 and rows[3]["gated_linear_rel_err"] < 1e-5
    assert "| 32x48 | 20 |" in md.read_text()
    assert not list(tmp_path.glob("*.tmp"))  # written through a renamed temporary file


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
