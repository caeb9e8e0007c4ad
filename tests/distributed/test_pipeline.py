"""DeepSpeed's ``PipelineEngine`` on real CPU ranks (gloo): 2 pipeline stages × 1 data-parallel
rank (2 ranks) and × 2 (4 ranks), ZeRO stage 0 and 1 (DeepSpeed refuses 2 and 3 with pipelines), the per-step scheme. After 3
``train_batch`` steps the stages' parameters equal the single-process optimizer on the whole model
(``reference.py``, n = micro-batches) to the DeepSpeed matrix's fp32 tolerance, and are far from the
same reference without variance reduction. ``vrgd_ds/ds/pipeline.py`` says what the path does."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

TOL = 1e-3  # as test_deepspeed.py's fp32 matrix: ‖θ − θ_ref‖ / ‖θ_ref − θ_0‖
CONTRAST = 0.1

#: (ZeRO stage, member, accumulation, clipping, optimizer arguments beyond worker.OPT_KW)
CASES = {
    "stage0-VRLamb-gas2-clip1": (0, "VRLamb", 2, 1.0, {}),
    "stage1-VRLamb-gas4-clip0": (1, "VRLamb", 4, 0.0, {}),
    # NVLAMB pre-normalisation by the global gradient norm: a per-stage norm would be another one
    "stage0-VRLamb-gas4-prenorm": (0, "VRLamb", 4, 0.0, {"max_grad_norm": 0.05}),
    "stage1-VRLamb-gas2-prenorm": (1, "VRLamb", 2, 1.0, {"max_grad_norm": 0.05}),
    "stage0-VRAdam-gas4-clip1": (0, "VRAdam", 4, 1.0, {}),
    "stage1-VRAdam-gas2-clip0": (1, "VRAdam", 2, 0.0, {}),
    "stage0-VRSGD-gas2-clip0": (0, "VRSGD", 2, 0.0, {}),
    "stage1-VRSGD-gas4-clip1": (1, "VRSGD", 4, 1.0, {}),
    # the base optimizer (no statistics) through the same path
    "stage1-Lamb-gas2-clip1": (1, "Lamb", 2, 1.0, {}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_stages_equal_the_unsharded_optimizer(pool, name):
    stage, opt, gas, clip, kw = CASES[name]
    res = pool.run("pipe_worker", "run_pipe_case", dict(stages=2, stage=stage, opt=opt, gas=gas, clip=clip, kw=kw))
    assert res["l2"] <= TOL, res
    if opt.startswith("VR"):
        assert res["n"] == [gas] * 3, "n = data-parallel ranks (1) × micro-batches on every stage"
        assert res["l2"] <= CONTRAST * res["contrast_l2"], res
        # every stage reports the whole model's metrics: a row per model tensor, the same mean GSNR.
        # Fails on the code before, where each stage reported its own tensors only
        assert [len(rows) for rows in res["rows"]] == [res["tensors"]] * 2, res["rows"]
        assert res["rows"][0] == res["rows"][1] and res["gsnr_mean"][0] == res["gsnr_mean"][1], res
    else:
        assert res["n"] == [None] * 3


@pytest.mark.parametrize("stage", [pytest.param(0, marks=pytest.mark.exhaustive),
                                   pytest.param(1, marks=pytest.mark.exhaustive)])
def test_pipeline_with_data_parallel_stages_equals_the_unsharded_optimizer(pool4, stage):
    """PP2 × DP2: each stage's statistics reduced over its data-parallel pair (ZeRO-1: its partitions
    completed per tensor), n = 2 ranks × 2 micro-batches, the pre-normalisation norm over both stages."""
    res = pool4.run("pipe_worker", "run_pipe_case", dict(stages=2, stage=stage, opt="VRLamb", gas=2, clip=1.0,
                                                         kw={"max_grad_norm": 0.05}))
    assert res["n"] == [4] * 3
    assert res["l2"] <= TOL and res["l2"] <= CONTRAST * res["contrast_l2"], res


@pytest.mark.exhaustive
def test_gamma_one_equals_the_base_optimizer(pool):
    """VRLamb at gamma = 1 through the pipeline against the base optimizer's reference (VRLamb with
    the GSNR off), and the reference's own gamma = 1 run against it, to the same tolerance (the
    test before compared two references that were both the gamma = 1 run: its contrast was 0 by
    construction, and the base optimizer never ran)."""
    res = pool.run("pipe_worker", "run_pipe_case", dict(stages=2, stage=1, opt="VRLamb", gas=2, clip=1.0,
                                                        kw={"gamma": 1.0}, against_base=True))
    assert res["l2"] <= TOL and res["contrast_l2"] <= TOL, res


@pytest.mark.parametrize("stage", [0, 1])
def test_a_tied_weight_counts_once_in_the_global_norm_across_stages(pool, stage):
    """A ``TiedLayerSpec`` weight on both stages, the base ``Lamb`` with NVLAMB pre-normalisation
    (``max_grad_norm`` below the gradient norm, so the norm sets every step): 3 steps equal the
    same optimizer on the untied model in one process. The old code summed the norm over the
    stages with the last stage's copy of the tied weight in it (DeepSpeed marks that copy
    ``ds_pipe_replicated`` and leaves it out of its own norm), and missed."""
    res = pool.run("pipe_worker", "tied_equals_unsharded", dict(stages=2, stage=stage, opt="Lamb", gas=2, clip=0.0,
                                                                kw={"max_grad_norm": 1e-3}))
    assert res["l2"] <= TOL, res


def test_bf16_on_stage_0_is_refused_naming_the_key_and_trains_on_zero_1(pool):
    """bf16 pipelines on ZeRO stage 0 get DeepSpeed's ``BF16_Optimizer``, which no hook covers:
    refused at ``initialize`` naming the key and the fix (the old code refused with a message
    that said stage 0 supports bf16); on ZeRO-1 the same model trains, n = 2 micro-batches."""
    res = pool.run("pipe_worker", "run_bad_pipe_case", dict(stage=0, opt="VRLamb", gas=2, clip=0.0, dtype="bf16"))
    assert res["raised"] == "UnsupportedConfiguration", res
    assert "'bf16 with zero_optimization.stage 0 under pipeline parallelism' is not supported" in res["message"]
    assert "use ZeRO stage 1" in res["message"]
    res = pool.run("pipe_worker", "run_bad_pipe_case", dict(stage=1, opt="VRLamb", gas=2, clip=0.0, dtype="bf16"))
    assert res["raised"] is None and res["n"] == 2, res


@pytest.mark.parametrize("scheme", ["per_micro_step", "hierarchical"])
def test_squares_schemes_other_than_per_step_are_refused_naming_the_key(pool, scheme):
    """Also the fix of the refusal's message, which named 'per_micro_step' whatever scheme the
    config set (seen with 'hierarchical')."""
    res = pool.run("pipe_worker", "run_bad_pipe_case", dict(stage=1, opt="VRLamb", gas=2, clip=0.0, scheme=scheme))
    assert res["raised"] == "UnsupportedConfiguration", res
    assert f"'vrgd.squares': '{scheme}' is not supported with pipeline parallelism" in res["message"], res


def test_tied_module_across_stages_with_gsnr_is_refused_and_accepted_with_gsnr_off(pool):
    """A ``TiedLayerSpec`` weight used on both stages holds a partial gradient per micro-batch on
    each: GSNR on it is refused, naming the tied key; in a ``gsnr: false`` group the same model
    trains, the other tensors keeping their GSNR (n = micro-batches)."""
    res = pool.run("pipe_worker", "run_bad_pipe_case", dict(stage=1, opt="VRLamb", gas=2, clip=0.0, tied=True))
    assert res["raised"] == "UnsupportedConfiguration", res
    assert "the tied module 'embed' (TiedLayerSpec) is used on 2 pipeline stages" in res["message"]
    assert "'gsnr': false" in res["message"]
    res = pool.run("pipe_worker", "run_bad_pipe_case", dict(stage=1, opt="VRLamb", gas=2, clip=0.0, tied=True,
                                                            tied_gsnr_off=True))
    assert res["raised"] is None, res
    assert res["parts"] == [0, 3, 5] and res["n"] == 2, res


@pytest.mark.exhaustive  # the flag's join over the stages: the pre-normalisation norm's (make test) shares it
@pytest.mark.parametrize("stage, dtype", [(0, "fp32"), (1, "bf16")])
def test_a_nonfinite_gradient_on_one_stage_skips_the_step_on_every_stage(pool, stage, dtype):
    """One gradient of the last stage NaN in step 1 of 3: both stages skip that step (their
    parameters do not move, ``step/skipped_nonfinite`` 1 on each), and both step again at step 2,
    finite. A stage that stepped alone would leave the model half-updated, its stages out of step."""
    res = pool.run("pipe_worker", "run_pipe_nonfinite", dict(stages=2, stage=stage, opt="VRAdam", gas=2, clip=0.0,
                                                             dtype=dtype))
    assert sorted(r["stage"] for r in res["ranks"]) == [0, 1], res
    for r in res["ranks"]:
        assert r["moved"][1] == 0.0 and r["moved"][0] > 0 and r["moved"][2] > 0, res
        assert r["skipped"] == [0.0, 1.0, 0.0] and r["finite"], res


@pytest.mark.exhaustive  # 4 ranks (make test: the refusal on 2 stages, above)
def test_a_tied_module_with_gsnr_on_is_refused_on_the_stages_between_too(pool4):
    """4 stages, the tied module on the first and the last: the stages between, which do not hold
    it, refuse at ``initialize`` as well (their message says the stages holding it name it): every
    rank returns what it raised. Fails on the old code, where only the stages holding the module
    raised and the two between went on into the engine's first collective, waiting for ranks that
    had stopped (a hang until the launcher or the collective timeout ends the job)."""
    res = pool4.run("pipe_worker", "run_bad_pipe_case", dict(stage=1, opt="VRLamb", gas=2, clip=0.0, tied=True,
                                                             stages=4, every_rank=True), timeout=120)
    by_stage = {r["stage"]: r for r in res["ranks"]}
    assert sorted(by_stage) == [0, 1, 2, 3] and {r["raised"] for r in res["ranks"]} == {"UnsupportedConfiguration"}
    for stage in (0, 3):
        assert "the tied module 'embed' (TiedLayerSpec) is used on 2 pipeline stages" in by_stage[stage]["message"]
    for stage in (1, 2):
        assert "not this one, has a weight in a param group with GSNR on (the stages holding it name it)" in \
            by_stage[stage]["message"], by_stage[stage]
    assert all("'gsnr': false" in r["message"] for r in res["ranks"])


def test_stages_with_unequally_many_param_groups_are_refused_at_initialize(pool):
    """The first stage's optimizer with 2 param groups, the second's with 1 (a stage without the
    tensors of a no-decay group): refused at ``initialize`` on every rank, naming the counts.
    Fails on the old code, where both ranks waited on each other forever at the first step (each
    group's gradient-norm collective over the stages unmatched)."""
    res = pool.run("pipe_worker", "run_bad_pipe_case", dict(stage=1, opt="VRLamb", gas=2, clip=0.0,
                                                            uneven_groups=True), timeout=120)
    assert res["raised"] == "UnsupportedConfiguration", res
    assert "the pipeline stages' optimizers have 2, 1 param groups (stages 0..1)" in res["message"], res
    # the other rank refused too (the same gathered counts): the pool's next case runs
    assert pool.run("pipe_worker", "run_bad_pipe_case", dict(stage=1, opt="VRLamb", gas=2, clip=0.0))["raised"] is None


@pytest.mark.exhaustive  # make test: the command's refusal on the same files by name (test_engine_paths.py)
def test_a_pipeline_checkpoint_is_refused_by_the_universal_conversion_before_it_writes(pool, tmp_path):
    """``vrgd_ds.ds.universal`` converts ZeRO-1/2 checkpoints without pipeline or tensor
    parallelism; a pipeline's is refused naming the stages, and nothing is left in the output
    folder. Fails on the old code, which refused it only from inside DeepSpeed's extraction and left
    the output folder with a partial ``tmp`` behind."""
    res = pool.run("pipe_worker", "run_pipe_universal", dict(stage=1, opt="VRLamb", gas=2, clip=0.0,
                                                             dir=str(tmp_path)))
    assert res["raised"] is not None and "saved by 2 model-parallel ranks (pipeline stages" in res["raised"], res
    assert res["left"] is None, res
