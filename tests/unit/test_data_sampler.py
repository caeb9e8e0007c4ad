"""PretrainingSampler: one global stream, exact resume, also on another world size."""
import collections

import numpy as np
import pytest

from vrgd_ds.data_pipeline.errors import DataError
from vrgd_ds.data_pipeline.sampler import PretrainingSampler


def run_steps(num_samples, *, steps, micro, world, accum, seed=7, consumed=0):
    """Simulate `steps` optimizer steps on `world` ranks as a training loop would.

    Returns the keys each step consumed (ranks' micro-batches in stream order) and the
    loop's own consumed_samples count after the last step.
    """
    iters = [iter(PretrainingSampler(num_samples, micro_batch_size=micro, rank=r,
                                     world_size=world, seed=seed, consumed_samples=consumed))
             for r in range(world)]
    per_step = []
    for _ in range(steps):
        step = []
        for _ in range(accum):
            for it in iters:  # round t: rank 0, then rank 1, ... = stream order
                step.extend(next(it))
        per_step.append(step)
        consumed += accum * world * micro
    return per_step, consumed


def test_each_epoch_is_a_permutation_and_epochs_differ():
    """Positions [eN, (e+1)N) visit every sample once, in a new order each epoch."""
    n = 37
    s = PretrainingSampler(n, micro_batch_size=1, rank=0, world_size=1, seed=3)
    keys = s.keys(0, 3 * n)
    orders = []
    for epoch in range(3):
        block = keys[epoch * n:(epoch + 1) * n]
        assert {e for e, _ in block} == {epoch}
        assert sorted(i for _, i in block) == list(range(n))
        orders.append([i for _, i in block])
    assert orders[0] != orders[1] != orders[2]
    other = PretrainingSampler(n, micro_batch_size=1, rank=0, world_size=1, seed=4)
    assert [i for _, i in other.keys(0, n)] != orders[0]
    again = PretrainingSampler(n, micro_batch_size=1, rank=0, world_size=1, seed=3)
    assert again.keys(0, 3 * n) == keys


def test_union_over_ranks_of_a_step_is_the_contiguous_stream_block():
    n, micro, world, accum = 50, 3, 4, 2
    ref = PretrainingSampler(n, micro_batch_size=1, rank=0, world_size=1, seed=7)
    per_step, _ = run_steps(n, steps=5, micro=micro, world=world, accum=accum)
    g = micro * world * accum
    for step, keys in enumerate(per_step):
        assert keys == ref.keys(step * g, g)


def test_rank_takes_every_world_size_th_micro_batch():
    n, micro, world = 40, 2, 3
    ref = PretrainingSampler(n, micro_batch_size=1, rank=0, world_size=1, seed=7)
    s = PretrainingSampler(n, micro_batch_size=micro, rank=1, world_size=world, seed=7)
    it = iter(s)
    for t in range(10):
        m = t * world + 1  # global micro-batch index of rank 1's t-th micro-batch
        assert next(it) == ref.keys(m * micro, micro)
        assert s.consumed_samples == (t + 1) * micro * world


def test_stop_and_resume_continues_the_stream_exactly():
    """A run stopped after 3 steps and rebuilt from the loop's count loses and repeats
    nothing compared with an uninterrupted run."""
    kw = dict(micro=4, world=2, accum=2)
    whole, _ = run_steps(45, steps=8, **kw)
    first, consumed = run_steps(45, steps=3, **kw)
    rest, _ = run_steps(45, steps=5, consumed=consumed, **kw)
    assert first + rest == whole


def test_a_stream_offset_continues_another_readers_stream_on_any_micro_batch():
    """A second reader of the stream with ``stream_offset`` at the first one's count takes the
    positions that follow (the next phase of one sequence length), also where the count is no
    multiple of its own round (12 samples, rounds of 8)."""
    first = PretrainingSampler(20, micro_batch_size=4, rank=0, world_size=1, seed=3)
    head = [k for _, batch in zip(range(3), first) for k in batch]
    second = [PretrainingSampler(20, micro_batch_size=4, rank=r, world_size=2, seed=3, stream_offset=12)
              for r in range(2)]
    tail = [k for _, batches in zip(range(2), zip(*second)) for batch in batches for k in batch]  # 2 rounds
    assert head + tail == first.keys(0, 28)
    assert sorted(i for e, i in head + tail if e == 0) == list(range(20))  # epoch 0 once, then epoch 1


