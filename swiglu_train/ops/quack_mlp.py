"""The ``drop_h_quack`` impl: drop_h on quack's CuTe-DSL GEMMs, SwiGLU in both epilogues.

Forward is one GEMM that writes h and the preactivation (quack's ``gemm_gated``), then fc2.
Backward is one GEMM that computes grad_h = grad_y @ W2 and, in its epilogue, both grad_preact
(from the saved preactivation) and h again for fc2's weight grad (``gemm_dgated``): grad_h
never reaches memory. With ``inplace`` grad_preact is written over the saved preactivation;
each output tile reads its own preact tile before writing it, so the aliasing is safe, and
backward allocates no [M, 2F] buffer. The other four GEMMs run on quack (untuned, on its
static or dynamic persistent schedule) or cuBLAS, as ``ops.gemm_choice`` says; grad_x and grad_W1
pair the interleaved grad_preact with the canonical fc1, which quack does inside its GEMM
(``concat_layout``) and cuBLAS through ``ops.concat_gemm``.
Fusing SwiGLU into the GEMM epilogues is the route to the floor that our Triton GEMMs cannot
take on the H200 (Triton 3.6 trails cuBLAS by 4-17 % there, and its Hopper warp specialization
miscompiles the gated GEMM: benchmarks/results/gemm/probe_ws_h200.json).

Saved tensors are drop_h's (x and the [M, 2F] preactivation). quack keeps the preactivation
gate/up interleaved per column, but its ``concat_layout`` reads fc1 and writes fc1's grads in
our canonical [W_gate; W_up], so parameters, checkpoints and optimizer state are drop_h's.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from typing import NamedTuple

import torch

from swiglu_train.extras import MissingExtra, install_command
from swiglu_train.kernels.runtime import device_capability
from swiglu_train.ops import gemm_choice
from swiglu_train.ops.concat_gemm import concat_grad_w1, concat_grad_x
from swiglu_train.ops.fc2_node import Fc2Handoff, fc2_grad_y, fc2_or_h, with_fc2_node
from swiglu_train.ops.mlp import (
    SECOND_BACKWARD_ERROR,
    SECOND_BACKWARD_FREED_ERROR,
    claim_inplace_backward,
    drop_h_mlp,
    refuse_double_backward,
    save_drop_h,
)

QUACK_DTYPES = (torch.bfloat16, torch.float16)
ALIGN = 8  # quack's TMA operands need 16-byte rows: 8 elements of a 16-bit dtype


@functools.cache
def require_quack():
    """quack's GEMM interface, imported on first use (it loads the CUTLASS DSL)."""
    try:
        from quack import gemm_interface
    except ImportError as e:
        raise MissingExtra(
            "impls 'drop_h_quack' and 'save_factors_quack' need the quack-kernels package and a "
            "Hopper GPU (CUDA compute capability 9.x)",
            "quack",
        ) from e
    remember_missing_module(QUACK_OPTIONAL_HEURISTICS)
    return gemm_interface


# quack 0.6.5 asks for nvMatmulHeuristics (its optional "heuristics" extra) on every untuned
# GEMM that misses its plan cache, which every concat_layout GEMM does (drop_h_quack's grad_x
# and grad_W1), and Python searches sys.path again for a module it did not find before: 16
# path scans a drop_h_quack step, about 0.4 ms of the H200 host's time under cProfile
# (benchmarks/results/host/probe_quack_host_before_h200.json, [2048, 4096, 11008]; none since).
QUACK_OPTIONAL_HEURISTICS = "nvMatmulHeuristics"


def remember_missing_module(name: str) -> None:
    """Make later imports of a module that is not installed fail at once: Python's negative
    entry (None in sys.modules) raises the same ImportError without searching sys.path. An
    installed or already imported module is left alone; one installed later in the same
    process stays refused until the entry is deleted."""
    if name not in sys.modules and importlib.util.find_spec(name) is None:
        sys.modules[name] = None


