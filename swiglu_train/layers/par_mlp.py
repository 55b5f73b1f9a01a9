"""ParMLP: a SwiGLU MLP whose memory/recompute trade-off is chosen by name.

Parameters have the same names and shapes for every impl (``fc1.weight`` [2F, D],
``fc2.weight`` [O, F], optional biases), so a model can switch impl and keep computing the
same function. fc1 is in the canonical [W_gate; W_up] layout, except under packed impls
(``save_factors``), where it is packed in chunks; a packed state_dict carries a layout stamp
and any state_dict is converted on load to the layout of the module it is loaded into. A load
is all or nothing: every ParMLP's stamp and shapes are checked before any parameter of the
model is written (``layers.loading``).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.overrides import is_tensor_like

from swiglu_train.kernels.runtime import SUPPORTED_DTYPES
from swiglu_train.layers.auto import resolve_auto
from swiglu_train.layers.layout import CANONICAL, Layout, order, permute_rows, read_stamp, stamp
from swiglu_train.layers.loading import CheckedLoad
from swiglu_train.layers.registry import (
    AUTO,
    FIXED_CHUNKS,
    PACKED_IMPLS,
    QUACK_IMPLS,
    MLPFunction,
    check_impl_name,
    check_saved_fp8,
    get_impl,
    packed_chunk,
)
from swiglu_train.ops import reference
from swiglu_train.ops.activation import triton_enabled
from swiglu_train.ops.float8_casts import Float8Gemms, is_torchao_float8
from swiglu_train.ops.float8_mlp import drop_h_float8_mlp
from swiglu_train.ops.inference import (
    grad_needed,
    swiglu_mlp_inference,
    swiglu_mlp_torch,
    transforms_need_torch,
)
from swiglu_train.ops.mlp import swiglu_activation
from swiglu_train.ops.quack_mlp import QUACK_DTYPES
from swiglu_train.ops.weights import check_plain_weights

# the impl that runs an FP8-converted fc1/fc2 through their own forward (its GEMMs are theirs)
CONVERTED_IMPL = "normal"
# the impl that runs torchao's Float8Linear recipes in GEMMs of its own (ops.float8_mlp)
FLOAT8_IMPL = "drop_h"
FLOAT8_IMPLS = (FLOAT8_IMPL, CONVERTED_IMPL)  # the impls an FP8 training conversion runs under
UNCOMPILED_FLOAT8_WARNING = (
    "ParMLP trains FP8 GEMMs (torchao Float8Linear fc1/fc2) outside torch.compile: torchao's "
    "casts then run as separate eager kernels, and the step is slower than bf16 (2.4-3.8x the "
    "bf16 GEMMs on an H100, docs/fp8-training.md). Compile the model or its blocks "
    "(torch.compile, nn.Module.compile; pretrain --float8 does) to fuse them, or use impl "
    "'drop_h' where Triton runs, whose casts are fused kernels of its own."
)
STAMP_KEY = "_extra_state"  # a packed ParMLP's state_dict entry: {"fc1_layout": {...}}


_PARAM_NAMES = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")


def _named(params: tuple) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) for fc1's and fc2's weight and bias, the absent biases left out."""
    return [(name, p) for name, p in zip(_PARAM_NAMES, params, strict=True) if p is not None]


