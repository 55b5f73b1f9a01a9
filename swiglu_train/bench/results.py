"""What the bench commands and the lab's scripts share besides the clock (``timing``): the
dtypes they take by name, and where a result was measured (commit, device, package versions),
written into every result file beside its rows."""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import os
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from swiglu_train.bench.timing import TIMING_DEFINITION
from swiglu_train.files import atomic_write, write_json_atomic

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PEERS = {"liger": "liger-kernel", "fla": "fla-core", "quack": "quack-kernels"}


def provenance(device: torch.device, commit: str | None) -> dict:
    """Where and when a result was measured: date, device name, package versions, commit."""
    versions = {"torch": torch.__version__}
    for pkg in ("triton", *PEERS.values()):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[pkg] = importlib.metadata.version(pkg)
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "versions": versions,
        "commit": commit or git_commit(),
    }


def environment(device: torch.device, commit: str | None) -> dict:
    """A timed result's provenance, with what its times mean."""
    return provenance(device, commit) | {"timing": TIMING_DEFINITION}


def write_probe_result(
    script: str,
    rows: list[dict],
    samples: int,
    commit: str | None,
    json_path: str,
    md_path: str | None = None,
    to_markdown: Callable[[dict], str] | None = None,
    device: torch.device = torch.device("cuda"),  # noqa: B008 (a constant, never mutated)
) -> dict:
    """A GPU probe script's result: its rows with the GPU, commit, exact command and
    environment, written atomically as JSON (and as markdown when asked)."""
    env = environment(device, commit)
    result = {"gpu": env["device_name"], "commit": env["commit"]}
    result |= {"environment": env, "samples": samples, "rows": rows}
    return write_result(script, result, json_path, md_path, to_markdown)


def write_result(
    script: str,
    result: dict,
    json_path: str | Path,
    md_path: str | Path | None = None,
    to_markdown: Callable[[dict], str] | None = None,
) -> dict:
    """``result`` with the exact command that made it, written atomically as JSON (and as
    markdown when asked): a lab script's output names how to make it again."""
    result = {"command": f"python {script} " + shlex.join(sys.argv[1:])} | result
    write_json_atomic(json_path, result)
    if md_path and to_markdown is not None:
        with atomic_write(md_path) as fh:
            fh.write(to_markdown(result))
    return result


def git_commit() -> str | None:
    """The commit measured: $SWIGLU_TRAIN_COMMIT where a device session names the tree it
    copied, else git's HEAD, with ``+dirty`` where tracked files differ from it. A copied
    tree's own .git may be another commit's (the device box's was the session's first), and
    a result must then say that its HEAD is not what ran."""
    if os.environ.get("SWIGLU_TRAIN_COMMIT"):
        return os.environ["SWIGLU_TRAIN_COMMIT"]
    try:
        head = _git("rev-parse", "HEAD")
        changed = _git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if changed else "")


def _git(*args: str) -> str:
    run = subprocess.run(["git", *args], capture_output=True, text=True, check=True)
    return run.stdout.strip()
