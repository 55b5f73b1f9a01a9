"""Run the crossover benchmark; the same as ``swiglu-train bench-crossover`` (see ``--help``)."""

import sys

from swiglu_train.cli import app

if __name__ == "__main__":
    app(["bench-crossover", *sys.argv[1:]])
