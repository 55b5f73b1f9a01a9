"""``swiglu-train bench-memory``: stacks of ParMLP layers through the memory profiler."""
