"""The routed experts of public MoE models, by shape, for the MoE benchmark.

Each model's (D, F, E, k) is copied from the config.json of the Hugging Face repo named beside
it: hidden_size; the expert FFN size (moe_intermediate_size where the config has one, else
intermediate_size); the routed experts (num_experts, num_local_experts or n_routed_experts);
and num_experts_per_tok. Shared experts are dense MLPs (the dense benchmarks' business) and are
left out. A whole layer's experts sit on one GPU, as without expert parallelism.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class MoEShape:
    name: str  # what --models takes
    repo: str  # the Hugging Face repo whose config.json the sizes come from ("" for --shapes)
    d: int  # hidden size
    f: int  # expert FFN size
    e: int  # routed experts
    k: int  # experts per token
    note: str = ""

    @property
    def label(self) -> str:
        return f"{self.name} (D={self.d} F={self.f} E={self.e} k={self.k})"


MODELS: tuple[MoEShape, ...] = (
    MoEShape("mixtral-8x7b", "mistralai/Mixtral-8x7B-v0.1", 4096, 14336, 8, 2),
    MoEShape("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", 2048, 768, 128, 8),
    MoEShape("olmoe-1b-7b", "allenai/OLMoE-1B-7B-0924", 2048, 1024, 64, 8),
    MoEShape("deepseek-v2-lite", "deepseek-ai/DeepSeek-V2-Lite", 2048, 1408, 64, 6),
    MoEShape("qwen1.5-moe-a2.7b", "Qwen/Qwen1.5-MoE-A2.7B", 2048, 1408, 60, 4),
    # 22.5 GB of bf16 expert weights and as much again for their grads
    MoEShape("deepseek-v3", "deepseek-ai/DeepSeek-V3", 7168, 2048, 256, 8),
    MoEShape(
        "llama4-scout",
        "meta-llama/Llama-4-Scout-17B-16E",
        5120,
        8192,
        16,
        1,
        "Llama 4 scales the expert's input by the router weight: --router-weights-on input",
    ),
    MoEShape(
        "gpt-oss-20b",
        "openai/gpt-oss-20b",
        2880,
        2880,
        32,
        4,
        "shape only: gpt-oss clamps its SwiGLU (limit 7, alpha 1.702) and has expert biases",
    ),
)
DEFAULT_MODELS = tuple(m.name for m in MODELS)


def select_models(names: Sequence[str]) -> tuple[MoEShape, ...]:
    """The listed models named, in the order named; an unknown name is refused in one line."""
    known = {m.name: m for m in MODELS}
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        what = f"unknown models {unknown}" if unknown else "no models given"
        raise ValueError(f"--models: {what}; choose from {', '.join(known)}")
    return tuple(known[n] for n in dict.fromkeys(names))


def parse_shapes(value: str) -> tuple[MoEShape, ...]:
    """Custom shapes, ``D,F,E,K`` separated by ``;`` (a listed model's shape keeps its name)."""
    shapes = []
    for part in (p for p in value.split(";") if p.strip()):
        try:
            d, f, e, k = (int(v) for v in part.split(","))
        except ValueError:
            raise ValueError(f"--shapes: expected D,F,E,K (integers); got {part!r}") from None
        if min(d, f, e, k) < 1 or k > e:
            raise ValueError(f"--shapes: need positive sizes and k <= E; got {part!r}")
        listed = [m for m in MODELS if (m.d, m.f, m.e, m.k) == (d, f, e, k)]
        shapes.append(listed[0] if listed else MoEShape(f"{d}x{f}-e{e}k{k}", "", d, f, e, k))
    if not shapes:
        raise ValueError("--shapes: no shapes given")
    return tuple(dict.fromkeys(shapes))  # a shape given twice is one point
