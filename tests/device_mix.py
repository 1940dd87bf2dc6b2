"""A CPU stand-in for "all tensors on the same device" (no GPU here, so CUDA-only mistakes are
caught this way): ``DeviceMixCheck`` marks chosen tensors as living on the accelerator, marks every
result computed from a marked tensor, and records each operation that would raise on CUDA because
it mixes a marked tensor with an unmarked (host) tensor that is not a 0-dim scalar. Indices of
indexing ops may stay on the host (torch allows it); copies (``copy_``, ``.to``) move data and are
allowed.

    with DeviceMixCheck() as check:
        check.mark(*module.buffers())
        code_under_test()
    assert check.violations == []
"""

from __future__ import annotations

import traceback
import weakref
from typing import List, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

MOVES = {"copy_", "_to_copy", "to", "detach", "alias", "lift_fresh", "_local_scalar_dense", "set_", "equal",
         "clone", "view", "_unsafe_view", "slice", "select", "t", "transpose", "reshape", "expand"}


class DeviceMixCheck(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self._marked: dict = {}
        self.violations: List[Tuple[str, str]] = []  # (op, "file:line" in neorec)

    def mark(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            self._marked[id(t)] = weakref.ref(t)

    def on_device(self, t) -> bool:
        """Whether ``t`` is marked (would live on the accelerator)."""
        return self._on_device(t)

    def _on_device(self, t) -> bool:
        ref = self._marked.get(id(t))
        return isinstance(t, torch.Tensor) and ref is not None and ref() is t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on_device = [t for t in tensors if self._on_device(t)]
        out = func(*args, **kwargs)
        if on_device and name not in MOVES:
            if name.startswith("index_put"):  # self, indices (host allowed), values
                values = args[2] if len(args) > 2 else kwargs.get("values")
                if self._on_device(args[0]) and isinstance(values, torch.Tensor) and values.dim() > 0 \
                        and not self._on_device(values):
                    self._record(name)
            elif not name.startswith("index"):
                if any(not self._on_device(t) and t.dim() > 0 for t in tensors):
                    self._record(name)
        if on_device and not (name == "_to_copy" and kwargs.get("device") is not None):
            for result in tree_flatten(out)[0]:
                if isinstance(result, torch.Tensor):
                    self.mark(result)
        return out

    def _record(self, name: str) -> None:
        frames = [f for f in traceback.extract_stack() if "/neorec/" in f.filename]
        where = f"{frames[-1].filename.rsplit('/neorec/', 1)[-1]}:{frames[-1].lineno}" if frames else "?"
        self.violations.append((name, where))
