"""swiglu_train.patch on the routed experts of real transformers 5 MoE models (tiny, CPU).

Each family's patched model is compared with its unpatched twin (transformers' grouped_mm
experts): fp32 logits and every gradient, the router's included, within fp32 rounding; its
state_dict is the same tensors under the same keys, so checkpoints go both ways.
"""

import copy

import pytest
import torch
from helpers import rel_err
from patch_models import (
    PARITY,
    TOKENS,
    assert_loads_both_ways,
    assert_state_equal,
    assert_step_matches,
    run_step,
)

import swiglu_train
from swiglu_train.integrations.patch.hf_experts import PatchedHFExperts

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, num_experts_per_tok=2)  # fmt: skip
DEEPSEEK = dict(intermediate_size=64, moe_intermediate_size=24, n_routed_experts=4,
                n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16,
                qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8)  # fmt: skip
# family -> (config, experts class, names of the patched experts, other MLPs patched)
FAMILIES = {
    "mixtral": (lambda: transformers.MixtralConfig(**BASE, intermediate_size=48,
                                                   num_local_experts=4),
                "MixtralExperts", [0, 1], 0),
    "qwen2_moe": (lambda: transformers.Qwen2MoeConfig(**BASE, intermediate_size=64,
                                                      moe_intermediate_size=24, num_experts=4,
                                                      shared_expert_intermediate_size=40,
                                                      norm_topk_prob=True),
                  "Qwen2MoeExperts", [0, 1], 2),
    "qwen3_moe": (lambda: transformers.Qwen3MoeConfig(**BASE, head_dim=8, intermediate_size=64,
                                                      moe_intermediate_size=24, num_experts=4),
                  "Qwen3MoeExperts", [0, 1], 0),
    "olmoe": (lambda: transformers.OlmoeConfig(**BASE, intermediate_size=24, num_experts=4),
              "OlmoeExperts", [0, 1], 0),
    "deepseek_v2": (lambda: transformers.DeepseekV2Config(**BASE, **DEEPSEEK, q_lora_rank=None,
                                                          topk_method="greedy",
                                                          routed_scaling_factor=1.5),
                    "DeepseekV2Experts", [1], 2),
    "deepseek_v3": (lambda: transformers.DeepseekV3Config(**BASE, **DEEPSEEK, q_lora_rank=24,
                                                          n_group=2, topk_group=1,
                                                          routed_scaling_factor=2.5),
                    "DeepseekV3NaiveMoe", [1], 2),
}  # fmt: skip


def moe_model(family: str, seed: int = 0):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(FAMILIES[family][0]()).train()


def patched_pair(family: str, **options):
    reference = moe_model(family)
    patched = copy.deepcopy(reference)
    return reference, patched, swiglu_train.patch(patched, **options)


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_moe_model_computes_and_saves_as_the_original(family):
    reference, patched, report = patched_pair(family, impl="drop_h")
    _, cls, layers, dense = FAMILIES[family]
    host = reference.model.layers[layers[0]].mlp.experts
    mine = patched.model.layers[layers[0]].mlp.experts
    shape = (32, host.down_proj.shape[2], 32)  # (D, F, D) per expert
    experts = [r for r in report.replaced if r.num_experts is not None]
    assert [(r.name, r.library, r.host_class, r.impl, r.num_experts, r.shape) for r in experts] == [
        (f"model.layers.{i}.mlp.experts", "transformers", cls, "drop_h", 4, shape) for i in layers
    ]
    assert len(report.replaced) - len(experts) == dense and report.left == []
    assert f"replaced {len(layers)} x transformers {cls} -> 4 experts drop_h" in str(report)
    assert isinstance(mine, PatchedHFExperts) and mine.gate_up_proj is mine.fc1_weight
    assert torch.equal(mine.gate_up_proj, host.gate_up_proj)
    assert_state_equal(patched.state_dict(), reference.state_dict())
    assert_step_matches(patched, reference)


