"""What the kernel paths of ``TableBatchedEmbeddingBags`` (``native_path.py``, ``triton_path.py``)
share: the KeyedJaggedTensor in the module's feature order, and the autograd function whose
forward pools through the path and whose backward runs the path's fused optimizer step."""

from __future__ import annotations

import os
import sys
import warnings
import weakref
from pathlib import Path
from typing import List

import torch

import neorec
from neorec.sparse.jagged import KeyedJaggedTensor


def features_in_order(features: KeyedJaggedTensor, feature_names: List[str], device: torch.device,
                      check_sum: bool = True) -> KeyedJaggedTensor:
    """``features`` with exactly ``feature_names`` as keys, in that order (keys may be a superset
    or a permutation), checked to be on ``device`` and by ``check_lookup_input`` (``check_sum``
    False: the caller checks the lengths' sum itself)."""
    if not isinstance(features, KeyedJaggedTensor):
        raise TypeError(f"expected a KeyedJaggedTensor, got {type(features).__name__}")
    keys = features.keys()
    if keys != feature_names:
        check_lookup_input(features)  # the whole KJT: a dropped key's bad lengths shift the kept keys' ids
        missing = [k for k in feature_names if k not in keys]
        if missing:
            raise ValueError(f"KeyedJaggedTensor lacks features {missing}; expected all of {feature_names}")
        features = features.permute([keys.index(k) for k in feature_names])
    if features.values.device != device:
        raise ValueError(f"KeyedJaggedTensor is on {features.values.device}, the embedding tables on {device}")
    check_lookup_input(features, check_sum)
    return features


def check_lookup_input(features: KeyedJaggedTensor, check_sum: bool = True) -> None:
    """What every lookup path checks of a KeyedJaggedTensor, also one built with validate=False: no
    negative length and lengths that add up to its values (torch's repeat_interleave, which the torch
    ops paths and the sharded input use, writes past its output for a negative repeat before it
    checks it: the heap was corrupted and the process aborted), as many per-value weights as values
    (the torch path ignored extra ones or failed on an index), and no weights that require grad
    while grad is enabled (no path differentiates with respect to them: their gradient would
    silently stay None). The lengths are checked on the CPU only (on a GPU the check
    would wait for the device at every lookup, and its kernels refuse a negative repeat themselves),
    in ~10 us for 26 features x 2048 samples: their minimum, and their sum from the per-key counts
    that the lookups use anyway (``check_sum`` False: the caller checks it)."""
    lengths = features.lengths
    if lengths.device.type == "cpu" and lengths.numel():
        if int(lengths.min()) < 0:  # (min: a tenth of the time of (lengths < 0).any())
            raise ValueError("KeyedJaggedTensor: a negative length (build it with validate=True to find the feature)")
        total = sum(features.length_per_key()) if check_sum else features.values.numel()
        if total != features.values.numel():
            raise ValueError(f"KeyedJaggedTensor: its lengths sum to {total} but it holds {features.values.numel()} "
                             "values (build it with validate=True to find the feature)")
    if features.weights is not None and features.weights.numel() != features.values.numel():
        raise ValueError(f"KeyedJaggedTensor: {features.weights.numel()} weights for {features.values.numel()} values")
    if features.weights is not None and features.weights.requires_grad and torch.is_grad_enabled():
        raise ValueError("KeyedJaggedTensor weights require grad, but the fused embedding lookup does not "
                         "differentiate with respect to per-value weights; pass weights.detach()")


_INTERNAL = tuple(str(Path(package.__file__).parent) + os.sep for package in (neorec, torch))


class SecondLookupWarning(UserWarning):
    """A table-batched module was looked up again while an earlier lookup's backward was still to
    come: each backward is its own optimizer step."""


SECOND_LOOKUP = ("this TableBatchedEmbeddingBags is looked up again while an earlier lookup's backward has not run: "
                 "each lookup's backward is its own optimizer step on the rows it touched (two lookups into one "
                 "loss step the optimizer twice, which differs from one step on the summed gradient for "
                 "AdaGrad, row-wise AdaGrad and Adam); concatenate the features into one KeyedJaggedTensor "
                 "for one step, or run the first lookup under torch.no_grad() if it needs no update")


class PendingLookups:
    """Which lookup of one module still awaits its backward: ``started(ctx)`` in an autograd
    forward (warns once per process, ``SecondLookupWarning``, when the previous lookup's graph is
    still alive and its backward has not run), ``stepped(ctx)`` in its backward. Holds a weak
    reference only: a graph dropped without a backward is forgotten; copies and pickles start empty."""

    def __init__(self) -> None:
        self._last = None

    def __getstate__(self) -> dict:
        return {"_last": None}

    def started(self, ctx) -> None:
        last = self._last() if self._last is not None else None
        if last is not None and not getattr(last, "stepped", True):
            frame, level = sys._getframe(0), 1  # the warning names the first caller outside neorec and torch
            while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
                frame, level = frame.f_back, level + 1
            warnings.warn(SECOND_LOOKUP, SecondLookupWarning, stacklevel=level)
        ctx.stepped = False
        self._last = weakref.ref(ctx)

    @staticmethod
    def stepped(ctx) -> None:
        ctx.stepped = True


_SAVED = object()  # marks an input kept by save_for_backward


class PathLookup(torch.autograd.Function):
    """Forward: ``path.pool(*inputs)``; backward: ``path.backward(*inputs, grad_output)`` (the fused
    gradient + optimizer step on the module's buffers). ``anchor`` is a scalar leaf that requires
    grad, so that autograd calls ``backward`` although the weights are buffers."""

    @staticmethod
    def forward(ctx, anchor, path, *inputs):  # type: ignore[override]
        # tensors through save_for_backward: ids changed in place before backward raise autograd's
        # "modified by an inplace operation" instead of updating other rows than were looked up
        tensors = [i for i in inputs if isinstance(i, torch.Tensor)]
        ctx.save_for_backward(*tensors)
        ctx.path, ctx.inputs = path, [_SAVED if isinstance(i, torch.Tensor) else i for i in inputs]
        path.module.pending_lookups.started(ctx)
        return path.pool(*inputs)

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        saved = iter(ctx.saved_tensors)
        inputs = [next(saved) if i is _SAVED else i for i in ctx.inputs]
        ctx.path.backward(*inputs, grad_output)
        PendingLookups.stepped(ctx)
        return (None, None) + (None,) * len(ctx.inputs)
