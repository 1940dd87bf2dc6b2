"""Collectives of the sharded embeddings, as awaitables and autograd functions.

- ``all_to_all(tensor, send_splits, recv_splits, group)``: variable-size all-to-all of a 1-D tensor
  (``dist.all_to_all_single`` with split sizes; gloo on CPU, NCCL on CUDA), no gradient (ids).
- ``differentiable_all_to_all(...)``: the same for activations; its backward sends the gradient the
  reverse way (swapped splits).
- ``all_reduce_sum_reducer(group)``: an in-place all-reduce sum, for replicated tables' gradients
  (each rank's loss is its share of the global mean loss: neorec/train/distributed.py).

Every launch returns an awaitable (``wait()`` gives the result), using ``async_op=True``, so that a
pipeline can overlap the transfer with compute. Bytes handed to each collective are counted in a
``CommStats`` the caller passes in (never global state); bytes a rank sends to itself are not
counted (they never leave the process).
"""

from __future__ import annotations

import time
from typing import Callable, Dict, Generic, List, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


class CommStats:
    """Bytes sent to other ranks and calls, per collective name (e.g. "input_dist",
    "output_dist", "output_dist.backward", "replica_all_reduce")."""

    def __init__(self) -> None:
        self.bytes_sent: Dict[str, int] = {}
        self.calls: Dict[str, int] = {}
        self.blocked: Dict[str, float] = {}  # seconds blocked waiting on each collective
        self.now: Callable[[], float] = time.perf_counter  # the clock of those waits (timeline.step_clock)

    def add_blocked(self, name: str, seconds: float) -> None:
        self.blocked[name] = self.blocked.get(name, 0.0) + seconds

    @property
    def blocked_seconds(self) -> float:
        """Total time this rank sat waiting for collectives to complete (exposed communication)."""
        return sum(self.blocked.values())


    def record(self, name: str, num_bytes: int) -> None:
        self.bytes_sent[name] = self.bytes_sent.get(name, 0) + int(num_bytes)
        self.calls[name] = self.calls.get(name, 0) + 1

    def total_bytes(self) -> int:
        return sum(self.bytes_sent.values())

    def reset(self) -> None:
        self.bytes_sent.clear()
        self.calls.clear()
        self.blocked.clear()

    def snapshot(self) -> Dict[str, int]:
        return dict(self.bytes_sent)


class Awaitable(Generic[T]):
    """The result of a launched collective; ``wait()`` blocks until it is there and returns it
    (waiting twice returns the same result). With ``stats``, the time blocked on the transfer is
    added to ``stats.blocked[name]``."""

    def __init__(self, works: Sequence[Optional[dist.Work]], finish: Callable[[], T],
                 stats: Optional["CommStats"] = None, name: str = "",
                 progress: Optional[Callable[[], None]] = None) -> None:
        self._works = [w for w in works if w is not None]
        self._finish: Optional[Callable[[], T]] = finish
        self._result: Optional[T] = None
        self._stats, self._name = stats, name
        self._progress = progress

    def progress(self) -> None:
        """Advance a staged exchange without waiting for its end (launch its next stage)."""
        if self._finish is not None and self._progress is not None:
            self._progress()

    def wait(self) -> T:
        if self._finish is not None:
            timed = self._stats is not None and bool(self._works)
            start = self._stats.now() if timed else 0.0
            for work in self._works:
                work.wait()
            if timed:
                self._stats.add_blocked(self._name, self._stats.now() - start)
            self._result = self._finish()
            self._finish, self._works, self._progress = None, [], None
        return self._result  # type: ignore[return-value]


def ready(value: T) -> Awaitable[T]:
    """An awaitable that is already complete."""
    return Awaitable([], lambda: value)


def _remote_bytes(splits: Sequence[int], rank: int, element_size: int) -> int:
    return sum(n for r, n in enumerate(splits) if r != rank) * element_size


