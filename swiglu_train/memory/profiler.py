"""Per-step activation memory: what autograd saves, per layer, and what the CUDA allocator sees.

A step is bracketed by three calls any training loop can make: :meth:`MemoryProfiler.begin`
before forward, :meth:`~MemoryProfiler.forward_done` between forward and backward, and
:meth:`~MemoryProfiler.backward_done` after backward. Saved-for-backward bytes come from
``saved_tensors_hooks`` and are exact on every device; allocator figures exist on CUDA only.
Hooks already active around a step (activation offloading, another profiler) keep working:
the profiler counts each tensor, then hands it to them.

Allocator figures are deltas over what was allocated when the step began (parameters,
optimizer state, inputs). If the loop frees the previous step's gradients between forward and
backward, as Lightning does (``zero_grad`` runs after ``training_step``), those freed bytes are
added back, so ``after_forward_MiB`` is what the forward pass itself holds.
``torch.cuda.reset_peak_memory_stats`` is called at each step start and at forward end.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from swiglu_train.layers import MLP_IMPLS, ParMLP
from swiglu_train.layers.experts import ParExperts
from swiglu_train.layers.registry import impl_label
from swiglu_train.memory.saved import storages

MiB = 2**20
# Why a table shows "—" for after-forward and peak MiB: only the CUDA allocator reports them.
NOT_MEASURED = (
    "— : after-forward and peak MiB are CUDA allocator stats, not measured on CPU; "
    "saved-for-backward bytes are exact on any device."
)


@dataclass
class LayerMemory:
    """One layer (transformer block, or a bare ParMLP) of the depth curve."""

    index: int
    name: str
    saved_bytes: int = 0
    mlp_saved_bytes: int | None = None
    cumulative_saved_bytes: int = 0
    allocated_MiB: float | None = None  # allocated after this layer's forward, above step start


@dataclass
class StepMemory:
    step: int
    saved_bytes: int
    layers: list[LayerMemory] = field(default_factory=list)
    impl_saved_bytes: dict[str, int] = field(default_factory=dict)  # by mlp_label
    after_forward_MiB: float | None = None
    forward_peak_MiB: float | None = None
    backward_peak_MiB: float | None = None
    allocated_MiB: float | None = None  # absolute, at step start
    # Tensors packed for backward, parameters included: 0 means the step's backward ran through
    # a graph an earlier step built (retain_graph), so it has no forward of its own.
    saved_tensors: int = 0

    @property
    def peak_MiB(self) -> float | None:
        peaks = [p for p in (self.forward_peak_MiB, self.backward_peak_MiB) if p is not None]
        return max(peaks) if peaks else None

    def metrics(self, prefix: str = "memory") -> dict[str, float]:
        """Flat ``memory/...`` keys for loggers; CUDA-only figures are left out off CUDA."""
        out = {f"{prefix}/saved_MiB": self.saved_bytes / MiB}
        for key in ("after_forward", "forward_peak", "backward_peak", "peak", "allocated"):
            value = getattr(self, f"{key}_MiB")
            if value is not None:
                out[f"{prefix}/{key}_MiB"] = value
        for layer in self.layers:
            base = f"{prefix}/layer/{layer.index}"
            out[f"{base}/saved_MiB"] = layer.saved_bytes / MiB
            out[f"{base}/cumulative_saved_MiB"] = layer.cumulative_saved_bytes / MiB
            if layer.mlp_saved_bytes is not None:
                out[f"{base}/mlp_saved_MiB"] = layer.mlp_saved_bytes / MiB
            if layer.allocated_MiB is not None:
                out[f"{base}/allocated_MiB"] = layer.allocated_MiB
        for impl, nbytes in self.impl_saved_bytes.items():
            out[f"{prefix}/impl/{impl}/saved_MiB"] = nbytes / MiB
        return out


def is_swiglu_mlp(module: nn.Module) -> bool:
    """A ParMLP or ParExperts, or a framework adapter running one of their impls (it exposes
    ``impl``)."""
    return isinstance(module, ParMLP | ParExperts) or getattr(module, "impl", None) in MLP_IMPLS


def mlp_label(module: nn.Module) -> str:
    """The MLP's impl as runs are compared by: ``drop_h+fp8`` when it saves its preactivation in
    FP8 (ParMLP and the Megatron adapter both say so in ``saved_fp8``), else the impl's name;
    routed experts (ParExperts, or an adapter saying ``ROUTED_EXPERTS``) as ``experts/`` and
    theirs, so a MoE model's two kinds stay apart."""
    label = impl_label(module.impl, getattr(module, "saved_fp8", False))
    routed = isinstance(module, ParExperts) or getattr(module, "ROUTED_EXPERTS", False)
    return f"experts/{label}" if routed else label


