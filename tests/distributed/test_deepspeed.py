"""DeepSpeed integration on 2 real CPU ranks (gloo): every case is its own test, run in the
session's rank pool (``pool.py``: one process group, engines built one after another; a hang
or a crash fails its case only). ``make test`` runs the covering designs of the matrix and the
per-step scheme (``worker.matrix_design``/``perstep_design``: every pair of factor levels at
least once); the full products are marked ``exhaustive`` (``make test-all``).

Tolerances of the matrix, as ``‖θ_deepspeed − θ_reference‖ / ‖θ_reference − θ_0‖`` over all
parameters after 3 steps (the error as a fraction of how far training moved them):

* fp32: 1e-3. The reference mirrors DeepSpeed's arithmetic; what is left is summation order
  (fp32 all-reduce vs. a Python sum, norms for clipping in fp32 vs. float64) amplified by Adam's
  normalisation of near-zero gradient elements. Seen: <= 3e-4.
* fp16 (dynamic loss scale, ZeRO-1/2/3): 0.1. The reference repeats the fp16 forward/backward,
  the loss scaling, fp16 accumulation and rounding of the fp32 mean; gradients still differ in
  the last fp16 bit where DeepSpeed's kernels order sums differently. Seen: <= 0.05.
* bf16: 0.3. Each step moves a weight of this tiny model by only 2-4 bf16 ulps, so rounding
  of the weights is a large share of the movement. Seen: <= 0.26.

For fp32 and fp16 the error must also be far below the distance to the same run without
variance reduction (gamma = 1): a mistake in the statistics would not pass unseen.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
TOL = {"fp32": 1e-3, "fp16": 0.1, "bf16": 0.3}
# err <= factor × distance to the gamma = 1 run: a statistics bug moving the result by a share of the
# GSNR's own effect shows (bf16: seen <= 0.33 over the 114 bf16 matrix and per-step cases; before,
# bf16 was held to the tolerance of the distance trained alone)
CONTRAST = {"fp32": 0.1, "fp16": 0.5, "bf16": 0.5}


sys.path.insert(0, str(HERE))
import vrgd_ds  # noqa: E402
import worker  # noqa: E402  (the case lists; the cases themselves run in the pool)


def params(cases, design: set[str] | None = None) -> list:
    """pytest parameters: every case by name, those outside ``design`` marked exhaustive."""
    out = []
    for name, case in cases:
        marks = [pytest.mark.exhaustive] if design is not None and name not in design else []
        out.append(pytest.param(name, case, marks=marks, id=name))
    return out


def run(pool, runner: str, case: dict) -> dict:
    return pool.run("worker", runner, case)


def by_name(cases, name: str) -> dict:
    return dict(cases)[name]


@pytest.mark.parametrize("name, case", params(worker.matrix_cases(), worker.matrix_design()))
def test_matrix_equals_single_process_reference(pool, name, case):
    if case["stage"] == 0 and case["dtype"] == "fp16":
        res = run(pool, "run_bad_case", case)
        assert "'fp16 with zero_optimization.stage 0' is not supported" in res["message"], res
        return
    res = run(pool, "run_matrix_case", case)
    want_n = 2 * (case["gas"] if case["stage"] >= 2 else 1)
    assert res["n"] == [want_n] * 3, "number of gradient groups per step (docs/design.md §3)"
    assert res["skipped"] == 0
    assert res["l2"] <= TOL[case["dtype"]], res
    factor = CONTRAST[case["dtype"]]
    if factor is not None and res["contrast_l2"] is not None:
        assert res["l2"] <= factor * res["contrast_l2"], res


# Tolerances of the per-step scheme, fraction of the distance trained. fp32: as the matrix (seen
# <= 1.2e-4). In bf16/fp16 DeepSpeed's own reduction is used, which sums and divides in the low
# dtype where the reference averages in fp32 and rounds once: the gradients differ by about one
# unit in the last place, which the GSNR's heavy tail at n = 2 amplifies. Seen: fp16 <= 0.12 at
# n = 2, <= 0.013 at n >= 4; bf16 <= 0.24 at n = 2, <= 0.082 at n >= 4 (tiny weights move by a
# few bf16 ulps per step, as in the matrix).
PERSTEP_TOL = {"fp32": (1e-3, 1e-3), "fp16": (0.15, 0.03), "bf16": (0.3, 0.15)}  # (n = 2, n >= 4)


@pytest.mark.parametrize("name, case", params(worker.perstep_cases(), worker.perstep_design()))
def test_per_step_squares_equal_the_reference_with_every_micro_step_a_group(pool, name, case):
    """``"vrgd": {"squares": "per_step"}``: DeepSpeed's own reduction untouched, each rank's
    micro-step squares summed locally and reduced once per step, so n = ranks × micro-steps on
    every stage (stage 0/ZeRO-1 included), with exactly one statistics collective per step
    (ZeRO-1/2 lay ``[Σg | Σg²]`` out per rank, so one reduce-scatter carries both with
    gbar="local"; ZeRO-3's coalesced helper takes two) whose bytes are the fp32 gradient's (twice
    with gbar="local"). Fails on the old code for ZeRO-3, which counted its padded reduce-scatter
    as sent but not as gradient (ratio 1.032 / 2.063), and for ZeRO-1/2 with gbar="local", which
    reduce-scattered Σg and Σg² in two collectives."""
    if case["stage"] == 0 and case["dtype"] == "fp16":
        res = run(pool, "run_bad_case", case)
        assert "'fp16 with zero_optimization.stage 0' is not supported" in res["message"], res
        return
    res = run(pool, "run_matrix_case", case)
    n = 2 * case["gas"]
    assert res["n"] == [n] * 3
    assert res["skipped"] == 0
    local = case.get("gbar", "auto") == "local" or (case.get("gbar", "auto") == "auto" and case["dtype"] != "fp32")
    # gbar="local": [Σg | Σg²] in one collective on stages 0-2, two coalesced reduce-scatters on ZeRO-3
    assert res["collectives"] == 3 * (2 if local and case["stage"] == 3 else 1)
    assert res["bytes_ratio"] == (2.0 if local else 1.0)
    assert res["l2"] <= PERSTEP_TOL[case["dtype"]][0 if n == 2 else 1], res
    factor = CONTRAST[case["dtype"]]
    if factor is not None:
        assert res["l2"] <= factor * res["contrast_l2"], res


@pytest.mark.parametrize("scheme, gbar", [("per_step", "engine"),
                                           pytest.param("per_step", "local", marks=pytest.mark.exhaustive),
                                           pytest.param("per_micro_step", "auto", marks=pytest.mark.exhaustive)])
def test_a_step_that_ends_before_its_accumulation_is_full_equals_the_reference(pool, scheme, gbar):
    """A step of 2 micro-steps where the accumulation is 4, between full steps: the boundary set
    by hand (``set_gradient_accumulation_boundary``, which accelerate calls at every micro-step, so
    that an epoch's last step can end early). DeepSpeed still divides each micro-step's loss by 4, so its reduced gradient is Σg / (ranks · 4), not the
    mean over the step's n = ranks × 2 groups. ``gbar="engine"`` read Σg from it as n · ḡ, half
    the true sum on that step while Σg² was whole, so the GSNR, and the step, were wrong (l2 0.069 of
    the distance trained on the old code, against the tolerance 1e-3). Now Σg = ranks · 4 · ḡ (``Scaling.sum_g_factor``); the
    reference's Σg, DeepSpeed's reduced gradient times that, equals the groups' sum. Fails on the
    old code with gbar="engine"."""
    case = dict(opt="VRLamb", stage=2, dtype="fp32", gas=4, clip=0.0, bucket=40, scheme=scheme, gbar=gbar,
                micro_steps=[4, 2, 4])
    res = run(pool, "run_matrix_case", case)
    assert res["n"] == [8, 4, 8][:len(res["n"])] and res["skipped"] == 0
    assert res["l2"] <= TOL["fp32"] and res["l2"] <= CONTRAST["fp32"] * res["contrast_l2"], res


@pytest.mark.parametrize("name, case", params(worker.record_cases(), worker.record_design()))
def test_statistics_from_deepspeeds_buckets_equal_the_hooks_bit_for_bit(pool, name, case):
    """The per-step scheme reads each micro-step's gradients from DeepSpeed's own flat bucket
    (``average_tensor`` on ZeRO-2, ZeRO-3's ipg bucket, and ZeRO-1 and stage 0 without
    accumulation) with one launch per bucket, and from a tensor hook per parameter otherwise: Σg, Σg² and n handed to the
    optimizer at every step, and so the trained parameters, are bit-equal to the hooks' (the
    path the matrix tests against the single-process reference). Where buckets are used, no
    parameter hook is installed, one launch runs per reduced bucket that holds gradients (none for
    the empty bucket ZeRO-1 flushes at each step without accumulation), and the segment tables are
    built in the first step only (at most two per bucket layout: first micro-step, later ones)."""
    res = run(pool, "run_record_case", case)
    assert res["checked"] > 0
    assert res["n"][0] == res["n"][1] == [2 * case["gas"]] * 3
    assert res["same_moments"] and res["same_params"], res
    buckets = case["stage"] in (2, 3) or (case["stage"] in (0, 1) and case["gas"] == 1)
    if buckets:
        assert res["hooks_auto"] == 0 and "no parameter hooks" in res["describe_auto"]
        if case["stage"] in (1, 2):  # stage 0 and ZeRO-3 reduce in functions the worker does not count
            assert res["launches_auto"] == res["reductions_auto"]
    else:
        assert res["hooks_auto"] == res["hooks_hooks"] > 0
    assert res["hooks_hooks"] > 0 and res["launches_hooks"] > res["launches_auto"] if buckets else True


COUNT_CASE = dict(stage=2, dtype="fp32", gas=2, bucket=2048)


def test_bucket_path_counts_are_the_same_for_8_and_64_tensors(pool):
    """The statistics on ZeRO-2's buckets, counted per micro-step of a steady step, for the same
    8,192 parameters as 8 tensors and as 64 (a 2,048-element bucket holds 2 or 16 of them: 4
    buckets either way): no parameter hook; one launch per bucket DeepSpeed reduces, so the same
    number for both models; no segment table built after the first step; aten operations added
    to the backward (against Lamb, which has no statistics, on the same model) at most 2 per
    bucket plus a constant. The hook path did one launch, one hook and more aten operations
    per tensor (seen: 8 and 64 launches per micro-step)."""
    res = {t: run(pool, "run_counts_case", dict(COUNT_CASE, tensors=t)) for t in (8, 64)}
    for t, r in res.items():
        vr, lamb = r["vr"], r["lamb"]
        assert vr["n"] == 4 and vr["hooks"] == 0 and "no parameter hooks" in vr["describe"], r
        assert vr["reductions_per_micro_step"] == lamb["reductions_per_micro_step"] == 4, r
        assert vr["launches_per_micro_step"] == vr["reductions_per_micro_step"], r
        assert vr["tables_built"] == 0, r
        assert vr["aten_per_micro_step"] - lamb["aten_per_micro_step"] <= 2 * vr["reductions_per_micro_step"] + 2, r
    assert res[8]["vr"]["launches_per_micro_step"] == res[64]["vr"]["launches_per_micro_step"]


def test_hook_path_counts_show_where_no_bucket_holds_a_micro_step(pool):
    """ZeRO-1 with accumulation reduces the accumulated gradient at the boundary, so the
    statistics keep a tensor hook per parameter: the counters say so (64 hooks, 64 launches per
    micro-step), and the statistics are still n = ranks × micro-steps."""
    r = run(pool, "run_counts_case", dict(COUNT_CASE, stage=1, tensors=64))["vr"]
    assert r["hooks"] == 64 and r["launches_per_micro_step"] == 64 and r["n"] == 4, r
    assert "64 parameter hooks" in r["describe"]


@pytest.mark.parametrize("name, case", params(worker.hierarchical_cases(), worker.hierarchical_design()))
def test_hierarchical_statistics_on_two_nodes_equal_the_reference(pool4, name, case):
    """``"squares": "hierarchical"`` on 4 ranks grouped as 2 nodes × 2: each bucket reduce-scattered
    within the node every micro-step, across nodes once per step; n = ranks × micro-steps and the
    trained parameters within the per-step scheme's tolerances of the single-process reference
    fed every rank's micro-batches (the same statistics: in bf16 the distance is the per-step
    scheme's to the last digit), one collective per step across nodes."""
    res = run(pool4, "run_matrix_case", case)
    n = 4 * case["gas"]
    assert res["n"] == [n] * 3 and res["skipped"] == 0
    assert res["collectives"] == 3  # across nodes: one per param group per step (one group here)
    assert res["l2"] <= PERSTEP_TOL[case["dtype"]][1], res
    if case["dtype"] == "fp32":
        assert res["l2"] <= CONTRAST["fp32"] * res["contrast_l2"], res


@pytest.mark.parametrize("gbar, squares", [("local", "fp32"), pytest.param("engine", "bf16", marks=pytest.mark.exhaustive)])
def test_zero3_per_step_counts_the_copy_its_step_collective_makes(pool, gbar, squares):
    """ZeRO-3 under the per-step scheme reduce-scatters its sums with DeepSpeed's coalesced helper,
    which copies its inputs (padded and interleaved by rank; bf16 squares copied to bf16 first):
    the statistics' ``memory()`` counts the largest such call as transient, the bytes measured
    around the calls. Fails on the code before, which said 0 (the attach log and the memory table
    understated the step's peak by 4 B/param)."""
    res = run(pool, "run_step_copy_case", dict(stage=3, dtype="fp32", gas=2, clip=0.0, opt="VRLamb", bucket=40,
                                               gbar=gbar, sq_dtype=squares))
    assert len(res["calls"]) == (2 if gbar == "local" else 1) and min(res["calls"]) > 0, res
    assert res["memory"]["transient"] == max(res["calls"]), res


@pytest.mark.parametrize("gbar", [pytest.param("engine", marks=pytest.mark.exhaustive), "local"])
def test_hierarchical_statistics_hold_a_node_share_of_per_steps_memory(pool4, gbar):
    """4 ranks as 2 nodes × 2, ZeRO-2, accumulation 2, a bucket of 40 elements: the buffers that
    mirror the model's gradients hold half of the per-step scheme's full-size one (÷ ranks per
    node); the partition's sums are the same; the transient buffers hold one bucket's chunks (the
    largest: the 91-element weight DeepSpeed reduces alone); across nodes one reduce-scatter per
    step of half the per-step scheme's bytes per rank, so each node sends what per_step's one
    collective does; within the node one reduce-scatter per bucket per micro-step."""
    res = run(pool4, "run_scheme_costs", dict(stage=2, dtype="fp32", gas=2, clip=1.0, opt="VRLamb", bucket=40,
                                              node_size=2, gbar=gbar))
    flat, hier = res["per_step"], res["hierarchical"]
    assert flat["n"] == hier["n"] == 8
    assert hier["step_collectives"] == flat["step_collectives"] == 1
    assert hier["inter_bytes"] * 2 == flat["inter_bytes"]
    assert hier["intra_bytes"] > 0 and flat["intra_bytes"] == 0
    # within the node: one reduce-scatter per bucket DeepSpeed reduced, every micro-step
    assert hier["intra_calls"] == hier["reductions"] == flat["reductions"] > 0, (hier, flat)
    words = 2 if gbar == "local" else 1
    assert flat["memory"]["local"] >= 4 * words * flat["numel"]  # full size (DeepSpeed's padding included)
    assert hier["memory"]["local"] * 2 == flat["memory"]["local"], (hier, flat)
    assert hier["memory"]["partition"] == flat["memory"]["partition"]
    assert 0 < hier["memory"]["transient"] <= 4 * words * 3 * (91 // 2 + 4) and flat["memory"]["transient"] == 0
    assert "hierarchical over 2 node(s) of 2 rank(s)" in hier["describe"]


@pytest.mark.parametrize("gbar", [pytest.param("engine", marks=pytest.mark.exhaustive), "local"])
def test_hierarchical_statistics_on_stage_0_gather_the_whole_sums_at_the_step(pool4, gbar):
    """Stage 0, where every rank steps every parameter: 4 ranks as 2 nodes × 2, no accumulation
    (DeepSpeed's one bucket read). During the micro-steps the node buffer is half of the per-step
    scheme's; at the step one all-reduce across nodes (half the bytes per rank) and one all-gather
    within the node per half ([Σg | Σg²] or Σg²) leave every rank the whole model's sums, which the
    per-step scheme holds in place of its buffer (so the partition sums are its whole buffer)."""
    res = run(pool4, "run_scheme_costs", dict(stage=0, dtype="fp32", gas=1, clip=1.0, opt="VRLamb", bucket=40,
                                              node_size=2, gbar=gbar))
    flat, hier = res["per_step"], res["hierarchical"]
    words = 2 if gbar == "local" else 1
    assert flat["n"] == hier["n"] == 4 and hier["step_collectives"] == flat["step_collectives"] == 1
    assert hier["inter_bytes"] * 2 == flat["inter_bytes"], (hier, flat)
    padded = -(-flat["numel"] // 8) * 8  # node_size · PAD
    assert flat["memory"]["local"] >= 4 * words * flat["numel"]  # full size (padding included)
    assert hier["memory"]["local"] * 2 == 4 * words * padded and padded - flat["numel"] < 8, (hier, flat)
    assert hier["memory"]["partition"] == 4 * words * padded + flat["memory"]["partition"], (hier, flat)
    assert hier["reductions"] == flat["reductions"] == 1
    assert hier["intra_calls"] == 1 + words, hier  # the bucket's reduce-scatter, then one gather per half


@pytest.mark.exhaustive  # 14 s; make test checks the local ḡ in bf16 in the per-step covering design
def test_engine_mean_gradient_in_bf16_inflates_the_gsnr_local_does_not(pool):
    """The measurement behind gbar="auto": in bf16 training DeepSpeed's bf16-reduced ḡ meets the
    fp32 squares in s - ḡ²; its rounding inflates the first step's mean GSNR (seen 4.46 against
    1.52 with the fp32 ḡ, n = 4), while the local fp32 ḡ equals the reference's."""
    cases = list(worker.perstep_cases())
    engine = run(pool, "run_matrix_case", by_name(cases, "perstep-engine-stage2-bf16"))["gsnr_means"][0]
    local = run(pool, "run_matrix_case", by_name(cases, "perstep-local-stage2-bf16"))["gsnr_means"][0]
    assert local[0] == pytest.approx(local[1], rel=1e-4)  # DeepSpeed run == reference (fp32 ḡ)
    assert engine[0] > 2 * local[0]


@pytest.mark.parametrize("name, case", params(worker.bytes_cases(), worker.bytes_design()))
def test_per_step_statistics_add_one_reduction_per_step_to_deepspeeds_own_traffic(pool, name, case):
    """Collectives of one optimizer step, counted by wrapping deepspeed.comm: DeepSpeed's own
    (everything but the statistics and the small per-tensor tables) is the same with VR-LAMB as
    with LAMB, whatever the accumulation, and the statistics add exactly one collective of one
    fp32 gradient (bf16 squares: half of it). The local buffers follow DeepSpeed's padding
    (ZeRO-1/2: the flat group's; ZeRO-3: each tensor padded to the world size), hence a few
    bytes over the gradient's on this tiny model."""
    res = run(pool, "run_bytes_case", case)
    vr, lamb = res["vr"], res["lamb"]
    assert vr["deepspeed_bytes"] == lamb["deepspeed_bytes"] and vr["deepspeed_calls"] == lamb["deepspeed_calls"]
    assert vr["stats_calls"] == 1 and lamb["stats_calls"] == 0
    half = "bf16sq" in name
    ratio = vr["stats_bytes"] / vr["grad_bytes_fp32"]
    assert (0.5 if half else 1.0) <= ratio <= (0.5 if half else 1.0) * 1.05, ratio
    gas = int(name.rsplit("gas", 1)[1])
    assert vr["n"] == 2 * gas


@pytest.mark.parametrize("name, case", params(worker.family_cases()))
def test_every_member_under_zero_equals_unsharded(pool, name, case):
    """Base variants (DeepSpeed's own reduction, no statistics) to 1e-5; a member with GSNR to the
    matrix's fp32 tolerance and far from its run without variance reduction."""
    res = run(pool, "run_matrix_case", case)
    if not vrgd_ds.REGISTRY[case["opt"]].vr:
        assert res["l2"] <= 1e-5, res
    else:
        assert res["l2"] <= TOL["fp32"] and res["l2"] <= CONTRAST["fp32"] * res["contrast_l2"], res


@pytest.mark.parametrize("name, case", params(worker.merit_cut_cases()))
def test_merit_row_and_column_maxima_across_partitions_equal_unsharded(pool, name, case):
    """One MAX all-reduce completes the maxima of a tensor cut between the ranks: the sharded
    run's parameters equal the single-process one's (to the reduction order of the gradients),
    which they would not with a ratio taken from one partition's maxima."""
    res = run(pool, "run_matrix_case", case)
    if res["contrast_l2"] is None:  # MERIT: only the gradients' reduction order differs
        assert res["l2"] <= 1e-5 and res["ulps"] <= 64, res
    else:  # VR-MERIT: the matrix's fp32 tolerance, far below the distance to its gamma = 1 run
        assert res["l2"] <= TOL["fp32"] and res["l2"] <= 0.01 * res["contrast_l2"], res


def test_every_member_is_in_the_distributed_tests():
    """A member added to the registry is run sharded against unsharded without editing this file."""
    covered = {c["opt"] for _, c in [*worker.matrix_cases(), *worker.family_cases()]}
    assert covered == set(vrgd_ds.REGISTRY), set(vrgd_ds.REGISTRY) ^ covered


@pytest.mark.parametrize("name, case", params(worker.groups_cases()))
def test_metrics_cover_every_param_group(pool, name, case):
    """Two param groups (decay / no decay): the step's metrics cover every model tensor, with
    trust ratios from the adapted group, and the mean GSNR equals the single-process
    reference's over all tensors (the default scheme: n = 4 groups on every stage; with n = 2
    the mean is decided by elements whose two gradients nearly agree, and the reduction order
    moved it by 0.16% on an AVX-512 machine). Fails on the code before: ZeRO-1/2 step the basic optimizer
    once per param group, each call started the metrics afresh, so the job's telemetry showed
    the last group only (biases and LayerNorm: no trust_ratio/* at all). With the first group's
    GSNR off (``-first-off``), the step's gradient groups and noise scale are the other group's:
    fails on the old code, where the merged record kept the first call's n = 0 and
    ``gsnr_metrics()`` raised (the job reads it every step: its first step died)."""
    res = run(pool, "run_groups_case", case)
    assert res["groups"] == 2
    assert res["tensors"] == res["names"]
    assert res["adapted"]
    assert res["gsnr_mean"] == pytest.approx(res["ref_gsnr_mean"], rel=1e-4)  # seen: <= 2e-5
    assert res["gsnr_n"] == res["ref_gsnr_n"] == 4
    assert res["b_simple"] == pytest.approx(res["ref_b_simple"], rel=1e-4)


def squares(pool, stage: int, opt: str, dtype: str) -> dict:
    return run(pool, "run_matrix_case", by_name(worker.squares_cases(), f"squares-{dtype}-stage{stage}-{opt}"))


@pytest.mark.parametrize("opt, stage", [  # make test: each member on two stages, every stage once
    (opt, stage) if (opt == "VRLamb") == (stage % 2 == 1) else pytest.param(opt, stage, marks=pytest.mark.exhaustive)
    for opt in ("VRAdam", "VRLamb") for stage in (0, 1, 2, 3)])
def test_bf16_squares_halve_the_extra_bytes(pool, stage, opt):
    """``"vrgd": {"squares_dtype": "bf16"}``: the squares travel in bf16 as a second call per
    bucket, so the bytes are 1.5x the fp32 gradient (fp32 squares: 2x, one call per bucket); the
    bf16-squares trajectory itself is pinned below on the stages where it runs with n = 4."""
    fp32, bf16 = squares(pool, stage, opt, "fp32"), squares(pool, stage, opt, "bf16")
    assert fp32["bytes_ratio"] == 2.0 and bf16["bytes_ratio"] == 1.5
    assert bf16["collectives"] == 2 * fp32["collectives"]
    assert fp32["l2"] <= TOL["fp32"]


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("opt", ["VRAdam", "VRLamb"])
def test_bf16_squares_stay_close_with_four_groups(pool, stage, opt):
    """Pins the measured effect of bf16 squares on the trajectory with n = 4 groups (2 ranks x
    2 micro-steps): the variance ``s - gbar²`` cancels, so each square's bf16 rounding
    (relative 2^-9) reaches the GSNR amplified by about (1 + GSNR). With the GSNR scale on the
    first moment only (the default placement) that error reaches the step: seen ``l2`` 0.019
    (VRAdam) and 0.067 (VRLamb), against 0.86 and 0.55 for the run without VR (gamma = 1), i.e.
    2% and 12% of VR's own effect. (With the scale on both moments, where it cancels, the same
    cases measured <= 0.0071 against 0.068-0.077.) Bounds: 0.1 absolute and 0.15 of the
    distance to the gamma = 1 run."""
    res = squares(pool, stage, opt, "bf16")
    assert res["l2"] <= 0.1, res
    assert res["l2"] <= 0.15 * res["contrast_l2"], res


@pytest.mark.parametrize("name, case", params(worker.checkpoint_cases("")))
def test_checkpoint_resume_continues_identically(pool, tmp_path, name, case):
    res = run(pool, "run_checkpoint_case", dict(case, dir=str(tmp_path)))
    assert res["moved"] > 1e-3  # the compared steps do change the weights
    assert res["max_abs_diff"] == 0.0, res
    assert "gsnr_avg" in res["state_keys"] and "exp_avg" in res["state_keys"]


BAD = {
    "bad-offload": "'zero_optimization.offload_optimizer' is not supported",
    "bad-contiguous": "'zero_optimization.contiguous_gradients' is not supported",
    "bad-contiguous-zero3": "'zero_optimization.contiguous_gradients' is not supported",
    "bad-quantized-gradients": "'zero_optimization.zero_quantized_gradients' is not supported",
    "bad-predivide": "'gradient_predivide_factor' is not supported",
    "bad-fp16-stage0-callable-client": "'fp16 with zero_optimization.stage 0' is not supported",
    "bad-fp16-stage0": "'fp16 with zero_optimization.stage 0' is not supported",
    "bad-client-and-config": "both a config optimizer ('optimizer.type': 'VRLamb') and a client optimizer",
    "bad-callable-client-and-config": "both a config optimizer ('optimizer.type': 'adam') and a client optimizer "
                                      "(a callable that built VRSGD)",
    "bad-gbar-zero3-default": "vrgd.gbar: 'local' applies to squares 'per_step' and 'hierarchical'; the scheme here is "
                              "'per_micro_step' (the default on ZeRO-3)",
    "bad-unknown-param": "optimizer.params.gama: not a parameter of VRLamb",
    "bad-squares-dtype": "vrgd.squares_dtype: Input should be 'fp32' or 'bf16'",
    "bad-vrgd-key": "vrgd.square_dtype: Extra inputs are not permitted",
    "bad-autotp": "'tensor_parallel.autotp_size' is not supported with VRGD optimizers: AutoTP shards weights across 2",
    "bad-moe": "'MoE layers' is not supported",
    "bad-tensor-parallel-mpu": "'mpu (tensor model parallelism)' is not supported with VRGD optimizers: the model is "
                               "sharded over 2 tensor-parallel ranks",
    "bad-node-size": "vrgd.node_size: 3 does not divide the 2 data-parallel ranks",
    "bad-launcher-local-size": "vrgd.node_size: the launcher's LOCAL_WORLD_SIZE=1 disagrees with the 2 rank(s) found "
                               "on each host",
    "bad-hierarchical-bf16-squares": "vrgd.squares_dtype: 'hierarchical' reduces [Σg | Σg²] chunks in one dtype",
    "bad-autocast-fp16-stage0": "'torch_autocast' fp16 with zero_optimization.stage 0 is not supported",
    "bad-autocast-fp16-zero2": "'torch_autocast' fp16 with zero_optimization.stage 2 is not supported",
    "bad-unmanaged-accumulation": "'managed_gradient_accumulation' false is not supported with VRGD optimizers",
    "bad-sparse-embedding": "vrgd_ds: emb (Embedding) has sparse=True in a param group with GSNR on",
    "bad-sparse-embedding-zero2": "vrgd_ds: emb (Embedding) has sparse=True in a param group with GSNR on",
    "bad-sparse-embedding-bf16": "vrgd_ds: emb (Embedding) has sparse=True in a param group with GSNR on",
    "bad-node-size-auto-zero3": "vrgd.node_size: 2 has no effect here: on ZeRO stage 3 \"squares\": \"auto\" picks "
                                "'per_micro_step', never 'hierarchical'",
    "bad-elastic-checkpoint": "'zero_optimization.elastic_checkpoint' is not supported with VRGD optimizers",
    "bad-bf16-nonfinite-unchecked": "'bf16.check_grad_overflow false' is not supported with VRGD optimizers and 2 "
                                    "param groups",
    "bad-fp32-nonfinite-unchecked": "'zero_optimization.compute_grad_norm false' is not supported with VRGD "
                                    "optimizers and 2 param groups",
}


@pytest.mark.parametrize("how, stage, gas, refused", [
    ("no_sync", 1, 1, "engine.no_sync() with gradient_accumulation_steps 1 is not supported"),
    ("no_sync", 1, 2, None),
    ("coalesce", 2, 2, "engine.coalesce_grad_reduction() is not supported"),
    # before: accepted, the two micro-steps read from the bucket as one group per rank (n = 2)
    ("boundary", 1, 1, "engine.set_gradient_accumulation_boundary(False) with gradient_accumulation_steps 1"),
    pytest.param("boundary", 0, 1, "engine.set_gradient_accumulation_boundary(False) with gradient_accumulation_steps 1",
                 marks=pytest.mark.exhaustive),
])
def test_backward_passes_summed_into_one_reduction_are_refused(pool, how, stage, gas, refused):
    """DeepSpeed's ``no_sync()`` with no accumulation, and ``coalesce_grad_reduction()``, sum
    several backward passes into one reduction, which the statistics would read as one micro-batch
    per rank: refused when entered, naming the fix. Accelerate's ``no_sync()`` around the
    micro-steps before the boundary (stage 0/1 with accumulation) is left alone and trains with
    n = ranks × micro-steps. Fails on the code before, which accepted both: ``no_sync()`` then
    failed in the step with a bare ``KeyError: 0``, and the coalesced step reported no ``gsnr/n``."""
    res = run(pool, "run_accumulation_case", dict(stage=stage, dtype="fp32", gas=gas, clip=0.0, opt="VRLamb",
                                                  bucket=500, how=how, scheme="per_step"))
    if refused:
        assert res["raised"] == "UnsupportedConfiguration" and refused in res["message"], res
    else:
        assert res["raised"] is None and res["n"] == 4 and res["finite"], res


def test_auto_squares_are_the_same_on_ranks_with_unequal_free_memory(pool):
    """``"squares": "auto"`` where the ranks' GPUs have 20.9 and 20.7 GB free, about the
    threshold for a 1.3B bf16 model (per_step's buffer would take half): every rank takes the
    scheme of the least free memory. Fails on the old code, where each rank decided on its own
    (per_step on one, hierarchical on the other: different collectives, a hang)."""
    res = run(pool, "run_auto_on_unequal_memory", {"free_gb": [20.9, 20.7]})
    assert res["schemes"] == ["hierarchical", "hierarchical"], res


def test_auto_squares_on_one_host_reduce_within_it(pool):
    """``"squares": "auto"`` on ZeRO-2 with both ranks on this host (the launcher's local world
    size and the host names agree): the hierarchical scheme over one node, nothing across nodes."""
    res = run(pool, "run_bad_case", dict(stage=2, dtype="fp32", gas=1, clip=0.0, opt="VRLamb", bucket=500,
                                         set={"vrgd.squares": "auto"}))
    assert res["raised"] is None, res
    assert res["describe"].startswith("hierarchical over 1 node(s) of 2 rank(s)"), res


@pytest.mark.exhaustive  # make test: the warning's rule in-process (tests/unit/test_engine_paths.py)
@pytest.mark.parametrize("stage, squares, warned", [(3, "auto", True), (2, "per_step", False)])
def test_communication_dtype_the_fused_reduction_ignores_is_warned_of(pool, stage, squares, warned):
    """``communication_data_type`` bf16 with an fp32 model: ignored for gradients when the fused
    fp32 ``[g | g²]`` reduction replaces DeepSpeed's, which ``"squares": "auto"`` picks on ZeRO-3,
    and said so; kept (no warning) under the per-step scheme. Fails on the code before, which
    read the configured scheme ("auto") and so never warned on ZeRO-3 under auto."""
    res = run(pool, "run_bad_case", dict(stage=stage, dtype="fp32", gas=1, clip=0.0, opt="VRLamb", bucket=500,
                                         set={"communication_data_type": "bf16", "vrgd.squares": squares}))
    assert res["raised"] is None, res
    assert any("communication_data_type" in w and "is ignored" in w for w in res["warnings"]) == warned, res


@pytest.mark.parametrize("low, stage, gas, gbar", [
    (None, 2, 1, "engine"),
    ({"communication_data_type": "bf16"}, 2, 1, "local"),
    ({"data_types.grad_accum_dtype": "bf16"}, 1, 2, "local"),
], ids=["fp32", "communication-bf16", "grad-accum-bf16"])
def test_gbar_auto_follows_the_dtype_gradients_are_reduced_in(pool, low, stage, gas, gbar):
    """An fp32 model under the per-step scheme: ``"gbar": "auto"`` takes DeepSpeed's reduced mean
    gradient where it is reduced in fp32, and the local fp32 one where ``communication_data_type``
    bf16 rounds it, or ``data_types.grad_accum_dtype`` bf16 (ZeRO-1 then accumulates and reduces
    ``grad_accum`` in bf16): a bf16 ḡ against fp32 squares is what "auto" avoids for bf16 models.
    Fails on the code before: first it read the model's dtype only, then it left out the
    accumulation dtype (the first step's mean GSNR 2.31 where fp32 statistics give 1.55)."""
    sets = {"vrgd.squares": "per_step", "vrgd.gbar": "auto", **(low or {})}
    res = run(pool, "run_bad_case", dict(stage=stage, dtype="fp32", gas=gas, clip=0.0, opt="VRLamb", bucket=500,
                                         set=sets))
    assert res["raised"] is None and res["gbar"] == gbar, res


@pytest.mark.exhaustive  # make test: the per-micro-step reduction against the reference on ZeRO-2 (fp32, bf16)
def test_a_bf16_model_accumulating_in_fp32_gets_the_same_gradient_under_either_scheme(pool):
    """bf16 on ZeRO-2 with ``data_types.grad_accum_dtype`` and ``communication_data_type`` fp32:
    DeepSpeed stages each micro-step's gradient in a bf16 bucket, reduces it in fp32 and adds the
    fp32 result to the fp32 partition. The per-micro-step scheme's fused reduction must hand back
    that fp32 result too: the optimizer then steps with the gradient of the per-step scheme (which
    leaves DeepSpeed's reduction as it is), bit for bit. Fails on the code before, which returned
    the bf16 bucket: every micro-step's averaged gradient rounded to bf16 before it was
    accumulated, with no warning."""
    sets = {"data_types.grad_accum_dtype": "fp32", "communication_data_type": "fp32"}
    grads = {scheme: run(pool, "run_stepped_grads_case", dict(stage=2, dtype="bf16", gas=2, clip=0.0, opt="VRLamb",
                                                              bucket=500, set={**sets, "vrgd.squares": scheme}))["grads"]
             for scheme in ("per_step", "per_micro_step")}
    assert len(grads["per_step"]) > 0 and grads["per_micro_step"] == grads["per_step"]


def test_lamb_by_name_trains_in_bf16_on_stage_0(pool):
    """``"type": "Lamb"`` (our LAMB on the CPU accelerator) in bf16 without ZeRO: DeepSpeed wraps it in
    FP16_UnfusedOptimizer, which for an optimizer named "lamb" takes FusedLamb's legacy step
    (``step(grads=, output_params=, scale=)``); ours steps as a torch optimizer. Fails on the code
    before: TypeError at the first step."""
    res = run(pool, "run_steps_case", dict(stage=0, dtype="bf16", gas=2, clip=0.0, opt="Lamb", bucket=500,
                                           scheme="per_step"))
    assert res["raised"] is None and res["finite"] and res["moved"], res


def test_a_frozen_parameter_is_left_out_on_stage_0(pool):
    """Stage 0 with accumulation (a hook per parameter) and a parameter with requires_grad False,
    which DeepSpeed hands the optimizer as it hands every parameter: the statistics leave it out,
    as DeepSpeed's reduction does. Fails on the code before: KeyError at initialize (the layout
    has trainable tensors only)."""
    res = run(pool, "run_bad_case", dict(stage=0, dtype="fp32", gas=2, clip=0.0, opt="VRLamb", bucket=500,
                                         frozen=True, set={"vrgd.squares": "per_step"}))
    assert res["raised"] is None, res


@pytest.mark.parametrize("stage, scheme, use", [(3, "per_step", "last_micro"), (3, "per_micro_step", "last_micro"),
                                               (3, "per_step", "first_step"), (2, "per_step", "last_micro"),
                                               (2, "per_step", "first_step")])
def test_a_parameter_without_a_gradient_where_zero3_keeps_a_stale_one_is_refused(pool, stage, scheme, use):
    """A head used in the second of two micro-batches only (``last_micro``), or in the first step
    only (``first_step``): DeepSpeed 0.19.8's ZeRO-3 never zeroes a gradient partition between
    steps, so the head's gradient is added onto the previous step's, or the previous step's is
    stepped on again; its update is wrong and, per step, Σg reads that gradient (its GSNR 0.90
    off at the second step). The job stops naming the head; ZeRO-2 trains it. Fails on the old
    code, which trained on."""
    res = run(pool, "run_late_gradient_case", dict(stage=stage, dtype="fp32", gas=2, clip=0.0, opt="VRLamb",
                                                   bucket=500, scheme=scheme, use=use))
    if stage == 3:
        assert res["raised"] == "UnsupportedConfiguration", res
        said = "micro-batch 1" if use == "last_micro" else "had a gradient in an earlier step and has none in this one"
        assert "head.weight" in res["message"] and said in res["message"], res
    else:
        assert res["raised"] is None and res["n"] == 4, res


#: make test-all only: a check another case of make test takes through the same code (the model's tensors of a
#: group under ZeRO-2 and stage 0 bf16; the overflow check's two keys; auto's node size on ZeRO-3)
BAD_EXHAUSTIVE = {"bad-sparse-embedding-zero2", "bad-bf16-nonfinite-unchecked", "bad-node-size-auto-zero3"}


@pytest.mark.parametrize("name, case", params(worker.bad_cases(), design=set(BAD) - BAD_EXHAUSTIVE))
def test_bad_configs_name_the_key(pool, name, case):
    res = run(pool, "run_bad_case", case)
    assert res["raised"] == "UnsupportedConfiguration", res
    assert BAD[name] in res["message"]


@pytest.mark.exhaustive
def test_universal_checkpoint_resumes_on_one_rank_with_gsnr_momentum(pool, pool1, tmp_path):
    case = worker.universal_case(str(tmp_path))
    assert run(pool, "run_universal_save", case)["kept"] == ["gsnr_avg"]  # beyond DeepSpeed's exp_avg/exp_avg_sq
    res = run(pool1, "run_universal_load", case)
    assert res["max_abs_diff"] == {"gsnr_avg": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0}
    assert res["step"] == 3 and res["n_after"] == 2.0  # one rank x gradient_accumulation_steps 2 (ZeRO-2)
    # loaded in a script of one's own into Lamb (VRLamb with gsnr off): the wiring stays as built, the
    # GSNR momentum goes. Fails on the code before, where only the job kept the wiring: DeepSpeed's
    # universal loader set the saved gsnr=True and the step raised "no statistics source is attached"
    res = run(pool1, "run_universal_switch", dict(case, load_opt="Lamb"))
    assert res["gsnr"] == [False] and "gsnr_avg" not in res["keys"] and res["n_after"] is None, res


@pytest.mark.exhaustive  # make test: the refusal's rule and wording (tests/unit/test_engine_paths.py)
def test_single_rank_without_enough_groups_is_an_error(pool1, tmp_path):
    """``deepspeed.initialize`` on one rank (ZeRO-1, 4 micro-steps: n=1) refuses before training.
    Its own group of one rank starts for it alone (about 20-35 s)."""
    res = run(pool1, "run_single_rank_n1", worker.universal_case(str(tmp_path)))
    assert res["raised"] == "UnsupportedConfiguration"
    assert "GSNR needs >= 2 gradient groups per step, this run has n=1" in res["message"]
    assert "gradient_accumulation_steps >= 2" in res["message"]


@pytest.mark.parametrize("opt, launches", [("VRLamb", (7, 5)), ("VRLars", (9, 6))])
def test_device_tables_across_ranks_step_as_the_torch_tables(pool, opt, launches):
    """The Triton step's tables, skip decision, trust ratios and metric rows built by its kernels,
    with the per-tensor sums (GSNR mean, trust norms) and the decision completed across 2 ranks (a
    NaN on one rank skips both): bit for bit the torch operations' run on every rank
    (worker.run_device_tables_case). Launches per step: the table kernels beside the step's own."""
    res = pool.run("worker", "run_device_tables_case", {"opt": opt})
    assert "error" not in res, res.get("trace", res)
    assert res["same"] and res["gsnr_mean"] > 0, res
    assert res["launches"] == [3 * launches[0], 3 * launches[1]]


@pytest.mark.exhaustive  # make test: the settings that would step some groups refused (bad-*-nonfinite-*)
@pytest.mark.parametrize("stage", [2, 3])
def test_a_non_finite_gradient_in_one_group_skips_the_whole_step_once(pool, stage):
    """ZeRO steps the param groups one call at a time: a NaN in the second group's gradient (one
    rank) skips the whole step, both groups untouched, counted once; the steps around it move
    both. DeepSpeed 0.19.8 decides it over every group before the first call: ZeRO-1/2 by its
    overflow check (bf16.check_grad_overflow, on by default) or, in fp32, its global norm; ZeRO-3
    by its global norm."""
    case = dict(stage=stage, dtype="bf16", gas=1, clip=0.0, opt="VRLamb", bucket=500, scheme="per_step")
    res = run(pool, "run_nonfinite_group_case", case)
    assert res["moved"] == [[True, True], [False, False], [True, True]], res
    assert [m["step/skipped"] for m in res["metrics"]] == [0.0, 1.0, 0.0], res
    assert res["metrics"][-1]["step/skipped_total"] == 1.0 and res["finite"], res


@pytest.mark.parametrize("scheme, gas", [("per_step", 1), ("per_step", 2), ("hierarchical", 2)])
def test_a_skipped_steps_collectives_land_before_the_next_step_writes(pool, scheme, gas):
    """A step DeepSpeed skips (here a NaN loss in bf16 on stage 0) has launched the statistics'
    all-reduce, in place on the buffers the micro-steps write, and never reads it. With NCCL that
    collective may land after the next step's first micro-steps have written those buffers; its
    sums (NaN here) then replace theirs. The run whose collectives land as late as a stream allows
    (``worker.LateCollectives``) must equal the plain run bit for bit. Fails on the code before:
    the step after the skipped one read the skipped step's sums (GSNR and parameters NaN)."""
    case = dict(stage=0, dtype="bf16", gas=gas, clip=0.0, opt="VRLamb", bucket=500, scheme=scheme)
    if scheme == "hierarchical":
        case["node_size"] = 1
    res = run(pool, "run_late_collectives_case", case)
    assert res["skipped"] == [0.0, 1.0, 0.0] and res["finite"], res
    assert res["same"], res


@pytest.mark.parametrize("pinned", [False, True], ids=["deepspeed-alone", "zero3_weights_of"])
def test_zero3_weights_without_the_optimizer_state_come_from_the_tag_asked(pool, tmp_path, pinned):
    """A ZeRO-3 checkpoint loaded without its optimizer states (the job's ``reset_if_incompatible``
    plan) while ``latest`` names a newer one: DeepSpeed 0.19.8 alone loads the weights of the tag
    ``latest`` names (the case shows it, so that a DeepSpeed that fixes it is noticed); under
    ``zero3_weights_of``, which the job's load uses, those of the tag asked. Fails on the job's
    code before, whose resume got step 2's weights with step 1's step count and data position."""
    res = run(pool, "run_zero3_weights_case", dict(stage=3, dtype="fp32", gas=2, clip=0.0, opt="VRLamb", bucket=500,
                                                   scheme="per_micro_step", dir=str(tmp_path), pinned=pinned))
    assert (res["step1"] == 0.0) == pinned and (res["step2"] == 0.0) != pinned, res


@pytest.mark.parametrize("stage", [0, pytest.param(2, marks=pytest.mark.exhaustive)])
def test_a_torch_lr_scheduler_drives_the_engines_optimizer(pool, stage):
    """A torch LR scheduler on the optimizer DeepSpeed built from the config (HF Trainer's way
    without a ``scheduler`` block: a callable) and one built on it after ``initialize``: both
    set the rates, and the statistics count ranks × micro-steps. Fails on the old code on stage 0
    in fp32, where the engine's optimizer is ours: the statistics' step replaced its ``step`` by a
    plain function, and every torch scheduler raised "'function' object has no attribute
    '__func__'" when built (ZeRO-1/2 wrap it: no error there)."""
    res = run(pool, "run_scheduler_case", {"stage": stage})
    for how in ("deepspeed", "by_hand"):
        assert "raised" not in res[how], res
        assert res[how]["lrs"] == [0.5 * 1e-2, 0.25 * 1e-2] and res[how]["n"] == [4.0, 4.0], res
