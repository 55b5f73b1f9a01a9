"""Count the bytes autograd keeps for backward, exactly and on any device.

Allocator statistics only exist on CUDA and include transient buffers; the set of tensors
packed through ``saved_tensors_hooks`` is what a graph holds between forward and backward.
Storages are counted once, however many views of them are saved.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator

import torch

try:  # private; the check it makes is public protocol, so a torch without it loses nothing
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass
except ImportError:  # pragma: no cover

    def is_traceable_wrapper_subclass(t: object) -> bool:
        return type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__")


_COMPRESSED = {
    torch.sparse_csr: ("crow_indices", "col_indices"),
    torch.sparse_bsr: ("crow_indices", "col_indices"),
    torch.sparse_csc: ("ccol_indices", "row_indices"),
    torch.sparse_bsc: ("ccol_indices", "row_indices"),
}


class SavedTensorCounter(torch.autograd.graph.saved_tensors_hooks):
    """Context manager that records every distinct storage saved for backward inside it.

    Storages of ``exclude`` (typically the model's parameters, which live anyway) are skipped.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {key for t in exclude for key, _ in storages(t)}
        self._storages: dict[tuple, int] = {}
        super().__init__(self._pack, lambda t: t)

    def __enter__(self) -> SavedTensorCounter:
        super().__enter__()
        return self

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        for key, nbytes in storages(t):
            if key not in self._excluded:
                self._storages[key] = nbytes
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


def distinct_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages behind ``tensors``, each counted once (views share one)."""
    return sum({key: nbytes for t in tensors for key, nbytes in storages(t)}.values())


def storages(t: torch.Tensor) -> Iterator[tuple[tuple, int]]:
    """(key, nbytes) of each storage behind ``t``.

    Sparse tensors and wrapper subclasses (DTensor, for tensor parallelism and FSDP2) have no
    storage of their own: their memory is that of the tensors they are made of, which are
    walked instead, so a model using them is measured rather than crashed. A tensor with
    neither (mkldnn, which ``relu`` saves on CPU; other opaque layouts) is counted as
    ``numel * element_size`` under its own identity, a lower bound (mkldnn may pad); if even
    that is undefined it is skipped with a warning naming its type and layout. The pack hook
    runs inside the user's forward: profiling must never break training.
    """
    if t.layout == torch.sparse_coo:
        parts = [t._indices(), t._values()]
    elif t.layout in _COMPRESSED:
        parts = [getattr(t, name)() for name in _COMPRESSED[t.layout]] + [t.values()]
    elif is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()  # may name opaque members too (DTensor's mesh)
        parts = [v for name in names if isinstance(v := getattr(t, name), torch.Tensor)]
    else:
        try:
            storage = t.untyped_storage()
            key = (t.device, storage.data_ptr())
        except Exception:  # any layout or subclass may refuse; see _opaque
            yield from _opaque(t)
            return
        yield key, storage.nbytes()
        return
    for part in parts:
        yield from storages(part)


def _opaque(t: torch.Tensor) -> Iterator[tuple[tuple, int]]:
    """A storage-less tensor keyed by its TensorImpl (the graph holds it, so the address is
    not reused while counted; such layouts have no views to share it), sized from its shape."""
    try:
        nbytes = t.numel() * t.element_size()
        key = (t.device, "impl", t._cdata)
    except Exception as e:  # a saved tensor must not break the forward
        # One warning per type and layout: Python's default filter shows a message once.
        warnings.warn(
            f"memory profiler: cannot size a saved {type(t).__name__} (layout {t.layout}); "
            f"its bytes are left out of the saved-for-backward figures ({type(e).__name__})",
            RuntimeWarning,
            stacklevel=2,
        )
        return
    yield key, nbytes
