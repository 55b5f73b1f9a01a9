"""What ``swiglu-train pretrain`` prints, as a user's terminal shows it (a process of its own,
since pytest captures warnings and log records before they print): where its files went, the
run's own initial loss after a resume, and no third-party noise that the run itself causes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Printed at every run before: Lightning's tip, torch's deprecation of Lightning's LeafSpec use,
# and W&B's word on the anonymous setting Lightning passed.
NOISE = ("litlogger", "LeafSpec", "anonymous setting has no effect", "URL not available")


def pretrain(out: Path, steps: int, *args: str) -> tuple[str, dict]:
    """The run's stdout and stderr together, and its summary."""
    summary = out.parent / f"summary_{steps}.json"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "WANDB_SILENT")}
    env["WANDB_MODE"] = "offline"  # W&B's own lines print, as they do for a user
    cmd = [sys.executable, "-m", "swiglu_train", "pretrain", "--max-steps", str(steps)]
    cmd += ["--micro-batch-size", "2", "--output-dir", str(out), "--summary-json", str(summary)]
    done = subprocess.run([*cmd, *args], env=env, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    return output, json.loads(summary.read_text())


@pytest.mark.slow
def test_a_run_says_where_its_files_went_and_a_resume_keeps_the_initial_loss(tmp_path):
    out = tmp_path / "run"
    first, summary = pretrain(out, 2)
    [run_dir] = (out / "wandb").glob("offline-run-*")
    assert summary["checkpoint_dir"] == str(out / "checkpoints")
    assert summary["memory_csv"] == str(out / "memory.csv")
    assert Path(summary["wandb_run_dir"]).resolve() == run_dir.resolve()
    assert summary["wandb_url"] is None  # offline
    lines = first.splitlines()
    for path in (out / "checkpoints", out / "memory.csv", summary["wandb_run_dir"]):
        assert any(str(path) in line for line in lines), path  # one line each, whole
    assert not [n for n in NOISE if n in first], first[-4000:]
    assert "never validates" in first  # a real warning (ours) still prints

    resumed_output, resumed = pretrain(out, 3, "--resume", "last")
    assert list(resumed["losses"]) == ["2"]  # this segment trained step 2 alone
    assert resumed["initial_loss"] == summary["initial_loss"]  # the run's step 0
    assert not [n for n in NOISE if n in resumed_output], resumed_output[-4000:]
