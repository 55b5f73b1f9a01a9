"""``benchmarks/fuzz_gpu.py`` and the suite's CPU subset: every impl on random shapes."""
