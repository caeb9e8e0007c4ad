"""The job's dropout seeds: one per micro-batch slot of a step's global batch, the same on any
number of ranks, and one per model chunk of a micro-batch (the Megatron engine's chunks)."""
from __future__ import annotations

SEED_SLOTS = 4099  # slots per step below which a seed is (seed * 1_000_003 + step) * SEED_SLOTS + slot


def micro_batch_seed(seed: int, step: int, slot: int) -> int:
    """The dropout seed of the micro-batch in ``slot`` of the step's global batch (its samples are
    ``slot × micro_batch`` onwards on any number of ranks: ``PretrainingSampler``). From slot
    ``SEED_SLOTS`` on, where that formula would give the next step's seeds, a hash of the three in
    [2^50, 2^51), above the formula's values for seeds below about 275,000 (and times 4096, as
    Megatron's CUDA seed takes it, still a 64-bit seed)."""
    if slot < SEED_SLOTS:
        return (seed * 1_000_003 + step) * SEED_SLOTS + slot
    return hashed_seed(seed, step, slot)


def hashed_seed(*entropy: int) -> int:
    """A seed in [2^50, 2^51) hashed from ``entropy`` (``numpy``'s ``SeedSequence``)."""
    import numpy as np

    state = int(np.random.SeedSequence(list(entropy)).generate_state(1, np.uint64)[0])
    return (1 << 50) | (state & ((1 << 50) - 1))
