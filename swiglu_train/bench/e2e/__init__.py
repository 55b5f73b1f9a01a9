"""``benchmarks/bench_e2e.py``: whole pretraining runs (Lightning, Megatron) per impl, in rounds."""
