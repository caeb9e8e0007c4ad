"""The pretraining job on the Megatron engine (``configs/megatron/gpt_tiny_cpu_vr_lamb.json``) end to
end on 2 CPU ranks under torchrun, as Megatron users launch it: Megatron's schedule and gradient
finalisation, the distributed optimizer, VR-LAMB from ``vrgd_ds.megatron``, the job's metrics,
evaluation and checkpoints; bf16 and fp16. (The failure cases, for both engines:
``test_reliability.py``; the configuration errors: ``tests/unit/test_engines.py``.)"""
from __future__ import annotations

import json
import math
import re
import shutil
import sys
from pathlib import Path

import launching
import pytest
from jobs import records

pytest.importorskip("megatron.core", reason="the megatron extra is not installed")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "megatron" / "gpt_tiny_cpu_vr_lamb.json"


def _train(tmp_path: Path, corpus: Path, *sets: str) -> dict[int, dict]:
    return _launch(tmp_path, corpus, *sets)[0]


def _launch(tmp_path: Path, corpus: Path, *sets: str, ranks: int = 2) -> tuple[dict[int, dict], str]:
    """The job's records, and its output."""
    run_dir = tmp_path / "run"
    torchrun = Path(sys.executable).parent / "torchrun"
    res = launching.run([torchrun, "--nproc_per_node", str(ranks), "--master_port", str(launching.free_port()), "-m",
                         "vrgd_ds.train", "--config", CONFIG, "--run-dir", run_dir, "--set",
                         f"job.data.path={json.dumps(str(corpus))}", *[a for s in sets for a in ("--set", s)]],
                        timeout=420, marker=run_dir)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "held-out LM loss" in res.stdout and (run_dir / "checkpoints" / "latest").is_file()
    assert any((run_dir / "plots").glob("*.png"))
    return records(run_dir), res.stdout + res.stderr


def _estimate(out: str) -> tuple[float, float]:
    """The first checkpoint's size written and as estimated before it was written (the free-space check)."""
    found = re.search(r"checkpoint \S+: ([\d.]+) MB written \(expected ([\d.]+) MB: the engine's estimate\)", out)
    return float(found.group(1)), float(found.group(2))


def _cut_back(tmp_path: Path, last: int, to: int, *copies: str) -> None:
    """``tmp_path/cut``: the run in ``tmp_path/whole`` cut back to its step-``to`` checkpoint (the
    step-``last`` one removed), and each of ``copies`` a copy of that."""
    shutil.copytree(tmp_path / "whole" / "run", tmp_path / "cut" / "run")
    checkpoints = tmp_path / "cut" / "run" / "checkpoints"
    shutil.rmtree(checkpoints / f"step{last:08d}")
    (checkpoints / "latest").write_text(f"step{to:08d}")
    for name in copies:
        shutil.copytree(tmp_path / "cut", tmp_path / name)


def _taken(rec: dict[int, dict]) -> list[dict]:
    return [r for s, r in sorted(rec.items()) if s > 0 and r.get("step/skipped") == 0.0]


@pytest.mark.exhaustive  # make test trains the engine in test_reliability.py (another TP size)
def test_gpt_job_trains_with_vr_lamb_on_two_ranks(tmp_path, corpus):
    rec, out = _launch(tmp_path, corpus, "job.total_steps=6")
    steps = [r for s, r in sorted(rec.items()) if s > 0]
    assert [r["step"] for r in steps] == list(range(1, 7)) and _taken(rec) == steps
    # global batch 32 = 2 ranks × 4 micro-batches of 4: n = 8 gradient groups per step
    assert {r["gsnr/n"] for r in steps} == {8.0}
    assert all(0.0 < r["gsnr/scale_mean"] < 1.0 for r in steps)  # the GSNR damps
    assert steps[-1]["train/loss"] < steps[0]["train/loss"]
    assert rec[6]["eval/lm_loss"] < rec[0]["eval/lm_loss"]
    # the statistics' extra bytes: the same every step (one fp32 gradient with the buckets' padding)
    sent = [r["comm/vrgd_bytes_total"] for r in steps]
    assert len({b - a for a, b in zip([0.0] + sent, sent)}) == 1
    # the first checkpoint's size, estimated before it was written (the free-space check): the model
    # once (the old code counted it on every data-parallel rank: 1.15x here), the fp32 main weights
    # and the optimizer state over the ranks
    written, expected = _estimate(out)
    assert 0.9 < expected / written < 1.1, (written, expected)


