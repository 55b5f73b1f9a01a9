"""What a checkpointed ParMLP recomputes in backward: fc1 again, never fc2 (ops.fc2_node).

A non-reentrant checkpoint stops its recompute once the last saved tensor is saved again;
`normal`'s fc2 saves h before its GEMM, and every other impl's fc2 is a node after the
Function's saves wherever saved-tensor hooks are on (as a checkpoint's are), so no impl's
recompute runs fc2. Grads are the same as unchecked, through
torch's reentrant checkpoint (Megatron's kind: it recomputes everything) too.
"""

import pytest
import torch
from helpers import TOLERANCE, rel_err
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from swiglu_train.layers import ParMLP
from swiglu_train.layers.registry import PORTABLE_IMPLS, QUACK_IMPLS
from swiglu_train.ops import quack_mlp, quack_save_factors, use_backend
from swiglu_train.ops.quack_mlp import quack_available

GEMMS = {"aten.mm", "aten.addmm", "aten.linear", "aten.matmul"}
CASES = [(impl, False) for impl in PORTABLE_IMPLS] + [("drop_h", True)]


class CountGemms(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += str(func.overloadpacket) in GEMMS
        return func(*args, **(kwargs or {}))


def backward_gemms(mlp: ParMLP, x: torch.Tensor, grad_y: torch.Tensor, mode: str | None):
    """The GEMMs backward ran (the recompute's included), and the grads."""
    mlp.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = mlp(x) if mode is None else checkpoint(mlp, x, use_reentrant=mode == "reentrant")
    counter = CountGemms()
    with counter:
        y.backward(grad_y)
    grads = [x.grad, *(p.grad for p in mlp.parameters())]
    return counter.count, grads


@pytest.mark.parametrize(("impl", "saved_fp8"), CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_the_recompute_runs_fc1_and_not_fc2(impl: str, saved_fp8: bool, bias: bool) -> None:
    torch.manual_seed(0)
    mlp = ParMLP(32, 48, bias=bias, impl=impl, saved_fp8=saved_fp8)
    x, grad_y = torch.randn(24, 32), torch.randn(24, 32)
    with use_backend("torch"):
        plain, grads = backward_gemms(mlp, x, grad_y, None)
        checkpointed, grads_ck = backward_gemms(mlp, x, grad_y, "non-reentrant")
        _, grads_re = backward_gemms(mlp, x, grad_y, "reentrant")
    assert plain == 4  # grad_h, grad_W2, grad_x, grad_W1
    assert checkpointed == plain + 1  # fc1 recomputed; fc2 not
    for g, g_ck, g_re in zip(grads, grads_ck, grads_re, strict=True):
        assert torch.equal(g_ck, g) and torch.equal(g_re, g)


@pytest.mark.parametrize("saved_fp8", [False, True])
def test_fc2_is_a_node_of_its_own_only_under_saved_tensor_hooks(saved_fp8: bool) -> None:
    """drop_h's Function ran fc2 in its forward (normal's and save_factors' fc2 is an F.linear
    of their own). Unhooked, it still does (one node: less host time a step); under any
    saved-tensor hooks fc2 is its own node, with the same grads."""
    torch.manual_seed(0)
    mlp = ParMLP(32, 48, impl="drop_h", saved_fp8=saved_fp8)
    x, grad_y = torch.randn(24, 32), torch.randn(24, 32)
    with use_backend("torch"):
        y = mlp(x.requires_grad_())
        assert type(y.grad_fn).__name__ != "_Fc2Backward"
        _, grads = backward_gemms(mlp, x, grad_y, None)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
            y = mlp(x)
        assert type(y.grad_fn).__name__ == "_Fc2Backward"
        mlp.zero_grad(set_to_none=True)
        x.grad = None
        y.backward(grad_y)
    for g, g_hooked in zip(grads, [x.grad, *(p.grad for p in mlp.parameters())], strict=True):
        assert torch.equal(g_hooked, g)


def test_a_second_backward_through_the_fc2_node_still_names_the_in_place_problem() -> None:
    mlp = ParMLP(32, 48, impl="drop_h")
    with use_backend("torch"), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        y = mlp(torch.randn(8, 32, requires_grad=True))
    with use_backend("torch"):
        y.sum().backward(retain_graph=True)
        with pytest.raises(RuntimeError, match=r"ran its backward in place.*inplace=False"):
            y.sum().backward()


@pytest.mark.gpu
@pytest.mark.skipif(not quack_available(), reason="needs quack-kernels and an sm_90+ GPU")
@pytest.mark.parametrize("impl", sorted(QUACK_IMPLS))
def test_quack_recompute_skips_fc2(impl: str, monkeypatch) -> None:
    """The quack impls' GEMMs are quack's (no aten op): count fc2's own calls instead."""
    names = []
    chosen = quack_mlp.chosen_gemm
    for module in (quack_mlp, quack_save_factors):  # each impl's own import of it
        monkeypatch.setattr(
            module, "chosen_gemm", lambda name, *args: names.append(name) or chosen(name, *args)
        )
    torch.manual_seed(0)
    mlp = ParMLP(256, 512, impl=impl).cuda().bfloat16()
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    grad_y = torch.randn_like(x)
    _, grads = backward_gemms(mlp, x, grad_y, None)
    mlp.zero_grad(set_to_none=True)
    x = x.requires_grad_()
    y = checkpoint(mlp, x, use_reentrant=False)
    names.clear()  # the forward's fc2
    y.backward(grad_y)
    assert "fc2" not in names and "grad_w2" in names
    for g, g_ck in zip(grads, [x.grad, *(p.grad for p in mlp.parameters())], strict=True):
        assert rel_err(g_ck, g) < TOLERANCE[torch.bfloat16]
