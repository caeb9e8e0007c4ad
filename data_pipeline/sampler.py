"""Deterministic data-parallel batch sampler keyed by ``(seed, consumed_samples)``.

All ranks read one global sample stream: position ``k`` is sample
``perm(seed, epoch)[k % N]`` of epoch ``k // N``, where ``perm`` is a numpy ``Generator``
permutation seeded by ``(seed, epoch)``. The stream is cut into micro-batches of
``micro_batch_size`` positions, dealt round-robin to the ranks: global micro-batch ``m``
(positions ``[m·mb, (m+1)·mb)``) goes to rank ``m % world_size``. One optimizer step of
``gradient_accumulation × world_size × micro_batch_size`` samples is therefore a contiguous
block of the stream, whatever the split, and the whole training position is one number,
``consumed_samples``. Resuming from it, also with another world size or micro-batch size,
continues the stream exactly: within an epoch no sample is lost or repeated. (Megatron-LM's
``MegatronPretrainingSampler`` keeps the same single counter; it deals each rank a
contiguous slice of the global batch instead, which ties the order to the world size.)

Each key is ``(epoch, sample_index)``: the epoch travels with the index so that
:class:`vrgd_ds.data_pipeline.samples.BertPretrainingDataset` can draw that epoch's masks.

The permutation of the current epoch is held in memory: O(N) int64, 8 bytes per sample
(800 MB for 10^8 samples); at most two epochs' permutations are cached, for a micro-batch
that straddles an epoch boundary.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np

from vrgd_ds.data_pipeline.errors import DataError

logger = logging.getLogger(__name__)

_TAG_PERM = 0x7065726D  # "perm": keeps this RNG stream apart from the masking stream


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise DataError(f"PretrainingSampler option {name}={value!r} must be an int >= "
                        f"{minimum}")
    return int(value)


class PretrainingSampler:
    """Batch sampler yielding this rank's micro-batches of ``(epoch, sample_index)`` keys.

    Iterating yields, for rounds ``t = 0, 1, ...`` from the current position ``c``
    (``consumed_samples``), the keys of stream positions
    ``[c + (t·world_size + rank)·mb, c + (t·world_size + rank + 1)·mb)``, forever, or while
    a whole round fits within ``max_samples``. Each yielded micro-batch advances
    ``consumed_samples`` by ``micro_batch_size × world_size``: one round of all ranks.

    Accounting in the training loop: a ``DataLoader`` prefetches, so the sampler's own
    counter runs ahead of what the model has seen and must not be checkpointed. The loop
    keeps ``consumed_samples`` itself, adding ``gradient_accumulation × world_size ×
    micro_batch_size`` after each completed optimizer step, stores that number in the
    checkpoint, and on resume builds a new sampler with it (and a new ``DataLoader``).
    Micro-batches of an unfinished step are read again after a resume, which is what the
    restored model state needs. The number must be a multiple of
    ``micro_batch_size × world_size`` of the resumed run, which holds whenever the global
    batch is a multiple of it. ``state_dict()`` reports the sampler's own counter, right
    when the sampler is iterated directly without prefetching.

    Args:
        num_samples: N, the number of samples of the dataset (``len(dataset)``).
        micro_batch_size: samples per micro-batch on each rank.
        rank: this rank, ``0 <= rank < world_size``.
        world_size: number of data-parallel ranks.
        seed: seeds the per-epoch permutations.
        consumed_samples: global stream position to start from; a multiple of
            ``micro_batch_size × world_size``.
        max_samples: stop before a round would go beyond this stream position
            (``None``: never stop).
        stream_offset: where position 0 of this sampler lies in the stream of ``seed``: the
            samples earlier readers of the same stream took (a job's phases of one sequence
            length continue one stream). ``consumed_samples`` and ``max_samples`` count
            from it.
    """

    def __init__(self, num_samples: int, *, micro_batch_size: int, rank: int,
                 world_size: int, seed: int, consumed_samples: int = 0,
                 max_samples: int | None = None, stream_offset: int = 0):
        self.num_samples = _check_int("num_samples", num_samples, 1)
        self.micro_batch_size = _check_int("micro_batch_size", micro_batch_size, 1)
        self.world_size = _check_int("world_size", world_size, 1)
        self.rank = _check_int("rank", rank, 0)
        if self.rank >= self.world_size:
            raise DataError(f"PretrainingSampler option rank={rank} must be < "
                            f"world_size={world_size}")
        self.seed = _check_int("seed", seed, 0)
        self.max_samples = None if max_samples is None else \
            _check_int("max_samples", max_samples, 0)
        self.consumed_samples = self._check_consumed(consumed_samples)
        self.stream_offset = _check_int("stream_offset", stream_offset, 0)
        self._perms: dict[int, np.ndarray] = {}

    @property
    def round_size(self) -> int:
        """Samples of one micro-batch round over all ranks: ``micro_batch_size × world_size``."""
        return self.micro_batch_size * self.world_size

    def _check_consumed(self, consumed_samples) -> int:
        consumed = _check_int("consumed_samples", consumed_samples, 0)
        if consumed % self.round_size:
            raise DataError(
                f"PretrainingSampler option consumed_samples={consumed} is not a multiple of "
                f"micro_batch_size × world_size = {self.micro_batch_size} × "
                f"{self.world_size}; resume from a count of completed optimizer steps, "
                "and pick a micro-batch size and world size that divide the global batch")
        return consumed

    def permutation(self, epoch: int) -> np.ndarray:
        """The sample order of ``epoch``; cached, keeping at most two epochs."""
        perm = self._perms.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, _TAG_PERM, epoch]).permutation(
                self.num_samples)
            # Only the epoch in use and its neighbour are ever needed again.
            for old in [e for e in self._perms if e < epoch - 1 or e > epoch + 1]:
                del self._perms[old]
            self._perms[epoch] = perm
        return perm

    def keys(self, start: int, count: int) -> list[tuple[int, int]]:
        """``(epoch, sample_index)`` of global stream positions ``[start, start + count)``."""
        out: list[tuple[int, int]] = []
        pos, end = start, start + count
        while pos < end:
            epoch, offset = divmod(pos, self.num_samples)
            take = min(end - pos, self.num_samples - offset)
            perm = self.permutation(epoch)
            out.extend((epoch, int(s)) for s in perm[offset:offset + take])
            pos += take
        return out

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        while self.max_samples is None or \
                self.consumed_samples + self.round_size <= self.max_samples:
            start = self.stream_offset + self.consumed_samples + self.rank * self.micro_batch_size
            batch = self.keys(start, self.micro_batch_size)
            # Advanced before the yield: once the caller holds the batch it counts as
            # consumed, so state_dict() taken then resumes after it.
            self.consumed_samples += self.round_size
            yield batch

    def __len__(self) -> int:
        """Micro-batches left for this rank; only defined with ``max_samples``."""
        if self.max_samples is None:
            raise TypeError("PretrainingSampler without max_samples is infinite")
        return max(0, (self.max_samples - self.consumed_samples) // self.round_size)

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed_samples, "seed": self.seed,
                "num_samples": self.num_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from ``state``; world and micro-batch size may differ from the saver's."""
        for name in ("seed", "num_samples"):
            if state.get(name) != getattr(self, name):
                raise DataError(
                    f"PretrainingSampler state has {name}={state.get(name)!r} but this "
                    f"sampler was built with {name}={getattr(self, name)!r}; resume with the "
                    "same seed and sample index, or start a new run")
        self.consumed_samples = self._check_consumed(state.get("consumed_samples"))
        logger.info("sampler resumes at consumed_samples=%d (epoch %d)",
                    self.consumed_samples, self.consumed_samples // self.num_samples)