def _weight_and_bias(linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(linear.weight, linear.bias)``, read from its parameter dict when both are there:
    ``Module.__getattr__`` costs about 0.5 us a read, and forward reads four. Anything else
    (a parametrized weight is a property computed on read) takes the attribute."""
    params = linear._parameters
    if "weight" in params and "bias" in params:
        return params["weight"], params["bias"]
    return linear.weight, linear.bias


class ParMLP(nn.Module, CheckedLoad):
    """y = fc2(silu(x W_gateᵀ) * (x W_upᵀ)), with the autograd behaviour of ``impl``.

    ``inplace=False`` lets a ``drop_h`` or ``save_factors`` graph be backpropagated more than
    once, at the cost of activation-sized buffers in backward. ``chunk`` is the packed layout's
    chunk under ``save_factors`` (default: the largest power of two up to 128 dividing F);
    ``save_factors_quack`` always packs with chunk 1, quack's pair order (a different chunk
    named together with it is refused; with ``auto`` or a later switch it is left aside).
    With no grad to compute (eval, generation, inference mode) every impl takes the same
    inference path (``ops.inference``), which saves nothing for backward. Under ``torch.func``
    transforms (per-sample grads with vmap and grad, jacrev, jvp) and forward-mode AD, which
    our kernels and autograd Functions do not support, it computes the same y in plain torch.

    ``impl="auto"`` picks a concrete impl here, once, from the cost model fitted on this GPU
    family, at ``tokens_hint`` (tokens per micro-batch); see ``swiglu_train.layers.auto`` for
    the rule, the drop_h fallback and why it cannot change per forward. ``impl`` then names
    the impl chosen and ``auto_reason`` says why (None when the impl was named explicitly).
    The model is fitted in bf16 and resolves fp32 models too (trained under autocast, they
    run bf16): a quack impl auto picked runs its portable twin (same fc1 layout, same saved
    tensors) on fp32 inputs, which quack's kernels cannot take; named explicitly, it refuses.

    ``saved_fp8=True`` (``drop_h`` only) keeps the saved preactivation as e4m3 with per-block
    scales, about half the bytes (``ops.fp8_saved``: format, measured errors); y is unchanged,
    gradients carry e4m3's rounding. Parameters and state_dict are the same either way.

    An fc1 or fc2 converted for FP8 training (torchao's ``convert_to_float8_training`` makes it
    a ``Float8Linear``) runs through its own forward under ``normal``, and under ``drop_h`` its
    GEMMs run in FP8 as its recipe says, with drop_h's saved set (``ops.float8_mlp``; with
    ``saved_fp8``, the preactivation as its FP8 copy); every other impl runs GEMMs of its own,
    whose FP8 versions are not implemented yet, and refuses it at forward rather than train in
    bf16 unannounced (docs/fp8-training.md). A weight that a conversion wrapped in a tensor
    subclass (torchao's MoE FP8 training) is refused the same way (``ops.weights``).
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        output_size: int | None = None,
        bias: bool = False,
        impl: str = "drop_h",
        inplace: bool = True,
        chunk: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        tokens_hint: int | None = None,
        saved_fp8: bool = False,
    ) -> None:
        super().__init__()
        output_size = hidden_size if output_size is None else output_size
        if min(hidden_size, ffn_hidden_size, output_size) < 1:
            raise ValueError(
                f"ParMLP sizes must be positive; got hidden_size={hidden_size}, "
                f"ffn_hidden_size={ffn_hidden_size}, output_size={output_size}"
            )
        check_impl_name(impl)
        check_saved_fp8(impl, saved_fp8)  # auto too: it may pick an impl without FP8
        if impl in FIXED_CHUNKS:  # a chunk named with it must be its own
            packed_chunk(impl, chunk, ffn_hidden_size)
        elif chunk is not None:  # save_factors' chunk: refused now, not at a later switch
            packed_chunk("save_factors", chunk, ffn_hidden_size)
        auto = None
        if impl == AUTO:  # now, before any optimizer can hold fc1 in the layout this decides
            auto = resolve_auto(
                tokens_hint, hidden_size, ffn_hidden_size, device, output_size=output_size
            )
        factory = {"device": device, "dtype": dtype}
        self.fc1 = nn.Linear(hidden_size, 2 * ffn_hidden_size, bias=bias, **factory)
        self.fc2 = nn.Linear(ffn_hidden_size, output_size, bias=bias, **factory)
        self.inplace = inplace
        self.chunk = chunk  # None: each packed impl's default
        self.fc1_layout = CANONICAL
        self._saved_fp8 = saved_fp8
        self.set_impl(auto.impl if auto else impl)
        self.auto_reason = auto.reason if auto else None
        self._register_state_dict_hook(_stamp_layout)
        self.register_load_state_dict_pre_hook(_convert_on_load)

    @property
    def impl(self) -> str:
        return self._impl

    @impl.setter
    def impl(self, name: str) -> None:
        get_impl(name, self._saved_fp8)  # an unknown name (or 'auto') fails before layout talk
        if self._layout_for(name) != self.fc1_layout:
            raise ValueError(
                f"switching ParMLP from {self._impl!r} to {name!r} repacks fc1 "
                f"({self.fc1_layout} -> {self._layout_for(name)}); call "
                "swiglu_train.packing.switch_impl(model, impl, optimizer) so optimizer state "
                "follows, or mlp.set_impl(impl) when no optimizer holds these parameters"
            )
        self.set_impl(name)

    def set_impl(self, name: str) -> torch.Tensor | None:
        """Switch impl, repacking fc1 in place when the layout changes.

        Returns the row index applied (``new = old[index]``) or None, so that callers can move
        per-element optimizer state the same way.
        """
        function, target = get_impl(name, self._saved_fp8), self._layout_for(name)
        index = self.layout_change(name)
        if index is not None:
            with torch.no_grad():
                for p in (self.fc1.weight, self.fc1.bias):
                    if p is not None:
                        p.copy_(permute_rows(p, index))
        self._mlp_function, self._impl, self.fc1_layout = function, name, target
        self.auto_reason: str | None = None  # a named impl is no longer auto's choice
        return index

    def layout_change(self, name: str) -> torch.Tensor | None:
        """The row index switching to ``name`` would apply to fc1 (None: same layout), changing
        nothing: callers check a whole model's switch before making any of it."""
        get_impl(name, self._saved_fp8)  # refused here, not half-way through a switch
        target = self._layout_for(name)
        _refuse_parametrized_relayout(self, self.fc1_layout, target)
        return order(self.fc1.out_features, self.fc1_layout, target)

    def _layout_for(self, name: str) -> Layout:
        if name not in PACKED_IMPLS:
            return CANONICAL
        chunk = None if name in FIXED_CHUNKS else self.chunk  # ``chunk`` is save_factors'
        return Layout("packed", packed_chunk(name, chunk, self.fc2.in_features))

    @property
    def saved_fp8(self) -> bool:
        """Whether the preactivation saved for backward is stored in FP8 (``drop_h`` only)."""
        return self._saved_fp8

    @saved_fp8.setter
    def saved_fp8(self, on: bool) -> None:
        self._mlp_function = get_impl(self._impl, on)
        self._saved_fp8 = on

    @property
    def hidden_size(self) -> int:
        return self.fc1.in_features

    @property
    def ffn_hidden_size(self) -> int:
        return self.fc2.in_features

    def _warn_unfused_casts(self, x: torch.Tensor) -> None:
        """Uncompiled, torchao's casts are eager kernels apiece; drop_h fuses its own where
        Triton runs (``kernels.float8_cast``)."""
        if self._impl != FLOAT8_IMPL or not triton_enabled(x):
            warnings.warn(UNCOMPILED_FLOAT8_WARNING, stacklevel=3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Per-call host time is a small layer's step time (benchmarks/host_time.py): the
        # submodules and parameters are read once, and the checks pass over them once.
        fc1, fc2 = self._modules["fc1"], self._modules["fc2"]  # as self.fc1, less __getattr__
        converted = False
        if type(fc1) is not nn.Linear or type(fc2) is not nn.Linear:
            converted = _check_converted_linears(fc1, fc2, self._impl)
        params = (*_weight_and_bias(fc1), *_weight_and_bias(fc2))
        device = x.device
        self._check_input(x, fc1.in_features, device, params, converted)
        if converted and uncompiled_float8_training(device.type) and is_torchao_float8(fc1):
            self._warn_unfused_casts(x)
        if converted and self._impl == FLOAT8_IMPL:  # torchao's recipes in drop_h's GEMMs
            return self._float8(x, fc1, fc2, params)
        if converted:  # impl normal: the converted forwards run the GEMMs (FP8 under torchao)
            return _through_linears(x, fc1, fc2)
        device_type = device.type
        if device_type == "meta":  # shapes only (deferred init, tracing): no kernel, no autocast
            return reference.mlp(x, *params)
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            tensors = tuple(None if t is None else t.to(dtype) for t in (x, *params))
            with torch.autocast(device_type, enabled=False):
                return self._apply_impl(*tensors)
        dtype = x.dtype
        for i, p in enumerate(params):
            if p is not None and p.dtype != dtype:
                raise TypeError(
                    f"ParMLP input is {dtype} but its {_PARAM_NAMES[i]} is {p.dtype}; "
                    "cast one of them, or run under torch.autocast"
                )
        return self._apply_impl(x, *params)

    def _params(self) -> list[tuple[str, torch.Tensor]]:
        """The four tensors forward reads, by name (a module converted in part, ``mlp.fc2.half()``
        or an fc2 left on meta, must be named, not reach a kernel or GEMM of mixed inputs)."""
        return _named((self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias))

    def _apply_impl(self, x: torch.Tensor, *params: torch.Tensor | None) -> torch.Tensor:
        # An [M, D] input goes to the impl as it is: a reshape and a view back would add two
        # autograd nodes, whose backward costs host time on every step.
        flat = x.dim() == 2
        x2d = x if flat else x.reshape(-1, x.shape[-1])
        if transforms_need_torch(x, *params):  # torch.func, forward AD: no kernel runs there
            y = swiglu_mlp_torch(x2d, *params, chunk=self.fc1_layout.chunk)
        elif grad_needed(x, *params):
            packed = {"chunk": self.fc1_layout.chunk} if self.fc1_layout.packed else {}
            function = self._function_for(x.dtype)
            y = function(x2d, *params, inplace=self.inplace, **packed)
        else:  # eval, generation: every impl computes the same y, and nothing need be saved
            y = swiglu_mlp_inference(x2d, *params, chunk=self.fc1_layout.chunk)
        return y if flat else y.view(*x.shape[:-1], y.shape[-1])

    def _float8(self, x: torch.Tensor, fc1: nn.Module, fc2: nn.Module, params: tuple):
        """drop_h with fc1's and fc2's torchao recipes (its preactivation saved in FP8 with
        ``saved_fp8``); under autocast, in its dtype, as Float8Linear casts its input."""
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            x = x.to(torch.get_autocast_dtype(device_type))
        x2d = x.reshape(-1, x.shape[-1])
        with torch.autocast(device_type, enabled=False):
            y = drop_h_float8_mlp(
                x2d, *params, Float8Gemms.of(fc1), Float8Gemms.of(fc2), self.inplace,
                self._saved_fp8,
            )  # fmt: skip
        return y.view(*x.shape[:-1], y.shape[-1])

    def _function_for(self, dtype: torch.dtype) -> MLPFunction:
        """The impl's autograd function, or for a quack impl ``auto`` picked, its portable twin
        on a dtype quack's kernels cannot take."""
        if self.auto_reason is None or self._impl not in QUACK_IMPLS or dtype in QUACK_DTYPES:
            return self._mlp_function
        return get_impl(self._impl.removesuffix("_quack"))

    def _check_input(
        self,
        x: torch.Tensor,
        hidden_size: int,
        device: torch.device,
        params: tuple,
        converted: bool,
    ) -> None:
        """Refuse an input the impls cannot take, naming the problem; ``params`` in
        ``_PARAM_NAMES`` order, absent biases as None. Unless fc1/fc2 were ``converted`` (their
        weights are then the converter's to wrap), a weight must be a plain tensor."""
        if x.dtype not in SUPPORTED_DTYPES:
            if not x.is_floating_point():
                raise TypeError(f"ParMLP expects a floating-point input, got {x.dtype}")
            raise TypeError(f"ParMLP supports {SUPPORTED_DTYPES}, got {x.dtype}")
        if x.dim() == 0 or x.shape[-1] != hidden_size:
            raise ValueError(
                f"ParMLP(hidden_size={hidden_size}) got an input of shape {tuple(x.shape)}; "
                f"its last dim must be {hidden_size}"
            )
        for i, p in enumerate(params):
            if p is None:
                continue
            if p.device != device:
                raise ValueError(
                    f"ParMLP input is on {device} but its {_PARAM_NAMES[i]} is on {p.device}"
                )
            if type(p) is not nn.Parameter and not converted:
                check_plain_weights("ParMLP", ((_PARAM_NAMES[i], p),))

    def check_state_dict(self, state_dict: Mapping, prefix: str = "") -> Layout:
        """The fc1 layout of this module's entries in ``state_dict`` (keys under ``prefix``),
        checked as a load would use them, changing nothing: a stamp its writer would not have
        written, a parameter that is no tensor or of another shape, a layout fc1 cannot be
        moved from. Missing keys are left to torch's strict check."""
        key = prefix + STAMP_KEY
        source = read_stamp(state_dict[key], key) if key in state_dict else CANONICAL
        for name, param in self._params():
            value = state_dict.get(prefix + name)
            if value is None:
                continue
            if not is_tensor_like(value):
                raise RuntimeError(
                    f"{prefix}{name}: expected a tensor in the state_dict, got "
                    f"{type(value).__name__}"
                )
            if value.shape != param.shape:  # torch's words, before anything is written
                raise RuntimeError(
                    f"size mismatch for {prefix}{name}: copying a param with shape "
                    f"{tuple(value.shape)} from checkpoint, the shape in current model is "
                    f"{tuple(param.shape)}"
                )
        if source != self.fc1_layout and any(k.startswith(prefix + "fc1.") for k in state_dict):
            _refuse_parametrized_relayout(self, source, self.fc1_layout)
            try:
                order(self.fc1.out_features, source, self.fc1_layout)
            except ValueError as e:
                raise ValueError(f"{key}: fc1 cannot be read as {source}: {e}") from e
        return source

    def extra_repr(self) -> str:
        chosen = " (auto)" if self.auto_reason is not None else ""
        fp8 = ", saved_fp8=True" if self.saved_fp8 else ""
        return (
            f"impl={self.impl!r}{chosen}{fp8}, inplace={self.inplace}, fc1_layout={self.fc1_layout}"
        )


def _stamp_layout(module: ParMLP, state_dict: dict, prefix: str, local_metadata) -> None:
    """Packed state carries its layout; canonical state, the ecosystem's standard, carries none."""
    if module.fc1_layout.packed:
        state_dict[prefix + STAMP_KEY] = stamp(module.fc1_layout)


def _convert_on_load(module: ParMLP, state_dict: dict, prefix: str, *args) -> None:
    """Move incoming fc1 weight and bias into this module's layout (never guessing)."""
    source = module.check_state_dict(state_dict, prefix)
    state_dict.pop(prefix + STAMP_KEY, None)
    keys = [k for k in (prefix + "fc1.weight", prefix + "fc1.bias") if k in state_dict]
    if source == module.fc1_layout or not keys:
        return
    index = order(module.fc1.out_features, source, module.fc1_layout)
    for key in keys:
        state_dict[key] = permute_rows(state_dict[key], index)


def converted_forward(linear: nn.Module) -> bool:
    """Whether a converter replaced ``linear``'s forward (torchao's ``convert_to_float8_training``
    swaps nn.Linear for ``Float8Linear``, whose forward runs FP8 GEMMs). Subclasses that keep
    ``nn.Linear.forward`` (FSDP2's, a parametrization's) are not converted."""
    return type(linear).forward is not nn.Linear.forward


def uncompiled_float8_training(device_type: str) -> bool:
    """Whether FP8 GEMMs would train here with their casts unfused: on a GPU, with grad, and
    not inside torch.compile (the CPU's FP8 GEMMs are for tests, slow whichever way)."""
    return device_type == "cuda" and torch.is_grad_enabled() and not torch.compiler.is_compiling()


def _check_converted_linears(fc1: nn.Module, fc2: nn.Module, impl: str) -> bool:
    """Whether fc1 or fc2 has a converted forward: impl ``normal`` runs them through it, and
    ``drop_h`` runs torchao's Float8Linear recipes in its own GEMMs. Any other impl, or drop_h
    with another converter, would skip that forward (and its FP8 GEMMs) and train in bf16
    unannounced: a one-line TypeError instead."""
    converted = False
    for name, linear in (("fc1", fc1), ("fc2", fc2)):
        if not converted_forward(linear):
            continue
        converted = True
        if impl == CONVERTED_IMPL:
            continue
        kind = f"{type(linear).__module__}.{type(linear).__qualname__}"
        if impl == FLOAT8_IMPL and is_torchao_float8(linear):
            continue
        if impl == FLOAT8_IMPL:
            why = "drop_h runs torchao's Float8Linear recipes only"
        else:
            why = f"its FP8 GEMMs are not implemented yet; use impl {FLOAT8_IMPL!r} or "
            why += f"{CONVERTED_IMPL!r} (pretrain --mlp-impl)"
        raise TypeError(
            f"ParMLP.{name} is a {kind}, which replaces nn.Linear's forward (an FP8 or "
            "quantized training conversion, such as torchao's convert_to_float8_training); "
            f"impl {impl!r} runs its own GEMMs on the weight and would skip that forward, "
            f"training in bf16 unannounced: {why}. Or leave ParMLP's fc1 and fc2 out of the "
            "conversion (torchao: module_filter_fn)"
        )
    return converted


def _through_linears(x: torch.Tensor, fc1: nn.Module, fc2: nn.Module) -> torch.Tensor:
    """``normal``'s math with the GEMMs of fc1's and fc2's own (converted) forwards: saved for
    backward are the preactivation (our activation's) and what those forwards save (torchao's
    Float8Linear: x and h in high precision, cast again in backward)."""
    x2d = x.reshape(-1, x.shape[-1])
    y = fc2(swiglu_activation(fc1(x2d)))
    return y.view(*x.shape[:-1], y.shape[-1])


def _refuse_parametrized_relayout(module: ParMLP, source: Layout, target: Layout) -> None:
    """A parametrized fc1 (``torch.nn.utils.parametrize``: weight_norm, spectral_norm, ...) is
    computed from originals that need not map row to row, so its rows cannot be permuted: a
    copy into the computed weight is lost, and its state_dict keys are not ``fc1.weight``.
    Either would leave fc1 in one layout while the module reads another, silently."""
    if source != target and parametrize.is_parametrized(module.fc1):
        raise ValueError(
            f"ParMLP fc1 is parametrized (torch.nn.utils.parametrize), so it cannot be moved "
            f"from {source} to {target}: switch impl or load the state_dict before registering "
            "the parametrization, or remove it first (parametrize.remove_parametrizations)"
        )
