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


class NonFiniteLossError(ValueError):
    """The training loss became NaN or infinite (training stops before the update is applied), or
    an update left weights so (stopped before they are saved).

    A ValueError (the message is for the user, no stack trace) whose command exits 1, a failed run,
    not 2 as for a command that could not run as given.
    """

    exit_code = 1


def diverged(what: str, checkpointer=None) -> NonFiniteLossError:
    """The error of a diverged update: ``what``, then what to do and, from ``checkpointer``
    (a ``Checkpointer`` or None), the last complete checkpoint to resume from."""
    last = checkpointer.go_on_from() if checkpointer is not None else None
    where = f"; its last complete checkpoint is of step {last[0]}: --resume {last[1]}" if last else ""
    return NonFiniteLossError(f"{what}; stopping without saving it (lower the learning rates){where}")


def non_finite_weight(model: nn.Module) -> Optional[str]:
    """The first weight of ``model`` holding NaN or inf, in words ("dense weight NAME" or "table
    'T' row R (embedding row)", "row R (cache slot S)" for a cached table), or None: its dense parameters,
    then the rows of its fused modules (device tables and cache slots, where an update writes).
    Rows in a cached table's store are not read: its store refuses a non-finite row that the cache
    writes back (``storage.NonFiniteRowError``, which the trainer reports as this check does)."""
    for name, parameter in model.named_parameters():
        if not bool(torch.isfinite(parameter).all()):
            return f"dense weight {name.removeprefix('module.')}"
    caches = {name: cache for collection in cached_collections(model) for name, cache in collection.caches.items()}
    for module in model.modules():
        if isinstance(module, TableBatchedEmbeddingBags):
            found = module.first_non_finite_row()
            if found is not None:
                table, row = found
                if table not in caches:
                    return f"table {table!r} row {row} (embedding row)"
                return f"table {table!r} row {int(caches[table].slot_rows[row])} (cache slot {row})"
    return None
