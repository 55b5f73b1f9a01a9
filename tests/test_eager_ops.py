"""Eager calls skip torch.library's dispatch; torch.compile still sees the registered op."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from swiglu_train.ops.activation import swiglu_fwd, use_backend
from swiglu_train.ops.reference import swiglu


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_eager_call_runs_the_body_without_the_op_dispatch():
    preact = torch.randn(5, 8)
    with use_backend("torch"), _Ops() as eager:
        h = swiglu_fwd(preact)
    with use_backend("torch"), _Ops() as dispatched:
        h_op = swiglu_fwd.op(preact)
    torch.testing.assert_close(h, swiglu(preact), rtol=0, atol=0)
    torch.testing.assert_close(h_op, h, rtol=0, atol=0)
    assert not any("swiglu_train" in n for n in eager.names)
    assert "swiglu_train.swiglu_fwd.default" in dispatched.names


def test_compiled_graph_holds_the_registered_op():
    graphs = []

    def backend(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    with use_backend("torch"):
        compiled = torch.compile(lambda p: swiglu_fwd(p) * 2, backend=backend, fullgraph=True)
        preact = torch.randn(5, 8)
        torch.testing.assert_close(compiled(preact), swiglu(preact) * 2)
    targets = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert any("swiglu_train.swiglu_fwd" in t for t in targets), targets
