"""Launching: ``neorec train --nproc 2`` end to end, errors in the ranks reported without a hang,
and two torchrun agents on loopback acting as two nodes (c10d rendezvous).

    python -m pytest tests/distributed/test_launch.py -q
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from neorec.train.launch import free_port, launch_local

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.toml")
SMALL = ["--set", "data.synthetic.num_train_samples=3000", "--set", "data.synthetic.num_eval_samples=1000",
         "--set", "data.batch_size=128", "--no-progress"]
TIMEOUT = 150


def neorec(*args, timeout=TIMEOUT):
    return subprocess.run([sys.executable, "-m", "neorec", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_nproc_2_end_to_end(tmp_path):
    run = neorec("train", "--config", TINY, "--nproc", "2", "--max-steps", "6", "--output-dir", str(tmp_path), *SMALL)
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("final eval: AUC") == 1  # rank 0 alone prints
    assert "distributed: 2 ranks (gloo), local batch 128, global batch 256" in run.stdout
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    final = records[-1]
    assert final["kind"] == "final" and final["step"] == 6 and final["samples"] == 6 * 256
    assert final["num_samples"] == 1000 and 0.0 <= final["auc"] <= 1.0


def test_nproc_errors_are_reported(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"world_size": 3, "tables": {}}))
    run = neorec("train", "--config", TINY, "--nproc", "2", "--plan", str(plan), *SMALL)
    assert run.returncode == 2
    # said once, by the launcher before it starts any rank (each rank used to say it, "(rank N)")
    assert "written for world_size 3" in run.stderr and run.stderr.count("\n") == 1 and "(rank " not in run.stderr
    run = neorec("train", "--config", TINY, "--plan", str(plan), *SMALL)
    assert run.returncode == 2 and "--plan needs several processes" in run.stderr


def test_failing_rank_stops_the_others(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    start = time.monotonic()
    assert launch_local(2, [], module="fail_rank") == 3
    assert time.monotonic() - start < 60


def test_an_error_the_ranks_share_is_said_once_naming_them(tmp_path, monkeypatch, capsys):
    """Every rank refusing the same input said it: N lines for N ranks. A rank relaying rank 0's
    error (rank 2 here) says nothing of its own."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), str(ROOT),
                                                      os.environ.get("PYTHONPATH", "")]))
    assert launch_local(3, [], module="same_error_rank") == 2
    err = capsys.readouterr().err
    assert err.startswith("neorec train (ranks 0, 1): error: the same for all\n"), err
    assert err.count("the same for all") == 1 and "(rank 2)" not in err, err


def test_a_relayed_error_is_said_when_the_rank_it_relays_was_stopped_before_saying_it(monkeypatch, capsys):
    """The relaying rank said nothing: when it exited first, the launcher stopped rank 0 before its
    line, and the user saw only "rank 1 of 2 exited with code 2"."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), str(ROOT),
                                                      os.environ.get("PYTHONPATH", "")]))
    assert launch_local(2, [], module="relay_rank") == 2
    err = capsys.readouterr().err
    assert err.startswith("neorec train (rank 1): error: rank 0 could not plan: the table does not fit\n"), err


@pytest.mark.parametrize("mode", ["peer", "other", "race"])
def test_the_rank_that_failed_first_is_said_first_and_a_peer_gone_error_only_as_a_relay(mode, monkeypatch, capsys):
    """Rank 1 failed on a bad id; rank 0's collective then failed with gloo's "Connection closed by
    peer", said first, as "unexpected", above rank 1's real reason ("race": rank 0 exits 20 ms after
    rank 1, mostly seen at the same poll: the launcher named rank 0 and returned its exit code 1)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), str(ROOT),
                                                      os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("PEER_ERROR_MODE", mode)
    assert launch_local(2, [], module="peer_error_rank") == 2
    err = capsys.readouterr().err
    assert err.startswith("neorec train (rank 1): error: feature 'f' (table 't'): id 1000 is outside"), err
    assert ("Connection closed by peer" in err) is False and ("a slow disk" in err) is (mode == "other"), err
    assert err.rstrip("\n").endswith("neorec: rank 1 of 2 exited with code 2; stopped the other ranks"), err


