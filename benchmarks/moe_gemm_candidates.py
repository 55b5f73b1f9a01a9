"""What ``sweep_moe_gemm_configs.py`` measures: which quack configs each of drop_h_quack's six
varlen GEMMs can take, the operands ``experts_quack`` hands quack and their ``torch._grouped_mm``
twins, the calls, and ``rel_err``, which checks one call's output against another's. Kept apart
from the timing and the report so that the rules deciding what is measured read on their own,
and are tested on CPU.

A config is named ``{tile_m}x{tile_n}-{pp|coop}-{cluster_m}x{cluster_n}-{static|dynamic}``. Each
(model, routing) point builds the GEMMs' operands as ``experts_quack`` passes them
(``operands``; h stands for both h and w·h) and their twins as ``bench.moe.floor`` does.

Explicit configs go through ``quack.gemm_interface.gemm_tuned.fn(A, B, out, config=...)``,
the undecorated function that quack's own ``gemm(..., tuned=False)`` calls with
``config=None`` (it then takes ``default_config``): a candidate differs from the shipped call
in its config alone. The public alternatives cannot: ``gemm_tuned`` autotunes, and
``gemm``/``gemm_out`` take no config. That entry point skips the autotuner's pruning, so
``unsupported`` mirrors quack 0.6.5's rules (``gemm_config.config_supports``, ``gemm_tuned``'s
asserts, ``GemmSm90``'s tile limits).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from swiglu_train.bench.moe.routing import make_routing
from swiglu_train.bench.moe.shapes import MoEShape
from swiglu_train.bench.moe.weights import ExpertWeights
from swiglu_train.ops.experts_routing import route
from swiglu_train.ops.quack_mlp import quack_gemm, require_quack

GEMMS = ("fc1", "fc2", "grad_h", "grad_W2", "grad_xg", "grad_W1")
GATHERED = frozenset({"fc1", "grad_h", "grad_W2", "grad_W1"})  # quack gathers A through A_idx
VARLEN_K = frozenset({"grad_W2", "grad_W1"})  # per-expert contraction; the others are varlen_m
# In order: a GEMM takes the first --max-configs that quack can run for it. Tiles from quack's
# SM90 autotune list (gemm_config._get_sm90_configs) plus tile_n 64/96 and cluster 1x1, which it
# lacks; most vary one thing from the default, 128x192-pp-2x1-static.
CONFIGS = (
    "128x128-pp-2x1-static",
    "128x256-coop-2x1-static",
    "256x128-coop-2x1-static",
    "256x192-coop-2x1-static",
    "192x128-pp-2x1-static",
    "128x192-coop-2x1-static",
    "128x192-pp-1x1-static",
    "128x96-pp-2x1-static",
    "128x192-pp-2x1-dynamic",  # not gathered GEMMs
    "128x208-pp-2x1-static",  # not gathered GEMMs
    "128x160-pp-2x1-static",
    "128x64-pp-2x1-static",
    "128x128-pp-1x1-static",
)
LABEL = re.compile(r"([0-9]+)x([0-9]+)-(pp|coop)-([12])x([12])-(static|dynamic)(-swap)?")


@dataclass(frozen=True)
class Config:
    """The fields of an SM90 quack GemmConfig that the sweep varies."""

    tile_m: int
    tile_n: int
    pingpong: bool
    cluster_m: int
    cluster_n: int
    dynamic: bool  # quack's dynamic persistent tile scheduler, else its static one
    swap_ab: bool = False

    @property
    def label(self) -> str:
        kind, schedule = "pp" if self.pingpong else "coop", "dynamic" if self.dynamic else "static"
        swap = "-swap" if self.swap_ab else ""
        return (
            f"{self.tile_m}x{self.tile_n}-{kind}-{self.cluster_m}x{self.cluster_n}-{schedule}{swap}"
        )

    @classmethod
    def parse(cls, label: str) -> Config:
        match = LABEL.fullmatch(label.strip())
        if not match:
            raise ValueError(f"config {label!r}: expected e.g. 128x192-pp-2x1-static")
        m, n, kind, cm, cn, schedule, swap = match.groups()
        return cls(
            int(m), int(n), kind == "pp", int(cm), int(cn), schedule == "dynamic", bool(swap)
        )

    @classmethod
    def of(cls, c) -> Config:
        """From a quack GemmConfig."""
        return cls(c.tile_m, c.tile_n, c.pingpong, c.cluster_m, c.cluster_n,
                   c.is_dynamic_persistent, c.swap_ab)  # fmt: skip

    def quack(self):
        from quack.gemm_config import GemmConfig

        return GemmConfig(
            tile_m=self.tile_m, tile_n=self.tile_n, pingpong=self.pingpong,
            cluster_m=self.cluster_m, cluster_n=self.cluster_n,
            is_dynamic_persistent=self.dynamic, swap_ab=self.swap_ab, device_capacity=9,
        )  # fmt: skip


def unsupported(c: Config, gemm: str) -> str | None:
    """Why quack 0.6.5's SM90 GEMM cannot run ``c`` as ``gemm``, or None. Every GEMM here is
    varlen_m or gathered, which rule out swap_ab; tile_m 64 is valid but not swept."""
    if c.swap_ab:
        return "swap_ab: quack runs no varlen_m or gathered GEMM swapped"
    if gemm in GATHERED:
        if c.cluster_n != 1:
            return "gather_A needs cluster_n = 1"
        if c.tile_n == 208 or c.dynamic:
            return "gather_A on SM90 takes neither tile_n 208 nor the dynamic scheduler"
    if c.tile_n % 16:
        return "tile_n must be a multiple of 16"
    if c.pingpong:
        limit = {128: 208, 192: 128}.get(c.tile_m)
    else:  # 192x256 aborts the process (quack's list says); past 256x208 the accumulator spills
        limit = {128: 256, 192: 224, 256: 208}.get(c.tile_m)
        if c.tile_m == 192 and c.tile_n % 32:
            return "cooperative tile_m 192 needs tile_n a multiple of 32"
    if limit is None:
        return f"tile_m {c.tile_m} is not swept {'pingpong' if c.pingpong else 'cooperative'}"
    if c.tile_n > limit:
        return f"tile_n {c.tile_n} is past {limit} at this tile_m"
    return None


def candidates(gemm: str, configs: Sequence[Config], default: Config, limit: int) -> list[Config]:
    """The first ``limit`` of ``configs`` that quack can run as ``gemm``, less the default (timed
    anyway)."""
    return [c for c in configs if c != default and unsupported(c, gemm) is None][:limit]


@dataclass
class Point:
    """One (model, routing): what the six GEMMs read, rows sorted by expert as ``route`` sorts."""

    shape: MoEShape
    routing: str
    x: torch.Tensor  # [T, D]
    grad_y: torch.Tensor  # [T, D]
    fc1: torch.Tensor  # [E, 2F, D]
    fc2: torch.Tensor  # [E, D, F]
    h: torch.Tensor  # [R, F]
    grad_preact: torch.Tensor  # [R, 2F]
    token: torch.Tensor  # [R] int64: each sorted row's token
    cu: torch.Tensor  # [E + 1] int32: quack's cu_seqlens
    a_idx: torch.Tensor  # [R] int32: quack's A_idx
    offs: torch.Tensor  # [E] int32: torch._grouped_mm's offsets (cu without its 0)

    @property
    def rows_per_expert(self) -> list[int]:
        return self.cu.diff().tolist()


def make_point(
    shape: MoEShape, routing: str, tokens: int, seed: int, device: torch.device | str,
    dtype: torch.dtype = torch.bfloat16,
) -> Point:  # fmt: skip
    indices, router = make_routing(routing, tokens, shape.e, shape.k, seed, device)
    plan = route(indices, router, shape.e)
    w = ExpertWeights.random(shape.e, shape.d, shape.f, dtype, device, seed)
    gen = torch.Generator(device).manual_seed(seed + 1)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, device=device, dtype=dtype)

    rows = plan.token.numel()
    cu = torch.cat([plan.offsets.new_zeros(1), plan.offsets])  # as experts_quack._varlen
    return Point(
        shape, routing, randn(tokens, shape.d), randn(tokens, shape.d), w.fc1.detach(),
        w.fc2.detach(), randn(rows, shape.f), randn(rows, 2 * shape.f), plan.token, cu,
        plan.token.to(torch.int32), plan.offsets,
    )  # fmt: skip


@dataclass
class GemmOperands:
    """One GEMM as ``experts_quack`` calls quack (a, b, varlen; ``out`` for candidates to write)
    and as ``bench.moe.floor`` calls ``torch._grouped_mm`` (twin_a, twin_b, offs)."""

    name: str
    a: torch.Tensor
    b: torch.Tensor
    out: torch.Tensor
    varlen: dict[str, torch.Tensor]
    twin_a: torch.Tensor
    twin_b: torch.Tensor
    offs: torch.Tensor
    # grad_W1: experts_quack hands quack the transposed view of an [E, 2F, D] buffer as out,
    # which the twin writes as is; every other call lets quack allocate its out
    out_view: bool = False

    @property
    def mnk(self) -> tuple[int, int, int]:
        """Total sizes: M sums the experts' rows (varlen_m), or K does (varlen_k)."""
        if self.name in VARLEN_K:
            return self.a.shape[0], self.b.shape[-1], self.b.shape[0]
        return self.out.shape[0], self.b.shape[-1], self.a.shape[-1]


