"""The peers the MoE benchmark races, each built over the shared expert weights.

Each takes what ``ParExperts`` takes (x [T, D], top-k indices and fp32 router weights [T, k])
and applies the router weight to the expert output, as Mixtral, Qwen and DeepSeek do, but for
the two that apply it to the expert input, as Llama-4 does: the loop (either side) and
transformers' Llama-4 experts. A peer is imported when built: one that does not import is
recorded as skipped, with why.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from swiglu_train.bench.moe.weights import Builder, ExpertWeights, Variant, shared


def loop(weights_on: str) -> Builder:
    """A loop over dense experts in plain torch, the reference every variant is checked
    against: per expert, gather its tokens, two GEMMs, silu(gate)·up, scatter-add in fp32, the
    router weight on the expert's output, or on its input (rounded to x's dtype first, as
    ``ParExperts`` rounds w·x). One host synchronization per step (the group sizes), as the
    eager MoE layers of HF transformers and Megatron's sequential experts have."""

    def build(w: ExpertWeights, top_k: int) -> Variant:
        def run(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
            flat = indices.reshape(-1)
            order = flat.argsort(stable=True)
            sizes = torch.bincount(flat, minlength=w.fc1.shape[0]).tolist()
            y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
            start = 0
            for e, n in enumerate(sizes):
                slots = order[start : start + n]
                start += n
                if not n:
                    continue
                tokens, slot_weights = slots // indices.shape[1], weights.reshape(-1)[slots, None]
                rows = x.index_select(0, tokens)
                if weights_on == "input":
                    rows = rows * slot_weights.to(x.dtype)
                gate, up = F.linear(rows, w.fc1[e]).chunk(2, dim=-1)
                out = F.linear(F.silu(gate) * up, w.fc2[e]).float()
                y.index_add_(0, tokens, out if weights_on == "input" else out * slot_weights)
            return y.to(x.dtype)

        return shared(run, w)

    return build


def torchtitan(compiled: bool) -> Builder:
    """torchtitan's routed experts (``RoutedExperts``: its local token dispatcher around
    ``GroupedExperts``, three ``torch._grouped_mm`` GEMMs on w1/w3/w2), the expert counts taken
    as its ``MoE.forward`` takes them; ``compiled`` as its ``apply_compile`` compiles a block
    (``fullgraph=True``, scalar outputs captured). w1 and w3 are views of the shared fc1."""

    def build(w: ExpertWeights, top_k: int) -> Variant:
        from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
        from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

        e, d, f = w.fc1.shape[0], w.fc1.shape[2], w.ffn
        config = RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=d, hidden_dim=f, num_experts=e),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=e, top_k=top_k),
        )
        with torch.device("meta"):
            module = config.build()
        inner = module.inner_experts
        inner.w1_EFD = torch.nn.Parameter(w.fc1.detach()[:, :f])
        inner.w3_EFD = torch.nn.Parameter(w.fc1.detach()[:, f:])
        inner.w2_EDF = w.fc2

        def run(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
            counts = torch.zeros(x.shape[0], e, dtype=torch.bool, device=x.device)
            counts = counts.scatter_(1, indices, True).sum(dim=0)
            return module(x[None], weights[None], indices[None], counts)[0]

        if compiled:
            torch._dynamo.config.capture_scalar_outputs = True  # as apply_compile sets it
            run = torch.compile(run, fullgraph=True)

        def weight_grads() -> tuple[torch.Tensor | None, torch.Tensor | None]:
            gate, up = inner.w1_EFD.grad, inner.w3_EFD.grad
            fc1 = None if gate is None or up is None else torch.cat([gate, up], dim=1)
            return fc1, w.fc2.grad

        return Variant(run, weight_grads, [inner.w1_EFD, inner.w3_EFD])

    return build


def hf_grouped_mm(w: ExpertWeights, top_k: int) -> Variant:
    """Hugging Face transformers 5's experts with ``experts_implementation="grouped_mm"``
    (``integrations.moe.grouped_mm_experts_forward``), as Qwen3-MoE builds them; its
    gate_up_proj [E, 2F, D] and down_proj [E, D, F] are the shared fc1 and fc2."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    e, d, f = w.fc1.shape[0], w.fc1.shape[2], w.ffn
    config = Qwen3MoeConfig(
        hidden_size=d,
        moe_intermediate_size=f,
        num_experts=e,
        num_experts_per_tok=top_k,
        hidden_act="silu",
        experts_implementation="grouped_mm",
    )
    with torch.device("meta"):
        experts = Qwen3MoeExperts(config)
    experts.gate_up_proj, experts.down_proj = w.fc1, w.fc2
    return shared(experts, w)


def liger(w: ExpertWeights, top_k: int) -> Variant:
    """Liger-Kernel's fused MoE (``LigerFusedMoEFunction``, Triton: gather + fc1 + SwiGLU in
    one kernel; keeps the preactivation and recomputes fc2's input in backward), called as
    its ``LigerExperts`` calls it: int32 indices, weights [E, 2F, D] and [E, D, F]."""
    from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

    def run(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return LigerFusedMoEFunction.apply(x, w.fc1, w.fc2, indices.to(torch.int32), weights)

    return shared(run, w)


def hf_llama4(w: ExpertWeights, top_k: int) -> Variant:
    """Hugging Face transformers 5's ``Llama4TextExperts`` as its ``Llama4TextMoe`` runs them:
    every expert on every token, each token's input scaled by its router score (0 for the
    experts it did not choose, so they add nothing), two ``bmm`` over all E experts, the E
    outputs summed. E/k times the expert work and activations of the routed impls. Its
    gate_up_proj [E, D, 2F] and down_proj [E, F, D] are transposed copies of the shared
    weights, whose gradients are mapped back."""
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextExperts

    e, d, f = w.fc1.shape[0], w.fc1.shape[2], w.ffn
    config = Llama4TextConfig(
        hidden_size=d, intermediate_size=f, num_local_experts=e, hidden_act="silu"
    )
    with torch.device("meta"):
        experts = Llama4TextExperts(config)
    experts.gate_up_proj = torch.nn.Parameter(w.fc1.detach().transpose(1, 2).contiguous())
    experts.down_proj = torch.nn.Parameter(w.fc2.detach().transpose(1, 2).contiguous())

    def run(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        scores = torch.zeros(x.shape[0], e, device=x.device, dtype=weights.dtype)
        scores = scores.scatter(1, indices, weights).to(x.dtype)  # HF's scores: x's dtype
        routed_in = x.repeat(e, 1) * scores.transpose(0, 1).reshape(-1, 1)
        return experts(routed_in).view(e, x.shape[0], d).sum(dim=0)

    def weight_grads() -> tuple[torch.Tensor | None, torch.Tensor | None]:
        up, down = experts.gate_up_proj.grad, experts.down_proj.grad
        return (
            None if up is None else up.transpose(1, 2),
            None if down is None else down.transpose(1, 2),
        )

    return Variant(run, weight_grads, [experts.gate_up_proj, experts.down_proj])
