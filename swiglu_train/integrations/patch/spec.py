"""How a host library's SwiGLU MLP is recognized: by structure, activation and forward code.

Class names say little: Hugging Face has ~80 copies of LlamaMLP under other names, and a
subclass of LitGPT's LLaMAMLP (GemmaMLP) computes GELU instead. So a module is taken for a
SwiGLU MLP only when its children are exactly the host layout's linears (plain ``nn.Linear``,
same dtype and device, no hooks or parametrizations), its activation computes SiLU, and its
``forward`` compiles to the same instructions as the host library's own (compared with
``dis``; local variable names and line numbers aside). Anything that fails says why, for the
report. No host library is imported here: a user's own copy of LlamaMLP is recognized too.
"""

from __future__ import annotations

import dis
import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from swiglu_train.kernels.runtime import SUPPORTED_DTYPES
from swiglu_train.layers.layout import DTensor
from swiglu_train.layers.par_mlp import FLOAT8_IMPLS, converted_forward


@dataclass(frozen=True)
class HostSpec:
    """One host library's SwiGLU MLP layout: its child names and reference forwards.

    ``gate``/``up`` name two [F, D] linears, or ``fused`` one [2F, D] linear holding
    [gate; up] (Phi3's ``gate_up_proj``). ``act`` names an activation child (HF's ``act_fn``)
    or is None where ``forward`` calls ``F.silu`` itself. ``order`` is the host's child
    registration order, which its state_dict keys follow.
    """

    library: str
    down: str
    order: tuple[str, ...]
    forwards: tuple[Callable, ...]
    gate: str | None = None
    up: str | None = None
    fused: str | None = None
    act: str | None = None

    @property
    def linears(self) -> tuple[str, ...]:
        return tuple(n for n in self.order if n != self.act)

    def fits(self, module: nn.Module) -> bool:
        """Whether ``module``'s child names are this layout's (the rest is checked by match)."""
        return {n for n, _ in module.named_children()} == set(self.order)

    def mismatch(self, module: nn.Module) -> str | None:
        """Why ``module``, whose children fit, is not this SwiGLU MLP; None when it is."""
        if any(DTensor is not None and isinstance(p, DTensor) for p in module.parameters()):
            return "its weights are DTensors (already sharded): patch before fully_shard or TP"
        if "forward" in vars(module):
            return "its forward was replaced on the instance (a hook or another patch)"
        hooks = _hooks(module)
        if hooks:
            return f"it has {hooks}, which a replacement would drop"
        if module._parameters or module._buffers:
            return "it holds parameters or buffers of its own besides its linears"
        if not any(same_code(type(module).forward, ref) for ref in self.forwards):
            return (
                f"its forward ({_where(type(module).forward)}) is not {self.library}'s "
                "SwiGLU forward"
            )
        if self.act is not None:
            act = getattr(module, self.act)
            why = not_silu(act)
            if why:
                return why
        linears = [getattr(module, n) for n in self.linears]
        for name, linear in zip(self.linears, linears, strict=True):
            why = not_plain_linear(linear)
            if why:
                return f"{name} {why}"
        return _shapes(self, module)

    def fc1_linears(self, module: nn.Module) -> list[nn.Linear]:
        """The linears whose rows make fc1, in canonical order: [gate, up] or [fused]."""
        names = [self.fused] if self.fused is not None else [self.gate, self.up]
        return [getattr(module, n) for n in names]


def same_code(fn: Callable, ref: Callable) -> bool:
    """Whether ``fn`` is ``ref``'s code: same signature, same instructions (locals by slot, so
    ``x`` and ``hidden_states`` agree) and the same objects behind the globals it reads."""
    fn = inspect.unwrap(fn)
    if not isinstance(fn, types.FunctionType):
        return False
    a, b = fn.__code__, ref.__code__
    sig = ("co_argcount", "co_posonlyargcount", "co_kwonlyargcount")
    if any(getattr(a, k) != getattr(b, k) for k in sig):
        return False
    varargs = inspect.CO_VARARGS | inspect.CO_VARKEYWORDS
    if (a.co_flags & varargs) != (b.co_flags & varargs) or _ops(fn) != _ops(ref):
        return False
    names = {i.argval for i in dis.get_instructions(ref) if i.opname == "LOAD_GLOBAL"}
    missing = object()  # a builtin (float, super) is in neither module's globals: the same
    return all(fn.__globals__.get(n, missing) is ref.__globals__.get(n, missing) for n in names)


