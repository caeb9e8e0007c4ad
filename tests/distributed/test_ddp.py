"""``vrgd_ds.ddp.attach`` on 2 real CPU ranks (gloo): each case is its own test, run by
``ddp_worker.py`` in the session's rank pool (``pool.py``), every rank's result checked.

Training cases: 3 steps of DDP with 100-byte buckets (several buckets, one holding several
tensors) against a single-process reference that sees every rank's gradient and feeds the
same optimizer class with sums computed by hand. Error as ``‖θ_ddp − θ_reference‖ /
‖θ_reference − θ_0‖``: at most 1e-5 (fp32; with 2 ranks the sums are the same additions, seen
0), and far below the distance to the run without variance reduction (gamma = 1), so a mistake
in the statistics would not pass unseen (2% off in Σg² already gives 0.1-0.6).
"""
from __future__ import annotations

import pytest

RANKS = 2
TOL = 1e-5
CONTRAST = 100  # the gamma = 1 run must be at least this many tolerances away
TRAIN_CASES = ["VRSGD", "VRAdam", "VRSGD_no_sync", "VRAdam_no_sync", "VRSGD_bucket_view"]
FUSED_CASES = ["fused_" + name for name in TRAIN_CASES]  # squares="per_micro_step": the comm hook


_RUN: dict[str, list[dict]] = {}  # a case read by several tests runs once


def _case(pool, name: str) -> list[dict]:
    if name not in _RUN:
        _RUN[name] = pool.run("ddp_worker", "run_case", {"name": name})
    per_rank = _RUN[name]
    assert len(per_rank) == RANKS
    for rank, res in enumerate(per_rank):
        assert "error" not in res, f"{name} (rank {rank}): {res['error']}\n{res.get('trace', '')}"
    return per_rank


@pytest.mark.parametrize("name", TRAIN_CASES + FUSED_CASES)
def test_training_equals_single_process_reference(pool, name):
    for res in _case(pool, name):
        assert res["err"] <= TOL, res
        assert res["contrast"] >= CONTRAST * TOL, res
        assert res["moved"] > 0


@pytest.mark.parametrize("name", ["VRAdam_gsnr_weights", "VRAdam_gsnr_weights_no_sync", "VRSGD_gsnr_off"])
def test_param_groups_with_gsnr_off_train_as_the_reference(pool, name):
    """DDP's buckets hold every parameter, the statistics only those of ``gsnr=True`` groups: the
    default scheme reads the buckets for those alone (the biases in a ``gsnr=False`` group, or
    every parameter). Fails on the code before: the first synchronised backward raised KeyError in
    DDP's communication hook, looking up the statistics of a parameter that had none."""
    for res in _case(pool, name):
        assert res["err"] <= TOL, res
        assert res["moved"] > 0
        if name != "VRSGD_gsnr_off":  # with GSNR off gamma = 1 changes nothing
            assert res["contrast"] >= CONTRAST * TOL, res


def test_accumulation_with_every_backward_synchronised_equals_the_reference(pool):
    """3 micro-steps a step, each backward synchronised (no ``no_sync()``): DDP's bucket holds
    ``.grad``, which from the second micro-step on is the reduced mean of the ones before plus the
    new local gradient; those micro-steps are read by tensor hooks, and training equals the
    reference with n = ranks × 3. Fails on the code before, which read every micro-step from the
    buckets (Σg and Σg² of the running sums)."""
    for res in _case(pool, "VRAdam_sync_each"):
        assert res["err"] <= TOL, res
        assert res["contrast"] >= CONTRAST * TOL, res
        assert all(s["n"] == float(RANKS * 3) for s in res["steps"]), res["steps"]


@pytest.mark.parametrize("name", [pytest.param("VRAdam_cleared", marks=pytest.mark.exhaustive), "VRAdam_no_sync_cleared",
                                  pytest.param("fused_VRAdam_cleared", marks=pytest.mark.exhaustive),
                                  "fused_VRAdam_no_sync_cleared"])
def test_a_step_the_caller_skipped_then_model_zero_grad_leaks_no_statistics(pool, name):
    """Before each step, backward passes on other batches, then ``model.zero_grad()`` and no
    optimizer step (a step GradScaler skipped, in HF Trainer's order): each step's statistics are
    its own (n = ranks × its backward passes) and training equals the reference. Fails on the old
    code: the per-step scheme counted the skipped step's groups too (n = 4 or 8 for 2 or 4, the
    reference missed by far more than the tolerance), and the fused scheme refused the step's
    backward as a second synchronised one; with accumulation under ``no_sync()``
    (``fused_VRAdam_no_sync_cleared``) it still did, until the cleared gradients were looked for
    at every forward, not only at a synchronising one."""
    micro = 2 if "no_sync" in name else 1
    groups = RANKS * (1 if name.startswith("fused") else micro)
    for res in _case(pool, name):
        assert "error" not in res, res
        assert all(s["n"] == float(groups) for s in res["steps"]), res["steps"]
        assert res["err"] <= TOL and res["contrast"] >= CONTRAST * TOL, res