def test_a_real_refusal_in_every_rank_is_said_once_and_leaves_no_folder(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    out = tmp_path / "new" / "out"
    run = neorec("train", "--config", TINY, "--nproc", "2", "--output-dir", str(out),
                 "--set", f"checkpoint.dir='{blocker}'", "--set", "checkpoint.every_steps=1", *SMALL)
    assert run.returncode == 2
    assert run.stderr.count(f"error: checkpoint.dir '{blocker}' is a file, not a directory") == 1, run.stderr
    assert not (tmp_path / "new").exists()


KILLED_RANK = """import os, signal, time
if os.environ["RANK"] == "1":
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(300)
"""


@pytest.mark.skipif(sys.platform.startswith("win"), reason="POSIX signals")
def test_a_rank_killed_by_a_signal_gives_128_plus_the_signal(tmp_path, monkeypatch, capsys):
    """`kill -9` of a rank: the launcher returns 137 (was 1) and names the signal."""
    (tmp_path / "killed_rank.py").write_text(KILLED_RANK)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    start = time.monotonic()
    assert launch_local(2, [], module="killed_rank") == 128 + signal.SIGKILL
    assert "neorec: rank 1 of 2 was killed by SIGKILL; stopped the other ranks" in capsys.readouterr().err
    assert time.monotonic() - start < 60


def _parent_if_alive(pid: int):
    """The parent pid of ``pid`` while it runs (not a zombie), else None."""
    try:
        state, parent = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:2]
    except OSError:
        return None
    return None if state in "ZX" else int(parent)


def _alive(pid: int) -> bool:
    return _parent_if_alive(pid) is not None


def _children(pid: int) -> list:
    """Live (not zombie) processes whose parent is ``pid``."""
    return [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit() and _parent_if_alive(int(e.name)) == pid]


def _wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def _kill_all(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _start_launcher(code: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL])
def test_no_rank_outlives_a_stopped_or_killed_launcher(signum):
    launcher = _start_launcher("import sys\nfrom neorec.signals import Terminated\nfrom neorec.train.launch import launch_local\n"
                               "try:\n    launch_local(2, [], module='sleep_rank')\n"
                               "except Terminated as exc:\n    print('terminated', exc); sys.exit(128 + exc.signum)")
    ranks = []
    try:
        assert _wait_for(lambda: len(_children(launcher.pid)) == 2, 60)
        ranks = _children(launcher.pid)
        time.sleep(1.0)  # let the ranks reach die_with_launcher (a rank started later checks its parent)
        os.kill(launcher.pid, signum)
        out, _ = launcher.communicate(timeout=30)
        if signum != signal.SIGKILL:
            assert launcher.returncode == 128 + signum and "terminated" in out
        assert _wait_for(lambda: not any(_alive(pid) for pid in ranks), 15), "a rank outlived its launcher"
    finally:
        _kill_all([launcher.pid, *ranks])
        launcher.wait()