@pytest.mark.parametrize("before,after", [
    (dict(micro=3, world=2, accum=2), dict(micro=2, world=3, accum=2)),  # 2 -> 3 ranks
    (dict(micro=3, world=4, accum=1), dict(micro=3, world=2, accum=2)),  # 4 -> 2 ranks
    (dict(micro=1, world=4, accum=3), dict(micro=6, world=1, accum=2)),  # micro 1 -> 6
])
def test_world_size_change_sees_each_sample_once_per_epoch(before, after):
    """Global batch 12 on both sides of the change; N = 31 so steps straddle epochs."""
    n = 31
    first, consumed = run_steps(n, steps=3, **before)
    rest, _ = run_steps(n, steps=8, consumed=consumed, **after)
    keys = [k for step in first + rest for k in step]
    assert len(keys) == 11 * 12
    counts = collections.Counter(keys)
    assert max(counts.values()) == 1
    for epoch in range(len(keys) // n):
        assert sorted(i for e, i in keys if e == epoch) == list(range(n))
    ref = PretrainingSampler(n, micro_batch_size=1, rank=0, world_size=1, seed=7)
    assert keys == ref.keys(0, len(keys))


def test_micro_batch_straddling_the_epoch_boundary():
    n = 10
    s = PretrainingSampler(n, micro_batch_size=4, rank=0, world_size=1, seed=1,
                           consumed_samples=8)
    batch = next(iter(s))
    p0 = [i for _, i in s.keys(0, n)]
    p1 = [i for _, i in s.keys(n, n)]
    assert batch == [(0, p0[8]), (0, p0[9]), (1, p1[0]), (1, p1[1])]


def test_max_samples_stops_after_whole_rounds_and_sets_len():
    s = PretrainingSampler(20, micro_batch_size=3, rank=1, world_size=2, seed=0,
                           max_samples=20)
    assert len(s) == 3  # rounds of 6: 0-6, 6-12, 12-18; 18-24 would pass 20
    batches = list(s)
    assert len(batches) == 3 and all(len(b) == 3 for b in batches)
    assert s.consumed_samples == 18 and len(s) == 0
    with pytest.raises(TypeError, match="infinite"):
        len(PretrainingSampler(20, micro_batch_size=3, rank=0, world_size=1, seed=0))


def test_state_dict_round_trip_onto_another_world_size():
    a = PretrainingSampler(100, micro_batch_size=2, rank=0, world_size=4, seed=5)
    it = iter(a)
    for _ in range(3):
        next(it)
    state = a.state_dict()
    assert state == {"consumed_samples": 24, "seed": 5, "num_samples": 100}
    b = PretrainingSampler(100, micro_batch_size=4, rank=1, world_size=2, seed=5)
    b.load_state_dict(state)
    assert b.consumed_samples == 24
    assert next(iter(b)) == a.keys(24 + 4, 4)


@pytest.mark.parametrize("kwargs,option", [
    (dict(rank=2, world_size=2), "rank=2"),
    (dict(rank=-1), "rank=-1"),
    (dict(world_size=0), "world_size=0"),
    (dict(micro_batch_size=0), "micro_batch_size=0"),
    (dict(micro_batch_size=True), "micro_batch_size=True"),
    (dict(seed=-3), "seed=-3"),
    (dict(consumed_samples=6), "consumed_samples=6"),
    (dict(consumed_samples=-8), "consumed_samples=-8"),
    (dict(num_samples=0), "num_samples=0"),
    (dict(max_samples=1.5), "max_samples=1.5"),
])
def test_invalid_options_name_the_option(kwargs, option):
    args = dict(num_samples=10, micro_batch_size=2, rank=0, world_size=2, seed=0)
    args.update(kwargs)
    num_samples = args.pop("num_samples")
    with pytest.raises(DataError, match=option.replace("(", r"\(")):
        PretrainingSampler(num_samples, **args)


def test_load_state_dict_rejects_another_seed_or_dataset_or_misaligned_count():
    s = PretrainingSampler(10, micro_batch_size=2, rank=0, world_size=2, seed=0)
    with pytest.raises(DataError, match="seed=1"):
        s.load_state_dict({"consumed_samples": 0, "seed": 1, "num_samples": 10})
    with pytest.raises(DataError, match="num_samples=11"):
        s.load_state_dict({"consumed_samples": 0, "seed": 0, "num_samples": 11})
    with pytest.raises(DataError, match="consumed_samples=6"):
        s.load_state_dict({"consumed_samples": 6, "seed": 0, "num_samples": 10})
    assert s.consumed_samples == 0


def test_permutation_cache_keeps_at_most_two_epochs():
    s = PretrainingSampler(5, micro_batch_size=5, rank=0, world_size=1, seed=0)
    it = iter(s)
    first = [next(it) for _ in range(6)]
    assert len(s._perms) <= 2
    assert [b[0][0] for b in first] == list(range(6))
    assert np.array_equal(s.permutation(0), np.array([i for _, i in first[0]]))
