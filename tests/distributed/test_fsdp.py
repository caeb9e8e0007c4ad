"""``vrgd_ds.fsdp`` on 2 and 4 CPU ranks (gloo): models sharded with FSDP2's ``fully_shard`` (FSDP,
and HSDP 2×2 on 4 ranks) against the same optimizer class on the unsharded model in one process
fed every rank's micro-batches (``fsdp_worker.py``).

The model has a tensor of fewer rows than 4 ranks (uneven dim 0, and an empty shard on 4 ranks);
cases add a parameter no forward uses (FSDP leaves it out of its reduce-scatter) and a loss taken
in chunks with one backward per chunk (each backward is a reduction, so a gradient group). Error
as ``‖θ − θ_ref‖ / ‖θ_ref − θ_0‖`` after 3 steps: at most 1e-5 (fp32; seen 2e-7 to 2e-6), and the
same distance to the run at ``gamma = 1`` at least 1e4 times larger, so statistics that were wrong
would not pass unseen.
"""
from __future__ import annotations

import pytest

TOL = 1e-5
CONTRAST = 1e4

CASES2 = {
    "fsdp-VRLamb-acc2": dict(opt="VRLamb", layout="fsdp", acc=2),
    "fsdp-VRAdam-acc1-unused": dict(opt="VRAdam", layout="fsdp", acc=1, unused=True),
    "fsdp-VRLamb-acc1-chunks2": dict(opt="VRLamb", layout="fsdp", acc=1, chunks=2),
    "fsdp-VRLars-acc2-unused": dict(opt="VRLars", layout="fsdp", acc=2, unused=True),
    # FSDP's own averaging reduce-scatter (gloo averages since torch 2.10, pytorch issue
    # #162338); before, refused as if gloo summed, though the gradients and statistics were right
    "fsdp-VRAdam-acc2-average": dict(opt="VRAdam", layout="fsdp", acc=2, average=True),
    # before each step, backward passes then model.zero_grad() with no optimizer step (a step
    # GradScaler skipped): before, their statistics stayed in the next step's (n doubled, and an
    # overflow's infinite squares skipped the next step too)
    "fsdp-VRAdam-acc2-cleared": dict(opt="VRAdam", layout="fsdp", acc=2, cleared=True),
}
# make test runs the rest: every layout, member and feature at least once (make test-all: all)
EXHAUSTIVE = {"fsdp-VRLars-acc2-unused", "hsdp-VRAdam-acc1-chunks2"}
TP_EXHAUSTIVE = {"VRLamb", "VRAdam", "VRLars"}  # make test: FSDP + TP through the MERIT case below


def _tier(names, exhaustive):
    return [pytest.param(n, marks=pytest.mark.exhaustive) if n in exhaustive else n for n in names]
CASES4 = {
    "hsdp-VRLamb-acc2": dict(opt="VRLamb", layout="hsdp", acc=2),
    "fsdp-VRMerit-acc1-unused": dict(opt="VRMerit", layout="fsdp", acc=1, unused=True),
    "hsdp-VRAdam-acc1-chunks2": dict(opt="VRAdam", layout="hsdp", acc=1, chunks=2),
    # n = 4 ranks: at n = 2 the reference's one backward of a rank's summed losses against FSDP's
    # accumulated backward passes (another summation order) is amplified (seen 4e-5)
    "fsdp-VRAdam-acc3-no_sync": dict(opt="VRAdam", layout="fsdp", acc=3, no_sync=True),
    # FSDP2's HSDP accumulation: the replicas' all-reduce deferred to the last micro-step, the shards'
    # .grad unset until then (the check for a model.zero_grad() must not take that for a clear)
    "hsdp-VRAdam-acc2-defer_all_reduce": dict(opt="VRAdam", layout="hsdp", acc=2, defer_all_reduce=True),
}
_RUN: dict[str, list[dict]] = {}


