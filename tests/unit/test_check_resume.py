"""``vrgd-pretrain --check-resume``: what a resume would load and what would change, read from
the checkpoint's marker without loading tensors or starting ranks."""
from __future__ import annotations

import copy
import json

import pytest

from vrgd_ds.train import checkpoints as ckpt
from vrgd_ds.train import loop
from vrgd_ds.train.check_resume import check

RAW = {
    "optimizer": {"type": "VRLamb", "params": {}},
    "zero_optimization": {"stage": 2},
    "job": {"model": {"size": "tiny"}, "total_steps": 8,
            "phases": [{"seq_len": 32, "fraction": 1.0, "global_batch": 16, "micro_batch": 4, "lr": 2e-3}]},
}
INFO = {"optimizer": {"type": "VRLamb", "gsnr": True, "gsnr_placement": "first_moment"}, "zero_stage": 2,
        "total_steps": 8, "phases": None, "data": "0123456789abcdef", "consumed": [64], "seed": 1234}


@pytest.fixture
def run_dir(tmp_path):
    """A run directory whose checkpoint step00000004 was written by 2 ZeRO-2 ranks."""
    from vrgd_ds.train.config import parse_job

    ckpt_dir = tmp_path / "run" / "checkpoints"
    tag = ckpt_dir / "step00000004"
    tag.mkdir(parents=True)
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                 "zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        (tag / name).write_bytes(b"x" * 10)
    info = dict(INFO, phases=[p.model_dump(mode="json") for p in parse_job(RAW).phases])
    ckpt.mark_complete(ckpt_dir, "step00000004", 4, 2, info)
    return tmp_path / "run"


def test_the_report_names_step_ranks_optimizer_phases_and_data(run_dir):
    report, ok = check(run_dir, None, None)
    assert ok
    assert "step00000004 (step 4)" in report and "saved on:    2 ranks, ZeRO stage 2" in report
    assert "VRLamb (gsnr True, placement first_moment)" in report and "fingerprint 0123456789abcdef" in report
    assert "8 steps, phases seq 32 x 16 for 1.0" in report and "consumed per phase [64]" in report


def test_the_same_configuration_changes_nothing_but_the_data_check(run_dir):
    report, ok = check(run_dir, copy.deepcopy(RAW), 2)
    assert ok and "with this configuration on 2 ranks:" in report
    assert "converting" not in report and "resuming with" not in report
    assert "the configured data is not prepared yet" in report  # run_dir/data does not exist here


def test_other_ranks_and_the_base_optimizer_are_listed(run_dir):
    raw = copy.deepcopy(RAW)
    raw["optimizer"]["type"] = "Lamb"
    raw["job"]["total_steps"] = 12
    report, ok = check(run_dir, raw, 1)
    assert ok
    assert "job.total_steps 8 -> 12" in report
    assert "was saved on 2 ranks; converting it for 1 to the universal checkpoint" in report
    assert "resuming with Lamb (gsnr False" in report and "the GSNR momentum is dropped" in report


def test_a_placement_the_config_leaves_out_is_the_saved_one(run_dir):
    """A loaded state brings its param groups' ``gsnr_placement`` unless the config names one.
    Before, a checkpoint of placement ``update`` resumed with a config that names none was
    reported as "resuming with VRLamb (gsnr True, placement first_moment)" (the built default),
    by the job too, which then stepped with ``update``. Fails on the old code."""
    marker = ckpt.marker(run_dir / "checkpoints", "step00000004")
    marker["info"]["optimizer"]["gsnr_placement"] = "update"
    ckpt.mark_complete(run_dir / "checkpoints", "step00000004", 4, 2, marker["info"])
    report, ok = check(run_dir, copy.deepcopy(RAW), 2)
    assert ok and "resuming with" not in report, report
    raw = copy.deepcopy(RAW)
    raw["optimizer"]["params"]["gsnr_placement"] = "first_moment"  # named: the config's again
    report, ok = check(run_dir, raw, 2)
    assert ok and "placement update), resuming with VRLamb (gsnr True, placement first_moment)" in report, report
    raw["optimizer"]["type"] = "Lamb"  # a member's switch keeps the saved placement too
    del raw["optimizer"]["params"]["gsnr_placement"]
    report, ok = check(run_dir, raw, 2)
    assert ok and "resuming with Lamb (gsnr False, placement update)" in report, report


def test_option_changes_are_listed_from_the_markers_record(run_dir):
    """The marker records the options the run stepped with (the config's named ones, and the
    checkpoint's for those a resumed config left out); the report lists what the configuration
    changes, as the job's log does. Before, ``--check-resume`` said "nothing changes" where the
    job then changed ``weight_decay``. Fails on the old code."""
    marker = ckpt.marker(run_dir / "checkpoints", "step00000004")
    ckpt.mark_complete(run_dir / "checkpoints", "step00000004", 4, 2,
                       dict(marker["info"], options={"weight_decay": 0.01, "beta3": 0.9}))
    raw = copy.deepcopy(RAW)
    raw["optimizer"]["params"].update(weight_decay=0.02, beta3=0.9, gamma=0.2)
    report, ok = check(run_dir, raw, 2)
    assert ok and "nothing changes" not in report, report
    assert ("optimizer.params.weight_decay: the checkpoint has 0.01, the config 0.02; continuing with the config's"
            in report), report
    assert "optimizer.params.gamma: the checkpoint's run left it to the optimizer's default, the config sets 0.2" in report
    assert "beta3" not in report  # named with the saved value: no change
    report, ok = check(run_dir, copy.deepcopy(RAW), 2)  # the config names neither any more
    assert ok and "optimizer.params.beta3: 0.9 carries on from the checkpoint" in report, report
    assert "optimizer.params.weight_decay: 0.01 carries on" in report
    raw = {**copy.deepcopy(RAW), "optimizer": {"type": "VRSGD", "params": {"weight_decay": 0.02}},
           "checkpoint": {"optimizer_state": "reset_if_incompatible"}}  # a fresh state: the config's options
    report, ok = check(run_dir, raw, 2)
    assert ok and "with a fresh VRSGD state" in report and "optimizer.params." not in report, report


