"""Shared test math (float64 references, norm-relative errors) and test fixtures' parts."""

from __future__ import annotations

import weakref

import torch

from swiglu_train.layers.layout import CANONICAL, relayout
from swiglu_train.ops import reference
from swiglu_train.ops.fp8_saved import copy_buffers

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


def auto_model(impls: dict, family: str = "H200", ds: tuple = (16, 8192)) -> dict:
    """A synthetic auto model file, fitted (it says) at D in ``ds``. ``impls`` maps an impl to
    (c, after_forward_per_mf): a = 0 and a negligible host time, so c is its predicted ratio
    at every shape; or to (c, a, host_ms, after_forward_per_mf) in full."""
    terms = {name: v if len(v) == 4 else (v[0], 0.0, 1e-9, v[1]) for name, v in impls.items()}
    return {
        "schema": 1,
        "gpu_family": family,
        "device_name": f"NVIDIA {family}",
        "commit": "abc1234",
        "dtype": "bf16",
        "measured_with": "swiglu-train bench-grid",
        "command": "swiglu-train bench-grid --merge grid.json --auto-model auto.json",
        "floor_tflops": 800.0,
        "points": [[4096, d, 4 * d] for d in ds],
        "impls": {
            name: {
                "c": c,
                "a": a,
                "host_ms": host_ms,
                "after_forward_per_md": 2.0,
                "after_forward_per_mf": per_mf,
                "gpu_points": 2 * len(ds),
            }
            for name, (c, a, host_ms, per_mf) in terms.items()
        },
    }


def pretend_gpu(monkeypatch, model: dict, device_name: str = "NVIDIA H200") -> None:
    """Make impl="auto" see this GPU and this model, so its resolution is testable on CPU."""
    from swiglu_train.layers import auto

    parsed = auto.AutoModel.from_dict(model)
    monkeypatch.setattr(auto, "target_device_name", lambda device: device_name)
    monkeypatch.setattr(auto, "packaged_model", lambda family: parsed)


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


def watch_planner_builds(monkeypatch) -> list:
    """Weak references to a parameter of each model the Lightning planner builds (the memory,
    not Fabric's wrapper, which dies first); building one while an earlier one lives fails."""
    from swiglu_train.integrations.lightning import planner

    built, real_build = [], planner._build

    def build_alone(*args):
        assert [ref for ref in built if ref() is not None] == [], "a model outlived its measure"
        module, optimizer = real_build(*args)
        built.append(weakref.ref(next(module.parameters())))
        return module, optimizer

    monkeypatch.setattr(planner, "_build", build_alone)
    return built


def fp8_buffers(m: int, ffn: int, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Empty h [m, F] (``like``'s dtype) and the FP8 copy's buffers: the forward op's outputs."""
    return (like.new_empty(m, ffn), *copy_buffers(m, ffn, like))


SEED_SHAPE = (11136, 3584, 14336, 3584)  # issue 19's M, D, F, O


def seed_step_bytes(saved_fp8: bool, impl: str = "drop_h") -> tuple[int, int, int]:
    """(forward's peak, after forward, backward's peak) allocator bytes above the step's start
    for ``impl`` at issue 19's seed shape, bf16 on CUDA; x, the weights and grad_y exist
    before, parameter grads do not."""
    from swiglu_train import ParMLP

    m, d, ffn, out = SEED_SHAPE
    mlp = ParMLP(d, ffn, out, impl=impl, saved_fp8=saved_fp8, device="cuda",
                 dtype=torch.bfloat16)  # fmt: skip
    x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad_y = torch.randn(m, out, device="cuda", dtype=torch.bfloat16)
    mlp(x).backward(grad_y)  # warm-up: compiles and cuBLAS workspaces
    x.grad = None
    mlp.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    y = mlp(x)
    torch.cuda.synchronize()
    forward_peak = torch.cuda.max_memory_allocated() - base
    after_forward = torch.cuda.memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    y.backward(grad_y)
    torch.cuda.synchronize()
    return forward_peak, after_forward, torch.cuda.max_memory_allocated() - base