def _run(pool, name: str, case: dict) -> list[dict]:
    if name not in _RUN:
        _RUN[name] = pool.run("fsdp_worker", "train_case", case)
    for rank, res in enumerate(_RUN[name]):
        assert "error" not in res, f"{name} (rank {rank}): {res['error']}\n{res.get('trace', '')}"
    return _RUN[name]


def _check(per_rank: list[dict], case: dict) -> None:
    """``no_sync``: ``set_requires_gradient_sync(False)`` before the last micro-step, so one
    reduction of each rank's accumulated gradient per step: n = ranks (the reference takes each
    rank's accumulated gradient as one group)."""
    acc, chunks, world = case["acc"], case.get("chunks", 1), len(per_rank)
    if case.get("no_sync"):
        acc = 1  # one reduction per step
    for res in per_rank:
        assert res["err"] <= TOL, res
        assert res["contrast"] >= CONTRAST * res["err"] and res["contrast"] > 0.1, res
        # DCP-ready state: every state tensor a DTensor sharded like its parameter
        assert res["state_types"] == ["DTensor"], res
        # sharded statistics: [Σg | Σg²] of this rank's padded shards, no full-size buffer
        assert res["arena"] < 2 * res["numel"] and res["buffer_bytes"] == 4 * res["arena"], res
        for s in res["steps"]:
            assert s["n"] == world * acc * chunks, s  # shard × replicate × reductions
            assert s["reductions"] == 3 * acc * chunks and s["hooks"] == 0, s
            hsdp = case["layout"] == "hsdp"
            assert s["collectives"] == s["reductions"] + hsdp, s
            sent = acc * chunks * res["shard"] * (res["padded"] - res["spare_padded"]) * 4  # the fp32 squares
            assert s["bytes"] == sent + (4 * res["arena"] if hsdp else 0), s
            assert s["layout_collectives"] <= 5, s  # batched per-tensor tables, not one per tensor


@pytest.mark.parametrize("name", _tier(CASES2, EXHAUSTIVE))
def test_fsdp_on_2_ranks_equals_the_single_process_optimizer(pool, name):
    _check(_run(pool, name, CASES2[name]), CASES2[name])


@pytest.mark.parametrize("name", _tier(CASES4, EXHAUSTIVE))
def test_fsdp_and_hsdp_on_4_ranks_equal_the_single_process_optimizer(pool4, name):
    _check(_run(pool4, name, CASES4[name]), CASES4[name])


REFUSALS = {
    "offload": ("UnsupportedFSDPConfiguration", "CPU offload"),
    "fused_group": ("UnsupportedFSDPConfiguration", "fused=True/foreach=None in a param group"),
    "twice": ("UnsupportedFSDPConfiguration", "a second attach to one model"),
    "uneven_sync": ("UnsupportedFSDPConfiguration", "reduced some parameters 1 times and others 2 times"),
    # before: accepted, Σg taken from FSDP's bf16 reduce-scatter against fp32 squares
    "bf16_reduce": ("UnsupportedFSDPConfiguration", "gradients reduced in bfloat16"),
    # before: "build the optimizer on model.parameters() after fully_shard", which the user had done
    "ignored": ("ValueError", "left out with fully_shard(..., ignored_params=...)"),
    # before: "parameters were added to the optimizer after the engine laid them out", which the user had not done
    "unfrozen": ("RuntimeError", "frozen (requires_grad False) when the engine laid the model out"),
    # before: "use vrgd_ds.ddp for replication", which takes a DDP model, not this one
    "replicated": ("UnsupportedFSDPConfiguration", "torch's DistributedDataParallel and vrgd_ds.ddp.attach"),
    # model.to() after attach (FSDP2 replaces the local shards): before, "it was frozen (requires_grad
    # False) when the engine laid the model out", which it was not
    "moved": ("UnsupportedFSDPConfiguration", "the model's shards were replaced after vrgd_ds.fsdp.attach"),
    "moved_base": ("RuntimeError", "or the model was moved or cast (model.to(...)) after"),
    # FSDP's own setters after attach: before, accepted, the reductions unrecorded and every tensor
    # stepping as plain LAMB (its moments all zero)
    "comm_after": ("UnsupportedFSDPConfiguration", "reduce-scatter was replaced after vrgd_ds.fsdp.attach"),
    "hook_after": ("UnsupportedFSDPConfiguration", "set_all_reduce_hook after vrgd_ds.fsdp.attach"),
}


