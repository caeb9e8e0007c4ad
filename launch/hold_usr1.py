#!/usr/bin/env python3
"""Runs a command with SIGUSR1 blocked: ``python launch/hold_usr1.py CMD [ARGS ...]``.

The launch scripts start the job's ranks (and the launchers that spawn them) through this. A
blocked signal is neither lost nor fatal: the mask passes through exec and to child processes,
and a pre-emption warning that arrives while a rank still imports torch stays pending until the
job installs its handler and unblocks it (``vrgd_ds.train.loop.main``), which then checkpoints
after the first step. Without it SIGUSR1's default action ends a process that has no handler
yet: a launcher (torchrun, DeepSpeed's) at once, its ranks left running, or a rank during its
imports. Nothing here imports more than the standard library, so the window left is the
interpreter's start.
"""
import os
import signal
import sys

if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: hold_usr1.py CMD [ARGS ...]")
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    os.execvp(sys.argv[1], sys.argv[1:])
