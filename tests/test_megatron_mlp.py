"""ParMLPMegatron against Megatron's stock MLP: fp32 parity at TP=1 and TP=2 for every impl
(save_factors with its packed fc1 included) and for the TE backend's activation-only MLP,
plain state_dict compatibility, and the configs it refuses. Multi-rank parts run in gloo
worker processes."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import rel_err
from megatron_support import (
    megatron_parallel,
    shim_distributed_optimizer,
    spawn,
    swiglu_config,
)

from megatron.core import parallel_state  # isort: skip
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # isort: skip
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # isort: skip
from megatron.core.models.gpt import GPTModel  # isort: skip
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # isort: skip
from megatron.core.process_groups_config import ProcessGroupCollection  # isort: skip
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear  # isort: skip
from megatron.core.transformer.mlp import MLP, MLPSubmodules  # isort: skip
from megatron.core.transformer.spec_utils import ModuleSpec, build_module  # isort: skip

from swiglu_train.integrations.megatron import (
    ParMLPMegatron,
    SwiGLUActivationMLP,
    get_gpt_layer_spec,
    get_mlp_layer_spec,
    mlp_spec,
)
from swiglu_train.layers import PORTABLE_IMPLS, registry  # CPU-runnable: quack needs CUDA
from swiglu_train.layers.layout import CANONICAL, Layout, relayout

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
    """Every parameter's grad, a packed fc1's unpacked to canonical to compare with stock."""
    out = {n: p.grad.clone() for n, p in module.named_parameters()}
    for name, mlp in module.named_modules():
        for param in ("linear_fc1.weight", "linear_fc1.bias"):
            key = f"{name}.{param}" if name else param
            if key in out:
                out[key] = relayout(out[key], getattr(mlp, "fc1_layout", CANONICAL), CANONICAL)
    return out


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


# What the MLP-level parity builds: every impl, plus the TE backend's activation-only MLP
# (run here on Megatron's local linears, which it accepts like TE's).
MLP_KINDS = (*PORTABLE_IMPLS, "activation")


def build_ours(kind: str, config, via_spec: bool):
    """Our MLP of ``kind``, from a spec (megatron-core 0.16-0.17) or from the builder call
    of megatron-core >= 0.18's TransformerLayer."""
    cls = SwiGLUActivationMLP if kind == "activation" else ParMLPMegatron
    impl = "normal" if kind == "activation" else kind
    if via_spec:
        spec = ModuleSpec(module=cls, params={"impl": impl}, submodules=stock_submodules())
        return build_module(spec, config=config)
    return cls.as_mlp_submodule(
        submodules=stock_submodules(),
        config=config,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        is_mtp_layer=False,
        name="decoder.layers.0.mlp",
        layer_number=1,
        impl=impl,
    )


def _mlp_parity(world_size: int) -> None:
    tp_rank = torch.distributed.get_rank()
    sequence_parallel = [False, True] if world_size > 1 else [False]
    for kind in MLP_KINDS:
        for bias in (False, True):
            for sp in sequence_parallel:
                label = f"{kind} bias={bias} sp={sp} tp={world_size}"
                config = swiglu_config(add_bias_linear=bias, sequence_parallel=sp)
                torch.manual_seed(0)
                stock = MLP(config, stock_submodules(), ffn_hidden_size=config.ffn_hidden_size)
                # Ours replaces Megatron's activation path whether it is fused or not.
                fused = swiglu_config(
                    add_bias_linear=bias, sequence_parallel=sp, bias_activation_fusion=bias
                )
                torch.manual_seed(1)
                ours = build_ours(kind, fused, via_spec=bias)
                assert ours.tp_group is parallel_state.get_tensor_model_parallel_group()
                ours.load_state_dict(stock.state_dict())  # canonical in, packed where needed
                torch.manual_seed(2)
                x = torch.randn(SEQ, BATCH, config.hidden_size)
                if sp:  # each rank holds its slice of the sequence
                    x = x.chunk(world_size)[tp_rank].contiguous()
                stock_out = mlp_loss_and_grads(stock, x)
                assert_parity(mlp_loss_and_grads(ours, x), stock_out, label)
                with torch.no_grad():  # eval: our inference path, TP collectives included
                    for mine, theirs in zip(ours(x), stock(x), strict=True):
                        if theirs is None:
                            assert mine is None, label
                        else:
                            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


