"""torchrun entry point: recipes/pretrain_megatron.py on CPU, with the CUDA-only calls shimmed.

The recipe seeds Megatron's model-parallel RNG through ``model_parallel_cuda_manual_seed``,
which needs CUDA; here it installs the CPU shims of megatron_support instead.
"""

import os
import runpy
import sys
from pathlib import Path

from megatron_support import shim_cuda_only_calls

from megatron.core import tensor_parallel  # isort: skip

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "pretrain_megatron.py"

tensor_parallel.model_parallel_cuda_manual_seed = lambda seed, *args, **kwargs: (
    shim_cuda_only_calls(seed)
)
os.environ["SWIGLU_TRAIN_MEGATRON_CPU_SHIMS"] = "1"  # the recipe checks for it at --device cpu
sys.argv = [str(RECIPE), *sys.argv[1:]]
runpy.run_path(str(RECIPE), run_name="__main__")
