"""Layout tools: switch a live model (and its optimizer) between the canonical and packed fc1
layouts, and convert checkpoints, optimizer state included."""

from swiglu_train.layers.layout import CANONICAL, Layout, packed_order, relayout
from swiglu_train.packing.checkpoint_read import records_layout
from swiglu_train.packing.convert import Converted, convert_checkpoint
from swiglu_train.packing.hf import from_hf, to_hf
from swiglu_train.packing.lightning_meta import hparams_chunk, hparams_impl
from swiglu_train.packing.optimizer import permute_state
from swiglu_train.packing.switch import switch_impl

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