@pytest.mark.exhaustive
def test_gpt_job_in_bf16(tmp_path, corpus):
    """bf16 as Megatron trains it: the model in bf16 inside ``Float16Module``, gradients reduced in
    fp32, fp32 main parameters in the optimizer; the statistics read the same fp32 buffers."""
    rec = _train(tmp_path, corpus, "job.total_steps=6", 'megatron.precision="bf16"')
    taken = _taken(rec)
    assert len(taken) == 6 and {r["gsnr/n"] for r in taken} == {8.0}
    assert all(0.0 < r["gsnr/scale_mean"] < 1.0 for r in taken)
    assert taken[-1]["train/loss"] < taken[0]["train/loss"]


@pytest.mark.exhaustive
def test_gpt_job_in_fp16_scales_the_loss_and_skips_overflowing_steps(tmp_path, corpus):
    """fp16 with Megatron's dynamic loss scale (initial 2^32): the first steps overflow, are skipped
    (no GSNR statistics are consumed) and lower the scale; once it fits, steps are taken with the
    statistics of all 8 groups, the loss scale taken out of them. Fails without the engine handing
    the optimizer's ``scale_loss`` to Megatron's schedule (``grad_scale_func``): the loss was then
    never scaled, every gradient was divided by 2^32 on the way to the optimizer, nothing
    overflowed and every step was taken with a zero gradient (grad norm 0.0). Fails too on the code
    before ``vrgd_ds.megatron``'s step hook recorded the steps Megatron skips: a skipped step's
    record then carried the previous step's optimizer metrics (or none: no ``step/skipped``)."""
    rec = _train(tmp_path, corpus, "job.total_steps=20", 'megatron.precision="fp16"')
    steps = [r for s, r in sorted(rec.items()) if s > 0]
    taken, skipped = _taken(rec), [r for r in steps if r["step/skipped"] == 1.0]
    assert skipped and taken and steps.index(taken[0]) == len(skipped), [r["step/skipped"] for r in steps]
    scales = [r["train/loss_scale"] for r in steps]
    assert scales[0] == 2.0**32 and scales[-1] < 2.0**32 and scales == sorted(scales, reverse=True)
    assert all(r["gsnr/n"] == 8.0 and 0.0 < r["gsnr/scale_mean"] < 1.0 and r["train/grad_norm"] > 0.0 for r in taken)