SECOND_SIGNAL_LAUNCHER = """import glob, os, sys
from neorec.signals import Terminated
from neorec.train.launch import launch_local
def running_children():
    found = 0
    for stat in glob.glob('/proc/[0-9]*/stat'):
        try:
            fields = open(stat).read().rsplit(')', 1)[1].split()
        except OSError:
            continue
        found += int(fields[1]) == os.getpid() and fields[0] != 'Z'
    return found
try:
    launch_local(2, [], module='stubborn_rank')
except (Terminated, KeyboardInterrupt) as exc:
    print('stopped by', type(exc).__name__, 'running children', running_children(), flush=True)
    sys.exit(3)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_while_the_launcher_stops_its_ranks_waits_until_they_are_stopped(second, tmp_path,
                                                                                        monkeypatch):
    """A second SIGTERM or Ctrl-C while the launcher stopped its ranks was raised inside the stopping:
    the ranks ran on (they trained, saved and pruned the checkpoint the launcher's message named)."""
    monkeypatch.setenv("STUBBORN_READY_DIR", str(tmp_path))
    launcher = _start_launcher(SECOND_SIGNAL_LAUNCHER)
    ranks = []
    try:
        assert _wait_for(lambda: len(_children(launcher.pid)) == 2, 60)
        ranks = _children(launcher.pid)
        assert _wait_for(lambda: len(list(tmp_path.iterdir())) == 2, 60)  # both ignore SIGTERM now
        os.kill(launcher.pid, signal.SIGTERM)  # the launcher SIGKILLs them after its grace period (5 s)
        time.sleep(1.0)
        os.kill(launcher.pid, second)
        out, err = launcher.communicate(timeout=60)
        assert launcher.returncode == 3 and "running children 0" in out, (out, err)
        assert f"stopped by {'Terminated' if second == signal.SIGTERM else 'KeyboardInterrupt'}" in out, out
    finally:
        _kill_all([launcher.pid, *ranks])
        launcher.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_is_answered_by_the_launcher_alone():
    """Ctrl-C in a terminal signals the whole process group: each rank printed its own
    KeyboardInterrupt (a traceback while starting, 'interrupted' lines mixed into the launcher's)."""
    launcher = subprocess.Popen(
        [sys.executable, "-c", "import sys\nfrom neorec.train.launch import launch_local\n"
         "try:\n    launch_local(2, [], module='sleep_rank')\n"
         "except KeyboardInterrupt:\n    print('launcher interrupted', file=sys.stderr); sys.exit(130)"],
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent),
                                                         os.environ.get("PYTHONPATH", "")])),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    ranks = []
    try:
        assert _wait_for(lambda: len(_children(launcher.pid)) == 2, 60)
        ranks = _children(launcher.pid)
        time.sleep(1.0)  # the ranks are importing or sleeping
        os.killpg(launcher.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        _, err = launcher.communicate(timeout=30)
        assert launcher.returncode == 130 and err == "launcher interrupted\n", err
        assert _wait_for(lambda: not any(_alive(pid) for pid in ranks), 15)
    finally:
        _kill_all([launcher.pid, *ranks])
        launcher.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a pseudo-terminal with job control")
def test_ranks_writing_to_a_terminal_with_tostop_are_not_stopped(tmp_path):
    """`stty tostop` on the launcher's terminal: each rank was a background process group of the
    terminal's session, rank 0's first write to it got SIGTTOU and stopped it, and the run hung."""
    import pty
    import select
    import termios

    (tmp_path / "print_rank.py").write_text(  # to the terminal, then a file saying it got past that write
        "import os, pathlib\nprint('rank', os.environ['RANK'], 'wrote', flush=True)\n"
        f"pathlib.Path({str(tmp_path)!r}, 'past-' + os.environ['RANK']).touch()\n")
    code = ("import sys\nfrom neorec.train.launch import launch_local\n"
            "sys.exit(launch_local(2, [], module='print_rank'))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    pid, fd = pty.fork()
    if pid == 0:  # the launcher, in the foreground of a terminal that stops background writers
        try:
            attrs = termios.tcgetattr(0)
            attrs[3] |= termios.TOSTOP
            termios.tcsetattr(0, termios.TCSANOW, attrs)
            os.execve(sys.executable, [sys.executable, "-c", code], env)
        finally:
            os._exit(99)
    output, status, deadline = b"", None, time.monotonic() + 60
    try:
        while status is None and time.monotonic() < deadline:
            if select.select([fd], [], [], 0.5)[0]:
                try:
                    output += os.read(fd, 4096)
                except OSError:  # the terminal closed: every process on it has ended
                    pass
            done, code_status = os.waitpid(pid, os.WNOHANG)
            if done:
                status = os.waitstatus_to_exitcode(code_status)
    finally:
        if status is None:
            for child in _children(pid):
                _kill_all([child])
            _kill_all([pid])
            os.waitpid(pid, 0)
        os.close(fd)
    assert status == 0, (status, output)
    assert (tmp_path / "past-0").exists() and (tmp_path / "past-1").exists()
    assert output.count(b"wrote") == 2, output  # (the two ranks' lines may interleave on the terminal)


WINDOW = """import os, signal, sys, time
import torch  # its threads: a process-directed signal may be delivered to any of them
import neorec.train.launch as launch
real = launch.subprocess.Popen
def popen_then_ctrl_c(*args, **kwargs):
    process = real(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the ranks are being started
    time.sleep(0.2)
    return process
launch.subprocess.Popen = popen_then_ctrl_c
try:
    launch.launch_local(2, [], module="sleep_rank")
except KeyboardInterrupt:
    print("launcher interrupted", file=sys.stderr)
    sys.exit(130)
"""


@pytest.mark.skipif(sys.platform.startswith("win"), reason="POSIX signals")
def test_ctrl_c_while_the_ranks_start_is_not_lost():
    """The launcher ignored SIGINT while it spawned the ranks (so that they would inherit the
    ignoring): a Ctrl-C in that window was lost, and the launcher and its ranks ran on. The ranks now
    get a session of their own instead, and the launcher's handler never changes."""
    launcher = _start_launcher(WINDOW)
    try:
        _, err = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert launcher.returncode == 130 and "launcher interrupted" in err, err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PR_SET_PDEATHSIG is Linux's")
def test_neorec_train_ranks_die_with_a_killed_launcher(tmp_path):
    """`kill -9` of `neorec train --nproc 2` (the launcher cannot clean up): its ranks stop too."""
    launcher = subprocess.Popen([sys.executable, "-m", "neorec", "train", "--config", TINY, "--nproc", "2",
                                 "--set", "train.epochs=1000", "--output-dir", str(tmp_path), *SMALL],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ranks = []
    try:
        assert _wait_for(lambda: len(_children(launcher.pid)) == 2, 60)
        ranks = _children(launcher.pid)
        assert _wait_for(lambda: (tmp_path / "metrics.jsonl").exists(), 90)  # training has started
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=30)
        assert _wait_for(lambda: not any(_alive(pid) for pid in ranks), 15), "a rank outlived its launcher"
    finally:
        _kill_all([launcher.pid, *ranks])
        launcher.wait()


def test_two_torchrun_agents_as_two_nodes(tmp_path):
    port = free_port()
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
              f"127.0.0.1:{port}", "--rdzv-id", "neorec-test", "-m", "neorec", "train", "--config", TINY,
              "--plan", str(ROOT / "configs" / "tiny_plan_2ranks.json"), "--max-steps", "4",
              "--output-dir", str(tmp_path), *SMALL]
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    agents = [subprocess.Popen([*torchrun, "--node-rank", str(node), *common], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd=ROOT) for node in (0, 1)]
    try:
        outputs = [agent.communicate(timeout=TIMEOUT) for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    assert [agent.returncode for agent in agents] == [0, 0], outputs
    stdout = "".join(out for out, _ in outputs)
    assert stdout.count("final eval: AUC") == 1
    assert "distributed: 2 ranks (gloo)" in stdout and "1 column_wise, 1 data_parallel, 1 row_wise, 1 table_wise" in stdout
    final = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert final["kind"] == "final" and final["step"] == 4


def test_a_plan_with_storage_tiers_trains_its_tables_there(tmp_path):
    """`neorec plan --tiers cached_dram` then `neorec train --nproc 2 --plan`: the planner's tiers
    place the tables (caches over DRAM stores, each rank's pieces), trained as on the device."""
    from neorec.planner.topology import Topology

    spec = tmp_path / "tables.json"
    spec.write_text(json.dumps({"batch_size": 128, "tables": [
        {"name": f"t_feature_{i}", "num_rows": rows, "dim": 8} for i, rows in enumerate([500, 1000, 2000, 300])]}))
    topology = tmp_path / "topology.json"
    topology.write_text(json.dumps(Topology("two", 1, 2, 8e9, 3e9, 16e9, 3e9, 0.0, 0.0, 0.5e9, 0.5e9, 50e9,
                                            5e-4).to_dict()))
    plan = tmp_path / "plan.json"
    made = neorec("plan", "--tables", str(spec), "--topology", str(topology), "--tiers", "cached_dram",
                  "--time-limit", "0", "--out", str(plan))
    assert made.returncode == 0, made.stderr
    entries = json.loads(plan.read_text())["tables"]
    assert {e["tier"] for e in entries.values()} == {"cached_dram"}
    device_plan = tmp_path / "device.json"
    device_plan.write_text(json.dumps({**json.loads(plan.read_text()), "tables": {
        name: {k: v for k, v in e.items() if k != "tier"} for name, e in entries.items()}}))
    finals = {}
    for name, path in (("tiers", plan), ("device", device_plan)):
        run = neorec("train", "--config", TINY, "--nproc", "2", "--plan", str(path), "--max-steps", "6",
                     "--output-dir", str(tmp_path / name), "--set", "embedding.location.cache_fraction=0.2", *SMALL)
        assert run.returncode == 0, run.stderr
        finals[name] = json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[-1])
        assert ("embedding cache: t_feature_0 hit rate" in run.stdout) == (name == "tiers"), run.stdout
    assert sorted(finals["tiers"]["cache"]) == [f"t_feature_{i}" for i in range(4)]
    assert all(c["lookups"] > 0 and c["evictions"] > 0 for c in finals["tiers"]["cache"].values())
    assert "cache" not in finals["device"]
    assert {k: v for k, v in finals["tiers"].items() if k in ("auc", "ne", "log_loss")} == {
        k: v for k, v in finals["device"].items() if k in ("auc", "ne", "log_loss")}
