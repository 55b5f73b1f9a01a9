"""ParMLPMegatron against Megatron's stock MLP: fp32 parity at TP=1 and TP=2, state_dict
compatibility, and the configs it refuses. Multi-rank parts run in gloo worker processes."""

from __future__ import annotations

import pytest
import torch
from helpers import rel_err
from megatron_support import megatron_parallel, spawn, swiglu_config

from megatron.core import parallel_state  # isort: skip
from megatron.core.models.gpt import GPTModel  # isort: skip
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # isort: skip
from megatron.core.process_groups_config import ProcessGroupCollection  # isort: skip
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear  # isort: skip
from megatron.core.transformer.mlp import MLP, MLPSubmodules  # isort: skip
from megatron.core.transformer.spec_utils import ModuleSpec, build_module  # isort: skip

from swiglu_train import MLP_IMPLS
from swiglu_train.integrations.megatron import (
    SUPPORTED_IMPLS,
    ParMLPMegatron,
    get_gpt_layer_spec,
    get_mlp_layer_spec,
    mlp_spec,
)

PARITY = 1e-5  # the fp32 target, norm-relative
SEQ, BATCH, VOCAB = 16, 2, 64


def stock_submodules() -> MLPSubmodules:
    return MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)


def mlp_loss_and_grads(module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    x = x.detach().clone().requires_grad_()
    out, bias = module(x)
    loss = ((out if bias is None else out + bias) ** 2).sum()
    loss.backward()
    return {"loss": loss.detach(), "x": x.grad, **grads(module)}


def grads(module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters()}


def assert_parity(ours: dict, stock: dict, label: str) -> None:
    assert ours.keys() == stock.keys(), label
    for name, expected in stock.items():
        err = rel_err(ours[name], expected)
        assert err <= PARITY, f"{label}: {name} differs from stock Megatron by {err:.2e}"


def build_gpt(config, spec, seed: int) -> GPTModel:
    torch.manual_seed(seed)  # CPU init draws the full master weight, then keeps this rank's rows
    return GPTModel(
        config, spec, vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope"
    )


def gpt_loss(model: GPTModel, tokens: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    # An explicit causal mask: Megatron's default one is allocated on "cuda".
    mask = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool).triu(1)[None, None]
    return model(tokens, positions, mask, labels=tokens.roll(-1, 1)).float().mean()


def _parity_worker(rank: int, world_size: int, port: int) -> None:
    with megatron_parallel(rank, world_size, port, tp=world_size):
        tp_rank = torch.distributed.get_rank()
        sequence_parallel = [False, True] if world_size > 1 else [False]
        for impl in SUPPORTED_IMPLS:
            for bias in (False, True):
                for sp in sequence_parallel:
                    label = f"impl={impl} bias={bias} sp={sp} tp={world_size}"
                    config = swiglu_config(add_bias_linear=bias, sequence_parallel=sp)
                    torch.manual_seed(0)
                    stock = MLP(config, stock_submodules(), ffn_hidden_size=config.ffn_hidden_size)
                    # Ours replaces Megatron's activation path whether it is fused or not.
                    fused = swiglu_config(
                        add_bias_linear=bias, sequence_parallel=sp, bias_activation_fusion=bias
                    )
                    torch.manual_seed(1)
                    if bias:  # the spec megatron-core 0.16-0.18 builds from
                        ours = build_module(mlp_spec(impl), config=fused)
                    else:  # the builder call of megatron-core >= 0.19's TransformerLayer
                        ours = ParMLPMegatron.as_mlp_submodule(
                            submodules=stock_submodules(),
                            config=fused,
                            pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
                            is_mtp_layer=False,
                            name="decoder.layers.0.mlp",
                            layer_number=1,
                            impl=impl,
                        )
                    assert ours.impl == impl
                    assert ours.tp_group is parallel_state.get_tensor_model_parallel_group()
                    ours.load_state_dict(stock.state_dict())
                    torch.manual_seed(2)
                    x = torch.randn(SEQ, BATCH, config.hidden_size)
                    if sp:  # each rank holds its slice of the sequence
                        x = x.chunk(world_size)[tp_rank].contiguous()
                    stock_out = mlp_loss_and_grads(stock, x)
                    assert_parity(mlp_loss_and_grads(ours, x), stock_out, label)

        # HybridModel's MLPLayer: norm + MLP + residual, stock MLP vs ours in the same spec.
        config = swiglu_config()
        stock_spec = get_mlp_layer_spec("normal")
        stock_spec.submodules.mlp = ModuleSpec(module=MLP, submodules=stock_submodules())
        torch.manual_seed(0)
        stock = build_module(stock_spec, config=config)
        torch.manual_seed(4)
        x = torch.randn(SEQ, BATCH, config.hidden_size)
        expected, _ = stock(x)
        for impl in SUPPORTED_IMPLS:
            ours = build_module(get_mlp_layer_spec(impl), config=config)
            assert isinstance(ours.mlp, ParMLPMegatron) and ours.mlp.impl == impl
            ours.load_state_dict(stock.state_dict())
            out, _ = ours(x)
            assert rel_err(out, expected) <= PARITY, f"MLPLayer impl={impl}"

        # A whole GPTModel, with a stock state_dict loaded into our spec, and the MLP recomputed.
        config = swiglu_config(recompute_granularity="selective", recompute_modules=["mlp"])
        stock = build_gpt(config, get_gpt_layer_local_spec(normalization="RMSNorm"), seed=0)
        torch.manual_seed(3)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
        stock_loss = gpt_loss(stock, tokens)
        stock_loss.backward()
        for impl in SUPPORTED_IMPLS:
            ours = build_gpt(config, get_gpt_layer_spec(impl), seed=1)
            assert isinstance(ours.decoder.layers[0].mlp, ParMLPMegatron)
            with torch.no_grad():
                fresh = gpt_loss(ours, tokens)
            assert rel_err(fresh, stock_loss) > PARITY, "seeds must differ for the load to count"
            ours.load_state_dict(stock.state_dict())  # strict: every key matches
            loss = gpt_loss(ours, tokens)
            loss.backward()
            assert_parity(
                {"loss": loss.detach(), **grads(ours)},
                {"loss": stock_loss.detach(), **grads(stock)},
                f"GPTModel impl={impl} tp={world_size} recompute=mlp",
            )


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_parity_with_stock_megatron(tp: int) -> None:
    """Loss and every grad match the stock MLP (and a stock GPTModel) to 1e-5 in fp32."""
    spawn(_parity_worker, tp)


def test_unknown_impl_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match="valid impls: normal, drop_h"):
        mlp_spec("fused")
    with pytest.raises(ValueError, match="valid impls: normal, drop_h"):
        ParMLPMegatron(swiglu_config(), stock_submodules(), impl="fused")


