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


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