def find_layers(
    model: nn.Module,
) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, nn.Module]]]:
    """(layers, mlps): the children of the model's outermost ModuleLists (its transformer
    blocks), or its MLPs when it has no blocks; and every ParMLP-like MLP.

    A ModuleList inside a block (MoE experts, attention heads) holds parts of that block, not
    layers: counting them would add bogus points past the last block of the depth curve.
    """
    mlps = [(n, m) for n, m in model.named_modules() if is_swiglu_mlp(m)]
    blocks: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        inside_block = any(name.startswith(f"{block}.") for block, _ in blocks)
        if not isinstance(module, nn.ModuleList) or inside_block:
            continue
        for child_name, child in module.named_children():
            if not isinstance(child, nn.ModuleList):  # a list of lists: its lists' children
                blocks.append((f"{name}.{child_name}" if name else child_name, child))
    return (blocks or list(mlps)), mlps


def model_config(model: nn.Module) -> dict[str, object]:
    """What a memory comparison needs to know about a model: its MLP impls (``mlp_label``) and
    shape."""
    layers, mlps = find_layers(model)
    impls = sorted({mlp_label(m) for _, m in mlps})
    config: dict[str, object] = {"num_layers": len(layers), "mlp_impl": ",".join(impls) or None}
    for key in ("hidden_size", "ffn_hidden_size"):
        value = getattr(mlps[0][1], key, None) if mlps else None
        if value is not None:
            config[key] = value
    return config


class MemoryProfiler:
    """Measures every step of ``model``; ``per_layer`` adds the depth curve and per-impl bytes.

    Use :meth:`step` as a context manager, or the three calls, from any training loop.
    """

    def __init__(self, model: nn.Module, per_layer: bool = True) -> None:
        self.model = model
        self.per_layer = per_layer
        self.layers, self.mlps = find_layers(model) if per_layer else ([], [])
        self.records: list[StepMemory] = []
        self._active: _StepState | None = None

    def begin(self, step: int) -> None:
        if self._active is not None:
            raise RuntimeError("MemoryProfiler.begin called twice without backward_done")
        self._active = _StepState(self, step)

    def forward_done(self) -> None:
        self._require_active("forward_done").forward_done()

    def backward_done(self) -> StepMemory:
        record = self._require_active("backward_done").backward_done()
        self._active = None
        self.records.append(record)
        return record

    def abort(self) -> None:
        """Drop a step that will not finish (an exception in forward), removing every hook."""
        if self._active is not None:
            self._active.close_forward()
            self._active = None

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[MemoryProfiler]:
        """``with profiler.step(i) as p: loss = fwd(); p.forward_done(); loss.backward()``."""
        self.begin(step)
        try:
            yield self
            self.backward_done()
        except BaseException:
            self.abort()  # a body that skipped forward_done must not leave the hooks installed
            raise

    def _require_active(self, call: str) -> _StepState:
        if self._active is None:
            raise RuntimeError(f"MemoryProfiler.{call} called outside a step (call begin first)")
        return self._active