@pytest.mark.parametrize("name", ["VRAdam_no_sync_late_zero_grad", "VRAdam_sync_each_late_zero_grad"])
def test_zero_grad_between_a_steps_first_forward_and_its_backward_keeps_the_step(pool, name):
    """``loss = model(x); opt.zero_grad(); loss.backward()`` at a step's first micro-step, with
    accumulation (under ``no_sync()``, or every backward synchronised): the ``zero_grad`` before
    any backward of the step does not end it, so each step's statistics are its own. Fails on the
    old code: the reset started a new step, the second forward was taken for its first, and that
    backward was read from DDP's bucket, which held the accumulated ``.grad`` (Σg off by 1.4 on the
    test model)."""
    for res in _case(pool, name):
        assert "error" not in res, res
        assert all(s["n"] == float(RANKS * 2) for s in res["steps"]), res["steps"]
        assert res["err"] <= TOL and res["contrast"] >= CONTRAST * TOL, res


def test_an_evaluation_between_steps_is_no_part_of_a_step(pool):
    """A forward under ``torch.no_grad()`` after each step (an evaluation): the statistics are the
    steps' own and nothing is said of dropped statistics. Fails on the old code, which took the
    evaluation for a step's first forward and the next step's for its second, finding the
    gradients cleared: a warning that statistics were dropped, though none were."""
    for res in _case(pool, "VRAdam_evaluated"):
        assert "error" not in res, res
        assert all(s["n"] == float(RANKS) for s in res["steps"]) and res["err"] <= TOL, res
        assert not [w for w in res["warned"] if "dropped" in w], res["warned"]


def test_a_second_synchronised_backward_is_refused_under_the_fused_scheme(pool):
    """``squares="per_micro_step"`` reduces each rank's gradient once a step; a second synchronised
    backward before the step reduces the first one's mean plus its own gradient. It is refused
    naming the fix. Fails on the code before, which overwrote the statistics with that sum's."""
    per_rank = pool.run("ddp_worker", "run_case", {"name": "fused_VRAdam_sync_each"})
    for res in per_rank:
        assert "reduces each rank's gradient once a step" in res.get("error", ""), res


def test_ranks_that_ran_unequal_backward_passes_are_refused(pool):
    """Rank 0 accumulates 3 micro-batches under ``no_sync()``, rank 1 2. Before, each rank took
    n = 2 × its own count (6 and 4, for 5 groups) and its own step: DDP's replicas drifted apart
    silently. Now the step's collective carries the counts and both ranks raise, naming the fix
    (fails on the old code)."""
    for res in pool.run("ddp_worker", "run_case", {"name": "VRAdam_no_sync_uneven"}):
        assert "needs the same number of backward() calls per step on every rank" in res.get("error", ""), res
        assert "ran 3 backward passes" in res["error"] or "ran 2 backward passes" in res["error"], res


@pytest.mark.exhaustive  # 4 ranks; make test: two ranks' unequal counts refused
def test_a_rank_whose_count_is_the_mean_of_unequal_counts_refuses_too(pool4):
    """4 ranks accumulate 1, 2, 3 and 2 micro-batches: the counts sum to 4 × 2, so ranks 1 and 3
    found the sum they expected. Every rank refuses the step now (the collective carries the
    squared counts too, whose sum is 4 × 2² only where every count is 2). Fails on the old code:
    ranks 1 and 3 took the step, the others raised, and the two halves went on apart."""
    per_rank = pool4.run("ddp_worker", "run_case", {"name": "spread"})
    for rank, res in enumerate(per_rank):
        assert "needs the same number of backward() calls per step on every rank" in res.get("error", ""), res
        count = (1, 2, 3, 2)[rank]
        assert f"this rank ran {count} backward passes in an optimizer step, the 4 ranks 8 together" \
               + (", not 2 each:" if count == 2 else ":") in res["error"], res


def test_a_rank_whose_passes_skip_the_gsnr_groups_refuses_with_the_others(pool):
    """The GSNR group holds only a branch that rank 1's 2 micro-batches (under ``no_sync()``)
    skip: rank 1's tensor hooks count no backward pass, rank 0's two. Both ranks refuse the step,
    naming the counts. Fails on the old code: rank 1 raised alone (fewer than 2 gradient groups)
    before the statistics' all-reduce, which rank 0 entered and waited in (the case's 180 s)."""
    for rank, res in enumerate(pool.run("ddp_worker", "run_case", {"name": "branch_no_sync"})):
        assert "needs the same number of backward() calls per step on every rank" in res.get("error", ""), res
        assert f"this rank ran {2 - 2 * rank} backward passes in an optimizer step, the 2 ranks 2 together" \
            in res["error"], res


