"""``swiglu-train bench-grid`` and ``bench-crossover``: the layer over many shapes, for auto."""
