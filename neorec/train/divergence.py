"""Whether a training update diverged: what of a model holds NaN or inf.

The trainer checks the loss before each update; an update that makes weights NaN or inf shows
only in the next step's loss, and the last step has none. ``Trainer.check_weights_finite`` asks
``non_finite_weight`` before each checkpoint and after the last step (a checkpoint of diverged
weights was saved as complete, and the run ended with exit 0).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from neorec.embedding.cache_prefetch import cached_collections
from neorec.embedding.tbe import TableBatchedEmbeddingBags


def non_finite_weight(model: nn.Module) -> Optional[str]:
    """The first weight of ``model`` holding NaN or inf, in words ("dense weight NAME" or "table
    'T' row R (embedding row)", "(cache slot)" for a cached table), or None: its dense parameters,
    then the rows of its fused modules (device tables and cache slots, where an update writes;
    rows in a cached table's store are not read)."""
    for name, parameter in model.named_parameters():
        if not bool(torch.isfinite(parameter).all()):
            return f"dense weight {name.removeprefix('module.')}"
    cached = {name for collection in cached_collections(model) for name in collection.caches}
    for module in model.modules():
        if isinstance(module, TableBatchedEmbeddingBags):
            found = module.first_non_finite_row()
            if found is not None:
                table, row = found
                return f"table {table!r} row {row} ({'cache slot' if table in cached else 'embedding row'})"
    return None