@pytest.mark.exhaustive
def test_gpt_job_on_other_layouts_and_phases(tmp_path, corpus):
    """Pipeline parallelism (PP 2, two phases of seq 32 then 64; the evaluations before
    training and at the end on the last phase's held-out windows) and tensor parallelism with a global batch that only the data-parallel ranks
    divide (TP 2: 12 = 4 × 3 × 1 rank, not a multiple of 4 × 2 ranks). Before: PP 2 stopped in
    megatron-core's config check (no ``pipeline_dtype``); the first evaluation of a two-phase run
    used the first phase's sequence length for the last phase's windows; and the spine checked a
    phase's batch against every rank, not the data-parallel ones (TP 2 with batch 12 stopped
    with exit 2 at the phase's start). 30 held-out windows at micro-batch 4 are all evaluated, the
    last 2 in a pass of their own through the pipeline (before: 28, the partial batch dropped)."""
    phases = json.dumps([{"seq_len": 32, "fraction": 0.5, "global_batch": 16, "micro_batch": 4, "lr": 4e-3},
                         {"seq_len": 64, "fraction": 0.5, "global_batch": 16, "micro_batch": 4, "lr": 2e-3}])
    rec = _train(tmp_path / "pp", corpus, "job.total_steps=4", "megatron.pipeline_model_parallel_size=2",
                 f"job.phases={phases}", "job.eval_every=2", "job.data.eval_samples=30")
    taken = _taken(rec)
    assert [rec[s]["eval/tokens"] for s in (0, 2, 4)] == [30 * 64, 30 * 32, 30 * 64]
    assert len(taken) == 4 and [r["train/seq_len"] for r in taken] == [32, 32, 64, 64]
    assert all(math.isfinite(r["train/loss"]) and r["gsnr/n"] == 4.0 for r in taken)  # 1 DP rank × 4 micro-batches
    assert all(math.isfinite(rec[s]["eval/lm_loss"]) for s in (0, 2, 4))
    rec = _train(tmp_path / "tp", corpus, "job.total_steps=2", "megatron.tensor_model_parallel_size=2",
                 "job.phases.0.global_batch=12")
    assert [r["gsnr/n"] for r in _taken(rec)] == [3.0, 3.0]


@pytest.mark.exhaustive
@pytest.mark.parametrize("precision, distributed", [("bf16", "false"), ("fp16", "true"), ("fp32", "false")])
def test_a_half_precision_run_resumes_exactly(tmp_path, corpus, precision, distributed):
    """A run cut back to a checkpoint and resumed takes the next steps bit for bit as the
    uninterrupted run did (fp16: 18 steps cut back to step 15, the first 13 skipped while Megatron's
    loss scale comes down from 2^32, so that the checkpoint holds stepped optimizer state and the
    steps compared are taken; else 6 steps cut back to step 3). Fails on the code before: (bf16
    without the distributed optimizer, ``Float16OptimizerWithFloat16Params``) its load copied the
    bf16 model over the fp32 main weights the checkpoint had just restored (Megatron's
    ``reload_model_params``), and the resumed run stepped from bf16-rounded weights, its loss 2.8e-5
    off at step 5, with no warning; (fp16) the loss scale's load called ``.cuda()``, so on CPU ranks
    no fp16 checkpoint loaded and the job stopped with "no complete checkpoint to resume from"."""
    last, cut = (18, 15) if precision == "fp16" else (6, 3)
    sets = (f"job.total_steps={last}", f"job.checkpoint_every={cut}", f'megatron.precision="{precision}"',
            f"megatron.use_distributed_optimizer={distributed}", "megatron.model.hidden_dropout=0.0",
            "megatron.model.attention_dropout=0.0")
    whole, out = _launch(tmp_path / "whole", corpus, *sets)
    _cut_back(tmp_path, last, cut)
    resumed, out_cut = _launch(tmp_path / "cut", corpus, *sets)
    assert launching.resumed_at(out_cut) == cut  # not a fresh start that happens to write the same records
    after = range(cut + 1, last + 1)
    assert all(whole[s]["step/skipped"] == 0.0 for s in (cut, *after)), [whole[s]["step/skipped"] for s in whole if s]
    for key in ("train/loss", "train/grad_norm", "train/loss_scale"):
        assert [resumed[s].get(key) for s in after] == [whole[s].get(key) for s in after], key
    # the first checkpoint's size estimated before it was written: without the distributed optimizer its
    # state and fp32 main weights once, not once per data-parallel rank (2.2x for fp32 before)
    written, expected = _estimate(out)
    assert 0.9 < expected / written < 1.1, (written, expected)


