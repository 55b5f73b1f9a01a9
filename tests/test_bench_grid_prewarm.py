"""The benchmarks' pre-warm pool: which point a free worker takes, what the GPU memory left
admits, and a worker that dies mid-point (a real process exit in a real spawned worker)
costing that point alone."""

import os
from collections import Counter

from swiglu_train.bench.grid.prewarm import grid_jobs, label
from swiglu_train.bench.mlp.run import BenchConfig
from swiglu_train.bench.prewarm import Warmed, pick_next, prewarm


def test_distinct_shapes_go_first_and_a_shape_is_never_compiled_twice_at_once():
    shapes = [(16, 40), (16, 40), (32, 64), (32, 64), (48, 80)]
    pending = [0, 1, 2, 3, 4]
    assert pick_next(pending, shapes, set(), Counter()) == 0
    # (16, 40) is being compiled: another shape, not its second M
    assert pick_next([1, 2, 3, 4], shapes, {(16, 40)}, Counter({(16, 40): 1})) == 2
    started = {(16, 40), (32, 64), (48, 80)}
    busy = Counter({(16, 40): 1, (32, 64): 1})
    assert pick_next([1, 3], shapes, started, busy) is None  # wait for a shape to finish
    busy[(16, 40)] -= 1
    assert pick_next([1, 3], shapes, started, busy) == 1  # its caches are warm now


def die_at_m40(cfg: BenchConfig) -> Warmed:
    """A worker task that exits its process at M = 40, as a compiler's segfault would."""
    if cfg.shape[0] == 40:
        os._exit(3)
    return Warmed(label(cfg), 0.0, os.getpid(), list(cfg.variants))


def test_a_worker_that_dies_costs_its_point_alone():
    configs = [BenchConfig(shape=(m, 16, 40, 16), variants=("normal",)) for m in (24, 40, 56)]
    seen = []
    record = prewarm(grid_jobs(configs), 1, die_at_m40, seen.append)
    assert [w.label for w in seen] == ["M=24 D=16 F=40", "M=40 D=16 F=40", "M=56 D=16 F=40"]
    first, died, after = seen
    assert first.warmed == after.warmed == ["normal"] and not first.error and not after.error
    assert died.pid is None and died.error.startswith("the worker died: BrokenProcessPool")
    assert first.pid != after.pid and os.getpid() not in (first.pid, after.pid)  # a fresh one
    assert record["points"] == 3 and record["workers"] == 1
    assert record["worker_errors"] == [died.describe()] and "M=40 D=16 F=40" in died.describe()
