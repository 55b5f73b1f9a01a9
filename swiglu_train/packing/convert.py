"""Switch a live model between layouts, and convert checkpoints between them.

A checkpoint is a bare state_dict, or a Lightning-style dict (``state_dict`` plus
``optimizer_states``). ParMLP fc1 entries are found by their stamp (packed) or, in canonical
state, by structure: ``<prefix>fc1.weight`` [2F, D] beside ``<prefix>fc2.weight`` [O, F].
Optimizer state is mapped through the parameter names the checkpoint records; without them
the mapping would be a guess, so it is refused.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from swiglu_train.layers import ParMLP
from swiglu_train.layers.layout import CANONICAL, Layout, order
from swiglu_train.layers.par_mlp import STAMP_KEY
from swiglu_train.packing.optimizer import permute_live_state, permute_state

CKPT_KEY = "swiglu_train"  # where Lightning checkpoints record layout and optimizer names


def switch_impl(
    model: nn.Module, impl: str, optimizer: torch.optim.Optimizer | None = None
) -> list[str]:
    """Switch every ParMLP to ``impl``, repacking fc1 and its optimizer state together.

    Returns the names of the ParMLPs whose layout changed.
    """
    changed = []
    for name, mlp in model.named_modules():
        if not isinstance(mlp, ParMLP):
            continue
        index = mlp.set_impl(impl)
        if index is None:
            continue
        changed.append(name)
        if optimizer is not None:
            for p in (mlp.fc1.weight, mlp.fc1.bias):
                if p is not None:
                    permute_live_state(optimizer, p, index, f"{name}.fc1")
    return changed


@dataclass
class Converted:
    """One fc1 moved by :func:`convert_checkpoint`, for the report table."""

    prefix: str
    source: str
    target: str
    optimizer_states: int


def convert_checkpoint(
    ckpt: dict,
    to: str,
    chunk: int | None = None,
    assume_layout: Layout | None = None,
    report: list[Converted] | None = None,
) -> dict:
    """A converted copy of ``ckpt`` with every ParMLP fc1 (and its optimizer state) in ``to``.

    ``to`` is "packed" (with ``chunk``) or "canonical". Unstamped fc1 weights are read as
    ``assume_layout`` (canonical by default: the ecosystem's layout).
    """
    if to not in ("packed", "canonical"):
        raise ValueError(f"to must be 'packed' or 'canonical', got {to!r}")
    lightning = "state_dict" in ckpt
    out = copy.deepcopy(ckpt)
    state = out["state_dict"] if lightning else out
    names = out.get(CKPT_KEY, {}).get("optimizer_param_names")
    if lightning and out.get("optimizer_states") and names is None:
        raise ValueError(
            "checkpoint has optimizer_states but no recorded parameter names "
            f"({CKPT_KEY}.optimizer_param_names); mapping them would be a guess"
        )
    report = report if report is not None else []
    target = CANONICAL
    for prefix in _mlp_prefixes(state):
        stamp = state.pop(prefix + STAMP_KEY, None)
        source = Layout.from_dict(stamp["fc1_layout"]) if stamp else assume_layout or CANONICAL
        rows = state[prefix + "fc1.weight"].shape[0]
        target = CANONICAL if to == "canonical" else Layout("packed", chunk or 128, source.tp)
        index = order(rows, source, target)
        moved_states = 0
        if index is not None:
            for key in ("fc1.weight", "fc1.bias"):
                if prefix + key in state:
                    state[prefix + key] = state[prefix + key].index_select(0, index)
                    moved_states += _move_optimizer_state(out, names, prefix + key, index)
        if target.packed:
            state[prefix + STAMP_KEY] = {"fc1_layout": target.to_dict()}
        report.append(Converted(prefix, str(source), str(target), moved_states))
    if not report:
        raise ValueError(
            "no ParMLP fc1 weights found (expected '<prefix>fc1.weight' beside "
            "'<prefix>fc2.weight' with matching sizes)"
        )
    if lightning and CKPT_KEY in out:
        out[CKPT_KEY]["fc1_layout"] = target.to_dict()
    return out


def _mlp_prefixes(state: dict) -> list[str]:
    prefixes = []
    for key, value in state.items():
        if not key.endswith("fc1.weight"):
            continue
        prefix = key[: -len("fc1.weight")]
        fc2 = state.get(prefix + "fc2.weight")
        if fc2 is not None and value.dim() == 2 and value.shape[0] == 2 * fc2.shape[1]:
            prefixes.append(prefix)
    return prefixes


def _move_optimizer_state(ckpt: dict, names: list[list[str]] | None, key: str, index) -> int:
    """Permute the state of parameter ``key`` in every optimizer; returns how many moved.

    Optimizer state_dicts key state by integer ids listed per param group; the recorded names
    per group pair with those ids one to one.
    """
    moved = 0
    for opt in ckpt.get("optimizer_states", []) if names else []:
        if len(names) != len(opt["param_groups"]):
            raise ValueError("recorded optimizer parameter names do not match its param groups")
        for group_names, group in zip(names, opt["param_groups"], strict=True):
            if len(group_names) != len(group["params"]):
                raise ValueError("recorded optimizer parameter names do not match a group")
            for name, param_id in zip(group_names, group["params"], strict=True):
                if name == key and param_id in opt["state"]:
                    shape = ckpt["state_dict"][key].shape
                    opt["state"][param_id] = permute_state(
                        opt["state"][param_id], shape, index, key
                    )
                    moved += 1
    return moved


HF_NAMES = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")


def to_hf(state: dict, report: list[Converted] | None = None) -> dict:
    """A bare state_dict with every ParMLP as HF Llama's gate_proj / up_proj / down_proj."""
    out = convert_checkpoint(state, to="canonical", report=report)
    for prefix in _mlp_prefixes(out):
        if prefix + "fc1.bias" in out or prefix + "fc2.bias" in out:
            raise ValueError(f"{prefix}: HF's gated MLP has no biases; this ParMLP has them")
        gate, up = out.pop(prefix + "fc1.weight").chunk(2)
        down = out.pop(prefix + "fc2.weight")
        for name, value in zip(HF_NAMES, (gate, up, down), strict=True):
            out[prefix + name] = value.contiguous()
    return out


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
        out[prefix + "fc1.weight"] = torch.cat([gate, up])
        out[prefix + "fc2.weight"] = down
        if report is not None:
            report.append(Converted(prefix, "hf", "canonical", 0))
    return out
