"""The pretrain decoder's MoE blocks on CPU (tiny_moe's shape): the router and its
load-balancing loss, every impl computing one function, autocast, the memory profiler's
per-layer bytes against the analytic figures, and the planner's checkpointed MoE blocks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from swiglu_train.bench.e2e.lightning import flops_per_token
from swiglu_train.integrations.lightning.config import load_config
from swiglu_train.integrations.lightning.model import LlamaDecoder, ModelConfig
from swiglu_train.integrations.lightning.moe import MoE, load_balancing_loss
from swiglu_train.integrations.lightning.planner import Steps, candidates, measurer, plan_run
from swiglu_train.layers.experts import ParExperts
from swiglu_train.memory import MemoryProfiler
from swiglu_train.ops import use_backend
from swiglu_train.ops.experts import saved_activation_bytes

BATCH, SEQ = 2, 16


@pytest.fixture(autouse=True)
def _torch_math():
    with use_backend("torch"):  # the interpreter would crawl; the kernels have their own tests
        yield


def tiny_moe(**changes) -> ModelConfig:
    return dataclasses.replace(load_config("tiny_moe").model, **changes)


TOKENS = torch.randint(0, 320, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))


def test_the_load_balancing_loss_is_k_when_balanced_and_grows_as_tokens_crowd():
    e, k = 4, 2
    uniform = torch.full((8, e), 1 / e, requires_grad=True)
    balanced = torch.tensor([[0, 1], [2, 3]] * 4)
    assert load_balancing_loss(uniform, balanced).item() == pytest.approx(k)
    crowded = torch.zeros(8, e)
    crowded[:, :2] = 0.5
    crowded.requires_grad_(True)
    loss = load_balancing_loss(crowded, torch.tensor([[0, 1]] * 8))
    assert loss.item() == pytest.approx(e * (1 * 0.5 + 1 * 0.5))  # f = 1 on two experts
    loss.backward()  # through P alone: each token's share of E · f_e / T
    torch.testing.assert_close(crowded.grad, torch.tensor([[0.5, 0.5, 0.0, 0.0]] * 8))


def test_the_router_renormalises_the_top_k_or_not():
    torch.manual_seed(0)
    x = torch.randn(5, 8)
    for renormalize in (True, False):
        torch.manual_seed(1)
        moe = MoE(8, 16, 4, 2, renormalize, "drop_h", saved_fp8=False)
        seen: list[torch.Tensor] = []
        moe.experts.register_forward_pre_hook(lambda m, args, seen=seen: seen.append(args[2]))
        moe(x)
        probs = moe.router(x).softmax(-1)
        top = probs.topk(2, dim=-1).values
        want = top / top.sum(-1, keepdim=True) if renormalize else top
        torch.testing.assert_close(seen[0], want)


def grads_of(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Logits and every parameter's gradient of a seeded decoder, through the objective the
    module trains (cross-entropy-like sum plus the load-balancing loss)."""
    torch.manual_seed(0)
    model = LlamaDecoder(cfg)
    logits, aux = model(TOKENS, with_aux_loss=True)
    (logits.float().square().mean() + 0.1 * aux).backward()
    return {"logits": logits.detach(), "aux": aux.detach(),
            **{n: p.grad for n, p in model.named_parameters()}}  # fmt: skip


def test_every_impl_computes_one_function_and_dense_impls_map_to_drop_h():
    drop_h = grads_of(tiny_moe(mlp_impl="drop_h"))
    assert drop_h["layers.0.mlp.router.weight"].abs().sum() > 0  # the router trains
    for impl in ("normal", "save_factors"):
        other = grads_of(tiny_moe(mlp_impl=impl))
        for name, value in drop_h.items():
            torch.testing.assert_close(other[name], value, rtol=1e-5, atol=1e-6, msg=name)
    experts = LlamaDecoder(tiny_moe(mlp_impl="save_factors")).layers[0].mlp
    assert experts.experts.impl == "drop_h" and "save_factors" in experts.impl_note


def test_under_autocast_the_experts_run_in_its_dtype_on_one_copy_of_x():
    model = LlamaDecoder(tiny_moe())
    saved: list[torch.Tensor] = []
    experts = model.layers[0].mlp.experts
    experts.register_forward_pre_hook(lambda m, args: saved.append(args[0]))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, aux = model(TOKENS, with_aux_loss=True)
    assert saved[0].dtype == torch.bfloat16 and aux.dtype == torch.float32
    (logits.float().mean() + aux).backward()
    assert experts.fc1_weight.grad.dtype == torch.float32  # the fp32 weights' own gradient


def profile(cfg: ModelConfig, grads: dict | None = None):
    """The profiler's record of one step; ``grads`` gets every parameter's gradient."""
    torch.manual_seed(0)
    model = LlamaDecoder(cfg)
    profiler = MemoryProfiler(model)
    with profiler.step(0) as p:
        logits, aux = model(TOKENS, with_aux_loss=True)
        loss = logits.float().mean() + aux
        p.forward_done()
        loss.backward()
    if grads is not None:
        grads.update({n: q.grad for n, q in model.named_parameters()})
    return profiler.records[0]


