"""Checkpoints on disk: their manifests, verification (``verify_checkpoint``), finding the
newest complete one (``find_latest_complete``), where a run resumes from (``choose_resume``) and
whether a checkpoint can go on as a given run (``check_resumable``; ``check_resume_before_launch``
for the ``--nproc`` launcher). Writing and restoring them: ``neorec/train/checkpoint.py``."""

from __future__ import annotations

import hashlib
import io
import json
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from neorec.train.checkpoint_config import CheckpointConfig
from neorec.train.checkpoint_files import sha256_file

FORMAT = "neorec-checkpoint-1"
MANIFEST = "manifest.json"


def checkpoint_name(step: int) -> str:
    return f"step-{step:09d}"


def _step_of(path: Path) -> Optional[int]:
    name = path.name
    if name.startswith("step-") and name[5:].isdigit():
        return int(name[5:])
    return None


MANIFEST_KEYS = ("step", "kind", "chain", "epoch", "batch_in_epoch", "global_batch_size", "world_size", "row_bits",
                 "plan", "tables", "sparse_optimizer", "sparse_step", "pieces", "dense_optimizer", "files")


def _manifest_digest(manifest: dict) -> str:
    """sha256 of the manifest's content (without its own digest), in a canonical JSON form."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _read_manifest(path: Path) -> dict:
    file = path / MANIFEST
    if not file.is_file():
        raise ValueError("no manifest.json (the checkpoint was not completed)")
    try:
        manifest = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"manifest.json is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"manifest.json is not a {FORMAT} manifest")
    if "manifest_sha256" in manifest and manifest["manifest_sha256"] != _manifest_digest(manifest):
        raise ValueError("manifest.json fails its sha256 checksum (corrupt)")  # (older manifests have none)
    missing = [key for key in MANIFEST_KEYS if key not in manifest]
    if missing or not isinstance(manifest["chain"], list) or not manifest["chain"]:
        raise ValueError(f"manifest.json lacks {', '.join(missing) or 'a chain'} (corrupt)")
    return manifest


def _chain_parts(path: Path, manifest: dict) -> List[Tuple[str, Path, dict]]:
    """(name, folder, manifest) of every checkpoint of ``path``'s chain, base first: the last is
    ``path`` itself whatever its folder is called, the bases are found by name beside it and must
    be the checkpoints it was saved on (the sha256 of their manifests, when it recorded them)."""
    parts = []
    bases = manifest.get("bases", {})
    for name in manifest["chain"][:-1]:
        directory = path.parent / name
        if not directory.is_dir():  # (an increment copied alone: "not completed" misled)
            raise ValueError(f"its base checkpoint {name} is not beside it ({directory} does not exist); an "
                             f"incremental checkpoint needs the checkpoints it builds on ({', '.join(manifest['chain'][:-1])}) "
                             f"in the same folder")
        try:
            part = _read_manifest(directory)
        except ValueError as exc:
            raise ValueError(f"its base checkpoint {name}: {exc}") from None
        if name in bases and bases[name] != part.get("manifest_sha256"):
            raise ValueError(f"its base checkpoint {directory} is not the one it was saved on (another run's, or "
                             f"saved again since); an incremental checkpoint needs its own bases beside it")
        parts.append((name, directory, part))
    parts.append((manifest["chain"][-1], path, manifest))
    return parts


def verify_checkpoint(path: Path, checksums: bool = True) -> dict:
    """The manifest of the checkpoint at ``path`` after checking it and every checkpoint of its
    chain (every file present, same size, same sha256: ``checksums=False`` skips the hashing, for
    a quick look); ValueError saying what is wrong."""
    path = Path(path)
    manifest = _read_manifest(path)
    for name, directory, part in _chain_parts(path, manifest):
        for file, info in part["files"].items():
            target = directory / file
            if not target.is_file():
                raise ValueError(f"{name}/{file} is missing")
            if target.stat().st_size != info["bytes"]:
                raise ValueError(f"{name}/{file} has {target.stat().st_size} bytes, the manifest says "
                                 f"{info['bytes']} (truncated or torn)")
            if checksums and sha256_file(target) != info["sha256"]:
                raise ValueError(f"{name}/{file} fails its sha256 checksum (corrupt)")
    return manifest


def _newest_first(root: Path) -> List[Path]:
    """The ``step-N`` folders under ``root``, newest first (none when ``root`` is no folder)."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and _step_of(p) is not None), key=_step_of, reverse=True)


