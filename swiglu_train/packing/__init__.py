"""Layout tools: switch a live model (and its optimizer) between the canonical and packed fc1
layouts, and convert checkpoints, optimizer state included."""

from swiglu_train.layers.layout import CANONICAL, Layout, packed_order, relayout
from swiglu_train.packing.convert import (
    Converted,
    convert_checkpoint,
    from_hf,
    hparams_chunk,
    hparams_impl,
    records_layout,
    switch_impl,
    to_hf,
)
from swiglu_train.packing.optimizer import permute_state

__all__ = [
    "CANONICAL",
    "Converted",
    "Layout",
    "convert_checkpoint",
    "from_hf",
    "hparams_chunk",
    "hparams_impl",
    "packed_order",
    "permute_state",
    "records_layout",
    "relayout",
    "switch_impl",
    "to_hf",
]
