"""A patched Hugging Face model under what its users run: activation checkpointing,
torch.compile, autocast and bf16, FSDP2, generate(); and the activation memory it saves."""

import copy

import pytest
import torch
from helpers import TOLERANCE, rel_err
from patch_models import (
    PARITY,
    TOKENS,
    assert_close_all,
    assert_state_equal,
    hf_model,
    host_grads,
    run_step,
)

import swiglu_train
from swiglu_train.layers.layout import CANONICAL, relayout
from swiglu_train.memory import MemoryProfiler, SavedTensorCounter, model_config

transformers = pytest.importorskip("transformers")


def pair(impl: str = "drop_h", family: str = "llama"):
    reference = hf_model(family)
    patched = copy.deepcopy(reference)
    swiglu_train.patch(patched, impl)
    return reference, patched


def assert_step_matches(patched, reference, tol: float = PARITY) -> None:
    ids = torch.randint(0, 64, TOKENS)
    logits, embed_grad = run_step(patched, patched.get_input_embeddings(), ids)
    ref_logits, ref_embed_grad = run_step(reference, reference.get_input_embeddings(), ids)
    assert rel_err(logits, ref_logits) < tol
    assert rel_err(embed_grad, ref_embed_grad) < tol
    assert_close_all(host_grads(patched), host_grads(reference), tol)


@pytest.mark.parametrize("reentrant", [False, True])
def test_hf_gradient_checkpointing(reentrant):
    reference, patched = pair("drop_h")
    for model in (reference, patched):
        model.gradient_checkpointing_enable({"use_reentrant": reentrant})
    assert patched.model.layers[0].gradient_checkpointing
    assert_step_matches(patched, reference)


def test_torch_compile_of_the_patched_model():
    torch._dynamo.reset()
    reference, patched = pair("drop_h")
    compiled = torch.compile(patched, backend="aot_eager")  # inductor's codegen aside, on CPU
    ids = torch.randint(0, 64, TOKENS)
    logits, _ = run_step(compiled, patched.get_input_embeddings(), ids)
    ref_logits, _ = run_step(reference, reference.get_input_embeddings(), ids)
    assert rel_err(logits, ref_logits) < PARITY
    assert_close_all(host_grads(patched), host_grads(reference))


def test_autocast_and_bf16_models():
    reference, patched = pair("save_factors")
    ids = torch.randint(0, 64, TOKENS)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, _ = run_step(patched, patched.get_input_embeddings(), ids)
        ref_logits, _ = run_step(reference, reference.get_input_embeddings(), ids)
    assert logits.dtype == torch.bfloat16
    assert rel_err(logits, ref_logits) < TOLERANCE[torch.bfloat16]

    # Llama: no attention biases, whose grads are rounding noise (softmax cancels a key bias).
    # Two bf16 models differ by both one's rounding and the other's (up to 1.2 % here), so
    # each is measured against the fp32 model: the patched one within 1.5x HF's own error.
    exact = hf_model("llama")
    reference = copy.deepcopy(exact).to(torch.bfloat16)
    patched = copy.deepcopy(reference)
    swiglu_train.patch(patched, "drop_h")
    assert patched.model.layers[0].mlp.fc1.weight.dtype == torch.bfloat16
    ids = torch.randint(0, 64, TOKENS)
    steps = [run_step(m, m.get_input_embeddings(), ids) for m in (patched, reference, exact)]
    (logits, embed_grad), (ref_logits, ref_embed_grad), (logits32, embed_grad32) = steps
    assert rel_err(logits, logits32) <= 1.5 * rel_err(ref_logits, logits32) + 1e-3
    assert rel_err(embed_grad, embed_grad32) <= 1.5 * rel_err(ref_embed_grad, embed_grad32) + 1e-3
    ours, theirs, grads32 = host_grads(patched), host_grads(reference), host_grads(exact)
    assert list(ours) == list(grads32)
    for key, grad32 in grads32.items():
        assert rel_err(ours[key], grad32) <= 1.5 * rel_err(theirs[key], grad32) + 1e-3, key


def test_generate_gives_the_unpatched_tokens():
    """generate() runs without grad: every impl takes the inference path there."""
    reference, patched = pair("save_factors")
    for model in (reference, patched):
        model.eval().generation_config.pad_token_id = 0
    prompt = torch.randint(1, 64, (2, 5))
    kwargs = {"max_new_tokens": 6, "do_sample": False}
    out = patched.generate(prompt, **kwargs)
    assert out.shape == (2, 11)
    assert torch.equal(out, reference.generate(prompt, **kwargs))


