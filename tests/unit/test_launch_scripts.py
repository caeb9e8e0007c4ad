"""The launch scripts (``launch/``) with stand-ins for the programs they start (``srun``,
``scontrol``, the DeepSpeed launcher, Python): the command each builds, from the caller's
directory and Slurm's environment. (The scripts starting real ranks under a local Slurm, pdsh
and mpirun: tests/integration/test_launchers.py.)"""
from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts processes (bash and its stand-ins)
ROOT = Path(__file__).resolve().parents[2]


def stand_in(path: Path, body: str) -> Path:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_slurm_sbatch_reads_the_first_host_of_a_long_node_list(tmp_path):
    """On an allocation of thousands of nodes ``scontrol show hostnames`` writes more than a pipe
    holds. Fails on the script that took the first line with ``head -n 1``: head stopped reading,
    scontrol's next write ended it with SIGPIPE, and ``set -o pipefail`` made that the batch
    script's exit (141) before any rank started."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in(bin_dir / "scontrol", 'if [[ $1 == show ]]; then printf "gpu-node-%05d\\n" $(seq 1 200000); fi\n')
    stand_in(bin_dir / "srun", 'echo "srun MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT"\n')
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(tmp_path),
           "SLURM_JOB_NODELIST": "gpu-node-[00001-200000]", "SLURM_JOB_ID": "4242", "SLURM_NTASKS": "1600000",
           "RUN_DIR": str(tmp_path / "run"), "CONFIG": str(ROOT / "configs" / "bert_tiny_cpu_test.json")}
    run = subprocess.run(["bash", str(ROOT / "launch" / "slurm.sbatch")], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "srun MASTER_ADDR=gpu-node-00001 MASTER_PORT=24242" in run.stdout


@pytest.mark.parametrize("script", ["deepspeed_hostfile.sh", "torchrun.sh", "mpirun.sh"])
def test_a_launch_script_reads_the_callers_relative_paths_from_the_callers_directory(tmp_path, script):
    """``CONFIG=my.json RUN_DIR=runs/a HOSTFILE=hosts launch/<script>`` started from another
    directory names the files there; the defaults stay the repository's. Fails on the scripts
    that changed to the repository's root first, then read the caller's relative paths there:
    "no hostfile 'hosts'", and a config and run directory under the checkout."""
    caller = tmp_path / "caller"
    (caller / "runs").mkdir(parents=True)
    (caller / "my.json").write_text("{}")
    (caller / "hosts").write_text("node-a slots=8\nnode-b slots=8\n")
    argv = stand_in(tmp_path / "argv", 'printf "%s\\n" "$@"\n')
    env = {**os.environ, "CONFIG": "my.json", "RUN_DIR": "runs/a", "HOSTFILE": "hosts", "NPROC": "2", "NP": "2",
           "PYTHON": str(argv), "DEEPSPEED": str(argv), "MPIRUN": str(argv)}
    run = subprocess.run(["bash", str(ROOT / "launch" / script)], cwd=caller, env=env, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    args = run.stdout.splitlines()
    assert args[args.index("--config") + 1] == str(caller / "my.json")
    assert args[args.index("--run-dir") + 1] == str(caller / "runs" / "a")
    if script == "deepspeed_hostfile.sh":
        assert args[args.index("--hostfile") + 1] == str(caller / "hosts")
        assert args[args.index("--master_addr") + 1] == "node-a"


@pytest.mark.parametrize("env, addr", [({}, "node-a"), ({"DS_ARGS": "--exclude node-a"}, None),
                                       ({"DS_ARGS": "-e node-a:0"}, None), ({"DS_ARGS": "--include=node-b"}, None),
                                       ({"DS_ARGS": "--exclude node-a", "MASTER_ADDR": "node-b"}, "node-b"),
                                       ({"HOSTS": "localhost slots=8\nnode-b slots=8\n"}, None)])
def test_the_hostfile_launch_names_a_rendezvous_host_only_where_rank_0_runs_there(tmp_path, env, addr):
    """The hostfile's first host is rank 0's unless DeepSpeed's ``--include``/``--exclude`` (in
    ``DS_ARGS``) choose others, when DeepSpeed places rank 0 on the first host it uses and its own
    choice of address stands; so too for a first host named ``localhost``, which every other node
    would take for itself. A ``MASTER_ADDR`` given is passed as given. Fails on the old script,
    which passed the first host always: with ``--exclude node-a`` every rank waited for node-a."""
    hosts = tmp_path / "hosts"
    hosts.write_text(env.pop("HOSTS", "node-a slots=8\nnode-b slots=8\nnode-c slots=8\n"))
    argv = stand_in(tmp_path / "argv", 'printf "%s\\n" "$@"\n')
    base = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "DS_ARGS")}
    run = subprocess.run(["bash", str(ROOT / "launch" / "deepspeed_hostfile.sh")], cwd=tmp_path,
                         env={**base, "HOSTFILE": str(hosts), "DEEPSPEED": str(argv), **env},
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    args = run.stdout.splitlines()
    assert (args[args.index("--master_addr") + 1] if "--master_addr" in args else None) == addr, args
