"""Turn measured steps into an activation-checkpointing plan: the pure decision.

A plan is an MLP impl and how many transformer blocks, from the first, run under activation
checkpointing (Megatron's ``--recompute-method block --recompute-num-layers N``). Measuring
is the integrations' job (``integrations/lightning/planner.py`` runs short profiled steps);
here is only what to do with the measurements, so it can be tested against recorded ones:

- :func:`search` finds, per impl, the fewest checkpointed blocks whose step fits the budget.
  The peak never grows as more blocks are checkpointed, so it bisects on that count, and
  measures each point through a callback. It takes the fewest blocks as the fastest: each
  checkpointed block only adds its forward again.
- :func:`search_micro_batches` does the same at each micro-batch that divides a global batch,
  largest first, for ``--micro-batch-size auto``. The peak never shrinks as the micro-batch
  grows, so the fewest blocks that fit at one micro-batch bound the bisection at the next,
  smaller one; an impl's descent stops at the first micro-batch it fits unchecked (a smaller
  one would run the same step on less work at a time).
- :func:`choose_plan` takes the fastest profile that fits; among those within ``tie`` of its
  tokens/s, the one with the smallest peak (headroom costs nothing there).
- :func:`step_tokens_per_s` is a profile's rate: tokens per second of a whole optimizer step,
  its micro-batches and the optimizer step once, so that micro-batches compare at one global
  batch (the optimizer counted after every micro-batch would favour the larger ones).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

DEFAULT_TIE = 0.01  # 1 %: below the run-to-run spread of a whole training step


@dataclass(frozen=True)
class Profile:
    """What a few steps of one (impl, checkpointed blocks) configuration measured."""

    impl: str
    checkpoint_layers: int
    peak_MiB: float | None  # None: the step ran out of memory
    tokens_per_s: float | None = None  # None: not timed
    after_forward_MiB: float | None = None
    micro_batch_size: int | None = None  # None: the run's own (not planned)
    # The timed parts of the step that ``tokens_per_s`` counts (:func:`step_tokens_per_s`)
    accumulate_grad_batches: int = 1  # micro-batches per optimizer step
    micro_batch_s: float | None = None  # the first: forward, zero_grad, backward
    accumulating_s: float | None = None  # each further one, adding into the held gradients
    optimizer_s: float | None = None  # gradient clipping and the optimizer step

    def fits(self, budget_MiB: float) -> bool:
        return self.peak_MiB is not None and self.peak_MiB <= budget_MiB


@dataclass(frozen=True)
class Plan:
    impl: str
    checkpoint_layers: int
    num_layers: int
    peak_MiB: float
    tokens_per_s: float
    budget_MiB: float
    why: str
    best_per_impl: tuple[Profile, ...]  # each impl's fastest profile that fits
    micro_batch_size: int | None = None  # planned (--micro-batch-size auto); None: the run's

    def to_dict(self) -> dict:
        return asdict(self) | {"best_per_impl": [asdict(p) for p in self.best_per_impl]}


class NoPlanFits(ValueError):
    """No measured configuration fits the budget; ``smallest`` is the lowest peak measured
    (None when every step ran out of memory)."""

    def __init__(self, message: str, smallest: Profile | None) -> None:
        super().__init__(message)
        self.smallest = smallest


Measure = Callable[[str, int], Profile]
MeasureAt = Callable[[str, int, int], Profile]  # (impl, checkpointed blocks, micro-batch)


def micro_batches(global_batch_size: int | None) -> list[int]:
    """The micro-batches ``--micro-batch-size auto`` tries: the divisors of the global batch
    (so that accumulation = global / micro is whole), largest first."""
    if global_batch_size is None:
        raise ValueError("--micro-batch-size auto needs a global batch to divide: set "
                         "train.global_batch_size (--global-batch-size), in sequences per "
                         "optimizer step")  # fmt: skip
    if isinstance(global_batch_size, bool) or not global_batch_size >= 1:
        raise ValueError(f"train.global_batch_size (--global-batch-size) must be a positive "
                         f"integer (sequences); got {global_batch_size!r}")  # fmt: skip
    return [m for m in range(global_batch_size, 0, -1) if global_batch_size % m == 0]


def accumulation(global_batch_size: int, micro_batch_size: int) -> int:
    """Micro-batches per optimizer step; a micro-batch that does not divide is refused."""
    if global_batch_size % micro_batch_size:
        raise ValueError(f"the global batch {global_batch_size} is not divisible by the "
                         f"micro-batch {micro_batch_size}: accumulation must be whole")  # fmt: skip
    return global_batch_size // micro_batch_size


def step_tokens_per_s(
    tokens: int,
    accumulation: int,
    micro_batch_s: float,
    accumulating_s: float | None,
    optimizer_s: float,
) -> float:
    """Tokens per second of one optimizer step of ``accumulation`` micro-batches of ``tokens``
    each, as gradient accumulation runs it: the first micro-batch, ``accumulation - 1`` more
    at ``accumulating_s`` each (alike: one timed stands for all), and the optimizer once."""
    if isinstance(accumulation, bool) or not (isinstance(accumulation, int) and accumulation >= 1):
        raise ValueError(f"accumulation must be a positive integer (micro-batches); "
                         f"got {accumulation!r}")  # fmt: skip
    if accumulation > 1 and accumulating_s is None:
        raise ValueError(f"a step of {accumulation} micro-batches needs an accumulating "
                         "micro-batch timed (accumulating_s)")  # fmt: skip
    step_s = micro_batch_s + (accumulation - 1) * (accumulating_s or 0.0) + optimizer_s
    if not step_s > 0:
        raise ValueError(f"a step's timed parts must add up to a positive time, got {step_s} s")
    return accumulation * tokens / step_s


def search(
    impls: Iterable[str], num_layers: int, budget_MiB: float, measure: Measure
) -> list[Profile]:
    """Every profile measured while finding each impl's fewest checkpointed blocks that fit:
    none first (the common case, one measurement), then all (if even that does not fit, the
    impl is out), then bisection in between; at most 2 + ceil(log2(num_layers)) per impl."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be at least 1, got {num_layers}")
    profiles: list[Profile] = []
    for impl in impls:
        _fewest(lambda n, impl=impl: _probe(measure, profiles, budget_MiB, impl, n), num_layers)
    return profiles