@pytest.mark.parametrize("saved_fp8", [False, True])
def test_each_layer_s_experts_bytes_are_x_the_routing_and_the_impl_s_claim(saved_fp8):
    cfg = tiny_moe(saved_fp8=saved_fp8)
    record = profile(cfg)
    tokens, d, f, k = BATCH * SEQ, cfg.hidden_size, cfg.ffn_hidden_size, cfg.moe_top_k
    claim = saved_activation_bytes(
        "drop_h", saved_fp8, "output", tokens, d, f, k, cfg.num_experts, torch.float32
    )
    experts = tokens * d * 4 + tokens * k * (8 + 4) + claim  # x, top-k indices, weights
    assert [layer.mlp_saved_bytes for layer in record.layers] == [experts] * cfg.num_layers
    label = "experts/drop_h+fp8" if saved_fp8 else "experts/drop_h"
    assert record.impl_saved_bytes == {label: experts * cfg.num_layers}
    assert record.layers[-1].cumulative_saved_bytes <= record.saved_bytes


def test_the_depth_curve_counts_the_experts_bytes_in_each_block():
    """Each block's saved bytes differ between drop_h and drop_h+fp8 by exactly the experts'
    claims: the rest of the block (attention, norms, router) saves the same."""
    bf16, fp8 = profile(tiny_moe()), profile(tiny_moe(saved_fp8=True))
    cfg = tiny_moe()
    args = ("output", BATCH * SEQ, cfg.hidden_size, cfg.ffn_hidden_size, cfg.moe_top_k,
            cfg.num_experts, torch.float32)  # fmt: skip
    gap = saved_activation_bytes("drop_h", False, *args) - saved_activation_bytes(
        "drop_h", True, *args
    )
    pairs = zip(bf16.layers, fp8.layers, strict=True)
    assert [a.saved_bytes - b.saved_bytes for a, b in pairs] == [gap] * cfg.num_layers


def test_a_checkpointed_moe_block_keeps_no_expert_activation_and_the_same_grads():
    grads, recomputed = {}, {}
    every = profile(tiny_moe(), grads)
    first = profile(tiny_moe(checkpoint_layers=1), recomputed)
    assert not first.layers[0].mlp_saved_bytes  # its input alone, outside the experts
    assert first.layers[0].saved_bytes < every.layers[0].mlp_saved_bytes
    assert first.layers[1].saved_bytes == every.layers[1].saved_bytes
    for name, grad in grads.items():  # the router's through the load-balancing loss too
        assert torch.equal(recomputed[name], grad), name


def test_the_planner_plans_tiny_moe_on_the_experts_impls():
    cfg = load_config("tiny_moe")
    cfg.data.seq_length, cfg.data.micro_batch_size = SEQ, BATCH
    assert candidates(cfg) == ["normal", "drop_h"]  # save_factors would be drop_h again
    measure = measurer(cfg, Steps(warmup=0, measured=1))
    none, every = measure("drop_h", 0), measure("drop_h", cfg.model.num_layers)
    assert every.peak_MiB < none.peak_MiB
    cfg.train.activation_checkpointing, cfg.train.plan_impls = "auto", ["drop_h"]
    cfg.train.memory_budget_gb = (none.peak_MiB + every.peak_MiB) / 2 / 1024
    record = plan_run(cfg, Steps(warmup=0, measured=1))
    assert record["impl"] == cfg.model.mlp_impl == "drop_h"
    assert record["checkpoint_layers"] == cfg.model.checkpoint_layers >= 1


def test_moe_settings_a_router_cannot_take_are_refused_in_the_config_s_words():
    with pytest.raises(ValueError, match="moe_top_k must be from 1 to num_experts=4"):
        tiny_moe(moe_top_k=5)
    with pytest.raises(ValueError, match="num_experts must be 0"):
        ModelConfig(num_experts=-1)
    with pytest.raises(ValueError, match="keeps canonical"):
        tiny_moe(mlp_impl="save_factors", mlp_chunk=16)
    with pytest.raises(ValueError, match="unknown MLP impl 'bogus'"):
        tiny_moe(mlp_impl="bogus")
    assert not any(isinstance(m, ParExperts) for m in LlamaDecoder(ModelConfig()).modules())
    assert isinstance(LlamaDecoder(tiny_moe()).layers[1].mlp.router, nn.Linear)


def test_the_e2e_bench_s_model_flops_count_the_router_and_the_top_k_experts():
    cfg = load_config("moe_1b").model
    d, layers, seq = cfg.hidden_size, cfg.num_layers, 4096
    active = layers * (4 * d * d + 8 * 3 * d * 1024 + d * 32) + d * cfg.vocab_size
    assert flops_per_token(cfg, seq) == 6 * active + 12 * layers * d * seq
    assert active == pytest.approx(1.076e9, rel=1e-3)  # the config's "1.08B active"
