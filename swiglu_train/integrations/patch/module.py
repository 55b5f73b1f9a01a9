"""PatchedSwiGLU: a host library's SwiGLU MLP recomputed by a ParMLP impl, its checkpoints kept.

The module owns one fused fc1 ([gate; up], packed under a packed impl) built once at patch
time, so no step concatenates weights. Its state_dict presents the host's own keys and values
(``gate_proj``/``up_proj``/``down_proj``, ``gate_up_proj``, ``fc_1``/``fc_2``/``proj``,
``w1``/``w3``/``w2``): fc1 is unpacked and split on save, and joined and packed on load, as
torchtitan does for a fused w13. A checkpoint written by the patched model therefore loads
into the unpatched one (``from_pretrained``, LitGPT's loaders) and vice versa.
"""

from __future__ import annotations

import torch
from torch import nn

from swiglu_train.integrations.patch.spec import HostSpec
from swiglu_train.layers import ParMLP
from swiglu_train.layers.layout import CANONICAL, DTensor, distribute_tensor, order, permute_rows
from swiglu_train.layers.par_mlp import STAMP_KEY

KINDS = ("weight", "bias")


class PatchedSwiGLU(ParMLP):
    """A ParMLP standing in for ``host_class`` of ``spec.library``, with that class's keys.

    Build it with :meth:`build` and :meth:`fill_from`; ``swiglu_train.patch`` does so for a
    whole model.
    """

    def __init__(
        self,
        spec: HostSpec,
        host_class: str,
        hidden_size: int,
        ffn_hidden_size: int,
        output_size: int,
        bias: bool,
        **options,
    ) -> None:
        super().__init__(hidden_size, ffn_hidden_size, output_size, bias=bias, **options)
        self.spec = spec
        self.host_class = host_class
        # after ParMLP's own hooks: this one drops its layout stamp, that one finds no fc1 key
        self._register_state_dict_hook(_to_host_keys)
        self.register_load_state_dict_pre_hook(_from_host_keys)

    @classmethod
    def build(cls, host: nn.Module, spec: HostSpec, **options) -> PatchedSwiGLU:
        """The replacement for ``host`` (already checked by ``spec.mismatch``), on ``meta``:
        its options are checked and ``impl="auto"`` resolved, but no memory is touched until
        :meth:`fill_from`. ``options`` are ParMLP's (impl, inplace, chunk, tokens_hint); on
        ``meta``, auto resolves for the current CUDA device, as for a model built on the CPU
        before being moved.
        """
        parts, down = spec.fc1_linears(host), getattr(host, spec.down)
        weight = parts[0].weight
        return cls(
            spec,
            type(host).__qualname__,
            weight.shape[1],
            down.in_features,
            down.out_features,
            down.bias is not None,
            device="meta",
            dtype=weight.dtype,
            **options,
        )

    def fill_from(self, host: nn.Module) -> PatchedSwiGLU:
        """Take ``host``'s weights (copied: fc1 is one tensor, in this impl's layout), device,
        requires_grad and training mode; returns self."""
        parts, down = self.spec.fc1_linears(host), getattr(host, self.spec.down)
        self.to_empty(device=parts[0].weight.device)
        with torch.no_grad():
            for kind in KINDS:
                target = getattr(self.fc1, kind)
                if target is None:
                    continue
                rows = torch.cat([getattr(p, kind).detach() for p in parts])
                index = order(target.shape[0], CANONICAL, self.fc1_layout)
                target.copy_(rows if index is None else rows[index.to(rows.device)])
                target.requires_grad_(getattr(parts[0], kind).requires_grad)
                source = getattr(down, kind)
                getattr(self.fc2, kind).copy_(source).requires_grad_(source.requires_grad)
        self.train(host.training)
        return self

    def extra_repr(self) -> str:
        return f"patched {self.spec.library} {self.host_class}, {super().extra_repr()}"


