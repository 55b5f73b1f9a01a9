"""Logic of the GPU scripts that can be checked without a GPU."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("capacity", "limit"), [(1, 64), (5, 64), (37, 64), (64, 64), (100, 64)])
def test_micro_batch_search_finds_the_largest_fit(capacity, limit):
    search = load_script("max_micro_batch").largest_fitting
    calls = []

    def fits(n):
        calls.append(n)
        return n <= capacity

    best, tried = search(fits, limit)
    assert best == min(capacity, limit)
    assert tried == calls and len(calls) <= 2 * limit.bit_length() + 1


def test_micro_batch_search_when_nothing_fits():
    best, tried = load_script("max_micro_batch").largest_fitting(lambda n: False, 64)
    assert best == 0 and tried == [1]
