"""fc2 as an autograd node of its own, after the MLP Function's saves, so that activation
checkpointing does not recompute it.

A non-reentrant checkpoint (``torch.utils.checkpoint(use_reentrant=False)``, Lightning's and
HF's) recomputes a block in backward only until the last tensor its forward saved is saved
again, then stops (early stop). The ``normal`` impl's fc2 is an ``F.linear`` that saves h
before its GEMM runs, so the recompute stops short of it. An MLP Function that ran fc2 inside
its own forward saves only once that forward returned, after fc2: each checkpointed block then
recomputed one GEMM more than ``normal`` (a sixth of the MLP's training FLOPs; the H200's 3B
table showed it as 2-4 % of the step with every block checkpointed).

So the Function returns h, and fc2 runs here, saving nothing: the Function's backward reads
fc2's weight from its own saves and takes fc2's output gradient from the ``Fc2Handoff``. This
node returns no gradient for h (None; the Function, which does not materialize it, is called
with None): the Function computes grad_h itself, fused with its recompute of h.
The extra node costs host time (21 us a step on a CPU: host_time_cpu.json's fc2_node run in
benchmarks/results; a small shape's step on an H200 is the host's), so it is made only where
saved-tensor hooks are on: a non-reentrant checkpoint sets them in its forward and its
recompute alike, so both see the same saves. Elsewhere (no checkpoint, or a reentrant one,
which recomputes everything anyway) the Function keeps fc2; under torch.compile too
(AOTAutograd plans its own recompute), and with no grad to compute there is nothing to hand
off.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

Fc2 = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


class Fc2Handoff:
    """fc2's output gradient, from its node's backward to the MLP Function's."""

    __slots__ = ("grad_y",)

    def __init__(self) -> None:
        self.grad_y: torch.Tensor | None = None

    def take(self) -> torch.Tensor:
        grad_y, self.grad_y = self.grad_y, None
        if grad_y is None:
            raise RuntimeError("ParMLP: the MLP's backward ran before its fc2 node's backward")
        return grad_y


class _Fc2(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, fc2_weight, fc2_bias, fc2: Fc2, handoff: Fc2Handoff) -> torch.Tensor:
        ctx.handoff = handoff
        return fc2(h, fc2_weight, fc2_bias)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        ctx.handoff.grad_y = grad_y
        return None, None, None, None, None


def saved_tensors_hooked() -> bool:
    """Whether saved-tensor hooks are on (a checkpoint's, save_on_cpu's, a profiler's). Read
    through torch's private query (AOTAutograd's too); a torch without it gets True."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(True) is not None


def handoff_for_fc2() -> Fc2Handoff | None:
    """A handoff where fc2 should run as its own node (eager, with grad, saved-tensor hooks
    on), else None."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return None
    return Fc2Handoff() if saved_tensors_hooked() else None


def fc2_or_h(ctx, handoff: Fc2Handoff | None, h, fc2_weight, fc2_bias, fc2: Fc2 = F.linear):
    """The end of an MLP Function's forward, after its saves: h for the fc2 node, or y."""
    ctx.handoff = handoff
    if handoff is None:
        return fc2(h, fc2_weight, fc2_bias)
    ctx.set_materialize_grads(False)  # h's gradient stays None: no [M, F] of zeros
    return h


def fc2_grad_y(ctx, grad_out: torch.Tensor) -> torch.Tensor:
    """The start of its backward: fc2's output gradient, contiguous."""
    grad_y = grad_out if ctx.handoff is None else ctx.handoff.take()
    return grad_y.contiguous()


def with_fc2_node(
    function: type[torch.autograd.Function], *args, fc2: Fc2 = F.linear
) -> torch.Tensor:
    """``function.apply(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, *rest, handoff)``, its h
    through fc2 in a node of its own where ``handoff_for_fc2`` gives one."""
    handoff = handoff_for_fc2()
    out = function.apply(*args, handoff)
    return out if handoff is None else _Fc2.apply(out, args[3], args[4], fc2, handoff)
