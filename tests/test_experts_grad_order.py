"""Which weight gradient drop_h's backward computes first: the order of the lower peak by the
size model of ``ops.experts_peak`` (whose figures ``test_experts_peak.py`` checks against the
GPU's), recorded here as the order in which backward writes the two gradients."""

from __future__ import annotations

import pytest
import torch
from test_experts import inputs
from torch.utils._python_dispatch import TorchDispatchMode

from swiglu_train.kernels.runtime import triton_runs_on
from swiglu_train.ops.activation import use_backend
from swiglu_train.ops.experts import experts_mlp
from swiglu_train.ops.experts_peak import grad_fc2_first

T, D, F, K = 40, 32, 24, 2  # R = 80 rows: no [R, .] tensor has a weight gradient's shape


class _WeightGradOrder(TorchDispatchMode):
    """The order in which tensors shaped like one expert's fc1 [2F, D] or fc2 [D, F] (whole or
    per expert) are written, leaving out views of the weights themselves."""

    def __init__(self, weights: tuple[torch.Tensor, ...]) -> None:
        super().__init__()
        self.weights = {w.untyped_storage().data_ptr() for w in weights}
        self.order: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if not isinstance(t, torch.Tensor) or t.dim() < 2:
                continue
            if t.untyped_storage().data_ptr() in self.weights:
                continue
            name = {(2 * F, D): "grad_W1", (D, F): "grad_W2"}.get(tuple(t.shape[-2:]))
            if name and name not in self.order:
                self.order.append(name)
        return out


def _torch_path_order(experts: int, pinned: bool) -> bool:
    """The order drop_h's torch path takes at this module's shapes, gathering x first."""
    rows = T * K
    return grad_fc2_first(
        grad_w2=experts * D * F,
        grad_preact=rows * 2 * F,
        waiting=rows * (D + F),
        gathered=rows * D,
        pinned=pinned,
    )


def test_pinned_grad_preact_puts_grad_w2_first_where_its_size_alone_would_not():
    assert not _torch_path_order(8, pinned=False)  # grad_W2 the larger: its rows wait
    assert _torch_path_order(8, pinned=True)  # grad_preact stays anyway: the rows only add
    assert _torch_path_order(4, pinned=False)  # grad_W2 now the smaller


@pytest.mark.skipif(not triton_runs_on(torch.device("cpu")), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize(
    ("saved_fp8", "inplace", "experts", "first"),
    [
        (False, True, 8, "grad_W1"),  # in place the saved preact is freed after grad_W1: by size
        (False, False, 8, "grad_W1"),  # out of place grad_preact is a copy, freed: by size
        (True, True, 8, "grad_W1"),  # from the FP8 copy grad_preact is its own buffer
        (True, True, 4, "grad_W2"),  # grad_W2 (4 D F) now smaller than its rows R (D + F)
    ],
)
def test_drop_h_backward_computes_the_weight_gradients_in_the_rule_s_order(
    saved_fp8, inplace, experts, first
):
    x, idx, w, fc1, fc2, grad_y = inputs(T, D, F, experts, K, torch.float32)
    for leaf in (x, w, fc1, fc2):
        leaf.requires_grad_()
    with use_backend("triton"):
        y = experts_mlp(x, idx, w, fc1, fc2, "drop_h", saved_fp8=saved_fp8, inplace=inplace)
        with _WeightGradOrder((fc1, fc2)) as recorded:
            y.backward(grad_y)
    assert recorded.order[0] == first, recorded.order
    assert sorted(recorded.order) == ["grad_W1", "grad_W2"]


@pytest.mark.skipif(not triton_runs_on(torch.device("cpu")), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("inplace", [True, False])
def test_in_place_the_saved_preact_is_freed_before_grad_w2_is_written(inplace):
    """In place grad_preact is the saved preactivation, which autograd's slot would hold until
    backward returns: backward frees its storage once grad_W1 has read it, so grad_W2, computed
    last, never stands beside it. Out of place the saved preact stays whole (a second backward
    reads it)."""
    x, idx, w, fc1, fc2, grad_y = inputs(T, D, F, 8, K, torch.float32)
    for leaf in (x, w, fc1, fc2):
        leaf.requires_grad_()
    saved = []

    def pack(t):
        if tuple(t.shape) == (T * K, 2 * F):
            saved.append(t)
        return t

    with use_backend("triton"), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = experts_mlp(x, idx, w, fc1, fc2, "drop_h", inplace=inplace)
    (preact,) = saved
    seen = {}

    class _PreactAtWeightGrads(_WeightGradOrder):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            for name in self.order:
                seen.setdefault(name, preact.untyped_storage().nbytes())
            return out

    with use_backend("triton"), _PreactAtWeightGrads((fc1, fc2)) as recorded:
        y.backward(grad_y, retain_graph=not inplace)
    assert recorded.order == ["grad_W1", "grad_W2"]
    whole = T * K * 2 * F * 4
    assert seen == {"grad_W1": whole, "grad_W2": 0 if inplace else whole}