@pytest.mark.exhaustive  # three launches (make test: the refusal before loading, tests/unit/test_check_resume.py)
def test_a_longer_phase_added_at_a_resume_needs_the_positions_from_the_start(tmp_path, corpus):
    """A seq-32 run resumed with a seq-64 phase added after it: the GPT's learned positions were
    built for 32, and dist-checkpointing loads the table into no other size. Before, every
    checkpoint of the run failed to load and the job said there was no complete checkpoint to
    resume from, to move the directory away (exit 2 after a load attempt per checkpoint); it now
    stops before loading, naming ``megatron.model.max_position_embeddings`` (fails on the old
    code). A run given 64 positions from its start takes the longer phase at its resume."""
    def phases(*lens):
        return "job.phases=" + json.dumps([{"seq_len": n, "fraction": 1 / len(lens), "global_batch": 16,
                                             "micro_batch": 4, "lr": 4e-3} for n in lens])

    short = ("job.total_steps=2", "job.checkpoint_every=2", "job.eval_every=0", "job.data.eval_samples=8", phases(32))
    grown = ("job.total_steps=4", "job.checkpoint_every=2", "job.eval_every=0", "job.data.eval_samples=8",
             phases(32, 64))
    _train(tmp_path / "a", corpus, *short)
    run_dir = tmp_path / "a" / "run"
    torchrun = Path(sys.executable).parent / "torchrun"
    res = launching.run([torchrun, "--nproc_per_node", "2", "--master_port", str(launching.free_port()), "-m",
                         "vrgd_ds.train", "--config", CONFIG, "--run-dir", run_dir, "--set",
                         f"job.data.path={json.dumps(str(corpus))}", *[a for s in grown for a in ("--set", s)]],
                        timeout=420, marker=run_dir)
    out = res.stdout + res.stderr
    assert res.returncode != 0, out[-3000:]  # torchrun's 1 for a rank's exit 2
    assert ("vrgd-pretrain: error: " + str(run_dir / "checkpoints" / "step00000002") + ": its model has position embeddings for 32 tokens, this configuration builds 64 "
            "(megatron.model.max_position_embeddings") in out, out[-3000:]
    assert "no complete checkpoint" not in out and "does not load" not in out
    positions = "megatron.model.max_position_embeddings=64"
    _train(tmp_path / "b", corpus, *short, positions)
    rec, out = _launch(tmp_path / "b", corpus, *grown, positions)
    assert "resumed from" in out and [rec[s]["train/seq_len"] for s in (3, 4)] == [64, 64]


@pytest.mark.exhaustive  # two launches
def test_a_gpt_of_another_shape_is_refused_at_the_resume_naming_its_tensors(tmp_path, corpus):
    """A 2-layer run resumed with ``megatron.model.num_layers=3``: the stacked layers' tensors have
    another global shape, which dist-checkpointing does not load. Fails on the old code, where the
    load failed on every checkpoint of the run and the job said there was no complete checkpoint
    to resume from, to move the directory away (exit 2 after a load attempt per checkpoint). Now
    it stops before loading, naming the tensors and the settings to resume with; the checkpoint
    is untouched."""
    sets = ("job.checkpoint_every=2", "job.eval_every=0", "job.data.eval_samples=8")
    _train(tmp_path, corpus, "job.total_steps=2", *sets)
    run_dir = tmp_path / "run"
    saved = run_dir / "checkpoints" / "step00000002"
    before = {f: f.stat().st_mtime_ns for f in saved.rglob("*") if f.is_file()}
    torchrun = Path(sys.executable).parent / "torchrun"
    res = launching.run([torchrun, "--nproc_per_node", "2", "--master_port", str(launching.free_port()), "-m",
                         "vrgd_ds.train", "--config", CONFIG, "--run-dir", run_dir, "--set",
                         f"job.data.path={json.dumps(str(corpus))}", "--set", "job.total_steps=4",
                         "--set", "megatron.model.num_layers=3", *[a for s in sets for a in ("--set", s)]],
                        timeout=420, marker=run_dir)
    out = res.stdout + res.stderr
    assert res.returncode != 0, out[-3000:]  # torchrun's 1 for a rank's exit 2
    assert (f"vrgd-pretrain: error: {saved}: the GPT differs from the one saved: 12 tensors of other shapes "
            "(decoder.layers.mlp.linear_fc1.bias (2, 256) saved, (3, 256) built") in out, out[-3000:]
    assert "Resume with the megatron.model settings it was saved with" in out
    assert "no complete checkpoint" not in out and "does not load" not in out
    assert {f: f.stat().st_mtime_ns for f in saved.rglob("*") if f.is_file()} == before


