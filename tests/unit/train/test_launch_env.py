"""``neorec train --nproc N``'s rank environment: the launcher's own torchrun variables, none left
over from an outer torchrun (TORCHELASTIC_RESTART_COUNT=1 + TORCHELASTIC_USE_AGENT_STORE=True made
every rank wait 600 s for a store no one serves).

    python -m pytest tests/unit/train/test_launch_env.py -q
"""

from __future__ import annotations

import os

from neorec.train.launch import launch_local, rank_environment

OUTER_TORCHRUN = {  # what torchrun's agent gives its workers (torch/distributed/elastic/agent)
    "RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
    "GROUP_WORLD_SIZE": "2", "ROLE_RANK": "3", "ROLE_NAME": "default", "ROLE_WORLD_SIZE": "8",
    "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29400", "TORCHELASTIC_RESTART_COUNT": "1",
    "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_USE_AGENT_STORE": "True",
    "TORCHELASTIC_ERROR_FILE": "/tmp/error.json", "TORCHELASTIC_ENABLE_FILE_TIMER": "1",
}
USER = {"PATH": "/usr/bin", "OMP_NUM_THREADS": "2", "CUDA_VISIBLE_DEVICES": "0,1", "NEOREC_TRACEBACK": "1",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "PYTHONPATH": "/src"}


def test_rank_environment_drops_leftover_torchrun_variables():
    env = rank_environment(1, 2, 12345, base={**OUTER_TORCHRUN, **USER})
    assert env == {**USER, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                   "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "12345"}
    assert not any(k.startswith("TORCHELASTIC_") for k in env)


def test_rank_environment_defaults_to_os_environ(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("ROLE_NAME", "trainer")
    monkeypatch.setenv("NEOREC_SOMETHING", "kept")
    env = rank_environment(0, 3, 2222)
    assert "TORCHELASTIC_RESTART_COUNT" not in env and "TORCHELASTIC_USE_AGENT_STORE" not in env
    assert "ROLE_NAME" not in env and env["NEOREC_SOMETHING"] == "kept"
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_PORT"]) == ("0", "3", "2222")
    assert "TORCHELASTIC_RESTART_COUNT" in os.environ  # the launcher's own environment is left alone


ENV_RANK = """import os, sys
leftover = [k for k in os.environ if k.startswith(("TORCHELASTIC_", "ROLE_")) or k == "GROUP_WORLD_SIZE"]
sys.exit(5 if leftover or os.environ["MASTER_ADDR"] != "127.0.0.1" or os.environ["GROUP_RANK"] != "0" else 0)
"""


def test_ranks_started_from_inside_torchrun_see_only_the_launchers_variables(tmp_path, monkeypatch):
    for key, value in OUTER_TORCHRUN.items():
        monkeypatch.setenv(key, value)
    (tmp_path / "env_rank.py").write_text(ENV_RANK)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    assert launch_local(2, [], module="env_rank") == 0


def test_a_ranks_threads_honour_omp_num_threads_and_the_affinity_mask(monkeypatch):
    """Each rank took cpu_count / local ranks threads: every CPU of the machine, whatever the
    process was allowed to run on (taskset, a container's cpuset), and over an OMP_NUM_THREADS the
    user (or torchrun) had set."""
    from neorec.train import distributed

    assert distributed.threads_per_rank(2, {"OMP_NUM_THREADS": "3"}) == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert distributed.usable_cpus() == 6
    assert distributed.threads_per_rank(2, {}) == 3 and distributed.threads_per_rank(8, {}) == 1
    assert distributed.threads_per_rank(2, {"OMP_NUM_THREADS": "junk"}) == 3
