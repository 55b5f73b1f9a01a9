"""Switch a live model, and its optimizer, between fc1 layouts."""

from __future__ import annotations

import torch
from torch import nn

from swiglu_train.layers import ParMLP
from swiglu_train.packing.optimizer import permute_state


def switch_impl(
    model: nn.Module, impl: str, optimizer: torch.optim.Optimizer | None = None
) -> list[str]:
    """Switch every ParMLP to ``impl``, repacking fc1 and its optimizer state together.

    Every layer's new layout and optimizer state are worked out before any is changed, so a
    switch that cannot be made (a chunk that does not divide F, a factored optimizer state, an
    fc1 the optimizer does not hold) leaves the model and optimizer as they were. Returns the
    names of the ParMLPs whose layout changed.
    """
    plans = []
    owned = (
        set() if optimizer is None else {id(q) for g in optimizer.param_groups for q in g["params"]}
    )
    for name, mlp in model.named_modules():
        if not isinstance(mlp, ParMLP):
            continue
        index, states = mlp.layout_change(impl), {}
        if index is not None and optimizer is not None:
            for kind, p in (("weight", mlp.fc1.weight), ("bias", mlp.fc1.bias)):
                where = f"{name}.fc1" if name else "fc1"
                if p is not None and p.requires_grad and id(p) not in owned:
                    raise ValueError(
                        f"{where}.{kind} is not one of the optimizer's parameters, so its state "
                        "could not follow the layout change (under FSDP2 a root module keeps "
                        "its parameters unsharded after a forward: call model.reshard() first)"
                    )
                if p is not None and optimizer.state.get(p):
                    states[p] = permute_state(optimizer.state[p], p.shape, index, where)
        plans.append((name, mlp, index, states))
    for _, mlp, _, states in plans:
        mlp.set_impl(impl)
        if optimizer is not None:
            optimizer.state.update(states)
    return [name for name, _, index, _ in plans if index is not None]
