"""The planner's decision (swiglu_train.memory.plan) against recorded profiles: which impl and
how many checkpointed blocks for a budget, the bisection's probes, and the refusals."""

import math

import pytest

from swiglu_train.memory.plan import (
    NoPlanFits,
    Profile,
    accumulation,
    choose_plan,
    micro_batches,
    search,
    search_micro_batches,
    step_tokens_per_s,
)

LAYERS = 16
# Illustrative profiles of a 16-block model, shaped as the H200's will be (not measured there
# yet): model state 20,000 MiB; each block's activations by impl (drop_h keeps no h); a
# checkpointed block keeps its 64 MiB input; each checkpointed block costs a third of its
# step time again. drop_h_quack runs 1 % faster than normal unchecked.
STATE, KEPT = 20_000.0, 64.0
BLOCK_MiB = {"normal": 5_000.0, "drop_h": 4_300.0, "drop_h_quack": 4_300.0}
RATE = {"normal": 10_000.0, "drop_h": 9_800.0, "drop_h_quack": 10_100.0}


def recorded(impl: str, n: int) -> Profile:
    peak = STATE + (LAYERS - n) * BLOCK_MiB[impl] + n * KEPT
    return Profile(impl, n, peak, RATE[impl] / (1 + n / (3 * LAYERS)), peak - STATE)


SWEEP = [recorded(impl, n) for impl in BLOCK_MiB for n in range(LAYERS + 1)]


def test_the_plan_is_the_fastest_that_fits_and_says_why():
    # 60,000 MiB: normal needs 9 blocks checkpointed (at 8: 20,000 + 8 x 5,000 + 8 x 64 =
    # 60,512), drop_h and drop_h_quack 7 (at 6: 20,000 + 10 x 4,300 + 6 x 64 = 63,384)
    need = {impl: min(n for n in range(LAYERS + 1) if recorded(impl, n).fits(60_000))
            for impl in BLOCK_MiB}  # fmt: skip
    assert need == {"normal": 9, "drop_h": 7, "drop_h_quack": 7}
    plan = choose_plan(SWEEP, 60_000, LAYERS)
    assert (plan.impl, plan.checkpoint_layers) == ("drop_h_quack", 7)
    assert plan.tokens_per_s == pytest.approx(10_100 / (1 + 7 / 48))
    assert plan.budget_MiB == 60_000 and plan.peak_MiB <= 60_000
    assert plan.why.startswith("drop_h_quack with 7 of 16 blocks checkpointed: 8,815 tokens/s")
    assert "drop_h with 7 blocks checkpointed, 0.970x the tokens/s" in plan.why
    assert "normal with 9 blocks checkpointed, 0.955x the tokens/s" in plan.why
    assert [p.impl for p in plan.best_per_impl] == ["drop_h_quack", "drop_h", "normal"]
    record = plan.to_dict()
    assert record["impl"] == "drop_h_quack" and record["best_per_impl"][2]["checkpoint_layers"] == 9


def test_within_the_tie_the_smaller_peak_is_kept():
    fast = Profile("normal", 0, 70_000.0, 10_050.0)
    lean = Profile("drop_h", 0, 62_000.0, 10_000.0)  # 0.5 % slower, 8,000 MiB less
    plan = choose_plan([fast, lean], 80_000, LAYERS)
    assert plan.impl == "drop_h"
    assert "normal with 0 of 16 blocks checkpointed ran 0.5% faster, within 1%" in plan.why
    assert choose_plan([fast, lean], 80_000, LAYERS, tie=0.001).impl == "normal"


