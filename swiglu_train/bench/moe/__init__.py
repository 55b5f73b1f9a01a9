"""``swiglu-train bench-moe``: routed SwiGLU experts (ParExperts) against the peers, paired
with the step's six grouped GEMMs, at the expert shapes of public MoE models."""
