"""Every variant ``bench-moe`` can race, by name: our ``ParExperts`` impls and the peers.

A variant is built per point (shape and routing) over that point's shared weights. Ours are
named as the dense benchmarks name them (``drop_h+fp8`` is drop_h with ``saved_fp8=True``,
``drop_h+gathered_wgrad`` with ``gathered_wgrad=True``);
an impl the module does not offer fails at construction and is recorded as such.

A run puts the router weight on the expert output (Mixtral, Qwen, DeepSeek) or on its input
(Llama-4); each side has its own variants (``SIDES``), and a variant named for a run whose
side it does not compute is recorded as not offered.
"""

from __future__ import annotations

from swiglu_train.bench.moe.peers import hf_grouped_mm, hf_llama4, liger, loop, torchtitan
from swiglu_train.bench.moe.sonic import sonicmoe
from swiglu_train.bench.moe.weights import Builder, ExpertWeights, NotOffered, Variant, shared
from swiglu_train.layers.experts import ParExperts

REFERENCE = "loop"


def ours(
    impl: str, saved_fp8: bool = False, gathered_wgrad: bool = False, weights_on: str = "output"
) -> Builder:
    def build(w: ExpertWeights, top_k: int) -> Variant:
        e, d = w.fc1.shape[0], w.fc1.shape[2]
        module = ParExperts(
            e, d, w.ffn, impl=impl, saved_fp8=saved_fp8, gathered_wgrad=gathered_wgrad,
            router_weights_on=weights_on, device="meta",
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
PEERS: dict[str, Builder] = {
    "loop": loop("output"),
    "torchtitan": torchtitan(compiled=False),
    "torchtitan_compile": torchtitan(compiled=True),
    "hf_grouped_mm": hf_grouped_mm,
    "liger": liger,
    "sonicmoe": sonicmoe,
}
# Each side's variants: ours take the router weight on either side; of the peers, the loop,
# and on the input side transformers' Llama-4 experts, the only peer that computes it.
SIDES: dict[str, dict[str, Builder]] = {
    "output": {**{n: ours(**o) for n, o in OUR_OPTIONS.items()}, **PEERS},
    "input": {
        **{n: ours(**o, weights_on="input") for n, o in OUR_OPTIONS.items()},
        "loop": loop("input"),
        "hf_llama4": hf_llama4,
    },
}
VARIANTS: tuple[str, ...] = tuple(dict.fromkeys([*SIDES["output"], *SIDES["input"]]))


def builder(name: str, weights_on: str) -> Builder:
    """The variant ``name`` with the router weight on ``weights_on``; NotOffered where it
    computes only the other side."""
    side = SIDES[weights_on]
    if name not in side:
        other = "input" if weights_on == "output" else "output"
        raise NotOffered(
            f"{name} applies the router weight to the expert {other}; this run puts it on the "
            f"{weights_on} (--router-weights-on)"
        )
    return side[name]