def test_bisection_finds_each_impls_fewest_blocks_in_few_probes():
    """Against the whole sweep at every budget from too small to ample: the plan the search
    finds is within the tie of the best configuration of the sweep, and it measures at most
    2 + ceil(log2(16)) points per impl."""
    table = {(p.impl, p.checkpoint_layers): p for p in SWEEP}
    peaks = sorted({p.peak_MiB for p in SWEEP})
    budgets = [peaks[0] - 1, *peaks, *(p + 1 for p in peaks), peaks[-1] * 2]
    for budget in budgets:
        probes = search(BLOCK_MiB, LAYERS, budget, lambda i, n: table[i, n])
        for impl in BLOCK_MiB:
            mine = [p for p in probes if p.impl == impl]
            assert len(mine) <= 2 + math.ceil(math.log2(LAYERS))
            fitting = [p.checkpoint_layers for p in SWEEP if p.impl == impl and p.fits(budget)]
            if fitting:  # the fewest blocks that fit was measured
                assert min(fitting) in [p.checkpoint_layers for p in mine if p.fits(budget)]
        if budget < peaks[0]:
            with pytest.raises(NoPlanFits):
                choose_plan(probes, budget, LAYERS)
            continue
        plan, best = choose_plan(probes, budget, LAYERS), choose_plan(SWEEP, budget, LAYERS)
        assert plan.peak_MiB <= budget
        assert plan.tokens_per_s >= best.tokens_per_s * 0.99


def test_an_ample_budget_costs_one_probe_per_impl_and_too_small_two():
    table = {(p.impl, p.checkpoint_layers): p for p in SWEEP}
    probes = search(BLOCK_MiB, LAYERS, 1e9, lambda i, n: table[i, n])
    assert [(p.impl, p.checkpoint_layers) for p in probes] == [(i, 0) for i in BLOCK_MiB]
    probes = search(BLOCK_MiB, LAYERS, 1_000, lambda i, n: table[i, n])
    assert [(p.impl, p.checkpoint_layers) for p in probes] == [
        (i, n) for i in BLOCK_MiB for n in (0, LAYERS)
    ]


def test_nothing_fits_names_the_smallest_peak_measured():
    profiles = [Profile("normal", 16, 21_500.0, 7_000.0), Profile("drop_h", 16, 21_024.4, 6_900.0),
                Profile("drop_h", 0, None)]  # fmt: skip
    with pytest.raises(NoPlanFits) as e:
        choose_plan(profiles, 20_480, LAYERS)
    assert e.value.smallest == profiles[1]
    assert str(e.value) == (
        "nothing fits the memory budget of 20,480 MiB: the smallest peak measured is 21,024 MiB "
        "(drop_h with 16 of 16 blocks checkpointed); raise the budget to at least 20.54 GiB "
        "(--memory-budget-gb), or lower the micro-batch size or the sequence length"
    )


def test_every_step_out_of_memory_and_bad_input_are_refused():
    with pytest.raises(NoPlanFits, match=r"every step measured \(2, up to 16 of 16 blocks "
                       r"checkpointed\) ran out of device memory") as e:  # fmt: skip
        choose_plan([Profile("normal", 0, None), Profile("normal", 16, None)], 1e5, LAYERS)
    assert e.value.smallest is None
    with pytest.raises(ValueError, match="budget must be positive, got 0 MiB"):
        choose_plan(SWEEP, 0, LAYERS)
    with pytest.raises(ValueError, match="profiles that fit must be timed"):
        choose_plan([Profile("normal", 0, 10.0)], 100, LAYERS)
    with pytest.raises(ValueError, match=r"measure\('normal', 0\) returned a profile of 'x', 0"):
        search(["normal"], LAYERS, 100, lambda i, n: Profile("x", n, 1.0, 1.0))
    with pytest.raises(ValueError, match="num_layers must be at least 1, got 0"):
        search(["normal"], 0, 100, recorded)


def test_an_impl_that_fits_nowhere_is_named_in_the_why():
    table = {(p.impl, p.checkpoint_layers): p for p in SWEEP}
    table["normal", LAYERS] = Profile("normal", LAYERS, None)  # out of memory at every N
    table["normal", 0] = Profile("normal", 0, None)
    probes = search(BLOCK_MiB, LAYERS, 60_000, lambda i, n: table[i, n])
    plan = choose_plan(probes, 60_000, LAYERS)
    assert plan.impl == "drop_h_quack"
    assert plan.why.endswith("normal does not fit with every block checkpointed (out of memory)")


GLOBAL = 16  # sequences per optimizer step: micro-batches 16, 8, 4, 2, 1


