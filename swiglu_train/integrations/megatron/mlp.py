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

Which TP group it runs on, the collectives around the local math and the DDP hooks of the
linears it never calls are :mod:`.parallel`'s; what it refuses, :mod:`.checks`'s.

Known gap: with sequence parallelism our Function saves the all-gathered input [s, b, h],
where the stock ColumnParallelLinear saves its [s/tp, b, h] shard and gathers it again in
backward.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from swiglu_train.integrations.megatron.checks import (
    check_chunk,
    check_config,
    check_impl,
    check_input,
    check_local_linears,
)
from swiglu_train.integrations.megatron.packed import (
    convert_on_load,
    pack_sharded_state_dict,
    stamp_packed,
)
from swiglu_train.integrations.megatron.parallel import (
    MLPDispatch,
    from_tp_region,
    resolve_tp_group,
    run_forward_pre_hooks,
    to_tp_region,
)
from swiglu_train.layers.layout import CANONICAL, Layout, relayout
from swiglu_train.layers.registry import (
    FIXED_CHUNKS,
    PACKED_IMPLS,
    check_saved_fp8,
    get_impl,
    packed_chunk,
)
from swiglu_train.ops.inference import grad_needed, swiglu_mlp_inference

# MLP.__init__ keywords differ across megatron-core versions; pass only those it takes.
_BASE_INIT_PARAMS = frozenset(inspect.signature(MLP.__init__).parameters)


class ParMLPMegatron(MLP, metaclass=MLPDispatch):
    """Drop-in for ``megatron.core.transformer.mlp.MLP`` (local backend) running ``impl``.

    ``bias_activation_fusion`` is ignored: our impl replaces that path whatever its value.
    ``inplace=False`` lets a ``drop_h`` or ``save_factors`` graph be backpropagated twice.
    ``saved_fp8=True`` (``drop_h`` only) saves the preactivation in FP8, as ParMLP's does.
    ``chunk`` is the packed layout's chunk under ``save_factors``; it must divide this rank's
    ffn size F/tp (default: ``gcd(F/tp, 128)``). ``save_factors_quack`` packs with chunk 1.
    The TP group comes from ``pg_collection`` or ``tp_group``
    (see :func:`~.parallel.resolve_tp_group`).
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
            run_forward_pre_hooks(linear, hidden_states)
        check_input(hidden_states, fc1.weight)
        x = to_tp_region(hidden_states, self.config.sequence_parallel, self.tp_group)
        x2d, params = x.reshape(-1, x.shape[-1]), (fc1.weight, fc1.bias, fc2.weight, None)
        if grad_needed(x2d, *params):
            packed = {"chunk": self.fc1_layout.chunk} if self.fc1_layout.packed else {}
            y = self._mlp_function(x2d, *params, inplace=self.inplace, **packed)
        else:  # eval, generation: the inference kernels, nothing saved (as ParMLP does)
            y = swiglu_mlp_inference(x2d, *params, chunk=self.fc1_layout.chunk)
        y = y.view(*x.shape[:-1], y.shape[-1])
        y = from_tp_region(y, self.config.sequence_parallel, self.tp_group)
        return y, fc2.bias

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
        """Only local linears (overridden where Megatron's linears run their own GEMMs)."""
        check_local_linears(submodules)

    def extra_repr(self) -> str:
        fp8 = ", saved_fp8=True" if self.saved_fp8 else ""
        return f"impl={self.impl!r}{fp8}, inplace={self.inplace}, fc1_layout={self.fc1_layout}"