def test_adopted_experts_are_the_same_tensors_so_an_earlier_optimizer_trains_them():
    model = moe_model("mixtral")
    experts = model.model.layers[0].mlp.experts
    before = {id(experts.gate_up_proj), id(experts.down_proj)}
    early = torch.optim.SGD(model.parameters(), lr=1.0)
    swiglu_train.patch(model)
    patched = model.model.layers[0].mlp.experts
    assert {id(p) for p in patched.parameters()} == before
    run_step(model, model.get_input_embeddings(), torch.randint(0, 64, TOKENS))
    old = patched.fc1_weight.detach().clone()
    early.step()  # no guard: nothing it holds was replaced
    assert not torch.equal(patched.fc1_weight, old)


@pytest.mark.parametrize(("impl", "saved_fp8", "tol"), [("normal", False, PARITY),
                                                        ("drop_h", True, 6e-2)])  # fmt: skip
def test_the_other_experts_impls_match(impl, saved_fp8, tol):
    """normal exactly; drop_h with its e4m3 preactivation within e4m3's rounding."""
    reference, patched, report = patched_pair("olmoe", impl=impl, saved_fp8=saved_fp8)
    assert report.impls == {impl: 2}
    assert patched.model.layers[0].mlp.experts.saved_fp8 is saved_fp8
    assert_step_matches(patched, reference, tol)


def test_a_bf16_model_matches_within_bf16_rounding():
    reference, patched, _ = patched_pair("olmoe", impl="drop_h")
    for model in (reference, patched):
        model.to(torch.bfloat16)
    assert patched.model.layers[0].mlp.experts.fc1_weight.dtype == torch.bfloat16
    assert_step_matches(patched, reference, tol=3e-2)  # seen 1e-2: bf16 sums in another order


def test_experts_impl_follows_impl_or_says_why():
    _, patched, report = patched_pair("qwen2_moe", impl="save_factors", chunk=8)
    assert report.impls == {"save_factors": 2, "drop_h": 2}
    assert ("transformers Qwen2MoeExperts -> 4 experts drop_h (save_factors has no "
            "routed-experts form, so drop_h; experts_impl= names one)") in str(report)  # fmt: skip
    _, _, report = patched_pair("qwen2_moe", impl="save_factors", chunk=8, experts_impl="normal")
    assert report.impls == {"save_factors": 2, "normal": 2} and "(save_" not in str(report)
    with pytest.raises(ValueError, match="unknown experts impl 'fast'; choose one of"):
        swiglu_train.patch(patched, experts_impl="fast")
    with pytest.raises(ValueError, match="saved_fp8=True needs impl='drop_h'"):
        swiglu_train.patch(moe_model("mixtral"), impl="normal", saved_fp8=True)
    again = swiglu_train.patch(patched, "drop_h")  # patching twice changes nothing
    assert again.replaced == []
    assert {e.reason for e in again.left} == {f"already patched (impl {impl})"
                                              for impl in ("drop_h", "save_factors")}  # fmt: skip


def test_state_dicts_load_both_ways():
    """An unpatched model's state loads into a patched one, and back, strictly."""
    reference, patched, _ = patched_pair("qwen3_moe")
    assert_loads_both_ways(patched, reference, moe_model("qwen3_moe", seed=1))


def test_save_pretrained_and_from_pretrained(tmp_path):
    """The patched model writes the plain model's files (Mixtral's original per-expert keys);
    ``from_pretrained`` of a saved model, patched, computes as the model saved."""
    from safetensors.torch import load_file

    reference, patched, _ = patched_pair("mixtral")
    patched.save_pretrained(tmp_path / "patched")
    reference.save_pretrained(tmp_path / "plain")
    written = load_file(tmp_path / "patched" / "model.safetensors")
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in written
    assert_state_equal(
        dict(sorted(written.items())),
        dict(sorted(load_file(tmp_path / "plain" / "model.safetensors").items())),
    )
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain")
    report = swiglu_train.patch(loaded)
    assert [r.host_class for r in report.replaced] == ["MixtralExperts"] * 2
    assert_state_equal(loaded.state_dict(), reference.state_dict())
    ids = torch.randint(0, 64, TOKENS)
    loaded.eval(), reference.eval()
    with torch.no_grad():
        assert rel_err(loaded(ids).logits, reference(ids).logits) < PARITY