@pytest.mark.parametrize("impl", sorted({*MLP_IMPLS, "auto"} - set(SUPPORTED_IMPLS)))
def test_packed_impls_are_refused_by_name(impl: str) -> None:
    with pytest.raises(ValueError, match=f"impl '{impl}' is not supported by the Megatron"):
        mlp_spec(impl)


def test_te_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="backend='te' is not supported yet"):
        get_gpt_layer_spec("drop_h", backend="te")
    with pytest.raises(ValueError, match="valid backends: local"):
        mlp_spec("drop_h", backend="apex")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"gated_linear_unit": False}, "computes SwiGLU only"),
        ({"activation_func": torch.nn.functional.gelu}, "computes SwiGLU only"),
        ({"fp8": "e4m3"}, "FP8/FP4 runs on Transformer Engine"),
        ({"gradient_accumulation_fusion": True}, "gradient_accumulation_fusion is not supported"),
        ({"activation_func_clamp_value": 7.0}, "clamped SwiGLU"),
    ],
)
def test_unsupported_configs_are_refused(change: dict, message: str) -> None:
    config = swiglu_config()
    for key, value in change.items():  # set after construction: TE-only values fail validation
        setattr(config, key, value)
    with pytest.raises(ValueError, match=message):
        ParMLPMegatron(config, stock_submodules())


def test_experts_are_refused() -> None:
    with pytest.raises(ValueError, match="dense MLPs only"):
        ParMLPMegatron(swiglu_config(), stock_submodules(), is_expert=True, ffn_hidden_size=48)


def test_transformer_engine_linears_are_refused() -> None:
    te = pytest.importorskip(
        "megatron.core.extensions.transformer_engine",
        reason="transformer-engine is not installed (cannot be on our machines); the TE path "
        "of ParMLPMegatron, which must refuse TE linears, was not run",
    )
    if not getattr(te, "HAVE_TE", False):
        pytest.skip("transformer-engine is not installed; the TE refusal was not run")
    submodules = MLPSubmodules(
        linear_fc1=te.TELayerNormColumnParallelLinear, linear_fc2=te.TERowParallelLinear
    )
    with pytest.raises(ValueError, match="Transformer Engine linears are not supported"):
        ParMLPMegatron(swiglu_config(), submodules)
