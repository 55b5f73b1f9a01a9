"""ParExperts (routed SwiGLU experts) against a float64 loop over experts, on CPU: every impl,
both router-weight orders, the edge cases of routing, and the bytes each impl keeps."""

from __future__ import annotations

import pytest
import torch
from conftest import cpu_backends
from helpers import rel_err

from swiglu_train.layers.experts import ParExperts
from swiglu_train.ops import reference
from swiglu_train.ops.activation import use_backend
from swiglu_train.ops.experts import experts_mlp
from swiglu_train.ops.experts_quack import experts_quack_unavailable_reason

IMPLS = [("normal", False), ("drop_h", False), ("drop_h", True)]
# ... and with drop_h's grad_W1 gathering x inside its GEMM (tests/test_experts_wgrad.py)
WITH_OPTIONS = [(*impl, {}) for impl in IMPLS] + [
    ("drop_h", fp8, {"gathered_wgrad": True}) for fp8 in (False, True)
]
FP8_TOLERANCE = 6e-2  # e4m3's 3 mantissa bits: ~3 % rms on the recomputed gradients


def routing(t: int, e: int, k: int, skew: bool = False) -> torch.Tensor:
    """[T, k] distinct experts per token; with ``skew`` expert 0 is half the first choices."""
    idx = torch.stack([torch.randperm(e)[:k] for _ in range(t)]) if t else torch.zeros(0, k)
    if skew and t:
        first = torch.arange(t) % 2 == 0
        idx[first] = torch.stack(
            [
                torch.cat([torch.tensor([0]), torch.randperm(e - 1)[: k - 1] + 1])
                for _ in range(int(first.sum()))
            ]
        )
    return idx.long()


def run(impl, fp8, on, x, idx, w, fc1, fc2, grad_y, backend="triton", fn=experts_mlp, **options):
    """y and the grads of x, w, fc1, fc2 for one impl (through ``fn``: experts_mlp, compiled)."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, fc1, fc2)]
    with use_backend(backend):
        y = fn(leaves[0], idx, leaves[1], leaves[2], leaves[3], impl, fp8, on, **options)
        y.backward(grad_y)
    # With no tokens plain autograd may leave a leaf out of the graph: its gradient is zero
    return [y.detach()] + [torch.zeros_like(t) if t.grad is None else t.grad for t in leaves]


def oracle(x, idx, w, fc1, fc2, grad_y, on, dtype=torch.float64):
    """y and grads of the loop over experts, in ``dtype`` (float64: the truth)."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (x, w, fc1, fc2)]
    y = reference.experts(leaves[0], idx, leaves[1], leaves[2], leaves[3], on)
    y.backward(grad_y.to(dtype))
    return [y.detach()] + [torch.zeros_like(t) if t.grad is None else t.grad for t in leaves]


def inputs(t, d, f, e, k, dtype, skew=False):
    x = torch.randn(t, d, dtype=dtype)
    fc1 = (torch.randn(e, 2 * f, d) / d**0.5).to(dtype)
    fc2 = (torch.randn(e, d, f) / f**0.5).to(dtype)
    w = torch.rand(t, k)
    return x, routing(t, e, k, skew), w, fc1, fc2, torch.randn(t, d, dtype=dtype)


NAMES = ("y", "grad_x", "grad_router_weights", "grad_fc1", "grad_fc2")


@pytest.mark.parametrize(("device", "backend"), cpu_backends())
@pytest.mark.parametrize(("impl", "fp8", "options"), WITH_OPTIONS)
@pytest.mark.parametrize(("on", "skew"), [("output", True), ("input", False)])
def test_matches_float64_in_bf16(device, backend, impl, fp8, options, on, skew):
    """bf16: each output within twice the eager bf16 loop's error of float64 (FP8: 6 %)."""
    x, idx, w, fc1, fc2, grad_y = inputs(24, 32, 40, 5, 2, torch.bfloat16, skew)
    idx[idx == 3] = 4  # expert 3 gets no token
    idx[5, 1] = -1  # a dropped slot
    got = run(impl, fp8, on, x, idx, w, fc1, fc2, grad_y, backend, **options)
    truth = oracle(x, idx, w, fc1, fc2, grad_y, on)
    eager = oracle(x, idx, w, fc1, fc2, grad_y, on, torch.bfloat16)
    for name, a, b, c in zip(NAMES, got, truth, eager, strict=True):
        bound = 2 * rel_err(c, b) + 1e-3
        if fp8 and name != "y":
            bound = FP8_TOLERANCE
        assert rel_err(a, b) <= bound, (name, rel_err(a, b), bound)
    assert got[2][5, 1] == 0, "a dropped slot's router weight gets no gradient"
    assert got[3][3].abs().max() == 0 and got[4][3].abs().max() == 0, "expert 3 saw no token"


