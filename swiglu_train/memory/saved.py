"""Count the bytes autograd keeps for backward, exactly and on any device.

Allocator statistics only exist on CUDA and include transient buffers; the set of tensors
packed through ``saved_tensors_hooks`` is what a graph holds between forward and backward.
Storages are counted once, however many views of them are saved.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class SavedTensorCounter(torch.autograd.graph.saved_tensors_hooks):
    """Context manager that records every distinct storage saved for backward inside it.

    Storages of ``exclude`` (typically the model's parameters, which live anyway) are skipped.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {storage_key(t) for t in exclude}
        self._storages: dict[tuple, int] = {}
        super().__init__(self._pack, lambda t: t)

    def __enter__(self) -> SavedTensorCounter:
        super().__enter__()
        return self

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key not in self._excluded:
            self._storages[key] = t.untyped_storage().nbytes()
        return t

    @property
    def bytes(self) -> int:
        """Total bytes of the distinct storages saved so far."""
        return sum(self._storages.values())

    @property
    def count(self) -> int:
        """How many distinct storages were saved."""
        return len(self._storages)


def storage_key(t: torch.Tensor) -> tuple:
    """Identity of the memory a tensor views: equal for every view of one storage."""
    return (t.device, t.untyped_storage().data_ptr())