def test_a_marker_without_options_says_the_log_lists_them(run_dir):
    raw = copy.deepcopy(RAW)
    report, ok = check(run_dir, raw, 2)
    assert ok and "record its optimizer options" not in report  # the config names only lr
    raw["optimizer"]["params"]["weight_decay"] = 0.02
    report, ok = check(run_dir, raw, 2)
    assert ok and "does not record its optimizer options: the job's log lists the ones the config changes" in report


def test_another_family_would_stop_and_the_cli_exits_2(run_dir, tmp_path, capsys):
    raw = copy.deepcopy(RAW)
    raw["optimizer"] = {"type": "VRSGD", "params": {}}
    report, ok = check(run_dir, raw, 2)
    assert not ok and "would stop" in report and "reset_if_incompatible" in report
    config = tmp_path / "config.json"
    config.write_text(json.dumps(raw))
    assert loop.main(["--check-resume", str(run_dir), "--config", str(config)]) == loop.EXIT_CONFIG
    assert "would stop" in capsys.readouterr().out
    assert loop.main(["--check-resume", str(run_dir), "--config", str(config), "--set",
                      'checkpoint={"optimizer_state": "reset_if_incompatible"}']) == 0
    assert "with a fresh VRSGD state" in capsys.readouterr().out


def test_zero3_on_other_ranks_is_refused_naming_both_world_sizes(run_dir):
    info = ckpt.marker(run_dir / "checkpoints", "step00000004")["info"]
    ckpt.mark_complete(run_dir / "checkpoints", "step00000004", 4, 2, dict(info, zero_stage=3))
    raw = copy.deepcopy(RAW)
    raw["zero_optimization"]["stage"] = 3
    report, ok = check(run_dir, raw, 4)
    assert not ok and "saved on 2 ranks, resumed on 4: a ZeRO-3 checkpoint is not converted" in report
    # with another optimizer family and its state reset too: DeepSpeed reads ZeRO-3's weights from
    # each rank's own file, which ranks 2 and 3 lack. Fails on the code before, which let the reset
    # policy through ("the weights load on any number of ranks"): at the load rank 1 failed while
    # rank 0 went on into the load's collectives
    raw["optimizer"] = {"type": "VRSGD", "params": {}}
    raw["checkpoint"] = {"optimizer_state": "reset_if_incompatible"}
    report, ok = check(run_dir, raw, 4)
    assert not ok and "saved on 2 ranks, resumed on 4: a ZeRO-3 checkpoint is not converted" in report


def test_a_run_directory_without_checkpoints_would_start_afresh(tmp_path):
    report, ok = check(tmp_path, None, None)
    assert ok and "start afresh" in report


