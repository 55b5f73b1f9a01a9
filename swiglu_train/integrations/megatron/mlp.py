"""ParMLPMegatron: Megatron-core's ``MLP`` with its SwiGLU math replaced by one of our impls.

Everything Megatron owns stays Megatron's: the ``linear_fc1`` / ``linear_fc2`` modules and
their parameters (TP attributes, init, DDP/DistributedOptimizer buffers), the TP process
group, and ``sharded_state_dict`` (wrapped for a packed fc1). Only the local math between the
two TP collectives changes:

    x_tp = copy-to-TP-region(x)            or all-gather along the sequence (sequence parallel)
    y_tp = impl(x_tp, W1_r, b1_r, W2_r)    our autograd Function, on this rank's shards
    y    = all-reduce(y_tp)                or reduce-scatter along the sequence

Megatron stores a gated fc1 with ``stride=2``: rank r holds ``[W_gate_r; W_up_r]``, which is
exactly our canonical layout for the local shard, so the canonical impls (``normal``,
``drop_h``) run on the stock weights unchanged. The packed impl (``save_factors``) repacks the
local shard once, at construction, into ``Layout("packed", chunk)``; :mod:`.packed` keeps its
checkpoints canonical (dist-ckpt writes the global [W_gate; W_up] exactly as the stock MLP
does) and converts plain state dicts on load, so checkpoints stay interchangeable with the
stock MLP and across impls and TP sizes.

Process groups: the TP group is the model's, never a guess. A TransformerLayer hands its
``pg_collection.tp`` to the stock ``MLP`` only (0.16-0.17 test ``spec.module == MLP``; 0.18+ call
``as_mlp_submodule`` with the collection, rewrapping a ModuleSpec of ``MLP``), so our classes
compare equal to ``MLP`` (:class:`MLPDispatch`) and take the stock path on every version. Built
with no group at all, the MLP takes ``parallel_state``'s global TP group as the stock MLP does,
and is refused where there is none (:func:`resolve_tp_group`).

Known gap: with sequence parallelism our Function saves the all-gathered input [s, b, h],
where the stock ColumnParallelLinear saves its [s/tp, b, h] shard and gathers it again in
backward.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from swiglu_train.integrations.megatron.packed import (
    convert_on_load,
    pack_sharded_state_dict,
    stamp_packed,
)
from swiglu_train.kernels.runtime import SUPPORTED_DTYPES
from swiglu_train.layers.layout import CANONICAL, Layout, relayout
from swiglu_train.layers.registry import (
    AUTO,
    FIXED_CHUNKS,
    MLP_IMPLS,
    PACKED_IMPLS,
    check_saved_fp8,
    get_impl,
    packed_chunk,
)
from swiglu_train.ops.inference import grad_needed, swiglu_mlp_inference

SUPPORTED_IMPLS: tuple[str, ...] = MLP_IMPLS

# MLP.__init__ keywords differ across megatron-core versions; pass only those it takes.
_BASE_INIT_PARAMS = frozenset(inspect.signature(MLP.__init__).parameters)


def check_config(
    config: TransformerConfig, is_expert: bool = False, own_gemms: bool = True
) -> None:
    """Refuse, with the reason, configs whose MLP math or kernels this layer cannot run.

    ``own_gemms=False`` (SwiGLUActivationMLP: Megatron's linears run the GEMMs, ours only the
    activation) skips the checks that concern only our GEMMs: FP8/FP4 among them, which TE's
    linears quantize themselves (the activation between them runs in bf16, as Megatron's does).
    """
    problems = []
    if not config.gated_linear_unit or config.activation_func is not F.silu:
        problems.append(
            "it computes SwiGLU only: set gated_linear_unit=True, activation_func=F.silu"
        )
    if own_gemms and (getattr(config, "fp8", None) or getattr(config, "fp4", None)):
        problems.append(
            "FP8/FP4 runs on Transformer Engine GEMMs, which this MLP replaces; unset "
            "config.fp8/fp4, or use get_gpt_layer_spec('normal', backend='te')"
        )
    if getattr(config, "use_te_activation_func", False):
        problems.append("use_te_activation_func would bypass our activation; set it False")
    if getattr(config, "activation_func_clamp_value", None) is not None:
        problems.append("activation_func_clamp_value (clamped SwiGLU) is not implemented")
    if getattr(config, "glu_linear_offset", 0.0):
        problems.append("glu_linear_offset != 0 is not implemented")
    if own_gemms and config.gradient_accumulation_fusion:
        problems.append(
            "gradient_accumulation_fusion is not supported: our backward writes weight grads "
            "to param.grad; set gradient_accumulation_fusion=False"
        )
    if own_gemms and getattr(config, "gtp_weight_remat_size", 1) > 1:
        problems.append(
            "generalized tensor parallelism (gtp_weight_remat_size > 1, megatron-core 0.19) "
            "shards fc1/fc2 further and regathers them inside the linears, whose GEMMs this MLP "
            "replaces; set tensor_parallel_num_weight_shards = tensor_model_parallel_size"
        )
    if getattr(config, "use_kitchen", False):
        problems.append("use_kitchen changes the fc1 layout (stride 1); not supported")
    if is_expert:
        problems.append("MoE experts use expert-parallel comms; use it for dense MLPs only")
    if problems:
        raise ValueError("ParMLPMegatron cannot run this config: " + "; ".join(problems))


def check_chunk(impl: str, chunk: int | None) -> None:
    """``chunk`` belongs to the packed layout: refuse it for a canonical impl before any weight
    exists (whether it divides F/tp is known only once the TP size is)."""
    if chunk is not None and impl not in PACKED_IMPLS:
        raise ValueError(f"chunk applies to packed impls only, not {impl!r}")


def check_impl(name: str) -> None:
    """Fail early, before any weight exists, on a name that is no impl (listing the valid).

    ``auto`` is refused: it picks a layout from a tokens hint per layer, while a Megatron model
    must have one layout known before its checkpoint factories and optimizer are built.
    """
    if name == AUTO:
        raise ValueError(
            "impl 'auto' is not supported by the Megatron integration; name one of "
            f"{', '.join(SUPPORTED_IMPLS)}"
        )
    get_impl(name)


class MLPDispatch(type(MLP)):
    """Metaclass under which our MLP classes compare equal to Megatron's ``MLP``.

    megatron-core 0.16-0.17's TransformerLayer passes its model's TP group to the mlp submodule
    only when ``spec.module == MLP``; any other class is built on no group (and logged as
    "Unknown MLP type ... Using default kwargs"), so a model with its own ProcessGroupCollection
    got an MLP on the global group, or none. 0.18+ rewrap a ModuleSpec whose module is in
    ``(MLP, TEFusedMLP)`` into ``module.as_mlp_submodule`` with the collection. Equal to ``MLP``,
    a ModuleSpec of our class takes the stock MLP's path, groups included, on every version.
    Hashing and ``isinstance``/``issubclass`` stay those of a plain class.
    """

    def __eq__(cls, other: object) -> bool:
        return other is MLP or super().__eq__(other)

    __hash__ = type.__hash__


class ParMLPMegatron(MLP, metaclass=MLPDispatch):
    """Drop-in for ``megatron.core.transformer.mlp.MLP`` (local backend) running ``impl``.

    ``bias_activation_fusion`` is ignored: our impl replaces that path whatever its value.
    ``inplace=False`` lets a ``drop_h`` or ``save_factors`` graph be backpropagated twice.
    ``saved_fp8=True`` (``drop_h`` only) saves the preactivation in FP8, as ParMLP's does.
    ``chunk`` is the packed layout's chunk under ``save_factors``; it must divide this rank's
    ffn size F/tp (default: ``gcd(F/tp, 128)``). ``save_factors_quack`` packs with chunk 1.
    The TP group comes from ``pg_collection`` or ``tp_group`` (see :func:`resolve_tp_group`).
    """

    DEFAULT_IMPL = "drop_h"
    OWN_GEMMS = True  # runs fc1/fc2 itself (see check_config)

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MLPSubmodules,
        is_expert: bool = False,
        input_size: int | None = None,
        ffn_hidden_size: int | None = None,
        tp_group: torch.distributed.ProcessGroup | None = None,
        pg_collection: Any | None = None,
        name: str | None = None,
        is_mtp_layer: bool = False,
        impl: str | None = None,
        inplace: bool = True,
        chunk: int | None = None,
        saved_fp8: bool = False,
    ) -> None:
        impl = self.DEFAULT_IMPL if impl is None else impl
        check_config(config, is_expert, own_gemms=self.OWN_GEMMS)
        self._check_linears(submodules)
        self.validate_impl(impl)  # before any weight is allocated
        check_chunk(impl, chunk)
        check_saved_fp8(impl, saved_fp8)
        tp_group = resolve_tp_group(tp_group, pg_collection, type(self).__name__, self.OWN_GEMMS)
        optional = {"pg_collection": pg_collection, "name": name, "is_mtp_layer": is_mtp_layer}
        super().__init__(
            config=config,
            submodules=submodules,
            is_expert=is_expert,
            input_size=input_size,
            ffn_hidden_size=config.ffn_hidden_size if ffn_hidden_size is None else ffn_hidden_size,
            tp_group=tp_group,
            **{k: v for k, v in optional.items() if k in _BASE_INIT_PARAMS},
        )
        self.inplace = inplace
        self.saved_fp8 = saved_fp8
        self.fc1_layout = self._pack_fc1(impl, chunk)
        self.impl = impl
        self._register_state_dict_hook(stamp_packed)
        self.register_load_state_dict_pre_hook(convert_on_load)

    def _pack_fc1(self, impl: str, chunk: int | None) -> Layout:
        """Repack this rank's freshly initialised fc1 shard when ``impl`` reads it packed, so
        the module computes the same function from the same seed as the stock MLP."""
        if impl not in PACKED_IMPLS:
            return CANONICAL
        layout = self._layout_for(impl, chunk)
        with torch.no_grad():
            for p in (self.linear_fc1.weight, self.linear_fc1.bias):
                if p is not None:
                    p.copy_(relayout(p, CANONICAL, layout))
        return layout

    @classmethod
    def as_mlp_submodule(
        cls,
        submodules: MLPSubmodules,
        config: TransformerConfig,
        pg_collection: Any | None = None,
        is_mtp_layer: bool = False,
        is_expert: bool = False,
        input_size: int | None = None,
        ffn_hidden_size: int | None = None,
        name: str | None = None,
        layer_number: int | None = None,
        impl: str | None = None,
        inplace: bool = True,
        chunk: int | None = None,
        saved_fp8: bool = False,
    ) -> ParMLPMegatron:
        """The MLP builder that megatron-core >= 0.18 TransformerLayers call for their mlp slot,
        with the model's ``pg_collection`` (0.16-0.17 build a ModuleSpec instead and pass its
        ``tp``); see :func:`~.specs.mlp_spec`."""
        del layer_number  # a dense MLP does not depend on its depth
        return cls(
            config,
            submodules,
            is_expert=is_expert,
            input_size=input_size,
            ffn_hidden_size=ffn_hidden_size,
            pg_collection=pg_collection,
            name=name,
            is_mtp_layer=is_mtp_layer,
            impl=impl,
            inplace=inplace,
            chunk=chunk,
            saved_fp8=saved_fp8,
        )

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """The stock MLP's (the global canonical fc1, for any impl and TP size); a packed fc1
        is unpacked on save and repacked on load through wrapped factories (:mod:`.packed`)."""
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.fc1_layout.packed:
            rows = self.linear_fc1.weight.shape[0]
            pack_sharded_state_dict(state, prefix, self.fc1_layout, rows, metadata)
        return state

    def forward(
        self, hidden_states: torch.Tensor, per_token_scale: torch.Tensor | None = None, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(output, fc2 bias) like the stock MLP: the bias is left for the bias-dropout-add.

        Other keywords Megatron passes (``padding_mask``, for MoE routing) do not concern a dense
        MLP and are ignored, as the stock MLP does.
        """
        if per_token_scale is not None:
            raise ValueError("ParMLPMegatron does not support per_token_scale (MoE experts)")
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        for linear in (fc1, fc2):
            _run_forward_pre_hooks(linear, hidden_states)
        self._check_input(hidden_states)
        x = self._to_tp_region(hidden_states)
        x2d, params = x.reshape(-1, x.shape[-1]), (fc1.weight, fc1.bias, fc2.weight, None)
        if grad_needed(x2d, *params):
            packed = {"chunk": self.fc1_layout.chunk} if self.fc1_layout.packed else {}
            y = self._mlp_function(x2d, *params, inplace=self.inplace, **packed)
        else:  # eval, generation: the inference kernels, nothing saved (as ParMLP does)
            y = swiglu_mlp_inference(x2d, *params, chunk=self.fc1_layout.chunk)
        y = self._from_tp_region(y.view(*x.shape[:-1], y.shape[-1]))
        return y, fc2.bias

    def _to_tp_region(self, x: torch.Tensor) -> torch.Tensor:
        """What ColumnParallelLinear does to its input: backward all-reduces (or
        reduce-scatters, with sequence parallelism) the input gradient over TP."""
        if self.config.sequence_parallel:
            return gather_from_sequence_parallel_region(
                x, tensor_parallel_output_grad=True, group=self.tp_group
            )
        return copy_to_tensor_model_parallel_region(x, group=self.tp_group)

    def _from_tp_region(self, y: torch.Tensor) -> torch.Tensor:
        """What RowParallelLinear does to its partial sums."""
        if self.config.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(y, group=self.tp_group)
        return reduce_from_tensor_model_parallel_region(y, group=self.tp_group)

    def _check_input(self, x: torch.Tensor) -> None:
        weight = self.linear_fc1.weight
        if x.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"ParMLPMegatron supports {SUPPORTED_DTYPES}, got {x.dtype}")
        if x.dtype != weight.dtype:
            raise TypeError(
                f"ParMLPMegatron input is {x.dtype} but its weights are {weight.dtype}; "
                "wrap the model in Float16Module or cast the input"
            )
        if x.shape[-1] != weight.shape[1]:
            raise ValueError(
                f"ParMLPMegatron expects a last dim of {weight.shape[1]}, got {tuple(x.shape)}"
            )

    @property
    def impl(self) -> str:
        return self._impl

    @impl.setter
    def impl(self, name: str) -> None:
        """Switch between impls of the same fc1 layout; the layout is fixed at construction
        (optimizer state and DDP buffers hold it), so a layout change means a new model
        loading a checkpoint, which is layout-neutral."""
        self.validate_impl(name)
        keeps_chunk = name not in FIXED_CHUNKS and self.fc1_layout.packed  # save_factors: any
        chunk = self.fc1_layout.chunk if keeps_chunk else None
        needed = self._layout_for(name, chunk) if name in PACKED_IMPLS else CANONICAL
        if needed != self.fc1_layout:
            raise ValueError(
                f"{type(self).__name__} holds fc1 {self.fc1_layout}; impl {name!r} needs it "
                f"{needed}. Build the model with this impl and load a checkpoint (dist-ckpt or "
                "state_dict) instead"
            )
        self._mlp_function = get_impl(name, self.saved_fp8)
        self._impl = name

    def _layout_for(self, impl: str, chunk: int | None) -> Layout:
        """The packed layout ``impl`` reads this rank's fc1 shard in (``chunk``: asked for)."""
        local_ffn = self.linear_fc1.weight.shape[0] // 2
        size_name = "this rank's ffn size (ffn_hidden_size / tensor_model_parallel_size)"
        return Layout("packed", packed_chunk(impl, chunk, local_ffn, size_name))

    @classmethod
    def validate_impl(cls, name: str) -> None:
        """The impls this class runs (overridden where fewer fit)."""
        check_impl(name)

    def _check_linears(self, submodules: MLPSubmodules) -> None:
        """Our forward replaces the linears' own GEMMs, which only the local ones allow."""
        for label, kind in (
            ("linear_fc1", ColumnParallelLinear),
            ("linear_fc2", RowParallelLinear),
        ):
            spec = getattr(submodules, label)
            module = spec.module if isinstance(spec, ModuleSpec) else spec
            if not (isinstance(module, type) and issubclass(module, kind)):
                raise ValueError(
                    f"ParMLPMegatron needs {label} to be a local {kind.__name__}, got "
                    f"{getattr(module, '__name__', module)}; with Transformer Engine linears use "
                    "get_gpt_layer_spec(..., backend='te') (impl 'normal' only)"
                )

    def extra_repr(self) -> str:
        fp8 = ", saved_fp8=True" if self.saved_fp8 else ""
        return f"impl={self.impl!r}{fp8}, inplace={self.inplace}, fc1_layout={self.fc1_layout}"