@pytest.mark.exhaustive  # three launches (make test: the checks, tests/unit/test_engines.py)
def test_a_gpt_tied_across_stages_trains_with_its_gsnr_off_and_resumes_only_tied(tmp_path, corpus):
    """A GPT whose embeddings are tied across 2 pipeline stages, with
    ``megatron.tied_across_stages`` "gsnr_off": the tied weight steps as the base optimizer and the
    other tensors with their GSNR (n = 8 per step: 8 micro-batches on 1 data-parallel rank); a run
    cut back to its step-2 checkpoint and resumed takes steps 3-4 bit for bit as the uninterrupted
    run did; and a resume of it as an untied GPT stops before loading, naming the key (the output
    layer does not carry over). The first checkpoint's size estimate is within 10% of what was
    written; fails on the code before, whose estimate counted the tied replica and left out the
    GSNR key the distributed optimizer's checkpoint holds for the tied weight (3.99 MB against 4.77
    written, with the replica left out alone)."""
    sets = ("job.total_steps=4", "job.checkpoint_every=2", "job.eval_every=0", "job.data.eval_samples=8",
            "megatron.pipeline_model_parallel_size=2", "megatron.model.share_embeddings_and_output_weights=true",
            'megatron.tied_across_stages="gsnr_off"', "megatron.model.hidden_dropout=0.0",
            "megatron.model.attention_dropout=0.0")
    whole, out = _launch(tmp_path / "whole", corpus, *sets)
    assert "GSNR switched off for 1 tensors (module.embedding.word_embeddings.weight)" in out, out[-3000:]
    # the first checkpoint's size estimated before it was written: the last stage's copy of the tied
    # weight is a replica, not written, and the distributed optimizer's checkpoint holds the GSNR keys
    # for the tied weight too (NaN)
    written, expected = _estimate(out)
    assert 0.9 < expected / written < 1.1, (written, expected)
    taken = _taken(whole)
    assert len(taken) == 4 and all(r["gsnr/n"] == 8.0 and 0.0 < r["gsnr/scale_mean"] < 1.0 for r in taken)
    _cut_back(tmp_path, 4, 2, "untied")
    resumed = _train(tmp_path / "cut", corpus, *sets)
    assert [resumed[s]["train/loss"] for s in (3, 4)] == [whole[s]["train/loss"] for s in (3, 4)]
    run_dir = tmp_path / "untied" / "run"
    untied = [s for s in sets if "share_embeddings" not in s]
    res = launching.run([Path(sys.executable).parent / "torchrun", "--nproc_per_node", "2", "--master_port",
                         str(launching.free_port()), "-m", "vrgd_ds.train", "--config", CONFIG, "--run-dir", run_dir,
                         "--set", f"job.data.path={json.dumps(str(corpus))}", *[a for s in untied for a in ("--set", s)]],
                        timeout=420, marker=run_dir)
    out = res.stdout + res.stderr
    assert res.returncode != 0, out[-3000:]  # torchrun's 1 for a rank's exit 2
    assert (str(run_dir / "checkpoints" / "step00000002") + ": its GPT was saved with megatron.model."
            "share_embeddings_and_output_weights true, this configuration builds false") in out, out[-3000:]


