"""``neorec train --nproc N``: start N local ranks of the same command and watch them.

    neorec train --config configs/tiny.toml --nproc 2

Each rank is ``python -m neorec <same arguments>`` with torchrun's environment (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK=0, MASTER_ADDR=127.0.0.1, a free MASTER_PORT); the other
variables torchrun sets (TORCHELASTIC_*, GROUP_WORLD_SIZE, ROLE_*), if the launcher's environment
holds any, are not passed on. When a rank exits with an error the others are stopped at once (they
would otherwise wait in a collective until its timeout), the ranks' error lines are said, each
distinct one once with the ranks that said it (``error_file``), and its exit code is returned (128 + N for
a rank killed by signal N, e.g. 137 for SIGKILL, and the message names the signal). Ctrl-C,
SIGTERM or SIGHUP to the launcher (what ``timeout``, a batch scheduler or ``docker stop`` send)
stop them all (each rank runs in a session of its own, so a terminal's Ctrl-C reaches the
launcher alone); on Linux a rank also receives SIGTERM when the launcher dies without a chance to
clean up (SIGKILL), so no rank outlives it. For several nodes use torchrun.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from neorec.signals import check_terminated, signals_held, terminate_raises

_POLL_SECONDS = 0.1
_STOP_SECONDS = 5.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# what torchrun (its elastic agent) sets for its workers: left over in our environment (neorec run
# from inside a torchrun worker, a job script that exported them) they would describe another job,
# e.g. TORCHELASTIC_RESTART_COUNT + TORCHELASTIC_USE_AGENT_STORE make a rank wait for a store that
# no one serves; ``rank_environment`` drops them and sets its own
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
TORCHRUN_PREFIXES = ("TORCHELASTIC_",)  # RESTART_COUNT, MAX_RESTARTS, RUN_ID, USE_AGENT_STORE, ERROR_FILE, ...


def rank_environment(rank: int, nproc: int, port: int, base: Optional[dict] = None) -> dict:
    """The environment of local rank ``rank`` of ``nproc``: ``base`` (default ``os.environ``)
    without torchrun's variables, plus the launcher's RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, GROUP_RANK=0, MASTER_ADDR, MASTER_PORT."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if k not in TORCHRUN_VARIABLES and not k.startswith(TORCHRUN_PREFIXES)}
    env.update(RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nproc),
               GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return env


def _stop(processes: List[subprocess.Popen]) -> None:
    """Stop and reap every rank (SIGTERM, SIGKILL after ``_STOP_SECONDS``). A second Ctrl-C or
    SIGTERM meanwhile is held until it is done: raised inside, it left ranks running (they trained
    and saved on, and pruned the checkpoint the launcher's message named)."""
    with signals_held():
        _terminate_and_reap(processes)


def _terminate_and_reap(processes: List[subprocess.Popen]) -> None:
    for p in processes:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + _STOP_SECONDS
    for p in processes:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


LAUNCHER_ENV = "NEOREC_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1


def started_by_a_launcher(environ: Optional[dict] = None) -> bool:
    """True in a rank that ``launch_local`` or torchrun started (their own variables are set), False
    where RANK and WORLD_SIZE are only left over in a shell's environment."""
    environ = os.environ if environ is None else environ
    return LAUNCHER_ENV in environ or "TORCHELASTIC_RUN_ID" in environ


