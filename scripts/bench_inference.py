"""Run the inference benchmark; the same as ``swiglu-train bench-inference`` (see ``--help``)."""

import sys

from swiglu_train.cli import app

if __name__ == "__main__":
    app(["bench-inference", *sys.argv[1:]])