@pytest.mark.parametrize("what", REFUSALS)
def test_set_ups_the_statistics_cannot_see_are_refused_naming_the_option(pool, what):
    kind, words = REFUSALS[what]
    for res in pool.run("fsdp_worker", "refusal_case", {"what": what}):
        assert res["type"] == kind and words in res["message"], res


def test_torchtitans_container_on_a_model_sharded_over_one_rank_names_torchtitans_option(pool):
    """torchtitan always applies ``fully_shard``, over one rank where
    ``parallelism.data_parallel_shard_degree`` is 1 (here HSDP 2 × 1): the container's refusal names
    that option. Fails on the code before, whose refusal told the user to replicate the model with
    torch's DistributedDataParallel and vrgd_ds.ddp.attach, which torchtitan's trainer cannot."""
    pytest.importorskip("torchtitan", reason="the torchtitan extra is not installed")
    for res in pool.run("fsdp_worker", "refusal_case", {"what": "titan_one_shard"}):
        assert res["type"] == "UnsupportedFSDPConfiguration", res
        assert "sharded over 1 rank (parallelism.data_parallel_shard_degree=1)" in res["message"], res
        assert "DistributedDataParallel" not in res["message"], res


def test_torchtitans_container_refuses_a_base_member_on_tensor_parallel_dtensors_without_fsdp(pool):
    """A base member (``Lamb``) on a model whose parameters are DTensors of tensor parallelism and
    that has no FSDP module (a custom ``parallelize_fn``): the container attaches it, and attach
    refuses the set-up when the container is built, naming it. Fails on the code that first let a
    base member skip attach on any model without an FSDP module, which built the container and
    failed at the first step instead, telling a torchtitan user to call vrgd_ds.fsdp.attach."""
    pytest.importorskip("torchtitan", reason="the torchtitan extra is not installed")
    for res in pool.run("fsdp_worker", "refusal_case", {"what": "titan_tp_base"}):
        assert res["type"] == "TypeError" and "needs a model sharded with torch.distributed.fsdp.fully_shard" in \
            res["message"], res


def test_a_base_optimizer_beside_a_vrgd_one_on_one_model_is_attached(pool):
    """A base optimizer (``Lamb``) leaves FSDP's reduce-scatter alone, so it attaches beside a VRGD
    optimizer with the GSNR on the same model (torchtitan's container, param groups split between
    them). Fails on the code before, which refused it as a second attach when the VRGD one came
    first, and accepted it when it came second."""
    for res in pool.run("fsdp_worker", "refusal_case", {"what": "twice_base"}):
        assert res["type"] is None, res


def test_a_model_whose_optimizer_is_gone_is_attached_to_a_new_one(pool):
    """The optimizer, after a step, deleted; a new VRGD optimizer built on the same model and
    attached: the earlier statistics are freed with the optimizer (reference counting, the
    garbage collector off), and the new ones count the step's groups (n = ranks × 2). Fails on the
    old code: FSDP's reduce-scatter and post-backward held the earlier statistics (each backward
    still reduced their squares), and the new attach was refused as a second one; then, until the
    collector ran, the statistics' buckets held them in a cycle (a rank whose collector ran first
    left the others' extra collective unmatched: a hang)."""
    for res in pool.run("fsdp_worker", "refusal_case", {"what": "rebuilt"}):
        assert res["type"] is None and res["freed"] and res["n"] == 4.0, res
        # attached while the last step's gradients were still there: refused (fails on the code
        # before, which took them into the new optimizer's first step beside the 4 groups it counted)
        assert "an attach while the parameters hold gradients" in res["held"] and "zero_grad()" in res["held"], res


