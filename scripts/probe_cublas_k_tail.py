"""Where torch's cuBLAS GEMM loses accuracy on a weight-gradient shape (issue 22's fuzz finding).

The GPU fuzz found fp16 ``a.t() @ b`` with a [17480, 128] and b [17480, 48] 2.1 % off float64 on
the H200 (cublas_fp16_k_tail_h200.txt), at K = 17480 and not at 17472. This sweeps K around
multiples of 16, the output shape and the dtype, and prints each relative (Frobenius) error
against float64, so that a rule for when to route the GEMM elsewhere rests on measurements.

    python scripts/probe_cublas_k_tail.py --out $OUT/probe_cublas_k_tail_h200.json
"""

from __future__ import annotations

import argparse
import sys

import torch

from swiglu_train.bench.mlp import environment
from swiglu_train.files import write_json_atomic

K_BASES = (1024, 4096, 17472, 65536)
K_OFFSETS = (0, 1, 2, 4, 8, 12, 15)
OUTPUTS = ((128, 48), (128, 1024), (4096, 4096), (28672, 4096))
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def rel_err(k: int, m: int, n: int, dtype: torch.dtype, gen: torch.Generator) -> float:
    a = torch.randn(k, m, device="cuda", dtype=dtype, generator=gen)
    b = torch.randn(k, n, device="cuda", dtype=dtype, generator=gen)
    want = a.double().t() @ b.double()
    got = (a.t() @ b).double()
    return ((got - want).norm() / want.norm()).item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: this probe needs a CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, dtype in DTYPES.items():
        for m, n in OUTPUTS:
            for base in K_BASES:
                for off in K_OFFSETS:
                    k = base + off
                    err = rel_err(k, m, n, dtype, gen)
                    rows.append({"dtype": name, "K": k, "M": m, "N": n, "rel_err": err})
                    flag = "  <-- over 2^-8" if err > 2**-8 else ""
                    print(f"{name} [{k}]^T [{m}] @ [{k}, {n}]: {err:.2e}{flag}", flush=True)
    result = {"command": "python " + " ".join(sys.argv), **environment(torch.device("cuda"), None)}
    write_json_atomic(args.out, {**result, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