@functools.cache  # one partial per schedule, not one per GEMM of every step
def quack_gemm(dynamic: bool = False) -> functools.partial:
    """quack's plain GEMM as the quack impls call it: untuned (no per-shape autotune stall), on
    the static or the dynamic persistent schedule, as ``gemm_choice`` has it for this GEMM
    (its defaults, or what ``swiglu-train pretune`` timed)."""
    return functools.partial(require_quack().gemm, tuned=False, dynamic_scheduler=dynamic)


class FusedSchedule(NamedTuple):
    """Which fused GEMMs of a quack impl run on quack's dynamic tile schedule: fc1's (the
    gated or factors epilogue) and grad_h's (the dgated or factors-to-grad epilogue). Unlike
    the plain GEMMs (``gemm_choice``) they have no cuBLAS twin, so pretune does not time them.
    Both run static, measured queued at the 12 grid shapes, M = 8000
    (grid_fused_schedule_m8000_h200.json): dynamic grad_h made ``save_factors_quack`` 1.2-1.7
    points slower at every shape, and moved ``drop_h_quack`` by at most 0.2 points except at
    D = 8192 (+1.4); fc1 dynamic too: -0.6 to +0.9. quack's own MLP runs grad_h dynamic."""

    fc1: bool = False
    grad_h: bool = False


STATIC_FUSED = FusedSchedule()


# The GEMMs that pair drop_h_quack's interleaved grad_preact with the canonical fc1: quack
# does it inside the GEMM (this concat_layout), cuBLAS through ops.concat_gemm's copies.
CONCAT_LAYOUTS = {"grad_x_concat": ("B",), "grad_w1_concat": ("out",)}


