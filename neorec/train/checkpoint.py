"""Sharded, reshardable, crash-safe, incremental and quantized checkpoints (Check-N-Run) for the
``Trainer``. Turned on by the ``[checkpoint]`` config section; resume with
``neorec train --resume DIR`` (DIR: a checkpoint root or one ``step-<N>`` directory), or
automatically when ``torchrun --max-restarts`` restarts a worker.

    neorec train --config configs/tiny.toml --set checkpoint.dir='"runs/ckpt"' --set checkpoint.every_steps=20
    neorec train --config configs/tiny.toml --resume runs/ckpt

One checkpoint = ``<dir>/step-<N>/``:
    rank<r>.pt    this rank's embedding pieces (``checkpoint_tables.py``) and its stochastic-rounding
                  generator state; flat dict of tensors (``torch.load(weights_only=True)``)
    rank<r>-<k>.pt  the rows of this rank's cached tables (``embedding.location``), one file per
                  chunk of rows (about 8 MiB), so that no table is ever held whole in memory
    rank<r>.json  this rank's files, their sizes, checksums and pieces (read by rank 0)
    dense.pt      (rank 0) dense weights, dense optimizer tensors, the torch CPU generator state
    manifest.json (rank 0, written LAST, atomically) step, data position, tables, plan, config,
                  pieces per file, sha256 and size of every file, the chain of checkpoints to apply
                  and the sha256 of each base's manifest; a sha256 of the manifest itself
A checkpoint is complete when its manifest, every file of it and every checkpoint of its chain
verify. The last entry of the chain is the checkpoint's own folder, whatever it is called (a full
checkpoint can be copied anywhere under any name); its bases are found by name beside it and must
be the very checkpoints it was saved on (their manifests' sha256). Restoring from a root takes the
newest complete one (a newer torn or corrupt one is reported and skipped); restoring from one
named ``step-<N>`` takes that one or stops.

Incremental (``checkpoint.incremental``): the fused modules mark the rows every optimizer step
updates (a cached table's rows are marked when a training step looks them up); an incremental
checkpoint writes only the rows marked since the previous checkpoint (plus all dense state); its
chain is the last full checkpoint, then every increment since. A full checkpoint is taken instead
when the increments since the last full one would exceed ``full_when_fraction_exceeds`` of a full
one's embedding bytes.

Data position: (epoch, global batches done in the epoch); the sources are deterministic per
(epoch, batch), so a resumed run skips exactly the batches already trained.
"""

from __future__ import annotations

import io
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from neorec.train.checkpoint_config import CheckpointConfig
from neorec.files import TEMPORARY, write_atomic
from neorec.train.checkpoint_files import MappedFiles, UnquantizableRowError, load_tensors, save_tensors, sha256_file
from neorec.train.checkpoint_tables import (fused_modules, holders, model_pieces, piece_bytes, restore_pieces,
                                            save_pieces)
from neorec.train.checkpoint_manifest import (FORMAT, MANIFEST, ResumeChoice, _chain_parts, _changed_data_settings,
                                              _changed_optimizer_settings, _manifest_digest, _read_manifest,
                                              _step_of, _table_shapes, check_resumable, check_resume_location,
                                              checkpoint_name, find_latest_complete, job_identity,
                                              newest_saved_step, no_checkpoint_message, verify_checkpoint)
from neorec.train.distributed import all_reduce_sums