@pytest.mark.exhaustive  # 4 ranks; make test: torchtitan's pipeline degree refused in-process
def test_a_model_sharded_over_part_of_the_ranks_is_refused(pool4):
    """Pipeline parallelism, each half of the ranks a stage with the model sharded over its half:
    the per-tensor sums run over every rank as one model's, so it is refused, naming the mesh.
    Fails on the code before, which took the other stage's tensors for copies of this one's:
    stage 1's trust ratios and GSNR means came from stage 0's tensors (about 20% off)."""
    for res in pool4.run("fsdp_worker", "refusal_case", {"what": "pipeline"}):
        assert res["type"] == "UnsupportedFSDPConfiguration", res
        assert "a model whose device meshes cover 2 of the 4 ranks" in res["message"], res


def test_hsdp_replicas_that_reduced_unequally_often_are_refused(pool4):
    """HSDP 2 × 2 with the replicas' all-reduce deferred (``set_requires_all_reduce``): replica 0
    runs 2 micro-steps, replica 1 runs 3, so the statistics' counts differ (n = 8 against 12).
    Every rank refuses the step, naming both counts and the fix. Fails on the code before: the step
    was taken, each replica with its own n, and the replicas' parameters drifted apart."""
    for rank, res in enumerate(pool4.run("fsdp_worker", "refusal_case", {"what": "uneven_replicas"})):
        assert res["type"] == "RuntimeError", res
        assert f"this rank ran {2 + rank // 2} reductions of each parameter in an optimizer step, the 2 ranks 5 " \
               "together: under HSDP every replica" in res["message"], res


def test_dcp_checkpoint_resumes_on_the_same_and_on_another_world_size(pool4, pool, tmp_path):
    """The optimizer state is DTensors sharded like the parameters: a DCP checkpoint saved on 4
    ranks resumes on 4 bit for bit and on 2 (the same micro-batches as 2 × accumulation 2: the
    same sums in another order) to fp32 rounding. ``get_state_dict`` on the fresh optimizer runs
    torch's zero-gradient, lr = 0 step to create the state: it creates it at step 0 with the GSNR
    momentum at zero and moves no parameter (a real step there raised n = 0 < 2)."""
    pool4.run("fsdp_worker", "dcp_case", {"phase": "save", "dir": str(tmp_path)})
    for ranks, p in ((4, pool4), (2, pool)):
        if ranks == 2:
            pool4.close(ask=False)
        for res in p.run("fsdp_worker", "dcp_case", {"phase": "load", "dir": str(tmp_path)}):
            assert res["init_steps"] == [0.0] and res["init_state_types"] == ["DTensor"], res
            assert res["init_gsnr_avg_zero"] and not res["init_moved"] and res["init_reductions"] == 0, res
            assert res["loaded_steps"] == [2.0], res
            assert res["moved"] > 1e-3, res
            if ranks == 4:
                assert res["bit_equal"], res
            else:
                assert res["max_diff"] <= 1e-6, res


@pytest.mark.exhaustive  # make test: the rule in-process (tests/unit/test_optimizers.py)
def test_a_first_step_at_lr_0_is_taken_by_every_rank_whatever_its_shard_holds(pool):
    """A real first step at lr 0 whose gradient is zero on one rank's shard: the state-init
    decision (``vrgd_ds.optim.state.is_state_init``) is every rank's, so both ranks step twice.
    Fails on the code before: rank 1 took the step for DCP's state-creating one and returned,
    while rank 0 stepped into the layout's collectives (a hang, or mismatched sums)."""
    res = pool.run("fsdp_worker", "zero_shard_case", {})
    assert [r["local_zero"] for r in res] == [False, True], res  # the case holds
    assert all(r["steps"] == [2] for r in res), res