@pytest.mark.parametrize("name", TRAIN_CASES)
def test_per_step_groups_are_ranks_times_backward_passes(pool, name):
    """The default scheme: every backward of every rank is a group, no_sync() micro-steps
    included, and one all-reduce of [Σg | Σg²] per step (twice the fp32 gradient's bytes),
    DDP's own reduction torch's default all-reduce of each bucket. Where every backward
    synchronises the micro-steps are read from DDP's buckets: no parameter hook, one launch per
    bucket; a step accumulating under no_sync() reads them by a hook per parameter."""
    micro = {"VRSGD_no_sync": 2, "VRAdam_no_sync": 3}.get(name, 1)
    for res in _case(pool, name):
        numel = sum(res["param_numels"])
        for s in res["steps"]:
            assert s["n"] == float(RANKS * micro)
            assert s["collectives"] == 1 and s["all_reduce_calls"] == 1 + s["ddp_reductions"], s
            # and one more element each half: the backward passes, padded to the arena's 4 (16 B)
            assert s["bytes_sent"] == 2 * 4 * (-(-(numel + 1) // 4) * 4), s
            if micro == 1:
                assert s["hooks"] == 0 and s["launches"] == s["ddp_reductions"] > 0, s
            else:
                assert s["hooks"] == len(res["param_numels"]) and s["launches"] == micro * s["hooks"], s


@pytest.mark.parametrize("name", TRAIN_CASES)
def test_statistics_from_ddps_buckets_equal_the_hooks_bit_for_bit(pool, name):
    """``micro_steps="auto"`` (DDP's buckets where every backward synchronises) against
    ``"hooks"`` (a tensor hook per parameter): every step's Σg, Σg², n and the trained parameters
    are bit-equal."""
    for auto, hooks in zip(_case(pool, name), _case(pool, "hooks_" + name)):
        assert auto["moments"] == hooks["moments"] and len(auto["moments"]) == 3
        assert auto["params"] == hooks["params"]


@pytest.mark.parametrize("name", FUSED_CASES)
def test_fused_groups_are_ranks(pool, name):
    for res in _case(pool, name):
        assert [s["n"] for s in res["steps"]] == [float(RANKS)] * len(res["steps"])


@pytest.mark.parametrize("name", FUSED_CASES)
def test_one_fused_collective_per_bucket(pool, name):
    for res in _case(pool, name):
        numel = sum(res["param_numels"])
        for s in res["steps"]:
            buckets = len(s["ddp_bucket_numels"])
            assert s["collectives"] == s["all_reduce_calls"] == s["buckets"] == buckets, s
            assert s["bytes_sent"] == 2 * 4 * numel, s  # [g | g²] in fp32, every element once
        rebuilt = res["steps"][-1]["ddp_bucket_numels"]
        assert len(rebuilt) >= 3, "the test needs several buckets"
        assert any(k not in res["param_numels"] for k in rebuilt), "the test needs a bucket of several tensors"


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_low_precision_model(pool, name):
    for res in _case(pool, name):
        assert res["n"] == RANKS and res["n_after_reset"] == 0
        assert res["stat_dtypes"] == ["torch.float32"]
        assert res["grad_dtypes"] == [f"torch.{'bfloat16' if name == 'bf16' else 'float16'}"]
        assert res["sum_g_err"] <= 1e-6 * res["sum_sq_scale"] and res["sum_sq_err"] <= 1e-6 * res["sum_sq_scale"], res
        assert res["grad_err"] == 0.0, "the fp32 mean rounded once to the model dtype"


@pytest.mark.parametrize("name", ["scaler", "fused_scaler"])
def test_a_grad_scaler_told_to_the_optimizer_trains_as_without_one(pool, name):
    """A ``torch.amp.GradScaler`` told to the optimizer (``set_grad_scaler``) under either scheme:
    the steps equal the unscaled run's exactly (S = 2^20 is a power of two), the GSNR floor
    included. Under ``squares="per_micro_step"`` every step raised "this engine's path removes its
    own loss scale: call set_grad_scaler(None)", though DDP's path removes none, and that advice
    left S² in the statistics. Fails on the old code (fused_scaler)."""
    for res in _case(pool, name):
        assert res["diff"] == 0.0 and res["moved"] > 0, res


@pytest.mark.parametrize("name", ["join", pytest.param("fused_join", marks=pytest.mark.exhaustive)])
def test_training_under_ddps_join_is_refused(pool, name):
    """``ddp.join()`` (uneven inputs): a rank out of data serves the others' reductions with zero
    buckets through the communication hook. A training forward under it is refused on every rank,
    naming the fix; an evaluation is not. Fails on the code before, which accepted it: the fused
    scheme counted the zero buckets as gradient groups (the GSNR biased low), and the per-step
    scheme's step collective met the joined rank's shadow all-reduces (a hang or a gloo error)."""
    for res in _case(pool, name):
        assert "DistributedDataParallel.join() (uneven inputs) is not supported" in res["train"], res
        assert "drop_last=True" in res["train"] and res["evaluated"], res


def test_bad_setups_raise(pool):
    """Among them ``micro_steps`` with ``squares="per_micro_step"``, whose communication hook reads
    every micro-step: it was accepted and ignored (fails on the old code). A VRGD optimizer inside
    a wrapper (``trainer.optimizer`` under HF Trainer is Accelerate's ``AcceleratedOptimizer``) is
    attached, not refused as "not a VRGD optimizer" (fails on the old code)."""
    for res in _case(pool, "bad"):
        assert "micro_steps='hooks' applies to squares='per_step' only" in res["micro_steps_fused"], res
        assert "needs a VRGD optimizer" in res["non_gsnr"] and "got SGD" in res["non_gsnr"]
        assert res["wrapped"] is True
        assert "needs >= 2 ranks" in res["one_rank"] and "use >= 2 ranks or gsnr=False" in res["one_rank"]
        assert res["one_rank_gsnr_off"] is True
        assert "not reduced by this DDP model" in res["foreign_params"]


@pytest.mark.exhaustive  # about 10 s (a world of 3: on 2 and 4 ranks the two roundings agree)
def test_the_per_step_scheme_leaves_ddps_reduction_bit_for_bit_on_3_ranks(pool4):
    """DDP on 3 ranks (of the 4-rank pool): with the statistics attached, the gradients DDP hands
    the optimizer are its own bit for bit, and VRAdam with ``gamma=1`` trains exactly as with its
    GSNR off on plain DDP. Fails on the old code: the per-step scheme's communication hook was
    torch's ``default_hooks.allreduce_hook``, which divides by the world size where DDP's reducer
    multiplies by its inverse (about half the elements 1 ulp off on 3 ranks; 2 and 4 are exact)."""
    per_rank = pool4.run("ddp_worker", "run_case", {"name": "three_ranks"})
    for rank, res in enumerate(per_rank):
        assert "error" not in res, f"rank {rank}: {res['error']}\n{res.get('trace', '')}"
    assert [res["idle"] for res in per_rank] == [False, False, False, True]
    for res in per_rank[:3]:
        assert res["grads_differ"] == [0, 0, 0] and res["weights_differ"] == 0, res
        assert res["moved"] > 0


@pytest.mark.parametrize("name", ["deleted", "fused_deleted"])
def test_a_deleted_optimizers_statistics_go_with_it_and_ddp_reduces_as_its_own(pool, name):
    """An optimizer attached to a DDP model, stepped and deleted (the garbage collector off), a
    torch SGD on the same model after it: the statistics are freed with the optimizer, and the
    model's reductions are DDP's own again, bit for bit against a fresh DDP model, and the tensor
    hooks the statistics installed are removed. Fails on the old code, where the communication
    hook's state held the statistics: they stayed alive, fed by every reduction (the
    per-micro-step scheme's collective of ``[g | g²]`` in each bucket's place). The callbacks
    chained on the step's collectives are kept past the deletion, as the process group's thread
    may still hold one: ``fused_deleted`` fails on the code before, whose callback on the fused
    all-reduce held the statistics (without the callbacks kept: a flaky failure, about 1 in 12
    deletions)."""
    for res in _case(pool, name):
        assert res.get("freed") and res["grads_differ"] == [0, 0] and res["weights_differ"] == 0, res
        # the per-step scheme's tensor hooks (a step under no_sync()) go with the statistics
        assert res["hooked"] == ([6, 0] if name == "deleted" else [0, 0]), res


@pytest.mark.parametrize("name", ["reattach", "fused_reattach"])
def test_a_new_optimizer_attached_to_the_same_ddp_model_trains_as_on_a_fresh_one(pool, name):
    """A second ``attach`` on one DDP model (an optimizer rebuilt mid-training): the new optimizer
    steps as one attached to a fresh DDP model with the same weights, bit for bit; the first gets
    no more statistics (its step is an error, not a step on stale sums); attaching with the other
    ``squares`` names the one in place. Fails on the old code: the second attach raised torch's
    "register_comm_hook ... can only be called once" after the new optimizer had installed its
    own hooks."""
    for res in _case(pool, name):
        assert res["refused"] and "this DDP model is attached with squares=" in res["refused"], res
        assert res["stale"] and "at least 2 gradient groups" in res["stale"], res
        assert res["weights_differ"] == 0 and res["n"] == (4 if name == "reattach" else 2), res