def _ops(fn: Callable) -> list[tuple[str, object]]:
    skip = {"RESUME", "NOP", "CACHE", "EXTENDED_ARG"}
    return [
        (i.opname, i.arg if "FAST" in i.opname else i.argval)
        for i in dis.get_instructions(fn)
        if i.opname not in skip
    ]


_PROBE = torch.linspace(-6.0, 6.0, 25)


def not_silu(act: object) -> str | None:
    """Why ``act`` is not SiLU (GELU makes a GeGLU), from what it computes on a probe."""
    name = type(act).__name__
    if isinstance(act, nn.Module) and (list(act.parameters()) or list(act.buffers())):
        return f"its activation {name} has parameters (a learned activation, not SiLU)"
    if not callable(act):
        return f"its activation {name} is not callable"
    try:
        out = act(_PROBE.clone())
    except Exception as e:  # a device-bound kernel, an odd signature: not provably SiLU
        return f"its activation {name} could not be probed ({type(e).__name__}: {e})"
    if not isinstance(out, torch.Tensor) or not torch.allclose(out, F.silu(_PROBE), atol=1e-6):
        return f"its activation {name} is not SiLU (a gated MLP with it is not SwiGLU)"
    return None


def not_plain_linear(linear: nn.Module) -> str | None:
    """Why ``linear`` cannot be fused into fc1/fc2 as it stands; None when it can."""
    if not isinstance(linear, nn.Linear):
        return f"is a {type(linear).__name__}, not an nn.Linear (an adapter or quantized layer)"
    if converted_forward(linear) or "forward" in vars(linear):
        # an FP8 training conversion leaves such a linear: a ParMLP of its weights would skip it
        return (
            f"is a {type(linear).__name__} whose forward is not nn.Linear's (as after an FP8 "
            "training conversion, torchao's convert_to_float8_training among them: to train "
            f"in FP8, patch first with impl {' or '.join(map(repr, FLOAT8_IMPLS))}, then convert)"
        )
    if parametrize.is_parametrized(linear):
        return "is parametrized (torch.nn.utils.parametrize)"
    hooks = _hooks(linear)
    if hooks:
        return f"has {hooks}, which a replacement would drop"
    for kind, p in (("weight", linear.weight), ("bias", linear.bias)):
        if p is not None and type(p.data) is not torch.Tensor:
            return f"{kind} is a {type(p.data).__name__}, not a plain tensor"
    if linear.weight.dtype not in SUPPORTED_DTYPES:
        return f"is {linear.weight.dtype}; the impls support {SUPPORTED_DTYPES}"
    return None


def _shapes(spec: HostSpec, module: nn.Module) -> str | None:
    linears = {n: getattr(module, n) for n in spec.linears}
    first = next(iter(linears.values())).weight
    for name, lin in linears.items():
        for kind, p in (("weight", lin.weight), ("bias", lin.bias)):
            if p is not None and (p.dtype, p.device) != (first.dtype, first.device):
                return f"{name}.{kind} is {p.dtype} on {p.device}, unlike its other weights"
    if len({lin.bias is None for lin in linears.values()}) > 1:
        return "only some of its linears have a bias (ParMLP biases fc1 and fc2 together)"
    down = linears[spec.down]
    if spec.fused is not None:
        fused = linears[spec.fused]
        if fused.out_features != 2 * down.in_features:
            return f"{spec.fused} has {fused.out_features} rows, not 2 x {down.in_features}"
        return None
    gate, up = linears[spec.gate], linears[spec.up]
    if gate.weight.shape != up.weight.shape or gate.out_features != down.in_features:
        return (
            f"its shapes do not chain: {spec.gate} {tuple(gate.weight.shape)}, "
            f"{spec.up} {tuple(up.weight.shape)}, {spec.down} {tuple(down.weight.shape)}"
        )
    for kind in ("weight", "bias"):
        g, u = getattr(gate, kind), getattr(up, kind)
        if g is not None and g.requires_grad != u.requires_grad:
            return f"{spec.gate}.{kind} and {spec.up}.{kind} differ in requires_grad (one fc1)"
    return None


def _hooks(module: nn.Module) -> str:
    kinds = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    found = [k.strip("_").replace("_", " ") for k in kinds if getattr(module, k, None)]
    if hasattr(module, "_hf_hook"):  # accelerate's offload/device-map hook wraps forward
        found.append("an accelerate hook")
    return " and ".join(found)


def _where(fn: Callable) -> str:
    fn = inspect.unwrap(fn)
    return getattr(fn, "__qualname__", repr(fn))
