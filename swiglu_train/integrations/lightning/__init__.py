"""PyTorch Lightning integration (``pip install swiglu-train[lightning]``)."""

from swiglu_train.integrations.lightning.memory_callback import MemoryProfilerCallback
from swiglu_train.integrations.lightning.model import LlamaDecoder, ModelConfig
from swiglu_train.integrations.lightning.module import PretrainModule

__all__ = ["LlamaDecoder", "MemoryProfilerCallback", "ModelConfig", "PretrainModule"]
