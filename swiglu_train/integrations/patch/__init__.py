"""Put ParMLP into the models users already train: ``swiglu_train.patch(model, impl)``.

Hugging Face transformers (LlamaMLP and its ~90 copies, Phi3MLP), LitGPT (LLaMAMLP) and
torchtitan (FeedForward) MLPs are recognized by structure, activation and forward code, and
replaced by a PatchedSwiGLU whose checkpoints keep the host library's keys. No host library is
imported here.
"""

from swiglu_train.integrations.patch.module import PatchedSwiGLU
from swiglu_train.integrations.patch.report import Left, PatchReport, Replaced
from swiglu_train.integrations.patch.walker import patch

__all__ = ["Left", "PatchReport", "PatchedSwiGLU", "Replaced", "patch"]
