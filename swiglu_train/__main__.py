"""``python -m swiglu_train`` is the ``swiglu-train`` command."""

from swiglu_train.cli import app

app(prog_name="swiglu-train")
