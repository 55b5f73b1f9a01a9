"""The MLP variants the benchmark races, each built over the same canonical weights.

A variant turns one layer's weights into a callable ``x -> y``. Peers are imported lazily; a
peer that does not import is reported as skipped with the reason, never silently dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from swiglu_train.layers import ParMLP
from swiglu_train.layers.layout import CANONICAL, relayout
from swiglu_train.layers.registry import SAVED_FP8_IMPLS, impl_label
from swiglu_train.ops import drop_h_mlp, reference, save_factors_mlp

Layer = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class LayerWeights:
    """One layer's canonical parameters: fc1 [2F, D] = [W_gate; W_up] and fc2 [O, F]."""

    fc1: torch.nn.Parameter
    fc2: torch.nn.Parameter

    @classmethod
    def random(cls, d: int, f: int, o: int, dtype: torch.dtype, device: str) -> LayerWeights:
        def param(rows: int, cols: int) -> torch.nn.Parameter:
            w = torch.randn(rows, cols, dtype=dtype, device=device) / cols**0.5
            return torch.nn.Parameter(w)

        return cls(param(2 * f, d), param(o, f))

    def parameters(self) -> list[torch.nn.Parameter]:
        return [self.fc1, self.fc2]


def eager(w: LayerWeights) -> Layer:
    """Megatron-core's eager MLP: two cuBLAS GEMMs around ``F.silu(x1) * x2``."""
    return lambda x: reference.mlp(x, w.fc1, None, w.fc2, None)


def ours(
    impl: str, inplace: bool = True, saved_fp8: bool = False
) -> Callable[[LayerWeights], Layer]:
    def build(w: LayerWeights) -> Layer:
        d, f, o = w.fc1.shape[1], w.fc2.shape[1], w.fc2.shape[0]
        mlp = ParMLP(d, f, o, impl=impl, inplace=inplace, saved_fp8=saved_fp8, device="meta")
        mlp.fc2.weight = w.fc2
        if mlp.fc1_layout.packed:  # its own packed copy of the canonical weight
            mlp.fc1.weight = torch.nn.Parameter(relayout(w.fc1.detach(), CANONICAL, mlp.fc1_layout))
        else:
            mlp.fc1.weight = w.fc1
        return mlp

    return build


def quack_fused_dynamic(impl: str, with_fc1: bool) -> Callable[[LayerWeights], Layer]:
    """diagnostic (issue 18): quack impl ``impl`` with its fused grad_h GEMM (and, with
    ``with_fc1``, its fused fc1 GEMM) on quack's dynamic tile schedule instead of the static
    one (``ops.quack_mlp.FusedSchedule``), on the impl's own parameters."""

    def build(w: LayerWeights) -> Layer:
        from swiglu_train.layers.registry import get_impl
        from swiglu_train.ops.quack_mlp import FusedSchedule

        mlp, function = ours(impl)(w), get_impl(impl)
        dynamic = FusedSchedule(fc1=with_fc1, grad_h=True)
        fc1, fc2 = mlp.fc1.weight, mlp.fc2.weight
        return lambda x: function(x, fc1, None, fc2, None, dynamic=dynamic)

    return build


def drop_h_fused(w: LayerWeights) -> Layer:
    """drop_h with h and the saved preact from one gated GEMM (the forward-fusion candidate)."""
    return lambda x: drop_h_mlp(x, w.fc1, None, w.fc2, None, fused_forward=True)


def save_factors_fused(w: LayerWeights) -> Layer:
    """save_factors with fc1 and the factors from one gated GEMM (the forward-fusion candidate),
    on the same packed parameters as the ``save_factors`` variant."""
    mlp = ours("save_factors")(w)
    fc1, fc2, chunk = mlp.fc1.weight, mlp.fc2.weight, mlp.fc1_layout.chunk
    return lambda x: save_factors_mlp(x, fc1, None, fc2, None, chunk=chunk, fused_forward=True)


def liger(w: LayerWeights) -> Layer:
    """Liger-Kernel's fused gate/up SiLU-mul on the [gate | up] preact, in place in backward."""
    from liger_kernel.ops.swiglu import LigerFusedGateUpSiLUMulFunction

    def layer(x: torch.Tensor) -> torch.Tensor:
        # Liger's backward returns a 2D grad, so the preact must be 2D (true of x here).
        h = LigerFusedGateUpSiLUMulFunction.apply(F.linear(x, w.fc1), True)
        return F.linear(h, w.fc2)

    return layer


def fla(w: LayerWeights) -> Layer:
    """FLA's swiglu_linear (x is the gate): h is recomputed inside fc2's backward."""
    from fla.modules.activations import swiglu_linear

    def layer(x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, w.fc1).chunk(2, dim=-1)
        return swiglu_linear(gate, up, w.fc2, None)

    return layer