def _save_factors_layout(world_size: int) -> None:
    """The packed shard: same function from the same seed as stock, chunk checked."""
    config = swiglu_config()
    local_ffn = config.ffn_hidden_size // world_size
    torch.manual_seed(0)
    stock = MLP(config, stock_submodules(), ffn_hidden_size=config.ffn_hidden_size)
    torch.manual_seed(0)
    ours = ParMLPMegatron(config, stock_submodules(), impl="save_factors")
    layout = Layout("packed", math.gcd(local_ffn, 128))
    assert ours.fc1_layout == layout
    packed = relayout(stock.linear_fc1.weight.detach(), CANONICAL, layout)
    assert torch.equal(ours.linear_fc1.weight, packed), "repacked at construction"
    assert not torch.equal(packed, stock.linear_fc1.weight), "the layouts must differ here"
    expected = f"chunk=5 must be positive and divide this rank's ffn size .* {local_ffn}"
    with pytest.raises(ValueError, match=expected):
        ParMLPMegatron(config, stock_submodules(), impl="save_factors", chunk=5)
    with pytest.raises(ValueError, match="chunk applies to packed impls only"):
        ParMLPMegatron(config, stock_submodules(), impl="drop_h", chunk=8)
    with pytest.raises(ValueError, match=r"holds fc1 packed.*impl 'drop_h' needs it canonical"):
        ours.impl = "drop_h"
    ours.impl = "save_factors"  # same layout: allowed
    real, registry.require_quack = registry.require_quack, lambda: None  # no quack here
    try:
        with pytest.raises(ValueError, match=r"'save_factors_quack' needs it packed\(chunk=1"):
            ours.impl = "save_factors_quack"  # packed too, but with chunk 1
    finally:
        registry.require_quack = real


def _mlp_layer_parity() -> None:
    """HybridModel's MLPLayer: norm + MLP + residual, stock MLP vs ours in the same spec."""
    config = swiglu_config()
    stock_spec = get_mlp_layer_spec("normal")
    stock_spec.submodules.mlp = ModuleSpec(module=MLP, submodules=stock_submodules())
    torch.manual_seed(0)
    stock = build_module(stock_spec, config=config)
    torch.manual_seed(4)
    x = torch.randn(SEQ, BATCH, config.hidden_size)
    expected, _ = stock(x)
    for impl in PORTABLE_IMPLS:
        ours = build_module(get_mlp_layer_spec(impl), config=config)
        assert isinstance(ours.mlp, ParMLPMegatron) and ours.mlp.impl == impl
        ours.load_state_dict(stock.state_dict())
        out, _ = ours(x)
        assert rel_err(out, expected) <= PARITY, f"MLPLayer impl={impl}"


def _gpt_parity(world_size: int) -> None:
    """A whole GPTModel, a stock state_dict loaded into our spec, the MLP recomputed; then
    the plain state_dict of a packed model: stamped, readable by every impl, refused by the
    stock MLP and refused with a stamp it cannot read."""
    config = swiglu_config(recompute_granularity="selective", recompute_modules=["mlp"])
    stock = build_gpt(config, get_gpt_layer_local_spec(normalization="RMSNorm"), seed=0)
    torch.manual_seed(3)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    stock_loss = gpt_loss(stock, tokens)
    stock_loss.backward()
    for impl in PORTABLE_IMPLS:
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

    packed = build_gpt(config, get_gpt_layer_spec("save_factors"), seed=1)
    packed.load_state_dict(stock.state_dict())
    state = packed.state_dict()
    stamp_key = "decoder.layers.0.mlp._extra_state"
    assert state[stamp_key]["fc1_layout"]["kind"] == "packed"
    assert stamp_key not in stock.state_dict(), "canonical state is unstamped"
    for impl in ("save_factors", "drop_h"):
        ours = build_gpt(config, get_gpt_layer_spec(impl), seed=2)
        ours.load_state_dict(state)
        with torch.no_grad():
            err = rel_err(gpt_loss(ours, tokens), stock_loss)
        assert err <= PARITY, f"packed state_dict -> {impl}: loss off by {err:.2e}"
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\).*mlp\._extra_state"):
        stock.load_state_dict(state)  # stock Megatron never reads a packed fc1 as canonical
    state[stamp_key] = {"fc1_layout": {"kind": "interleaved", "chunk": 8, "tp": 1}}
    with pytest.raises(ValueError, match="unknown fc1 layout kind 'interleaved'"):
        packed.load_state_dict(state)
    state[stamp_key] = "v2"
    with pytest.raises(ValueError, match="unrecognised fc1 layout stamp 'v2'"):
        packed.load_state_dict(state)


