"""The pretraining job (``python -m vrgd_ds.train``'s arguments) with every torch RNG draw after
the initial weights on another stream: the micro-batch seeds (``loop.micro_batch_seed``, which
seed dropout) shifted by ``$SHIFT``. Stands in for the same job on another device, whose torch
generator (CUDA's Philox against the CPU's Mersenne Twister) gives other draws for the same seed."""
import os
import sys

import vrgd_ds.train.loop as loop

SHIFT = int(os.environ["SHIFT"])
same_stream = loop.micro_batch_seed
loop.micro_batch_seed = lambda seed, step, slot: same_stream(seed + SHIFT, step, slot)

if __name__ == "__main__":
    sys.exit(loop.main())
