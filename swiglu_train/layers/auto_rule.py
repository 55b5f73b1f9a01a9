"""The rule ``impl="auto"`` is judged by, on measurements: the fastest impl by its paired ratio
to the six-GEMM floor, and among impls within ``TIE_TOLERANCE`` (1 %, issue 18's target) of it
the one with the least after-forward memory. Auto itself applies the rule to its model's
predictions, with a tie of its own (``layers/auto.py``); the crossover and grid benchmarks
apply it to what they measured, to mark each point's winner and to judge auto's picks."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from swiglu_train.layers.auto import fastest_or_leanest

TIE_TOLERANCE = 0.01  # impls measured within 1 % of the fastest count as equally fast


@dataclass(frozen=True)
class ImplStats:
    """One impl at one point: its paired median ratio to the floor, its after-forward MiB."""

    ratio_to_floor: float
    after_forward_MiB: float


def measured_pick(impls: Mapping[str, ImplStats]) -> str:
    """The rule at one point. Fastest by ratio to floor (paired, so it cancels clock drift that
    unpaired ms medians keep); within TIE_TOLERANCE, least memory wins."""
    return fastest_or_leanest(
        {n: s.ratio_to_floor for n, s in impls.items()},
        {n: s.after_forward_MiB for n, s in impls.items()},
        TIE_TOLERANCE,
    )
