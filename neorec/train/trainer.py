"""DLRM training loop with periodic evaluation and a JSON-lines metrics log, on one process or,
given a ``DistributedContext``, on every rank of a job (sharded embeddings, data-parallel MLPs;
see ``neorec/train/distributed.py``).

Run it through the CLI:  ``neorec train [--config configs/default.toml] [--set train.max_steps=100]``
(``--nproc N`` or ``torchrun --nproc-per-node N -m neorec train ...`` for N processes)

    trainer = Trainer(load_config("configs/tiny.toml"))
    result = trainer.fit()          # result.final_eval["auc"], result.qps
"""

from __future__ import annotations

import contextlib
import itertools
import math
import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, TextIO, Tuple

import torch
import torch.distributed as dist
from tqdm import tqdm

from neorec.config import Config
from neorec.data import DataSource, PrefetchLoader, make_data_source
from neorec.data.batch import Batch
from neorec.files import ensure_writable_dir, holding_dirs, write_atomic
from neorec.embedding.cache_prefetch import cached_collections, with_prefetch
from neorec.embedding.cached import CachedEmbeddingBagCollection
from neorec.embedding.init_stream import observing_draws
from neorec.embedding.locations import PREFETCH_NEEDS_PIPELINE
from neorec.embedding.storage import NonFiniteRowError
from neorec.model import dense_parameters
from neorec.signals import check_terminated
from neorec.train.allocator import reuse_freed_memory
from neorec.train.divergence import NonFiniteLossError, diverged, non_finite_weight
from neorec.train.build import (build_model, make_dense_optimizer, memory_named, plan_locations, resolve_device,
                                ssd_dir_of)
from neorec.train.distributed import (DistributedContext, all_reduce_sum, all_reduce_sums, gather_to_main, local_loss,
                                      split_batch, threads_per_rank)
from neorec.train.metrics import METRIC_KEYS, MetricsAccumulator, compute_metrics
from neorec.train.metrics_log import MetricsLog
from neorec.train.pipeline import TrainPipeline, abandon_launched_exchanges, plain_steps
from neorec.train.timeline import StepTimeline, step_clock


def run_dirs(cfg: Config) -> List[Tuple[str, str]]:
    """The folders a run writes and holds (``holding_dirs``), with their settings' names."""
    return [(cfg.train.output_dir, "train.output_dir"), (cfg.checkpoint.dir, "checkpoint.dir")]


@dataclass
class TrainResult:
    """What ``Trainer.fit`` returns."""

    steps: int
    samples: int
    train_seconds: float
    qps: float
    final_eval: Dict[str, float] = field(default_factory=dict)
    metrics_path: Optional[str] = None
    first_step: int = 0  # the step this run started from (resumed: the checkpoint's); samples and
    # seconds count this run's steps only, ``steps`` is the total
    cache: Dict[str, Dict[str, Optional[float]]] = field(default_factory=dict)  # per cached table:
    # CACHE_COUNTERS summed over its pieces and ranks, and hit_rate (None without lookups); empty
    # without cached tables


CACHE_COUNTERS = ("lookups", "hits", "evictions", "write_backs", "store_bytes_read", "store_bytes_written")


PROGRESS_LINE_SECONDS = 30.0  # progress to a file or pipe: one plain line at most this often
BUILD_NOTICE_BYTES = 1 << 30  # models with this many bytes of fp32 embedding rows or more say they are building


def redraws_lines(out) -> bool:
    """Whether ``out`` shows a bar redrawn with "\\r" in place: a terminal, or a Jupyter notebook's
    stdout (ipykernel's ``OutStream``: not a tty, but its cells honour carriage returns)."""
    if getattr(out, "isatty", lambda: False)():
        return True
    return type(out).__module__.split(".")[0] == "ipykernel"


