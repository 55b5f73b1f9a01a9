"""The benchmark commands run end to end on CPU (timings there are smoke only)."""

import json

import pytest
import torch
from typer.testing import CliRunner

from swiglu_train.cli import app

runner = CliRunner()
M, D, FFN = 24, 16, 40


def test_bench_memory_stack_table_is_exact_on_cpu(tmp_path):
    out = tmp_path / "stack.json"
    result = runner.invoke(
        app,
        [
            "bench-memory",
            "--device",
            "cpu",
            "--dtype",
            "fp32",
            "--shape",
            f"{M},{D},{FFN},{D}",
            "--layers",
            "1,3",
            "--mlp-impl",
            "normal,drop_h",
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["results"]
    assert [(r["impl"], r["layers"]) for r in rows] == [
        ("normal", 1),
        ("normal", 3),
        ("drop_h", 1),
        ("drop_h", 3),
    ]
    for r in rows:
        per_layer = (M * D + 2 * M * FFN + (M * FFN if r["impl"] == "normal" else 0)) * 4
        assert r["per_layer_saved_bytes"] == [per_layer] * r["layers"]
        assert r["saved_for_backward_bytes"] == per_layer * r["layers"]
        assert r["after_forward_MiB"] is None and r["peak_MiB"] is None
    assert "| drop_h | 3 |" in out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").read_bytes().startswith(b"\x89PNG")


def test_bench_memory_rejects_unknown_impl():
    result = runner.invoke(app, ["bench-memory", "--device", "cpu", "--mlp-impl", "save_factorz"])
    assert result.exit_code != 0
    assert "valid impls: normal, drop_h" in str(result.exception)


def test_bench_memory_needs_square_stack():
    result = runner.invoke(
        app, ["bench-memory", "--device", "cpu", "--shape", "8,16,24,12", "--layers", "2"]
    )
    assert "needs O == D" in str(result.exception)


def test_bench_smoke_on_cpu(tmp_path):
    out = tmp_path / "mlp.json"
    result = runner.invoke(
        app,
        [
            "bench",
            "--device",
            "cpu",
            "--dtype",
            "fp32",
            "--shape",
            f"{M},{D},{FFN},{D}",
            "--variants",
            "eager,normal,drop_h,save_factors,liger",
            "--samples",
            "30",
            "--stack-layers",
            "2",
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(out.read_text())
    names = [r["variant"] for r in payload["results"]]
    # liger-kernel is a test dependency (the peers extra): the peer runs, under the interpreter
    assert names == ["floor", "eager", "normal", "drop_h", "save_factors", "liger"]
    for row in payload["results"][1:]:
        assert row["full_ms"] > 0 and row["full_over_floor"] > 0
        assert row["rel_err_vs_reference"] < 1e-5  # fp32: every variant computes the same MLP
    assert payload["meta"]["samples"] == 30 and payload["meta"]["device_name"] == "cpu"
    assert [r["layers"] for r in payload["stack"]] == [2] * 5


def test_bench_races_the_fp8_saved_option_beside_its_bf16_impl(tmp_path):
    """``drop_h+fp8`` is drop_h with saved_fp8: the same MLP, its backward off by e4m3's
    rounding of the saved preactivation (errors are relative to the first variant, drop_h),
    in both tables."""
    out = tmp_path / "mlp.json"
    args = ["bench", "--device", "cpu", "--dtype", "fp32", "--shape", f"{M},{D},{FFN},{D}"]
    args += ["--variants", "drop_h,drop_h+fp8", "--samples", "2", "--stack-layers", "2"]
    result = runner.invoke(app, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    payload = json.loads(out.read_text())
    errors = {r["variant"]: r["rel_err_vs_reference"] for r in payload["results"][1:]}
    assert errors["drop_h"] == 0.0 and 1e-4 < errors["drop_h+fp8"] < 0.1
    assert [r["variant"] for r in payload["stack"]] == ["drop_h", "drop_h+fp8"]


def test_bench_prints_skip_reasons_with_their_brackets(monkeypatch):
    from swiglu_train.bench.mlp import run as mlp

    real_case = mlp.layer_case
    hint = "needs quack (pip install 'swiglu-train[quack]')"

    def layer_case(name, *args):
        if name == "drop_h_quack":
            raise ImportError(hint)
        return real_case(name, *args)

    monkeypatch.setattr(mlp, "layer_case", layer_case)
    args = ["bench", "--device", "cpu", "--dtype", "fp32", "--shape", f"{M},{D},{FFN},{D}"]
    args += ["--variants", "eager,drop_h_quack", "--samples", "2", "--stack-layers", "0"]
    result = runner.invoke(app, args, env={"COLUMNS": "200"})  # the reason on one line
    assert result.exit_code == 0, result.output
    assert f"skipped drop_h_quack: not importable: {hint}" in result.output


def test_bench_inference_merge_takes_several_files_after_one_flag(tmp_path):
    runs = []
    for model in ("32x48", "16x40"):
        runs.append(tmp_path / f"{model}.json")
        args = ["bench-inference", "--device", "cpu", "--dtype", "fp32", "--models", model]
        args += ["--m", "1", "--samples", "1", "--variants", "ours", "--json", str(runs[-1])]
        assert runner.invoke(app, args).exit_code == 0
    for merge in (["--merge", *map(str, runs)], ["--merge", str(runs[0]), "--merge", str(runs[1])]):
        out = tmp_path / "merged.json"
        result = runner.invoke(app, ["bench-inference", *merge, "--json", str(out)])
        assert result.exit_code == 0, result.output
        assert {r["model"] for r in json.loads(out.read_text())["rows"]} == {"32x48", "16x40"}
    stray = runner.invoke(app, ["bench-inference", str(runs[0])], env={"COLUMNS": "200"})
    assert stray.exit_code == 2 and "unexpected arguments" in stray.output


def test_out_of_place_variants_build_ours_with_inplace_off():
    """The aliasing diagnostic: ours(impl, inplace=False) is the same layer with grad_preact
    written to a new buffer, so its graph takes a second backward; the quack one needs quack."""
    from swiglu_train.bench.mlp.variants import BUILDERS, LayerWeights, ours

    w = LayerWeights.random(16, 40, 16, torch.float32, "cpu")
    layer = ours("drop_h", inplace=False)(w)
    assert layer.inplace is False and layer.fc1.weight is w.fc1
    y = layer(torch.randn(8, 16)).square().sum()
    y.backward(retain_graph=True)
    first = w.fc1.grad.clone()
    y.backward()  # the in-place path refuses this; out of place it doubles the grad
    torch.testing.assert_close(w.fc1.grad, 2 * first)
    with pytest.raises(ImportError, match="quack"):
        BUILDERS["drop_h_quack_out_of_place"](w)


def test_the_fused_schedule_diagnostics_are_the_quack_impls_with_a_dynamic_schedule():
    """Four grid variants put the quack impls' fused GEMMs (grad_h's, or both) on quack's
    dynamic schedule; built where quack cannot run, they say so, as the impls do."""
    from swiglu_train.bench.mlp.variants import BUILDERS, LayerWeights

    names = [n for n in BUILDERS if "_dynamic_" in n]
    assert names == [
        f"{impl}_dynamic_{which}"
        for impl in ("drop_h_quack", "save_factors_quack")
        for which in ("grad_h", "fused")
    ]
    w = LayerWeights.random(16, 40, 16, torch.float32, "cpu")
    for name in names:
        with pytest.raises(ImportError, match="quack"):
            BUILDERS[name](w)