def gemm_on(
    library: str, gemm: str, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``gemm``'s a @ b (+ bias) on ``library``: what training runs and pretune times."""
    if library in (gemm_choice.QUACK, gemm_choice.QUACK_DYNAMIC):
        layout = CONCAT_LAYOUTS.get(gemm)
        run = quack_gemm(library == gemm_choice.QUACK_DYNAMIC)
        return run(a, b, bias=bias, **({"concat_layout": layout} if layout else {}))
    if gemm == "grad_x_concat":
        return concat_grad_x(a, b)
    if gemm == "grad_w1_concat":  # a = grad_preactᵀ
        return concat_grad_w1(a.t(), b)
    return a @ b if bias is None else torch.addmm(bias, a, b)


def chosen_gemm(
    gemm: str, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """a @ b (+ bias) on quack or cuBLAS, whichever ``gemm_choice`` has for this GEMM here."""
    return gemm_on(gemm_choice.backend(gemm, a, b), gemm, a, b, bias)


HOPPER = 9  # the one compute capability major our quack GEMMs and epilogues were built for


def capability_refusal(capability: tuple[int, int]) -> str | None:
    """Why the quack impls refuse a GPU of this compute capability, or None on Hopper.

    Not ``>= 9``: quack 0.6.5 would mint our ``@gemm_epilogue`` classes on its SM100 GEMM
    (``quack.epilogue.frontend._SM_BASE``), but there an epilogue is handed packed f32x2 values
    where our FP8 decode takes f32 scalars, our tile configs come from its SM90 space, and none
    of it has run on such a GPU: a refusal in one line, never a compiler trace or an untested
    number (docs/gpus.md)."""
    major, minor = capability
    if major == HOPPER:
        return None
    if major < HOPPER:
        return f"compute capability {major}.{minor} is below 9.0 (Hopper)"
    return (
        f"compute capability {major}.{minor} is not Hopper (9.x): our quack GEMM configs and "
        "epilogues are built for sm_90 and untested on newer GPUs"
    )


def quack_unavailable_reason() -> str | None:
    """Why the quack impls cannot run on the current CUDA device, or None when they can."""
    return _unavailable_reason(torch.cuda.current_device() if torch.cuda.is_available() else -1)


@functools.cache
def _unavailable_reason(device_index: int) -> str | None:
    """Per device, once: the no-grad dispatch asks on every call."""
    if device_index < 0:
        return "no CUDA GPU"
    reason = capability_refusal(device_capability(device_index))
    if reason is not None:
        return reason
    try:
        require_quack()
    except ImportError:
        return f"quack-kernels is not installed ({install_command('quack')})"
    except Exception as e:  # an installed quack that fails to load must not break other impls
        return f"quack-kernels failed to load: {type(e).__name__}: {e}"
    return None


def quack_available() -> bool:
    """Whether the quack impls can run on the current CUDA device (``auto`` asks this)."""
    return quack_unavailable_reason() is None


def check_quack_inputs(
    x: torch.Tensor, fc1_weight: torch.Tensor, fc2_weight: torch.Tensor, impl: str = "drop_h_quack"
) -> None:
    """A clear error for anything quack's kernels cannot take, before any kernel is built;
    it names ``impl`` and the portable impl with the same saved tensors."""
    portable = impl.removesuffix("_quack")
    if not x.is_cuda:
        raise ValueError(f"impl {impl!r} runs on CUDA only; the input is on {x.device}")
    refusal = capability_refusal(device_capability(x.get_device()))  # x.device.index, faster
    if refusal is not None:
        raise ValueError(
            f"impl {impl!r} cannot run on {x.device}: {refusal}; use impl {portable!r}"
        )
    if x.dtype not in QUACK_DTYPES:
        raise TypeError(f"impl {impl!r} needs bf16 or fp16 tensors, got {x.dtype}")
    (out, ffn), hidden = fc2_weight.shape, fc1_weight.shape[1]
    if hidden % ALIGN or ffn % ALIGN or out % ALIGN:
        sizes = {"hidden": hidden, "ffn": ffn, "out": out}
        odd = {name: n for name, n in sizes.items() if n % ALIGN}
        raise ValueError(
            f"impl {impl!r} needs sizes that are multiples of {ALIGN} (16-byte rows "
            f"for TMA); got {odd}: use impl {portable!r}"
        )


def quack_sizes_ok(hidden_size: int, ffn_hidden_size: int) -> bool:
    """D and F as quack's TMA operands need them: 16-byte rows."""
    return hidden_size % ALIGN == 0 and ffn_hidden_size % ALIGN == 0


def quack_serves(x: torch.Tensor, fc1_weight: torch.Tensor) -> bool:
    """Whether quack's gated GEMM can take this no-grad call (the dispatch's "quack" path):
    both of its fc1 readings (concat_layout's [W_gate; W_up], or pairs interleaved) run
    along fc1's rows, so fc1 must be row-major."""
    sizes_ok = quack_sizes_ok(x.shape[1], fc1_weight.shape[0] // 2)
    row_major = fc1_weight.stride(1) == 1
    return x.is_cuda and x.dtype in QUACK_DTYPES and sizes_ok and row_major and quack_available()


def quack_swiglu_projection(
    x: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc1_bias: torch.Tensor | None,
    interleaved: bool = False,
) -> torch.Tensor:
    """h [M, F] from quack's GEMM with the SwiGLU epilogue, no preactivation stored.

    fc1 is canonical [W_gate; W_up], or with ``interleaved`` packed with chunk 1
    (save_factors_quack's layout), which is quack's own pair order. Up to SMALL_M rows on
    Hopper the config comes from the wave-fill rule (``small_m_tile_n``).
    """
    config = None
    if not torch.compiler.is_compiling() and _hopper(x):  # a config pin is eager-only in quack
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        tile_n = small_m_tile_n(x.shape[0], fc1_weight.shape[0], sms)
        config = None if tile_n is None else n_clustered_config(tile_n)
    return quack_gated_h(x, fc1_weight, fc1_bias, interleaved, config)


def quack_gated_h(
    x: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc1_bias: torch.Tensor | None,
    interleaved: bool,
    config: object | None,
) -> torch.Tensor:
    """quack's gated GEMM with a given config (None: quack's default for the arch)."""
    options = {} if interleaved else {"concat_layout": ("B", "bias")}
    if config is not None:
        options["config"] = config
    _, h = require_quack().gemm_gated(
        x, fc1_weight.t(), bias=fc1_bias, activation="swiglu", tuned=False, store_preact=False,
        **options,
    )  # fmt: skip
    return h


# Up to four M tiles the tile grid, not the mainloop, sets the waves. Beyond, quack's default
# (which clusters along M, so each weight tile is fetched once per two M tiles) measured
# faster than cuBLAS, and wave fill alone does not see that saving.
SMALL_M = 512
TILE_M = 128
DEFAULT_TILE_N, DEFAULT_CLUSTER_M = 192, 2  # quack 0.6.5's SM90 default: 128x192, cluster 2x1
SMALL_M_TILES_N = (128, 160, 192, 224, 256)  # quack's SM90 gated space at tile_m = 128
# Outside that space but built and correct (its epilogue needs N % 32 == 0): at one M tile,
# where the N tiles alone make the grid, 0.5B's 2F = 9728 fills 102 SMs with 96-wide tiles
# against 76 with 128. At several M tiles it lost to the space's best by up to 1.10x
# (probe_quack_tiles_h200.json), so it is a candidate at one M tile only.
ONE_M_TILE_N = (96,)
CLUSTER_N = 2
FILL_MARGIN = 1.05  # below this gain in fill, keep quack's default


def _hopper(x: torch.Tensor) -> bool:
    """sm_90: the configs here are from quack's SM90 space; other archs keep their defaults."""
    return device_capability(x.get_device())[0] == 9


def wave_fill(m_tiles: int, n_tiles: int, cluster_m: int, cluster_n: int, sms: int) -> float:
    """Busy share of the SM slots over a persistent grid's waves of clusters: a cluster takes
    cluster_m x cluster_n SMs whether or not the grid has a tile for each of them."""
    clusters = -(-m_tiles // cluster_m) * -(-n_tiles // cluster_n)
    waves = -(-clusters // (sms // (cluster_m * cluster_n)))
    return m_tiles * n_tiles / (waves * sms)


@functools.lru_cache(maxsize=256)  # per call on the host, against GEMMs of ~10 us
def small_m_tile_n(m: int, fc1_rows: int, sms: int) -> int | None:
    """The N tile of an N-clustered config for quack's gated GEMM at M rows, or None to keep
    quack's default (always past SMALL_M, and for an empty batch, which quack returns as is).
    With one M tile the default's M cluster idles half its CTAs; with a few, the N tile decides
    how evenly the tiles fill the SMs (7B's 2F = 37888 at M = 128 runs 2.24 waves of 128-wide
    tiles, 1.80 of 160-wide ones). The fullest last wave wins, the narrowest tile on a tie; the
    default stays unless the best fills FILL_MARGIN more."""
    if not 0 < m <= SMALL_M:
        return None
    m_tiles = -(-m // TILE_M)

    def fill(tile_n: int, cluster_m: int, cluster_n: int) -> float:
        return wave_fill(m_tiles, -(-fc1_rows // tile_n), cluster_m, cluster_n, sms)

    tiles = SMALL_M_TILES_N + (ONE_M_TILE_N if m_tiles == 1 else ())
    best = max(tiles, key=lambda n: (fill(n, 1, CLUSTER_N), -n))
    default = fill(DEFAULT_TILE_N, DEFAULT_CLUSTER_M, 1)
    return best if fill(best, 1, CLUSTER_N) > FILL_MARGIN * default else None


@functools.cache
def n_clustered_config(tile_n: int):
    """A config of quack's SM90 gated space clustered along N, pingpong where the space has it
    (N up to 192), cooperative above."""
    from quack.gemm_config import GemmConfig

    return GemmConfig(
        tile_m=TILE_M, tile_n=tile_n, pingpong=tile_n <= 192, cluster_m=1, cluster_n=CLUSTER_N,
        is_dynamic_persistent=False,
    )  # fmt: skip


def _canonical_bias_grad(grad_preact: torch.Tensor) -> torch.Tensor:
    """Sum of the interleaved [g0, u0, g1, u1, ...] grad over rows, as [grad_gate; grad_up]."""
    return grad_preact.sum(0).view(-1, 2).t().reshape(-1)


class _DropHQuack(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, inplace: bool, dynamic: FusedSchedule,
        handoff: Fc2Handoff | None,
    ):  # fmt: skip
        q = require_quack()
        x = x.contiguous()
        # concat_layout reads [W_gate; W_up] along fc1's non-contiguous dim: it must be the rows
        fc1_weight = fc1_weight if fc1_weight.stride(1) == 1 else fc1_weight.contiguous()
        preact, h = q.gemm_gated(
            x, fc1_weight.t(), bias=fc1_bias, activation="swiglu", tuned=False,
            concat_layout=("B", "bias"), dynamic_scheduler=dynamic.fc1,
        )  # fmt: skip
        save_drop_h(ctx, x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, preact, inplace)
        ctx.dynamic_grad_h = dynamic.grad_h
        return fc2_or_h(ctx, handoff, h, fc2_weight, fc2_bias, quack_fc2)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        refuse_double_backward()
        inplace = claim_inplace_backward(ctx, SECOND_BACKWARD_ERROR, SECOND_BACKWARD_FREED_ERROR)
        x, fc1_weight, fc2_weight, preact = ctx.saved_tensors
        need_x, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad[:5]
        q = require_quack()
        grad_y = fc2_grad_y(ctx, grad_out)
        grad_preact, h = q.gemm_dgated(
            grad_y, fc2_weight, preact, activation="swiglu", tuned=False,
            dynamic_scheduler=ctx.dynamic_grad_h, dx_out=preact if inplace else None,
        )  # fmt: skip
        grad_w2 = chosen_gemm("grad_w2", grad_y.t(), h) if need_w2 else None
        del h  # frees [M, F] before the two largest GEMM outputs are allocated
        grad_x = chosen_gemm("grad_x_concat", grad_preact, fc1_weight) if need_x else None
        grad_w1 = chosen_gemm("grad_w1_concat", grad_preact.t(), x) if need_w1 else None
        grad_b1 = _canonical_bias_grad(grad_preact) if need_b1 and ctx.has_bias[0] else None
        grad_b2 = grad_y.sum(0) if need_b2 and ctx.has_bias[1] else None
        return grad_x, grad_w1, grad_b1, grad_w2, grad_b2, None, None, None


def quack_fc2(h: torch.Tensor, fc2_weight: torch.Tensor, fc2_bias: torch.Tensor | None):
    """The quack impls' fc2: y = h W2ᵀ (+ b2) on the GEMM ``gemm_choice`` picks."""
    return chosen_gemm("fc2", h, fc2_weight.t(), fc2_bias)


def drop_h_quack_mlp(
    x: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc1_bias: torch.Tensor | None,
    fc2_weight: torch.Tensor,
    fc2_bias: torch.Tensor | None,
    inplace: bool = True,
    dynamic: FusedSchedule = STATIC_FUSED,
) -> torch.Tensor:
    """drop_h with SwiGLU fused into quack's fc1 and grad_h GEMM epilogues (CUDA sm_90);
    ``dynamic`` puts those two on quack's dynamic tile schedule (``FusedSchedule``).

    An empty batch (no tokens on this rank) takes drop_h itself: a TMA descriptor needs a row.
    """
    check_quack_inputs(x, fc1_weight, fc2_weight)
    if x.shape[0] == 0:
        return drop_h_mlp(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, inplace)
    return with_fc2_node(
        _DropHQuack, x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, inplace, dynamic, fc2=quack_fc2
    )
