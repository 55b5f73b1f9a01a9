"""swiglu_train.patch on Llama-4's MoE block (Llama4TextMoe) of a real tiny transformers 5
Llama4ForCausalLM (CPU).

Llama-4 runs every expert on every token scaled by its router score; the patched block runs
the top-k experts alone. fp32 logits, the block's router logits and every gradient (router,
experts, shared expert) match the unpatched twin; the state_dict is the host's keys, layouts
and values, so checkpoints go both ways.
"""

import copy

import pytest
import torch
from helpers import rel_err
from patch_models import (
    PARITY,
    TOKENS,
    assert_close_all,
    assert_loads_both_ways,
    assert_state_equal,
    assert_step_matches,
    host_grads,
    run_step,
)

import swiglu_train
from swiglu_train.integrations.patch.hf_llama4 import PatchedLlama4Experts, PatchedLlama4Moe

transformers = pytest.importorskip("transformers")
from transformers.models.llama4.modeling_llama4 import Llama4TextMoe  # noqa: E402

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=24, intermediate_size_mlp=48,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2)  # fmt: skip
BLOCKS = ["model.layers.0.feed_forward", "model.layers.1.feed_forward"]


def llama4_model(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.Llama4TextConfig(**CONFIG)
    return transformers.AutoModelForCausalLM.from_config(config).train()


def patched_pair(**options):
    reference = llama4_model()
    patched = copy.deepcopy(reference)
    return reference, patched, swiglu_train.patch(patched, **options)


def block_outputs(model, ids):
    """(logits, grad of the input embeddings, each block's router logits) of one step."""
    outs = []
    handles = [model.get_submodule(name).register_forward_hook(lambda m, a, o: outs.append(o))
               for name in BLOCKS]  # fmt: skip
    try:
        logits, embed_grad = run_step(model, model.get_input_embeddings(), ids)
    finally:
        for handle in handles:
            handle.remove()
    return logits, embed_grad, outs


@pytest.mark.parametrize("impl", ["normal", "drop_h"])
def test_patched_llama4_computes_as_the_original(impl):
    reference, patched, _ = patched_pair(impl=impl)
    assert isinstance(reference.model.layers[0].feed_forward, Llama4TextMoe)
    block = patched.model.layers[0].feed_forward
    assert isinstance(block, PatchedLlama4Moe) and isinstance(block.experts, PatchedLlama4Experts)
    assert block.experts.impl == impl and block.experts.router_weights_on == "input"
    ids = torch.randint(0, 64, TOKENS)
    logits, embed_grad, outs = block_outputs(patched, ids)
    ref_logits, ref_embed_grad, ref_outs = block_outputs(reference, ids)
    assert rel_err(logits, ref_logits) < PARITY
    assert rel_err(embed_grad, ref_embed_grad) < PARITY
    for (out, router_logits), (ref_out, ref_router_logits) in zip(outs, ref_outs, strict=True):
        assert out.shape == ref_out.shape == (TOKENS[0] * TOKENS[1], 32)
        assert out.dtype == ref_out.dtype and router_logits.shape == (16, 4)
        assert rel_err(out, ref_out) < PARITY
        assert rel_err(router_logits, ref_router_logits) < PARITY
    grads, ref_grads = host_grads(patched), host_grads(reference)
    assert_close_all(grads, ref_grads)
    for key in ("experts.gate_up_proj", "experts.down_proj", "router.weight",
                "shared_expert.gate_proj.weight"):  # fmt: skip
        assert ref_grads[f"{BLOCKS[1]}.{key}"].norm() > 0, key  # each grad is really compared


def test_saved_fp8_matches_within_e4m3_rounding():
    reference, patched, report = patched_pair(impl="drop_h", saved_fp8=True)
    assert report.impls == {"drop_h": 4}  # two blocks: their experts and shared experts
    assert patched.get_submodule(BLOCKS[0]).experts.saved_fp8
    assert_step_matches(patched, reference, tol=6e-2)  # the e4m3 preactivation, 3 mantissa bits


def test_a_bf16_model_matches_within_bf16_rounding():
    reference, patched, _ = patched_pair(impl="drop_h")
    for model in (reference, patched):
        model.to(torch.bfloat16)
    assert patched.get_submodule(BLOCKS[0]).experts.fc1_weight.dtype == torch.bfloat16
    assert_step_matches(patched, reference, tol=3e-2)  # bf16 sums in another order


def test_state_dict_is_the_hosts_and_loads_both_ways():
    reference, patched, _ = patched_pair()
    state = patched.state_dict()
    assert_state_equal(state, reference.state_dict())
    assert state[f"{BLOCKS[0]}.experts.gate_up_proj"].shape == (4, 32, 48)  # [E, D, 2F]
    assert state[f"{BLOCKS[0]}.experts.down_proj"].shape == (4, 24, 32)  # [E, F, D]
    assert_loads_both_ways(patched, reference, llama4_model(seed=1))
    bad = {f"{BLOCKS[0]}.experts.down_proj": torch.zeros(4, 32, 24)}  # ours, not the host's
    with pytest.raises(RuntimeError, match=r"size mismatch for .*experts\.down_proj"):
        patched.load_state_dict(bad, strict=False)


def test_save_pretrained_writes_the_plain_models_files(tmp_path):
    from safetensors.torch import load_file

    reference, patched, _ = patched_pair()
    patched.save_pretrained(tmp_path / "patched")
    reference.save_pretrained(tmp_path / "plain")
    written = load_file(tmp_path / "patched" / "model.safetensors")
    plain = load_file(tmp_path / "plain" / "model.safetensors")
    assert_state_equal(dict(sorted(written.items())), dict(sorted(plain.items())))


def test_report_names_the_block_and_the_shared_expert_is_patched_as_a_dense_mlp():
    _, patched, report = patched_pair(impl="save_factors", chunk=8)
    assert [(r.name, r.host_class, r.impl, r.num_experts, r.shape) for r in report.replaced] == [
        *[(n, "Llama4TextMoe", "drop_h", 4, (32, 24, 32)) for n in BLOCKS[:1]],
        (f"{BLOCKS[0]}.shared_expert", "Llama4TextMLP", "save_factors", None, (32, 24, 32)),
        *[(n, "Llama4TextMoe", "drop_h", 4, (32, 24, 32)) for n in BLOCKS[1:]],
        (f"{BLOCKS[1]}.shared_expert", "Llama4TextMLP", "save_factors", None, (32, 24, 32)),
    ]
    assert report.left == []
    assert "replaced 2 x transformers Llama4TextMoe -> 4 experts drop_h (save_factors" in str(
        report
    )
    again = swiglu_train.patch(patched)  # patching twice changes nothing
    assert again.replaced == [] and {e.reason for e in again.left} == {
        "already patched (impl drop_h)",
        "already patched (impl save_factors)",
    }


def test_an_optimizer_built_before_patch_is_refused():
    model = llama4_model()
    early = torch.optim.SGD(model.parameters(), lr=1.0)
    swiglu_train.patch(model)
    run_step(model, model.get_input_embeddings(), torch.randint(0, 64, TOKENS))
    with pytest.raises(RuntimeError, match=r"experts\.gate_up_proj"):
        early.step()


class MyMoe(Llama4TextMoe):
    def forward(self, hidden_states):
        out, logits = super().forward(hidden_states)
        return 2 * out, logits


def test_a_block_that_differs_is_left_with_the_reason():
    model = llama4_model()
    config = model.config
    # built from the config, its weights are torch.empty's memory (NaNs at times): take the
    # block's values, so "left as it was" compares numbers
    custom = MyMoe(config)
    custom.load_state_dict(model.model.layers[0].feed_forward.state_dict())
    model.model.layers[0].feed_forward = custom
    gelu = model.model.layers[1].feed_forward
    gelu.experts.act_fn = torch.nn.GELU()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = swiglu_train.patch(model)
    reasons = {e.name: (e.host_class, e.reason) for e in report.left}
    assert reasons == {
        BLOCKS[0]: ("MyMoe", "its forward (MyMoe.forward) is not transformers' Llama-4 MoE "
                    "(Llama4TextMoe, Llama4TextExperts, Llama4Router)"),
        BLOCKS[1]: ("Llama4TextMoe", "its activation GELU is not SiLU (a gated MLP with it is "
                    "not SwiGLU)"),
    }  # fmt: skip
    # the experts are the block's (not reported twice); its shared expert is a dense MLP still
    assert [r.name for r in report.replaced] == [f"{n}.shared_expert" for n in BLOCKS]
    assert isinstance(model.model.layers[0].feed_forward, MyMoe)
    state = model.state_dict()
    assert list(state) == list(before)
    for key in before:
        if "shared_expert" not in key:
            assert torch.equal(state[key], before[key]), key


def test_experts_whose_weights_are_not_the_pair_are_left_with_the_reason():
    """Llama-4 holds its experts transposed ([E, D, 2F], [E, F, D]); the reason says so."""
    model = llama4_model()
    first, second = (model.model.layers[i].feed_forward.experts for i in (0, 1))
    first.register_parameter("bias", torch.nn.Parameter(torch.zeros(3)))
    e, f, d = second.down_proj.shape
    second.down_proj = torch.nn.Parameter(torch.zeros(e, f - 1, d))
    report = swiglu_train.patch(model)
    reasons = {e.name: e.reason for e in report.left}
    assert reasons == {
        BLOCKS[0]: "its experts: it holds bias besides gate_up_proj and down_proj",
        BLOCKS[1]: f"its experts: its shapes do not chain: gate_up_proj ({e}, {d}, {2 * f}), "
        f"down_proj ({e}, {f - 1}, {d}) (want [E, D, 2F] and [E, F, D])",
    }


def test_the_multimodal_models_text_blocks_are_patched_and_compute_as_before():
    """Llama4ForConditionalGeneration holds the same text blocks under its language model."""
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=48,
                  image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32,
                  projector_output_dim=32)  # fmt: skip
    config = transformers.Llama4Config(text_config=CONFIG, vision_config=vision)
    torch.manual_seed(0)
    reference = transformers.Llama4ForConditionalGeneration(config).train()
    patched = copy.deepcopy(reference)
    report = swiglu_train.patch(patched, impl="drop_h")
    assert report.impls == {"drop_h": 4}  # two blocks: their experts and shared experts
    blocks = [m for n, m in patched.named_modules() if n.endswith("feed_forward")]
    assert len(blocks) == 2 and all(isinstance(b, PatchedLlama4Moe) for b in blocks)
    ids = torch.randint(0, 64, TOKENS)
    with torch.no_grad():
        assert rel_err(patched(input_ids=ids).logits, reference(input_ids=ids).logits) < PARITY
