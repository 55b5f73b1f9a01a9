"""swiglu-train: SwiGLU MLP layers that give pretraining their activation memory back."""

from swiglu_train.layers import MLP_IMPLS, PORTABLE_IMPLS, ParMLP

__all__ = ["MLP_IMPLS", "PORTABLE_IMPLS", "ParMLP"]
__version__ = "0.1.0"
