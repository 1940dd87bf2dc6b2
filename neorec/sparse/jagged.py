"""Lengths-based jagged sparse input: ``KeyedJaggedTensor``.

A batch of sparse features is stored as one flat ``values`` tensor of ids, plus ``lengths`` in
key-major order: ``lengths[k * batch_size + b]`` is how many ids feature ``keys[k]`` has for
sample ``b``. Optional per-value ``weights`` ride along with ``values``.

    kjt = KeyedJaggedTensor(keys=["user", "item"], values=torch.tensor([3, 1, 4, 1, 5]),
                            lengths=torch.tensor([1, 1, 2, 1]))   # batch size 2
    kjt["item"].values   # tensor([4, 1, 5])
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence

import torch


@dataclass
class JaggedTensor:
    """One feature's ids for a batch: ``values`` [N], ``lengths`` [B], ``weights`` [N] or None."""

    values: torch.Tensor
    lengths: torch.Tensor
    weights: Optional[torch.Tensor] = None

    def offsets(self) -> torch.Tensor:
        """[B + 1] start of each sample's ids in ``values``, last entry = N."""
        return _offsets_from_lengths(self.lengths)

    def to_list(self) -> List[List[int]]:
        """Per-sample id lists (for debugging and tests)."""
        out, start = [], 0
        for n in self.lengths.tolist():
            out.append(self.values[start : start + n].tolist())
            start += n
        return out


def _offsets_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, dim=0, out=offsets[1:])
    return offsets


