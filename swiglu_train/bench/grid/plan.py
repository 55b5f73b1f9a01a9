"""The model grid's plan: its points, their chunks for device calls, and time estimates.

A grid too long for one device call runs in chunks (``--chunk I/N``) cut so that the longest
chunk's estimated time, its pre-warm included, is as short as it can be.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from swiglu_train.bench.grid.models import GridShape
from swiglu_train.bench.mlp.run import BenchConfig, one_layer_config
from swiglu_train.bench.prewarm import makespan_s
from swiglu_train.bench.timing import QUEUE_MS

# Every impl and every peer (quack's mlp_func untuned, Liger in-place, torch.compile, FLA);
# a peer that does not import or run here is skipped on record.
GRID_VARIANTS = (
    *("normal", "drop_h", "save_factors", "drop_h_quack", "save_factors_quack"),
    *("quack", "liger", "compile", "fla"),
)
DEFAULT_M = (4096, 8000, 16384)  # 8000 tokens: no multiple of 128
# A planning estimate for the H200 in bf16, to split the grid into device calls: the floor runs
# its 18·M·D·F FLOPs at ~650 TFLOP/s (630-720 in crossover_h200.json), the variants average
# ~1.08x it, and each step waits behind the timer's spin of QUEUE_MS. The first M of each new
# (D, F) compiles it (quack's CuTe kernels, Triton, torch.compile): 46-108 s in grid_h200.json
# (35523e6, one process); every point also pays building, allocator readings and dynamo's
# re-trace: the later M there took 6-12 s. With a pre-warm the compiles run in its workers, a
# (D, F) in one worker, the shapes spread over them. Each point's measured elapsed_s, and the
# pre-warm's, are recorded beside the estimates.
FLOOR_FLOPS_PER_S = 650e12
MEAN_RATIO = 1.08
SHAPE_COMPILE_S = 70.0
POINT_OVERHEAD_S = 7.0
PREWARM_POINT_S = 3.0  # a worker's build, release and re-trace at a point, besides its steps
EXTRA_STEPS = 2  # the correctness step and the memory reading, besides warm-up and samples
PRETUNE_POINT_S = 10.0  # --pretune: 6 GEMMs x 3 libraries x 30 queued samples at a point
Dims = tuple[int, int, int]  # (M, D, F)


@dataclass(frozen=True)
class GridPoint:
    m: int
    shape: GridShape

    @property
    def dims(self) -> Dims:
        return self.m, self.shape.d, self.shape.f


@dataclass
class GridConfig:
    shapes: Sequence[GridShape]
    m: Sequence[int] = DEFAULT_M
    variants: Sequence[str] = GRID_VARIANTS
    samples: int = 30
    warmup: int = 2
    dtype: str = "bf16"
    device: str = "cuda"
    seed: int = 0
    commit: str | None = None
    chunk: tuple[int, int] = (1, 1)  # (I, N): the I-th of N chunks
    command: str | None = None  # the command line, recorded with every (partial) result
    prewarm_workers: int = 0  # processes that compile the chunk's points before timing
    pretune: bool = False  # time the quack impls' GEMM libraries at each point first

    def all_points(self) -> list[GridPoint]:
        """Shape-major, smallest D·F first: a chunk cut short keeps the most points."""
        return [GridPoint(m, shape) for shape in self.shapes for m in self.m]

    def chunks(self) -> list[list[GridPoint]]:
        return split_chunks(self.all_points(), self.chunk[1], self.chunk_s)

    def points(self) -> list[GridPoint]:
        return self.chunks()[self.chunk[0] - 1]

    def estimate_s(self, point: GridPoint, compiles: bool = False) -> float:
        """Seconds the timing pass spends on ``point`` on an H200 in bf16 (see
        FLOOR_FLOPS_PER_S); ``compiles``: its (D, F) is compiled there (no pre-warm did)."""
        runs = self.warmup + self.samples + EXTRA_STEPS
        step_s = (1 + len(self.variants) * MEAN_RATIO) * _floor_s(point)
        spins = (1 + len(self.variants)) * QUEUE_MS / 1e3
        pretune_s = PRETUNE_POINT_S if self.pretune else 0.0
        return POINT_OVERHEAD_S + runs * (step_s + spins) + SHAPE_COMPILE_S * compiles + pretune_s

    def prewarm_s(self, points: Sequence[GridPoint]) -> float:
        """The pre-warm's seconds for ``points`` (0 without one): each (D, F) compiled once and
        its points warmed, in one worker."""
        if not self.prewarm_workers:
            return 0.0
        per_shape: dict[GridShape, float] = {}
        for p in points:
            warm_s = self.warmup * len(self.variants) * MEAN_RATIO * _floor_s(p)
            per_shape[p.shape] = per_shape.get(p.shape, SHAPE_COMPILE_S) + PREWARM_POINT_S + warm_s
        return makespan_s(per_shape.values(), self.prewarm_workers)

    def chunk_s(self, points: Sequence[GridPoint]) -> float:
        """Seconds one call running ``points`` is expected to take: the pre-warm, then the
        timing pass (which compiles each (D, F) once itself where no pre-warm did)."""
        return self.prewarm_s(points) + sum(
            self.estimate_s(p, compiles) for p, compiles in self.compiling(points)
        )

    def compiling(self, points: Sequence[GridPoint]) -> list[tuple[GridPoint, bool]]:
        """Each point, and whether the timing pass compiles its (D, F) there: at its first
        point in ``points``, unless a pre-warm runs first."""
        seen: set[GridShape] = set()
        flags = []
        for p in points:
            flags.append((p, not self.prewarm_workers and p.shape not in seen))
            seen.add(p.shape)
        return flags

    def bench_config(self, point: GridPoint) -> BenchConfig:
        return one_layer_config(point.dims, self.variants, self)


def parse_chunk(value: str) -> tuple[int, int]:
    """``"2/3"`` -> (2, 3); a ValueError names what is wrong."""
    parts = value.split("/")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"--chunk {value!r}: expected I/N, e.g. 1/2")
    index, count = (int(p) for p in parts)
    if not 1 <= index <= count:
        raise ValueError(f"--chunk {value!r}: I must be between 1 and N")
    return index, count


def _floor_s(point: GridPoint) -> float:
    m, d, f = point.dims
    return 18 * m * d * f / FLOOR_FLOPS_PER_S


def split_chunks(
    points: Sequence[GridPoint], count: int, cost: Callable[[Sequence[GridPoint]], float]
) -> list[list[GridPoint]]:
    """``points`` cut, in order, into ``count`` non-empty runs whose largest estimated cost
    (``cost`` of a run) is as small as it can be (the device call's limit binds the longest)."""
    n = len(points)
    if not 1 <= count <= n:
        raise ValueError(f"--chunk: {n} grid points cannot be split into {count} chunks")
    run_cost = {(j, i): cost(points[j:i]) for i in range(n + 1) for j in range(i)}
    # worst[k][i]: the least possible largest chunk over the first i points in k chunks
    worst = [[math.inf] * (n + 1) for _ in range(count + 1)]
    cut = [[0] * (n + 1) for _ in range(count + 1)]
    worst[0][0] = 0.0
    for k in range(1, count + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(worst[k - 1][j], run_cost[j, i])
                if value < worst[k][i]:
                    worst[k][i], cut[k][i] = value, j
    bounds, i = [], n
    for k in range(count, 0, -1):
        bounds.append((cut[k][i], i))
        i = cut[k][i]
    return [list(points[j:i]) for j, i in reversed(bounds)]
