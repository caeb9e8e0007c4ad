"""The ranks of a persistent process group that runs one test case per request (``pool.py``).

Started once per pytest session by ``ranks.py --nproc 2 ... pool_worker.py --control DIR`` (``pool.py``).
Rank 0 waits for ``DIR/req-<id>.json`` (``{"module", "function", "case"}``), broadcasts it, every
rank calls ``module.function(case)``, and rank 0 writes ``DIR/res-<id>.json``: rank 0's result,
or the first error of any rank with its traceback. A case that hangs or kills a rank is the
caller's to detect (it times out, has every process of the group print its Python stacks on
SIGUSR2, kills the group and starts another one). Rank 0 leaves when the pytest process that
started it is gone, so no pool outlives its session.
"""
from __future__ import annotations

import argparse
import datetime
import faulthandler
import importlib
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

# a hung case: the caller sends SIGUSR2 to the group's processes and reads their stacks from the
# log. Registered before the imports, and at module level so that the processes a rank spawns
# (they import this module as ``__mp_main__``) print theirs too.
faulthandler.register(signal.SIGUSR2, all_threads=True)

import deepspeed
import deepspeed.comm as dist

from vrgd_ds.ds import shm

sys.path.insert(0, os.path.dirname(__file__))

POLL_S, IDLE_POLL_S = 0.01, 0.1


def _write(path: Path, payload: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def _next_request(control: Path, owner: int) -> dict:
    """The next request; polls every 10 ms for a second after the last one, then every 100 ms."""
    since = time.monotonic()
    while True:
        found = sorted(control.glob("req-*.json"))
        if found:
            request = json.loads(found[0].read_text())
            found[0].unlink()
            return request
        try:
            os.kill(owner, 0)
        except ProcessLookupError:
            return {"op": "stop"}
        time.sleep(POLL_S if time.monotonic() - since < 1.0 else IDLE_POLL_S)


def _call(request: dict) -> dict:
    try:
        fn = getattr(importlib.import_module(request["module"]), request["function"])
        return {"result": fn(request["case"])}
    except Exception as e:  # noqa: BLE001 (reported to the test)
        return {"error": f"rank {dist.get_rank()}: {type(e).__name__}: {e}", "trace": traceback.format_exc()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--control", required=True)
    ap.add_argument("--owner", type=int, required=True, help="the pytest process's pid")
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    control = Path(args.control)
    # between two requests rank 1 waits in a broadcast: as long as the session may last
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(hours=6))
    rank = dist.get_rank()
    dist.barrier()  # every rank has mapped its peers' shared memory (CPU accelerator)
    shm.unlink_own_segment(rank)  # else each group start leaves 69 MB per rank in /dev/shm
    if rank == 0:
        _write(control / "ready.json", {"world": dist.get_world_size(), "pid": os.getpid()})
    while True:
        box = [_next_request(control, args.owner) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        request = box[0]
        if request.get("op") == "stop":
            break
        outcome = _call(request)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, outcome)
        if rank == 0:
            failed = [o for o in everyone if "error" in o]
            _write(control / f"res-{request['id']}.json", failed[0] if failed else outcome)
    dist.barrier()


if __name__ == "__main__":
    main()
