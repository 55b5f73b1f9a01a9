"""Where Triton kernels can run, and how they are tuned there.

The Triton interpreter (``TRITON_INTERPRET=1``) runs kernels on CPU tensors, which is how CI
tests them. It has no CUDA events, so autotuning collapses to one config there, and it must be
switched on before any kernel is defined, which is why this is read once at import.
"""

from __future__ import annotations

import functools
import os

import torch

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.cache  # asked before every kernel launch; an import's outcome holds for the process
def triton_available() -> bool:
    """True when the Triton package imports (it ships for Linux only)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_runs_on(device: torch.device) -> bool:
    """Can a Triton kernel run on tensors of this device: CUDA, or CPU under the interpreter."""
    if not triton_available():
        return False
    return device.type == "cuda" or (INTERPRET and device.type == "cpu")


def triton_runs_for(t: torch.Tensor) -> bool:
    """``triton_runs_on(t.device)``, asked before every kernel launch without building the
    device object, which costs more host time than the rest of the question."""
    return (t.is_cuda or (INTERPRET and t.is_cpu)) and triton_available()


def m_bucket(m: int) -> int:
    """Round the row count up to a power of two so autotuning is keyed by size class.

    Token counts change every step in real training (packing, last batch); tuning once per
    power of two keeps a good config without re-tuning on every new M.
    """
    return 1 << max(m - 1, 0).bit_length()


@functools.cache
def device_capability(device_index: int) -> tuple[int, int]:
    """A CUDA GPU's compute capability, asked once per device: torch's query costs host time,
    and the kernels' dispatch asks on every step."""
    return torch.cuda.get_device_capability(device_index)
