"""The launch scripts (``launch/``) with stand-ins for the programs they start (``srun``,
``scontrol``, the DeepSpeed launcher, Python): the command each builds, from the caller's
directory and Slurm's environment. (The scripts starting real ranks under a local Slurm, pdsh
and mpirun: tests/integration/test_launchers.py.)"""
from __future__ import annotations

import os
import re
import signal
import socket
import stat
import subprocess
import sys
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


@pytest.mark.parametrize("left, writes, rc, requeued", [
    ('{"tag": "step00000020"}', None, 2, False),  # another launcher's, and this start failed on its config
    ('{"tag": "step00000020", "slurm_job_id": "100", "slurm_restart": 0}', None, 6, False),  # another job's
    ('{"tag": "step00000020", "slurm_job_id": "4242", "slurm_restart": 0}', None, 2, False),  # an earlier start's
    (None, '{"tag": "step00000030", "slurm_job_id": "4242", "slurm_restart": 1}', 75, True),  # this start's
])
def test_slurm_sbatch_requeues_on_this_starts_marker_only(tmp_path, left, writes, rc, requeued):
    """The batch script requeues only on a ``requeue.json`` the job wrote in this start of this
    Slurm job (its id and restart count in it); a failed start finding another's marker exits with
    its own code, the marker left alone. Fails on the script before, which requeued on any marker
    and exited 0: a job whose config did not parse was requeued for ever, and a job refused the run
    directory (exit 6) requeued itself on the owner's marker and removed it, so the owner was not."""
    bin_dir, run_dir = tmp_path / "bin", tmp_path / "run"
    bin_dir.mkdir()
    run_dir.mkdir()
    marker = run_dir / "requeue.json"
    if left is not None:
        marker.write_text(left)
    stand_in(bin_dir / "scontrol", 'if [[ $1 == show ]]; then echo node1; else echo "scontrol $*" >> "$LOG"; fi\n')
    stand_in(bin_dir / "srun", (f"echo '{writes}' > {marker}\n" if writes else "") + f"exit {rc}\n")
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(tmp_path),
           "SLURM_JOB_NODELIST": "node1", "SLURM_JOB_ID": "4242", "SLURM_NTASKS": "2", "SLURM_RESTART_COUNT": "1",
           "RUN_DIR": str(run_dir), "LOG": str(tmp_path / "log"), "CONFIG": "c.json"}
    run = subprocess.run(["bash", str(ROOT / "launch" / "slurm.sbatch")], env=env, capture_output=True, text=True,
                         timeout=120)
    log = (tmp_path / "log").read_text() if (tmp_path / "log").exists() else ""
    if requeued:
        assert run.returncode == 0 and log == "scontrol requeue 4242\n" and not marker.exists(), run.stderr[-2000:]
    else:
        assert run.returncode == rc and log == "" and marker.read_text() == left, run.stderr[-2000:]


