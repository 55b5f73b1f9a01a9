"""CUDA checks of the routed experts: every impl's y and gradients (x, router weights, fc1, fc2)
against float64 at an MoE layer's shape (D = 2048, F = 768, E = 128, k = 8, T = 4096) and at
the routing's edges; torch's grouped GEMM on an expert with no rows; the bytes held after
forward against each impl's claim; drop_h's backward peak; drop_h_quack's second-backward rules
and refusals.

Run with ``python -m pytest tests/test_gpu_experts.py -m gpu``. drop_h_quack's cases need
quack-kernels and an sm_90+ GPU, and skip without them.

Tolerance: each output's norm-relative error against the float64 loop over experts
(``reference.experts``) is at most twice the eager bf16 loop's on the same inputs, plus 1e-3
for outputs whose bf16 error is tiny (tests/test_experts.py's rule); gradients computed from
an FP8-saved preactivation get 6e-2 (e4m3's 3 mantissa bits).
"""

from __future__ import annotations

import functools
import re

import pytest
import torch

from swiglu_train.layers.experts import ParExperts
from swiglu_train.ops import reference
from swiglu_train.ops.experts import WEIGHTS_ON, experts_mlp, saved_activation_bytes
from swiglu_train.ops.experts_quack import SECOND_BACKWARD_ERROR
from swiglu_train.ops.quack_mlp import quack_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
NEEDS_QUACK = pytest.mark.skipif(
    not torch.cuda.is_available() or not quack_available(),
    reason="needs quack-kernels and an sm_90+ GPU",
)
GATHERED = {"gathered_wgrad": True}  # grad_W1 in the Triton GEMM that reads x's rows itself
IMPLS = [
    pytest.param("normal", False, {}, id="normal"),
    pytest.param("drop_h", False, {}, id="drop_h"),
    pytest.param("drop_h", True, {}, id="drop_h+fp8"),
    pytest.param("drop_h", False, GATHERED, id="drop_h+gathered_wgrad"),
    pytest.param("drop_h", True, GATHERED, id="drop_h+fp8+gathered_wgrad"),
    pytest.param("drop_h_quack", False, {}, id="drop_h_quack", marks=NEEDS_QUACK),
    pytest.param("drop_h_quack", True, {}, id="drop_h_quack+fp8", marks=NEEDS_QUACK),
]
# normal's claim leaves out the index vectors torch's ops keep; the backward's option saves alike
SAVING_IMPLS = [
    pytest.param(*p.values[:2], id=p.id, marks=p.marks) for p in IMPLS[1:] if not p.values[2]
]
FP8_TOLERANCE = 6e-2
NAMES = ("y", "grad_x", "grad_router_weights", "grad_fc1", "grad_fc2")
# name: (T, D, F, E, k, routing). D and F are multiples of 8 (quack's rows); F = 200 and 136
# leave a partial 128-column FP8 scale block.
CASES = {
    "moe-d2048": (4096, 2048, 768, 128, 8, "random"),
    "skewed": (1000, 256, 200, 16, 4, "skewed"),  # expert 0 takes half the first choices
    "edges": (333, 256, 136, 8, 2, "edges"),  # expert 3 gets no token, slot (5, 1) dropped
    # the same edges with D past drop_h_quack's COOPERATIVE_MIN_DEPTH: fc1 and grad_h on the
    # cooperative 128 x 256 tile, partial in rows and columns
    "edges-deep": (333, 1336, 136, 8, 2, "edges"),
    "no-tokens": (0, 64, 32, 4, 2, "random"),
    "one-expert": (77, 64, 32, 1, 1, "random"),
    "top-1": (300, 128, 96, 6, 1, "random"),
}
EMPTY_EXPERT, DROPPED_SLOT = 3, (5, 1)


