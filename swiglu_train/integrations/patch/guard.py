"""Refuse an optimizer created before ``patch``: it would step the replaced host weights.

``patch`` swaps each MLP's linears for one fused fc1 and an fc2, so an optimizer built
earlier holds tensors the model no longer reads; its steps would leave the patched MLPs
untrained, silently. Each replaced parameter is remembered (weakly: forgetting it frees
nothing) and a global optimizer step pre-hook raises on the first step of an optimizer that
still holds one.
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

# id(param) -> (weak reference to it, its name in the model when it was replaced)
_replaced: dict[int, tuple[weakref.ref, str]] = {}
_hook: torch.utils.hooks.RemovableHandle | None = None


def remember(params: dict[str, torch.Tensor]) -> None:
    """Watch ``params`` (name -> replaced parameter) for as long as anything holds them."""
    global _hook
    for name, p in params.items():
        key = id(p)
        _replaced[key] = (weakref.ref(p, lambda _, key=key: _replaced.pop(key, None)), name)
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_refuse_stale)


def stale_names(optimizer: torch.optim.Optimizer) -> list[str]:
    """Names of the replaced parameters ``optimizer`` still holds."""
    names = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            entry = _replaced.get(id(p))
            if entry is not None and entry[0]() is p:
                names.append(entry[1])
    return names


def _refuse_stale(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if not _replaced:
        return
    names = stale_names(optimizer)
    if names:
        more = f" and {len(names) - 1} more" if len(names) > 1 else ""
        raise RuntimeError(
            f"{type(optimizer).__name__} holds {names[0]}{more}, which swiglu_train.patch "
            "replaced: the optimizer was created before patch(model) and would not train the "
            "patched MLPs. Create the optimizer after patch (in Lightning: patch in __init__ "
            "or configure_model, so configure_optimizers sees the patched parameters)."
        )
