"""Starts the ranks of a rank pool on this host (``pool.py``): what ``deepspeed --num_gpus N``
does for one node, without the two launcher processes that each import DeepSpeed first (about
6 s of every group's start on the 2-core machine).

    python ranks.py --nproc 2 --master_port 29500 pool_worker.py --control DIR --owner PID

Each rank gets the environment DeepSpeed's ``launcher/launch.py`` sets for a single node
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_SIZE``, ``CROSS_RANK``, ``CROSS_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``) and ``--local_rank=i``. Imports nothing but the standard
library. The first rank to exit with an error ends the others, and its code is this process's
exit code, as the launcher's is; the pool kills the whole process group when it closes. The
launchers themselves are tested where a job starts through them (``tests/integration``).
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, required=True)
    ap.add_argument("--master_port", type=int, required=True)
    ap.add_argument("script")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    env = dict(os.environ, WORLD_SIZE=str(args.nproc), LOCAL_SIZE=str(args.nproc), CROSS_RANK="0", CROSS_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.master_port))
    procs = [subprocess.Popen([sys.executable, "-u", args.script, f"--local_rank={rank}", *args.args],
                              env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)))
             for rank in range(args.nproc)]
    while True:
        codes = [p.poll() for p in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGKILL)
            return failed[0] if failed[0] > 0 else 128 - failed[0]
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())
