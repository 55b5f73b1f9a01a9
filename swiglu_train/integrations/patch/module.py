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

    def host_tensor(self, name: str, kind: str) -> torch.Tensor | None:
        """The host's ``{name}.{kind}`` (``gate_proj.weight``, ...) as its state_dict holds it:
        fc1's canonical rows split back (a view where fc1 is canonical, a copy where packed),
        or fc2's; None for a bias the layer does not have."""
        spec = self.spec
        if name == spec.down:
            p = getattr(self.fc2, kind)
            return None if p is None else p.detach()
        p = getattr(self.fc1, kind)
        if p is None:
            return None
        rows = p.detach()
        index = order(rows.shape[0], self.fc1_layout, CANONICAL)  # canonical = rows[index]
        half = rows.shape[0] // 2
        start, stop = (0, 2 * half) if name == spec.fused else (0, half)
        if name == spec.up:
            start, stop = half, 2 * half
        if index is None:
            return rows if (start, stop) == (0, rows.shape[0]) else _row_slice(rows, start, stop)
        return permute_rows(rows, index[start:stop])

    def __getattr__(self, name: str):
        """``mlp.gate_proj`` (any host linear's name) reads as the host's linear did, for code
        that reads weights by module path, torch.distributed.checkpoint's among them."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            spec = self.__dict__.get("spec")
            if spec is None or name not in spec.linears:
                raise
            return HostLinearView(self, name)

    def extra_repr(self) -> str:
        return f"patched {self.spec.library} {self.host_class}, {super().extra_repr()}"


class HostLinearView:
    """What ``mlp.gate_proj`` reads as on a patched MLP: the host linear's ``weight`` and
    ``bias`` as its state_dict presents them. Read-only: a packed fc1's rows are copies, so a
    write would not reach the model; write through ``load_state_dict`` instead."""

    def __init__(self, mlp: PatchedSwiGLU, name: str) -> None:
        self._mlp, self._name = mlp, name

    @property
    def weight(self) -> torch.Tensor:
        return self._mlp.host_tensor(self._name, "weight")

    @property
    def bias(self) -> torch.Tensor | None:
        return self._mlp.host_tensor(self._name, "bias")

    def __repr__(self) -> str:
        return f"HostLinearView({self._mlp.host_class}.{self._name}, read-only)"


def _to_host_keys(module: PatchedSwiGLU, state_dict: dict, prefix: str, local_metadata) -> None:
    """fc1/fc2 entries -> the host's keys, in the host's order, canonical rows split back."""
    state_dict.pop(prefix + STAMP_KEY, None)  # the host has no layout: its rows are canonical
    for key in [f"{prefix}{part}.{kind}" for part in ("fc1", "fc2") for kind in KINDS]:
        state_dict.pop(key, None)
    for name in module.spec.linears:
        for kind in KINDS:
            value = module.host_tensor(name, kind)
            if value is not None:
                state_dict[f"{prefix}{name}.{kind}"] = value


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
        rows = rows if index is None else permute_rows(rows, index)
        state_dict[f"{prefix}fc1.{kind}"] = _like(rows, target)
    for kind in KINDS:
        key, target = f"{prefix}{spec.down}.{kind}", getattr(module.fc2, kind)
        if key in state_dict and target is not None:
            state_dict[f"{prefix}fc2.{kind}"] = _like(state_dict.pop(key), target)


def _row_slice(t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of ``t``: a view, or for a DTensor (FSDP2) sharded like ``t``."""
    if not _is_dtensor(t):
        return t[start:stop]
    rows = t.full_tensor()[start:stop]
    return distribute_tensor(rows, t.device_mesh, t.placements, src_data_rank=None)


def _cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts stacked along rows; DTensors (FSDP2) come back sharded like the first.

    Copied part by part rather than by ``torch.cat``: a lazily loaded checkpoint's tensors
    (Lightning's ``lazy_load``, which LitGPT uses) take ops of one tensor, not of a list."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if _is_dtensor(first):
        full = torch.cat([p.full_tensor() if _is_dtensor(p) else p for p in parts])
        return distribute_tensor(full, first.device_mesh, first.placements, src_data_rank=None)
    rows = sum(p.shape[0] for p in parts)
    out = torch.empty((rows, *first.shape[1:]), dtype=first.dtype, device=first.device)
    start = 0
    for p in parts:
        out[start : start + p.shape[0]].copy_(p)
        start += p.shape[0]
    return out


def _like(value: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A full ``value`` sharded like a DTensor ``target`` (a full state_dict loaded into FSDP2,
    as torch.distributed.checkpoint does for the keys it knows: it does not know the host's)."""
    if _is_dtensor(target) and not _is_dtensor(value):
        return distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None)
    return value


def _is_dtensor(t: torch.Tensor) -> bool:
    return DTensor is not None and isinstance(t, DTensor)
