"""Per-element optimizer state follows its parameter when the fc1 layout changes.

Adam's moments, SGD's momentum buffer and every other state tensor of the parameter's shape
are permuted with the same row index; scalar state (``step``) is left alone. State of any
other shape (a factored second moment, say) cannot be permuted row-wise and is refused.
"""

from __future__ import annotations

import torch


def permute_state(state: dict, param_shape: torch.Size, index: torch.Tensor, where: str) -> dict:
    """A copy of one parameter's optimizer state with per-element tensors re-ordered."""
    out = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            out[key] = value
        elif value.shape == param_shape:
            out[key] = value.index_select(0, index.to(value.device))
        else:
            raise ValueError(
                f"{where}: optimizer state {key!r} has shape {tuple(value.shape)}, not the "
                f"parameter's {tuple(param_shape)}; a non-elementwise state cannot follow a "
                "layout change"
            )
    return out