@pytest.mark.exhaustive  # three launches (make test: the checks, tests/unit/test_engines.py)
def test_a_gpt_in_model_chunks_trains_interleaved_and_resumes_on_other_chunks(tmp_path, corpus):
    """4 layers over 2 pipeline stages of 2 model chunks each (``megatron.virtual_pipeline_model_
    parallel_size`` 2, Megatron's interleaved schedule): it trains with n = 8 (8 micro-batches on 1
    data-parallel rank) and the GSNR damping; 30 held-out windows at micro-batch 4 are all evaluated
    (each pass padded to a multiple of the 2 stages with repeats that are not counted: the 7 full
    micro-batches to 8, the last 2 windows to 2 micro-batches); a run cut back
    to its step-2 checkpoint and resumed takes steps 3-4 bit for bit as the uninterrupted run did;
    and the same checkpoint resumed with one chunk a stage (dist-checkpointing reshards the layers)
    takes them to within rounding of the chunked run."""
    base = ("job.total_steps=4", "job.checkpoint_every=2", "job.eval_every=2", "job.data.eval_samples=30",
            "megatron.pipeline_model_parallel_size=2", "megatron.model.num_layers=4",
            "megatron.model.hidden_dropout=0.0", "megatron.model.attention_dropout=0.0")
    sets = (*base, "megatron.virtual_pipeline_model_parallel_size=2")
    whole, out = _launch(tmp_path / "whole", corpus, *sets)
    written, expected = _estimate(out)
    assert 0.9 < expected / written < 1.1, (written, expected)  # every chunk's tensors and state
    taken = _taken(whole)
    assert len(taken) == 4 and all(r["gsnr/n"] == 8.0 and 0.0 < r["gsnr/scale_mean"] < 1.0 for r in taken)
    assert [whole[s]["eval/tokens"] for s in (0, 2, 4)] == [30 * 64] * 3
    assert whole[4]["eval/lm_loss"] < whole[0]["eval/lm_loss"]
    _cut_back(tmp_path, 4, 2, "one")
    resumed = _train(tmp_path / "cut", corpus, *sets)
    assert [resumed[s]["train/loss"] for s in (3, 4)] == [whole[s]["train/loss"] for s in (3, 4)]
    assert resumed[4]["eval/lm_loss"] == whole[4]["eval/lm_loss"]
    one, out = _launch(tmp_path / "one", corpus, *base)
    assert "was saved with 2 model chunk(s) a pipeline stage; resuming with 1" in out, out[-3000:]
    for s in (3, 4):
        assert one[s]["train/loss"] == pytest.approx(whole[s]["train/loss"], rel=1e-6), s


@pytest.mark.exhaustive
@pytest.mark.parametrize("precision, steps", [("bf16", 4), ("fp16", 20)])
def test_a_tied_gpt_in_model_chunks_trains_in_half_precision(tmp_path, corpus, precision, steps):
    """Model chunks with an embedding tied across the stages (the word embedding on the first
    stage's first chunk, the output layer's copy on the last stage's last chunk), each chunk in
    ``Float16Module``: the tied weight steps with its GSNR off, the rest with it, n = 8, and the
    held-out loss falls; bf16 takes every step, fp16 skips its first (Megatron's loss scale from
    2^32, lowered on each overflow) and then steps."""
    rec, out = _launch(tmp_path, corpus, f"job.total_steps={steps}", f"job.eval_every={steps}",
                       "job.data.eval_samples=8", "megatron.pipeline_model_parallel_size=2",
                       "megatron.model.num_layers=4", "megatron.virtual_pipeline_model_parallel_size=2",
                       f'megatron.precision="{precision}"', "megatron.model.share_embeddings_and_output_weights=true",
                       'megatron.tied_across_stages="gsnr_off"')
    assert "GSNR switched off for 1 tensors (module.module.embedding.word_embeddings.weight)" in out, out[-3000:]
    ran = [r for s, r in sorted(rec.items()) if s > 0]
    taken, skipped = _taken(rec), [r for r in ran if r["step/skipped"] == 1.0]
    assert taken and all(r["gsnr/n"] == 8.0 and 0.0 < r["gsnr/scale_mean"] < 1.0 for r in taken)
    assert (len(taken) == steps) if precision == "bf16" else (skipped and ran.index(taken[0]) == len(skipped))
    assert rec[steps]["eval/lm_loss"] < rec[0]["eval/lm_loss"]