def _parity_worker(rank: int, world_size: int, rendezvous: str) -> None:
    with megatron_parallel(rank, world_size, rendezvous, tp=world_size):
        _mlp_parity(world_size)
        _save_factors_layout(world_size)
        _mlp_layer_parity()
        _gpt_parity(world_size)


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
@pytest.mark.slow
def test_parity_with_stock_megatron(tp: int) -> None:
    """Loss and every grad match the stock MLP (and a stock GPTModel) to 1e-5 in fp32."""
    spawn(_parity_worker, tp)


def _overlap_param_gather_worker(rank: int, world_size: int, rendezvous: str) -> None:
    """Two DP ranks, DistributedOptimizer: losses with overlap_param_gather match those without.

    Megatron waits for a bucket's param all-gather in forward pre-hooks on the modules that own
    the params, here linear_fc1 and linear_fc2, which our forward reads without calling. Small
    buckets give the MLP weights buckets of their own: unwaited, the next step's gather
    dispatch fails (and larger buckets can read weights mid-gather on a GPU).
    """
    with megatron_parallel(rank, world_size, rendezvous):
        shim_distributed_optimizer()
        config = swiglu_config()
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
        for impl in ("drop_h", "save_factors"):
            losses = {}
            for overlap in (False, True):
                model = build_gpt(config, get_gpt_layer_spec(impl), seed=0)
                ddp_config = DistributedDataParallelConfig(
                    use_distributed_optimizer=True,
                    overlap_param_gather=overlap,
                    overlap_grad_reduce=overlap,
                    bucket_size=1000,
                )
                ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
                optimizer = get_megatron_optimizer(
                    OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True),
                    [ddp],
                )
                losses[overlap] = []
                for _ in range(3):
                    ddp.zero_grad_buffer()
                    optimizer.zero_grad()
                    loss = gpt_loss(ddp, tokens)
                    loss.backward()
                    ddp.finish_grad_sync()
                    optimizer.step()
                    losses[overlap].append(loss.detach())
            pairs = zip(losses[False], losses[True], strict=True)
            for step, (plain, overlapped) in enumerate(pairs):
                err = rel_err(overlapped, plain)
                assert err <= PARITY, f"{impl} step {step}: overlap_param_gather off by {err:.2e}"

        mlp = ParMLPMegatron(config, stock_submodules(), impl="drop_h")
        mlp.linear_fc2.register_forward_pre_hook(lambda module, args: (args[0] * 2,))
        with pytest.raises(RuntimeError, match="returned a new input; ParMLPMegatron runs its own"):
            mlp(torch.randn(SEQ, BATCH, config.hidden_size))


@pytest.mark.slow
def test_overlap_param_gather_waits_for_mlp_weights() -> None:
    spawn(_overlap_param_gather_worker, 2)


def test_unknown_impl_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match="valid impls: normal, drop_h, save_factors"):
        mlp_spec("fused")
    with pytest.raises(ValueError, match="valid impls: normal, drop_h"):
        ParMLPMegatron(swiglu_config(), stock_submodules(), impl="fused")


def test_chunk_of_a_canonical_impl_is_refused_by_the_spec() -> None:
    """A chunk only means something to a packed fc1: the spec says so, not the first layer."""
    with pytest.raises(ValueError, match="chunk applies to packed impls only, not 'drop_h'"):
        get_gpt_layer_spec("drop_h", chunk=8)
    mlp_spec("save_factors", chunk=8)  # whether 8 divides F/tp is checked at construction


def test_auto_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="impl 'auto' is not supported by the Megatron"):
        mlp_spec("auto")