def megatron_checkpoint(tmp_path, block: dict, **saved) -> dict:
    """A Megatron engine's config (``block`` added to its ``"megatron"`` block) and, in
    ``tmp_path/run``, its step-4 checkpoint saved on TP 1 × PP 1 × DP 2 (``saved``: more marker info)."""
    from vrgd_ds.train.config import parse_job

    raw = {"optimizer": {"type": "VRLamb", "params": {}},
           "megatron": {"model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4}, **block},
           "job": {"engine": "megatron", "total_steps": 8,
                   "phases": [{"seq_len": 32, "fraction": 1.0, "global_batch": 16, "micro_batch": 4, "lr": 2e-3}]}}
    ckpt_dir = tmp_path / "run" / "checkpoints"
    (ckpt_dir / "step00000004").mkdir(parents=True)
    (ckpt_dir / "step00000004" / "__0_0.distcp").write_bytes(b"x" * 10)
    info = {k: v for k, v in INFO.items() if k != "zero_stage"}
    info.update(engine="megatron", tensor_model_parallel_size=1, pipeline_model_parallel_size=1, data_parallel_size=2,
                phases=[p.model_dump(mode="json") for p in parse_job(raw).phases])
    info.update(saved)
    ckpt.mark_complete(ckpt_dir, "step00000004", 4, 2, info)
    return raw


def test_a_megatron_checkpoint_reports_its_layout_and_the_configured_one(tmp_path):
    """A Megatron engine's marker holds TP × PP × DP, not a ZeRO stage; the report names both
    layouts when the configuration changes the tensor-parallel size (dist-checkpointing
    reshards), and refuses an engine switch (the job stops on it too, exit 2)."""
    raw = megatron_checkpoint(tmp_path, {}, precision="fp32")
    report, ok = check(tmp_path / "run", None, None)
    assert ok and "saved on:    2 ranks, TP 1 × PP 1 × DP 2" in report
    same, ok = check(tmp_path / "run", copy.deepcopy(raw), 2)
    assert ok and "reshards" not in same
    raw["megatron"]["tensor_model_parallel_size"] = 2
    report, ok = check(tmp_path / "run", raw, 2)
    assert ok and "TP 1 × PP 1 × DP 2 -> TP 2 × PP 1 × DP 1 (dist-checkpointing reshards every tensor)" in report
    # without --world-size: the marker's number of ranks (before, 1 rank was assumed: "DP ?", a
    # layout change that was not there)
    report, ok = check(tmp_path / "run", raw, None)
    assert ok and "with this configuration on 2 ranks:" in report and "TP 2 × PP 1 × DP 1 (dist" in report
    report, ok = check(tmp_path / "run", copy.deepcopy(RAW), 2)
    assert not ok and "written by the megatron engine, the config has job.engine 'deepspeed'" in report


@pytest.mark.parametrize("saved, block, phases, stop", [
    (32, {}, [32], None),
    (32, {}, [32, 64], "a phase of seq_len 64 does not fit the 32 positions the run was built with"),
    (64, {}, [32], "this configuration builds 32 (megatron.model.max_position_embeddings, by default from the "
                   "longest phase): set megatron.model.max_position_embeddings to 64"),
    (64, {"max_position_embeddings": 64}, [32, 64], None),
    (None, {}, [32, 64], "a phase of seq_len 64 does not fit the 32 positions"),  # a marker before the record
])
def test_a_gpt_checkpoint_resumes_only_into_its_own_position_table(tmp_path, saved, block, phases, stop):
    """The GPT's learned positions are as many as the longest phase's ``seq_len`` (or
    ``megatron.model.max_position_embeddings``), and dist-checkpointing loads the table only into
    one of its own size: a seq-64 phase added at the resume of a seq-32 run, or a run built for 64
    resumed without the key, would fail to load every checkpoint of the run, and the job said
    there was no complete checkpoint and to move the directory away. ``--check-resume`` (as the
    job, before loading) now stops naming the key, and a run built for the longer phase from its
    start takes it; a marker written before the size was recorded holds its phases, whose longest
    was the size. Fails on the code before, which went ahead."""
    raw = megatron_checkpoint(tmp_path, {}, max_position_embeddings=saved)
    raw["megatron"]["model"].update(block)
    raw["job"]["phases"] = [{"seq_len": n, "fraction": 1 / len(phases), "global_batch": 16, "micro_batch": 4,
                             "lr": 2e-3} for n in phases]
    report, ok = check(tmp_path / "run", raw, 2)
    assert ok == (stop is None), report
    assert stop is None or f"would stop: {tmp_path / 'run' / 'checkpoints' / 'step00000004'}: its model has " \
        f"position embeddings for {saved or 32} tokens" in report and stop in report, report


@pytest.mark.parametrize("phases, overrides", [([128], {}), ([128, 512], {}), ([64, 1000], {}),
                                               ([128], {"max_position_embeddings": 1024})])
def test_the_bert_position_table_a_resume_compares_is_the_one_the_job_builds(phases, overrides):
    """``config.position_table`` (what ``--check-resume`` compares with the marker) gives the
    size ``model.bert_config`` builds BERT with: max(512, the longest phase's batch width), or
    ``job.model.overrides.max_position_embeddings``."""
    from vrgd_ds.train.config import parse_job, position_table
    from vrgd_ds.train.model import bert_config

    raw = copy.deepcopy(RAW)
    raw["job"]["model"]["overrides"] = overrides
    raw["job"]["phases"] = [{"seq_len": n, "fraction": 1 / len(phases), "global_batch": 16, "micro_batch": 4,
                             "lr": 2e-3} for n in phases]
    job = parse_job(raw)
    built = bert_config(job.model, 2000, max(phases)).max_position_embeddings
    assert position_table(job, raw) == (built, "job.model.overrides.max_position_embeddings")
    assert built == overrides.get("max_position_embeddings", max(512, -(-max(phases) // 8) * 8))


@pytest.mark.parametrize("block, world, message", [
    ({"tensor_model_parallel_size": 2}, 3, "tensor_model_parallel_size × pipeline_model_parallel_size = 2 × 1 does "
                                           "not divide the 3 ranks"),
    ({"tensor_model_parallel_size": 8}, 8, "4 heads do not split over tensor_model_parallel_size 8"),
])
def test_check_resume_refuses_a_megatron_layout_the_job_refuses(tmp_path, block, world, message):
    """``--check-resume`` makes the Megatron engine's configuration checks, as the job does before
    its process group: a TP size that does not divide the ranks, or that the heads do not split
    over, would stop the job (exit 2). Fails on the code before, which reported "TP 2 × PP 1 × DP
    ?" and said the resume would go ahead."""
    raw = megatron_checkpoint(tmp_path, {})
    raw["megatron"].update(block)
    report, ok = check(tmp_path / "run", raw, world)
    assert not ok and message in report, report


@pytest.mark.parametrize("windows", [True, False])
def test_a_gpt_checkpoint_is_checked_against_the_gpt_windows_fingerprint(tmp_path, windows):
    """The Megatron engine records the fingerprint of its GPT windows (``JobData.fingerprint``
    with ``windows``: each document ends with ``[SEP]``), another than the BERT samples' of the
    same prepared data; ``--check-resume`` compares a Megatron checkpoint with that one, so the
    job's own checkpoint reads as the same data and one whose windows were made without the
    token (the BERT form of the fingerprint, as recorded before) as other data, which the job
    refuses. Fails on the code before, which had one fingerprint for both."""
    from types import SimpleNamespace

    from vrgd_ds.data_pipeline.tokenizer import sha256_file
    from vrgd_ds.train.config import parse_job
    from vrgd_ds.train.data import JobData, split_document

    raw = megatron_checkpoint(tmp_path, {})
    job = parse_job(raw)
    data = tmp_path / "run" / "data"  # job.data.path unset: the run directory's
    (data / "shards").mkdir(parents=True)
    (data / "tokenizer.model").write_bytes(b"a tokenizer")
    (data / "shards" / "manifest.json").write_text(json.dumps({"num_documents": 10, "sha256": "0" * 64}))
    prepared = JobData(SimpleNamespace(sha256=sha256_file(data / "tokenizer.model")),
                       SimpleNamespace(path=data / "shards"), {}, split_document(10, job.data.heldout_fraction),
                       job.seed, None)
    marker = tmp_path / "run" / "checkpoints" / "step00000004"
    info = ckpt.marker(marker.parent, marker.name)["info"] | {"data": prepared.fingerprint(windows=windows)}
    ckpt.mark_complete(marker.parent, marker.name, 4, 2, info)
    report, ok = check(tmp_path / "run", raw, 2)
    assert ok == windows and ("the data differs from the checkpoint's" in report) != windows, report


def test_a_change_of_model_chunks_is_reported_and_resumes(tmp_path):
    """A checkpoint saved with 2 model chunks a stage, configured with one (the key left out), or
    the other way round (a marker from before the record: one chunk): the report notes the change
    and the resume goes ahead (the sharded keys are global; the job's test resumes it)."""
    layout = {"pipeline_model_parallel_size": 2}
    raw = megatron_checkpoint(tmp_path, {"model": {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4},
                                         **layout}, pipeline_model_parallel_size=2, data_parallel_size=1,
                              virtual_pipeline_model_parallel_size=2)
    report, ok = check(tmp_path / "run", copy.deepcopy(raw), 2)
    assert ok and "was saved with 2 model chunk(s) a pipeline stage; resuming with 1 (dist-checkpointing" in report
    raw["megatron"]["virtual_pipeline_model_parallel_size"] = 2
    report, ok = check(tmp_path / "run", copy.deepcopy(raw), 2)
    assert ok and "model chunk" not in report, report
    raw = megatron_checkpoint(tmp_path / "old", {"model": {"num_layers": 4, "hidden_size": 64,
                                                           "num_attention_heads": 4}, **layout,
                                                 "virtual_pipeline_model_parallel_size": 2},
                              pipeline_model_parallel_size=2, data_parallel_size=1)
    report, ok = check(tmp_path / "old" / "run", raw, 2)
    assert ok and "was saved with 1 model chunk(s) a pipeline stage; resuming with 2" in report, report


@pytest.mark.parametrize("saved, now, ok", [
    ((True, "fp32"), {"use_distributed_optimizer": False}, False),
    ((False, "fp32"), {}, False),  # the default: the distributed optimizer
    ((False, "fp32"), {"use_distributed_optimizer": False, "precision": "bf16"}, False),
    ((False, "bf16"), {"use_distributed_optimizer": False, "precision": "fp16"}, True),  # one wrapper
    ((True, "fp32"), {"precision": "bf16"}, True),  # the distributed optimizer's format either way
])
def test_a_megatron_optimizer_wrapper_switch_would_stop_naming_the_keys(tmp_path, saved, now, ok):
    """A Megatron checkpoint saved under another optimizer wrapper (``use_distributed_optimizer``
    switched, or fp32 <-> bf16/fp16 without it) has an optimizer state no load carries over: the
    job and --check-resume stop, naming the keys, unless ``checkpoint.optimizer_state`` is
    ``reset_if_incompatible``. Fails on the code before, which reported the resume as going ahead;
    the job then failed inside the load (KeyError 'pre_wd_mult', or a message about a checkpoint
    format key the config did not set) and called the checkpoint broken."""
    from vrgd_ds.train.engines.megatron import MegatronBlock

    fields = MegatronBlock.model_fields  # the defaults --check-resume reads a block without these keys with
    assert fields["use_distributed_optimizer"].default is True and fields["precision"].default == "fp32"
    raw = megatron_checkpoint(tmp_path, now, precision=saved[1], use_distributed_optimizer=saved[0])
    ckpt_dir = tmp_path / "run" / "checkpoints"
    report, went = check(tmp_path / "run", copy.deepcopy(raw), 2)
    assert went == ok, report
    if not ok:
        assert (f"would stop: {ckpt_dir / 'step00000004'} was saved with megatron.use_distributed_optimizer "
                f"{str(saved[0]).lower()} and megatron.precision '{saved[1]}'") in report
        raw["checkpoint"] = {"optimizer_state": "reset_if_incompatible"}
        raw["optimizer"]["type"] = "Lamb"  # a member's switch too: nothing carries over from a fresh state
        report, went = check(tmp_path / "run", raw, 2)
        assert went and "resuming its weights and data position with a fresh" in report, report
        assert "carry over" not in report, report


def test_an_adaptive_position_no_round_of_this_layout_divides_is_refused_naming_the_ranks(run_dir):
    """An adaptive phase saved 24 samples in (batches of micro_batch 4 × 2 ranks) cannot continue
    on 4 ranks, where each step takes multiples of 16 and each rank starts at consumed + rank × 4:
    the resume stops before loading, naming the rank counts that can take it (1 and 2). The code
    before got as far as the phase's sampler, which failed naming its own option
    (``PretrainingSampler option consumed_samples=24``) and a fix that did not apply; this test
    fails on it (--check-resume reported the resume as going ahead)."""
    from vrgd_ds.train.config import ConfigError, check_resume_position, parse_job

    info = ckpt.marker(run_dir / "checkpoints", "step00000004")["info"]
    ckpt.mark_complete(run_dir / "checkpoints", "step00000004", 4, 2, dict(info, consumed=[24]))
    report, ok = check(run_dir, copy.deepcopy(RAW), 4)
    assert not ok
    assert ("would stop: job.phases[0]: the checkpoint is 24 samples into the phase, which is no multiple of "
            "micro_batch x ranks = 4 x 4") in report
    assert "resume on 1, 2 data-parallel rank(s)" in report
    eights = copy.deepcopy(RAW)
    eights["job"]["phases"][0]["global_batch"] = 8  # a fixed phase 24 samples in takes a batch that divides 24
    assert check(run_dir, eights, 2)[1]
    job = parse_job(RAW)
    check_resume_position(job, [128], [128], 3)  # a finished phase is not positioned again
    with pytest.raises(ConfigError, match="no multiple of micro_batch x ranks = 4 x 4"):
        check_resume_position(job, [24], [128], 4)
    # the rank counts named must also divide the adaptive bounds (min_batch 8: not 3 ranks of 4). Fails on the
    # old code, which named 3, where the job then refused min_batch
    raw = copy.deepcopy(RAW)
    raw["job"]["phases"][0].update(global_batch=24, adaptive_batch={"target_ratio": 1.0, "min_batch": 8,
                                                                     "max_batch": 48})
    with pytest.raises(ConfigError, match=r"resume on 1, 2 data-parallel rank\(s\)"):
        check_resume_position(parse_job(raw), [24], [10 ** 6], 4)


def test_a_fixed_phase_resumed_with_a_batch_its_position_is_no_multiple_of_is_refused(run_dir):
    """A fixed phase saved at global_batch 64 two steps in (128 samples of 10 steps) and resumed with
    96: its samples are 10 × 96 = 960, and steps of 96 from 128 end at 992, past them. The job and
    --check-resume stop, naming global_batch. Fails on the code before, which went ahead (and the
    last step read 32 samples of the next phase's budget)."""
    from vrgd_ds.train.config import ConfigError, check_resume_position, parse_job

    raw = copy.deepcopy(RAW)
    raw["job"]["phases"][0].update(global_batch=96, micro_batch=8)
    raw["job"]["total_steps"] = 10
    with pytest.raises(ConfigError, match=r"job.phases\[0\].global_batch: the checkpoint is 128 samples into the "
                                          r"phase, no multiple of 96"):
        check_resume_position(parse_job(raw), [128], [960], 2)
    raw["job"]["phases"][0]["global_batch"] = 32  # divides 128: ends on the phase's 320 samples
    check_resume_position(parse_job(raw), [128], [320], 2)
    info = ckpt.marker(run_dir / "checkpoints", "step00000004")["info"]
    ckpt.mark_complete(run_dir / "checkpoints", "step00000004", 4, 2, dict(info, consumed=[128]))
    raw["job"]["phases"][0]["global_batch"] = 96
    report, ok = check(run_dir, raw, 2)
    assert not ok and "would stop: job.phases[0].global_batch: the checkpoint is 128 samples" in report, report


def test_an_adaptive_phase_resumed_with_fewer_samples_left_than_its_min_batch_is_refused():
    """An adaptive phase 1,216 samples in, resumed with another budget (``job.total_steps``
    changed) that leaves it 64 samples, below ``min_batch`` 128: refused, naming the key and the
    budgets that resume; 128 left, or none, resume. Fails on the code before, which went ahead: the
    last step took the 64 left (one gradient group on one rank: the optimizer refused it, exit 1 on
    every restart)."""
    from vrgd_ds.train.config import ConfigError, check_resume_position, parse_job

    raw = copy.deepcopy(RAW)
    raw["job"]["phases"][0].update(global_batch=128, micro_batch=64,
                                   adaptive_batch={"target_ratio": 1.0, "min_batch": 128, "max_batch": 512})
    job = parse_job(raw)
    with pytest.raises(ConfigError, match=r"job.phases\[0\].adaptive_batch.min_batch: the checkpoint is 1216 samples "
                                          r"into the phase, and this config gives it 1280: its last step would take the "
                                          r"64 left, fewer than min_batch 128 .*at least 1344 samples, or end it at 1216"):
        check_resume_position(job, [1216], [1280], 1)
    check_resume_position(job, [1216], [1344], 1)
    check_resume_position(job, [1216], [1216], 1)


def test_a_longer_run_that_would_go_back_to_an_earlier_phase_is_refused(run_dir):
    """Two phases of 2 steps at 16 (32 samples each), saved in the second (16 samples in) and
    resumed with job.total_steps 8: phase 0 would have 64 samples, 32 more than it trained, and
    the job takes the first phase with samples left. Before, it went back to seq 32 at step 5 and
    then ran phase 1 again from its position, both exiting 0. Now the job and --check-resume stop,
    naming the phase and the fix; a smaller fraction for phase 0 beside the larger total_steps
    resumes (fails on the old code)."""
    from vrgd_ds.train.config import ConfigError, check_resume_position, parse_job

    raw = copy.deepcopy(RAW)
    raw["job"]["total_steps"] = 4
    raw["job"]["phases"] = [dict(raw["job"]["phases"][0], fraction=0.5),
                            dict(raw["job"]["phases"][0], seq_len=64, fraction=0.5)]
    longer = copy.deepcopy(raw)
    longer["job"]["total_steps"] = 8
    with pytest.raises(ConfigError, match=r"job.phases\[0\]: the checkpoint is in phase 1 \(16 samples in\), and this "
                                          r"config gives phase 0 64 samples, 32 more than it trained"):
        check_resume_position(parse_job(longer), [32, 16], [64, 64], 2)
    check_resume_position(parse_job(raw), [32, 16], [32, 32], 2)  # as saved
    info = ckpt.marker(run_dir / "checkpoints", "step00000004")["info"]
    saved = [p.model_dump(mode="json") for p in parse_job(raw).phases]
    ckpt.mark_complete(run_dir / "checkpoints", "step00000004", 3, 2,
                       dict(info, consumed=[32, 16], total_steps=4, phases=saved))
    report, ok = check(run_dir, longer, 2)
    assert not ok and "would stop: job.phases[0]: the checkpoint is in phase 1" in report, report
    longer["job"]["phases"][0]["fraction"], longer["job"]["phases"][1]["fraction"] = 0.25, 0.75  # 2 steps, then 6
    report, ok = check(run_dir, longer, 2)
    assert ok, report


def test_an_adaptive_phase_whose_settings_would_change_is_refused_naming_the_keys(tmp_path):
    """An adaptive phase's controller starts after the warmup (``start_step``, derived from
    ``total_steps``, ``fraction`` and ``warmup_fraction``); a resume with another ``total_steps``
    moves it, which the job refuses. --check-resume says so, naming the keys. Fails on the code
    before: it reported the resume as going ahead (exit 0), and the job then stopped naming
    ``start_step``, which no config has."""
    from vrgd_ds.train.config import parse_job

    raw = copy.deepcopy(RAW)
    raw["job"]["phases"][0].update(warmup_fraction=0.25, adaptive_batch={"target_ratio": 1.0, "min_batch": 16,
                                                                          "max_batch": 64, "every": 2})
    ckpt_dir = tmp_path / "run" / "checkpoints"
    (ckpt_dir / "step00000004").mkdir(parents=True)
    (ckpt_dir / "step00000004" / "mp_rank_00_model_states.pt").write_bytes(b"x")
    info = dict(INFO, phases=[p.model_dump(mode="json") for p in parse_job(raw).phases])
    ckpt.mark_complete(ckpt_dir, "step00000004", 4, 1, info)
    report, ok = check(tmp_path / "run", copy.deepcopy(raw), 1)
    assert ok, report
    raw["job"]["total_steps"] = 16
    report, ok = check(tmp_path / "run", raw, 1)
    assert not ok and "would stop: job.phases[0].adaptive_batch: the checkpoint's controller settings differ in " \
                      "start_step (from job.total_steps, job.phases[0].fraction or warmup_fraction" in report, report
    # the adaptive block removed: the job refuses it (Job.resume), and so does --check-resume. Fails on the old
    # code, which reported the resume as going ahead
    raw["job"]["total_steps"] = RAW["job"]["total_steps"]
    del raw["job"]["phases"][0]["adaptive_batch"]
    report, ok = check(tmp_path / "run", raw, 1)
    assert not ok and "would stop: job.phases[0]: phase 0 ran with adaptive_batch, the config has none there" \
        in report, report
    # a phase the checkpoint has not started may change (the job keeps nothing of its controller). Fails on the
    # old code, whose adaptive_changes took no positions
    from vrgd_ds.train.config import adaptive_changes

    two = copy.deepcopy(RAW)
    adaptive = dict(two["job"]["phases"][0], fraction=0.5, adaptive_batch={"target_ratio": 1.0, "min_batch": 16,
                                                                          "max_batch": 64})
    two["job"]["phases"] = [dict(two["job"]["phases"][0], fraction=0.5), adaptive]
    saved = parse_job(two)
    two["job"]["phases"][1] = two["job"]["phases"][0]
    assert adaptive_changes(saved, parse_job(two), 1, consumed=[32, 0]) == []
    assert adaptive_changes(saved, parse_job(two), 1, consumed=[64, 16]) == [
        "job.phases[1]: phase 1 ran with adaptive_batch, the config has none there; resume with the config it was "
        "saved with"]


def test_adaptive_settings_saved_on_other_ranks_are_compared_not_checked_against_these(tmp_path):
    """A run saved on 2 ranks (micro-batch × ranks 8) with an adaptive phase of global_batch 48 and
    min_batch 24, checked for 4 ranks (16) with 64 and 32: --check-resume says the resume would stop
    on the changed settings, naming the config's keys. Fails on the code before, which built the
    saved settings for the new ranks: a traceback from ControllerSettings (exit 1) on the saved
    48, or, for the saved 24, a line blaming the config's min_batch for the checkpoint's value."""
    from vrgd_ds.train.config import parse_job

    raw = copy.deepcopy(RAW)
    raw["job"]["phases"][0].update(global_batch=48, adaptive_batch={"target_ratio": 1.0, "min_batch": 24,
                                                                     "max_batch": 96})
    ckpt_dir = tmp_path / "run" / "checkpoints"
    (ckpt_dir / "step00000004").mkdir(parents=True)
    (ckpt_dir / "step00000004" / "mp_rank_00_model_states.pt").write_bytes(b"x")
    info = dict(INFO, phases=[p.model_dump(mode="json") for p in parse_job(raw).phases], consumed=[96])
    ckpt.mark_complete(ckpt_dir, "step00000004", 4, 2, info)
    raw["job"]["phases"][0].update(global_batch=64, adaptive_batch={"target_ratio": 1.0, "min_batch": 32,
                                                                     "max_batch": 96})
    report, ok = check(tmp_path / "run", raw, 4)
    assert not ok and "would stop: job.phases[0].adaptive_batch: the checkpoint's controller settings differ in " \
                      "initial_batch, min_batch (from job.phases[0].global_batch; " \
                      "job.phases[0].adaptive_batch.min_batch)" in report, report


def test_a_phase_added_goes_ahead_and_a_dropped_phase_that_ran_would_stop(run_dir):
    """--check-resume agrees with the job (``test_job_spine.py``): a phase added after the saved
    ones starts at 0; the checkpoint's second phase, started, missing from the config stops it.
    Fails on the old code, which approved the second: it checked the positions only when the
    numbers of phases matched."""
    raw = copy.deepcopy(RAW)
    raw["job"]["total_steps"] = 16
    raw["job"]["phases"] = [dict(RAW["job"]["phases"][0], fraction=0.5), dict(RAW["job"]["phases"][0], fraction=0.5,
                                                                            seq_len=64)]
    assert check(run_dir, raw, 2)[1]
    info = ckpt.marker(run_dir / "checkpoints", "step00000004")["info"]
    ckpt.mark_complete(run_dir / "checkpoints", "step00000004", 4, 2, dict(info, consumed=[128, 32]))
    report, ok = check(run_dir, copy.deepcopy(RAW), 2)
    assert not ok and "would stop: job.phases: the checkpoint trained 2 phases (phase 1: 32 samples)" in report


@pytest.mark.parametrize("stage, ok", [(0, False), (1, True), (3, False)])
def test_a_zero_stage_whose_checkpoint_does_not_load_is_refused_naming_both_stages(run_dir, stage, ok):
    """A ZeRO-2 checkpoint resumed under stage 0 or 3: DeepSpeed's files of one do not load into the
    other, so every checkpoint failed to load and the job said to move the run directory away
    (exit 2, the run thrown away if followed). Refused before loading, naming both stages; stage 1
    loads stage 2's files and goes ahead. Fails on the old code, which --check-resume approved
    ("ZeRO stage 2 -> 0") and the job tried."""
    raw = copy.deepcopy(RAW)
    raw["zero_optimization"]["stage"] = stage
    report, went = check(run_dir, raw, 2)
    assert went == ok, report
    if not ok:
        assert (f"would stop: {run_dir / 'checkpoints' / 'step00000004'}: saved under ZeRO stage 2, the config has "
                f"zero_optimization.stage {stage}") in report
        assert "Resume with zero_optimization.stage 2" in report


@pytest.mark.parametrize("policy, ok", [(None, False), ("continue", True)])
def test_other_data_would_stop_unless_the_config_says_continue(run_dir, monkeypatch, policy, ok):
    """Data of another fingerprint than the checkpoint's: ``--check-resume`` says the job would
    stop, naming ``checkpoint.data_change``, as the job does; with ``"continue"`` it goes ahead and
    lists the change. Fails on the old code, which listed the change and said go ahead, the job
    then resuming in the new stream without a word."""
    from vrgd_ds.train import data

    monkeypatch.setattr(data, "configured_fingerprint", lambda job, run_dir: "fedcba9876543210")
    raw = copy.deepcopy(RAW)
    if policy:
        raw["checkpoint"] = {"data_change": policy}
    report, go = check(run_dir, raw, 2)
    assert go == ok, report
    assert "the data differs from the checkpoint's, fingerprint 0123456789abcdef -> fedcba9876543210" in report
    assert ("would stop:" in report and "data_change" in report) != ok, report


@pytest.mark.parametrize("policy, ok", [(None, False), ("continue", True)])
def test_a_checkpoint_whose_numpy_drew_other_samples_would_stop_unless_the_config_says_continue(run_dir, policy, ok):
    """A checkpoint whose marker records other draws of numpy's ``Generator`` than this numpy's
    (another release: the rest of the epoch in another order, samples repeated and skipped):
    ``--check-resume`` says the job would stop, naming numpy's releases and
    ``checkpoint.data_change``; with ``"continue"`` it goes ahead and lists the change; the
    same draws say nothing. Fails on the code before, which recorded neither and resumed in the
    new order without a word."""
    from vrgd_ds.data_pipeline.samples import generator_streams

    tag = run_dir / "checkpoints" / "step00000004"
    marker = ckpt.marker(run_dir / "checkpoints", "step00000004")
    raw = copy.deepcopy(RAW)
    if policy:
        raw["checkpoint"] = {"data_change": policy}
    for streams, said in ((generator_streams(), False), ("0123456789abcdef", True)):
        ckpt.mark_complete(run_dir / "checkpoints", "step00000004", 4, 2,
                           dict(marker["info"], numpy_streams=streams, numpy="1.0.0"))
        report, go = check(run_dir, raw, 2)
        assert ("numpy 1.0.0 drew this run's sample order and masks" in report) == said, report
        assert go == (ok or not said), report
        if said and not ok:
            assert f"would stop: {tag}" in report and "pip install numpy==1.0.0" in report and "data_change" in report


def test_a_global_batch_the_ranks_do_not_split_would_stop_as_the_job_does(run_dir):
    """On 8 ranks a global batch of 16 in micro-batches of 4 does not split: the job stops at its
    set-up (``phase_settings``), and ``--check-resume`` says it would. Fails on the old code, whose
    report said go ahead."""
    report, ok = check(run_dir, copy.deepcopy(RAW), 8)
    assert not ok
    assert "would stop: job.phases[0].global_batch: 16 is not divisible by micro_batch x ranks = 4 x 8" in report


TWO_PHASES = [{"seq_len": 32, "fraction": 0.5, "global_batch": 12, "micro_batch": 2, "lr": 2e-3},
              {"seq_len": 32, "fraction": 0.5, "global_batch": 16, "micro_batch": 2, "lr": 2e-3}]


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("consumed, ok", [([48, 0], True), ([48, 32], True), ([36, 0], False)])
def test_a_finished_phase_whose_batch_the_new_ranks_do_not_split_goes_ahead(run_dir, consumed, ok, adaptive):
    """Saved on 2 ranks, resumed on 4: phase 0's batch of 12 in micro-batches of 2 does not split
    over 4 ranks (nor, adaptive, its bounds 12 and 24), phase 1's of 16 does. With phase 0 done
    (4 steps of 12: 48 samples) the resume takes no step in it and goes ahead, in phase 1 or at
    its start; 36 samples in, phase 0 has a step left and the resume would stop, naming its
    batch. Fails on the old code, which checked every phase's batch on the new ranks and stopped
    all three, the message's fix (another global_batch for a finished phase) moving the phase
    boundaries of the run."""
    from vrgd_ds.train.config import parse_job

    raw = copy.deepcopy(RAW)
    raw["job"]["phases"] = copy.deepcopy(TWO_PHASES)
    if adaptive:
        raw["job"]["phases"][0]["adaptive_batch"] = {"target_ratio": 1.0, "min_batch": 12, "max_batch": 24}
    marker = ckpt.marker(run_dir / "checkpoints", "step00000004")
    ckpt.mark_complete(run_dir / "checkpoints", "step00000004", 4, 2, dict(
        marker["info"], consumed=consumed, phases=[p.model_dump(mode="json") for p in parse_job(raw).phases]))
    report, go = check(run_dir, raw, 4)
    assert go == ok, report
    assert ("would stop: job.phases[0].global_batch: 12 is not divisible by micro_batch x ranks = 2 x 4"
            in report) != ok, report


def test_the_megatron_layout_check_passes_over_finished_phases():
    """The Megatron engine's layout check of the batches on the ranks, with and without phase 0
    finished (the same rule as the DeepSpeed job's ``phase_settings``). Fails on the old code,
    which had no ``finished`` and refused phase 0's batch on 4 data-parallel ranks."""
    pytest.importorskip("megatron.core")
    from vrgd_ds.train.config import ConfigError, parse_job
    from vrgd_ds.train.engines.megatron import check

    raw = {"optimizer": {"type": "VRLamb", "params": {}},
           "megatron": {"model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4}},
           "job": {"engine": "megatron", "total_steps": 8, "phases": copy.deepcopy(TWO_PHASES)}}
    job = parse_job(raw)
    with pytest.raises(ConfigError, match=r"job.phases\[0\].global_batch: 12 is not divisible .* 2 x 4"):
        check(raw, job, 4)
    check(raw, job, 4, frozenset({0}))
    with pytest.raises(ConfigError, match=r"job.phases\[1\].global_batch: 16 is not divisible .* 2 x 16"):
        check(raw, job, 16, frozenset({0}))


def test_a_started_phase_with_another_seq_len_would_stop_and_a_phase_after_it_may_have_one(run_dir):
    """The checkpoint is 64 samples into its one phase at seq 32: a config with seq 64 there
    would read that position in another index, another sample stream, so ``--check-resume`` says
    the job would stop, naming the key and the fix; ending the phase where it is (8 steps of
    which 4 ran: fraction 0.5 of 8 steps is its 64 samples) and adding a seq-64 phase after it
    goes ahead. Fails on the old code, which said only that the phases differ and went ahead."""
    raw = copy.deepcopy(RAW)
    raw["job"]["phases"][0]["seq_len"] = 64
    report, ok = check(run_dir, raw, 2)
    assert not ok and "would stop: job.phases[0].seq_len: the checkpoint trained 64 samples of this phase at " \
                      "seq_len 32, the config has 64" in report, report
    raw["job"]["phases"] = [dict(RAW["job"]["phases"][0], fraction=0.5),
                            dict(RAW["job"]["phases"][0], fraction=0.5, seq_len=64)]
    report, ok = check(run_dir, raw, 2)
    assert ok, report


def test_saved_phases_the_code_of_now_would_refuse_do_not_stop_the_resume():
    """A marker whose phases an older release accepted and today's checks refuse (a warmup of
    0.6 of a 2-step phase, which rounds to no decay), resumed with a valid config: the marker's
    checks compare the saved phases only where one was adaptive, and a saved job that no longer
    parses leaves the controller's comparison to the loaded state. Fails on the code before,
    which parsed the saved phases for every resume and stopped it with their error, as if the
    config were at fault."""
    from vrgd_ds.train.config import ConfigError, check_resume_marker, parse_job

    phase = {"seq_len": 32, "fraction": 1.0, "global_batch": 4, "micro_batch": 2, "lr": 1e-3, "warmup_fraction": 0.6}
    with pytest.raises(ConfigError, match="warmup_fraction"):
        parse_job({"job": {"total_steps": 2, "phases": [phase]}})
    job = parse_job({"job": {"total_steps": 10, "phases": [phase]}})
    check_resume_marker(job, {"total_steps": 2, "phases": [dict(phase, adaptive_batch=None)], "consumed": [4]}, 1)
    adaptive = dict(phase, adaptive_batch={"target_ratio": 1.0, "min_batch": 4, "max_batch": 16})
    check_resume_marker(parse_job({"job": {"total_steps": 10, "phases": [adaptive]}}),
                        {"total_steps": 2, "phases": [adaptive], "consumed": [4]}, 1)


def test_world_size_without_check_resume_is_refused(capsys, tmp_path):
    """``--world-size`` says how many ranks a resume would run on, for ``--check-resume``; given to
    a run it was accepted and ignored (fails on the old code, which started the run)."""
    with pytest.raises(SystemExit) as exc:
        loop.main(["--config", str(tmp_path / "c.json"), "--run-dir", str(tmp_path / "run"), "--world-size", "8"])
    assert exc.value.code == 2
    assert "--world-size applies to --check-resume only" in capsys.readouterr().err


def test_check_resume_makes_the_deepspeed_engines_config_checks(run_dir):
    """``--check-resume`` refuses what the DeepSpeed engine's configuration checks refuse before
    any work (a ``scheduler`` block here: the job's phases set the LR), as it does the Megatron
    engine's. Fails on the old code, which said the resume would go ahead and the job then exited 2."""
    raw = copy.deepcopy(RAW)
    raw["scheduler"] = {"type": "WarmupDecayLR", "params": {"total_num_steps": 8}}
    report, ok = check(run_dir, raw, 2)
    assert not ok and "would stop: scheduler: the job sets the learning rate from its phases" in report, report
    raw["scheduler"] = None
    assert check(run_dir, raw, 2)[1]
    raw["optimizer"]["params"]["lr"] = 0.5  # the job's check too (test_engines.py: ignored, the phases set the LR)
    report, ok = check(run_dir, raw, 2)
    assert not ok and "would stop: optimizer.params.lr: 0.5 has no effect" in report, report


def test_check_resume_stops_on_a_change_of_the_gpts_tie(tmp_path):
    """``--check-resume`` says a tied GPT's checkpoint would not resume untied (nor the other way
    round), naming the key, as the job stops on it before loading; the same tie resumes."""
    raw = megatron_checkpoint(tmp_path, {}, share_embeddings_and_output_weights=True)
    report, ok = check(tmp_path / "run", copy.deepcopy(raw), 2)
    assert not ok and ("its GPT was saved with megatron.model.share_embeddings_and_output_weights true, this "
                       "configuration builds false") in report
    raw["megatron"]["model"]["share_embeddings_and_output_weights"] = True
    report, ok = check(tmp_path / "run", raw, 2)
    assert ok, report


def test_check_resume_reads_the_gpts_tie_as_the_job_does(tmp_path):
    """The tie as the job's block parses it: the string "false" is pydantic's false, so an untied
    checkpoint resumes. Fails on the code before, whose ``bool("false")`` made --check-resume say it
    would stop."""
    raw = megatron_checkpoint(tmp_path, {})
    raw["megatron"]["model"]["share_embeddings_and_output_weights"] = "false"
    report, ok = check(tmp_path / "run", raw, 2)
    assert ok, report
