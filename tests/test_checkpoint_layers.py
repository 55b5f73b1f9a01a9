"""Activation checkpointing of whole blocks in the Lightning Llama (model.checkpoint_layers):
the same losses and grads with and without, for every impl's in-place backward, and exactly
the saved bytes of the checkpointed blocks gone but their inputs."""

import pytest
import torch
from helpers import TOLERANCE, rel_err

from swiglu_train.integrations.lightning.model import LlamaDecoder, ModelConfig
from swiglu_train.kernels.runtime import triton_runs_on
from swiglu_train.layers.registry import PORTABLE_IMPLS, QUACK_IMPLS
from swiglu_train.memory import MemoryProfiler
from swiglu_train.ops import use_backend
from swiglu_train.ops.quack_mlp import quack_available

SHAPE = {"hidden_size": 64, "ffn_hidden_size": 96, "num_layers": 2, "num_heads": 4}
BATCH, SEQ = 2, 16
# Every impl that runs on CPU, and drop_h with its FP8-saved preactivation (its own in-place
# backward, which consumes the saved FP8 copy), on the torch backend (whose backwards are in
# place too); drop_h's Triton kernels as well where the interpreter runs them.
CPU_CASES = [(impl, False, "torch") for impl in PORTABLE_IMPLS] + [("drop_h", True, "torch")]
if triton_runs_on(torch.device("cpu")):
    CPU_CASES.append(("drop_h", False, "triton"))


def step(model: LlamaDecoder, tokens: torch.Tensor, n: int):
    """One forward and backward with ``n`` blocks checkpointed: loss, grads, profiler record."""
    model.checkpoint_layers = n
    model.zero_grad(set_to_none=True)
    profiler = MemoryProfiler(model)
    with profiler.step(0):
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        profiler.forward_done()
        loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return loss.detach(), grads, profiler.records[-1]


def build(impl: str, saved_fp8: bool = False, **kwargs) -> LlamaDecoder:
    torch.manual_seed(0)
    cfg = ModelConfig(**SHAPE, max_seq_length=SEQ, mlp_impl=impl, saved_fp8=saved_fp8)
    return LlamaDecoder(cfg).to(**kwargs)


@pytest.mark.parametrize(("impl", "saved_fp8", "backend"), CPU_CASES)
def test_checkpointed_blocks_give_the_same_loss_and_grads_and_save_only_their_inputs(
    impl: str, saved_fp8: bool, backend: str
) -> None:
    model = build(impl, saved_fp8)
    tokens = torch.randint(0, model.cfg.vocab_size, (BATCH, SEQ + 1))
    with use_backend(backend):
        check_checkpointing(model, tokens)


def check_checkpointing(model: LlamaDecoder, tokens: torch.Tensor) -> None:
    loss0, grads0, full = step(model, tokens, 0)
    x_bytes = BATCH * SEQ * SHAPE["hidden_size"] * 4  # a block's input, fp32
    rope_bytes = model.rope_cos.nbytes + model.rope_sin.nbytes  # one storage each, shared
    for n, repeats in ((1, 1), (SHAPE["num_layers"], 2)):
        # A second step on the same model must not trip the in-place backwards'
        # second-backward guard (each recompute makes a fresh graph).
        for _ in range(repeats):
            loss, grads, record = step(model, tokens, n)
            # fp32 on CPU: the recompute runs the very same kernels on the very same inputs
            assert torch.equal(loss, loss0)
            for name, g in grads.items():
                assert torch.equal(g, grads0[name]), (n, name)
        kept = [layer.saved_bytes for layer in record.layers[:n]]
        assert kept == [x_bytes + rope_bytes] * n  # a checkpointed block keeps its inputs
        assert [la.saved_bytes for la in record.layers[n:]] == [
            la.saved_bytes for la in full.layers[n:]
        ]
        dropped = sum(layer.saved_bytes - x_bytes - rope_bytes for layer in full.layers[:n])
        assert dropped > 0
        assert record.saved_bytes == full.saved_bytes - dropped
    assert model.checkpoint_layers == SHAPE["num_layers"]


def test_no_grad_forward_is_not_checkpointed_and_bounds_are_checked() -> None:
    model = build("drop_h")
    model.checkpoint_layers = 2
    tokens = torch.randint(0, 320, (1, 8))
    with use_backend("torch"), torch.no_grad():  # eval: nothing to recompute; same logits
        eval_logits = model(tokens)
        model.checkpoint_layers = 0
        assert torch.equal(model(tokens), eval_logits)
    with pytest.raises(ValueError, match=r"checkpoint_layers must be from 0 to 2, got 3"):
        model.checkpoint_layers = 3
    with pytest.raises(ValueError, match=r"from 0 to num_layers=2"):
        ModelConfig(**SHAPE, checkpoint_layers=-1)
    with pytest.raises(ValueError, match=r"must be an integer from 0 to num_layers"):
        ModelConfig(**SHAPE, checkpoint_layers=1.5)


