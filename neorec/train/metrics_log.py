"""``metrics.jsonl``: the trainer's JSON-lines log of train, eval, final and error records, kept
across resumes (records of the runs a checkpoint descends from) and strict JSON: a value that is
not finite is written as null and named, with what it was, in the record's ``non_finite``
(``{"ne": "inf"}``: a confident wrong prediction, against ``"nan"``: undefined)."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, TextIO

from neorec.files import write_atomic


class MetricsLog:
    """Append-only JSON-lines file; each record is flushed as it is written, with ``run`` (the id of
    the run, one process's training from its start or resume to its end) added.

    A new run starts the file afresh (``replaced`` says whether it held records). ``continue_after_step``
    (a run resumed at that step) keeps the existing file's records of ``keep_runs`` (the runs the
    resumed checkpoint descends from; None: records without an id, written before runs had ids;
    another run's records are dropped, and ``replaced`` says so) up to that step
    and appends after them: the records a crashed run wrote past its last checkpoint are dropped,
    since those steps are trained again, and the ``final`` record of a run that ended there becomes
    the ``eval`` record it is (in ``epoch``: the epoch of that step); the resumed run writes its own
    ``final``."""

    def __init__(self, path: Optional[Path], continue_after_step: Optional[int] = None, epoch: int = 0,
                 run: Optional[str] = None, keep_runs: Sequence[Optional[str]] = (None,)) -> None:
        self.path, self.run = path, run
        self._file: Optional[TextIO] = None
        self.replaced = False
        self.kept = 0  # records of the resumed checkpoint's runs kept (continue_after_step)
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if continue_after_step is not None and path.exists():
            for line in path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # a line torn by the crash
                    continue
                if not isinstance(record, dict):
                    continue
                if record.get("run") not in keep_runs:  # another run's log in this folder
                    self.replaced = True
                    continue
                if isinstance(record.get("step"), int) and record["step"] <= continue_after_step:
                    if record.get("kind") == "final":
                        if "auc" not in record:  # the run had no eval set
                            continue
                        for key in ("samples", "train_seconds", "qps", "first_step", "cache"):
                            record.pop(key, None)
                        line = json.dumps(dict(record, kind="eval", epoch=epoch), sort_keys=True)
                    kept.append(line + "\n")
            write_atomic(path, "".join(kept))
            self.kept = len(kept)
        else:
            self.replaced = path.is_file() and path.stat().st_size > 0
        self._file = path.open("a" if kept else "w")

    def write(self, record: Dict[str, Any]) -> None:
        if self._file is not None:
            clean = dict(record)
            non_finite = {k: str(v) for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)}
            if non_finite:  # strict JSON has no NaN or inf: null, and what it was ("nan", "inf", "-inf")
                clean.update(dict.fromkeys(non_finite), non_finite=non_finite)
            if self.run is not None:
                clean["run"] = self.run
            try:
                self._file.write(json.dumps(clean, sort_keys=True, allow_nan=False) + "\n")
                self._file.flush()
            except OSError as exc:  # a full disk: name the file; the log is not written again
                file, self._file = self._file, None
                with contextlib.suppress(OSError):
                    file.close()
                raise OSError(exc.errno, f"{exc.strerror} (writing the metrics log)", file.name) from None

    def close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            file.close()
