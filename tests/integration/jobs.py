"""What the integration tests share: the job's command line, its metrics and heartbeats, and
job configurations on the session's prepared corpus (``conftest.corpus``)."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import launching

TIMEOUT = 600  # one launch


#: the held-out loss each engine's job reports
EVAL_LOSS = {"deepspeed": "eval/mlm_loss", "megatron": "eval/lm_loss"}


def engine_of(config: Path) -> str:
    """The config's ``job.engine``."""
    return json.loads(Path(config).read_text())["job"].get("engine", "deepspeed")


def command(config: Path, run_dir: Path, *sets: str, ranks: int = 2, port: int | None = None) -> list[str]:
    """``deepspeed --num_gpus RANKS --module vrgd_ds.train`` with ``--set`` overrides, for either
    engine. DeepSpeed's launcher passes the first failing rank's exit code on, as ``srun
    --kill-on-bad-exit`` does; torchrun reports 1 for any failed rank (torch.distributed.elastic),
    so the exit codes the tests check would be lost under it (``test_megatron_job.py`` runs
    torchrun itself)."""
    bin_dir, port = Path(sys.executable).parent, str(port or launching.free_port())
    cmd = [str(bin_dir / "deepspeed"), "--num_gpus", str(ranks), "--master_port", port, "--module", "vrgd_ds.train"]
    cmd += ["--config", str(config), "--run-dir", str(run_dir)]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def write_config(directory: Path, config: dict, corpus: Path) -> Path:
    """``config`` with the session's prepared corpus as its data, written to ``config.json``."""
    cfg = json.loads(json.dumps(config))
    cfg["job"]["data"]["path"] = str(corpus)
    path = directory / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def records(run_dir: Path) -> dict[int, dict]:
    """``metrics.jsonl`` by step (a step's records merged)."""
    out: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out.setdefault(rec["step"], {}).update(rec)
    return out


def heartbeat(run_dir: Path, rank: int) -> dict | None:
    try:
        return json.loads((run_dir / "heartbeat" / f"rank{rank}").read_text())
    except (OSError, ValueError):
        return None


def wait_for(pred, proc: subprocess.Popen, timeout: float = TIMEOUT) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        if proc.poll() is not None:
            raise AssertionError(f"the job ended (rc={proc.returncode}) before the condition was met")
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def kill_after_checkpoint(cmd: list[str], run_dir: Path, tag: str = "step00000004", env: dict | None = None) -> None:
    """Starts the job and SIGKILLs it (every rank) once ``latest`` names ``tag``."""
    proc = launching.spawn(cmd, **({"env": env} if env is not None else {}))
    latest = run_dir / "checkpoints" / "latest"
    wait_for(lambda: latest.is_file() and latest.read_text().strip() == tag, proc)
    launching.kill(proc, marker=run_dir)