def all_to_all(tensor: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
               group: Optional[dist.ProcessGroup], stats: Optional[CommStats] = None,
               name: str = "all_to_all") -> Awaitable[torch.Tensor]:
    """Send ``tensor[sum(send_splits[:r]) : ...]`` to rank r; receive ``recv_splits[r]`` elements
    from rank r. ``tensor`` is 1-D; the result is 1-D of ``sum(recv_splits)`` elements."""
    send_splits, recv_splits = [int(n) for n in send_splits], [int(n) for n in recv_splits]
    if tensor.dim() != 1 or tensor.numel() != sum(send_splits):
        raise ValueError(f"all_to_all({name}): need a 1-D tensor of sum(send_splits) = {sum(send_splits)} "
                         f"elements, got shape {tuple(tensor.shape)}")
    tensor = tensor.contiguous()
    output = tensor.new_empty(sum(recv_splits))
    if stats is not None:
        stats.record(name, _remote_bytes(send_splits, dist.get_rank(group), tensor.element_size()))
    work = dist.all_to_all_single(output, tensor, recv_splits, send_splits, group=group, async_op=True)
    return Awaitable([work], lambda: (tensor, output)[1], stats, name)  # the sent buffer lives until the wait


class _DifferentiableAllToAll(torch.autograd.Function):
    """Forward launches the all-to-all and returns the (still arriving) output buffer; the work
    handle goes back through ``holder``. Backward: the reverse all-to-all of the gradient.

    ``anchor`` is a scalar that requires grad, so that this function is part of the graph (and its
    backward runs, keeping the collectives matched) even on a rank whose input needs no gradient."""

    @staticmethod
    def forward(ctx, anchor, tensor, send_splits, recv_splits, group, stats, name, holder):  # type: ignore[override]
        ctx.send_splits, ctx.recv_splits = send_splits, recv_splits
        ctx.group, ctx.stats, ctx.name = group, stats, name
        tensor = tensor.detach().contiguous()
        output = tensor.new_empty(sum(recv_splits))
        if stats is not None:
            stats.record(name, _remote_bytes(send_splits, dist.get_rank(group), tensor.element_size()))
        holder.append((dist.all_to_all_single(output, tensor, recv_splits, send_splits, group=group,
                                              async_op=True), tensor))
        return output

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        grad_output = grad_output.contiguous()
        grad_input = grad_output.new_empty(sum(ctx.send_splits))
        if ctx.stats is not None:
            ctx.stats.record(ctx.name + ".backward", _remote_bytes(ctx.recv_splits, dist.get_rank(ctx.group),
                                                                   grad_output.element_size()))
        start = ctx.stats.now() if ctx.stats is not None else 0.0
        dist.all_to_all_single(grad_input, grad_output, ctx.send_splits, ctx.recv_splits, group=ctx.group)
        if ctx.stats is not None:
            ctx.stats.add_blocked(ctx.name + ".backward", ctx.stats.now() - start)
        return None, grad_input, None, None, None, None, None, None


def differentiable_all_to_all(tensor: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
                              group: Optional[dist.ProcessGroup], stats: Optional[CommStats] = None,
                              name: str = "all_to_all") -> Awaitable[torch.Tensor]:
    """``all_to_all`` of a float 1-D ``tensor`` whose backward returns the gradient to the senders.
    Under ``torch.no_grad`` it is a plain all-to-all."""
    send_splits, recv_splits = [int(n) for n in send_splits], [int(n) for n in recv_splits]
    if tensor.dim() != 1 or tensor.numel() != sum(send_splits):
        raise ValueError(f"differentiable_all_to_all({name}): need a 1-D tensor of sum(send_splits) = "
                         f"{sum(send_splits)} elements, got shape {tuple(tensor.shape)}")
    if not torch.is_grad_enabled():
        return all_to_all(tensor, send_splits, recv_splits, group, stats, name)
    anchor = torch.zeros((), device=tensor.device, requires_grad=True)
    holder: List = []
    output = _DifferentiableAllToAll.apply(anchor, tensor, send_splits, recv_splits, group, stats, name, holder)
    work, _sent = holder[0]  # keep the sent buffer alive until the transfer completes
    return Awaitable([work], lambda: (_sent, output)[1], stats, name)


def all_reduce_sum_reducer(group: Optional[dist.ProcessGroup], stats: Optional[CommStats] = None,
                           name: str = "replica_all_reduce") -> Callable[[torch.Tensor], None]:
    """``reducer(tensor)``: in-place sum of ``tensor`` over the ranks of ``group``. The bytes
    recorded are the tensor's size (what each rank hands to the all-reduce; a ring all-reduce moves
    about 2 (W - 1) / W times that per rank)."""

    def reduce(tensor: torch.Tensor) -> None:
        if dist.get_world_size(group) == 1:
            return
        start = stats.now() if stats is not None else 0.0
        dist.all_reduce(tensor, group=group)
        if stats is not None:
            stats.record(name, tensor.numel() * tensor.element_size())
            stats.add_blocked(name, stats.now() - start)

    return reduce
