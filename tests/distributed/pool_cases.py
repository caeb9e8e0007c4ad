"""Cases that misbehave on purpose, for ``test_pool.py``."""
from __future__ import annotations

import os
import time

import deepspeed.comm as dist


def ok(case: dict) -> dict:
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "echo": case.get("echo")}


def fail(case: dict) -> dict:
    raise ValueError(f"broken on purpose ({case.get('echo')})")


def hang(case: dict) -> dict:
    time.sleep(3600)
    return {}


def die(case: dict) -> dict:
    os._exit(9)
