"""SwiGLU activation ops, registered with ``torch.library`` so torch.compile treats them as
opaque nodes with known shapes, and dispatched to Triton or to plain torch.

Triton runs on CUDA, and on CPU under ``TRITON_INTERPRET=1``; elsewhere (or when asked with
:func:`use_backend`) the plain-torch math runs, with the same outputs and the same in-place
behaviour, so what autograd saves is identical on every backend.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from swiglu_train.kernels.runtime import triton_runs_for
from swiglu_train.ops import reference
from swiglu_train.ops.eager import eager_op

try:
    from swiglu_train.kernels import swiglu as kernels
except ImportError:  # no Triton on this platform: the torch backend serves everything
    kernels = None

BACKENDS = ("auto", "triton", "torch")
_backend = "auto"


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force the activation backend: "triton", "torch", or "auto" (Triton wherever it runs)."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {BACKENDS}")
    previous, _backend = _backend, name
    try:
        yield
    finally:
        _backend = previous


def triton_enabled(t: torch.Tensor) -> bool:
    """Whether ops on this tensor run Triton kernels (the backend setting and the device)."""
    if _backend == "torch":
        return False
    runs = kernels is not None and triton_runs_for(t)
    if _backend == "triton" and not runs:
        raise RuntimeError(
            f"Triton backend requested but Triton cannot run on {t.device} "
            "(needs CUDA, or TRITON_INTERPRET=1 set before import for CPU)"
        )
    return runs


@eager_op("swiglu_train::swiglu_fwd", mutates_args=())
def swiglu_fwd(preact: torch.Tensor) -> torch.Tensor:
    """h = silu(gate) * up for a [M, 2F] canonical preact."""
    if not triton_enabled(preact):
        return reference.swiglu(preact)
    h = preact.new_empty(preact.shape[0], preact.shape[1] // 2)
    kernels.swiglu_forward(preact, h)
    return h


@swiglu_fwd.register_fake
def _(preact: torch.Tensor) -> torch.Tensor:
    return preact.new_empty(preact.shape[0], preact.shape[1] // 2)


@eager_op("swiglu_train::swiglu_bwd", mutates_args=())
def swiglu_bwd(preact: torch.Tensor, grad_h: torch.Tensor) -> torch.Tensor:
    """grad_preact from the saved preact and grad_h (the `normal` impl's backward)."""
    if not triton_enabled(preact):
        return reference.swiglu_grad(preact, grad_h)
    grad_preact = torch.empty_like(preact)
    kernels.swiglu_backward(preact, grad_h, grad_preact, None)
    return grad_preact


@swiglu_bwd.register_fake
def _(preact: torch.Tensor, grad_h: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(preact)


@eager_op("swiglu_train::swiglu_bwd_recompute", mutates_args=())
def swiglu_bwd_recompute(
    preact: torch.Tensor, grad_h: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, grad_preact) in fresh buffers: `drop_h`'s backward when it may not overwrite."""
    if not triton_enabled(preact):
        return reference.swiglu(preact), reference.swiglu_grad(preact, grad_h)
    h, grad_preact = torch.empty_like(grad_h), torch.empty_like(preact)
    kernels.swiglu_backward(preact, grad_h, grad_preact, h)
    return h, grad_preact


@swiglu_bwd_recompute.register_fake
def _(preact: torch.Tensor, grad_h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(grad_h), torch.empty_like(preact)


@eager_op("swiglu_train::swiglu_bwd_recompute_", mutates_args=("preact", "grad_h"))
def swiglu_bwd_recompute_(preact: torch.Tensor, grad_h: torch.Tensor) -> None:
    """In place: preact becomes grad_preact and grad_h becomes h; nothing is allocated."""
    if not triton_enabled(preact):
        h, grad_preact = reference.swiglu(preact), reference.swiglu_grad(preact, grad_h)
        preact.copy_(grad_preact)
        grad_h.copy_(h)
        return
    kernels.swiglu_backward(preact, grad_h, preact, grad_h)


@swiglu_bwd_recompute_.register_fake
def _(preact: torch.Tensor, grad_h: torch.Tensor) -> None:
    return None


def torch_amaxes(
    grad_preact: torch.Tensor, h: torch.Tensor, rowwise: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The amaxes of ``swiglu_bwd_recompute_amax_`` (and its FP8-copy twin) in torch, where
    Triton does not run: max |grad_preact| and max |h|, and grad_preact's per row."""
    pair = torch.stack([grad_preact.abs().amax(), h.abs().amax()]).float()
    rows = grad_preact.abs().amax(1, keepdim=True) if rowwise else grad_preact.new_empty(0, 1)
    return pair, rows.float()


@eager_op("swiglu_train::swiglu_bwd_recompute_amax_", mutates_args=("preact", "grad_h"))
def swiglu_bwd_recompute_amax_(
    preact: torch.Tensor, grad_h: torch.Tensor, rowwise: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``swiglu_bwd_recompute_`` (preact becomes grad_preact, grad_h becomes h) and the amaxes
    an FP8 recipe scales them by, found as they are written: ([2] fp32: max |grad_preact| and
    max |h|; [M, 1] fp32: each row's max |grad_preact| where ``rowwise``, else [0, 1]). M > 0."""
    if not triton_enabled(preact):
        swiglu_bwd_recompute_(preact, grad_h)
        return torch_amaxes(preact, grad_h, rowwise)
    pair, rows = kernels.swiglu_backward(preact, grad_h, preact, grad_h, True, rowwise)
    return pair, rows if rowwise else preact.new_empty(0, 1, dtype=torch.float32)


@swiglu_bwd_recompute_amax_.register_fake
def _(preact: torch.Tensor, grad_h: torch.Tensor, rowwise: bool):
    rows = preact.shape[0] if rowwise else 0
    return preact.new_empty(2, dtype=torch.float32), preact.new_empty(rows, 1, dtype=torch.float32)


@eager_op("swiglu_train::swiglu_bwd_h_over_grad_h_amax_", mutates_args=("grad_h",))
def swiglu_bwd_h_over_grad_h_amax_(
    preact: torch.Tensor, grad_h: torch.Tensor, rowwise: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_preact in a fresh buffer, and the amaxes of ``swiglu_bwd_recompute_amax_``), h
    over grad_h: out of place, where preact must stay intact (a retained graph, or under
    torch.compile, whose functionalization copies a mutated saved tensor) but grad_h, read once,
    need not, so backward holds no new [M, F] buffer for h."""
    if not triton_enabled(preact):
        h, grad_preact = swiglu_bwd_recompute(preact, grad_h)
        grad_h.copy_(h)
        return grad_preact, *torch_amaxes(grad_preact, grad_h, rowwise)
    grad_preact = torch.empty_like(preact)
    pair, rows = kernels.swiglu_backward(preact, grad_h, grad_preact, grad_h, True, rowwise)
    return grad_preact, pair, rows if rowwise else preact.new_empty(0, 1, dtype=torch.float32)


@swiglu_bwd_h_over_grad_h_amax_.register_fake
def _(preact: torch.Tensor, grad_h: torch.Tensor, rowwise: bool):
    rows = preact.shape[0] if rowwise else 0
    return (
        torch.empty_like(preact),
        preact.new_empty(2, dtype=torch.float32),
        preact.new_empty(rows, 1, dtype=torch.float32),
    )