def _active_saved_tensors_hooks() -> tuple | None:
    """The (pack, unpack) pair in effect now, if any. torch keeps a stack of them but applies
    only the top one; it exposes the top privately, so without it there is nothing to chain."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


class _StepState:
    """Hooks and readings of one step in progress."""

    def __init__(self, profiler: MemoryProfiler, step: int) -> None:
        params = list(profiler.model.parameters())
        self.device = params[0].device if params else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self.params = params
        self.excluded = {key for p in params for key, _ in storages(p)}
        self.saved: dict[tuple, int] = {}
        self.by_module: dict[str, dict[tuple, int]] = {}
        self.stack: list[str] = []
        self.record = StepMemory(step=step, saved_bytes=0)
        self.layer_index = {name: i for i, (name, _) in enumerate(profiler.layers)}
        self.mlp_impl = {name: mlp_label(m) for name, m in profiler.mlps}  # as this step runs
        self.forward_open = True
        self.handles = []
        tracked = dict(profiler.layers) | dict(profiler.mlps)
        for name, module in tracked.items():
            self.handles.append(module.register_forward_pre_hook(self._push(name)))
            self.handles.append(module.register_forward_hook(self._pop(name), always_call=True))
        # Hooks already active (activation offloading such as save_on_cpu, or another profiler)
        # would be shadowed by ours for the step: ours count, then hand each tensor to them.
        self.outer = _active_saved_tensors_hooks()
        unpack = self.outer[1] if self.outer else lambda t: t
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, unpack)
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            self.grad_bytes = self._grad_bytes()
            self.record.allocated_MiB = self.base / MiB
        self.hooks.__enter__()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.record.saved_tensors += 1
        # A parameter, or a view of one (a transposed weight), is the model's, not an
        # activation; under FSDP2 it is the block's gathered copy, which is no parameter at the
        # step's start (excluded holds the shards then) and is freed after the block's forward.
        base = t if t._base is None else t._base
        if isinstance(base, nn.Parameter):
            return self.outer[0](t) if self.outer else t
        for key, nbytes in storages(t):
            if key not in self.excluded:
                self.saved[key] = nbytes
                for name in self.stack:
                    self.by_module.setdefault(name, {})[key] = nbytes
        return self.outer[0](t) if self.outer else t

    def _push(self, name: str):
        def hook(module, args):
            self.stack.append(name)

        return hook

    def _pop(self, name: str):
        def hook(module, args, output):
            if self.stack and self.stack[-1] == name:
                self.stack.pop()
            index = self.layer_index.get(name)
            if index is not None:
                self._close_layer(index, name)

        return hook

    def _close_layer(self, index: int, name: str) -> None:
        layer = LayerMemory(index, name, sum(self.by_module.get(name, {}).values()))
        layer.cumulative_saved_bytes = sum(self.saved.values())
        if self.cuda:
            layer.allocated_MiB = (torch.cuda.memory_allocated(self.device) - self.base) / MiB
        self.record.layers = [x for x in self.record.layers if x.index != index] + [layer]

    def _grad_bytes(self) -> int:
        grads = {
            key: nbytes
            for p in self.params
            if p.grad is not None and p.grad.device == self.device
            for key, nbytes in storages(p.grad)
        }
        return sum(grads.values())

    def close_forward(self) -> None:
        if not self.forward_open:
            return
        self.forward_open = False
        self.hooks.__exit__(None, None, None)
        for handle in self.handles:
            handle.remove()

    def forward_done(self) -> None:
        if not self.forward_open:
            raise RuntimeError("MemoryProfiler.forward_done called twice in one step")
        self.close_forward()
        record = self.record
        record.saved_bytes = sum(self.saved.values())
        record.layers.sort(key=lambda layer: layer.index)
        # Union the storages, not sum the bytes: MLPs fed one input (experts, parallel
        # branches) or nested in one another (an adapter around a ParMLP) save it once.
        by_impl: dict[str, dict[tuple, int]] = {}
        by_owner: dict[int, dict[tuple, int]] = {}
        for name, impl in self.mlp_impl.items():
            saved = self.by_module.get(name, {})
            by_impl.setdefault(impl, {}).update(saved)
            owner = next((lay for lay in record.layers if name.startswith(f"{lay.name}.")), None)
            if owner is not None:
                by_owner.setdefault(owner.index, {}).update(saved)
        record.impl_saved_bytes = {impl: sum(s.values()) for impl, s in by_impl.items()}
        for layer in record.layers:
            if layer.index in by_owner:
                layer.mlp_saved_bytes = sum(by_owner[layer.index].values())
        if self.cuda:
            freed_grads = self.grad_bytes - self._grad_bytes()
            now = torch.cuda.memory_allocated(self.device)
            record.after_forward_MiB = (now - self.base + freed_grads) / MiB
            record.forward_peak_MiB = (
                torch.cuda.max_memory_allocated(self.device) - self.base
            ) / MiB
            torch.cuda.reset_peak_memory_stats(self.device)

    def backward_done(self) -> StepMemory:
        if self.forward_open:
            raise RuntimeError("MemoryProfiler.backward_done called before forward_done")
        if self.cuda:
            peak = torch.cuda.max_memory_allocated(self.device) - self.base
            self.record.backward_peak_MiB = peak / MiB
        return self.record