@dataclass
class Position:
    """Where training is: ``batch_in_epoch`` global batches of ``epoch`` are done."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0


class CheckpointWriteError(OSError):
    """A checkpoint could not be written; the run stops (exit code 1: it failed, it was not misused)."""

    exit_code = 1


def refuse_other_runs(cfg: CheckpointConfig, resumed_step: Optional[int] = None,
                      resumed_from: Optional[Path] = None) -> None:
    """Stop before training when ``checkpoint.dir`` holds complete checkpoints of another run:
    any, for a fresh run or one resumed from elsewhere; those after the resumed step, for a run
    resumed from ``checkpoint.dir`` itself (the rewound run's future). Saving beside them would
    let ``keep_last`` prune the wrong ones and a later ``--resume`` mix the two runs. Torn or
    corrupt ones do not count: resuming skips them and this run overwrites them. ``neorec train``
    calls it before building the model for a run without --resume (a refusal came after minutes of
    building and a filled SSD store otherwise)."""
    root = Path(cfg.dir) if cfg.dir else None
    if root is None or not root.is_dir() or not (cfg.every_steps or cfg.save_final):
        return
    if (root / MANIFEST).exists():
        raise ValueError(f"checkpoint.dir {root} is a checkpoint itself (it holds {MANIFEST}): this run would "
                         f"save its step-N folders inside it; set checkpoint.dir to a folder of its own")
    resumed_here = resumed_step is not None and resumed_from is not None and (
        resumed_from.parent.resolve() == root.resolve())
    after = resumed_step if resumed_here else -1
    steps = {p: _step_of(p) for p in root.iterdir() if p.is_dir()}
    candidates = sorted((p for p, step in steps.items() if step is not None and step > after
                         and (p / MANIFEST).exists()), key=steps.get, reverse=True)
    for path in candidates:
        try:
            verify_checkpoint(path)
        except (ValueError, KeyError, TypeError, OSError):
            continue
        names = ", ".join(p.name for p in candidates[:3]) + (", ..." if len(candidates) > 3 else "")
        what = (f"checkpoints after step {resumed_step}, the one resumed from ({names}): the future of the "
                f"run being rewound" if resumed_here else f"checkpoints of another run ({names})")
        raise ValueError(f"checkpoint.dir {root} already holds {what}. Saving beside them would let keep_last "
                         f"prune the wrong ones and a later --resume mix the two runs: set checkpoint.dir to "
                         f"another directory or move them away"
                         + ("" if resumed_here else f" (or continue that run with --resume {root})"))


class Checkpointer:
    """Saves and restores a ``Trainer``'s complete state; see the module docstring."""

    def __init__(self, cfg: CheckpointConfig, trainer) -> None:
        self.cfg = cfg
        self.trainer = trainer
        context = trainer.distributed
        self.rank = context.rank if context is not None else 0
        self.world_size = context.world_size if context is not None else 1
        self.group = context.dense_group if context is not None else None
        self.root = Path(cfg.dir) if cfg.dir else None
        self.sparse_arch = _unwrap(trainer.model).sparse_arch
        self.pieces = model_pieces(self.sparse_arch, self.rank)
        if cfg.incremental:
            for holder in holders(self.pieces):
                holder.track()
        self.chain: List[str] = []
        self.full_bytes = 0.0
        self.increment_bytes = 0.0
        self.last_saved_step: Optional[int] = None
        self.position = Position()
        self.resumed_from: Optional[Path] = None  # the checkpoint restored, if any
        # while a checkpoint is checked and restored: (its step, its path), (None, --resume) until known
        self.restoring: Optional[Tuple[Optional[int], Path]] = None
        self.last_complete: Optional[Path] = None  # the newest complete checkpoint of this run (restored or saved)
        self.bytes_written: List[dict] = []  # one record per save (kind, bytes) for benchmarks

    def go_on_from(self) -> Optional[Tuple[int, str]]:
        """(step, what to give ``--resume``) of the newest complete checkpoint of this run:
        ``checkpoint.dir`` when its newest is at least as new (a save that stopped after its
        manifest counts), else the checkpoint it resumed from elsewhere. None: none yet."""
        found = []
        if self.root is not None:
            newest = newest_saved_step(self.root)
            if newest is not None:
                found.append((newest, str(self.root)))
        mine = ((self.last_saved_step, self.last_complete) if self.last_complete is not None
                and self.last_saved_step is not None else self.restoring)  # (stopped while restoring it)
        if mine is not None and mine[0] is not None:
            here = self.root is not None and mine[1].parent.resolve() == self.root.resolve()
            found.append((mine[0], str(self.root) if here else str(mine[1])))
        return max(found, key=lambda item: item[0]) if found else None  # (a tie: checkpoint.dir, first)

    def _say(self, text: str) -> None:
        if self.rank == 0:
            print(f"checkpoint: {text}", file=self.trainer.out, flush=True)

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)

    # ------------------------------------------------------------------------------ trainer hooks
    def start(self, choice: "ResumeChoice", steps_per_epoch: int) -> Position:
        """Restore from ``choice`` (``choose_resume``); returns the position to continue from (zero
        when starting fresh)."""
        if choice.said and self.rank == 0:
            print(choice.said, end="", file=self.trainer.out, flush=True)
        if choice.location is None:
            refuse_other_runs(self.cfg)
            return Position()
        position = self.restore(Path(choice.location), found=choice.found)
        refuse_other_runs(self.cfg, position.step, self.resumed_from)
        if self.root is None:  # --resume reads a checkpoint; only checkpoint.dir makes a run save them
            location = Path(choice.location)
            folder = location.parent if _step_of(location) is not None else location
            if (location / MANIFEST).exists() and _step_of(location) is None:  # a checkpoint copied under a name
                root = "DIR"  # (itself would put the new step-N folders inside it)
            elif (newest_saved_step(folder) or 0) > position.step:  # refused there: it holds this run's future
                root = f"{folder}-from-step-{position.step}"
            else:
                root = str(folder)
            self._say(f"this run saves no checkpoints (checkpoint.dir is empty); to save as it goes: "
                      f"--set checkpoint.dir='\"{root}\"' --set checkpoint.every_steps=N")
        if position.batch_in_epoch >= steps_per_epoch:
            position = Position(position.step, position.epoch + 1, 0)
        self.position = position
        return position

    def due(self) -> bool:
        """Whether ``after_step`` will save at the trainer's current step (every ``every_steps``)."""
        return self.root is not None and bool(self.cfg.every_steps) and self.trainer.step % self.cfg.every_steps == 0

    def after_step(self, epoch: int, batch_in_epoch: int) -> None:
        """Called after every training step, once its records (train, eval) are written; saves
        every ``every_steps`` steps."""
        self.position = Position(self.trainer.step, epoch, batch_in_epoch)
        if self.due():
            self.save()

    def finish(self) -> None:
        """Called when training ends: the final checkpoint (``save_final``)."""
        if self.root is not None and self.cfg.save_final and self.last_saved_step != self.trainer.step:
            self.save()

    # ------------------------------------------------------------------------------ save
    def _choose_kind(self) -> str:
        if not self.cfg.incremental or not self.chain:
            return "full"
        full, incremental = self._payload_bytes()
        if self.increment_bytes + incremental > self.cfg.full_when_fraction_exceeds * full:
            return "full"
        return "incremental"

    def _payload_bytes(self) -> Tuple[float, float]:
        """Bytes of the embedding tensors (rows, optimizer state, ids) that a full and an
        incremental checkpoint of this step would write, summed over the ranks."""
        full = incremental = 0.0
        for piece in self.pieces:
            if piece.writes:
                kind, rows = piece.holder.optimizer_kind, piece.row_end - piece.row_start
                full += piece_bytes(kind, piece, rows, self.cfg.row_bits)
                incremental += piece_bytes(kind, piece, piece.holder.count_modified(piece), self.cfg.row_bits,
                                           incremental=True)
        if self.world_size > 1:
            full, incremental = all_reduce_sums([full, incremental], self.group, self.trainer.device)
        return full, incremental

    def save(self) -> Path:
        """Write a checkpoint of the current state (every rank calls it at the same step). A file
        that cannot be written (a full disk, say) stops the run with ``CheckpointWriteError``."""
        try:
            return self._save()
        except BrokenPipeError:  # the reader of our report line went away, not the disk: said by the CLI
            raise
        except (OSError, UnquantizableRowError) as exc:
            step, last = self.trainer.step, self.go_on_from()
            where = (f"its last complete checkpoint is of step {last[0]}: --resume {last[1]} goes on from there"
                     if last is not None else "no checkpoint of it is complete yet")
            reason = (f"{exc.strerror or exc}{f': {exc.filename}' if exc.filename else ''}"
                      if isinstance(exc, OSError) else str(exc))
            raise CheckpointWriteError(f"could not write the checkpoint of step {step} in {self.root} ({reason}); "
                                       f"training stopped; {where}") from exc

    def _save(self) -> Path:
        trainer, step = self.trainer, self.trainer.step
        trainer.check_weights_finite()  # (a checkpoint of diverged weights was saved as complete)
        kind = self._choose_kind()
        path = self.root / checkpoint_name(step)
        path.mkdir(parents=True, exist_ok=True)
        if self.rank == 0 and (path / MANIFEST).exists():
            (path / MANIFEST).unlink()  # rewriting this step: it is incomplete until the new manifest
        for stale in path.glob(f"rank{self.rank}-*.pt"):  # chunk files of an earlier try at this step
            stale.unlink()
        modules = fused_modules(self.sparse_arch)
        files = []
        # the main file rank<r>.pt: every piece held whole, the rounding generators; then one file
        # per chunk of a cached table's rows, rank<r>-<k>.pt (CachedPieces)
        for number, (tensors, entries) in enumerate(save_pieces(self.pieces, kind == "incremental",
                                                                self.cfg.row_bits, "p")):
            if number == 0:
                for name, module in modules:
                    if module._rounder.stochastic:
                        tensors[_rng_key(name, "rounding")] = module._rounder.get_state().cpu()
                        if module._replica_rounder is not None:  # the same on every rank
                            tensors[_rng_key(name, "replica_rounding")] = module._replica_rounder.get_state().cpu()
            file = f"rank{self.rank}.pt" if number == 0 else f"rank{self.rank}-{number}.pt"
            size = save_tensors(path / file, tensors)
            files.append({"file": file, "bytes": size, "sha256": sha256_file(path / file), "entries": entries})
        meta = {"files": files, "sparse_step": int(modules[0][1].step) if modules else None}
        write_atomic(path / f"rank{self.rank}.json", json.dumps(meta).encode())
        if self.rank == 0:
            dense, optimizer_json = _dense_state(trainer)
            dense_size = save_tensors(path / "dense.pt", dense)
        self._barrier()
        if self.rank == 0:
            metas = self._rank_metas(path)
            files = {f["file"]: {"bytes": f["bytes"], "sha256": f["sha256"]} for m in metas for f in m["files"]}
            files["dense.pt"] = {"bytes": dense_size, "sha256": sha256_file(path / "dense.pt")}
            chain = [checkpoint_name(step)] if kind == "full" else self.chain + [checkpoint_name(step)]
            embedding_bytes = sum(f["bytes"] for m in metas for f in m["files"])
            manifest = {
                "format": FORMAT, "step": step, "kind": kind, "chain": chain,
                "epoch": self.position.epoch, "batch_in_epoch": self.position.batch_in_epoch,
                "global_batch_size": trainer.cfg.data.batch_size * self.world_size,
                "world_size": self.world_size, "row_bits": self.cfg.row_bits,
                "plan": trainer.plan.to_dict() if trainer.plan is not None else None,
                "tables": _table_shapes(trainer.cfg, trainer.source),
                "sparse_optimizer": trainer.cfg.embedding.optimizer.kind,
                "sparse_step": max((m["sparse_step"] for m in metas if m["sparse_step"] is not None), default=0),
                "pieces": {f["file"]: f["entries"] for m in metas for f in m["files"]},
                "dense_optimizer": optimizer_json, "files": files,
                "bytes": {"embeddings": embedding_bytes, "dense": dense_size},
                "config": trainer.cfg.to_dict(),
                "runs": [*trainer.ancestor_runs, trainer.run_id],  # whose metrics records lead here
                "job": job_identity(),  # the torchrun job whose restarts may go on from it
            }
            if kind != "full":  # the bases it is saved on, by their manifests' digests
                manifest["bases"] = {name: _read_manifest(path.parent / name).get("manifest_sha256")
                                     for name in chain[:-1]}
            manifest["manifest_sha256"] = _manifest_digest(manifest)
            _remove_leftovers(path, set(files) | {f"rank{r}.json" for r in range(self.world_size)})
            write_atomic(path / MANIFEST, json.dumps(manifest, indent=1).encode())
            self._prune(step)
        self._barrier()
        total = self._embedding_bytes(path)
        if kind == "full":
            self.chain, self.full_bytes, self.increment_bytes = [checkpoint_name(step)], total, 0.0
        else:
            self.chain.append(checkpoint_name(step))
            self.increment_bytes += total
        self.last_saved_step, self.last_complete = step, path
        self.bytes_written.append({"step": step, "kind": kind, "embedding_bytes": total,
                                   "total_bytes": sum(f.stat().st_size for f in path.glob("*.pt"))})
        self._say(f"saved {kind} checkpoint {path} ({total:,} bytes of embeddings)")
        return path

    def _rank_metas(self, path: Path) -> List[dict]:
        """What every rank wrote at ``path``: its files, their pieces and its optimizer step."""
        return [json.loads((path / f"rank{r}.json").read_text()) for r in range(self.world_size)]

    def _embedding_bytes(self, path: Path) -> int:
        return sum(f["bytes"] for m in self._rank_metas(path) for f in m["files"])

    def _prune(self, step: int) -> None:
        """Rank 0: drop complete checkpoints beyond ``keep_last`` (not the ones a kept chain
        needs) and incomplete ones older than ``step``. Checkpoints after ``step`` are not this
        run's (``start`` refused complete ones; torn or corrupt ones wait to be overwritten):
        they are neither counted nor removed."""
        complete, keep = [], set()
        for path in self.root.iterdir():
            if path.is_dir() and _step_of(path) is not None and _step_of(path) <= step:
                try:
                    complete.append((_step_of(path), path, _read_manifest(path)))
                except ValueError:
                    if _step_of(path) < step:
                        shutil.rmtree(path, ignore_errors=True)
        complete.sort(key=lambda item: item[0], reverse=True)
        for _, _, manifest in complete[: self.cfg.keep_last]:
            keep.update(manifest["chain"])
        for _, path, _ in complete:
            if path.name not in keep:
                shutil.rmtree(path, ignore_errors=True)

    # ------------------------------------------------------------------------------ restore
    def restore(self, location: Path, found: Optional[Tuple[Path, dict]] = None) -> Position:
        """Load a checkpoint into the trainer and return its position: the newest complete one under
        ``location`` (a root; newer torn or corrupt ones are reported and skipped), or ``location``
        itself when it names one checkpoint (an error if that one is incomplete or corrupt).
        ``found``: (path, manifest) of the checkpoint to load, already verified (not again)."""
        location = Path(location)
        check_resume_location(location)
        named = _step_of(location) is not None or (location / MANIFEST).exists()  # one checkpoint, not a root
        self.restoring = (None, location)  # (its files are hashed first: minutes for a large one)
        if found is not None:
            path, manifest = found
        elif named:  # the user chose this step: use it or stop, never an older one in its place
            try:
                path, manifest = location, verify_checkpoint(location)
            except (ValueError, KeyError, TypeError, OSError) as exc:
                step = _step_of(location)
                older = (find_latest_complete(location.parent, out=io.StringIO(), max_step=step - 1)
                         if step is not None else None)
                hint = f"; the newest complete one before it is {older[0]} (--resume {older[0]})" if older else ""
                raise ValueError(f"--resume: {location} is incomplete or corrupt ({exc}){hint}") from None
        else:
            found = find_latest_complete(location, out=self.trainer.out if self.rank == 0 else io.StringIO())
            if found is None:
                raise ValueError(no_checkpoint_message(location))
            path, manifest = found
        trainer = self.trainer
        samples_in_epoch = check_resumable(manifest, path, trainer.cfg, trainer.source, self.world_size)
        self.restoring = (int(manifest["step"]), path)
        changed = _changed_optimizer_settings(manifest.get("config", {}), trainer.cfg.to_dict())
        if changed:
            self._say(f"resuming {path.name} with other optimizer settings than its run's, which apply from "
                      f"here: {', '.join(changed)}")
        changed = _changed_data_settings(manifest.get("config", {}), trainer.cfg.to_dict())
        if changed:
            self._say(f"resuming {path.name} with other data settings than its run's: {', '.join(changed)}; the "
                      f"samples from here are not the rest of its run's (some may be trained twice, others never)")
        global_batch = trainer.cfg.data.batch_size * self.world_size
        chain = []
        files = MappedFiles()
        for name, directory, part in _chain_parts(path, manifest):
            entries = [dict(e, file=f, checkpoint=str(directory)) for f, es in part["pieces"].items() for e in es]
            chain.append((entries, lambda entry: files.tensors(Path(entry["checkpoint"]) / entry["file"])))
        try:
            restore_pieces(self.pieces, chain)
        except ValueError as exc:  # (a row this run's precision cannot hold, a table not covered)
            raise ValueError(f"--resume {path}: {exc}") from None
        finally:
            files.close()
        same_layout = manifest["world_size"] == self.world_size and manifest["plan"] == (
            trainer.plan.to_dict() if trainer.plan is not None else None)
        modules = fused_modules(self.sparse_arch)
        stochastic = any(module._rounder.stochastic for _, module in modules)
        saved = load_tensors(path / f"rank{self.rank}.pt") if same_layout and stochastic else {}
        for name, module in modules:
            module.step.fill_(int(manifest["sparse_step"]))
            if module._rounder.stochastic:
                key = _rng_key(name, "rounding")
                if key in saved and module._rounder.set_state(saved[key]):
                    if module._replica_rounder is not None and _rng_key(name, "replica_rounding") in saved:
                        module._replica_rounder.set_state(saved[_rng_key(name, "replica_rounding")])
                else:
                    self._say("stochastic-rounding generators restart from their seed (another world size, plan, "
                              "table location or kind of device, or a checkpoint saved without stochastic rounding)")
        if self.cfg.incremental:
            for holder in holders(self.pieces):
                holder.track()  # clears the marks: the restored rows are the checkpoint's
        _load_dense_state(trainer, load_tensors(path / "dense.pt"), manifest["dense_optimizer"])
        trainer.step = int(manifest["step"])
        trainer.ancestor_runs = list(manifest.get("runs", [None]))  # (None: records written before runs had ids)
        self.resumed_from = self.last_complete = path
        self.restoring = None
        same_root = self.root is not None and path.parent.resolve() == self.root.resolve()
        parts = _chain_parts(path, manifest) if same_root else []
        self.chain = [directory.name for _, directory, _ in parts]  # increments continue this chain (by the
        self.increment_bytes = float(sum(part["bytes"]["embeddings"] for _, _, part in parts[1:]))  # folders' names)
        self.last_saved_step = trainer.step
        batch = samples_in_epoch // global_batch
        self._say(f"resumed from {path} ({manifest['kind']}, step {trainer.step}, epoch {manifest['epoch']}, "
                  f"batch {batch} of the epoch)")
        return Position(trainer.step, int(manifest["epoch"]), batch)