def _to_host_keys(module: PatchedSwiGLU, state_dict: dict, prefix: str, local_metadata) -> None:
    """fc1/fc2 entries -> the host's keys, in the host's order, canonical rows split back."""
    spec = module.spec
    state_dict.pop(prefix + STAMP_KEY, None)  # the host has no layout: its rows are canonical
    fc1 = {kind: state_dict.pop(f"{prefix}fc1.{kind}", None) for kind in KINDS}
    fc2 = {kind: state_dict.pop(f"{prefix}fc2.{kind}", None) for kind in KINDS}
    values: dict[str, torch.Tensor] = {}
    for kind in KINDS:
        if fc1[kind] is not None:
            rows = fc1[kind]
            index = order(rows.shape[0], module.fc1_layout, CANONICAL)
            rows = rows if index is None else permute_rows(rows, index)
            if spec.fused is not None:
                values[f"{spec.fused}.{kind}"] = rows
            else:
                half = rows.shape[0] // 2
                values[f"{spec.gate}.{kind}"] = _row_slice(rows, 0, half)
                values[f"{spec.up}.{kind}"] = _row_slice(rows, half, 2 * half)
        if fc2[kind] is not None:
            values[f"{spec.down}.{kind}"] = fc2[kind]
    for name in spec.order:
        for kind in KINDS:
            if f"{name}.{kind}" in values:
                state_dict[f"{prefix}{name}.{kind}"] = values[f"{name}.{kind}"]


def _from_host_keys(
    module: PatchedSwiGLU,
    state_dict: dict,
    prefix: str,
    local_metadata,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """The host's keys -> fc1 (joined, then moved to this module's layout) and fc2."""
    spec = module.spec
    names = [spec.fused] if spec.fused is not None else [spec.gate, spec.up]
    for kind in KINDS:
        target = getattr(module.fc1, kind)
        keys = [f"{prefix}{n}.{kind}" for n in names]
        given = [k for k in keys if k in state_dict]
        if target is None or not given:  # no bias here: a given one stays unexpected
            continue
        if len(given) < len(keys):
            missing = [k for k in keys if k not in given]
            error_msgs.append(f"{given[0]} is given without {missing[0]}: fc1 needs both")
            continue
        parts = [state_dict.pop(k) for k in keys]
        want = (target.shape[0] // len(parts), *target.shape[1:])
        bad = [(k, p) for k, p in zip(keys, parts, strict=True) if tuple(p.shape) != want]
        if bad:
            key, part = bad[0]
            error_msgs.append(
                f"size mismatch for {key}: copying a param with shape {tuple(part.shape)} "
                f"from checkpoint, the shape in current model is {torch.Size(want)}."
            )
            continue
        rows = _cat_rows(parts)
        index = order(rows.shape[0], CANONICAL, module.fc1_layout)
        state_dict[f"{prefix}fc1.{kind}"] = rows if index is None else permute_rows(rows, index)
    for kind in KINDS:
        key = f"{prefix}{spec.down}.{kind}"
        if key in state_dict and getattr(module.fc2, kind) is not None:
            state_dict[f"{prefix}fc2.{kind}"] = state_dict.pop(key)


def _row_slice(t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of ``t``: a view, or for a DTensor (FSDP2) sharded like ``t``."""
    if not _is_dtensor(t):
        return t[start:stop]
    rows = t.full_tensor()[start:stop]
    return distribute_tensor(rows, t.device_mesh, t.placements, src_data_rank=None)


def _cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts stacked along rows; DTensors (FSDP2) come back sharded like the first."""
    if len(parts) == 1:
        return parts[0]
    full = torch.cat([p.full_tensor() if _is_dtensor(p) else p for p in parts])
    first = parts[0]
    if not _is_dtensor(first):
        return full
    return distribute_tensor(full, first.device_mesh, first.placements, src_data_rank=None)


def _is_dtensor(t: torch.Tensor) -> bool:
    return DTensor is not None and isinstance(t, DTensor)