def operands(p: Point, gemm: str) -> GemmOperands:
    rows, (e, d, f) = p.token.numel(), p.fc2.shape

    def out(*size: int) -> torch.Tensor:
        return torch.empty(size, dtype=p.x.dtype, device=p.x.device)

    on_m, on_k, idx = {"cu_seqlens_m": p.cu}, {"cu_seqlens_k": p.cu}, {"A_idx": p.a_idx}
    if gemm == "fc1":  # preact [R, 2F] = x[token] fc1ᵀ
        xg = p.x[p.token]
        return GemmOperands(gemm, p.x, p.fc1.mT, out(rows, 2 * f), on_m | idx, xg, p.fc1.mT, p.offs)
    if gemm == "fc2":  # [R, D] = h fc2ᵀ
        return GemmOperands(gemm, p.h, p.fc2.mT, out(rows, d), on_m, p.h, p.fc2.mT, p.offs)
    if gemm == "grad_h":  # [R, F] = grad_y[token] fc2
        yg = p.grad_y[p.token]
        return GemmOperands(gemm, p.grad_y, p.fc2, out(rows, f), on_m | idx, yg, p.fc2, p.offs)
    if gemm == "grad_W2":  # [E, D, F] = grad_y[token]ᵀ (w·h), per expert
        yg = p.grad_y[p.token]
        return GemmOperands(gemm, p.grad_y.T, p.h, out(e, d, f), on_k | idx, yg.T, p.h, p.offs)
    if gemm == "grad_xg":  # [R, D] = grad_preact fc1
        g = p.grad_preact
        return GemmOperands(gemm, g, p.fc1, out(rows, d), on_m, g, p.fc1, p.offs)
    if gemm == "grad_W1":  # [E, 2F, D] = grad_preactᵀ x[token], per expert
        g, xg = p.grad_preact, p.x[p.token]
        buf = out(e, 2 * f, d).mT
        return GemmOperands(gemm, p.x.T, g, buf, on_k | idx, g.T, xg, p.offs, out_view=True)
    raise ValueError(f"unknown GEMM {gemm!r}; choose from {GEMMS}")