def die_with_launcher() -> None:
    """Called first thing by a rank that ``launch_local`` started (``LAUNCHER_ENV`` is set): on
    Linux, have the kernel send this process SIGTERM when the launcher dies. Elsewhere a no-op."""
    launcher = os.environ.get(LAUNCHER_ENV)
    if not launcher or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != int(launcher):  # the launcher died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def _how_it_ended(returncode: int) -> str:
    """'exited with code 3' or, for a rank killed by a signal (``Popen.returncode`` -N), 'was
    killed by SIGKILL'."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"was killed by {name}"


def launch_local(nproc: int, argv: Sequence[str], module: str = "neorec") -> int:
    """Run ``python -m <module> *argv`` as ``nproc`` ranks; 0 when all succeed, else the exit code
    of the first rank that failed (128 + N when it was killed by signal N, as a shell reports it).
    SIGTERM / SIGHUP stop every rank and raise ``Terminated``."""
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    port = free_port()
    with terminate_raises():
        return _start_and_watch(nproc, argv, module, port)


ERRORS_ENV = "NEOREC_RANK_ERRORS"


def error_file(relayed: bool = False) -> Optional[Path]:
    """In a rank that ``launch_local`` started: the file its error line goes to (the launcher says
    each distinct line once, naming the ranks that said it; ``relayed``: a line that relays another
    rank's error, said only when no rank's own line is); None elsewhere."""
    folder = os.environ.get(ERRORS_ENV)
    if not folder or LAUNCHER_ENV not in os.environ:
        return None
    return Path(folder) / f"rank{os.environ.get('RANK', '0')}{'.relayed' if relayed else ''}"


def _say_rank_errors(folder: Path, nproc: int, first: int = 0) -> None:
    """Each distinct error line of the ranks (``error_file``) once, with the ranks that said it: N
    ranks refusing the same input said it N times. Lines relaying another rank's error only when
    that rank's own line is missing (stopped before it said it). The line of rank ``first`` (the
    rank that failed first) comes first."""
    said: dict = {}
    for suffix in ("", ".relayed"):
        for rank in range(nproc):
            try:
                line = (folder / f"rank{rank}{suffix}").read_text().rstrip("\n")
            except OSError:
                continue
            if line:
                said.setdefault(line, []).append(rank)
        if said:
            break
    for line, ranks in sorted(said.items(), key=lambda item: first not in item[1]):
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        print(line.replace("{RANKS}", who), file=sys.stderr, flush=True)


def _first_failure(failed: List[Tuple[int, int]], folder: Path) -> Tuple[int, int]:
    """The (rank, exit code) to name among the ranks seen ended at one poll: one that said an error
    of its own, else the lowest. A rank whose collective failed because another rank ended exits a
    few ms after it, mostly seen at the same poll: the lowest was named, with its exit code 1 for
    the other's 2."""
    for rank, code in failed:
        try:
            if (folder / f"rank{rank}").read_text().strip():
                return rank, code
        except OSError:
            continue
    return failed[0]


def _start_and_watch(nproc: int, argv: Sequence[str], module: str, port: int) -> int:
    processes: List[subprocess.Popen] = []
    errors = Path(tempfile.mkdtemp(prefix="neorec-rank-errors-"))
    try:
        for rank in range(nproc):
            env = rank_environment(rank, nproc, port)
            env[LAUNCHER_ENV] = str(os.getpid())
            env[ERRORS_ENV] = str(errors)
            # a session of its own: a terminal's Ctrl-C (sent to its foreground group) reaches the launcher
            # alone, which stops the ranks (they printed tracebacks or "interrupted" beside it); and with no
            # controlling terminal a rank is never stopped for writing to it (`stty tostop`: SIGTTOU, as a
            # background group of the terminal's session, stopped rank 0 and the run hung)
            processes.append(subprocess.Popen([sys.executable, "-m", module, *argv], env=env,
                                              start_new_session=True))
        while True:
            codes = [p.poll() for p in processes]
            failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                rank, code = _first_failure(failed, errors)
                _stop(processes)
                _say_rank_errors(errors, nproc, first=rank)
                print(f"neorec: rank {rank} of {nproc} {_how_it_ended(code)}; stopped the other ranks",
                      file=sys.stderr, flush=True)
                return code if code > 0 else 128 - code  # killed by signal N: 128 + N, as a shell says
            if all(code == 0 for code in codes):
                return 0
            check_terminated()  # (a stop whose exception was lost)
            time.sleep(_POLL_SECONDS)
    finally:  # (also on Ctrl-C, SIGTERM, SIGHUP: every rank is stopped)
        _stop(processes)
        shutil.rmtree(errors, ignore_errors=True)
