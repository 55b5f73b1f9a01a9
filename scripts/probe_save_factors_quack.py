"""Which GEMM settings make save_factors_quack fastest: quack autotuning per pass, and quack's
GEMM for fc2 / grad_W2 and grad_x / grad_W1, against the shipped default, paired in the bench.

    python scripts/probe_save_factors_quack.py --samples 40 --json OUT.json [bench options]
"""

import sys

from swiglu_train.bench.variants import BUILDERS, ours
from swiglu_train.cli import app
from swiglu_train.ops.quack_save_factors import Gemms, save_factors_quack_mlp

SETTINGS = {
    "sfq_tune_fwd": Gemms(tune_forward=True),
    "sfq_tune_both": Gemms(tune_forward=True, tune_backward=True),
    "sfq_tune_fwd_quack_fc2": Gemms(tune_forward=True, quack_fc2=True),
    "sfq_tune_fwd_quack_all": Gemms(tune_forward=True, quack_fc2=True, quack_fc1_grads=True),
}


def with_gemms(gemms: Gemms):
    def build(w):
        mlp = ours("save_factors_quack")(w)
        fc1, fc2 = mlp.fc1.weight, mlp.fc2.weight
        return lambda x: save_factors_quack_mlp(x, fc1, None, fc2, None, gemms=gemms)

    return build


if __name__ == "__main__":
    BUILDERS.update({name: with_gemms(g) for name, g in SETTINGS.items()})
    variants = ["quack", "drop_h_quack", "save_factors_quack", *SETTINGS]
    app(["bench", "--variants", ",".join(variants), *sys.argv[1:]])
