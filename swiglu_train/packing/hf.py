"""Convert checkpoints to and from HF Llama's gated MLP: gate_proj, up_proj and down_proj.

Canonical ParMLP fc1 is [gate_proj; up_proj] and fc2 is down_proj; a packed fc1 is unpacked
first, in the layout its checkpoint records.
"""

from __future__ import annotations

import torch

from swiglu_train.layers.layout import Layout
from swiglu_train.packing.checkpoint_read import CKPT_KEY, mlp_prefixes
from swiglu_train.packing.convert import Converted, convert_checkpoint

HF_NAMES = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")


def to_hf(
    ckpt: dict, report: list[Converted] | None = None, assume_layout: Layout | None = None
) -> dict:
    """A bare state_dict with every ParMLP as HF Llama's gate_proj / up_proj / down_proj.

    ``ckpt`` may be a Lightning checkpoint: its weights are read in the layout it records.
    Its optimizer state is left behind, as an HF state_dict has no place for it.
    """
    lightning = "state_dict" in ckpt
    if lightning:
        ckpt = {"state_dict": ckpt["state_dict"], CKPT_KEY: ckpt.get(CKPT_KEY, {})}
    moved: list[Converted] = []
    out = convert_checkpoint(ckpt, to="canonical", assume_layout=assume_layout, report=moved)
    if lightning:
        out = out["state_dict"]
    if report is not None:
        report.extend(Converted(r.prefix, r.source, "hf", 0) for r in moved)
    for prefix in mlp_prefixes(out):
        if prefix + "fc1.bias" in out or prefix + "fc2.bias" in out:
            raise ValueError(f"{prefix}: HF's gated MLP has no biases; this ParMLP has them")
        gate, up = out.pop(prefix + "fc1.weight").chunk(2)
        down = out.pop(prefix + "fc2.weight")
        for name, value in zip(HF_NAMES, (gate, up, down), strict=True):
            out[prefix + name] = value.contiguous()
    return out


def _check_hf_shapes(prefix: str, gate, up, down) -> None:
    """gate_proj and up_proj [F, D], down_proj [O, F]: anything else would load into a ParMLP
    of another size with its gate and up rows mixed, without an error."""
    tensors = {"gate_proj": gate, "up_proj": up, "down_proj": down}
    odd = {n: type(t).__name__ for n, t in tensors.items() if not isinstance(t, torch.Tensor)}
    if odd:
        raise ValueError(f"{prefix}: HF weights must be tensors; got {odd}")
    shapes = {n: tuple(t.shape) for n, t in tensors.items()}
    two_d = gate.dim() == 2 and down.dim() == 2
    if not two_d or up.shape != gate.shape or down.shape[1] != gate.shape[0]:
        raise ValueError(f"{prefix}: expected gate_proj and up_proj [F, D] and down_proj [O, F]"
                         f" with one F; got {shapes}")  # fmt: skip


def from_hf(state: dict, report: list[Converted] | None = None) -> dict:
    """The inverse of :func:`to_hf`: canonical ParMLP fc1 = [gate_proj; up_proj]."""
    out = dict(state)
    prefixes = [k[: -len(HF_NAMES[0])] for k in state if k.endswith(HF_NAMES[0])]
    if not prefixes:
        raise ValueError("no HF gated MLPs found (expected '<prefix>gate_proj.weight')")
    for prefix in prefixes:
        missing = [n for n in HF_NAMES if prefix + n not in out]
        if missing:
            raise ValueError(f"{prefix}: HF gated MLP lacks {missing}")
        gate, up, down = (out.pop(prefix + n) for n in HF_NAMES)
        _check_hf_shapes(prefix, gate, up, down)
        biases = [prefix + n.replace("weight", "bias") for n in HF_NAMES]
        if any(b in out for b in biases):  # mlp_bias=True: ParMLP's fc1 bias has no HF twin here
            raise ValueError(f"{prefix}: HF MLP biases ({', '.join(b for b in biases if b in out)})"
                             " are not converted; only bias-free gated MLPs are")  # fmt: skip
        taken = [prefix + k for k in ("fc1.weight", "fc2.weight") if prefix + k in out]
        if taken:
            raise ValueError(f"{prefix}: the state already holds {taken}; not overwriting them")
        out[prefix + "fc1.weight"] = torch.cat([gate, up])
        out[prefix + "fc2.weight"] = down
        if report is not None:
            report.append(Converted(prefix, "hf", "canonical", 0))
    return out