@pytest.mark.parametrize("script", ["deepspeed_hostfile.sh", "torchrun.sh", "mpirun.sh"])
def test_a_launch_script_reads_the_callers_relative_paths_from_the_callers_directory(tmp_path, script):
    """``CONFIG=my.json RUN_DIR=runs/a HOSTFILE=hosts launch/<script>`` started from another
    directory names the files there; the defaults stay the repository's. Fails on the scripts
    that changed to the repository's root first, then read the caller's relative paths there:
    "no hostfile 'hosts'", and a config and run directory under the checkout; and the mpirun script
    that read MPI_ARGS's host file there (the script's own comment said the caller's)."""
    caller = tmp_path / "caller"
    (caller / "runs").mkdir(parents=True)
    (caller / "my.json").write_text("{}")
    (caller / "hosts").write_text("node-a slots=8\nnode-b slots=8\n")
    argv = stand_in(tmp_path / "argv", 'printf "%s\\n" "$@"\n')
    env = {**os.environ, "CONFIG": "my.json", "RUN_DIR": "runs/a", "HOSTFILE": "hosts", "NPROC": "2", "NP": "2",
           "PYTHON": str(argv), "DEEPSPEED": str(argv), "MPIRUN": str(argv),
           "MPI_ARGS": "--hostfile hosts -npernode 8 --machinefile=hosts"}
    run = subprocess.run(["bash", str(ROOT / "launch" / script)], cwd=caller, env=env, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    args = run.stdout.splitlines()
    assert args[args.index("--config") + 1] == str(caller / "my.json")
    assert args[args.index("--run-dir") + 1] == str(caller / "runs" / "a")
    if script == "deepspeed_hostfile.sh":
        assert args[args.index("--hostfile") + 1] == str(caller / "hosts")
        assert args[args.index("--master_addr") + 1] == "node-a"
    if script == "mpirun.sh":  # MPI_ARGS's host files too (fails on the script that read them in the checkout)
        assert args[args.index("--hostfile") + 1] == str(caller / "hosts") and "-npernode" in args
        assert f"--machinefile={caller / 'hosts'}" in args


def test_torchrun_leaves_the_pre_emption_signal_to_the_ranks(tmp_path):
    """torchrun neither handles nor forwards SIGUSR1, whose default action ended it at once (exit
    138) while its ranks ran on, orphaned, and wrote the requeue marker after the launcher had
    returned. The script starts torchrun through launch/hold_usr1.py with the signal blocked, a
    mask torchrun and its ranks inherit (each rank's job installs its handler and unblocks it).
    Fails on the scripts before: first the stand-in saw the default action; then, with the signal
    ignored, one that reached a rank during its imports was lost."""
    python = tmp_path / "python"
    python.write_text("#!" + sys.executable + "\nimport os, signal, sys\n"
                      "if sys.argv[1].endswith('hold_usr1.py'):\n"
                      "    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])\n"
                      "print(signal.SIGUSR1 in signal.pthread_sigmask(signal.SIG_BLOCK, []),\n"
                      "      int(signal.getsignal(signal.SIGUSR1)), *sys.argv[1:3])\n")
    python.chmod(0o755)
    env = {**os.environ, "NPROC": "2", "PYTHON": str(python), "CONFIG": str(ROOT / "configs" / "bert_tiny_cpu_test.json")}
    run = subprocess.run(["bash", str(ROOT / "launch" / "torchrun.sh")], env=env, capture_output=True, text=True,
                         timeout=60)
    want = f"True {int(signal.SIG_DFL)} -m torch.distributed.run"
    assert run.returncode == 0 and run.stdout.strip() == want, (run.stdout, run.stderr[-2000:])


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


@pytest.mark.parametrize("host, remote", [("localhost", False), ("127.0.0.1", False), (socket.gethostname(), False),
                                          ("node-a", True)])
def test_a_one_line_hostfile_naming_another_machine_starts_the_ranks_there(tmp_path, host, remote):
    """DeepSpeed starts the ranks of a one-line hostfile on this machine, whatever host it names:
    with another machine's name the ranks ran here and waited for a rendezvous at that host. Such
    a hostfile now goes over pdsh (``--force_multi``, the job's arguments quoted for its shell);
    one naming this machine keeps DeepSpeed's own local start. Fails on the old script, which
    passed ``--force_multi`` only for several hosts."""
    (tmp_path / "hosts").write_text(f"{host} slots=2\n")
    argv = stand_in(tmp_path / "argv", 'printf "%s\\n" "$@"\n')
    run = subprocess.run(["bash", str(ROOT / "launch" / "deepspeed_hostfile.sh")], cwd=tmp_path,
                         env={**{k: v for k, v in os.environ.items() if k not in ("LAUNCHER", "DS_ARGS")},
                              "HOSTFILE": str(tmp_path / "hosts"), "DEEPSPEED": str(argv)},
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    assert ("--force_multi" in run.stdout.splitlines()) == remote, run.stdout


#: DeepSpeed 0.19.8's launcher as far as the job's arguments go: parsed by its own parser; on one
#: host as they are, else with pdsh (the last --launcher, in any case) through its runner's quoting
#: and a node's shell (``bash -c``), with another launcher (OpenMPI's) as a list, as they are
DEEPSPEED_STAND_IN = """import subprocess, sys
from deepspeed.launcher.multinode_runner import PDSHRunner
from deepspeed.launcher.runner import parse_args
args = parse_args(sys.argv[1:])
hosts = [line for line in open(args.hostfile) if line.strip() and not line.lstrip().startswith("#")]
if (args.force_multi or len(hosts) > 1) and args.launcher.lower() == "pdsh":
    command = " ".join(PDSHRunner(args, "").user_arguments)
    print(subprocess.run(["bash", "-c", "printf '%s\\n' " + command], capture_output=True, text=True).stdout, end="")
else:
    print("\\n".join(args.user_args))
"""


# each case about 3 s (DeepSpeed's parser imported): make test keeps one host, and several with the
# launcher chosen in DS_ARGS
@pytest.mark.parametrize("hosts, env", [
    (1, {}), pytest.param(2, {}, marks=pytest.mark.exhaustive), (2, {"DS_ARGS": "--launcher openmpi"}),
    pytest.param(2, {"DS_ARGS": "--launcher=OpenMPI"}, marks=pytest.mark.exhaustive),
    pytest.param(2, {"LAUNCHER": "PDSH"}, marks=pytest.mark.exhaustive),
    pytest.param(2, {"LAUNCHER": "openmpi", "DS_ARGS": "--launcher pdsh"}, marks=pytest.mark.exhaustive)])
def test_the_hostfile_launch_hands_the_job_its_arguments_as_given_on_one_host_or_several(tmp_path, hosts, env):
    """Arguments a shell would take apart — JSON with quotes, braces and brackets, a glob, a space,
    ``$``, a backslash, a backtick — reach the job as given: on one host (DeepSpeed starts the
    ranks without a shell) and on several (pdsh: DeepSpeed joins them into one command for every
    node's shell; OpenMPI: a list, no shell), the script started by a path relative to another
    directory. Fails on the old script: on several hosts ``--set 'job.model.overrides={"a":0.0,"b":0.0}'``
    reached the job as two arguments without quotes, a JSON list lost its quotes, and ``$HOME`` was
    expanded; started by a relative path from outside the repository, it did not find
    ``launch/args.sh``. And on the script after it, which chose the quoting by ``LAUNCHER`` alone:
    with the launcher chosen in ``DS_ARGS`` (``--launcher openmpi``, as docs/pretraining.md shows)
    the arguments reached the job with pdsh's backslashes, and with ``LAUNCHER=PDSH`` (DeepSpeed
    reads it in lower case) unquoted."""
    given = ['job.model.overrides={"hidden_dropout_prob":0.0,"attention_probs_dropout_prob":0.0}',
             'job.data.inputs=["/shared/wiki/*.txt"]', 'job.comment="two words, $HOME and `date`"',
             "job.data.path=/a\\b", "job.seed=3"]
    (tmp_path / "hosts").write_text("".join(f"node-{i} slots=8\n" for i in range(hosts)))
    (tmp_path / "ds.py").write_text(DEEPSPEED_STAND_IN)
    argv = stand_in(tmp_path / "deepspeed", f'exec {sys.executable} {tmp_path / "ds.py"} "$@"\n')
    caller = tmp_path / "elsewhere"
    caller.mkdir()
    script = os.path.relpath(ROOT / "launch" / "deepspeed_hostfile.sh", caller)
    run = subprocess.run(["bash", script, *[a for g in given for a in ("--set", g)]], cwd=caller,
                         env={**{k: v for k, v in os.environ.items() if k not in ("LAUNCHER", "DS_ARGS")},
                              "HOSTFILE": str(tmp_path / "hosts"), "DEEPSPEED": str(argv),
                              "RUN_DIR": str(tmp_path / "run dir"), **env}, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    args = run.stdout.splitlines()
    assert args[args.index("--run-dir") + 1] == str(tmp_path / "run dir"), args
    assert args[args.index("--set"):] == [a for g in given for a in ("--set", g)], args


@pytest.mark.parametrize("script, name, value, want", [
    ("deepspeed_hostfile.sh", "DS_ARGS", '--launcher openmpi --launcher_args "-x NCCL_DEBUG=INFO -x FOO=1"',
     ["--launcher", "openmpi", "--launcher_args", "-x NCCL_DEBUG=INFO -x FOO=1"]),
    ("mpirun.sh", "MPI_ARGS", "--mca btl_tcp_if_include 'eth0,ib0' -x 'A=two words'",
     ["--mca", "btl_tcp_if_include", "eth0,ib0", "-x", "A=two words"]),
    ("mpirun.sh", "MPI_ARGS", '-x "FOO=a\\"b" -x "B=a\\\\b" -x "C=tab\tin quotes"',
     ["-x", 'FOO=a"b', "-x", "B=a\\b", "-x", "C=tab\tin quotes"]),
])
def test_extra_launcher_arguments_are_split_as_a_shell_splits_them(tmp_path, script, name, value, want):
    """Fails on the old scripts, which split ``DS_ARGS``/``MPI_ARGS`` at every space: DeepSpeed's
    ``--launcher_args "-x A -x B"`` came apart and its parser took ``NCCL_DEBUG=INFO`` for the
    script to run. An unmatched quote ends the launch naming the variable. The escapes inside
    double quotes (``\\"``, ``\\\\``) are read as a shell reads them: the script after them, which
    split with ``xargs``, called the first an unmatched quote and kept both backslashes of the
    second."""
    (tmp_path / "hosts").write_text("node-a slots=8\n")
    argv = stand_in(tmp_path / "argv", 'printf "%s\\n" "$@"\n')
    base = {**os.environ, "HOSTFILE": str(tmp_path / "hosts"), "NP": "2", "DEEPSPEED": str(argv), "MPIRUN": str(argv)}
    run = subprocess.run(["bash", str(ROOT / "launch" / script)], cwd=tmp_path, env={**base, name: value},
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    args = run.stdout.splitlines()
    assert any(args[i:i + len(want)] == want for i in range(len(args))), args
    run = subprocess.run(["bash", str(ROOT / "launch" / script)], cwd=tmp_path, env={**base, name: value + ' "'},
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and f"error: {name}: an unmatched quote" in run.stderr and not run.stdout


def test_torchrun_on_several_nodes_needs_the_rendezvous_address(tmp_path):
    """Fails on the old script: with ``NNODES=2`` and no ``MASTER_ADDR`` every node met at its own
    127.0.0.1 and waited until the rendezvous timed out, with nothing saying why."""
    argv = stand_in(tmp_path / "python", 'printf "%s\\n" "$@"\n')
    base = {k: v for k, v in os.environ.items() if k != "MASTER_ADDR"} | {"NNODES": "2", "NODE_RANK": "1",
                                                                          "NPROC": "8", "PYTHON": str(argv)}
    run = subprocess.run(["bash", str(ROOT / "launch" / "torchrun.sh")], env=base, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 2 and "NNODES=2 needs MASTER_ADDR" in run.stderr and not run.stdout
    run = subprocess.run(["bash", str(ROOT / "launch" / "torchrun.sh")], env={**base, "MASTER_ADDR": "node0"},
                         capture_output=True, text=True, timeout=60)
    args = run.stdout.splitlines()
    assert run.returncode == 0 and args[args.index("--master_addr") + 1] == "node0", run.stderr[-2000:]


@pytest.mark.parametrize("name, value", [("NNODES", "two"), ("NPROC", "8x"), ("NODE_RANK", "first")])
def test_torchrun_refuses_a_count_that_is_not_a_number(tmp_path, name, value):
    """Fails on the old script: bash's arithmetic read ``NNODES=two`` as 0, so the several-node
    checks passed it by and torchrun got the word (and a bad NPROC or NODE_RANK went to it alike)."""
    argv = stand_in(tmp_path / "python", 'printf "%s\\n" "$@"\n')
    env = dict(os.environ) | {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "node0", "NPROC": "8",
                              "PYTHON": str(argv), name: value}
    run = subprocess.run(["bash", str(ROOT / "launch" / "torchrun.sh")], env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 2 and f"error: {name}={value} is not a whole number" in run.stderr and not run.stdout


def test_torchrun_on_several_nodes_needs_each_nodes_rank(tmp_path):
    """Fails on the old script: with ``NNODES=2`` and no ``NODE_RANK`` every node took node rank 0,
    and torchrun's rank-0 agents waited in the rendezvous store for a node 1 that never came,
    until the store timed out."""
    argv = stand_in(tmp_path / "python", 'printf "%s\\n" "$@"\n')
    base = {k: v for k, v in os.environ.items() if k != "NODE_RANK"} | {"NNODES": "2", "MASTER_ADDR": "node0",
                                                                        "NPROC": "8", "PYTHON": str(argv)}
    run = subprocess.run(["bash", str(ROOT / "launch" / "torchrun.sh")], env=base, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 2 and "NNODES=2 needs NODE_RANK" in run.stderr and not run.stdout, run.stderr
    run = subprocess.run(["bash", str(ROOT / "launch" / "torchrun.sh")], env={**base, "NODE_RANK": "1"},
                         capture_output=True, text=True, timeout=60)
    args = run.stdout.splitlines()
    assert run.returncode == 0 and args[args.index("--node_rank") + 1] == "1", run.stderr[-2000:]
    one = {k: v for k, v in base.items() if k not in ("NNODES", "MASTER_ADDR")}  # one node: rank 0 by default
    run = subprocess.run(["bash", str(ROOT / "launch" / "torchrun.sh")], env=one, capture_output=True, text=True,
                         timeout=60)
    args = run.stdout.splitlines()
    assert run.returncode == 0 and args[args.index("--node_rank") + 1] == "0", run.stderr[-2000:]


@pytest.mark.parametrize("job_id", ["12767", "19999", "31999"])
def test_the_slurm_rendezvous_port_stays_below_the_ephemeral_ports(tmp_path, job_id):
    """Fails on the old script for job ids whose port was 20000 + id mod 20000 >= 32768 (about a
    third of them): Linux hands ports from 32768 to 60999 to outgoing connections, so one could
    already hold the rendezvous port ("address in use")."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in(bin_dir / "scontrol", 'if [[ $1 == show ]]; then echo node-a; fi\n')
    stand_in(bin_dir / "srun", 'echo "MASTER_PORT=$MASTER_PORT"\n')
    env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"} | {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(tmp_path),
        "SLURM_JOB_NODELIST": "node-a", "SLURM_JOB_ID": job_id, "SLURM_NTASKS": "8", "RUN_DIR": str(tmp_path / "run"),
        "CONFIG": str(ROOT / "configs" / "bert_tiny_cpu_test.json")}
    run = subprocess.run(["bash", str(ROOT / "launch" / "slurm.sbatch")], env=env, capture_output=True, text=True,
                         timeout=60)
    port = int(re.search(r"MASTER_PORT=(\d+)", run.stdout).group(1))
    assert run.returncode == 0 and 20000 <= port < 32768, (port, run.stderr[-2000:])


def test_make_demo_keeps_its_run_directory_when_run_dir_is_exported(tmp_path):
    """``RUN_DIR``, exported for the launch scripts, does not move ``make demo`` (the README's
    main job, into ``runs/demo``) into that run, whose checkpoints it would resume. Fails on the
    Makefile before, whose ``RUN_DIR ?= runs/demo`` took the exported one."""
    env = {k: v for k, v in os.environ.items() if k != "DEMO_RUN_DIR"} | {"RUN_DIR": str(tmp_path / "bert large")}
    run = subprocess.run(["make", "-n", "-C", str(ROOT), "demo"], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    assert '--run-dir "runs/demo"' in run.stdout and "bert large" not in run.stdout


@pytest.mark.parametrize("script", sorted(p.relative_to(ROOT / "launch").as_posix() for p in
                                          [*(ROOT / "launch").glob("*.sh"), *(ROOT / "launch").glob("*.sbatch"),
                                           *(ROOT / "launch" / "megatron").glob("*.sbatch")]))
def test_a_launch_script_expands_a_possibly_empty_array_the_way_older_bash_allows(script):
    """Under ``set -u``, bash before 4.4 (RHEL/CentOS 7's 4.2 on many clusters' nodes) takes
    ``"${ARGS[@]}"`` of an empty array for an unbound variable and ends the script ("ARGS[@]:
    unbound variable"): a launch without ``BACKEND``, ``DS_ARGS`` or ``MPI_ARGS`` failed there
    before starting anything. Each array is expanded as ``${ARGS[@]+"${ARGS[@]}"}``, which every
    bash reads the same way. Fails on the scripts before (bash 5 here cannot show the error
    itself, so the expansions are read from the source)."""
    text = (ROOT / "launch" / script).read_text()
    if not re.search(r"^set -[a-z]*u", text, re.M):
        pytest.skip("no set -u")
    bare = [m.group(0) for m in re.finditer(r'(?<!\+)"\$\{!?[A-Za-z_][A-Za-z0-9_]*\[[@*]\]\}"', text)]
    assert not bare, f"{script}: unguarded array expansions {bare}"