def _run_forward_pre_hooks(linear: torch.nn.Module, hidden_states: torch.Tensor) -> None:
    """Run ``linear``'s forward pre-hooks, as calling it would: our forward reads its weights
    without calling it, and Megatron's DDP waits for those weights' all-gather in such a hook
    (``overlap_param_gather``); skipped, a step reads stale weights or breaks its next gather.

    Each hook gets the MLP's input (fc2's own input never exists outside our kernels); a hook
    that rewrites the input cannot be honoured and is refused.
    """
    for hook_id, hook in linear._forward_pre_hooks.items():
        if hook_id in linear._forward_pre_hooks_with_kwargs:
            result = hook(linear, (hidden_states,), {})
        else:
            result = hook(linear, (hidden_states,))
        if result is not None:
            raise RuntimeError(
                f"a forward pre-hook on {type(linear).__name__} ({hook!r}) returned a new input; "
                "ParMLPMegatron runs its own GEMMs and never passes input through the linear"
            )


def resolve_tp_group(
    tp_group: torch.distributed.ProcessGroup | None,
    pg_collection: Any | None,
    owner: str,
    needs_group: bool = True,
) -> torch.distributed.ProcessGroup | None:
    """The TP group this MLP shards and reduces over: the one it was given, never a guess.

    Given a ``pg_collection`` (megatron-core 0.18+ TransformerLayers pass the model's) or a
    ``tp_group`` (0.16-0.17 pass ``pg_collection.tp``), that group; both must agree. Given
    neither, ``parallel_state``'s global TP group, as the stock MLP takes. With no
    ``parallel_state`` either, the model may well have groups of its own that did not reach us:
    refused rather than built unsharded or on the wrong ranks. Only a single process without
    torch.distributed and Megatron's own linears (``needs_group=False``) runs without a group.
    """
    if pg_collection is not None:
        if getattr(pg_collection, "tp", None) is None:
            raise ValueError(f"{owner}: pg_collection has no tp group; set pg_collection.tp")
        if tp_group is not None and tp_group is not pg_collection.tp:
            raise ValueError(
                f"{owner}: tp_group (ranks {_ranks(tp_group)}) and pg_collection.tp (ranks "
                f"{_ranks(pg_collection.tp)}) are different groups; pass one of them"
            )
        return pg_collection.tp
    if tp_group is not None:
        return tp_group
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_group()
    if needs_group or torch.distributed.is_initialized():
        raise ValueError(
            f"{owner} got no TP process group and megatron.core.parallel_state is not "
            "initialized, so it cannot know which ranks share its weights: pass tp_group= or "
            "pg_collection= (TransformerLayer and GPTModel(pg_collection=...) pass the model's), "
            "or call parallel_state.initialize_model_parallel for the global groups"
        )
    return None


def _ranks(group: torch.distributed.ProcessGroup) -> list[int]:
    return torch.distributed.get_process_group_ranks(group)