def routing(t: int, e: int, k: int, kind: str) -> torch.Tensor:
    """[T, k] distinct experts per token, drawn by sorting random scores: "skewed" puts expert
    0 first for every other token; "edges" ranks EMPTY_EXPERT last (never chosen, k < E) and
    drops DROPPED_SLOT."""
    scores = torch.rand(t, e, device="cuda")
    if kind == "skewed":
        scores[::2, 0] = -1.0
    if kind == "edges":
        scores[:, EMPTY_EXPERT] = 2.0
    idx = scores.argsort(dim=1)[:, :k]
    if kind == "edges":
        idx[DROPPED_SLOT] = -1
    return idx


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Norm-relative error in float64 on the GPU (tests/helpers.py's copies to the host: 3 GB
    per fc1 grad at the MoE shape)."""
    assert torch.isfinite(actual).all(), "non-finite values"
    diff = (actual.double() - expected.double()).norm()
    return (diff / expected.double().norm().clamp_min(1e-30)).item()


def run(impl: str, fp8: bool, on: str, inputs: tuple, **options) -> list[torch.Tensor]:
    """y and the grads of x, the router weights, fc1 and fc2 for one impl."""
    x, idx, w, fc1, fc2, grad_y = inputs
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, fc1, fc2)]
    y = experts_mlp(leaves[0], idx, leaves[1], leaves[2], leaves[3], impl, fp8, on, **options)
    y.backward(grad_y)
    # With no tokens plain autograd may leave a leaf out of the graph: its gradient is zero
    return [y.detach()] + [torch.zeros_like(t) if t.grad is None else t.grad for t in leaves]


def loop(inputs: tuple, on: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """y and the grads of the plain loop over experts, computed in ``dtype``."""
    x, idx, w, fc1, fc2, grad_y = inputs
    leaves = [t.detach().to(dtype).requires_grad_() for t in (x, w, fc1, fc2)]
    y = reference.experts(leaves[0], idx, leaves[1], leaves[2], leaves[3], on)
    y.backward(grad_y.to(dtype))
    return [y.detach()] + [t.grad for t in leaves]


@functools.cache
def references(case: str, on: str) -> tuple[tuple, list[torch.Tensor], list[float]]:
    """(bf16 inputs, the float64 truth kept in fp32, the eager bf16 loop's errors): one per case
    and weight order, shared by the impls (the float64 loop at the MoE shape takes seconds)."""
    t, d, f, e, k, kind = CASES[case]
    torch.manual_seed(0)
    x = torch.randn(t, d, device="cuda").bfloat16()
    fc1 = (torch.randn(e, 2 * f, d, device="cuda") / d**0.5).bfloat16()
    fc2 = (torch.randn(e, d, f, device="cuda") / f**0.5).bfloat16()
    w = torch.rand(t, k, device="cuda")
    grad_y = torch.randn(t, d, device="cuda").bfloat16()
    inputs = (x, routing(t, e, k, kind), w, fc1, fc2, grad_y)
    truth = [g.float() for g in loop(inputs, on, torch.float64)]
    eager = [
        rel_err(a, b) if b.norm() > 0 else 0.0
        for a, b in zip(loop(inputs, on, torch.bfloat16), truth, strict=True)
    ]
    return inputs, truth, eager


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("on", WEIGHTS_ON)
@pytest.mark.parametrize(("impl", "fp8", "options"), IMPLS)
def test_matches_float64(case, on, impl, fp8, options):
    inputs, truth, eager = references(case, on)
    got = run(impl, fp8, on, inputs, **options)
    for name, a, b, eager_err in zip(NAMES, got, truth, eager, strict=True):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        if b.numel() == 0:
            continue
        if b.norm() == 0:  # no token (T = 0) or every slot dropped: exactly nothing
            assert a.abs().max() == 0, name
            continue
        bound = FP8_TOLERANCE if fp8 and name != "y" else 2 * eager_err + 1e-3
        assert rel_err(a, b) <= bound, (name, rel_err(a, b), bound)
    if CASES[case][-1] == "edges":
        grad_w, grad_fc1, grad_fc2 = got[2:]
        assert grad_w[DROPPED_SLOT] == 0, "a dropped slot's router weight gets no gradient"
        assert grad_fc1[EMPTY_EXPERT].abs().max() == 0, "expert 3 saw no token"
        assert grad_fc2[EMPTY_EXPERT].abs().max() == 0, "expert 3 saw no token"


def test_edge_case_has_token_counts_off_multiples_of_8():
    """The "edges" case exercises group sizes no GEMM tile divides (a guard on its routing)."""
    idx = references("edges", "output")[0][1]
    counts = torch.bincount(idx[idx >= 0], minlength=CASES["edges"][3])
    assert counts[EMPTY_EXPERT] == 0
    assert (counts % 8 != 0).any(), counts.tolist()


@pytest.mark.skipif(
    not torch.cuda.is_available()
    or not hasattr(torch, "_grouped_mm")
    or torch.cuda.get_device_capability() < (9, 0),
    reason="needs torch._grouped_mm on an sm_90+ GPU",
)
def test_grouped_mm_weight_grad_is_zero_for_an_expert_with_no_rows():
    """drop_h's weight grads (2d x 2d ``torch._grouped_mm`` over the sorted rows) rely on an
    empty group's output being written as zeros, not left as the allocator's old bytes: the
    output's block is poisoned with NaN first, so uninitialized memory would show."""
    sizes = [5, 0, 13, 0]  # empty in the middle and at the end; none a multiple of 8
    rows = sum(sizes)
    grad_out = torch.randn(rows, 96, device="cuda", dtype=torch.bfloat16)
    inp = torch.randn(rows, 40, device="cuda", dtype=torch.bfloat16)
    offsets = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    poison = torch.full((len(sizes), 96, 40), float("nan"), device="cuda", dtype=torch.bfloat16)
    del poison  # its block goes back to the cache, for the next request of its size
    out = torch._grouped_mm(grad_out.t(), inp, offs=offsets)
    start = 0
    for e, size in enumerate(sizes):
        part = slice(start, start + size)
        expected = grad_out[part].t().float() @ inp[part].float()
        torch.testing.assert_close(out[e].float(), expected, rtol=2**-7, atol=1e-2)
        start += size
    assert out[1].abs().max() == 0 and out[3].abs().max() == 0


def requested_bytes() -> int:
    """Bytes the live tensors asked for (memory_allocated would count a cached block the
    allocator hands out whole, up to 1 MiB larger than asked)."""
    return torch.cuda.memory_stats()["requested_bytes.all.current"]


@pytest.mark.parametrize("on", WEIGHTS_ON)
@pytest.mark.parametrize(("impl", "fp8"), SAVING_IMPLS)
def test_after_forward_holds_what_the_impl_claims(impl, fp8, on):
    """The allocator's growth over one forward is y plus the claimed saved bytes, within 512
    bytes (its rounding) per tensor: y, the plan's five vectors and the preactivation, or its
    copy and scales."""
    t, d, f, e, k = 1024, 512, 200, 16, 4
    layer = ParExperts(e, d, f, impl, fp8, on, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    idx, w = routing(t, e, k, "random"), torch.rand(t, k, device="cuda", requires_grad=True)
    layer(x, idx, w).sum().backward()  # warm-up: compiles, workspaces, the grads' buffers
    torch.cuda.synchronize()
    base = requested_bytes()
    y = layer(x, idx, w)
    torch.cuda.synchronize()
    held = requested_bytes() - base - y.numel() * y.element_size()
    claim = saved_activation_bytes(impl, fp8, on, t, d, f, k, e, torch.bfloat16)
    assert abs(held - claim) <= 512 * (8 if fp8 else 7), (held, claim)


@pytest.mark.parametrize("on", WEIGHTS_ON)
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_drop_h_backward_peak_holds_no_gathered_x_beside_the_weight_grads(on, fp8):
    """With gathered_wgrad, drop_h's backward allocates at its peak both weight gradients,
    grad_x and (from the FP8 copy) grad_preact: grad_W1's GEMM reads x's rows itself
    (kernels.experts_wgrad). Here the weight gradients (48 MiB) dwarf the [R, D] rows (4 MiB)
    that gathering first adds."""
    t, d, f, e, k = 1024, 512, 256, 64, 4
    layer = ParExperts(
        e, d, f, "drop_h", fp8, on, gathered_wgrad=True, device="cuda", dtype=torch.bfloat16
    )
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    idx, w = routing(t, e, k, "random"), torch.rand(t, k, device="cuda", requires_grad=True)
    grad_y = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    layer(x, idx, w).backward(grad_y)  # warm-up: compiles and autotunes
    layer.zero_grad(set_to_none=True)
    x.grad = w.grad = None
    y = layer(x, idx, w)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y.backward(grad_y)
    torch.cuda.synchronize()
    grown = torch.cuda.max_memory_allocated() - base
    held = sum(p.grad.numel() * 2 for p in layer.parameters()) + x.numel() * 2
    held += t * k * 2 * f * 2 if fp8 else 0  # grad_preact: the bf16 preact is overwritten
    assert grown <= held + 2**20, (grown / 2**20, held / 2**20)


@NEEDS_QUACK
def test_drop_h_quack_second_backward_is_refused_in_place_and_works_out_of_place():
    t, d, f, e, k = 64, 64, 32, 4, 2
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    idx, w = routing(t, e, k, "random"), torch.rand(t, k, device="cuda")
    in_place = ParExperts(e, d, f, "drop_h_quack", device="cuda", dtype=torch.bfloat16)
    y = in_place(x, idx, w)
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=re.escape(SECOND_BACKWARD_ERROR)):
        y.sum().backward()
    kept = ParExperts(e, d, f, "drop_h_quack", inplace=False, device="cuda", dtype=torch.bfloat16)
    y = kept(x, idx, w)
    y.sum().backward(retain_graph=True)
    once = kept.fc1_weight.grad.clone()
    y.sum().backward()
    torch.testing.assert_close(kept.fc1_weight.grad, 2 * once, rtol=2**-7, atol=1e-3)


@NEEDS_QUACK
def test_drop_h_quack_refuses_in_one_line_what_quack_cannot_take():
    with pytest.raises(ValueError, match="multiples of 8") as info:
        ParExperts(4, 100, 64, "drop_h_quack")
    assert "\n" not in str(info.value)
    x = torch.randn(8, 64, device="cuda")  # fp32: quack's GEMMs here are 16-bit
    fc1, fc2 = torch.randn(2, 64, 64, device="cuda"), torch.randn(2, 64, 32, device="cuda")
    idx, w = torch.zeros(8, 1, dtype=torch.long, device="cuda"), torch.ones(8, 1, device="cuda")
    with pytest.raises(TypeError, match="bf16 or fp16"):
        experts_mlp(x, idx, w, fc1, fc2, impl="drop_h_quack")
