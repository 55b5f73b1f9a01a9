"""What a fuzz case's outputs are checked against (:mod:`swiglu_train.bench.fuzz.run`).

The expected values are the eager MLP's in float64 on the same values, each with the norm its
error is measured against: the value's own, or where its sums cancel, the rounding noise they
carry. torch's eager MLP in the case's own dtype tells how far off the platform's GEMMs alone
are, so that their error is not taken for the impl's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from swiglu_train.layers import ParMLP
from swiglu_train.layers.layout import CANONICAL, relayout
from swiglu_train.ops import reference


def reference_outputs(mlp: ParMLP, x: torch.Tensor, grad_y: torch.Tensor | None) -> dict:
    """y (and with ``grad_y`` the grads of x and every parameter) of the eager MLP in float64
    on the same values, each with the norm its error is measured against (:func:`_scale`); a
    packed fc1 is unpacked for it and its grads packed back."""
    layout, grad = mlp.fc1_layout, grad_y is not None
    params = {}
    for name, p in mlp.named_parameters():
        value = p.detach().double()
        if name.startswith("fc1."):
            value = relayout(value, layout, CANONICAL)
        params[name] = value.requires_grad_(grad)
    w1, b1, w2, b2 = (params.get(n) for n in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"))
    x64 = x.detach().double().reshape(-1, x.shape[-1]).requires_grad_(grad)
    with torch.enable_grad():
        preact = F.linear(x64, w1, b1)
        if grad:
            preact.retain_grad()
        h = reference.swiglu(preact)
        y = F.linear(h, w2, b2)
    h = h.detach()
    y_scale = _scale(h, w2.detach().t(), None if b2 is None else b2.detach())
    out = {"y": (y.detach().view(*x.shape[:-1], w2.shape[0]), y_scale)}
    if not grad:
        return out
    gy = grad_y.double().reshape(-1, grad_y.shape[-1])
    y.backward(gy)
    gp = preact.grad
    scales = {
        "x": _scale(gp, w1.detach()),
        "fc1.weight": _scale(gp.t(), x64.detach()),
        "fc1.bias": gp.norm().item(),
        "fc2.weight": _scale(gy.t(), h),
        "fc2.bias": gy.norm().item(),
    }
    out["x"] = (x64.grad.view(x.shape), scales["x"])
    for name, p in params.items():
        value = relayout(p.grad, CANONICAL, layout) if name.startswith("fc1.") else p.grad
        out[name] = (value, scales[name])
    return out


def _scale(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> float:
    """The norm of the root-sum-square of the terms of ``a @ b (+ bias)``: how large the
    rounding noise its inputs carry makes its error, where its sums cancel (an output of a
    few elements summing a few terms, say) and the norm of the result would not say."""
    terms = (a.square().sum(0) * b.square().sum(1)).sum()
    if bias is not None:
        terms = terms + a.shape[0] * bias.square().sum()
    return terms.sqrt().item()


def rel_err(actual: torch.Tensor, expected: torch.Tensor, scale: float = 0.0) -> float:
    """||actual - expected|| / max(||expected||, scale), in float64 (inf for a non-finite
    actual): norm-relative, unless the expected sums cancel below the noise ``scale`` says."""
    actual = actual.double()
    if not torch.isfinite(actual).all():
        return math.inf
    return ((actual - expected).norm() / max(expected.norm().item(), scale, 1e-30)).item()


def eager_errors(mlp: ParMLP, x: torch.Tensor, grad_y: torch.Tensor | None, expected: dict):
    """The relative errors of torch's own eager MLP (two F.linear around F.silu(gate) * up) in
    the case's dtype on the same device and values: what the platform's GEMMs achieve."""
    layout, grad = mlp.fc1_layout, grad_y is not None
    params = {}
    for name, p in mlp.named_parameters():
        value = p.detach()
        if name.startswith("fc1."):
            value = relayout(value, layout, CANONICAL)
        params[name] = value.clone().requires_grad_(grad)
    w1, b1, w2, b2 = (params.get(n) for n in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"))
    x2d = x.detach().reshape(-1, x.shape[-1]).clone().requires_grad_(grad)
    with torch.enable_grad():
        y = reference.mlp(x2d, w1, b1, w2, b2)
    got = {"y": y.detach().view(expected["y"][0].shape)}
    if grad:
        y.backward(grad_y.reshape(-1, grad_y.shape[-1]))
        got["x"] = x2d.grad.view(x.shape)
        for name, p in params.items():
            got[name] = relayout(p.grad, CANONICAL, layout) if name.startswith("fc1.") else p.grad
    return {name: rel_err(got[name], want, scale) for name, (want, scale) in expected.items()}
