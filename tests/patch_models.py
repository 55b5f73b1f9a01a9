"""Tiny real host-library models for the patch tests, and the comparisons they share."""

from __future__ import annotations

import copy

import torch
from helpers import rel_err

SMALL = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
CHUNK = 16  # save_factors packs fc1 in 4 chunks of 16 rows per half: a real permutation
TOKENS = (2, 8)  # batch, sequence
# fp32 parity, norm-relative: the fused fc1 sums in another order than two GEMMs (seen: logits
# 1e-7, grads 5e-7); a slip of one fc1 row pair or one weight off by 1 % is 1e-5 or more
PARITY = 2e-6


def hf_config(family: str):
    """A 2-layer config of a transformers family, D=32 and F=64 (Llama with MLP biases)."""
    import transformers

    configs = {
        "llama": lambda: transformers.LlamaConfig(**SMALL, mlp_bias=True),
        "mistral": lambda: transformers.MistralConfig(**SMALL),
        "qwen2": lambda: transformers.Qwen2Config(**SMALL),
        "qwen3": lambda: transformers.Qwen3Config(**SMALL, head_dim=8),
        "phi3": lambda: transformers.Phi3Config(**SMALL, pad_token_id=0),
    }
    return configs[family]()


def hf_model(family: str, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family))
    return model.train()


def litgpt_model(mlp_class_name: str = "LLaMAMLP", bias: bool = False, **extra):
    from litgpt import GPT, Config

    config = Config(
        block_size=32,
        vocab_size=64,
        padded_vocab_size=64,
        n_layer=2,
        n_head=4,
        n_query_groups=2,
        n_embd=32,
        intermediate_size=64,
        bias=bias,
        norm_class_name="RMSNorm",
        mlp_class_name=mlp_class_name,
        **extra,
    )
    torch.manual_seed(0)
    return GPT(config).train()


def host_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's grad under the host library's state_dict key: a copy of the model
    whose parameters hold the grads, read through state_dict (a patched model's hooks split
    and unpack fc1's grad exactly as they do its weight)."""
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            q.copy_(p.grad)
    return twin.state_dict()


def assert_step_matches(patched, reference, tol: float = PARITY) -> None:
    """One step of each on the same tokens: logits, the input embeddings' grad and every
    parameter's grad under the host's names (the router's too) within ``tol``."""
    ids = torch.randint(0, 64, TOKENS)
    logits, embed_grad = run_step(patched, patched.get_input_embeddings(), ids)
    ref_logits, ref_embed_grad = run_step(reference, reference.get_input_embeddings(), ids)
    assert rel_err(logits, ref_logits) < tol
    assert rel_err(embed_grad, ref_embed_grad) < tol
    assert_close_all(host_grads(patched), host_grads(reference), tol)  # router's too


def assert_loads_both_ways(patched, reference, other) -> None:
    """``other``'s state (other weights, so a load that did nothing shows) loads into the
    patched model and the patched model's into the unpatched ``reference``; the patched model
    then computes ``other``'s logits."""
    patched.load_state_dict(other.state_dict())
    assert_state_equal(patched.state_dict(), other.state_dict())
    reference.load_state_dict(patched.state_dict())
    assert_state_equal(reference.state_dict(), other.state_dict())
    ids = torch.randint(0, 64, TOKENS)
    patched.eval(), other.eval()
    with torch.no_grad():
        assert rel_err(patched(ids).logits, other(ids).logits) < PARITY


def assert_state_equal(actual: dict, expected: dict) -> None:
    """Same keys in the same order, and bitwise the same values."""
    assert list(actual) == list(expected)
    for key, value in expected.items():
        assert actual[key].shape == value.shape, key
        assert torch.equal(actual[key], value), key


def assert_close_all(actual: dict, expected: dict, tol: float = PARITY) -> None:
    assert list(actual) == list(expected)
    for key, value in expected.items():
        assert rel_err(actual[key], value) < tol, key


def run_step(model: torch.nn.Module, embed: torch.nn.Module, ids: torch.Tensor, seed: int = 1):
    """(logits, grad of the input embeddings) of one backward of a fixed random projection of
    the logits; parameter grads are left on the model."""
    captured = []

    def keep(module, args, out):
        out.retain_grad()
        captured.append(out)

    handle = embed.register_forward_hook(keep)
    try:
        out = model(ids)
    finally:
        handle.remove()
    logits = getattr(out, "logits", out)
    weight = torch.randn(logits.shape, generator=torch.Generator().manual_seed(seed))
    (logits * weight.to(logits.dtype)).sum().backward()
    return logits.detach(), captured[0].grad
