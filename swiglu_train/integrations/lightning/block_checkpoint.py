"""Activation checkpointing of whole blocks, from the first: the built-in Llama's and a
``--model`` host's (Hugging Face decoder layers, LitGPT blocks), whatever their forward takes.

A checkpointed block's forward keeps only its inputs for backward, which runs the block again
first. Non-reentrant (``use_reentrant=False``), so the recompute saves through autograd as the
first forward did, our impls' in-place backwards see a fresh saved preactivation, and the
recompute stops at the block's last save (fc2 then runs in a node of its own: ops/fc2_node.py).

The checkpoint wraps the block's own forward as an instance attribute, inside the module call,
so the memory profiler's hooks on the block count the inputs it keeps as that block's, and
parameters, buffers and checkpoint keys stay as they are. A forward without grad (eval) runs
as is: there is nothing to recompute.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def _checkpointed(forward: Callable, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def is_checkpointed(block: nn.Module) -> bool:
    """Whether ``block`` runs under the checkpoint (its forward is the wrapped one)."""
    forward = vars(block).get("forward")
    return isinstance(forward, functools.partial) and forward.func is _checkpointed


def set_checkpointed(block: nn.Module, on: bool) -> None:
    """Run ``block`` under the checkpoint, or not; setting what is already set does nothing."""
    if on == is_checkpointed(block):
        return
    if on:
        block.forward = functools.partial(_checkpointed, block.forward)
        return
    inner = block.forward.args[0]
    if getattr(inner, "__func__", None) is type(block).forward:
        del block.forward  # the class's own again
    else:
        block.forward = inner  # a forward someone else had set on the block, kept


class CheckpointLayers:
    """``checkpoint_layers`` for a decoder (an ``nn.Module``) whose ``layers`` are its blocks:
    how many of them, from the first, run under the checkpoint (as Megatron's
    ``--recompute-method block --recompute-num-layers N``); settable between steps, as the
    planner tries several counts on one model."""

    layers: Sequence[nn.Module]

    @property
    def checkpoint_layers(self) -> int:
        return sum(is_checkpointed(block) for block in self.layers)

    @checkpoint_layers.setter
    def checkpoint_layers(self, n: int) -> None:
        blocks = self.layers
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= len(blocks):
            raise ValueError(f"checkpoint_layers must be from 0 to {len(blocks)}, got {n!r}")
        for i, block in enumerate(blocks):
            set_checkpointed(block, i < n)
