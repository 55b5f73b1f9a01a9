"""``swiglu-train pretune``: each quack GEMM's fastest library at a model's shapes, cached."""