def test_fsdp2_fully_shard(one_rank_gloo):
    import torch.distributed.checkpoint.state_dict as dcp
    from torch.distributed.fsdp import fully_shard

    reference, patched = pair("save_factors")
    for layer in patched.model.layers:
        fully_shard(layer)
    fully_shard(patched)
    fc1 = patched.model.layers[0].mlp.fc1.weight
    assert type(fc1).__name__ == "DTensor"
    state = patched.state_dict()
    assert list(state) == list(reference.state_dict())
    for key, value in reference.state_dict().items():
        assert torch.equal(state[key].full_tensor(), value), key
    ids = torch.randint(0, 64, TOKENS)
    logits, embed_grad = run_step(patched, patched.get_input_embeddings(), ids)
    ref_logits, ref_embed_grad = run_step(reference, reference.get_input_embeddings(), ids)
    assert rel_err(logits, ref_logits) < PARITY
    assert rel_err(embed_grad, ref_embed_grad) < PARITY
    for mlp, ref in zip(patched.model.layers, reference.model.layers, strict=True):
        mlp, ref = mlp.mlp, ref.mlp
        fc1_grad = relayout(mlp.fc1.weight.grad.full_tensor(), mlp.fc1_layout, CANONICAL)
        assert (
            rel_err(fc1_grad, torch.cat([ref.gate_proj.weight.grad, ref.up_proj.weight.grad]))
            < PARITY
        )
        assert rel_err(mlp.fc2.weight.grad.full_tensor(), ref.down_proj.weight.grad) < PARITY
    other = hf_model("llama", seed=1)  # an unpatched FSDP2 model's sharded state loads too
    expected = other.state_dict()
    for layer in other.model.layers:
        fully_shard(layer)
    patched.load_state_dict(fully_shard(other).state_dict())
    for key, value in patched.state_dict().items():
        assert torch.equal(value.full_tensor(), expected[key]), key
    # torch.distributed.checkpoint (Lightning's and torchtitan's FSDP2 checkpoints) walks
    # module attributes by key: mlp.gate_proj reads as the host linear did
    full = dcp.StateDictOptions(full_state_dict=True)
    dcp.set_model_state_dict(patched, reference.state_dict(), options=full)
    assert_state_equal(dcp.get_model_state_dict(patched, options=full), reference.state_dict())


# Saved for backward per MLP, in elements of [M, F], besides its input x (which both save):
# HF's eager LlamaMLP keeps gate, silu(gate), up and h (4); normal keeps preact [M, 2F] and h
# (3); drop_h the preactivation alone (2); save_factors the factors [M, 2F] and h (3).
SAVED_MF = {"eager": 4, "normal": 3, "drop_h": 2, "save_factors": 3}


@pytest.mark.parametrize("impl", ["normal", "drop_h", "save_factors"])
def test_saved_bytes_drop_by_exactly_the_mlp_tensors(impl):
    reference, patched = pair(impl)
    ids = torch.randint(0, 64, TOKENS)
    saved = {}
    for name, model in (("eager", reference), (impl, patched)):
        with SavedTensorCounter(exclude=model.parameters()) as counter:
            model(ids)
        saved[name] = counter.bytes
    M, F, layers = ids.numel(), 64, 2
    cut = (SAVED_MF["eager"] - SAVED_MF[impl]) * M * F * 4 * layers  # fp32
    assert saved["eager"] - saved[impl] == cut


def test_memory_profiler_counts_patched_mlps_by_impl():
    _, patched = pair("drop_h")
    profiler = MemoryProfiler(patched)
    ids = torch.randint(0, 64, TOKENS)
    with profiler.step(0) as p:
        loss = patched(ids).logits.square().mean()
        p.forward_done()
        loss.backward()
    record = profiler.records[0]
    assert model_config(patched)["mlp_impl"] == "drop_h"
    assert [layer.name for layer in record.layers] == ["model.layers.0", "model.layers.1"]
    # per MLP: its input x [M, D] and the preactivation [M, 2F], fp32
    M, D, F = ids.numel(), 32, 64
    assert record.impl_saved_bytes == {"drop_h": 2 * (M * D + 2 * M * F) * 4}