class KeyedJaggedTensor:
    """Sparse features of a batch: keys, flat ids, key-major lengths, optional per-value weights.

    Args:
        keys: feature names, unique.
        values: [N] integer ids, all features concatenated key by key.
        lengths: [len(keys) * batch_size] non-negative counts, key-major.
        weights: [N] float per-value weights, or None.
        batch_size: samples per key; inferred from ``lengths`` when omitted (0 when there are
            no keys: give it for a batch without sparse features).
        validate: check shapes, dtypes and lengths (one pass; on by default).

    A KJT is not to be changed in place: its offsets and per-key lengths are computed once, on first
    use (every transform and ``to`` returns a new KJT).
    """

    def __init__(
        self,
        keys: Sequence[str],
        values: torch.Tensor,
        lengths: torch.Tensor,
        weights: Optional[torch.Tensor] = None,
        batch_size: Optional[int] = None,
        validate: bool = True,
    ) -> None:
        if isinstance(keys, str):  # list("ab") would be the keys "a" and "b"
            raise TypeError(f"KeyedJaggedTensor: keys must be a sequence of names, got the string {keys!r}")
        for name, tensor in (("values", values), ("lengths", lengths), ("weights", weights)):
            if tensor is not None and not isinstance(tensor, torch.Tensor):
                raise TypeError(f"KeyedJaggedTensor: {name} must be a torch.Tensor, got {type(tensor).__name__}")
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)):
            raise TypeError(f"KeyedJaggedTensor: batch_size must be an int, got {batch_size!r}")
        self._keys: List[str] = list(keys)
        self._values = values
        self._lengths = lengths
        self._weights = weights
        if batch_size is None:
            if not self._keys:
                batch_size = 0
            else:
                if lengths.numel() % len(self._keys) != 0:
                    raise ValueError(
                        f"KeyedJaggedTensor: lengths has {lengths.numel()} entries, not a multiple "
                        f"of the {len(self._keys)} keys {self._keys}; lengths are key-major "
                        f"[num_keys * batch_size]"
                    )
                batch_size = lengths.numel() // len(self._keys)
        if batch_size < 0:
            raise ValueError(f"KeyedJaggedTensor: batch_size must be >= 0, got {batch_size}")
        self._batch_size = int(batch_size)
        self._offsets: Optional[torch.Tensor] = None
        self._length_per_key: Optional[List[int]] = None
        if validate:
            self.validate()

    # ----------------------------------------------------------------------------- construction
    @classmethod
    def from_dict(
        cls, features: Dict[str, JaggedTensor], batch_size: Optional[int] = None
    ) -> "KeyedJaggedTensor":
        """Build from ``{key: JaggedTensor}``; all features must have the same batch size (which
        ``batch_size``, if given, must equal)."""
        keys = list(features)
        if not keys:
            return cls.empty(batch_size or 0)
        sizes = {k: jt.lengths.numel() for k, jt in features.items()}
        if len(set(sizes.values())) != 1:
            raise ValueError(f"KeyedJaggedTensor.from_dict: features differ in batch size: {sizes}")
        if batch_size is not None and batch_size != sizes[keys[0]]:
            raise ValueError(
                f"KeyedJaggedTensor.from_dict: batch_size={batch_size} but the features have batch size "
                f"{sizes[keys[0]]}"
            )
        has_weights = [jt.weights is not None for jt in features.values()]
        if any(has_weights) and not all(has_weights):
            missing = [k for k, jt in features.items() if jt.weights is None]
            raise ValueError(f"KeyedJaggedTensor.from_dict: features {missing} lack weights")
        for key, jt in features.items():  # joined, one feature's surplus ids would pass as the next one's
            if jt.values.dim() != 1 or jt.lengths.dim() != 1:
                raise ValueError(f"KeyedJaggedTensor.from_dict: feature {key!r} needs 1-D values and lengths, got "
                                 f"shapes {tuple(jt.values.shape)} and {tuple(jt.lengths.shape)}")
            if int(jt.lengths.sum()) != jt.values.numel():
                raise ValueError(f"KeyedJaggedTensor.from_dict: feature {key!r} has lengths summing to "
                                 f"{int(jt.lengths.sum())} but {jt.values.numel()} values")
            if jt.weights is not None and jt.weights.shape != jt.values.shape:
                raise ValueError(f"KeyedJaggedTensor.from_dict: feature {key!r} has {jt.weights.numel()} weights "
                                 f"for {jt.values.numel()} values")
        values = torch.cat([features[k].values for k in keys])
        lengths = torch.cat([features[k].lengths for k in keys])
        weights = torch.cat([features[k].weights for k in keys]) if all(has_weights) else None
        return cls(keys, values, lengths, weights)

    @classmethod
    def empty(cls, batch_size: int = 0, device: Optional[torch.device] = None) -> "KeyedJaggedTensor":
        return cls(
            [],
            torch.zeros(0, dtype=torch.int64, device=device),
            torch.zeros(0, dtype=torch.int64, device=device),
            batch_size=batch_size,
        )

    # ----------------------------------------------------------------------------- accessors
    def keys(self) -> List[str]:
        return list(self._keys)

    @property
    def values(self) -> torch.Tensor:
        """[N] ids, key-major."""
        return self._values

    @property
    def lengths(self) -> torch.Tensor:
        """[num_keys * batch_size] ids per (key, sample), key-major."""
        return self._lengths

    @property
    def weights(self) -> Optional[torch.Tensor]:
        """[N] per-value weights, or None."""
        return self._weights

    @property
    def batch_size(self) -> int:
        return self._batch_size

    def offsets(self) -> torch.Tensor:
        """[num_keys * batch_size + 1] start of each (key, sample) bag in ``values``."""
        if self._offsets is None:
            self._offsets = _offsets_from_lengths(self._lengths)
        return self._offsets

    def lengths_2d(self) -> torch.Tensor:
        """[num_keys, batch_size] view of the lengths."""
        return self._lengths.view(len(self._keys), self._batch_size)

    def length_per_key(self) -> List[int]:
        """Number of ids each key holds in this batch."""
        if self._length_per_key is None:
            if self._keys:
                self._length_per_key = self.lengths_2d().sum(dim=1).tolist()
            else:
                self._length_per_key = []
        return list(self._length_per_key)

    def offset_per_key(self) -> List[int]:
        """[num_keys + 1] start of each key's ids in ``values``."""
        out = [0]
        for n in self.length_per_key():
            out.append(out[-1] + n)
        return out

    def __getitem__(self, key: str) -> JaggedTensor:
        try:
            k = self._keys.index(key)
        except ValueError:
            raise KeyError(f"KeyedJaggedTensor has no key {key!r}; keys are {self._keys}") from None
        starts = self.offset_per_key()
        lo, hi = starts[k], starts[k + 1]
        b = self._batch_size
        return JaggedTensor(
            values=self._values[lo:hi],
            lengths=self._lengths[k * b : (k + 1) * b],
            weights=None if self._weights is None else self._weights[lo:hi],
        )

    def to_dict(self) -> Dict[str, JaggedTensor]:
        """Split per key: ``{key: JaggedTensor}``."""
        return {k: self[k] for k in self._keys}

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __iter__(self):
        """The keys, as a dict's iteration gives them (``__getitem__`` takes keys, not positions)."""
        return iter(list(self._keys))

    def __repr__(self) -> str:
        return (
            f"KeyedJaggedTensor(keys={self._keys}, batch_size={self._batch_size}, "
            f"num_values={self._values.numel()}, weighted={self._weights is not None})"
        )

    # ----------------------------------------------------------------------------- transforms
    def permute(self, order: Sequence[int]) -> "KeyedJaggedTensor":
        """Reorder (or drop) keys: the result's key ``i`` is this key ``order[i]``; no index may
        repeat (keys are unique)."""
        n = len(self._keys)
        try:  # (0-d tensors hash by identity: a repeat among them was not seen)
            order = [operator.index(i) for i in order]
        except TypeError:
            raise TypeError(f"KeyedJaggedTensor.permute: order must hold integers, got {list(order)}") from None
        for i in order:
            if not 0 <= i < n:
                raise ValueError(f"KeyedJaggedTensor.permute: index {i} outside 0..{n - 1}")
        if len(set(order)) != len(order):
            dup = sorted({i for i in order if order.count(i) > 1})
            raise ValueError(
                f"KeyedJaggedTensor.permute: order {order} repeats indices {dup} (keys "
                f"{[self._keys[i] for i in dup]}); the keys of a KeyedJaggedTensor must be unique"
            )
        starts = self.offset_per_key()
        b = self._batch_size
        values = [self._values[starts[i] : starts[i + 1]] for i in order]
        lengths = [self._lengths[i * b : (i + 1) * b] for i in order]
        empty_v = self._values.new_zeros(0)
        weights = None
        if self._weights is not None:
            weights = torch.cat(
                [self._weights[starts[i] : starts[i + 1]] for i in order]
                or [self._weights.new_zeros(0)]
            )
        return KeyedJaggedTensor(
            [self._keys[i] for i in order],
            torch.cat(values) if values else empty_v,
            torch.cat(lengths) if lengths else self._lengths.new_zeros(0),
            weights,
            batch_size=b,
            validate=False,
        )

    def select_keys(self, keys: Iterable[str]) -> "KeyedJaggedTensor":
        """Keep only ``keys``, in the order given."""
        if isinstance(keys, str):  # list("ab") would be the keys "a" and "b"
            raise TypeError(f"KeyedJaggedTensor.select_keys: keys must be a sequence of names, got the string "
                            f"{keys!r} (select_keys([{keys!r}]) keeps that one key)")
        keys = list(keys)
        missing = [k for k in keys if k not in self._keys]
        if missing:
            raise KeyError(f"KeyedJaggedTensor has no keys {missing}; keys are {self._keys}")
        if len(set(keys)) != len(keys):
            dup = sorted({k for k in keys if keys.count(k) > 1})
            raise ValueError(f"KeyedJaggedTensor.select_keys: keys {dup} asked for more than once")
        return self.permute([self._keys.index(k) for k in keys])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "KeyedJaggedTensor":
        """The same ids, lengths and weights on ``device`` (a device only: ids stay integers)."""
        if isinstance(device, torch.dtype):
            raise TypeError(f"KeyedJaggedTensor.to moves to a device; got the dtype {device} (ids stay integers)")
        return KeyedJaggedTensor(
            self._keys,
            self._values.to(device, non_blocking=non_blocking),
            self._lengths.to(device, non_blocking=non_blocking),
            None if self._weights is None else self._weights.to(device, non_blocking=non_blocking),
            batch_size=self._batch_size,
            validate=False,
        )

    def pin_memory(self) -> "KeyedJaggedTensor":
        return KeyedJaggedTensor(
            self._keys,
            self._values.pin_memory(),
            self._lengths.pin_memory(),
            None if self._weights is None else self._weights.pin_memory(),
            batch_size=self._batch_size,
            validate=False,
        )

    @staticmethod
    def concat(kjts: Sequence["KeyedJaggedTensor"]) -> "KeyedJaggedTensor":
        """Join the keys of several KJTs with the same batch size (keys must not repeat). Inputs
        with values must all have weights or none; an input without values (such as ``empty()``)
        joins either kind."""
        if isinstance(kjts, KeyedJaggedTensor):
            raise TypeError("KeyedJaggedTensor.concat takes a list of KeyedJaggedTensors, got one")
        kjts = list(kjts)
        others = sorted({type(k).__name__ for k in kjts if not isinstance(k, KeyedJaggedTensor)})
        if others:
            raise TypeError(f"KeyedJaggedTensor.concat takes a list of KeyedJaggedTensors, got {others} in it")
        if not kjts:
            raise ValueError("KeyedJaggedTensor.concat needs at least one KeyedJaggedTensor")
        sizes = [k.batch_size for k in kjts]
        if len(set(sizes)) != 1:
            raise ValueError(f"KeyedJaggedTensor.concat: batch sizes differ: {sizes}")
        keys = [key for k in kjts for key in k.keys()]
        dup = sorted({k for k in keys if keys.count(k) > 1})
        if dup:
            raise ValueError(f"KeyedJaggedTensor.concat: keys {dup} appear more than once")
        filled = [k for k in kjts if k.values.numel()]  # an input without values fits either kind
        weighted = {k.weights is not None for k in filled or kjts}
        if filled and len(weighted) > 1:
            have = [i for i, k in enumerate(kjts) if k.weights is not None and k.values.numel()]
            lack = [i for i, k in enumerate(kjts) if k.weights is None and k.values.numel()]
            raise ValueError(
                f"KeyedJaggedTensor.concat: some inputs have weights and some do not (inputs {have} "
                f"have weights, inputs {lack} have values but no weights)"
            )
        weights = None
        if True in weighted:
            like = next(k.weights for k in kjts if k.weights is not None)
            weights = torch.cat([like.new_zeros(0) if k.weights is None else k.weights for k in kjts])
        return KeyedJaggedTensor(
            keys,
            torch.cat([k.values for k in kjts]),
            torch.cat([k.lengths for k in kjts]),
            weights,
            batch_size=sizes[0],
            validate=False,
        )

    # ----------------------------------------------------------------------------- validation
    def validate(self) -> None:
        """Raise ``ValueError``/``TypeError`` naming what is inconsistent."""
        not_names = [k for k in self._keys if not isinstance(k, str)]
        if not_names:  # (the tables name their features: 1 is never the feature "1")
            raise TypeError(f"KeyedJaggedTensor: keys must be feature names (str), got {not_names}")
        if len(set(self._keys)) != len(self._keys):
            dup = sorted({k for k in self._keys if self._keys.count(k) > 1})
            raise ValueError(f"KeyedJaggedTensor: duplicate keys {dup}")
        if self._values.dim() != 1 or self._lengths.dim() != 1:
            raise ValueError(
                f"KeyedJaggedTensor: values and lengths must be 1-D, got shapes "
                f"{tuple(self._values.shape)} and {tuple(self._lengths.shape)}"
            )
        devices = {t.device for t in (self._values, self._lengths, self._weights) if t is not None}
        if len(devices) > 1:
            raise ValueError(f"KeyedJaggedTensor: values, lengths and weights must be on one device, got "
                             f"{sorted(str(d) for d in devices)}")
        if self._values.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"KeyedJaggedTensor: values must be int32/int64 ids, got {self._values.dtype}")
        if self._lengths.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"KeyedJaggedTensor: lengths must be int32/int64, got {self._lengths.dtype}")
        expected = len(self._keys) * self._batch_size
        if self._lengths.numel() != expected:
            raise ValueError(
                f"KeyedJaggedTensor: lengths has {self._lengths.numel()} entries, expected "
                f"num_keys * batch_size = {len(self._keys)} * {self._batch_size} = {expected}"
            )
        if self._lengths.numel() and int(self._lengths.min()) < 0:
            pos = int(torch.nonzero(self._lengths < 0)[0])
            key = self._keys[pos // self._batch_size]
            raise ValueError(
                f"KeyedJaggedTensor: negative length {int(self._lengths[pos])} for key {key!r}, "
                f"sample {pos % self._batch_size}"
            )
        total = int(self._lengths.sum()) if self._lengths.numel() else 0
        if total != self._values.numel():
            raise ValueError(
                f"KeyedJaggedTensor: lengths sum to {total} but there are {self._values.numel()} values"
            )
        if self._weights is not None:
            if self._weights.shape != self._values.shape:
                raise ValueError(
                    f"KeyedJaggedTensor: weights shape {tuple(self._weights.shape)} differs from "
                    f"values shape {tuple(self._values.shape)}"
                )
            if not self._weights.is_floating_point():
                raise TypeError(f"KeyedJaggedTensor: weights must be floating point, got {self._weights.dtype}")
