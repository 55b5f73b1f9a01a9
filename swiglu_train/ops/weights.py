"""Weights the impls can take: plain tensors, not a training conversion's tensor subclass.

A conversion that wraps a weight in a tensor subclass changes what torch's ops do with it:
torchao's MoE FP8 training (``quantize_`` with ``Float8TrainingOpConfig``) reroutes
``torch._grouped_mm`` and ``mm`` on its ``Float8TrainingWeightWrapperTensor`` to FP8 GEMMs, and
torchao's quantized weights reroute everything at dispatch. Our impls run their own kernels and
GEMMs on the weight: some would pass through the override and some would not, so a step would
run partly in FP8 (or fail inside a kernel) with nothing said. They refuse such a weight in one
line instead. Subclasses that only carry a plain tensor through torch's own machinery pass:
DTensor (tensor parallelism, FSDP2's shards), and the fake and functional tensors of
``torch.compile`` and ``torch.export``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

_PLAIN = (nn.Parameter, torch.Tensor)
if torch.distributed.is_available():
    from torch.distributed.tensor import DTensor

    _CARRIERS: tuple[type, ...] = (DTensor, FakeTensor, FunctionalTensor)
else:  # a torch built without distributed has no DTensor
    _CARRIERS = (FakeTensor, FunctionalTensor)


def check_plain_weights(owner: str, named: Iterable[tuple[str, torch.Tensor | None]]) -> None:
    """A one-line TypeError naming the first weight of ``owner`` whose class a conversion gave
    it (module docstring); None entries (absent biases) are skipped."""
    for name, weight in named:
        if weight is None or type(weight) in _PLAIN or isinstance(weight, _CARRIERS):
            continue
        kind = f"{type(weight).__module__}.{type(weight).__qualname__}"
        raise TypeError(
            f"{owner}.{name} is a {kind}, a tensor subclass that reroutes torch's ops on it (an "
            "FP8 or quantized training conversion, such as torchao's MoE training quantize_); "
            "the impls run their own kernels and GEMMs on the weight and would skip some of "
            "those overrides, training partly in bf16 unannounced. Leave this module out of the "
            "conversion (quantize_'s filter_fn)"
        )
