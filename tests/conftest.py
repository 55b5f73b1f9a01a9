"""Test setup: Triton runs under its CPU interpreter when there is no GPU.

TRITON_INTERPRET must be set before any kernel is defined, so it is set here, before the
package is imported. On a CUDA machine it stays unset and the `gpu` tests run real kernels.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from swiglu_train.kernels.runtime import triton_runs_on
from swiglu_train.ops import use_backend

HAS_CUDA = torch.cuda.is_available()


def device_backends() -> list:
    """(device, backend) pairs to test here: torch math on CPU, Triton wherever it runs."""
    pairs = [pytest.param("cpu", "torch", id="cpu-torch")]
    if triton_runs_on(torch.device("cpu")):
        pairs.append(pytest.param("cpu", "triton", id="cpu-triton"))
    pairs.append(
        pytest.param(
            "cuda",
            "triton",
            id="cuda-triton",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")],
        )
    )
    return pairs


def cpu_backends() -> list:
    """``device_backends`` on the CPU alone, for tests whose inputs are built there: on a CUDA
    machine, where the interpreter is off, that is torch's math alone."""
    return [p for p in device_backends() if p.values[0] == "cpu"]


def pytest_collection_modifyitems(items: list) -> None:
    """The tests marked slow go first (in file order otherwise): under pytest-xdist a worker that
    draws a 3-minute test last runs alone at the end while the others wait."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _cli_width(monkeypatch) -> None:
    """Pin the CLI consoles to one wide size. Rich takes the width from COLUMNS (fixed at import
    when it is set) or from the terminal pytest runs in, and a table cell that a test reads must
    not wrap or be cut at one user's width. Plain lines and errors never wrap at any width
    (tests/test_cli_errors.py checks that at 20 columns)."""
    from swiglu_train.cli.app import console, error_console

    for c in (console, error_console):
        monkeypatch.setattr(c, "size", (400, 50))


@pytest.fixture
def one_rank_gloo(tmp_path):
    """A 1-rank gloo process group for DTensor code (FSDP2, tensor parallel) on CPU; it meets
    through a file, so no port is picked that a parallel test could take first."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already up")
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def offline_wandb_torch_math(monkeypatch):
    """For training runs: W&B offline and quiet, and plain-torch SwiGLU math (the Triton
    interpreter would make a run crawl; the kernels have their own interpreter tests). A
    module asks for it with ``pytestmark = pytest.mark.usefixtures(...)``."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    with use_backend("torch"):
        yield