class Trainer:
    """Trains ``DLRM``: forward, BCE loss, backward (the embedding optimizer runs fused inside it),
    dense optimizer step; evaluates NE / AUC / calibration periodically.

    With ``distributed`` (a ``DistributedContext``; every rank builds its own Trainer) the
    embeddings are sharded by ``plan`` (default: ``default_plan``), the MLPs are wrapped in
    DistributedDataParallel, ``data.batch_size`` is per rank, and only rank 0 prints and writes
    the metrics log. ``comm_stats`` counts the bytes of the embedding collectives."""

    def __init__(self, cfg: Config, source: Optional[DataSource] = None, out: Optional[TextIO] = None,
                 distributed: Optional[DistributedContext] = None, plan=None, comm_stats=None,
                 resume: Optional[str] = None) -> None:
        self.cfg = cfg
        self.out = out if out is not None else sys.stdout
        self.distributed = distributed
        self.world_size = distributed.world_size if distributed else 1
        self.is_main = distributed is None or distributed.is_main
        if cfg.train.output_dir and self.is_main:  # fail now, not after the first hour of training
            ensure_writable_dir(cfg.train.output_dir, "train.output_dir")
        if cfg.checkpoint.dir:
            ensure_writable_dir(cfg.checkpoint.dir, "checkpoint.dir")
        if cfg.train.reuse_freed_memory:
            reuse_freed_memory()  # process-wide, like the thread count below
        if cfg.train.num_threads:
            torch.set_num_threads(cfg.train.num_threads)
        elif distributed is not None:  # share the cores among the local ranks
            torch.set_num_threads(threads_per_rank(distributed.local_world_size))
        self.device = distributed.device if distributed else resolve_device(cfg.train.device)
        self.source = source if source is not None else make_data_source(cfg.data)
        tables = self.source.tables(cfg.model.embedding_dim, cfg.model.pooling)
        if any(cfg.embedding.location.kind_of(t) == "cached_ssd" for t in tables):  # named, not a bare errno
            ensure_writable_dir(ssd_dir_of(cfg), "embedding.location.ssd_dir" if cfg.embedding.location.ssd_dir
                                else "embedding.location.ssd_dir (by default <train.output_dir>/embedding_ssd)")
        self.plan = None
        if cfg.train.profile and distributed is not None and comm_stats is None:
            from neorec.sharding.comm import CommStats

            comm_stats = CommStats()  # times the waits on collectives for the timeline
        self.comm_stats = comm_stats
        from neorec.train.checkpoint_manifest import choose_resume

        # a resumed run's tables get every row from the checkpoint: no initial rows are drawn for
        # them or written to its row stores (for an SSD store, a write of the whole table)
        self.resume = choose_resume(cfg.checkpoint, resume)  # (a torchrun restart: where it saved)
        initial_rows = self.resume.location is None
        with memory_named(cfg, tables, self.device, distributed is not None), \
                self._build_progress(tables if initial_rows else []):  # (resumed: nothing drawn, nothing to say)
            sparse_arch = self._sharded_collection(plan, comm_stats, initial_rows) if distributed is not None else None
            self.model = build_model(cfg, self.source, self.device, sparse_arch, initial_rows=initial_rows)
        self.timeline = None
        if cfg.train.profile:
            clock = step_clock(self.device)  # phases and waits on collectives end when their GPU work does
            self.timeline = StepTimeline(comm_stats, clock=clock)
            if comm_stats is not None:
                comm_stats.now = clock
        if distributed is not None:
            from neorec.train.distributed import wrap_data_parallel

            self.model = wrap_data_parallel(self.model, distributed.dense_group, self.device)
        if self.timeline is not None:
            self.timeline.attach(self.model)
        self.dense_optimizer = make_dense_optimizer(cfg.dense_optimizer, dense_parameters(self.model))
        self.loss_fn = torch.nn.BCEWithLogitsLoss()
        self.step = 0
        self.run_id = secrets.token_hex(8)  # in every metrics record; a checkpoint lists its runs
        self.ancestor_runs: List[Optional[str]] = []  # the runs a resumed checkpoint descends from
        self.output_dir = Path(cfg.train.output_dir) if cfg.train.output_dir else None
        self.closed = False
        self.checkpointer = None
        if cfg.checkpoint.dir or self.resume.location is not None:
            from neorec.train.checkpoint import Checkpointer
            self.checkpointer = Checkpointer(cfg.checkpoint, self)

    def _phase(self, name: str):
        """The timeline's phase ``name`` when profiling, else nothing."""
        return self.timeline.phase(name) if self.timeline is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def _build_progress(self, tables) -> Iterator[None]:
        """Building a model of ``BUILD_NOTICE_BYTES`` of embedding rows or more (drawing initial
        rows, filling row stores) can take minutes: say so. On a terminal, a bar of the initial rows
        this process draws; to a file, a line before and one after."""
        total = sum(4 * t.num_embeddings * t.embedding_dim for t in tables)
        if not (self.cfg.train.progress and self.is_main) or total < BUILD_NOTICE_BYTES:
            yield
            return
        from neorec.planner.enumerate import format_bytes

        terminal, start = redraws_lines(self.out), time.perf_counter()
        where = f", over {self.world_size} ranks" if self.world_size > 1 else ""
        if not terminal:
            print(f"building the model: {len(tables)} tables, {format_bytes(total)} of embedding rows (in fp32{where})",
                  file=self.out, flush=True)
        bar = tqdm(unit="B", unit_scale=True, desc="initial rows" + (" of this rank" if where else ""),
                   disable=not terminal, file=self.out, mininterval=0.5)
        with bar, observing_draws(bar.update):
            yield
        if not terminal:
            print(f"model built in {time.perf_counter() - start:.1f} s", file=self.out, flush=True)

    def _sharded_collection(self, plan, comm_stats, initial_rows: bool):
        """This rank's ``ShardedEmbeddingBagCollection`` of ``plan`` (default: ``default_plan``),
        its pieces placed by ``plan_locations`` and starting from the rows the single-process
        model starts from (``load_initial_weights``; skipped without ``initial_rows``, when a
        checkpoint sets them next): no rank allocates the whole model."""
        from neorec.sharding import ShardedEmbeddingBagCollection, default_plan

        cfg, context = self.cfg, self.distributed
        tables = self.source.tables(cfg.model.embedding_dim, cfg.model.pooling)
        self.plan = plan if plan is not None else default_plan(tables, context.world_size, context.local_world_size)
        locations = plan_locations(cfg, tables, self.plan)
        if locations is not None and any(location.cached for location in locations.values()) and \
                cfg.embedding.location.prefetch and not cfg.train.pipeline:
            raise ValueError(PREFETCH_NEEDS_PIPELINE)
        if locations is not None and any(location.kind == "cached_ssd" for location in locations.values()):
            ensure_writable_dir(ssd_dir_of(cfg), "embedding.location.ssd_dir (the plan's cached_ssd tables)")
        collection = ShardedEmbeddingBagCollection(
            tables, self.plan, context.embedding_group, cfg.embedding.optimizer, cfg.embedding.storage,
            device=self.device, comm_stats=comm_stats, comm=cfg.embedding.comm, locations=locations,
            init_seed=None)  # set next: the unsharded model's rows, or a checkpoint's
        if initial_rows:
            collection.load_initial_weights(cfg.train.seed)
        return collection

    # ------------------------------------------------------------------------------ one step
    def train_step(self, batch: Batch, global_batch_size: Optional[int] = None, hooks=None) -> float:
        """One optimisation step; returns the batch loss (distributed: ``batch`` is this rank's
        part of a global batch of ``global_batch_size`` samples and the loss is the global mean).
        Raises NonFiniteLossError before any weight changes if the loss is NaN or infinite (on
        every rank at once). ``hooks`` (``TrainPipeline``'s ``StepHooks``): ``after_forward()`` runs
        between forward and backward, ``after_backward()`` between backward and the optimizer."""
        self.model.train()
        timeline = self.timeline
        with timeline.forward() if timeline is not None else contextlib.nullcontext():
            logits = self.model(batch.dense, batch.sparse)
            if self.distributed is None:
                loss = self.loss_fn(logits, batch.labels)
                value = float(loss.detach())
            else:
                loss = local_loss(logits, batch.labels, global_batch_size)
                value = all_reduce_sum(float(loss.detach()), self.distributed.dense_group, self.device)
        if hooks is not None:
            hooks.after_forward()
        self._check_finite(value)
        with timeline.phase("backward") if timeline is not None else contextlib.nullcontext():
            self.dense_optimizer.zero_grad(set_to_none=True)
            loss.backward()
        if hooks is not None:
            hooks.after_backward()
        with timeline.phase("optimizer") if timeline is not None else contextlib.nullcontext():
            self.dense_optimizer.step()
        self.step += 1
        return value

    def _check_finite(self, value: float) -> None:
        if not math.isfinite(value):
            raise NonFiniteLossError(
                f"training loss is {value} at step {self.step + 1}; stopping before the update is applied "
                f"(lower the learning rates, check the input features for NaN/inf)"
            )

    def check_weights_finite(self) -> None:
        """Raise ``NonFiniteLossError`` when a dense weight or a fused module's embedding row is NaN
        or infinite (``divergence.non_finite_weight``): the last update diverged. Called before
        each checkpoint and after the last step, on every rank (the verdict is all-reduced)."""
        what = non_finite_weight(self.model)
        if self.distributed is not None:  # (a rank's own rows: every rank stops alike)
            if all_reduce_sum(float(what is not None), self.distributed.dense_group, self.device) and what is None:
                what = "an embedding row of another rank"
        if what is not None:
            raise diverged(f"{what} is not finite after step {self.step}: the update diverged", self.checkpointer)

    @torch.no_grad()
    def evaluate(self, max_batches: Optional[int] = None) -> Dict[str, float]:
        """NE, AUC, calibration and log loss over the eval set (or its first ``max_batches``)."""
        if self.timeline is not None:
            with self.timeline.paused():
                return self._evaluate(max_batches)
        return self._evaluate(max_batches)

    def _evaluate(self, max_batches: Optional[int]) -> Dict[str, float]:
        limit = self.cfg.train.eval_max_batches if max_batches is None else max_batches
        self.model.eval()
        acc = MetricsAccumulator()
        world = self.world_size
        for i, batch in enumerate(self.source.eval_batches(self.cfg.data.eval_batch_size * world)):
            if limit and i >= limit:
                break
            check_terminated()
            if self.distributed is not None:
                batch = split_batch(batch, self.distributed.rank, world)
            batch = batch.to(self.device)
            acc.update(self.model(batch.dense, batch.sparse), batch.labels)
        self.model.train()
        nan = int(torch.isnan(acc.logits()).sum())  # a diverged model (fit raises)
        if self.distributed is None:
            return {**acc.compute(), "nan_predictions": nan}
        nan = int(all_reduce_sum(float(nan), self.distributed.dense_group, self.device))
        # AUC does not decompose: rank 0 gathers every prediction, computes, and sends the figures
        # (every rank gathering and computing held ~120 bytes per eval sample on each of them)
        group = self.distributed.dense_group
        pairs = gather_to_main(torch.stack([acc.logits(), acc.labels()], dim=1).to(self.device), group)  # [N, 2]
        metrics, failure = {}, None
        if pairs is not None:
            try:
                pairs = pairs.cpu()
                metrics = compute_metrics(pairs[:, 0], pairs[:, 1])
            except Exception as exc:  # every rank stops, not rank 0 alone while the others wait in the broadcast
                failure = exc
        figures = torch.tensor([float(metrics.get(k, 0.0)) for k in METRIC_KEYS] + [float(failure is None)],
                               dtype=torch.float64, device=self.device)
        dist.broadcast(figures, src=dist.get_global_rank(group, 0), group=group)
        if failure is not None:
            raise failure
        if not figures[-1]:
            raise RuntimeError("evaluation: rank 0 failed computing the metrics (its error is in its output)")
        figures = dict(zip(METRIC_KEYS, figures.tolist()))
        figures["num_samples"] = int(figures["num_samples"])
        return {**figures, "nan_predictions": nan}

    # ------------------------------------------------------------------------------ loop
    def _eval_and_log(self, log: MetricsLog, bar: tqdm, epoch: int, window: Dict[str, Any]) -> float:
        """Evaluate, log and print; returns the seconds it took, which are not training time: the
        train ``window``'s start moves by them too. Nothing without an eval set."""
        if not self.source.num_eval_samples():
            return 0.0
        t0 = time.perf_counter()
        metrics = self.evaluate()
        log.write({"kind": "eval", "step": self.step, "epoch": epoch, **metrics})
        if self.is_main:
            bar.write(_format_eval(self.step, metrics), file=self.out)
        spent = time.perf_counter() - t0
        window["start"] += spent
        return spent

    def _train_batches(self, epoch: int, start_batch: int = 0) -> Iterator[Tuple[Batch, int]]:
        """(this rank's batch, global batch size) for every global batch of the epoch from
        ``start_batch`` on."""
        batches = self.source.train_batches(self.cfg.data.batch_size * self.world_size, epoch=epoch,
                                            start_batch=start_batch)
        for batch in batches:
            if self.distributed is None:
                yield batch, batch.batch_size
            else:
                yield split_batch(batch, self.distributed.rank, self.world_size), batch.batch_size

    def close(self) -> None:
        """Flush and close the row stores of cached tables (their files stay, unlocked: another run
        or process may open them; a trainer kept alive held them, and a second trainer of the same
        config in the process was refused them); the trainer cannot train or evaluate afterwards.
        Idempotent. A flush refused after a diverged run still closes every store, then raises."""
        if not self.closed:
            self.closed = True
            errors = []
            for collection in cached_collections(self.model):  # (each closes all its stores, then raises)
                try:
                    collection.close()
                except BaseException as exc:
                    errors.append(exc)
            if errors:
                raise errors[0]

    def fit(self) -> TrainResult:
        """Train for ``train.epochs`` epochs (or ``train.max_steps`` steps, whichever ends first),
        then evaluate. Training QPS counts training samples over training wall time (data
        loading and checkpoint saves included, evaluation excluded), in the ``train`` records as
        in the ``final`` one. ``train.output_dir`` and ``checkpoint.dir`` are locked meanwhile: a
        second run writing to either is refused (two runs interleaved their logs and checkpoints)."""
        with holding_dirs(run_dirs(self.cfg) if self.is_main else []):
            return self._fit()

    def _fit(self) -> TrainResult:
        cfg = self.cfg.train
        writes = self.output_dir if self.is_main else None  # rank 0 alone logs
        global_batch_size = self.cfg.data.batch_size * self.world_size
        steps_per_epoch = math.ceil(self.source.num_train_samples() / global_batch_size)
        epoch, batch_in_epoch = 0, 0
        if self.checkpointer is not None:  # resume (or not): sets self.step and the data position
            position = self.checkpointer.start(self.resume, steps_per_epoch)
            epoch, batch_in_epoch = position.epoch, position.batch_in_epoch
        # a resumed run continues the log of the run it resumes (records past its step are dropped)
        last_epoch_trained = epoch - 1 if batch_in_epoch == 0 and epoch > 0 else epoch
        log = MetricsLog(writes / "metrics.jsonl" if writes else None, continue_after_step=self.step or None,
                         epoch=last_epoch_trained, run=self.run_id, keep_runs=self.ancestor_runs)
        if log.replaced and log.kept:  # a branch resumed from an earlier checkpoint: its ancestors' records stay
            print(f"train.output_dir {writes}: metrics.jsonl keeps the {log.kept} records of the resumed "
                  f"checkpoint's runs up to step {self.step} and drops those of another run (not the resumed "
                  f"checkpoint's); config.json is replaced", file=self.out, flush=True)
        elif log.replaced:
            whose = "another run (not the resumed checkpoint's)" if self.step else "an earlier run"
            print(f"train.output_dir {writes}: replacing the metrics.jsonl and config.json of {whose}",
                  file=self.out, flush=True)
        if writes:
            writes.mkdir(parents=True, exist_ok=True)
            write_atomic(writes / "config.json", self.cfg.to_json())
            stale = writes / "timeline.json"
            if not cfg.profile and (log.replaced or not self.step) and stale.is_file():
                stale.unlink()  # an earlier run's profile, not this run's
                print(f"train.output_dir {writes}: removed the timeline.json of an earlier run (--profile writes "
                      "this run's)", file=self.out, flush=True)
        if cfg.epochs:  # the step the run ends at: what is left of the data, in this run's global batches
            left = 0 if epoch >= cfg.epochs else (max(0, steps_per_epoch - batch_in_epoch)
                                                  + steps_per_epoch * (cfg.epochs - epoch - 1))
            total_steps = self.step + left  # (a resumed run may have trained its steps with other batches)
        else:
            total_steps = cfg.max_steps
        if cfg.max_steps:
            total_steps = min(total_steps, cfg.max_steps)
        if self.step and total_steps and self.is_main and self.step >= total_steps:
            print(f"nothing left to train: resumed at step {self.step}, and the run ends at step {total_steps} "
                  f"(train.max_steps {cfg.max_steps or 'unset'}, train.epochs {cfg.epochs}); evaluating only",
                  file=self.out, flush=True)
        terminal = redraws_lines(self.out)
        show = cfg.progress and self.is_main
        # a bar redraws with "\r" on one line: on a terminal; to a file or pipe, a plain line now and then
        bar = tqdm(total=total_steps, initial=self.step, disable=not (show and terminal), file=self.out,
                   unit="step", dynamic_ncols=True, mininterval=0.5)
        self._progress_lines = {"on": show and not terminal, "last": time.perf_counter(), "total": total_steps}
        samples, eval_seconds, first_step = 0, 0.0, self.step
        window = {"samples": 0, "loss": 0.0, "steps": 0, "start": time.perf_counter()}
        start = step_start = time.perf_counter()
        trained_epoch = epoch  # (the epoch of the last step, for a record after the loop)
        try:
            stop = bool(cfg.max_steps) and self.step >= cfg.max_steps
            while not stop and (not cfg.epochs or epoch < cfg.epochs):
                # the epoch's own number of steps, the same on every rank: no rank reads past its last
                # batch (one whose source failed there launched a look-ahead the others did not)
                remaining = steps_per_epoch - batch_in_epoch
                last_epoch = cfg.epochs and epoch == cfg.epochs - 1
                if cfg.max_steps:
                    remaining = min(remaining, cfg.max_steps - self.step)
                with PrefetchLoader(self._train_batches(epoch, batch_in_epoch),
                                    depth=self.cfg.data.prefetch_batches) as loader, \
                        self._step_stream(loader, remaining) as steps:
                    step_start = time.perf_counter()  # not the previous epoch's evaluation
                    for batch, size, hooks in steps:
                        check_terminated()  # a SIGTERM whose exception was lost (raised in a finalizer)
                        with self._error_record(log, epoch, 1):
                            loss = self.train_step(batch, size, hooks)
                        samples += size
                        batch_in_epoch += 1
                        window["samples"] += size
                        window["loss"] += loss
                        window["steps"] += 1
                        bar.update(1)
                        stop = bool(cfg.max_steps) and self.step >= cfg.max_steps
                        epoch_end = batch_in_epoch >= steps_per_epoch
                        # a step's records (train, then eval) come before its checkpoint: a run killed between
                        # them resumes from an earlier checkpoint and writes them again, none is lost
                        saving = self.checkpointer is not None and self.checkpointer.due()
                        if self.step % cfg.log_every_steps == 0 or stop or epoch_end or saving:
                            self._log_train(log, bar, window, epoch)
                        spent = 0.0  # (the last step's eval is the final one)
                        if not stop and self.step != total_steps and (
                                cfg.eval_every_steps and self.step % cfg.eval_every_steps == 0
                                or epoch_end and not cfg.eval_every_steps and not last_epoch):
                            spent = self._eval_and_log(log, bar, epoch, window)
                            eval_seconds += spent
                        if self.checkpointer is not None:
                            with self._phase("checkpoint"), self._error_record(log, epoch):
                                self.checkpointer.after_step(epoch, batch_in_epoch)
                        if self.timeline is not None:  # (the save and the logging in; an evaluation out)
                            self.timeline.end_step(time.perf_counter() - step_start - spent)
                        if stop:
                            break
                        step_start = time.perf_counter()
                if self.step == 0:
                    raise ValueError("the training data yielded no batches")
                if not stop and batch_in_epoch < steps_per_epoch:  # the data ended early: the epoch's end here
                    if window["steps"]:
                        self._log_train(log, bar, window, epoch)
                    if not cfg.eval_every_steps and not last_epoch:
                        eval_seconds += self._eval_and_log(log, bar, epoch, window)
                trained_epoch, epoch, batch_in_epoch = epoch, epoch + 1, 0
            with self._error_record(log, trained_epoch):
                self.check_weights_finite()  # (the last step's update: no loss of a next step checks it)
                if self.checkpointer is not None:
                    self.checkpointer.finish()
            train_seconds = time.perf_counter() - start - eval_seconds
            train_comm = (self.comm_stats.snapshot(), dict(self.comm_stats.calls)) if self.comm_stats else None
            bar.close()
            with self._error_record(log, trained_epoch):
                final_eval = self.evaluate() if self.source.num_eval_samples() else {}  # {}: no eval set
                if final_eval.get("nan_predictions"):  # (a last line of defence: the checks above missed it)
                    raise NonFiniteLossError(f"the final evaluation predicted NaN for {final_eval['nan_predictions']:,} "
                                             f"samples after step {self.step}: the last update diverged (lower the "
                                             f"learning rates)")
                for collection in cached_collections(self.model):
                    collection.flush()  # every cached row back in its store
            cache = self._cache_counters()
            qps = samples / max(train_seconds, 1e-9)
            log.write({"kind": "final", "step": self.step, "first_step": first_step, "samples": samples,
                       "train_seconds": train_seconds, "qps": qps, **final_eval, **({"cache": cache} if cache else {})})
            if self.timeline is not None:
                self._report_timeline(writes, train_comm)
        finally:
            bar.close()
            log.close()
        return TrainResult(steps=self.step, samples=samples, train_seconds=train_seconds, qps=qps,
                           final_eval=final_eval, metrics_path=str(log.path) if log.path else None,
                           first_step=first_step, cache=cache)

    @contextlib.contextmanager
    def _error_record(self, log: MetricsLog, epoch: int, ahead: int = 0):
        """A ``NonFiniteLossError`` raised inside (or a store's ``NonFiniteRowError``: a diverged row a
        cache wrote back) goes to the log as an "error" record of step ``self.step + ahead`` and on."""
        try:
            yield
        except NonFiniteRowError as exc:
            row = f"row {exc.row}" if exc.row is not None else "a row"
            error = diverged(f"table {exc.store!r} {row} is not finite as its cache writes it back to its "
                             f"store after step {self.step}: an update diverged", self.checkpointer)
            log.write({"kind": "error", "step": self.step + ahead, "epoch": epoch, "message": str(error)})
            raise error from exc
        except NonFiniteLossError as exc:
            log.write({"kind": "error", "step": self.step + ahead, "epoch": epoch, "message": str(exc)})
            raise

    def _cache_counters(self) -> Dict[str, Dict[str, float]]:
        """{table: CACHE_COUNTERS and hit_rate} of every cached table, summed over its pieces and,
        in a sharded run, over the ranks (a collective: every rank calls it). Counters of this
        process's life (a resumed run counts from its restart)."""
        from neorec.sharding import ShardedEmbeddingBagCollection

        arch = (self.model.module if isinstance(self.model, torch.nn.parallel.DistributedDataParallel)
                else self.model).sparse_arch
        collection, table_of = arch, {}
        if isinstance(arch, ShardedEmbeddingBagCollection):
            collection = arch.cached
            table_of = {p.config.name: p.table.name for p in arch.routing.shards_on[arch.rank]}
        names = [t.name for t in arch.tables]
        totals = {name: [0.0] * (len(CACHE_COUNTERS) + 1) for name in names}  # + 1: "is cached here"
        if isinstance(collection, CachedEmbeddingBagCollection):
            for piece, stats in collection.cache_stats().items():
                row = totals[table_of.get(piece, piece)]
                for i, key in enumerate(CACHE_COUNTERS):
                    row[i] += float(stats[key])
                row[-1] = 1.0
        if self.distributed is not None:
            flat = all_reduce_sums([v for name in names for v in totals[name]], self.distributed.dense_group,
                                   self.device)
            width = len(CACHE_COUNTERS) + 1
            totals = {name: flat[i * width : (i + 1) * width] for i, name in enumerate(names)}
        out = {}
        for name in names:
            row = totals[name]
            if row[-1] > 0:
                counters = {key: int(value) for key, value in zip(CACHE_COUNTERS, row)}
                # None without lookups (a resumed run with nothing left to train): JSON has no NaN
                counters["hit_rate"] = counters["hits"] / counters["lookups"] if counters["lookups"] else None
                out[name] = counters
        return out

    @contextlib.contextmanager
    def _step_stream(self, loader, max_steps: Optional[int]):
        """``_steps`` closed on leaving. A step that raised leaves the ranks out of step: an id
        exchange the pipeline launched for the next batch is dropped, not completed (completing
        it would meet another collective on the other ranks: gloo aborts the process, and the
        error that stopped the step is never shown)."""
        steps = self._steps(loader, max_steps)
        try:
            yield steps
        except NonFiniteLossError:  # every rank stops at this step (the loss is all-reduced)
            raise
        except BaseException:
            abandon_launched_exchanges(self.model)
            raise
        finally:
            steps.close()

    def _steps(self, loader, max_steps: Optional[int] = None):
        """(batch on the device, global batch size, StepHooks or None) per step: through
        ``TrainPipeline`` (``train.pipeline``) or the plain loop; either loads no batch past
        ``max_steps``."""
        prefetch = self.cfg.embedding.location.prefetch
        if self.cfg.train.pipeline:
            return TrainPipeline(self.model, self.device, self.timeline,
                                 prefetch_cached_rows=prefetch).run(loader, max_steps)
        if max_steps is not None:
            loader = itertools.islice(loader, max_steps)
        items = with_prefetch(loader, self.model, lambda item: item[0].sparse, max_steps) if prefetch else loader
        return plain_steps(items, self.device, self.timeline)

    def _report_timeline(self, writes: Optional[Path], train_comm) -> None:
        extra = {"pipeline": self.cfg.train.pipeline, "world_size": self.world_size}
        if train_comm is not None:  # this rank's bytes to other ranks per collective, training steps
            extra["comm_bytes"], extra["comm_calls"] = train_comm  # (and evaluations between them)
        if writes:
            self.timeline.write_json(writes / "timeline.json", extra)
        if self.is_main:
            print(self.timeline.format_table(), file=self.out, flush=True)

    def _log_train(self, log: MetricsLog, bar: tqdm, window: Dict[str, Any], epoch: int) -> None:
        now = time.perf_counter()
        qps = window["samples"] / max(now - window["start"], 1e-9)
        loss = window["loss"] / max(window["steps"], 1)
        log.write({"kind": "train", "step": self.step, "epoch": epoch, "loss": loss, "qps": qps,
                   "steps": window["steps"]})  # fewer than log_every_steps at an epoch's end or after a resume
        bar.set_postfix(loss=f"{loss:.4f}", qps=f"{qps:,.0f}", refresh=False)  # drawn at the bar's own pace
        lines = self._progress_lines
        if lines["on"] and now - lines["last"] >= PROGRESS_LINE_SECONDS:
            lines["last"] = now
            total = f"/{lines['total']:,}" if lines["total"] else ""
            print(f"step {self.step:,}{total}: loss {loss:.4f}, {qps:,.0f} samples/s", file=self.out, flush=True)
        window.update(samples=0, loss=0.0, steps=0, start=now)


def _format_eval(step: int, m: Dict[str, float]) -> str:
    return (f"eval @ step {step:,}: AUC {m['auc']:.4f}  NE {m['ne']:.4f}  "
            f"calibration {m['calibration']:.3f}  ({int(m['num_samples']):,} samples)")
