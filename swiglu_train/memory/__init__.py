"""Memory accounting: bytes saved for backward (exact, any device) and CUDA allocator figures,
per step and along layer depth, with CSV and Weights & Biases sinks."""

from swiglu_train.memory.csv_log import MemoryCsv
from swiglu_train.memory.profiler import (
    LayerMemory,
    MemoryProfiler,
    StepMemory,
    find_layers,
    model_config,
)
from swiglu_train.memory.saved import SavedTensorCounter, storage_key, storages

__all__ = [
    "LayerMemory",
    "MemoryCsv",
    "MemoryProfiler",
    "SavedTensorCounter",
    "StepMemory",
    "find_layers",
    "model_config",
    "storage_key",
    "storages",
]
