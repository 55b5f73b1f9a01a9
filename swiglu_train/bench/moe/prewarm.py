"""``bench-moe``'s pre-warm (the pool is ``bench/prewarm.py``): each model's variants built and
run untimed in worker processes before the timing pass, several models at once.

A model's routings share every compiled kernel: quack's and Triton's compile per (D, F) and
dtype, inductor's graph (compiled torchtitan) per static shape, and balanced and skewed routing
differ only in the values of the group sizes, never in a shape. So a model is warmed once, at
its first routing. Its GPU memory is bounded from its sizes (``point_bytes``), so that the
workers' points together stay within the GPU's free memory: a DeepSeek-V3 layer alone holds
45 GB of weights and their gradients.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from swiglu_train.bench.moe.harness import (
    Inputs,
    MoEConfig,
    built_case,
    free,
    release,
    skip_reason,
    warm_up,
)
from swiglu_train.bench.moe.shapes import MoEShape
from swiglu_train.bench.prewarm import Job, Warmed, prewarm, worker_outcome
from swiglu_train.bench.results import DTYPES
from swiglu_train.ops.experts import saved_activation_bytes

# Variants whose preparation a pre-warm cannot share: they time candidates on the GPU, which
# no on-disk cache carries to the timing pass (Triton's autotuner keeps its picks in memory),
# and among the other workers they would time them slowly and on a crowded GPU
NOT_PREWARMED = {
    "liger": "Liger's fused MoE autotunes ~240 Triton configs per shape by timing them; the "
    "timing pass does that itself",
}
CONTEXT_BYTES = 2**30  # a worker's CUDA context and allocator slack
# Of the GPU's free memory, what the workers' points may hold together
FREE_MEMORY_SHARE = 0.8


def point_bytes(cfg: MoEConfig, shape: MoEShape) -> int:
    """What a worker holds at most while it warms ``shape``: the expert weights and their
    gradients, x and grad_y with theirs, and three times what ``normal`` saves (the most any
    variant keeps, with backward's transients beside it), plus its CUDA context."""
    size = torch.empty(0, dtype=DTYPES[cfg.dtype]).element_size()
    weights = 3 * shape.e * shape.d * shape.f * size
    tokens = 3 * cfg.tokens * shape.d * size
    saved = saved_activation_bytes(
        "normal", False, cfg.router_weights_on, cfg.tokens, shape.d, shape.f, shape.k, shape.e,
        DTYPES[cfg.dtype],
    )  # fmt: skip
    return 2 * weights + tokens + 3 * saved + CONTEXT_BYTES


def moe_jobs(cfg: MoEConfig) -> list[Job]:
    """One job per model (its first routing), largest first; a (D, F) compiles once."""
    firsts: dict[MoEShape, str] = {}
    for shape, routing in cfg.points():
        firsts.setdefault(shape, routing)
    return [
        Job((cfg, shape, routing), f"{shape.name} {routing}", (shape.d, shape.f),
            shape.e * shape.d * shape.f, point_bytes(cfg, shape))
        for shape, routing in firsts.items()
    ]  # fmt: skip


def gpu_budget(cfg: MoEConfig) -> int | None:
    """Bytes the workers' points may hold together: a share of the GPU's free memory now
    (None on the CPU, which has no such limit worth planning around)."""
    device = torch.device(cfg.device)
    if device.type != "cuda":
        return None
    return int(FREE_MEMORY_SHARE * torch.cuda.mem_get_info(device)[0])


def prewarm_moe(cfg: MoEConfig, on_point: Callable[[Warmed], None]) -> dict:
    """Warm ``cfg``'s models in ``cfg.prewarm_workers`` processes; the pool's record."""
    jobs = moe_jobs(cfg)
    return prewarm(jobs, cfg.prewarm_workers, warm_moe_point, on_point, gpu_budget(cfg))


def warm_moe_point(job: tuple[MoEConfig, MoEShape, str]) -> Warmed:
    """In a worker: build each variant at the point and run its warm-up steps untimed (what
    ``measure_point`` does before checking it), one variant at a time, then free everything."""
    cfg, shape, routing = job
    began, device = time.perf_counter(), torch.device(cfg.device)
    warmed: list[str] = []
    not_warmed: dict[str, str] = {}
    try:
        inputs = Inputs.build(cfg, shape, routing)
    except Exception as e:  # out of memory among the other workers: the timing pass builds it
        not_warmed["all"] = skip_reason(e)
        inputs = None
    for name in cfg.variants if inputs is not None else ():
        if name in NOT_PREWARMED:
            not_warmed[name] = NOT_PREWARMED[name]
            continue
        case = None
        try:
            _, case = built_case(cfg, name, inputs, shape)  # the case holds its variant
            warm_up(case, cfg.warmup, device)
            warmed.append(name)
        except Exception as e:  # the timing pass meets it again and records it
            not_warmed[name] = skip_reason(e)
        finally:
            if case is not None:
                case.reset()
            case = None
            free(device)
    inputs = None
    release(device)
    return worker_outcome(f"{shape.name} {routing}", began, warmed, not_warmed, device)
