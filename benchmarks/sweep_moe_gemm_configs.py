"""quack configs for drop_h_quack's six varlen GEMMs at MoE expert shapes, each timed paired
against quack's untuned default (what ``ops.experts_quack`` ships) and against its
``torch._grouped_mm`` twin (the MoE bench's floor): the measurement a config rule (wave fill
over the SMs, tile fit to N and to the rows per expert) is to be fitted from.

    python benchmarks/sweep_moe_gemm_configs.py [--models A,B] [--routing balanced,skewed]
        [--gemms fc1,grad_W1] [--configs 128x128-pp-2x1-static,...] [--max-configs 12]
        [--samples 30] --json OUT.json [--md OUT.md]

Each (model, routing) point builds the GEMMs' operands as ``experts_quack`` passes them
(``operands``; h stands for both h and w·h) and their twins as ``bench.moe.floor`` does. A
config is named ``{tile_m}x{tile_n}-{pp|coop}-{cluster_m}x{cluster_n}-{static|dynamic}``.

Explicit configs go through ``quack.gemm_interface.gemm_tuned.fn(A, B, out, config=...)``,
the undecorated function that quack's own ``gemm(..., tuned=False)`` calls with
``config=None`` (it then takes ``default_config``): a candidate differs from the shipped call
in its config alone. The public alternatives cannot: ``gemm_tuned`` autotunes, and
``gemm``/``gemm_out`` take no config. That entry point skips the autotuner's pruning, so
``unsupported`` mirrors quack 0.6.5's rules (``gemm_config.config_supports``, ``gemm_tuned``'s
asserts, ``GemmSm90``'s tile limits). Each candidate's output is checked against the default's
before it is timed; one that fails to compile or run, or differs, is recorded with its reason.

Every call of a sample runs in a fresh random order (``timing.paired_samples``) behind a short
spin hold and after a read of twice the L2, so each starts from a cold cache, as the expert
weights do in training; ratios are medians of per-sample ratios. quack keys a kernel by dtypes,
majors, flags and config, never by size, so ``precompile`` first compiles every (GEMM, config)
at once in quack's compile pool, on a tiny point, as quack's autotuner compiles its candidates.
"""

from __future__ import annotations

import argparse
import functools
import math
import re
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch

from swiglu_train.bench.moe.routing import ROUTINGS, make_routing
from swiglu_train.bench.moe.shapes import MoEShape, select_models
from swiglu_train.bench.moe.weights import ExpertWeights
from swiglu_train.bench.results import environment, write_result
from swiglu_train.bench.timing import Case, paired_samples
from swiglu_train.ops.experts_routing import route
from swiglu_train.ops.quack_mlp import quack_gemm, require_quack

GEMMS = ("fc1", "fc2", "grad_h", "grad_W2", "grad_xg", "grad_W1")
GATHERED = frozenset({"fc1", "grad_h", "grad_W2", "grad_W1"})  # quack gathers A through A_idx
VARLEN_K = frozenset({"grad_W2", "grad_W1"})  # per-expert contraction; the others are varlen_m
MODELS = ("mixtral-8x7b", "qwen3-30b-a3b", "olmoe-1b-7b", "deepseek-v2-lite",
          "qwen1.5-moe-a2.7b", "deepseek-v3")  # fmt: skip
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
HOLD_MS = 1.0  # one GEMM queues in well under this; the clock lengthens it if not
CONFIG_LIMIT = 1e-3  # a candidate against the default: rounding at most (fp32 sums, bf16 out)
TWIN_LIMIT = 1e-2  # the default against torch: the same GEMM, other summation orders
PRECOMPILE_S = 180.0  # a pool slower than this leaves the rest to the sweep, in-process
TINY = MoEShape("tiny", "", 128, 128, 4, 2)  # precompile's point: kernels do not depend on size
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


FIELDS = tuple(f.name for f in fields(Config))


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


