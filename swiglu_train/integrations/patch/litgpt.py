"""LitGPT: ``LLaMAMLP`` (``fc_1`` gate, ``fc_2`` up, ``proj`` down; SiLU in forward).

Its subclass GemmaMLP keeps the layout but computes GELU: the forward comparison leaves it.
The reference forward is LitGPT's own source (0.5.x), verbatim (see ``spec.same_code``).
"""

from __future__ import annotations

import torch.nn.functional as F

from swiglu_train.integrations.patch.spec import HostSpec


def _llama_mlp_forward(self, x):
    x_fc_1 = self.fc_1(x)
    x_fc_2 = self.fc_2(x)
    x = F.silu(x_fc_1) * x_fc_2
    return self.proj(x)


SPEC = HostSpec(
    library="litgpt",
    gate="fc_1",
    up="fc_2",
    down="proj",
    order=("fc_1", "fc_2", "proj"),
    forwards=(_llama_mlp_forward,),
)
SPECS = (SPEC,)
