"""Third-party messages that a pretrain run triggers and that tell its user nothing, filtered
where the run triggers them, each by its own text: every other warning and log line is kept."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

# Lightning's Trainer advertises its cloud logger whenever a run logs to another one.
LITLOGGER_TIP = "try installing [litlogger]"
# Lightning 2.6's pytree helper builds torch's LeafSpec, which torch 2.10+ deprecates: a
# FutureWarning at every fit, about Lightning's code.
LEAFSPEC = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
# The logger Lightning's rank_zero_info writes to (lightning.pytorch.utilities.rank_zero).
RANK_ZERO_LOGGER = "lightning.pytorch.utilities.rank_zero"


class _DropLitloggerTip(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return LITLOGGER_TIP not in record.getMessage()


@contextlib.contextmanager
def quiet_lightning() -> Iterator[None]:
    """Around the Trainer's construction and fit: without Lightning's litlogger tip and its
    LeafSpec deprecation warning."""
    tip = _DropLitloggerTip()
    logger = logging.getLogger(RANK_ZERO_LOGGER)
    logger.addFilter(tip)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=LEAFSPEC, category=FutureWarning)
            yield
    finally:
        logger.removeFilter(tip)