def _remove_leftovers(path: Path, keep: set) -> None:
    """Remove what an earlier try at this step left in its folder (all ranks have written theirs:
    called after the barrier): the temporary of a write killed before its rename, as large as the
    file, and rank files of another world size. They are in no manifest, and stayed as long as
    the checkpoint was kept."""
    for p in path.iterdir():
        if p.name not in keep and (_LEFTOVER.fullmatch(p.name) or TEMPORARY.fullmatch(p.name)):
            p.unlink(missing_ok=True)


_LEFTOVER = re.compile(r"rank\d+(-\d+)?\.(pt|json)")


def _rng_key(module: str, generator: str) -> str:
    """Name of a fused module's generator state in the rank file ("" = the main module)."""
    return f"rng.{module}.{generator}" if module else f"rng.{generator}"


def _unwrap(model):
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def _dense_state(trainer) -> Tuple[Dict[str, torch.Tensor], dict]:
    """Tensors of the dense weights (``model.<name>``), the dense optimizer state
    (``optimizer.<param>.<name>``) and the torch CPU generator; the optimizer's plain data as JSON."""
    model = _unwrap(trainer.model)
    tensors = {f"model.{k}": v for k, v in model.state_dict().items() if not k.startswith("sparse_arch.")}
    state = trainer.dense_optimizer.state_dict()
    scalars: Dict[str, Dict[str, object]] = {}
    for param, values in state["state"].items():
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer.{param}.{name}"] = value
            else:
                scalars.setdefault(str(param), {})[name] = value
    tensors["rng.torch"] = torch.get_rng_state()
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def _load_dense_state(trainer, tensors: Dict[str, torch.Tensor], optimizer_json: dict) -> None:
    model = _unwrap(trainer.model)
    weights = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    current = model.state_dict()
    differ = [f"{k} {list(v.shape)} in the checkpoint, {list(current[k].shape)} in the model"
              for k, v in weights.items() if k in current and current[k].shape != v.shape]
    if differ:
        raise ValueError(f"checkpoint dense weights do not fit the model ({'; '.join(differ[:3])}"
                         f"{'; ...' if len(differ) > 3 else ''}): model.dense_layers, model.over_layers, "
                         "model.interaction or the data's dense features differ from the checkpoint's run")
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.startswith("sparse_arch.")]
    if missing or unexpected:
        raise ValueError(f"checkpoint dense weights do not fit the model: missing {missing}, unexpected {unexpected}")
    state: Dict[int, Dict[str, object]] = {}
    for key, value in tensors.items():
        if key.startswith("optimizer."):
            _, param, name = key.split(".", 2)
            state.setdefault(int(param), {})[name] = value
    for param, values in optimizer_json["scalars"].items():
        state.setdefault(int(param), {}).update(values)
    optimizer = trainer.dense_optimizer
    configured = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    optimizer.load_state_dict({"state": state, "param_groups": optimizer_json["param_groups"]})
    for group, settings in zip(optimizer.param_groups, configured):
        group.update(settings)  # the config's learning rate, eps, weight decay: as for the sparse optimizer
    torch.set_rng_state(tensors["rng.torch"])