@pytest.mark.parametrize(("device", "backend"), cpu_backends())
@pytest.mark.parametrize(("impl", "fp8", "options"), WITH_OPTIONS)
@pytest.mark.parametrize("on", ["output", "input"])
def test_torch_compile_gives_eager_values(device, backend, impl, fp8, options, on):
    """A compiled model (torchtitan compiles each block) runs the same kernels: the Triton
    launches are opaque ops to torch.compile, so y and every gradient equal eager's."""
    x, idx, w, fc1, fc2, grad_y = inputs(24, 32, 40, 5, 2, torch.bfloat16, True)
    eager = run(impl, fp8, on, x, idx, w, fc1, fc2, grad_y, backend, **options)
    torch._dynamo.reset()
    compiled = torch.compile(experts_mlp, backend="aot_eager")
    traced = run(impl, fp8, on, x, idx, w, fc1, fc2, grad_y, backend, compiled, **options)
    for name, a, b in zip(NAMES, traced, eager, strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(("impl", "fp8"), IMPLS[:2])
@pytest.mark.parametrize("on", ["output", "input"])
def test_fp32_is_exact_to_rounding(impl, fp8, on):
    x, idx, w, fc1, fc2, grad_y = inputs(17, 24, 20, 3, 3, torch.float32)
    for name, a, b in zip(
        NAMES,
        run(impl, fp8, on, x, idx, w, fc1, fc2, grad_y),
        oracle(x, idx, w, fc1, fc2, grad_y, on),
        strict=True,
    ):
        assert rel_err(a, b) < 1e-5, name


@pytest.mark.parametrize(
    ("t", "e", "k"),
    [(0, 4, 2), (9, 1, 1), (11, 6, 1), (7, 3, 3)],
    ids=["no-tokens", "one-expert", "top-1", "every-expert"],
)
@pytest.mark.parametrize(("impl", "fp8"), IMPLS)
def test_edge_routings(t, e, k, impl, fp8):
    x, idx, w, fc1, fc2, grad_y = inputs(t, 16, 24, e, k, torch.float32)
    got = run(impl, fp8, "output", x, idx, w, fc1, fc2, grad_y, backend="torch")
    truth = oracle(x, idx, w, fc1, fc2, grad_y, "output")
    assert got[0].shape == (t, 16) and got[2].shape == (t, k)
    for name, a, b in zip(NAMES, got, truth, strict=True):
        if b.numel() and b.norm() > 0:
            assert rel_err(a, b) < (FP8_TOLERANCE if fp8 and name != "y" else 1e-5), name
        else:
            assert a.abs().max() == 0 if a.numel() else True, name


def test_every_slot_dropped_gives_zeros():
    x, idx, w, fc1, fc2, grad_y = inputs(5, 16, 8, 2, 2, torch.float32)
    got = run("drop_h", False, "output", x, torch.full_like(idx, -1), w, fc1, fc2, grad_y)
    assert all(t.abs().max() == 0 for t in got)


def test_saved_bytes_are_what_each_impl_claims():
    from swiglu_train.memory import SavedTensorCounter
    from swiglu_train.ops.experts import saved_activation_bytes

    t, d, f, e, k = 21, 32, 136, 4, 3  # F not a multiple of 128: a partial scale block
    for impl, fp8 in IMPLS:
        for on in ("output", "input"):
            m = ParExperts(e, d, f, impl, fp8, on, dtype=torch.bfloat16)
            x = torch.randn(t, d, dtype=torch.bfloat16, requires_grad=True)
            idx, w = routing(t, e, k), torch.rand(t, k, requires_grad=True)
            with (
                use_backend("torch"),
                SavedTensorCounter(exclude=[*m.parameters(), x, idx, w]) as counter,
            ):
                m(x, idx, w)
            claim = saved_activation_bytes(impl, fp8, on, t, d, f, k, e, torch.bfloat16)
            if impl == "normal":  # plus the routing's index vectors torch's ops keep
                assert claim <= counter.bytes <= claim + 64 * t * k, (impl, on)
            else:
                assert counter.bytes == claim, (impl, fp8, on, counter.bytes, claim)


def test_drop_h_keeps_less_than_normal_by_h_gathered_x_and_outputs():
    from swiglu_train.ops.experts import saved_activation_bytes

    t, d, f, k = 4096, 2048, 768, 8
    normal = saved_activation_bytes("normal", False, "output", t, d, f, k, 128, torch.bfloat16)
    drop_h = saved_activation_bytes("drop_h", False, "output", t, d, f, k, 128, torch.bfloat16)
    r = t * k
    plan = r * 4 + 128 * 4  # of the sorted plan: an int32 slot a row, E int32 offsets
    assert normal - drop_h == 2 * (r * d + r * f + r * d) - plan


def test_second_backward_is_refused_in_place_and_works_out_of_place():
    x, idx, w, _, _, grad_y = inputs(8, 16, 24, 3, 2, torch.float32)
    m = ParExperts(3, 16, 24)
    y = m(x, idx, w)
    y.backward(grad_y, retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace=False"):
        y.backward(grad_y)
    m = ParExperts(3, 16, 24, inplace=False)
    y = m(x, idx, w)
    y.backward(grad_y, retain_graph=True)
    first = m.fc1_weight.grad.clone()
    y.backward(grad_y)
    assert torch.allclose(m.fc1_weight.grad, 2 * first)


def test_module_takes_batched_tokens_and_keeps_parameter_names():
    m = ParExperts(4, 16, 8, dtype=torch.float32)
    assert dict(m.named_parameters()).keys() == {"fc1_weight", "fc2_weight"}
    assert m.fc1_weight.shape == (4, 16, 16) and m.fc2_weight.shape == (4, 16, 8)
    x = torch.randn(2, 3, 16)
    idx, w = torch.randint(0, 4, (2, 3, 2)), torch.rand(2, 3, 2)
    y = m(x, idx, w)
    flat = m(x.view(6, 16), idx.view(6, 2), w.view(6, 2))
    assert y.shape == (2, 3, 16) and torch.equal(y.view(6, 16), flat)


def test_auto_builds_drop_h_off_hopper_and_says_why():
    """As ParMLP's auto: the impl it chose, and auto_reason (None where the impl was named).
    Without a CUDA GPU drop_h_quack cannot run, so auto builds drop_h and names why; patch and
    pretrain hand auto to ParExperts (resolve_experts_impl), which resolves it so."""
    from swiglu_train.layers.experts import resolve_experts_impl

    m = ParExperts(4, 16, 8, impl="auto", gathered_wgrad=True)
    assert m.impl == "drop_h" and m.gathered_wgrad
    assert m.auto_reason == "drop_h: drop_h_quack cannot run here (no CUDA GPU)"
    assert resolve_experts_impl("auto", None) == ("auto", None)
    assert resolve_experts_impl("drop_h", "auto") == ("auto", None)
    assert ParExperts(4, 16, 8, impl="drop_h").auto_reason is None
    on_input = ParExperts(4, 16, 8, impl="auto", router_weights_on="input")
    assert on_input.impl == "drop_h" and "router weights on the input" in on_input.auto_reason


def test_auto_s_drop_h_quack_runs_drop_h_on_inputs_quack_cannot_take():
    """Where auto chose drop_h_quack (on a Hopper GPU), a call on the CPU or in fp32 runs drop_h,
    which has the same parameters and saved tensors, as ParMLP's auto falls back; a
    drop_h_quack the user named is refused there in one line instead."""
    torch.manual_seed(0)
    chosen = ParExperts(4, 16, 8, impl="auto")
    chosen.impl = "drop_h_quack"  # as auto picks it where quack runs (the impl attribute)
    named = ParExperts(4, 16, 8, impl="auto")
    named.impl, named.auto_reason = "drop_h_quack", None
    drop_h = ParExperts(4, 16, 8, impl="drop_h")
    for m in (chosen, named):
        m.load_state_dict(drop_h.state_dict())
    x = torch.randn(6, 16)
    idx, w = torch.randint(0, 4, (6, 2)), torch.rand(6, 2)
    assert torch.equal(chosen(x, idx, w), drop_h(x, idx, w))
    with pytest.raises(ValueError, match="drop_h_quack"):
        named(x, idx, w)


def test_auto_rule_takes_drop_h_quack_only_where_it_runs_and_the_weight_scales_the_output():
    """The rule on a device's facts (experts_auto): quack's reason, the sizes, the weight's side."""
    from swiglu_train.layers.experts import experts_auto

    assert experts_auto(4096, 14336, "input")[0] == "drop_h"
    impl, why = experts_auto(4096, 14336, "output")
    if torch.cuda.is_available() and experts_quack_unavailable_reason(4096, 14336) is None:
        assert impl == "drop_h_quack" and "faster than drop_h" in why
        assert experts_auto(4096, 14340, "output") == (
            "drop_h",
            "drop_h: drop_h_quack cannot run here (hidden_size 4096 and ffn_hidden_size 14340 "
            "must be multiples of 8 (16-byte rows for TMA))",
        )
    else:
        reason = experts_quack_unavailable_reason(4096, 14336)
        assert (impl, why) == ("drop_h", f"drop_h: drop_h_quack cannot run here ({reason})")


@pytest.mark.parametrize("impl", ["normal", "drop_h", "drop_h_quack"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("on", ["output", "input"])
def test_meta_tensors_give_shapes_as_parmlp_does(impl, dtype, on, monkeypatch):
    """Deferred init and tracing run the layer on meta tensors: y and every gradient come back
    with their shapes, whatever the dtype (torch's grouped GEMM has a meta kernel for bf16
    alone), with no index checked by value and no kernel launched. drop_h_quack, built where
    quack runs, traces drop_h's graph there, which keeps the same tensors."""
    from swiglu_train.layers import experts as layer

    monkeypatch.setattr(layer, "check_experts_quack_runs", lambda *_: None)  # as on a GPU
    m = ParExperts(4, 16, 24, impl=impl, router_weights_on=on, device="meta", dtype=dtype)
    x = torch.empty(2, 5, 16, device="meta", dtype=dtype, requires_grad=True)
    idx = torch.empty(2, 5, 2, device="meta", dtype=torch.int64)
    w = torch.empty(2, 5, 2, device="meta", requires_grad=True)
    y = m(x, idx, w)
    y.sum().backward()
    assert y.is_meta and y.shape == (2, 5, 16) and y.dtype == dtype
    assert x.grad.shape == x.shape and w.grad.shape == w.shape
    assert m.fc1_weight.grad.shape == (4, 48, 16) and m.fc2_weight.grad.shape == (4, 16, 24)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: {**a, "idx": a["idx"].float()}, "int32 or int64"),
        (
            lambda a: {**a, "idx": a["idx"][:-1]},
            r"expert_indices must be \[..., k\] over x's tokens",
        ),
        (lambda a: {**a, "w": a["w"][:, :1]}, "must match expert_indices' shape"),
        (lambda a: {**a, "idx": a["idx"].clamp_max(3) + 1}, r"in \[0, num_experts\) or -1"),
        (lambda a: {**a, "idx": a["idx"] - 3}, "found -"),
        (lambda a: {**a, "idx": a["idx"][:, :0], "w": a["w"][:, :0]}, "k >= 1"),
        (
            lambda a: {**a, "x": a["x"].double()},
            "fc1_weight is torch.float32 on cpu, x is torch.float64",
        ),
        (lambda a: {**a, "x": a["x"][:, :8]}, r"and x \[T, 16\]"),
        (lambda a: {**a, "w": a["w"].long()}, "floating point"),
    ],
    ids=[
        "float-indices",
        "short-indices",
        "weights-shape",
        "index-too-big",
        "index-below-minus-one",
        "k-zero",
        "dtype",
        "hidden",
        "int-weights",
    ],
)
def test_bad_input_is_refused_in_one_line(change, message):
    args = {"x": torch.randn(6, 16), "idx": torch.randint(0, 4, (6, 2)), "w": torch.rand(6, 2)}
    args = change(args)
    m = ParExperts(4, 16, 8)
    with pytest.raises((ValueError, TypeError), match=message) as info:
        m(args["x"], args["idx"], args["w"])
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"impl": "fast"}, "unknown experts impl 'fast'"),
        ({"impl": "normal", "saved_fp8": True}, "saved_fp8=True needs impl='drop_h'"),
        ({"router_weights_on": "both"}, "router_weights_on must be one of"),
        ({"num_experts": 0}, "num_experts must be a positive integer"),
        ({"impl": "normal", "gathered_wgrad": True}, "gathered_wgrad=True needs impl='drop_h'"),
    ],
)
def test_bad_construction_is_refused(kwargs, message):
    args = {"num_experts": 4, "hidden_size": 16, "ffn_hidden_size": 8, **kwargs}
    with pytest.raises(ValueError, match=message):
        ParExperts(**args)
