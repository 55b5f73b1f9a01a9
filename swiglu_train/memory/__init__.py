"""Memory accounting: bytes saved for backward, device-independent and exact."""

from swiglu_train.memory.saved import SavedTensorCounter

__all__ = ["SavedTensorCounter"]
