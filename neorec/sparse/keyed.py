"""``KeyedTensor``: pooled embeddings of several features side by side in one dense tensor."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Union

import torch

from neorec.sparse.column_blocks import ColumnBlocks


class KeyedTensor:
    """Per-feature pooled embeddings: ``values`` [B, sum(length_per_key)], feature ``keys[i]``
    occupying columns ``offset_per_key()[i] : offset_per_key()[i + 1]``. The values may be given as
    ``ColumnBlocks`` (a sharded collection's received parts): ``values`` then copies them into one
    tensor on first use, and ``blocks`` lets a consumer read them where they are."""

    def __init__(self, keys: Sequence[str], length_per_key: Sequence[int],
                 values: Union[torch.Tensor, ColumnBlocks]) -> None:
        self.keys: List[str] = list(keys)
        self.length_per_key: List[int] = [int(n) for n in length_per_key]
        if len(self.keys) != len(self.length_per_key):
            raise ValueError(f"KeyedTensor: {len(self.keys)} keys but {len(self.length_per_key)} lengths")
        if any(n < 0 for n in self.length_per_key):
            raise ValueError(f"KeyedTensor: widths must be >= 0, got {self.length_per_key}")
        if len(set(self.keys)) != len(self.keys):
            raise ValueError(f"KeyedTensor: duplicate keys {sorted({k for k in self.keys if self.keys.count(k) > 1})}")
        self._blocks: Optional[ColumnBlocks] = None
        self._values: Optional[torch.Tensor] = None
        if isinstance(values, ColumnBlocks):
            if values.width != sum(self.length_per_key):
                raise ValueError(f"KeyedTensor: values must be [B, {sum(self.length_per_key)}], got column blocks "
                                 f"{values.width} wide")
            self._blocks = values
        else:
            if values.dim() != 2 or values.shape[1] != sum(self.length_per_key):
                raise ValueError(
                    f"KeyedTensor: values must be [B, {sum(self.length_per_key)}], got {tuple(values.shape)}"
                )
            self._values = values

    @property
    def values(self) -> torch.Tensor:
        """[B, sum(length_per_key)]; built from the column blocks on first use when given as such."""
        if self._values is None:
            assert self._blocks is not None
            self._values = self._blocks.materialize()
        return self._values

    @property
    def blocks(self) -> Optional[ColumnBlocks]:
        """The column blocks the values were given as (None when given as a tensor): a consumer
        that reads them in place avoids copying them into ``values``."""
        return self._blocks

    @property
    def batch_size(self) -> int:
        return self._blocks.rows if self._blocks is not None else int(self.values.shape[0])

    def offset_per_key(self) -> List[int]:
        out = [0]
        for n in self.length_per_key:
            out.append(out[-1] + n)
        return out

    def __getitem__(self, key: str) -> torch.Tensor:
        try:
            i = self.keys.index(key)
        except ValueError:
            raise KeyError(f"KeyedTensor has no key {key!r}; keys are {self.keys}") from None
        off = self.offset_per_key()
        return self.values[:, off[i] : off[i + 1]]

    def to_dict(self) -> Dict[str, torch.Tensor]:
        return {k: self[k] for k in self.keys}

    def __repr__(self) -> str:
        return f"KeyedTensor(keys={self.keys}, length_per_key={self.length_per_key}, shape={(self.batch_size, sum(self.length_per_key))})"