def quack(tuned: bool) -> Callable[[LayerWeights], Layer]:
    """quack's CuTe-DSL MLP with the activation fused into its GEMM epilogues; ``tuned``
    autotunes each GEMM once per shape (minutes of warm-up), as quack's own default does.

    ``concat_layout=True`` reads our canonical [W_gate; W_up]; quack's default is interleaved.
    """

    def build(w: LayerWeights) -> Layer:
        from quack.mlp import mlp_func

        return lambda x: mlp_func(
            x, w.fc1, w.fc2, activation="swiglu", tuned=tuned, concat_layout=True
        )

    return build


def float8_convert(module: torch.nn.Module, recipe: str) -> torch.nn.Module:
    """torchao's ``convert_to_float8_training`` with one of its named recipes (the fp8 extra)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    return convert_to_float8_training(module, config=Float8LinearConfig.from_recipe_name(recipe))


def ours_float8(
    impl: str, recipe: str, compile_: bool = False, saved_fp8: bool = False
) -> Callable[[LayerWeights], Layer]:
    """Our impl on fc1/fc2 that torchao converted (issue 48): drop_h runs their recipes in its
    own GEMMs (its preactivation kept in FP8 with ``saved_fp8``), normal runs their forwards;
    torch.compile'd as ``pretrain --float8`` runs it."""

    def build(w: LayerWeights) -> Layer:
        mlp = float8_convert(ours(impl, saved_fp8=saved_fp8)(w), recipe)
        return torch.compile(mlp) if compile_ else mlp

    return build


class _TorchaoMLP(torch.nn.Module):
    """torchao's FP8 MLP, the peer: two linears on the shared weights, SwiGLU in torch."""

    def __init__(self, w: LayerWeights) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(w.fc1.shape[1], w.fc1.shape[0], bias=False, device="meta")
        self.fc2 = torch.nn.Linear(w.fc2.shape[1], w.fc2.shape[0], bias=False, device="meta")
        self.fc1.weight, self.fc2.weight = w.fc1, w.fc2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(reference.swiglu(self.fc1(x)))


def torchao_float8(recipe: str, compile_: bool) -> Callable[[LayerWeights], Layer]:
    """torchao's Float8Linear MLP (torchtitan's float8 converter), eager or torch.compile'd,
    as torchao recommends running it."""

    def build(w: LayerWeights) -> Layer:
        mlp = float8_convert(_TorchaoMLP(w), recipe)
        return torch.compile(mlp) if compile_ else mlp

    return build


def compiled(w: LayerWeights) -> Layer:
    """torch.compile (inductor) of the eager MLP."""
    return torch.compile(eager(w))


BUILDERS: dict[str, Callable[[LayerWeights], Layer]] = {
    "eager": eager,
    "compile": compiled,
    "normal": ours("normal"),
    "drop_h": ours("drop_h"),
    "drop_h_fused": drop_h_fused,
    "save_factors": ours("save_factors"),
    "save_factors_fused": save_factors_fused,
    "drop_h_quack": ours("drop_h_quack"),
    # diagnostic: quack's dgated GEMM writing grad_preact to a new buffer instead of over the
    # preact it reads (a higher backward peak); does the aliasing cost drop_h_quack time?
    "drop_h_quack_out_of_place": ours("drop_h_quack", inplace=False),
    "save_factors_quack": ours("save_factors_quack"),
    # the opt-in FP8-saved preactivation (issue 19), named as the planner and profiler name it
    **{impl_label(impl, True): ours(impl, saved_fp8=True) for impl in SAVED_FP8_IMPLS},
    # diagnostics: the fused GEMMs' tile schedule (static in the impls); see quack_fused_dynamic
    **{
        f"{impl}_dynamic_{which}": quack_fused_dynamic(impl, with_fc1=which == "fused")
        for impl in ("drop_h_quack", "save_factors_quack")
        for which in ("grad_h", "fused")
    },
    # FP8 GEMMs (issue 48): ours on torchao-converted linears, and torchao's own MLP
    **{
        f"{impl_label(impl, saved, recipe)}{'_compile' if c else ''}": ours_float8(
            impl, recipe, c, saved
        )
        for impl, saved in (("drop_h", False), ("drop_h", True), ("normal", False))
        for recipe in ("tensorwise", "rowwise")
        for c in (False, True)
    },
    **{
        f"torchao_float8_{recipe}{'_compile' if c else ''}": torchao_float8(recipe, c)
        for recipe in ("tensorwise", "rowwise")
        for c in (False, True)
    },
    "liger": liger,
    "fla": fla,
    "quack": quack(tuned=False),
    "quack_tuned": quack(tuned=True),
}
