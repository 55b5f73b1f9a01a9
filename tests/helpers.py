"""Shared test math: float64 references and norm-relative errors."""

from __future__ import annotations

import torch

from swiglu_train.layers.layout import CANONICAL, relayout
from swiglu_train.ops import reference

# Norm-relative error allowed against a float64 reference: one or two roundings of the dtype.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double().cpu(), expected.double().cpu()
    assert torch.isfinite(actual).all(), "non-finite values"
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def reference_outputs(mlp: torch.nn.Module, x: torch.Tensor, grad_y: torch.Tensor) -> dict:
    """Output and grads of the eager MLP in float64 on the same values, on CPU.

    A packed fc1 is unpacked for the reference and its grads packed back for comparison.
    """
    layout = getattr(mlp, "fc1_layout", CANONICAL)
    params = {}
    for n, p in mlp.named_parameters():
        value = p.detach().double().cpu()
        if n.startswith("fc1."):
            value = relayout(value, layout, CANONICAL)
        params[n] = value.requires_grad_()
    x64 = x.detach().double().cpu().requires_grad_()
    y = reference.mlp(
        x64,
        params["fc1.weight"],
        params.get("fc1.bias"),
        params["fc2.weight"],
        params.get("fc2.bias"),
    )
    y.backward(grad_y.double().cpu())
    grads = {
        n: relayout(p.grad, CANONICAL, layout) if n.startswith("fc1.") else p.grad
        for n, p in params.items()
    }
    return {"y": y.detach(), "x": x64.grad, **grads}


def run_outputs(mlp: torch.nn.Module, x: torch.Tensor, grad_y: torch.Tensor) -> dict:
    x = x.detach().requires_grad_()
    mlp.zero_grad(set_to_none=True)
    y = mlp(x)
    y.backward(grad_y)
    return {"y": y.detach(), "x": x.grad, **{n: p.grad for n, p in mlp.named_parameters()}}


def crossover_table(points: dict, family: str = "H200") -> dict:
    """A synthetic crossover table: ``{(M, D, F): {impl: (ratio_to_floor, after_fwd_MiB)}}``."""
    return {
        "schema": 1,
        "gpu_family": family,
        "device_name": f"NVIDIA {family}",
        "commit": "abc1234",
        "dtype": "bf16",
        "points": [
            {
                "M": m,
                "D": d,
                "F": f,
                "impls": {
                    name: {"ms": 10.0 * ratio, "ratio_to_floor": ratio, "after_forward_MiB": mib}
                    for name, (ratio, mib) in impls.items()
                },
            }
            for (m, d, f), impls in points.items()
        ],
    }


def pretend_gpu(monkeypatch, table: dict, device_name: str = "NVIDIA H200") -> None:
    """Make impl="auto" see this GPU and this table, so its resolution is testable on CPU."""
    from swiglu_train.layers import auto

    parsed = auto.CrossoverTable.from_dict(table)
    monkeypatch.setattr(auto, "target_device_name", lambda device: device_name)
    monkeypatch.setattr(auto, "packaged_table", lambda family: parsed)


def dispatch_table(shapes: dict | None = None) -> dict:
    """A synthetic dispatch table: ``{"DxF": {kind: {M: path}}}``; none: no entries at all."""
    entry = {"ms": 1.0, "runner_up": None, "runner_up_ratio": None}
    return {
        "schema": 1,
        "gpu": "test",
        "commit": None,
        "dtype": "fp32",
        "shapes": {
            shape: {
                kind: {str(m): {"path": path, **entry} for m, path in by_m.items()}
                for kind, by_m in kinds.items()
            }
            for shape, kinds in (shapes or {}).items()
        },
    }