def search_micro_batches(
    impls: Iterable[str],
    num_layers: int,
    budget_MiB: float,
    micro_batch_sizes: Iterable[int],
    measure: MeasureAt,
) -> list[Profile]:
    """:func:`search` at each micro-batch, largest first, pruned by the monotone peak: an
    impl's fewest fitting blocks at one micro-batch is the bisection's upper end at the next
    (it fits there too), and its descent stops at the first micro-batch it fits unchecked."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be at least 1, got {num_layers}")
    sizes = sorted(set(micro_batch_sizes), reverse=True)
    if not sizes or sizes[-1] < 1:
        raise ValueError(f"micro-batch sizes must be at least 1, got {sizes}")
    profiles: list[Profile] = []
    for impl in impls:
        upper = None  # the fewest blocks that fit at the previous, larger micro-batch
        for m in sizes:

            def probe(n: int, impl: str = impl, m: int = m) -> bool:
                at = lambda i, k: measure(i, k, m)  # noqa: E731
                fits = _probe(at, profiles, budget_MiB, impl, n)
                if profiles[-1].micro_batch_size != m:
                    raise ValueError(f"measure({impl!r}, {n}, {m}) returned a profile of "
                                     f"micro-batch {profiles[-1].micro_batch_size}")  # fmt: skip
                return fits

            upper = _fewest(probe, num_layers, upper)
            if upper == 0:
                break
    return profiles


def _probe(measure: Measure, profiles: list[Profile], budget_MiB: float, impl: str, n: int):
    profile = measure(impl, n)
    if (profile.impl, profile.checkpoint_layers) != (impl, n):
        raise ValueError(f"measure({impl!r}, {n}) returned a profile of {profile.impl!r}, "
                         f"{profile.checkpoint_layers}")  # fmt: skip
    profiles.append(profile)
    return profile.fits(budget_MiB)


def _fewest(probe: Callable[[int], bool], num_layers: int, upper: int | None = None):
    """The fewest checkpointed blocks that fit, or None: none first, then bisection up to
    ``upper`` (known to fit, measured last if it is the answer) or ``num_layers`` (measured
    second: if even that does not fit, None)."""
    if probe(0):
        return 0
    if upper is None:
        if not probe(num_layers):
            return None
        upper, measured = num_layers, True
    else:
        measured = False
    low, high = 0, upper  # low does not fit, high does
    while high - low > 1:
        mid = (low + high) // 2
        if probe(mid):
            high, measured = mid, True
        else:
            low = mid
    if not measured:  # the bound from a larger micro-batch: timed here, and checked
        return high if probe(high) else None
    return high


def choose_plan(
    profiles: Iterable[Profile], budget_MiB: float, num_layers: int, tie: float = DEFAULT_TIE
) -> Plan:
    """The fastest measured configuration that fits ``budget_MiB``, and why, in words.

    Raises :class:`NoPlanFits`, naming the smallest peak measured, when none fits.
    """
    if not budget_MiB > 0:
        raise ValueError(f"the memory budget must be positive, got {budget_MiB} MiB")
    profiles = list(profiles)
    fitting = [p for p in profiles if p.fits(budget_MiB)]
    if not fitting:
        raise _no_fit(profiles, budget_MiB, num_layers)
    untimed = [p for p in fitting if p.tokens_per_s is None]
    if untimed:
        raise ValueError(f"profiles that fit must be timed: {untimed[0]}")
    best = max(fitting, key=lambda p: p.tokens_per_s)
    near = [p for p in fitting if p.tokens_per_s >= best.tokens_per_s * (1 - tie)]
    chosen = min(near, key=lambda p: (p.peak_MiB, p.checkpoint_layers))
    per_impl = {}
    for p in sorted(fitting, key=lambda p: -p.tokens_per_s):
        per_impl.setdefault(p.impl, p)
    return Plan(
        impl=chosen.impl,
        checkpoint_layers=chosen.checkpoint_layers,
        num_layers=num_layers,
        peak_MiB=chosen.peak_MiB,
        tokens_per_s=chosen.tokens_per_s,
        budget_MiB=budget_MiB,
        why=_why(chosen, best, per_impl, profiles, budget_MiB, num_layers, tie),
        best_per_impl=tuple(per_impl.values()),
        micro_batch_size=chosen.micro_batch_size,
    )


def _config(p: Profile, num_layers: int) -> str:
    return f"{p.impl}{_at(p)} with {p.checkpoint_layers} of {num_layers} blocks checkpointed"


def _at(p: Profile) -> str:
    return "" if p.micro_batch_size is None else f" at micro-batch {p.micro_batch_size}"


def _why(chosen, best, per_impl, profiles, budget_MiB, num_layers, tie) -> str:
    parts = [
        f"{_config(chosen, num_layers)}: {chosen.tokens_per_s:,.0f} tokens/s at a peak of "
        f"{chosen.peak_MiB:,.0f} MiB, within the budget of {budget_MiB:,.0f} MiB"
    ]
    if chosen is not best:
        parts.append(
            f"{_config(best, num_layers)} ran {best.tokens_per_s / chosen.tokens_per_s - 1:.1%} "
            f"faster, within {tie:.0%}, at a higher peak ({best.peak_MiB:,.0f} MiB): the "
            "smaller peak is kept as headroom"
        )
    others = [p for impl, p in per_impl.items() if impl != chosen.impl]
    if others:
        parts.append(
            "each other impl's best that fits: "
            + "; ".join(
                f"{p.impl}{_at(p)} with {p.checkpoint_layers} blocks checkpointed, "
                f"{p.tokens_per_s / chosen.tokens_per_s:.3f}x the tokens/s at "
                f"{p.peak_MiB:,.0f} MiB"
                for p in others
            )
        )
    out = sorted({p.impl for p in profiles} - set(per_impl))
    for impl in out:
        smallest = _smallest([p for p in profiles if p.impl == impl])
        parts.append(
            f"{impl} does not fit with every block checkpointed"
            + (" at any micro-batch" if smallest and smallest.micro_batch_size else "")
            + (f" (peak {smallest.peak_MiB:,.0f} MiB)" if smallest else " (out of memory)")
        )
    return "; ".join(parts)


def _smallest(profiles: list[Profile]) -> Profile | None:
    measured = [p for p in profiles if p.peak_MiB is not None]
    return min(measured, key=lambda p: p.peak_MiB) if measured else None


def _no_fit(profiles: list[Profile], budget_MiB: float, num_layers: int) -> NoPlanFits:
    smallest = _smallest(profiles)
    if not profiles:
        return NoPlanFits(f"no configuration was measured against the budget of "
                          f"{budget_MiB:,.0f} MiB", None)  # fmt: skip
    if smallest is None:
        return NoPlanFits(
            f"nothing fits the memory budget of {budget_MiB:,.0f} MiB: every step measured "
            f"({len(profiles)}, up to {num_layers} of {num_layers} blocks checkpointed) ran "
            "out of device memory; lower the micro-batch size or the sequence length",
            None,
        )
    need_gib = math.ceil(smallest.peak_MiB / 1024 * 100) / 100
    lower = "the micro-batch size or " if smallest.micro_batch_size is None else ""
    return NoPlanFits(
        f"nothing fits the memory budget of {budget_MiB:,.0f} MiB: the smallest peak measured "
        f"is {smallest.peak_MiB:,.0f} MiB ({_config(smallest, num_layers)}); raise the budget "
        f"to at least {need_gib} GiB (--memory-budget-gb), or lower {lower}the sequence length",
        smallest,
    )
