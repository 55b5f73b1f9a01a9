"""swiglu-train: SwiGLU MLP layers that give pretraining their activation memory back."""

from swiglu_train.layers import MLP_IMPLS, PORTABLE_IMPLS, ParExperts, ParMLP

__all__ = ["MLP_IMPLS", "PORTABLE_IMPLS", "ParExperts", "ParMLP", "PatchReport", "patch"]
__version__ = "0.1.0"

_LAZY = {"patch", "PatchReport"}  # integrations sit above layers: imported on first use


def __getattr__(name: str):
    if name in _LAZY:
        from swiglu_train.integrations import patch as patching

        return getattr(patching, name)
    raise AttributeError(f"module 'swiglu_train' has no attribute {name!r}")