@pytest.mark.parametrize("titan", [False, True], ids=["attach", "torchtitan"])
def test_a_base_optimizer_takes_a_replicated_model_with_an_all_reduce_hook(pool, titan):
    """``Lamb`` without the GSNR on HSDP of 2 replicas × a shard of 1 rank, with
    ``set_all_reduce_hook``: both are refused for the statistics only (no reduce-scatter to take
    them at; a hook after they read the gradient), and a base optimizer takes none. It trains as
    Lamb in one process, attached by hand or built by torchtitan's container. Fails on the code
    before, which refused both for every optimizer; the container case, on the code before it,
    whose container refused a shard of one rank for a base optimizer too."""
    if titan:
        pytest.importorskip("torchtitan", reason="the torchtitan extra is not installed")
    for res in pool.run("fsdp_worker", "base_replicated_case", {"titan": titan}):
        assert res["err"] <= TOL and res["hooked"] == 2 * 3 and not res["statistics"], res  # 3 steps


def test_fsdps_reduction_is_untouched_and_gamma_1_is_the_base_optimizer_bit_for_bit(pool):
    for res in pool.run("fsdp_worker", "base_case", {}):
        assert res["grads_equal"] and res["params_equal"], res


@pytest.mark.parametrize("opt", _tier(["VRLamb", "VRAdam", "VRLars"], TP_EXHAUSTIVE))
def test_fsdp_with_tensor_parallelism_equals_the_single_process_optimizer(pool4, opt):
    """FSDP + tensor parallelism on 2 × 2 (data, tensor): a sequence-parallel norm (replicated over
    the tensor dimension: counted once in the per-tensor sums), colwise layers (FSDP's shard of a
    tensor-parallel shard: ``_StridedShard``) and a rowwise one (``Shard(1)``). n = data-parallel
    ranks × micro-steps (4): the tensor-parallel ranks of a pair read one micro-batch. At n = 2 the
    tensor-parallel matmuls' summation order is amplified as in the Megatron tests (seen 4e-5 and
    7e-5 for VRAdam and VRLamb), so the cases accumulate 2 micro-steps."""
    for rank, res in enumerate(pool4.run("fsdp_worker", "tp_case", {"opt": opt, "acc": 2})):
        assert res["err"] <= TOL and res["contrast"] >= CONTRAST * res["err"] and res["contrast"] > 0.1, res
        assert res["n"] == [4.0] * 3, res
        # the norm's weight and bias and the rowwise bias are copies on tensor-parallel rank 1
        assert res["dropped"] == (3 if rank % 2 else 0), res


def test_fsdp_with_tensor_parallelism_and_a_norm_outside_it_equals_the_single_process_optimizer(pool4):
    """Tensor parallelism without sequence parallelism (torchtitan's plan with it off): the norm
    is no tensor-parallel DTensor, and FSDP gives it the data-parallel mesh alone, 2 of the 4
    ranks. The meshes cover every rank together; the norm's copy on tensor-parallel rank 1 is
    counted once. Fails on the code before, which asked each parameter's mesh to cover every rank
    and refused the model as pipeline parallelism."""
    for rank, res in enumerate(pool4.run("fsdp_worker", "tp_case", {"opt": "VRLamb", "acc": 2,
                                                                     "sequence_parallel": False})):
        assert "refused" not in res, res
        assert res["placements"]["norm.weight"] == "(Shard(dim=0),)", res  # the case holds
        assert res["err"] <= TOL and res["contrast"] >= CONTRAST * res["err"] and res["contrast"] > 0.1, res
        assert res["n"] == [4.0] * 3, res
        assert res["dropped"] == (3 if rank % 2 else 0), res


def test_merit_under_tensor_parallelism_takes_row_and_column_maxima_across_shards(pool4):
    """MERIT's row and column maxima of a rowwise layer's ``Shard(1)`` shards (each cut into one
    run per row for MERIT) and of the colwise layers' ``_StridedShard`` ones equal the unsharded
    optimizer's."""
    for res in pool4.run("fsdp_worker", "tp_case", {"opt": "VRMerit", "acc": 2}):
        assert res["err"] <= TOL and res["contrast"] >= CONTRAST * res["err"] and res["contrast"] > 0.1, res