def test_te_backend_needs_transformer_engine() -> None:
    """Without TE, backend='te' names the package and the local backend; the impls that need
    their own GEMMs are refused first, TE or not; unknown backends list the valid ones."""
    if te_available():
        pytest.skip("transformer-engine is installed: the refusal does not apply")
    with pytest.raises(ImportError, match=r"needs transformer-engine.*use backend='local'"):
        get_gpt_layer_spec("normal", backend="te")
    for impl in ("drop_h", "save_factors"):
        with pytest.raises(ValueError, match=f"impl '{impl}' needs its own GEMMs"):
            get_gpt_layer_spec(impl, backend="te")
    with pytest.raises(ValueError, match="valid backends: local, te"):
        mlp_spec("drop_h", backend="apex")


def test_te_backend_spec() -> None:
    """Where TE imports: fc1 is TE's LayerNorm+Linear, fc2 TE's row-parallel, ours between."""
    if not te_available():
        pytest.skip("transformer-engine is not installed (cannot be on our machines)")
    from megatron.core.extensions.transformer_engine import (
        TELayerNormColumnParallelLinear,
        TERowParallelLinear,
    )

    mlp = get_gpt_layer_spec("normal", backend="te").submodules.mlp
    if not isinstance(mlp, ModuleSpec):  # megatron-core >= 0.19: a bound builder
        mlp = ModuleSpec(module=mlp.func.__self__, submodules=mlp.keywords["submodules"])
    assert mlp.module is SwiGLUActivationMLP
    assert mlp.submodules.linear_fc1 is TELayerNormColumnParallelLinear
    assert mlp.submodules.linear_fc2 is TERowParallelLinear


def te_available() -> bool:
    from megatron.core.extensions import transformer_engine

    return bool(getattr(transformer_engine, "HAVE_TE", False))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"gated_linear_unit": False}, "computes SwiGLU only"),
        ({"activation_func": torch.nn.functional.gelu}, "computes SwiGLU only"),
        ({"fp8": "e4m3"}, "FP8/FP4 runs on Transformer Engine"),
        ({"gradient_accumulation_fusion": True}, "gradient_accumulation_fusion is not supported"),
        ({"activation_func_clamp_value": 7.0}, "clamped SwiGLU"),
        ({"gtp_weight_remat_size": 2}, "generalized tensor parallelism"),  # megatron-core 0.19
    ],
)
def test_unsupported_configs_are_refused(change: dict, message: str) -> None:
    config = swiglu_config()
    for key, value in change.items():  # set after construction: TE-only values fail validation
        setattr(config, key, value)
    with pytest.raises(ValueError, match=message):
        ParMLPMegatron(config, stock_submodules())


class _PlainLinear(torch.nn.Module):
    """A stand-in for TE's linears (not installable here), built and called as Megatron's MLP
    builds and calls its linears; it ignores gradient_accumulation_fusion, as TE handles it."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method, bias, **kw):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size))
        init_method(self.weight)
        self.bias = torch.nn.Parameter(torch.zeros(output_size)) if bias else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return torch.nn.functional.linear(x, self.weight), self.bias


@pytest.mark.parametrize("option", ["gradient_accumulation_fusion", "fp8"])
def test_activation_mlp_leaves_gemm_options_to_the_linears(option: str) -> None:
    """gradient_accumulation_fusion (Megatron-LM's default with TE) and FP8 concern the GEMMs,
    which SwiGLUActivationMLP leaves to Megatron's (TE's) linears: allowed there, refused where
    ours run."""
    config = swiglu_config(num_layers=1)
    # Set after construction: validation wants Apex or TE.
    setattr(config, option, "e4m3" if option == "fp8" else True)
    submodules = MLPSubmodules(linear_fc1=_PlainLinear, linear_fc2=_PlainLinear)
    torch.manual_seed(0)
    ours = SwiGLUActivationMLP(config, submodules)
    torch.manual_seed(0)
    stock = MLP(config, submodules, ffn_hidden_size=config.ffn_hidden_size)
    x = torch.randn(SEQ, BATCH, config.hidden_size)
    assert rel_err(ours(x)[0], stock(x)[0]) <= PARITY
    refusal = {"fp8": r"FP8/FP4 .* backend='te'"}.get(option, f"{option} is not supported")
    with pytest.raises(ValueError, match=refusal):
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
    with pytest.raises(ValueError, match=r"with Transformer Engine linears use .*backend='te'"):
        ParMLPMegatron(swiglu_config(), submodules)
