"""Run the MLP benchmark; the same as ``swiglu-train bench`` (see ``--help``)."""

import sys

from swiglu_train.cli import app

if __name__ == "__main__":
    app(["bench", *sys.argv[1:]])
