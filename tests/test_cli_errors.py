"""Input errors reach the user as one line, not a traceback; genuine bugs keep theirs."""

import sys

import pytest
import torch
from typer.testing import CliRunner

from swiglu_train.cli import app

runner = CliRunner()
DEBUG_ENV = "SWIGLU_TRAIN_DEBUG"  # as --help documents it
NO_CUDA = "Invalid value for '--device': CUDA is not available on this machine; pass --device cpu"


@pytest.fixture
def entry(monkeypatch, capsys):
    """Run ``swiglu-train ARGS`` through the console-script entry point; (exit code, stderr)."""
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # Typer installs its own
    monkeypatch.delenv(DEBUG_ENV, raising=False)

    def run(*args: str) -> tuple[int, str]:
        with pytest.raises(SystemExit) as exit_:
            app(args=list(args), prog_name="swiglu-train")
        return exit_.value.code, capsys.readouterr().err

    return run


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer without CUDA")
@pytest.mark.parametrize("command", ["bench", "bench-memory", "bench-crossover", "bench-inference"])
def test_bench_without_cuda_says_so_in_one_line(command):
    result = runner.invoke(app, [command], env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert NO_CUDA in result.output and "Traceback" not in result.output


def test_bench_rejects_a_device_torch_does_not_know():
    result = runner.invoke(app, ["bench", "--device", "gpu0"], env={"COLUMNS": "200"})
    assert result.exit_code == 2 and "'gpu0' is not a torch device" in result.output


def test_a_missing_config_is_one_line(entry):
    code, err = entry("pretrain", "--config", "nosuch")
    assert code == 1
    assert err == (
        "error: config 'nosuch' not found; named configs: ['125m', '1b', 'tiny'] "
        f"({DEBUG_ENV}=1 shows the traceback)\n"
    )


def test_an_unknown_impl_is_one_line(entry):
    code, err = entry("bench-memory", "--device", "cpu", "--mlp-impl", "fast[x]")
    assert code == 1 and err.startswith("error: unknown MLP impl 'fast[x]'; valid impls: normal")
    assert err.count("\n") == 1


@pytest.mark.parametrize("value", ["1", "true", "yes"])
def test_debug_env_shows_the_traceback(entry, monkeypatch, value):
    monkeypatch.setenv(DEBUG_ENV, value)
    with pytest.raises(FileNotFoundError, match="config 'nosuch' not found"):
        entry("pretrain", "--config", "nosuch")


@pytest.mark.parametrize("value", ["0", "false", "off", ""])
def test_debug_env_off_keeps_one_line(entry, monkeypatch, value):
    monkeypatch.setenv(DEBUG_ENV, value)
    code, err = entry("pretrain", "--config", "nosuch")
    assert code == 1 and err.count("\n") == 1


def test_an_error_line_prints_emoji_codes_and_brackets_as_typed(entry):
    """Rich would render ':x:' as an emoji and swallow '[bold]' as a tag."""
    code, err = entry("pretrain", "--config", "7b:x:1[bold]")
    assert code == 1 and "config '7b:x:1[bold]' not found" in err


def test_a_bug_is_not_taken_for_an_input_error(entry, monkeypatch):
    import swiglu_train.integrations.lightning.config as config

    def broken(name):
        raise RuntimeError("a bug")

    monkeypatch.setattr(config, "load_config", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        entry("pretrain", "--config", "tiny")


@pytest.mark.parametrize("devices", ["0", "abc", "-3"])
def test_devices_lightning_refuses_are_one_line(entry, tmp_path, devices):
    """They failed inside the Trainer: a MisconfigurationException or TypeError traceback."""
    code, err = entry("pretrain", "--devices", devices, "--output-dir", str(tmp_path / "run"))
    assert code == 1 and err.startswith("error: train.devices must be auto or a count of at least")
    assert err.count("\n") == 1 and not (tmp_path / "run").exists()


def test_devices_in_a_config_are_checked_too(entry, tmp_path):
    (tmp_path / "c.yaml").write_text(f"train: {{devices: 0}}\noutput_dir: {tmp_path / 'run'}\n")
    code, err = entry("pretrain", "--config", str(tmp_path / "c.yaml"))
    assert code == 1 and "train.devices must be auto or a count of at least 1" in err
