"""Commands run on a CPU-only machine fit it: a CPU-sized default shape, no more training
processes than cores, and a "—" in a memory table that says why."""

import json
import os
import sys

import pytest
import torch
from typer.testing import CliRunner

from swiglu_train.bench.memory.stack import to_markdown
from swiglu_train.cli import app
from swiglu_train.cli.bench_memory import CPU_SHAPE
from swiglu_train.memory.profiler import NOT_MEASURED

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answers"),
    pytest.mark.usefixtures("offline_wandb_torch_math"),
]
runner = CliRunner()


def test_bench_memory_on_cpu_takes_a_cpu_sized_shape_and_says_why_memory_is_a_dash(tmp_path):
    """The seed shape ran 5 minutes a row on a CPU with nothing printed."""
    out = tmp_path / "stack.json"
    args = ["bench-memory", "--device", "cpu", "--layers", "1", "--mlp-impl", "drop_h"]
    result = runner.invoke(app, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert f"shape {CPU_SHAPE} (M,D,F,O), CPU-sized" in result.output
    saved = json.loads(out.read_text())
    assert saved["meta"]["shape"] == [int(v) for v in CPU_SHAPE.split(",")]
    m, d, f, _ = saved["meta"]["shape"]
    assert saved["results"][0]["saved_for_backward_bytes"] == (m * d + m * 2 * f) * 2  # x, preact
    assert saved["results"][0]["after_forward_MiB"] is None
    assert NOT_MEASURED in out.with_suffix(".md").read_text()


def test_a_cuda_table_has_no_footnote():
    row = {"impl": "drop_h", "layers": 1, "saved_for_backward_bytes": 2**20}
    assert NOT_MEASURED not in to_markdown([row | {"after_forward_MiB": 1.0, "peak_MiB": 2.0}])


def test_more_training_processes_than_cores_are_refused_in_one_line(monkeypatch, capsys, tmp_path):
    """`--devices 3` on a 2-core machine silently started 3 processes."""
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # Typer installs its own
    with pytest.raises(SystemExit) as exit_:
        app(args=["pretrain", "--devices", str(cores + 1), "--output-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert f"train.devices={cores + 1} would start {cores + 1} training processes" in err
    assert f"{cores} CPU cores (no CUDA); use at most {cores}" in err
    assert not (tmp_path / "r").exists()


def test_the_pretrain_summary_says_why_memory_is_a_dash_on_cpu(tmp_path):
    (tmp_path / "c.yaml").write_text(
        "model: {hidden_size: 32, ffn_hidden_size: 64, num_heads: 2, num_layers: 1}\n"
        "data: {seq_length: 32, micro_batch_size: 2, val_fraction: 0.0}\n"
        "train: {max_steps: 2, checkpoint_every: 2}\n"
    )
    data = tmp_path / "text.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    args = ["pretrain", "--config", tmp_path / "c.yaml", "--data", data]
    summary = tmp_path / "summary.json"
    args += ["--output-dir", tmp_path / "run", "--summary-json", summary]
    result = runner.invoke(app, list(map(str, args)))
    assert result.exit_code == 0, result.output
    assert json.loads(summary.read_text())["after_forward_MiB"] is None
    assert NOT_MEASURED in result.output
