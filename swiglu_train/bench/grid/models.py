"""The public dense SwiGLU models users pretrain, by MLP shape, for the model-grid benchmark.

Each model's (hidden_size, intermediate_size) is copied from the config.json of the Hugging Face
repo named beside it. Only SwiGLU (silu-gated) MLPs are listed: Gemma's GeGLU is not ours.
Models that share an MLP shape are one grid point naming all of them, so the grid never times
a shape twice and leave-one-family-out can hold out every family a shape belongs to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Model:
    name: str  # what --models takes
    family: str  # the unit left out by the leave-one-family-out evaluation of impl="auto"
    repo: str  # the Hugging Face repo whose config.json the sizes come from
    d: int  # hidden_size
    f: int  # intermediate_size


MODELS: tuple[Model, ...] = (
    Model("qwen2.5-0.5b", "qwen2.5", "Qwen/Qwen2.5-0.5B", 896, 4864),
    Model("qwen2.5-1.5b", "qwen2.5", "Qwen/Qwen2.5-1.5B", 1536, 8960),
    Model("llama3.2-1b", "llama3", "meta-llama/Llama-3.2-1B", 2048, 8192),
    Model("qwen3-4b", "qwen3", "Qwen/Qwen3-4B", 2560, 9728),
    Model("llama3.2-3b", "llama3", "meta-llama/Llama-3.2-3B", 3072, 8192),
    Model("phi3-mini", "phi3", "microsoft/Phi-3-mini-4k-instruct", 3072, 8192),
    Model("qwen2.5-7b", "qwen2.5", "Qwen/Qwen2.5-7B", 3584, 18944),
    Model("llama2-7b", "llama2", "meta-llama/Llama-2-7b-hf", 4096, 11008),
    Model("yi-6b", "yi", "01-ai/Yi-6B", 4096, 11008),
    Model("olmo2-7b", "olmo2", "allenai/OLMo-2-1124-7B", 4096, 11008),
    Model("qwen3-8b", "qwen3", "Qwen/Qwen3-8B", 4096, 12288),
    Model("llama3-8b", "llama3", "meta-llama/Meta-Llama-3-8B", 4096, 14336),  # and Llama 3.1
    Model("mistral-7b", "mistral", "mistralai/Mistral-7B-v0.1", 4096, 14336),
    Model("llama2-13b", "llama2", "meta-llama/Llama-2-13b-hf", 5120, 13824),
    Model("qwen2.5-14b", "qwen2.5", "Qwen/Qwen2.5-14B", 5120, 13824),
    Model("olmo2-13b", "olmo2", "allenai/OLMo-2-1124-13B", 5120, 13824),
    Model("qwen2.5-32b", "qwen2.5", "Qwen/Qwen2.5-32B", 5120, 27648),
    Model("llama2-70b", "llama2", "meta-llama/Llama-2-70b-hf", 8192, 28672),
    Model("llama3-70b", "llama3", "meta-llama/Meta-Llama-3-70B", 8192, 28672),  # and 3.1/3.3
)


@dataclass(frozen=True)
class GridShape:
    """One (D, F) of the grid and every listed model (and family) that has it."""

    d: int
    f: int
    models: tuple[str, ...]
    families: tuple[str, ...]

    @property
    def label(self) -> str:
        return ", ".join(self.models)


def grid_shapes(models: Sequence[Model] = MODELS) -> tuple[GridShape, ...]:
    """The distinct (D, F) of ``models``, smallest D·F first, each naming all its models."""
    by_shape: dict[tuple[int, int], list[Model]] = {}
    for model in models:
        by_shape.setdefault((model.d, model.f), []).append(model)
    return tuple(
        GridShape(d, f, tuple(m.name for m in ms), tuple(dict.fromkeys(m.family for m in ms)))
        for (d, f), ms in sorted(by_shape.items(), key=lambda kv: (kv[0][0] * kv[0][1], kv[0]))
    )


def select_models(names: Sequence[str]) -> tuple[GridShape, ...]:
    """The grid shapes of the models named (each shape once, with all its models and families,
    so a point measured for one name counts for every model that shares it)."""
    known = {m.name: m for m in MODELS}
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        what = f"unknown models {unknown}" if unknown else "no models given"
        raise ValueError(f"--models: {what}; choose from {', '.join(known)}")
    wanted = {(known[n].d, known[n].f) for n in names}
    return tuple(s for s in grid_shapes() if (s.d, s.f) in wanted)


def shapes_for(pairs: Sequence[tuple[int, int]]) -> tuple[GridShape, ...]:
    """Grid shapes for explicit (D, F) pairs: a listed model's shape keeps its models and
    families; any other pair is its own one-shape family named ``DxF``."""
    listed = {(s.d, s.f): s for s in grid_shapes()}
    shapes = []
    for d, f in dict.fromkeys(pairs):
        name = f"{d}x{f}"
        shapes.append(listed.get((d, f), GridShape(d, f, (name,), (name,))))
    return tuple(shapes)
