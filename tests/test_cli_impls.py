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
