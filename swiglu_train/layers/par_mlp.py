"""ParMLP: a SwiGLU MLP whose memory/recompute trade-off is chosen by name.

Parameters are the same for every impl (``fc1.weight`` [2F, D] in canonical [W_gate; W_up]
layout, ``fc2.weight`` [O, F], optional biases), so a model can switch ``impl`` at any time
and keep computing the same function.
"""

from __future__ import annotations

import torch
from torch import nn

from swiglu_train.kernels.runtime import SUPPORTED_DTYPES
from swiglu_train.layers.registry import get_impl


class ParMLP(nn.Module):
    """y = fc2(silu(x W_gateᵀ) * (x W_upᵀ)), with the autograd behaviour of ``impl``.

    ``inplace=False`` lets a ``drop_h`` graph be backpropagated more than once, at the cost of
    two activation-sized buffers in backward.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        output_size: int | None = None,
        bias: bool = False,
        impl: str = "drop_h",
        inplace: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if min(hidden_size, ffn_hidden_size, output_size or hidden_size) < 1:
            raise ValueError("ParMLP sizes must be positive")
        factory = {"device": device, "dtype": dtype}
        self.fc1 = nn.Linear(hidden_size, 2 * ffn_hidden_size, bias=bias, **factory)
        self.fc2 = nn.Linear(ffn_hidden_size, output_size or hidden_size, bias=bias, **factory)
        self.impl = impl
        self.inplace = inplace

    @property
    def impl(self) -> str:
        return self._impl

    @impl.setter
    def impl(self, name: str) -> None:
        self._mlp_function = get_impl(name)
        self._impl = name

    @property
    def hidden_size(self) -> int:
        return self.fc1.in_features

    @property
    def ffn_hidden_size(self) -> int:
        return self.fc2.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        tensors = (x, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias)
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            tensors = tuple(None if t is None else t.to(dtype) for t in tensors)
            with torch.autocast(device_type, enabled=False):
                return self._apply_impl(*tensors)
        if x.dtype != self.fc1.weight.dtype:
            raise TypeError(
                f"ParMLP input is {x.dtype} but its parameters are {self.fc1.weight.dtype}; "
                "cast one of them, or run under torch.autocast"
            )
        return self._apply_impl(*tensors)

    def _apply_impl(self, x: torch.Tensor, *params: torch.Tensor | None) -> torch.Tensor:
        y = self._mlp_function(x.reshape(-1, x.shape[-1]), *params, inplace=self.inplace)
        return y.view(*x.shape[:-1], y.shape[-1])

    def _check_input(self, x: torch.Tensor) -> None:
        if not x.is_floating_point():
            raise TypeError(f"ParMLP expects a floating-point input, got {x.dtype}")
        if x.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"ParMLP supports {SUPPORTED_DTYPES}, got {x.dtype}")
        if x.dim() == 0 or x.shape[-1] != self.hidden_size:
            raise ValueError(
                f"ParMLP(hidden_size={self.hidden_size}) got an input of shape {tuple(x.shape)}; "
                f"its last dim must be {self.hidden_size}"
            )
        if x.device != self.fc1.weight.device:
            raise ValueError(
                f"ParMLP input is on {x.device} but its parameters are on {self.fc1.weight.device}"
            )

    def extra_repr(self) -> str:
        return f"impl={self.impl!r}, inplace={self.inplace}"
