"""``swiglu-train impls``: availability per impl and auto's pick, as a user would ask."""

import pytest
import torch
from helpers import auto_model, pretend_gpu
from typer.testing import CliRunner

from swiglu_train.cli import app

runner = CliRunner()
SHAPE = ["--hidden-size", "4096", "--ffn-hidden-size", "11008", "--tokens", "4096"]


def run(*args: str) -> str:
    result = runner.invoke(app, ["impls", *args])
    assert result.exit_code == 0, result.output
    return result.output


def test_every_impl_is_listed_with_what_it_saves():
    output = run()
    for name in ("normal", "drop_h", "save_factors", "drop_h_quack", "save_factors_quack"):
        assert name in output
    assert "preact [M, 2F], h [M, F]" in output
    assert "--hidden-size and --ffn-hidden-size" in output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answers")
def test_off_cuda_quack_is_unavailable_and_auto_falls_back():
    output = run(*SHAPE)
    assert "no: no CUDA GPU" in output
    assert "auto -> drop_h (fallback to drop_h: not on a CUDA device" in output


def test_auto_s_pick_comes_from_the_model_of_this_gpu(monkeypatch):
    pretend_gpu(monkeypatch, auto_model({"normal": (1.0, 6.0), "drop_h": (1.05, 4.0)}))
    expected = "auto -> normal (normal: fastest predicted (1.000x the six-GEMM floor) at M=4096"
    assert expected in run(*SHAPE)


def test_a_quack_install_hint_keeps_its_brackets(monkeypatch):
    import swiglu_train.ops.quack_mlp as quack_mlp

    hint = "quack-kernels is not installed (pip install 'swiglu-train[quack]')"
    monkeypatch.setattr(quack_mlp, "quack_unavailable_reason", lambda: hint)
    result = runner.invoke(app, ["impls"])
    assert result.exit_code == 0 and f"no: {hint}" in result.output


@pytest.mark.parametrize("option", ["--hidden-size", "--ffn-hidden-size", "--tokens"])
def test_a_size_below_one_is_refused_naming_the_option(option):
    """A negative or zero D, F or M used to print auto's pick for a shape that cannot exist."""
    args = dict(zip(SHAPE[::2], SHAPE[1::2], strict=True)) | {option: "0"}
    argv = ["impls", *[v for kv in args.items() for v in kv]]
    result = runner.invoke(app, argv)
    assert result.exit_code == 2
    assert f"Invalid value for '{option}'" in result.output
    assert "greater than or equal to" in result.output


def test_experts_rows_give_each_impl_s_saved_mib_and_where_it_runs(monkeypatch):
    """--experts lists the routed experts' impls with the bytes ops.experts claims (the figure
    its memory tests assert) at Qwen3-30B-A3B's shape, 8192 tokens: drop_h keeps the
    preactivation and the plan, its FP8 form the e4m3 copy, normal 4x as much and more."""
    import swiglu_train.ops.experts_quack as experts_quack
    from swiglu_train.cli.info import experts_rows
    from swiglu_train.ops.experts import saved_activation_bytes

    monkeypatch.setattr(experts_quack, "quack_unavailable_reason", lambda: None)  # as on Hopper
    rows = {r["impl"]: r for r in experts_rows(128, 8, 2048, 768, 8192, "Triton kernels")}
    assert list(rows) == ["normal", "drop_h", "drop_h+fp8", "drop_h_quack", "drop_h_quack+fp8"]
    for label, r in rows.items():
        impl, fp8 = label.removesuffix("+fp8"), label.endswith("+fp8")
        size = saved_activation_bytes(impl, fp8, "output", 8192, 2048, 768, 8, 128, torch.bfloat16)
        assert r["MiB"] == size / 2**20 and r["runs"] and r["why_not"] is None
    assert rows["drop_h"]["MiB"] == pytest.approx(8192 * 8 * 2 * 768 * 2 / 2**20, rel=0.01)
    assert rows["drop_h+fp8"]["MiB"] < 0.55 * rows["drop_h"]["MiB"]
    assert rows["normal"]["MiB"] > 4 * rows["drop_h"]["MiB"]
    assert rows["drop_h_quack"]["kernels"] == "quack"
    odd = {r["impl"]: r for r in experts_rows(8, 2, 2048, 770, 64, "Triton kernels")}
    assert not odd["drop_h_quack"]["runs"]  # rows TMA cannot take: said, as the layer says
    assert odd["drop_h_quack"]["why_not"].startswith("hidden_size 2048 and ffn_hidden_size 770")


def test_experts_without_a_shape_list_the_impls_and_auto_s_pick():
    result = runner.invoke(app, ["impls", "--experts", "64", "--top-k", "6"])
    assert result.exit_code == 0, result.output
    assert "routed experts (ParExperts): E=64, k=6" in result.output
    assert "experts auto -> drop_h (" in result.output
    from swiglu_train.cli.info import experts_rows

    assert all(r["MiB"] is None for r in experts_rows(64, 6, None, None, None, "torch"))


def test_top_k_above_the_experts_is_refused():
    result = runner.invoke(app, ["impls", "--experts", "4", "--top-k", "8"])
    assert result.exit_code == 2
    assert "Invalid value for '--top-k'" in result.output and "8 > --experts 4" in result.output
