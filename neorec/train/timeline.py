"""``StepTimeline``: where a training step's time goes. Printed by ``neorec train --profile`` and
written to ``OUTPUT_DIR/timeline.json`` (rank 0's view; every rank times its own steps).

    neorec train --config configs/tiny.toml --profile
    neorec train --config configs/tiny.toml --nproc 2 --profile --no-pipeline

Phases (seconds summed over the profiled steps, then per step and as a share of the step):

- ``data_loading``: waiting for the next batch (the loader thread prepares it) and moving it to
  the device;
- ``input_dist``: the id all-to-all (the pipeline's early launch of the next batch's exchange, and
  the forward's wait on it / its own exchange);
- ``lookup``: the fused embedding lookup (the whole sparse module when it is not sharded);
- ``dense_forward``: the rest of the forward and the loss (MLPs, interaction);
- ``output_dist``: the pooled-embedding all-to-all of the forward (launch and wait);
- ``backward``: the whole backward: dense gradients, the gradient all-to-all, the embedding update
  fused into it, DDP's all-reduce;
- ``optimizer``: the dense optimizer step;
- ``checkpoint``: the checkpoint saved after the step, if any (``checkpoint.every_steps``);
- ``other``: the rest of the step (bookkeeping, logging). An evaluation between steps is in no
  step (it used to be that saves and logging were not either: steps did not add up to the
  training time, and a save's cost was nowhere in the profile).

``exposed_comm`` overlays them: time a rank sat blocked waiting for an embedding collective to
complete (``CommStats.blocked``: the id header exchange, the waits on the id and pooled-embedding
all-to-alls, the gradient all-to-all of the backward, replica all-reduces), per collective too.
Its share of the step is the exposed communication fraction. Compute done by the collectives'
callers (bucketizing ids, assembling the received batch, placing columns) is not in it.

Off (the default) the model and the step carry no timer: ``timeline`` attributes are None and no
clock is read.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional

import torch
from torch import nn

PHASES = ("data_loading", "input_dist", "lookup", "dense_forward", "output_dist", "backward", "optimizer", "checkpoint",
          "other")
_SPARSE_FORWARD = ("input_dist", "lookup", "output_dist")


def step_clock(device: torch.device) -> Callable[[], float]:
    """``time.perf_counter``, on a CUDA device after ``torch.cuda.synchronize``: kernels and NCCL
    collectives return before their work is done, so an unsynchronized phase time is the time to
    queue it (a wait on an all-to-all read ~0 exposed communication). Only while profiling."""
    if device.type != "cuda":
        return time.perf_counter

    def synchronized() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return synchronized


class StepTimeline:
    """Accumulates phase times of training steps (one instance per trainer; not thread-safe)."""

    def __init__(self, comm_stats=None, clock: Callable[[], float] = time.perf_counter) -> None:
        self._now = clock  # step_clock(device): on a GPU, phase ends wait for the work queued in them
        self.seconds: Dict[str, float] = {name: 0.0 for name in PHASES}
        self.comm_stats = comm_stats  # a CommStats whose blocked times are the exposed communication
        self.exposed_comm = 0.0
        self.blocked: Dict[str, float] = {}
        self._blocked_base: Dict[str, float] = {}
        self.steps = 0
        self.step_seconds = 0.0
        self._in_forward = 0.0  # sparse phases timed inside the current forward
        self._hooks: List = []
        self._paused = False

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Record nothing inside (evaluation between training steps)."""
        self._paused, before = True, self._paused
        try:
            yield
        finally:
            self._paused = before
            if self.comm_stats is not None:
                self._blocked_base = dict(self.comm_stats.blocked)

    # -------------------------------------------------------------------------- recording
    def add(self, name: str, seconds: float) -> None:
        if name not in self.seconds:
            raise ValueError(f"StepTimeline: unknown phase {name!r}; phases are {PHASES}")
        if self._paused:
            return
        self.seconds[name] += seconds

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase ``name``."""
        start = self._now()
        try:
            yield
        finally:
            elapsed = self._now() - start
            self.add(name, elapsed)
            if name in _SPARSE_FORWARD and not self._paused:
                self._in_forward += elapsed

    @contextmanager
    def forward(self) -> Iterator[None]:
        """Time a step's forward + loss; what its sparse phases did not take is ``dense_forward``."""
        self._in_forward = 0.0
        start = self._now()
        try:
            yield
        finally:
            self.add("dense_forward", max(0.0, self._now() - start - self._in_forward))

    def end_step(self, step_seconds: float) -> None:
        """Close a step of ``step_seconds`` wall time; the untimed rest of it is ``other``."""
        self.steps += 1
        self.step_seconds += step_seconds
        if self.comm_stats is not None:
            now = dict(self.comm_stats.blocked)
            for name, value in now.items():
                delta = value - self._blocked_base.get(name, 0.0)
                self.blocked[name] = self.blocked.get(name, 0.0) + delta
                self.exposed_comm += delta
            self._blocked_base = now
        self.seconds["other"] = max(0.0, self.step_seconds - sum(v for k, v in self.seconds.items() if k != "other"))

    # -------------------------------------------------------------------------- model hooks
    def attach(self, model: nn.Module) -> None:
        """Time the sparse module of ``model``: sharded collections time their own phases; any
        other ``sparse_arch`` is timed as a whole as ``lookup``."""
        from neorec.train.pipeline import sharded_collections

        sharded = sharded_collections(model)
        for collection in sharded:
            collection.timeline = self
        if sharded:
            return
        for module in model.modules():
            sparse = getattr(module, "sparse_arch", None)
            if isinstance(sparse, nn.Module):
                starts: List[float] = []
                self._hooks.append(sparse.register_forward_pre_hook(lambda *_: starts.append(self._now())))
                self._hooks.append(sparse.register_forward_hook(lambda *_: self._lookup_done(starts)))

    def _lookup_done(self, starts: List[float]) -> None:
        elapsed = self._now() - starts.pop()
        self.add("lookup", elapsed)
        if not self._paused:
            self._in_forward += elapsed

    def detach(self, model: nn.Module) -> None:
        from neorec.train.pipeline import sharded_collections

        for collection in sharded_collections(model):
            collection.timeline = None
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    # -------------------------------------------------------------------------- report
    def summary(self) -> Dict[str, object]:
        """JSON-ready: steps, step_ms, per phase {seconds, ms_per_step, fraction}, exposed comm."""
        steps = max(self.steps, 1)
        total = max(self.step_seconds, 1e-12)
        phases = {name: {"seconds": value, "ms_per_step": 1e3 * value / steps, "fraction": value / total}
                  for name, value in self.seconds.items()}
        return {"steps": self.steps, "step_ms": 1e3 * self.step_seconds / steps, "phases": phases,
                "exposed_comm": {"seconds": self.exposed_comm, "ms_per_step": 1e3 * self.exposed_comm / steps,
                                 "fraction": self.exposed_comm / total,
                                 "ms_per_step_by_collective": {
                                     k: 1e3 * v / steps for k, v in sorted(self.blocked.items())}}}

    def format_table(self) -> str:
        summary = self.summary()
        lines = [f"step timeline ({summary['steps']} steps, {summary['step_ms']:.2f} ms per step)",
                 f"  {'phase':<22}{'ms/step':>10}{'share':>9}"]
        rows = list(summary["phases"].items()) + [("exposed communication", summary["exposed_comm"])]
        for name, entry in rows:
            lines.append(f"  {name:<22}{entry['ms_per_step']:>10.3f}{100 * entry['fraction']:>8.1f}%")
        for name, ms in summary["exposed_comm"]["ms_per_step_by_collective"].items():
            lines.append(f"    blocked in {name:<22}{ms:>8.3f}")
        lines.append("  (exposed communication overlaps the phases above: time blocked in embedding collectives)")
        return "\n".join(lines)

    def write_json(self, path: Path, extra: Optional[Dict[str, object]] = None) -> None:
        """Atomic write of ``summary()`` (plus ``extra``) to ``path``."""
        from neorec.files import write_atomic

        write_atomic(path, json.dumps({**self.summary(), **(extra or {})}, indent=2, sort_keys=True))
