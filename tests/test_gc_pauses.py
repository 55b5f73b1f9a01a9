"""The garbage-collector meter and Megatron-LM's --manual-gc switch."""

from __future__ import annotations

import gc

from swiglu_train.gc_pauses import GcPauses, manual_gc


def test_pauses_count_each_collection_and_reset_on_take() -> None:
    with GcPauses() as pauses:
        gc.collect()
        gc.collect(0)
        seconds, collections = pauses.take()
        assert collections == 2 and seconds > 0
        assert pauses.take() == (0.0, 0)
    gc.collect()  # the callback is gone: nothing counts any more
    assert pauses.take() == (0.0, 0)


def test_manual_gc_disables_automatic_collection_and_gives_it_back() -> None:
    assert gc.isenabled()
    with manual_gc(True), GcPauses() as pauses:
        assert not gc.isenabled()
        garbage = [[] for _ in range(100_000)]  # far past gen 0's threshold of allocations
        del garbage
        assert pauses.take() == (0.0, 0)
    assert gc.isenabled()
    with manual_gc(False):
        assert gc.isenabled()


def test_manual_gc_is_given_back_when_the_loop_raises() -> None:
    try:
        with manual_gc(True):
            raise RuntimeError("step failed")
    except RuntimeError:
        pass
    assert gc.isenabled()
