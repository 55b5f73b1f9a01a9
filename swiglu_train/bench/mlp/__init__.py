"""``swiglu-train bench``: one MLP layer per variant, paired against the six-GEMM floor."""
