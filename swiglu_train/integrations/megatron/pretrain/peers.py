"""Peers the recipe runs for A/B inside Megatron's own MLP: ``--mlp-impl liger`` is
Liger-Kernel's Megatron SwiGLU, the way its users turn it on.

Liger (0.8.5+) patches ``megatron.core.fusions.fused_bias_swiglu.SwiGLUFunction`` with its
fused gate-up Triton kernel (``apply_liger_kernel_to_megatron(swiglu=True)``, its "Mode 1");
Megatron's MLP reaches it through ``bias_swiglu_impl`` when ``bias_activation_fusion`` is on
and there is no fc1 bias, as in this recipe. Only the SwiGLU is patched (not its RMSNorm or
cross-entropy), so the A/B against ``stock`` differs in the MLP's activation alone. The patch
is process-wide, as Liger makes it: the recipe runs one impl per process.
"""

from __future__ import annotations

import importlib.metadata

LIGER_MIN = "0.8.5"  # the first release with liger_kernel.megatron


def patch_liger_swiglu() -> str:
    """Patch Megatron's SwiGLU with Liger's and check that it took; returns a line saying so.
    Raises SystemExit naming the fix when liger-kernel (with its Megatron adapter) is absent."""
    try:
        from liger_kernel.megatron import apply_liger_kernel_to_megatron
    except ImportError as e:
        raise SystemExit(
            f"--mlp-impl liger needs liger-kernel>={LIGER_MIN} (its Megatron SwiGLU, "
            f"liger_kernel.megatron): pip install 'liger-kernel>={LIGER_MIN}' ({e})"
        ) from e
    from megatron.core.fusions import fused_bias_swiglu

    apply_liger_kernel_to_megatron(rms_norm=False, swiglu=True)
    patched = fused_bias_swiglu.SwiGLUFunction
    if not patched.__module__.startswith("liger_kernel."):
        raise RuntimeError(
            "liger-kernel's patch did not replace megatron.core.fusions.fused_bias_swiglu."
            f"SwiGLUFunction (it is {patched.__module__}.{patched.__qualname__}): this "
            "megatron-core and liger-kernel do not fit together, and the run would be stock's"
        )
    version = importlib.metadata.version("liger-kernel")
    return f"mlp: Megatron's MLP with Liger-Kernel {version}'s SwiGLU (fused gate-up kernel)"
