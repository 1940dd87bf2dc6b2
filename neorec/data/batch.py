"""The unit of training data: ``Batch(dense, sparse, labels)``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from neorec.sparse.jagged import KeyedJaggedTensor


@dataclass
class Batch:
    """One mini-batch.

    dense:  [B, num_dense] float32 dense features.
    sparse: KeyedJaggedTensor with batch size B (one key per sparse feature).
    labels: [B] float32 click labels in {0, 1}.
    """

    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    labels: torch.Tensor

    @property
    def batch_size(self) -> int:
        return int(self.labels.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        return Batch(
            self.dense.to(device, non_blocking=non_blocking),
            self.sparse.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
        )