def at_micro(impl: str, n: int, m: int) -> Profile:
    """``recorded`` at micro-batch m (recorded is micro-batch 4): activations scale with m;
    tokens/s saturates, m / (m + 1) of the impl's rate."""
    peak = STATE + ((LAYERS - n) * BLOCK_MiB[impl] + n * KEPT) * m / 4
    rate = RATE[impl] * m / (m + 1) / (1 + n / (3 * LAYERS))
    return Profile(impl, n, peak, rate, peak - STATE, m)


MICRO_SWEEP = [at_micro(i, n, m) for i in BLOCK_MiB for n in range(LAYERS + 1)
               for m in micro_batches(GLOBAL)]  # fmt: skip


def test_micro_batches_are_the_global_batchs_divisors_and_bad_ones_are_refused():
    assert micro_batches(12) == [12, 6, 4, 3, 2, 1] and micro_batches(1) == [1]
    assert accumulation(12, 4) == 3
    with pytest.raises(ValueError, match=r"needs a global batch to divide: set "
                       r"train.global_batch_size \(--global-batch-size\)"):  # fmt: skip
        micro_batches(None)
    with pytest.raises(ValueError, match=r"must be a positive integer \(sequences\); got 0"):
        micro_batches(0)
    with pytest.raises(ValueError, match="global batch 12 is not divisible by the micro-batch 5"):
        accumulation(12, 5)


