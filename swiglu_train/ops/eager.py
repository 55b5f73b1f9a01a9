"""torch.library custom ops that eager code calls without the dispatcher.

A custom op is what torch.compile needs: an opaque node with a known shape and known
mutations. In eager mode its Python dispatch (autograd, ADInplaceOrView, backend wrappers,
each behind a dynamo-disable guard) cost ~100 µs of host time per call on our CPU runner,
and a training step of one ParMLP makes two to three such calls: as much host time as a
small layer's kernels take on an H200, where the grid measured our impls trailing Liger's
plain autograd Function most at small D and M (benchmarks/results/grid/grid_h200.md). So eager
calls go straight to the implementation, which is the op's own body; under torch.compile
the registered op is traced.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch


class EagerOp:
    """The registered op (``.op``) and a call that skips its dispatch outside torch.compile.

    Skipping the dispatch skips nothing these ops need in eager mode: their autograd lives
    in our own Functions, and in-place bodies bump version counters themselves (torch ops) or
    never did (Triton stores, which bypass autograd either way).
    """

    def __init__(self, name: str, fn: Callable, mutates_args: Iterable[str]) -> None:
        self.op = torch.library.custom_op(name, fn, mutates_args=tuple(mutates_args))
        self._fn = fn
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return self.op(*args, **kwargs)
        return self._fn(*args, **kwargs)

    def register_fake(self, fake: Callable) -> Callable:
        return self.op.register_fake(fake)


def eager_op(name: str, *, mutates_args: Iterable[str]) -> Callable[[Callable], EagerOp]:
    """``@torch.library.custom_op``'s drop-in for ops our autograd Functions call."""
    return lambda fn: EagerOp(name, fn, mutates_args)
