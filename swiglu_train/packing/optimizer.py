"""Per-element optimizer state follows its parameter when the fc1 layout changes.

Adam's moments, SGD's momentum buffer and every other state tensor of the parameter's shape
are permuted with the same row index; scalar state (``step``) is left alone. State of any
other shape (a factored second moment, say) cannot be permuted row-wise and is refused.
In a checkpoint, state is mapped to parameters through the names the checkpoint records;
without them the mapping would be a guess, so it is refused.
"""

from __future__ import annotations

import torch

from swiglu_train.layers.layout import permute_rows
from swiglu_train.packing.checkpoint_read import CKPT_KEY


def permute_state(state: dict, param_shape: torch.Size, index: torch.Tensor, where: str) -> dict:
    """A copy of one parameter's optimizer state with per-element tensors re-ordered."""
    out = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor) and _holds_rows(value):
            raise ValueError(
                f"{where}: optimizer state {key!r} is a {type(value).__name__} holding "
                "non-scalar tensors; they cannot be told apart from per-row state, so it "
                "cannot follow a layout change"
            )
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            out[key] = value
        elif value.shape == param_shape:
            out[key] = permute_rows(value, index)  # FSDP2 keeps state as DTensors too
        else:
            raise ValueError(
                f"{where}: optimizer state {key!r} has shape {tuple(value.shape)}, not the "
                f"parameter's {tuple(param_shape)}; a non-elementwise state cannot follow a "
                "layout change"
            )
    return out


def _holds_rows(value: object) -> bool:
    """Whether a list, tuple or dict holds a non-scalar tensor: per-row state (a history of
    moments, say) hidden there would keep the old row order without an error."""
    if isinstance(value, torch.Tensor):
        return value.dim() > 0
    if isinstance(value, dict):
        value = list(value.values())
    return isinstance(value, (list, tuple)) and any(_holds_rows(v) for v in value)


def check_optimizer_names(optimizer_states: list, names: object) -> None:
    """Refuse optimizer state whose parameters the recorded names do not name one to one.

    Optimizer state_dicts key state by integer ids listed per param group, and our record
    names the parameters of one optimizer, group by group. Pairing them any other way (the
    names of one optimizer read against another's ids, or no names at all) would permute some
    state and leave the rest scrambled, without an error.
    """
    where = f"{CKPT_KEY}.optimizer_param_names"
    if names is None:
        raise ValueError(
            f"checkpoint has optimizer_states but no recorded parameter names ({where}); "
            "mapping them would be a guess"
        )
    if len(optimizer_states) != 1:
        raise ValueError(
            f"checkpoint has {len(optimizer_states)} optimizer states but {where} names the "
            "parameters of one optimizer; which names go with which state would be a guess"
        )
    opt = optimizer_states[0]
    if not isinstance(opt, dict) or not isinstance(opt.get("param_groups"), list):
        raise ValueError("optimizer_states[0] is not an optimizer state_dict (no param_groups)")
    sizes = [len(group["params"]) for group in opt["param_groups"]]
    groups = isinstance(names, list) and all(isinstance(g, list) for g in names)
    named = [len(g) for g in names] if groups else names
    if not groups or named != sizes:
        raise ValueError(
            f"{where} has groups of {named} names, but optimizer_states[0]'s param groups hold "
            f"{sizes} parameters; mapping them would be a guess"
        )


def move_optimizer_state(
    ckpt: dict, names: list[list[str]] | None, key: str, index: torch.Tensor
) -> int:
    """Permute the state of parameter ``key`` in the optimizer; returns how many moved.

    The recorded names per group pair with the state ids one to one
    (:func:`check_optimizer_names`).
    """
    moved = 0
    for opt in ckpt.get("optimizer_states") or []:
        for group_names, group in zip(names, opt["param_groups"], strict=True):
            for name, param_id in zip(group_names, group["params"], strict=True):
                if name == key and param_id in opt["state"]:
                    shape = ckpt["state_dict"][key].shape
                    opt["state"][param_id] = permute_state(
                        opt["state"][param_id], shape, index, key
                    )
                    moved += 1
    return moved