def test_the_micro_batch_search_finds_the_sweeps_best_with_fewer_probes():
    """At every budget from too small to ample: the plan from the pruned search is within the
    tie of the best configuration of the whole (impl, blocks, micro-batch) sweep, and costs far
    fewer points than the sweep."""
    peaks = sorted({p.peak_MiB for p in MICRO_SWEEP})
    for budget in [peaks[0] - 1, *peaks[:: len(peaks) // 40], peaks[-1] + 1]:
        probes = search_micro_batches(BLOCK_MiB, LAYERS, budget, micro_batches(GLOBAL), at_micro)
        for impl in BLOCK_MiB:
            for m in micro_batches(GLOBAL):
                mine = [p for p in probes if (p.impl, p.micro_batch_size) == (impl, m)]
                assert len(mine) <= 2 + math.ceil(math.log2(LAYERS))
        assert len(probes) <= len(MICRO_SWEEP) // 3
        assert len(set(probes)) == len(probes)  # no point measured twice
        if budget < peaks[0]:
            with pytest.raises(NoPlanFits) as e:
                choose_plan(probes, budget, LAYERS)
            assert e.value.smallest.micro_batch_size == 1  # it went down to the smallest
            assert "or lower the sequence length" in str(e.value)
            assert "micro-batch size" not in str(e.value)
            continue
        plan, best = choose_plan(probes, budget, LAYERS), choose_plan(MICRO_SWEEP, budget, LAYERS)
        assert plan.peak_MiB <= budget and GLOBAL % plan.micro_batch_size == 0
        assert plan.tokens_per_s >= best.tokens_per_s * 0.99


def test_the_micro_batch_plan_trades_blocks_for_micro_batch_and_says_so():
    # 60,000 MiB: the fastest that fits, over every (impl, blocks, micro-batch) of the sweep
    probes = search_micro_batches(BLOCK_MiB, LAYERS, 60_000, micro_batches(GLOBAL), at_micro)
    plan = choose_plan(probes, 60_000, LAYERS)
    best = max((p for p in MICRO_SWEEP if p.fits(60_000)), key=lambda p: p.tokens_per_s)
    assert (plan.impl, plan.micro_batch_size, plan.checkpoint_layers) == (
        best.impl, best.micro_batch_size, best.checkpoint_layers)  # fmt: skip
    assert plan.to_dict()["micro_batch_size"] == best.micro_batch_size
    assert plan.why.startswith(
        f"{best.impl} at micro-batch {best.micro_batch_size} with {best.checkpoint_layers} of "
        "16 blocks checkpointed: "
    )
    # an impl stops descending at the first micro-batch it fits unchecked
    for impl in BLOCK_MiB:
        unchecked = [p.micro_batch_size for p in probes if p.impl == impl and p.fits(60_000)
                     and p.checkpoint_layers == 0]  # fmt: skip
        assert len(unchecked) == 1
        assert min(p.micro_batch_size for p in probes if p.impl == impl) == unchecked[0]


def test_a_micro_batch_measurer_that_answers_for_another_is_refused():
    with pytest.raises(ValueError, match=r"measure\('normal', 0, 4\) returned a profile of "
                       r"micro-batch 2"):  # fmt: skip
        search_micro_batches(["normal"], LAYERS, 1e9, [4],
                             lambda i, n, m: at_micro(i, n, 2))  # fmt: skip


def test_a_step_counts_its_micro_batches_and_the_optimizer_once():
    # 4 micro-batches of 100 tokens: the first, 3 accumulating, one optimizer step
    assert step_tokens_per_s(100, 4, 0.1, 0.2, 1.0) == pytest.approx(400 / (0.1 + 3 * 0.2 + 1.0))
    assert step_tokens_per_s(100, 1, 0.1, None, 1.0) == pytest.approx(100 / 1.1)
    with pytest.raises(ValueError, match="needs an accumulating micro-batch timed"):
        step_tokens_per_s(100, 2, 0.1, None, 1.0)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="accumulation must be a positive integer"):
            step_tokens_per_s(100, bad, 0.1, 0.1, 1.0)
    with pytest.raises(ValueError, match=r"must add up to a positive time, got 0\.0 s"):
        step_tokens_per_s(100, 1, 0.0, None, 0.0)


SEQ, BATCH, OPTIMIZER_S = 4096, 8, 1.0  # an optimizer step as long as a micro-batch of 10


def timed_at(impl: str, n: int, m: int) -> Profile:
    """Recorded parts at micro-batch m of the global batch BATCH: memory as ``at_micro``; a
    micro-batch takes 0.1 s a sequence (no faster per token when larger), a checkpointed
    block a third of its share again; the optimizer step OPTIMIZER_S."""
    peak = at_micro(impl, n, m).peak_MiB
    micro_s = 0.1 * m * (1 + n / (3 * LAYERS))
    a = accumulation(BATCH, m)
    rate = step_tokens_per_s(m * SEQ, a, micro_s, micro_s if a > 1 else None, OPTIMIZER_S)
    return Profile(impl, n, peak, rate, peak - STATE, m, a, micro_s, micro_s, OPTIMIZER_S)


def test_an_expensive_optimizer_step_counts_once_per_global_batch_not_per_micro_batch():
    """At 60,000 MiB normal needs 13 blocks checkpointed at micro-batch 8, 9 at 4, none at 2.
    The optimizer step runs once per 8 sequences whatever the micro-batch, so the recompute
    decides: micro-batch 2 unchecked. Counted after every micro-batch, the optimizer would have
    made micro-batch 8 (13 blocks recomputed) look 2.4x faster than micro-batch 2."""
    probes = search_micro_batches(["normal"], LAYERS, 60_000, micro_batches(BATCH), timed_at)
    fits = [(p.micro_batch_size, p.checkpoint_layers) for p in probes if p.fits(60_000)]
    assert {m: min(n for mm, n in fits if mm == m) for m, _ in fits} == {8: 13, 4: 9, 2: 0}
    plan = choose_plan(probes, 60_000, LAYERS)
    assert (plan.micro_batch_size, plan.checkpoint_layers) == (2, 0)
    # 4 micro-batches of 0.2 s and one optimizer step: 8 sequences in 1.8 s
    assert plan.tokens_per_s == pytest.approx(BATCH * SEQ / (4 * 0.2 + OPTIMIZER_S))
    big = timed_at("normal", 13, 8)
    assert big.tokens_per_s == pytest.approx(BATCH * SEQ / (0.8 * (1 + 13 / 48) + OPTIMIZER_S))
    assert plan.tokens_per_s > big.tokens_per_s
    # what the bias measured: one micro-batch and the optimizer as a step
    biased = {m: step_tokens_per_s(m * SEQ, 1, 0.1 * m * (1 + n / 48), None, OPTIMIZER_S)
              for m, n in ((8, 13), (2, 0))}  # fmt: skip
    assert biased[8] / biased[2] == pytest.approx(2.38, abs=0.01)
