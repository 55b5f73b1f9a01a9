"""``swiglu-train bench-inference``: the no-grad paths by M, and the dispatch table they fit."""