@pytest.mark.exhaustive
def test_a_gpt_in_model_chunks_trains_with_tensor_parallelism_over_two_phases(tmp_path, corpus):
    """TP 2 × PP 2 with 2 model chunks a stage on 4 ranks, a phase of seq 32 then one of seq 64 (the
    interleaved schedule's tensors reshaped at the switch): n = 8 (8 micro-batches on 1
    data-parallel rank) and the GSNR damping in both, and the held-out loss falls."""
    phases = json.dumps([{"seq_len": 32, "fraction": 0.5, "global_batch": 32, "micro_batch": 4, "lr": 4e-3},
                         {"seq_len": 64, "fraction": 0.5, "global_batch": 32, "micro_batch": 4, "lr": 2e-3}])
    rec, _ = _launch(tmp_path, corpus, "job.total_steps=4", "job.eval_every=4", "job.data.eval_samples=8",
                     f"job.phases={phases}", "megatron.tensor_model_parallel_size=2",
                     "megatron.pipeline_model_parallel_size=2", "megatron.model.num_layers=4",
                     "megatron.virtual_pipeline_model_parallel_size=2", ranks=4)
    taken = _taken(rec)
    assert [r["train/seq_len"] for r in taken] == [32, 32, 64, 64]
    assert all(r["gsnr/n"] == 8.0 and 0.0 < r["gsnr/scale_mean"] < 1.0 for r in taken)
    assert rec[4]["eval/lm_loss"] < rec[0]["eval/lm_loss"]


@pytest.mark.exhaustive
@pytest.mark.parametrize("precision, distributed, saved, resumed", [
    ("fp32", "true", 1, 2), ("bf16", "false", 1, 2), ("bf16", "false", 2, 1), ("fp16", "true", 1, 2),
    ("fp16", "false", 2, 1)])
def test_a_gpt_resumes_on_other_model_chunks(tmp_path, corpus, precision, distributed, saved, resumed):
    """A run with ``saved`` model chunks a stage (PP 2), cut back to a checkpoint and resumed with
    ``resumed`` chunks a stage (the layers resharded, the optimizer state with them, with and without
    the distributed optimizer): the next steps take the uninterrupted run's losses, and fp16 its
    loss scale (fp16: 18 steps cut back to step 16, the first 13 skipped while the loss scale comes
    down, so that the checkpoint holds stepped optimizer state; else 4 steps cut back to step 2)."""
    last, cut = (18, 16) if precision == "fp16" else (4, 2)
    base = (f"job.total_steps={last}", f"job.checkpoint_every={cut}", "job.eval_every=0", "job.data.eval_samples=8",
            "megatron.pipeline_model_parallel_size=2", "megatron.model.num_layers=4",
            "megatron.model.hidden_dropout=0.0", "megatron.model.attention_dropout=0.0",
            f'megatron.precision="{precision}"', f"megatron.use_distributed_optimizer={distributed}")
    chunks = {n: (f"megatron.virtual_pipeline_model_parallel_size={n}",) if n > 1 else () for n in (saved, resumed)}
    whole, _ = _launch(tmp_path / "whole", corpus, *base, *chunks[saved])
    _cut_back(tmp_path, last, cut)
    other, out = _launch(tmp_path / "cut", corpus, *base, *chunks[resumed])
    assert f"was saved with {saved} model chunk(s) a pipeline stage; resuming with {resumed}" in out, out[-3000:]
    after = range(cut + 1, last + 1)
    assert all(whole[s]["step/skipped"] == 0.0 for s in (cut, *after)), [whole[s]["step/skipped"] for s in whole if s]
    for s in after:
        assert other[s]["train/loss"] == pytest.approx(whole[s]["train/loss"], rel=1e-6), s
        assert other[s]["train/loss_scale"] == whole[s]["train/loss_scale"], s