def test_a_forward_set_on_the_block_before_is_wrapped_and_given_back() -> None:
    """Another wrapper's instance forward (a hook library's, say) survives checkpointing on and
    off; the class's own forward is simply uncovered again."""
    from swiglu_train.integrations.lightning.block_checkpoint import (
        is_checkpointed,
        set_checkpointed,
    )

    plain, wrapped = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    calls = []
    own = wrapped.forward
    wrapped.forward = lambda x: calls.append(x.shape) or own(x)
    other = wrapped.forward
    x = torch.randn(2, 4, requires_grad=True)
    for block in (plain, wrapped):
        for _ in range(2):  # setting what is set does nothing
            set_checkpointed(block, True)
        assert is_checkpointed(block)
        block(x).sum().backward()  # the forward, and its recompute
        set_checkpointed(block, False)
        assert not is_checkpointed(block)
    assert "forward" not in vars(plain) and wrapped.forward is other
    assert calls == [(2, 4)] * 2


def host_source(tmp_path, kind: str) -> str:
    """A two-block Llama as a Hugging Face config.json, or as a LitGPT model_config.yaml."""
    if kind == "hf":
        transformers = pytest.importorskip("transformers")
        transformers.LlamaConfig(
            vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        ).save_pretrained(tmp_path)  # fmt: skip
        return f"hf:{tmp_path / 'config.json'}"
    yaml = pytest.importorskip("yaml")
    pytest.importorskip("litgpt")
    path = tmp_path / "model_config.yaml"
    path.write_text(yaml.safe_dump({
        "block_size": 64, "vocab_size": 320, "padded_vocab_size": 320, "n_layer": 2,
        "n_head": 4, "n_query_groups": 2, "n_embd": 32, "intermediate_size": 64,
        "bias": False, "norm_class_name": "RMSNorm", "mlp_class_name": "LLaMAMLP",
    }))  # fmt: skip
    return f"litgpt:{path}"


@pytest.mark.parametrize("kind", ["hf", "litgpt"])
def test_a_host_model_s_blocks_are_checkpointed_like_the_llama_s(tmp_path, kind) -> None:
    """--model hosts' blocks take their own arguments (HF's position embeddings and keyword
    flags, LitGPT's RoPE and mask): the same loss and grads, their saved bytes gone but their
    inputs', the checkpoint's keys unchanged, and the count from the config."""
    from swiglu_train.integrations.lightning.config import OptimConfig
    from swiglu_train.integrations.lightning.module import PretrainModule

    source = host_source(tmp_path, kind)
    torch.manual_seed(0)
    cfg = ModelConfig(source=source, mlp_impl="drop_h", checkpoint_layers=1)
    model = PretrainModule(cfg, OptimConfig(), max_steps=1).model
    assert model.checkpoint_layers == 1  # from the config
    keys = list(model.state_dict())
    tokens = torch.randint(0, 320, (BATCH, SEQ + 1))
    with use_backend("torch"):
        loss0, grads0, full = step(model, tokens, 0)
        records = []
        for n in (1, 2, 1):  # on and off again on one model, as the planner does
            loss, grads, record = step(model, tokens, n)
            assert torch.equal(loss, loss0)
            for name, g in grads.items():
                assert torch.equal(g, grads0[name]), (n, name)
            records.append(record)
    assert list(model.state_dict()) == keys
    for n, record in zip((1, 2, 1), records, strict=True):
        kept = [layer.saved_bytes for layer in record.layers]
        unchecked = [layer.saved_bytes for layer in full.layers]
        assert all(k < u / 2 for k, u in zip(kept[:n], unchecked[:n], strict=True)), (n, kept)
        assert kept[n:] == unchecked[n:]
    with pytest.raises(ValueError, match=r"checkpoint_layers must be from 0 to 2, got 3"):
        model.checkpoint_layers = 3


@pytest.mark.gpu
@pytest.mark.skipif(not quack_available(), reason="needs quack-kernels and an sm_90+ GPU")
@pytest.mark.parametrize("impl", sorted(QUACK_IMPLS))
def test_quack_impls_under_block_checkpointing(impl: str) -> None:
    """bf16 on the GPU: the recompute runs the same kernels, so the grads agree to bf16."""
    model = build(impl, device="cuda", dtype=torch.bfloat16)
    tokens = torch.randint(0, 320, (BATCH, SEQ + 1), device="cuda")
    loss0, grads0, _ = step(model, tokens, 0)
    for _ in range(2):
        loss, grads, _ = step(model, tokens, SHAPE["num_layers"])
        assert rel_err(loss, loss0) < TOLERANCE[torch.bfloat16]
        for name, g in grads.items():
            assert rel_err(g, grads0[name]) < TOLERANCE[torch.bfloat16], name
