"""Per-element optimizer state follows its parameter when the fc1 layout changes.

Adam's moments, SGD's momentum buffer and every other state tensor of the parameter's shape
are permuted with the same row index; scalar state (``step``) is left alone. State of any
other shape (a factored second moment, say) cannot be permuted row-wise and is refused.
"""

from __future__ import annotations

import torch

from swiglu_train.layers.layout import permute_rows


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