def test_fsdp2_fully_shard_after_patch(one_rank_gloo):
    import torch.distributed.checkpoint.state_dict as dcp
    from torch.distributed.fsdp import fully_shard

    reference, patched, _ = patched_pair("mixtral")
    for layer in patched.model.layers:
        fully_shard(layer)
    fully_shard(patched)
    assert type(patched.model.layers[0].mlp.experts.fc1_weight).__name__ == "DTensor"
    state = patched.state_dict()
    assert list(state) == list(reference.state_dict())
    for key, value in reference.state_dict().items():
        assert torch.equal(state[key].full_tensor(), value), key
    ids = torch.randint(0, 64, TOKENS)
    logits, _ = run_step(patched, patched.get_input_embeddings(), ids)
    ref_logits, _ = run_step(reference, reference.get_input_embeddings(), ids)
    assert rel_err(logits, ref_logits) < PARITY
    for mine, host in zip(patched.model.layers, reference.model.layers, strict=True):
        mine, host = mine.mlp, host.mlp  # FSDP2 modules are not deep-copied: no host_grads
        for ours, theirs in ((mine.experts.fc1_weight, host.experts.gate_up_proj),
                             (mine.experts.fc2_weight, host.experts.down_proj),
                             (mine.gate.weight, host.gate.weight)):  # fmt: skip
            assert rel_err(ours.grad.full_tensor(), theirs.grad) < PARITY
    # torch.distributed.checkpoint's full state dicts (Lightning's and torchtitan's checkpoints)
    other, full = moe_model("mixtral", seed=1), dcp.StateDictOptions(full_state_dict=True)
    dcp.set_model_state_dict(patched, other.state_dict(), options=full)
    assert_state_equal(dcp.get_model_state_dict(patched, options=full), other.state_dict())


def test_gpt_oss_swiglu_oai_is_left_with_the_reason():
    config = transformers.GptOssConfig(**BASE, intermediate_size=24, num_local_experts=4,
                                       head_dim=8, sliding_window=8)  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = swiglu_train.patch(model)
    assert report.replaced == []
    reasons = {e.name: e.reason for e in report.left}
    assert reasons["model.layers.1.mlp.experts"] == (
        "its gate (GptOssExperts._apply_gate) is not silu(gate) * up on [gate; up] halves: "
        "another activation (gpt-oss's clamped swiglu_oai is one); it also has expert biases "
        "and a transposed [E, D, 2F] gate_up_proj"
    )
    assert "left 2 x GptOssExperts: its gate" in str(report)
    assert_state_equal(model.state_dict(), before)


def test_experts_that_are_not_transformers_swiglu_experts_are_left():
    from transformers.models.llama4.modeling_llama4 import Llama4TextExperts
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    def experts(**config):
        config = dict(BASE, intermediate_size=8, num_local_experts=2, **config)
        return MixtralExperts(transformers.MixtralConfig(**config))

    hooked, custom, double = experts(), experts(), experts().double()
    hooked.register_forward_pre_hook(lambda *args: None)
    custom.config._experts_implementation = "my_kernel"
    llama4 = Llama4TextExperts(transformers.Llama4TextConfig(**BASE, intermediate_size=8,
                                                             num_local_experts=2))  # fmt: skip
    model = torch.nn.ModuleList([experts(hidden_act="gelu"), hooked, custom, double, llama4])
    report = swiglu_train.patch(model)
    assert report.replaced == []
    reasons = [e.reason for e in report.left]
    assert "its activation GELUActivation is not SiLU" in reasons[0]
    assert "forward pre hooks, which a replacement would drop" in reasons[1]
    assert "experts implementation 'my_kernel' is not one of transformers' own" in reasons[2]
    assert "gate_up_proj is torch.float64; the impls support" in reasons[3]
    assert reasons[4].startswith(
        "its forward (Llama4TextExperts.forward) is not transformers' routed-experts forward"
    )
