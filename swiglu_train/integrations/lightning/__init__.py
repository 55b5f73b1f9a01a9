"""PyTorch Lightning integration (``pip install swiglu-train[lightning]``)."""

from swiglu_train.integrations.lightning.memory_callback import MemoryProfilerCallback

__all__ = ["MemoryProfilerCallback"]
