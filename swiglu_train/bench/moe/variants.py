"""Every variant ``bench-moe`` can race, by name: our ``ParExperts`` impls and the peers.

A variant is built per point (shape and routing) over that point's shared weights. Ours are
named as the dense benchmarks name them (``drop_h+fp8`` is drop_h with ``saved_fp8=True``,
``drop_h+gathered_wgrad`` with ``gathered_wgrad=True``);
an impl the module does not offer fails at construction and is recorded as such.
"""

from __future__ import annotations

from swiglu_train.bench.moe.peers import hf_grouped_mm, liger, loop, torchtitan
from swiglu_train.bench.moe.sonic import sonicmoe
from swiglu_train.bench.moe.weights import Builder, ExpertWeights, Variant, shared
from swiglu_train.layers.experts import ParExperts

REFERENCE = "loop"


def ours(impl: str, saved_fp8: bool = False, gathered_wgrad: bool = False) -> Builder:
    def build(w: ExpertWeights, top_k: int) -> Variant:
        e, d = w.fc1.shape[0], w.fc1.shape[2]
        module = ParExperts(
            e, d, w.ffn, impl=impl, saved_fp8=saved_fp8, gathered_wgrad=gathered_wgrad,
            device="meta",
        )  # fmt: skip
        module.fc1_weight, module.fc2_weight = w.fc1, w.fc2
        return shared(module, w)

    return build


# Each of ours by name: the ParExperts options it runs with (the peak model reads them too)
OUR_OPTIONS: dict[str, dict] = {
    "normal": {"impl": "normal"},
    "drop_h": {"impl": "drop_h"},
    "drop_h_quack": {"impl": "drop_h_quack"},
    "drop_h+fp8": {"impl": "drop_h", "saved_fp8": True},
    "drop_h+gathered_wgrad": {"impl": "drop_h", "gathered_wgrad": True},
    "drop_h_quack+fp8": {"impl": "drop_h_quack", "saved_fp8": True},
}
OURS: dict[str, Builder] = {name: ours(**options) for name, options in OUR_OPTIONS.items()}
PEERS: dict[str, Builder] = {
    "loop": loop,
    "torchtitan": torchtitan(compiled=False),
    "torchtitan_compile": torchtitan(compiled=True),
    "hf_grouped_mm": hf_grouped_mm,
    "liger": liger,
    "sonicmoe": sonicmoe,
}
BUILDERS: dict[str, Builder] = {**OURS, **PEERS}