def shipped(op: GemmOperands) -> torch.Tensor:
    """The call ``experts_quack`` makes: quack's untuned default config."""
    out = torch.empty_like(op.out) if op.out_view else None  # empty_like keeps the view's strides
    return quack_gemm()(op.a, op.b, out=out, **op.varlen)


def run_config(op: GemmOperands, config) -> torch.Tensor:
    """The same call with ``config`` (a quack GemmConfig), into the preallocated out."""
    require_quack().gemm_tuned.fn(op.a, op.b, op.out, config=config, **op.varlen)
    return op.out


def run_twin(op: GemmOperands) -> torch.Tensor:
    out = torch._grouped_mm(op.twin_a, op.twin_b, offs=op.offs)
    return out.mT if op.out_view else out


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """‖got - want‖ / ‖want‖ in fp32, a slice of dim 0 at a time (a grad_W is GBs). NaN (an
    unwritten element of a NaN-filled out) stays NaN."""
    step = max(1, (1 << 24) // max(1, want.numel() // max(1, want.shape[0])))
    num = den = 0.0
    for start in range(0, want.shape[0], step):
        w = want[start : start + step].float()
        num += (got[start : start + step].float() - w).square().sum().item()
        den += w.square().sum().item()
    return math.sqrt(num / den) if den else (0.0 if num == 0 else math.inf)


def output_tiles(gemm: str, rows_per_expert: Sequence[int], m: int, n: int, c: Config) -> int:
    """Output tiles the scheduler hands out: each expert's rows in tile_m (varlen_m), or each
    expert's whole [M, N] (varlen_k, an empty expert's zeros included)."""
    n_tiles = -(-n // c.tile_n)
    if gemm in VARLEN_K:
        return len(rows_per_expert) * -(-m // c.tile_m) * n_tiles
    return sum(-(-r // c.tile_m) for r in rows_per_expert) * n_tiles
