"""torchtitan: ``FeedForward`` (``w1`` gate, ``w3`` up, ``w2`` down; SiLU in forward).

Registered as w1, w2, w3, so its state_dict keys come in that order. SigmoidGatedFeedForward
(an extra ``gate``) does not fit the layout and is left. The reference forward is
torchtitan's own source (0.3.x), verbatim (see ``spec.same_code``).
"""

from __future__ import annotations

import torch.nn.functional as F

from swiglu_train.integrations.patch.spec import HostSpec


def _feed_forward(self, x):
    return self.w2(F.silu(self.w1(x)) * self.w3(x))


SPEC = HostSpec(
    library="torchtitan",
    gate="w1",
    up="w3",
    down="w2",
    order=("w1", "w2", "w3"),
    forwards=(_feed_forward,),
)
SPECS = (SPEC,)