def _reason(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def measure(
    op: GemmOperands, configs: Sequence[Config], samples: int, seed: int, flush: Callable
) -> tuple[dict[str, np.ndarray], dict[str, float], dict[str, str]]:
    """Per call (torch, default, each candidate that checks out) its times; each one's rel err
    against the default; and why each failed candidate failed."""
    default = shipped(op)
    errors = {"torch": rel_err(run_twin(op), default), "default": 0.0}
    if not errors["torch"] <= TWIN_LIMIT:
        raise AssertionError(f"{op.name}: quack's default and torch._grouped_mm differ by "
                             f"{errors['torch']:.2e}: the operands are not one GEMM")  # fmt: skip
    calls = {"torch": functools.partial(run_twin, op), "default": functools.partial(shipped, op)}
    failed = {}
    for c in configs:
        try:
            config = c.quack()
            op.out.fill_(math.nan)
            errors[c.label] = rel_err(run_config(op, config), default)
        except Exception as e:  # a compile error, a launch refused: recorded, not fatal
            failed[c.label] = _reason(e)
            continue
        if errors[c.label] <= CONFIG_LIMIT:
            calls[c.label] = functools.partial(run_config, op, config)
        else:
            failed[c.label] = f"output differs from the default's: rel err {errors[c.label]:.2e}"
    del default
    for call in calls.values():
        call()  # warm: launch plans, cuBLAS's heuristics
    cases = [Case(name, call, lambda _: None, flush) for name, call in calls.items()]
    times = paired_samples(cases, samples, op.a.device, seed, hold_ms=HOLD_MS)
    return {name: t["fwd"] for name, t in times.items()}, errors, failed


def rows_of(
    p: Point, op: GemmOperands, times: dict, errors: dict, failed: dict, default: Config
) -> list[dict]:
    """The JSON rows of one GEMM at one point: torch, the default, each candidate."""
    sizes, (m, n, k) = p.rows_per_expert, op.mnk
    base = {
        "model": p.shape.name, "routing": p.routing, "D": p.shape.d, "F": p.shape.f,
        "E": p.shape.e, "k": p.shape.k, "gemm": op.name, "M": m, "N": n, "K": k,
        "varlen": "k" if op.name in VARLEN_K else "m", "gathered": op.name in GATHERED,
        "rows_per_expert": {"min": min(sizes), "median": float(np.median(sizes)),
                            "mean": float(np.mean(sizes)), "max": max(sizes),
                            "empty": sizes.count(0)},
    }  # fmt: skip
    out = []
    for name in [*times, *failed]:
        c = None if name == "torch" else default if name == "default" else Config.parse(name)
        row = base | {"config": name} | (asdict(c) if c else dict.fromkeys(FIELDS))
        row["tiles"] = output_tiles(op.name, sizes, m, n, c) if c else None
        t = times.get(name)
        row |= {
            "ms": None if t is None else float(np.median(t)),
            "over_torch": None if t is None else float(np.median(t / times["torch"])),
            "over_default": None if t is None else float(np.median(t / times["default"])),
            "rel_err": errors.get(name), "exact": errors.get(name) == 0.0,
            "failed": failed.get(name),
        }  # fmt: skip
        out.append(row)
    return out


def summarize(rows: Sequence[dict]) -> list[dict]:
    """Per (model, routing, gemm), in run order: its torch and default rows, the quack row
    (default included) with the lowest paired ratio to the default, and its failures."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["routing"], r["gemm"]), []).append(r)
    out = []
    for group in groups.values():
        timed = {r["config"]: r for r in group if r["failed"] is None}
        quack = [r for name, r in timed.items() if name != "torch"]
        out.append({"torch": timed["torch"], "default": timed["default"],
                    "best": min(quack, key=lambda r: r["over_default"]),
                    "failed": [r for r in group if r["failed"] is not None]})  # fmt: skip
    return out


def kind_table(groups: Sequence[dict]) -> list[str]:
    """Per GEMM kind, over the points: the default's and the best config's ratios."""
    lines = ["| gemm | points | default ÷ torch | best ÷ default (median, min) | best ÷ torch | "
             "best config most often |", "|---|---|---|---|---|---|"]  # fmt: skip
    for gemm in dict.fromkeys(g["best"]["gemm"] for g in groups):
        mine = [g for g in groups if g["best"]["gemm"] == gemm]
        best = [g["best"]["over_default"] for g in mine]
        ((label, times),) = Counter(g["best"]["config"] for g in mine).most_common(1)
        lines.append(
            f"| {gemm} | {len(mine)} | {np.median([g['default']['over_torch'] for g in mine]):.3f}"
            f" | {np.median(best):.3f} ({min(best):.3f}) | "
            f"{np.median([g['best']['over_torch'] for g in mine]):.3f} | {label} ({times}) |"
        )
    return lines


def point_tables(groups: Sequence[dict]) -> list[str]:
    """The six GEMMs' sums per point, then each point's GEMMs."""
    points: dict[tuple, list[dict]] = {}
    for g in groups:
        points.setdefault((g["best"]["model"], g["best"]["routing"]), []).append(g)
    lines = ["The GEMMs of each point (sums of median ms):", "",
             "| model | routing | torch ms | default ÷ torch | best per GEMM ÷ torch |",
             "|---|---|---|---|---|"]  # fmt: skip
    for (model, routing), mine in points.items():
        torch_ms, default_ms, best_ms = (sum(g[k]["ms"] for g in mine)
                                         for k in ("torch", "default", "best"))  # fmt: skip
        lines.append(f"| {model} | {routing} | {torch_ms:.3f} | {default_ms / torch_ms:.3f} | "
                     f"{best_ms / torch_ms:.3f} |")  # fmt: skip
    for (model, routing), mine in points.items():
        s = mine[0]["torch"]["rows_per_expert"]
        lines += ["", f"#### {model}, {routing}: rows per expert {s['min']} / {s['median']:.0f} / "
                  f"{s['max']} (min / median / max), {s['empty']} empty", "",
                  "| gemm | MxNxK | torch ms | default ms | ÷ torch | best | best ms | "
                  "÷ default | ÷ torch | failed |",
                  "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for g in mine:
            t, d, b = g["torch"], g["default"], g["best"]
            lines.append(
                f"| {t['gemm']} | {t['M']}x{t['N']}x{t['K']} | {t['ms']:.3f} | {d['ms']:.3f} "
                f"| {d['over_torch']:.3f} | {b['config']} | {b['ms']:.3f} | "
                f"{b['over_default']:.3f} | {b['over_torch']:.3f} | {len(g['failed'])} |"
            )
    return lines


def to_markdown(result: dict) -> str:
    groups = summarize(result["rows"])
    lines = [
        f"### quack configs for drop_h_quack's six varlen GEMMs ({result['gpu']}, "
        f"{result['sm_count']} SMs, {result['commit']})", "",
        f"T = {result['tokens']} tokens, bf16, {result['samples']} paired samples, every call "
        "from a cold L2. ÷ torch: over `torch._grouped_mm` on pre-gathered operands (the MoE "
        f"floor's GEMM); ÷ default: over quack's untuned default ({result['default']}), which "
        "drop_h_quack ships. Medians of per-sample ratios; best: the lowest ÷ default, the "
        "default itself where no candidate beats it.", "",
        *kind_table(groups), "", *point_tables(groups),
    ]  # fmt: skip
    failures = [r for g in groups for r in g["failed"]]
    if failures:
        lines += ["", "Configs that did not run or did not match the default:", "",
                  "| model | routing | gemm | config | why |", "|---|---|---|---|---|"]  # fmt: skip
        lines += [f"| {r['model']} | {r['routing']} | {r['gemm']} | {r['config']} | "
                  f"{r['failed'].replace('|', '/')} |" for r in failures]  # fmt: skip
    if result["errors"]:
        lines += ["", "GEMMs not measured:", ""]
        lines += [
            f"- {e['model']} {e['routing']} {e['gemm']}: {e['error']}" for e in result["errors"]
        ]
    return "\n".join(lines) + "\n"


def sweep_gemm(
    p: Point, gemm: str, configs: Sequence[Config], default: Config, samples: int, seed: int,
    flush: Callable,
) -> list[dict]:  # fmt: skip
    op = operands(p, gemm)
    times, errors, failed = measure(op, configs, samples, seed, flush)
    return rows_of(p, op, times, errors, failed, default)


def precompile(
    gemms: Sequence[str], configs: dict[str, list[Config]], seed: int, device: torch.device
) -> str:
    """Compile every kernel the sweep runs at once, in quack's compile pool (``quack.cache``'s
    ``pool_scope``, as quack's autotuner does): a cold kernel raises ``CompilePending`` while a
    worker compiles it into the disk cache, and is retried once it lands. Failures are left to
    the sweep, which compiles them in-process and records why."""
    from quack.cache import CompilePending, pool_scope

    p = make_point(TINY, "balanced", 64, seed, device)
    calls = []
    for gemm in gemms:
        op = operands(p, gemm)
        calls.append(functools.partial(shipped, op))
        calls += [functools.partial(run_config, op, c.quack()) for c in configs[gemm]]
    start, queue, failed, waited = time.monotonic(), deque(calls), 0, 0
    with pool_scope():
        while queue and time.monotonic() - start < PRECOMPILE_S:
            call = queue.popleft()
            try:
                call()
                waited = 0
            except CompilePending:
                queue.append(call)
                waited += 1
                if waited >= len(queue):  # a whole round pending: let the workers work
                    time.sleep(0.1)
                    waited = 0
            except Exception:
                failed += 1
    torch.cuda.synchronize()
    return (f"precompile: {len(calls)} kernels in {time.monotonic() - start:.0f} s, {failed} "
            f"failed, {len(queue)} left to compile in-process")  # fmt: skip


def progress(model: str, routing: str, gemm: str, rows: list[dict], errors: list) -> str:
    if not rows:
        return f"{model} {routing} {gemm}: {errors[-1]['error']}"
    (g,) = summarize(rows)
    t, d, b = g["torch"], g["default"], g["best"]
    return (f"{model} {routing} {gemm} {t['M']}x{t['N']}x{t['K']}: torch {t['ms']:.3f} ms, default "
            f"÷ torch {d['over_torch']:.3f}, best {b['config']} ÷ default {b['over_default']:.3f}, "
            f"÷ torch {b['over_torch']:.3f}, {len(g['failed'])} failed")  # fmt: skip


def _names(value: str, known: Sequence[str], what: str) -> list[str]:
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"{what}: unknown {unknown or 'none given'}; choose from {list(known)}")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="bench-moe's model names")
    parser.add_argument("--routing", default=",".join(ROUTINGS))
    parser.add_argument("--gemms", default=",".join(GEMMS))
    parser.add_argument("--configs", default=",".join(CONFIGS), help="candidate labels, in order")
    parser.add_argument("--max-configs", type=int, default=12, help="candidates per GEMM")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--precompile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--commit")
    parser.add_argument("--json", required=True)
    parser.add_argument("--md")
    args = parser.parse_args()
    try:
        models = select_models([n.strip() for n in args.models.split(",") if n.strip()])
        routings = _names(args.routing, ROUTINGS, "--routing")
        gemms = _names(args.gemms, GEMMS, "--gemms")
        configs = [Config.parse(c) for c in args.configs.split(",") if c.strip()]
    except ValueError as e:
        parser.error(str(e))
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        raise SystemExit("error: the candidates are quack's SM90 configs: this needs a Hopper GPU")
    require_quack()  # one line where quack is missing
    from quack.gemm_config import default_config

    device = torch.device("cuda")
    default = Config.of(default_config(device))
    chosen = {g: candidates(g, configs, default, args.max_configs) for g in gemms}
    props = torch.cuda.get_device_properties(device)
    cache = torch.zeros(2 * props.L2_cache_size, dtype=torch.int8, device=device)
    flush = functools.partial(torch.sum, cache)  # a read: leaves the L2 clean, not dirty
    if args.precompile:
        try:
            print(precompile(gemms, chosen, args.seed, device), flush=True)
        except Exception as e:  # the pool itself: the sweep compiles each kernel in-process
            print(f"precompile: {_reason(e)}; compiling in-process", flush=True)
    env = environment(device, args.commit)
    result = {
        "gpu": env["device_name"], "sm_count": props.multi_processor_count,
        "commit": env["commit"], "environment": env, "tokens": args.tokens,
        "samples": args.samples, "default": default.label,
        "configs": {g: [c.label for c in cs] for g, cs in chosen.items()},
        "skipped": {g: {c.label: unsupported(c, g) for c in configs if unsupported(c, g)}
                    for g in gemms},
        "errors": [], "rows": [],
    }  # fmt: skip
    for shape in models:
        for routing in routings:
            p = make_point(shape, routing, args.tokens, args.seed, device)
            for gemm in gemms:
                try:
                    rows = sweep_gemm(p, gemm, chosen[gemm], default, args.samples, args.seed,
                                      flush)  # fmt: skip
                except Exception as e:  # out of memory, operands that disagree: this GEMM's loss
                    result["errors"].append({"model": shape.name, "routing": routing,
                                             "gemm": gemm, "error": _reason(e)})  # fmt: skip
                    rows = []
                torch.cuda.empty_cache()
                result["rows"] += rows
                print(progress(shape.name, routing, gemm, rows, result["errors"]), flush=True)
            del p
            torch.cuda.empty_cache()
            write_result(f"benchmarks/{Path(__file__).name}", result, args.json, args.md,
                         to_markdown)  # fmt: skip
    print("\n".join(kind_table(summarize(result["rows"]))))


if __name__ == "__main__":
    main()
