"""Hugging Face transformers: LlamaMLP and the ~90 classes of its structure (Mistral, Qwen2,
Qwen3, ...), Llama4TextMLP, and Phi3MLP (GlmMLP) with its fused ``gate_up_proj``.

The reference forwards below are transformers' own source (5.x), kept verbatim because a
module is recognized by compiling to the same instructions (``spec.same_code``).
"""

from __future__ import annotations

from swiglu_train.integrations.patch.spec import HostSpec


def _llama_forward(self, x):  # LlamaMLP, MistralMLP, Qwen2MLP, Qwen3MLP, ...
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return down_proj


def _llama_forward_return(self, hidden_state):  # the same MLP written as one return
    return self.down_proj(self.act_fn(self.gate_proj(hidden_state)) * self.up_proj(hidden_state))


def _llama4_forward(self, x):  # Llama4TextMLP: the same MLP, its activation named otherwise
    down_proj = self.activation_fn(self.gate_proj(x)) * self.up_proj(x)
    return self.down_proj(down_proj)


def _phi3_forward(self, hidden_states):  # Phi3MLP, GlmMLP: one [gate; up] linear
    up_states = self.gate_up_proj(hidden_states)

    gate, up_states = up_states.chunk(2, dim=-1)
    up_states = up_states * self.activation_fn(gate)

    return self.down_proj(up_states)


SPLIT = HostSpec(
    library="transformers",
    gate="gate_proj",
    up="up_proj",
    down="down_proj",
    act="act_fn",
    order=("gate_proj", "up_proj", "down_proj", "act_fn"),
    forwards=(_llama_forward, _llama_forward_return),
)
SPLIT_LLAMA4 = HostSpec(
    library="transformers",
    gate="gate_proj",
    up="up_proj",
    down="down_proj",
    act="activation_fn",
    order=("gate_proj", "up_proj", "down_proj", "activation_fn"),
    forwards=(_llama4_forward,),
)
FUSED = HostSpec(
    library="transformers",
    fused="gate_up_proj",
    down="down_proj",
    act="activation_fn",
    order=("gate_up_proj", "down_proj", "activation_fn"),
    forwards=(_phi3_forward,),
)
SPECS = (SPLIT, SPLIT_LLAMA4, FUSED)