def find_latest_complete(root: Path, out=None, max_step: Optional[int] = None) -> Optional[Tuple[Path, dict]]:
    """(path, manifest) of the newest complete checkpoint under ``root`` (at most ``max_step``);
    every newer incomplete or corrupt one is reported on ``out`` and skipped. None if none."""
    out = out if out is not None else sys.stderr
    for path in _newest_first(Path(root)):
        if max_step is not None and _step_of(path) > max_step:
            continue
        try:
            return path, verify_checkpoint(path)
        except (ValueError, KeyError, TypeError, OSError) as exc:
            print(f"checkpoint: {path} is incomplete or corrupt ({exc}); using the previous complete one",
                  file=out, flush=True)
    return None


def newest_saved_step(root: Path) -> Optional[int]:
    """The step of the newest checkpoint under ``root`` whose manifest was written (no checksums
    read: cheap, for messages; ``--resume`` verifies and falls back to an older one if needed)."""
    root = Path(root)
    steps = [_step_of(p) for p in root.iterdir() if (p / MANIFEST).is_file()] if root.is_dir() else []
    steps = [step for step in steps if step is not None]
    return max(steps) if steps else None


UNKNOWN_JOB = "torchrun"  # a torchrun job that cannot name itself (see ``job_identity``)


def job_identity() -> Optional[str]:
    """What the workers of one torchrun job share across its restarts and no other job has: its
    rendezvous id (``--rdzv-id``; ``--standalone`` draws one), or, with the default id "none" on
    one node, its agent process (the workers' parent: pid and start time). None outside torchrun;
    ``UNKNOWN_JOB`` for a multi-node job with the default id (its nodes' agents differ)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is None:
        return None
    if run_id and run_id != "none":
        return f"rdzv:{run_id}"
    if os.environ.get("LOCAL_WORLD_SIZE") != os.environ.get("WORLD_SIZE"):
        return UNKNOWN_JOB
    agent = os.getppid()
    try:  # field 22, the start time: a pid alone may be reused
        start = Path(f"/proc/{agent}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return UNKNOWN_JOB
    return f"agent:{socket.gethostname()}:{agent}:{start}"


def saved_by_this_job(manifest: dict, job: Optional[str]) -> bool:
    """Whether a restart of torchrun job ``job`` may go on from the checkpoint of ``manifest``:
    one its job saved, or, where either job cannot name itself (``UNKNOWN_JOB``: a multi-node job
    with the default rendezvous id, which may since have shrunk to one node), any checkpoint a
    torchrun job saved. Not one of a run outside torchrun (its manifest's job is None)."""
    saved = manifest.get("job")
    if job in (None, UNKNOWN_JOB):
        return True
    return saved == job or saved == UNKNOWN_JOB


@dataclass
class ResumeChoice:
    """Where a run resumes from (``choose_resume``): ``location`` (None: it starts fresh), the
    checkpoint already found and verified there (``found``: path, manifest), and what to say."""

    location: Optional[str] = None
    found: Optional[Tuple[Path, dict]] = None
    said: str = ""


def choose_resume(cfg: CheckpointConfig, resume: Optional[str]) -> ResumeChoice:
    """``resume``, or, for a worker restarted by torchrun with ``auto_resume``, the newest complete
    checkpoint of ``checkpoint.dir`` (where this run saved before the restart; ``resume`` only when
    it holds none). Only one this job saved (its manifest's ``job``, ``job_identity``): a first
    attempt refused beside another run's checkpoints, or rewinding past its own, made torchrun
    restart it, and the restart went on from those. Decided before the model is built: a run that
    resumes draws no initial rows."""
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    root = Path(cfg.dir) if cfg.dir else None
    if not (cfg.auto_resume and restarted and root is not None):
        return ResumeChoice(resume)
    skipped = io.StringIO()  # newer torn or corrupt checkpoints, said by the trainer's rank 0
    found = find_latest_complete(root, out=skipped)
    job = job_identity()
    if found is not None and not saved_by_this_job(found[1], job):
        # another job's: the first attempt refused them (or resumed --resume); a restart does the same
        return ResumeChoice(resume, None, f"checkpoint: restarted by torchrun, but the newest checkpoint in {root} "
                                          f"({found[0].name}) was not saved by this job: not resuming it\n")
    if found is not None:
        said = skipped.getvalue()
        if resume is not None and Path(resume).resolve() != root.resolve():
            said += (f"checkpoint: restarted by torchrun: resuming from {root}, where this run saved, "
                     f"not from --resume {resume}\n")
        return ResumeChoice(str(root), found, said)
    if resume is None:
        return ResumeChoice(None, None, f"checkpoint: restarted by torchrun, but {root} holds no complete "
                                        f"checkpoint: starting fresh\n")
    return ResumeChoice(resume)


def _table_shapes(cfg, source) -> Dict[str, List[int]]:
    tables = source.tables(cfg.model.embedding_dim, cfg.model.pooling)
    return {t.name: [t.num_embeddings, t.embedding_dim] for t in tables}


def _changed_optimizer_settings(saved: dict, current: dict) -> List[str]:
    """``key old -> new`` for each optimizer setting of the config that differs from the checkpoint's."""
    changed = []
    for section in ("embedding.optimizer", "dense_optimizer"):
        old, new = saved, current
        for part in section.split("."):
            old, new = old.get(part, {}), new.get(part, {})
        changed += [f"{section}.{key} {old[key]!r} -> {new[key]!r}" for key in sorted(new)
                    if key in old and old[key] != new[key]]
    return changed


# data settings that leave the training samples as they are: the preprocessing's own, and the eval set's
_STREAM_NEUTRAL = ("chunk_lines", "processed_dir", "num_eval_samples")


def _flat(settings: dict, prefix: str) -> Dict[str, object]:
    out: Dict[str, object] = {}
    for key, value in settings.items():
        out.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def _changed_data_settings(saved: dict, current: dict) -> List[str]:
    """``key old -> new`` for each setting of the config's data source that differs from the
    checkpoint's (its seed, sizes, files, shuffling: what its stream of samples is made of)."""
    old, new = saved.get("data"), current.get("data", {})
    if not old:
        return []
    source = new.get("source")
    if old.get("source") != source:
        return [f"data.source {old.get('source')!r} -> {source!r}"]
    old, new = _flat(old.get(source, {}), f"data.{source}."), _flat(new.get(source, {}), f"data.{source}.")

    def same(key: str) -> bool:
        name, before, after = key.rsplit(".", 1)[1], old[key], new[key]
        if name.endswith("path") and isinstance(before, str) and isinstance(after, str):
            if name == "eval_path" and before and after:
                return True  # another eval file: the training samples are the same
            return before == after or bool(before and after) and \
                os.path.realpath(os.path.expanduser(before)) == os.path.realpath(os.path.expanduser(after))
        return before == after or name in _STREAM_NEUTRAL

    return [f"{key} {old[key]!r} -> {new[key]!r}" for key in sorted(new) if key in old and not same(key)]


def _changed_model_settings(saved: dict, model) -> List[str]:
    """``model.key checkpoint -> config`` for each setting of the model that differs from the
    checkpoint's (``saved``: its config's [model]; keys it lacks are not compared), leaving out the
    settings of DCN when the checkpoint used "dot" (``dcn_*``). Compared as JSON has them (a list
    of layer sizes given as a tuple is the same list)."""
    unused = ("dcn_num_layers", "dcn_low_rank") if saved.get("interaction", model.interaction) == "dot" else ()
    out = []
    for key, value in vars(model).items():
        value = json.loads(json.dumps(value))
        if key in saved and key not in unused and saved[key] != value:
            out.append(f"model.{key} {saved[key]!r} -> {value!r}")
    return out


def _check_compatible(manifest: dict, cfg, source, path: Path) -> None:
    saved, current = manifest["tables"], _table_shapes(cfg, source)
    if saved != current:
        diff = sorted(n for n in set(saved) | set(current) if saved.get(n) != current.get(n))
        raise ValueError(f"resume from {path}: the model's tables differ from the checkpoint's: {diff} "
                         f"(checkpoint {[saved.get(n) for n in diff]}, model {[current.get(n) for n in diff]})")
    if manifest["sparse_optimizer"] != cfg.embedding.optimizer.kind:
        raise ValueError(f"resume from {path}: checkpoint has sparse optimizer {manifest['sparse_optimizer']!r}, "
                         f"the config {cfg.embedding.optimizer.kind!r} (set embedding.optimizer.kind = "
                         f"{manifest['sparse_optimizer']!r})")
    changed = _changed_model_settings(manifest.get("config", {}).get("model", {}), cfg.model)
    if changed:  # (pooling, the interaction: another model with the same weight shapes, or shapes said plainly)
        raise ValueError(f"resume from {path}: the checkpoint's model differs from the config's: "
                         f"{'; '.join(changed)} (set them as the checkpoint has them)")
    saved_dense = manifest.get("config", {}).get("dense_optimizer", {}).get("kind")
    if saved_dense is not None and saved_dense != cfg.dense_optimizer.kind:
        raise ValueError(f"resume from {path}: checkpoint has dense optimizer {saved_dense!r}, the config "
                         f"{cfg.dense_optimizer.kind!r} (set dense_optimizer.kind = {saved_dense!r})")


def check_resumable(manifest: dict, path: Path, cfg, source, world_size: int) -> int:
    """ValueError if the checkpoint ``manifest`` (of ``path``) cannot go on as a run of ``cfg`` on
    ``source`` with ``world_size`` ranks: other tables, optimizers or pooling, or an epoch position
    the new global batches cannot continue. Returns the samples of its epoch that are done."""
    _check_compatible(manifest, cfg, source, path)
    global_batch = cfg.data.batch_size * world_size
    epoch_samples = source.num_train_samples()
    samples_in_epoch = manifest["batch_in_epoch"] * manifest["global_batch_size"]
    if samples_in_epoch >= epoch_samples:  # its last batch may have been short: any batch continues
        samples_in_epoch = -(-epoch_samples // global_batch) * global_batch  # the new batches' whole epoch
    if samples_in_epoch % global_batch:
        fits = [b for b in range(1, 2 * cfg.data.batch_size + 1) if samples_in_epoch % (b * world_size) == 0]
        hint = (f"; e.g. data.batch_size={min(fits, key=lambda b: abs(b - cfg.data.batch_size))} on "
                f"{world_size} rank(s) continues it") if fits else ""
        raise ValueError(f"resume from {path}: {samples_in_epoch} samples of epoch {manifest['epoch']} were "
                         f"trained with global batches of {manifest['global_batch_size']}; that is not a whole "
                         f"number of the new global batches of {global_batch} (data.batch_size x ranks){hint}")
    return samples_in_epoch


def check_resume_location(location: Path) -> None:
    """ValueError when ``--resume location`` cannot name a checkpoint, found without reading one:
    it does not exist, is a file, or is a folder with neither a manifest nor step-N folders. Said
    before a model is built (minutes for a large one) and before ``--nproc`` starts its ranks."""
    location = Path(location)
    if not location.exists():
        raise ValueError(f"--resume: {location} does not exist")
    if not location.is_dir():
        raise ValueError(f"--resume: {location} is a file; give a checkpoint folder (checkpoint.dir, or one "
                         f"step-N folder in it)")
    if _step_of(location) is None and not (location / MANIFEST).exists() and not _newest_first(location):
        raise ValueError(no_checkpoint_message(location))


def check_resume_before_launch(location: Path, cfg, source, world_size: int) -> None:
    """What every rank of a ``--nproc`` run would refuse alike about ``--resume location``, said
    once by the launcher (``check_resumable`` on the checkpoint the ranks will take). Checks files'
    presence and sizes, not their checksums (the ranks verify those, and say it if a checkpoint is
    corrupt): a torn newest checkpoint is skipped here as the ranks skip it (it was checked in
    their place, and its refusal's hint led to a batch size the ranks then refused)."""
    location = Path(location)
    check_resume_location(location)
    named = _step_of(location) is not None or (location / MANIFEST).exists()
    for path in [location] if named else _newest_first(location):
        try:
            manifest = verify_checkpoint(path, checksums=False)
        except (ValueError, KeyError, TypeError, OSError):
            continue  # torn or corrupt: the ranks report it and take an older one (or stop)
        check_resumable(manifest, path, cfg, source, world_size)
        return
    if not named:  # every rank would stop on it
        raise ValueError(no_checkpoint_message(location))


def no_checkpoint_message(root: Path) -> str:
    """Why ``--resume root`` finds nothing to load, and what to do."""
    if _newest_first(Path(root)):
        return f"--resume: no complete checkpoint in {root} (each of its step-N folders is incomplete or corrupt)"
    return (f"--resume: no complete checkpoint in {root}: it holds no step-N folders (checkpoints are saved only "
            f"with checkpoint.dir set: --set checkpoint.dir='\"DIR\"' --set checkpoint.every_steps=N, then "
            f"--resume DIR)")
