"""``KeyedTensor``: pooled embeddings of several features side by side in one dense tensor."""

from __future__ import annotations

from typing import Dict, List, Sequence

import torch


class KeyedTensor:
    """Per-feature pooled embeddings: ``values`` [B, sum(length_per_key)], feature ``keys[i]``
    occupying columns ``offset_per_key()[i] : offset_per_key()[i + 1]``."""

    def __init__(self, keys: Sequence[str], length_per_key: Sequence[int], values: torch.Tensor) -> None:
        self.keys: List[str] = list(keys)
        self.length_per_key: List[int] = [int(n) for n in length_per_key]
        if len(self.keys) != len(self.length_per_key):
            raise ValueError(f"KeyedTensor: {len(self.keys)} keys but {len(self.length_per_key)} lengths")
        if values.dim() != 2 or values.shape[1] != sum(self.length_per_key):
            raise ValueError(
                f"KeyedTensor: values must be [B, {sum(self.length_per_key)}], got {tuple(values.shape)}"
            )
        self.values = values

    def offset_per_key(self) -> List[int]:
        out = [0]
        for n in self.length_per_key:
            out.append(out[-1] + n)
        return out

    def __getitem__(self, key: str) -> torch.Tensor:
        i = self.keys.index(key)
        off = self.offset_per_key()
        return self.values[:, off[i] : off[i + 1]]

    def to_dict(self) -> Dict[str, torch.Tensor]:
        return {k: self[k] for k in self.keys}

    def __repr__(self) -> str:
        return f"KeyedTensor(keys={self.keys}, length_per_key={self.length_per_key}, shape={tuple(self.values.shape)})"
