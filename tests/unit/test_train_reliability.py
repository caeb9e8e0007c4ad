"""The job's failure handling that needs no process group: configuration checked before any
work, checkpoint completeness and the choice of the checkpoint to resume from, rotation, free
space, and the watchdog's report. Launch-level behaviour (kill, stall, divergence, requeue)
is in tests/integration/test_reliability.py."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vrgd_ds import REGISTRY
from vrgd_ds.train import checkpoints as ckpt
from vrgd_ds.train import loop
from vrgd_ds.train.watchdog import Watchdog, collective_timeout, poll_interval

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TEST_CONFIG = CONFIGS / "bert_tiny_cpu_test.json"


def run_main(capsys, *args: str, config: Path = TEST_CONFIG, run_dir: Path | None = None) -> tuple[int, str]:
    rc = loop.main(["--config", str(config), "--run-dir", str(run_dir or "/nonexistent/run"), *args])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("override, message", [
    ("optimizer.params.gama=0.1", "optimizer.params.gama: not a parameter of VRLamb (type 'VRLamb'); did you mean "
                                  "'gamma'?; accepted: lr, "),
    ("optimizer.params.gamma=0", "optimizer.params.gamma: VRLamb: invalid gamma=0: must be in (0, 1]"),
    ("optimizer.params.beta3=1", "optimizer.params.beta3: VRLamb: invalid beta3=1: must be in [0, 1)"),
    ("optimizer.params.gsnr_placement=\"last\"", "optimizer.params.gsnr_placement: VRLamb: invalid "
                                                 "gsnr_placement='last'"),
    ('optimizer.type="VRLam"', "optimizer.type: 'VRLam' is not a VRGD optimizer; did you mean 'VRLamb'?; registered: "
                               + ", ".join(REGISTRY)),
    ('zero_optimization.offload_optimizer={"device": "cpu"}', "zero_optimization.offload_optimizer: CPU/NVMe offload "
                                                              "is not supported"),
    ('vrgd={"squares_dtype": "fp8"}', "vrgd.squares_dtype: Input should be 'fp32' or 'bf16'"),
    ('vrgd={"squares": "per_batch"}', "vrgd.squares: Input should be 'per_step', 'per_micro_step', 'hierarchical' or 'auto'"),
    ('vrgd={"gbar": "mean"}', "vrgd.gbar: Input should be 'auto', 'engine' or 'local'"),
    # before: coerced to 1 and 2 (fails on the old code)
    ('vrgd={"squares": "hierarchical", "node_size": true}', "vrgd.node_size: Input should be a valid integer"),
    ('vrgd={"squares": "hierarchical", "node_size": "2"}', "vrgd.node_size: Input should be a valid integer"),
    ("job.phases.5.lr=1", "--set job.phases.5.lr: 'job.phases' has 2 entries (0..1); there is no job.phases.5"),
    ("job.phases.x.lr=1", "--set job.phases.x.lr: 'job.phases' is a list; 'x' is not an index (0..1)"),
    ("job.total_steps.foo=1", "--set job.total_steps.foo: 'job.total_steps' is a value (4), not an object"),
    # before: "no key 'checkpoint' in the config", without the way to add it
    ("checkpoint.optimizer_state=reset_if_incompatible", "--set checkpoint.optimizer_state: no key 'checkpoint' in the "
     "config; add the block whole: --set 'checkpoint={\"optimizer_state\": \"reset_if_incompatible\"}'"),
    # before: added beside the real key and ignored by DeepSpeed (clipping silently stayed as configured)
    ("gradient_cliping=0.5", "--set gradient_cliping: no key 'gradient_cliping' in the config; did you mean "
                             "'gradient_clipping'?"),
    ("zero_optimization.stge=3", "did you mean 'zero_optimization.stage'?"),
    ('job.data.path="/does/not/exist"', "job.data.path: /does/not/exist does not exist. Prepare it first"),
    # before: a TypeError from WandbSink after set-up and resume (exit 1), or accepted
    ('job.telemetry.wandb={"project": "p", "mod": "offline"}', "job.telemetry.wandb.mod: Extra inputs are not permitted"),
    ('job.telemetry.wandb={"mode": "offline"}', "job.telemetry.wandb.project: Field required"),
    # before: accepted, and the model built with another vocabulary than the tokenizer's, or
    # fewer positions than the sequence (an IndexError at the first forward)
    ('job.model.overrides={"vocab_size": 100}', "job.model.overrides.vocab_size: set by the job from the tokenizer's"),
    ('job.model.overrides={"max_position_embeddings": 16}',
     "job.model.overrides.max_position_embeddings: 16 is fewer positions than the longest phase's seq_len"),
    # before (each fails on the old code): a negative seed passed, and rank 0 stopped in the data
    # preparation after the process group and the lock, rank 1 with a gloo traceback; 512.0 was
    # "fewer positions than" 64; a misspelt checkpoint key was ignored by the job and DeepSpeed alike,
    # its policy silently the default
    ("job.seed=-1", "job.seed: Input should be greater than or equal to 0"),
    ('job.model.overrides={"max_position_embeddings": 512.0}',
     "job.model.overrides.max_position_embeddings: 512.0 is not an integer"),
    # before: "Extra inputs are not permitted" alone (fails on the old code)
    ("job.keep_checkpoint=2", "job.keep_checkpoint: Extra inputs are not permitted; did you mean 'keep_checkpoints'?"),
    ("job.phases.0.lrr=0.1", "job.phases.0.lrr: Extra inputs are not permitted; did you mean 'lr'?"),
    # before: coerced, "4" to 4 and true to 1 (keep_checkpoints); a value of the wrong type is an error
    ('job.total_steps="4"', "job.total_steps: Input should be a valid integer"),
    ("job.keep_checkpoints=true", "job.keep_checkpoints: Input should be a valid integer"),
    ('checkpoint={"data_chnage": "continue"}', "checkpoint.data_chnage: the checkpoint block has the job's keys "
                                               "optimizer_state, data_change and DeepSpeed's tag_validation, "),
    # before (each fails on the old code): a misspelt block was to be added whole under its misspelt
    # name; a number for a text key read only "Input should be a valid string"; an infinite
    # timeout passed and ended every rank with an OverflowError traceback (exit 1) building the watchdog
    ("zero_optimisation.stage=3", "--set zero_optimisation.stage: no key 'zero_optimisation' in the config; did you "
                                  "mean 'zero_optimization.stage'?"),
    ("job.data.path=2024", "job.data.path: Input should be a valid string (a number or a boolean here; write the "
                           "text as a JSON string: \"2024\", with --set: 'job.data.path=\"2024\"')"),
    ("job.timeout_minutes=Infinity", "job.timeout_minutes: Input should be a finite number"),
    ("job.startup_timeout_minutes=1e12", "job.startup_timeout_minutes: Input should be less than or equal to 1000000"),
    # before (fails on the old code): an infinite LR or decay power passed its bound (> 0) and the
    # run trained at an LR of inf, or of 0 after the warmup
    ("job.phases.0.lr=Infinity", "job.phases.0.lr: Input should be a finite number"),
    ("job.phases.0.decay_power=Infinity", "job.phases.0.decay_power: Input should be a finite number"),
    # before: accepted, and the phase warmed up to its last step and ended at its peak LR, never decaying
    ("job.phases.0.warmup_fraction=0.6", "job.phases[0].warmup_fraction: 0.6 of the phase's 2 steps rounds up to 2 "
                                         "warmup steps, leaving none to decay; use a warmup_fraction of at most 0.5"),
    # before (each fails on the old code): refused by transformers only when the model was built,
    # after the data preparation, with its traceback on every rank (exit 1)
    ('job.model.overrides={"hidden_act": "gleu"}', "job.model: the tiny BERT with job.model.overrides (hidden_act) is "
                                                   "refused by transformers: KeyError: 'gleu'"),
    ('job.model.overrides={"num_attention_heads": 3}', "refused by transformers: ValueError: The hidden size (128) is "
                                                       "not a multiple of the number of attention heads (3)"),
    # before: DeepSpeed read clipping at -1 as none
    ("gradient_clipping=-1", "gradient_clipping: -1: must be a finite number >= 0"),
])
def test_bad_configuration_fails_before_any_work_with_one_line(capsys, override, message):
    """Each of these used to surface late (at deepspeed.initialize, after data preparation and
    the model build, as a long traceback on every rank), as a raw IndexError/ValueError/
    TypeError (--set paths), or not at all (a data path that does not exist trained on the
    embedded corpus and exited 0). Now: exit 2 before any process group, one line naming the
    key."""
    rc, err = run_main(capsys, "--set", override)
    assert rc == loop.EXIT_CONFIG
    assert message in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_fp16_where_deepspeeds_accelerator_has_none_fails_before_any_work(capsys, monkeypatch):
    """The BERT-large configs' ``fp16`` on a machine whose DeepSpeed accelerator has no fp16 (a CPU
    without native fp16 kernels): exit 2 naming the key and the way out, before the data is
    prepared. Before, the data was prepared, then ``deepspeed.initialize`` raised "Type fp16 is
    not supported on your device" as a traceback (exit 1). Fails on the old code."""
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(get_accelerator(), "is_fp16_supported", lambda: False)
    rc, err = run_main(capsys, "--set", 'fp16={"enabled": true}')
    assert rc == loop.EXIT_CONFIG
    assert "fp16.enabled: DeepSpeed's " in err and "--set fp16.enabled=false for fp32, or use bf16" in err, err
    assert len(err.strip().splitlines()) == 1


def test_a_data_path_without_prepared_data_is_an_error_unless_asked_to_prepare(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    rc, err = run_main(capsys, "--set", f'job.data.path="{tmp_path / "empty"}"')
    assert rc == loop.EXIT_CONFIG and f"{tmp_path / 'empty'} holds no prepared data (no tokenizer.model" in err
    from vrgd_ds.train.config import load_config
    from vrgd_ds.train.data import check_data_path

    for extra in ("job.data.prepare=true", 'job.data.inputs=["corpus.txt"]'):
        _, job = load_config(TEST_CONFIG, [f'job.data.path="{tmp_path / "empty"}"', extra])
        check_data_path(job)  # asked to prepare there: no error


def test_a_job_asked_to_prepare_finishes_a_preparation_left_half_done(tmp_path, monkeypatch):
    """``job.data.prepare: true`` on a directory a killed preparation left with a tokenizer and no
    shards prepares it (``prepare`` is idempotent: it reuses what matches). Fails on the code that
    took any directory with a tokenizer for one prepared beforehand: the restarted job stopped at
    "shard directory ... does not exist"."""
    from vrgd_ds.data_pipeline import prepare as prepare_module
    from vrgd_ds.train.config import load_config
    from vrgd_ds.train.data import prepare_data

    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "tokenizer.model").write_bytes(b"a tokenizer without shards")
    _, job = load_config(TEST_CONFIG, [f'job.data.path="{tmp_path / "half"}"', "job.data.prepare=true"])
    calls = []

    def prepare(out, **kwargs):
        calls.append(out)
        raise RuntimeError("prepared")

    monkeypatch.setattr(prepare_module, "prepare", prepare)
    with pytest.raises(RuntimeError, match="prepared"):
        prepare_data(job, tmp_path / "run", 0, lambda: None, [64])
    assert calls == [tmp_path / "half"]


def test_a_prepared_data_directory_is_not_rebuilt_by_a_job_that_lists_other_inputs_or_options(tmp_path):
    """A directory prepared by ``vrgd-data prepare`` (other jobs may read it), given to a job
    with ``inputs`` and another ``vocab_size``: the job stops before anything is rebuilt, naming
    what differs and the keys; the same inputs and options reuse it. Fails on the old code, which
    trained the tokenizer again (the job's default 8000 pieces) and rewrote the shards in place."""
    from pydoc_data.topics import topics

    from vrgd_ds.data_pipeline.prepare import prepare
    from vrgd_ds.train import data
    from vrgd_ds.train.config import ConfigError, load_config

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(" ".join(topics[k].split()) for k in sorted(topics)[:40]) + "\n")
    prepared = tmp_path / "prepared"
    sets = [f'job.data.path="{prepared}"', f'job.data.inputs=["{corpus}"]', "job.data.prepare=true"]
    _, job = load_config(TEST_CONFIG, sets + ["job.data.vocab_size=400"])
    prepare(prepared, corpus, vocab_size=400, seq_lens=(64,), seed=job.seed, workers=1, progress=False)
    tokenizer = (prepared / "tokenizer.model").read_bytes()
    _, other = load_config(TEST_CONFIG, sets + ["job.data.vocab_size=500"])
    with pytest.raises(ConfigError, match=r"job.data.inputs: .* holds a tokenizer built from other vocab_size \(400 "
                                          r"there, 500 now\).*Drop job.data.inputs to train on"):
        data.prepare_data(other, tmp_path / "run", 0, lambda: None, [64])
    assert (prepared / "tokenizer.model").read_bytes() == tokenizer
    reused = data.prepare_data(job, tmp_path / "run", 0, lambda: None, [64])  # the same inputs and options
    assert reused.tokenizer.vocab_size == 400 and (prepared / "tokenizer.model").read_bytes() == tokenizer


def test_ranks_other_than_0_look_the_prepared_files_up_only_after_the_barrier(tmp_path, monkeypatch):
    """Rank 0 prepares the data into the run directory while the others wait at the barrier: a
    rank other than 0 must not look up the tokenizer or the shards' manifest before it (on a
    network filesystem a lookup of a file not yet written can be cached as missing, and the rank
    then fails to open what rank 0 wrote). Fails on the old code, where every rank looked both up
    before the barrier (whether the directory was prepared, which only rank 0 uses)."""
    import pathlib

    from vrgd_ds.train import data
    from vrgd_ds.train.config import load_config

    _, job = load_config(TEST_CONFIG, [])
    run_dir = tmp_path / "run"
    data.prepare_data(job, run_dir, 0, lambda: None, [64])  # rank 0's part (what the others wait for)
    early, passed = [], []
    is_file = pathlib.Path.is_file

    def looked_up(path: pathlib.Path) -> bool:
        if not passed and path.name in ("tokenizer.model", "manifest.json"):
            early.append(path.name)
        return is_file(path)

    monkeypatch.setattr(pathlib.Path, "is_file", looked_up)
    opened = data.prepare_data(job, run_dir, 1, lambda: passed.append(True), [64])
    assert passed and early == [] and opened.tokenizer.vocab_size > 0


@pytest.mark.parametrize("record", ["missing", "unreadable", "without the shards"])
def test_a_prepared_data_directory_without_its_record_is_not_rebuilt_by_a_job_with_inputs(tmp_path, record):
    """A tokenizer and shards with no record of how they were built (``vrgd-data tokenizer`` and
    ``vrgd-data shard`` write none; a lost or damaged ``prepare.json``; a record of the tokenizer
    only), given to a job with ``inputs``: the job stops before anything is rebuilt, naming the
    record and the keys, and the files are as they were. Fails on the old code, whose refusal
    needed a record: it trained the tokenizer again and rewrote the shards other jobs may read."""
    import json

    from pydoc_data.topics import topics

    from vrgd_ds.data_pipeline.prepare import prepare
    from vrgd_ds.train import data
    from vrgd_ds.train.config import ConfigError, load_config

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(" ".join(topics[k].split()) for k in sorted(topics)[:40]) + "\n")
    prepared = tmp_path / "prepared"
    sets = [f'job.data.path="{prepared}"', f'job.data.inputs=["{corpus}"]', "job.data.prepare=true",
            "job.data.vocab_size=400"]
    _, job = load_config(TEST_CONFIG, sets)
    prepare(prepared, corpus, vocab_size=400, seq_lens=(64,), seed=job.seed, workers=1, progress=False)
    path = prepared / "prepare.json"
    if record == "missing":
        path.unlink()
    elif record == "unreadable":
        path.write_text("{not json")
    else:
        path.write_text(json.dumps({"tokenizer": json.loads(path.read_text())["tokenizer"]}))
    before = {f: f.read_bytes() for f in [prepared / "tokenizer.model", *sorted((prepared / "shards").iterdir())]}
    built = "manifest.json" if record == "without the shards" else "tokenizer.model"
    with pytest.raises(ConfigError, match=rf"job.data.inputs: .* inputs or options it has no record of \(prepare.json "
                                          rf"missing or unreadable.*its {built} built by another command.*Drop "
                                          r"job.data.inputs to train on"):
        data.prepare_data(job, tmp_path / "run", 0, lambda: None, [64])
    assert {f: f.read_bytes() for f in before} == before
    assert sorted((prepared / "shards").iterdir()) == sorted(p for p in before if p.parent.name == "shards")


@pytest.mark.parametrize("given, warned", [("job.data.vocab_size=2000", True), ("job.data.vocab_size=400", False),
                                           (None, False)])
def test_a_vocabulary_the_prepared_data_does_not_have_is_named(tmp_path, monkeypatch, caplog, given, warned):
    """``job.data.vocab_size`` sizes a tokenizer the job trains; a directory prepared beforehand
    keeps its own. A config that names another size than the prepared tokenizer's gets a warning
    naming both (the key's default, not named, gets none). Fails on the old code, which said
    nothing: a run meant for 2,000 pieces trained on 400."""
    import logging

    from vrgd_ds.data_pipeline import samples
    from vrgd_ds.train import data
    from vrgd_ds.train.config import load_config

    prepared = tmp_path / "prepared"
    (prepared / "shards").mkdir(parents=True)
    (prepared / "tokenizer.model").write_bytes(b"a tokenizer")
    (prepared / "shards" / "manifest.json").write_text("{}")

    class Corpus:  # the prepared directory's shards, as ShardedCorpus reads them
        vocab_size = 400

        def __init__(self, path, verify):
            pass

        def check_token_ids(self):
            pass

    def load(path):
        raise RuntimeError("tokenizer loaded")

    monkeypatch.setattr(data, "ShardedCorpus", Corpus)
    monkeypatch.setattr(samples, "build_sample_index", lambda *args, **kwargs: None)
    monkeypatch.setattr(data.Tokenizer, "load", staticmethod(load))
    raw = json.loads(TEST_CONFIG.read_text())
    del raw["job"]["data"]["vocab_size"]
    config = tmp_path / "job.json"
    config.write_text(json.dumps(raw))
    _, job = load_config(config, [f'job.data.path="{prepared}"'] + ([given] if given else []))
    with caplog.at_level(logging.WARNING, logger="vrgd_ds.train.data"), pytest.raises(RuntimeError, match="loaded"):
        data.prepare_data(job, tmp_path / "run", 0, lambda: None, [64])
    warnings = [r.getMessage() for r in caplog.records if "vocab_size" in r.getMessage()]
    assert warnings == ([f"job.data.vocab_size: 2000 is not used: {prepared} was prepared with a tokenizer of 400 "
                         "pieces, which the job uses (the key sizes a tokenizer the job trains)"] if warned else [])


def test_data_that_cannot_be_prepared_ends_the_job_with_one_line(capsys, monkeypatch):
    """The shipped BERT-large configs on the embedded corpus (``data.path`` null) ask for 30,522
    pieces, more than its text holds (about 10.9k): preparing the data raises a DataError on rank 0
    after the process group is up. It ends the job with exit 2 and one line naming the cause, as a
    bad config does. Fails on the code before: the DataError escaped ``main`` as a traceback
    (exit 1)."""
    from vrgd_ds.data_pipeline.errors import DataError

    class Failing:
        rank = 0

        def __init__(self, *args):
            pass

        def setup(self):
            raise DataError("the corpus (18771 sentences) is too small for vocab_size=30522 (...); lower "
                            "--vocab-size or add text")

        def release(self):
            pass

    monkeypatch.setattr(loop, "Job", Failing)
    rc, err = run_main(capsys)
    assert rc == loop.EXIT_CONFIG
    assert "too small for vocab_size=30522" in err and len(err.strip().splitlines()) == 1, err


def test_only_the_first_rank_prints_the_error(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    rc, err = run_main(capsys, "--set", "optimizer.params.gama=0.1")
    assert rc == loop.EXIT_CONFIG and err == ""


# ---- checkpoint directory ----------------------------------------------------------------


def fake_checkpoint(root: Path, step: int, complete: bool = True, files: dict[str, int] | None = None) -> str:
    tag = ckpt.tag_of(step)
    d = root / tag
    d.mkdir(parents=True)
    for name, size in (files or {"mp_rank_00_model_states.pt": 100, "zero_pp_rank_0_optim_states.pt": 300,
                                 "zero_pp_rank_1_optim_states.pt": 300}).items():
        (d / name).write_bytes(b"x" * size)
    if complete:
        ckpt.mark_complete(root, tag, step)
    return tag


def test_marker_and_latest_are_written_after_the_files(tmp_path):
    tag = fake_checkpoint(tmp_path, 4)
    marker = json.loads((tmp_path / tag / ckpt.MARKER).read_text())
    assert marker["step"] == 4 and marker["files"]["zero_pp_rank_1_optim_states.pt"] == 300
    assert (tmp_path / "latest").read_text() == tag
    assert ckpt.problem(tmp_path, tag) is None


def test_a_truncated_newest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    """DeepSpeed writes ``latest`` from rank 0 before the other ranks finish, and torch.save
    writes in place: a truncated rank file in the tag ``latest`` names used to fail the restart
    ("checkpoint file is corrupted", no file named) although an intact checkpoint sat beside it."""
    fake_checkpoint(tmp_path, 2)
    newest = fake_checkpoint(tmp_path, 4)
    bad = tmp_path / newest / "zero_pp_rank_1_optim_states.pt"
    bad.write_bytes(b"x" * 120)
    choice = ckpt.choose(tmp_path)
    assert choice.tag == ckpt.tag_of(2)
    assert choice.skipped == [f"{bad}: 120 bytes, 300 when it was written (truncated or overwritten)"]


def test_a_checkpoint_without_marker_is_incomplete(tmp_path):
    fake_checkpoint(tmp_path, 2)
    fake_checkpoint(tmp_path, 4, complete=False)  # killed before every rank finished
    choice = ckpt.choose(tmp_path)
    assert choice.tag == ckpt.tag_of(2) and "no vrgd_complete.json" in choice.skipped[0]
    assert ckpt.choose(tmp_path, exclude=(ckpt.tag_of(2),)).tag is None


def test_rotation_keeps_the_newest_and_the_protected_and_never_an_incomplete_one(tmp_path):
    for s in (2, 4, 6, 8):
        fake_checkpoint(tmp_path, s)
    fake_checkpoint(tmp_path, 10, complete=False)
    assert ckpt.rotate(tmp_path, keep=2, protect=ckpt.tag_of(2)) == [ckpt.tag_of(4)]
    assert ckpt.tags(tmp_path) == [ckpt.tag_of(s) for s in (2, 6, 8, 10)]


def test_rotation_deletes_an_incomplete_checkpoint_once_the_kept_ones_are_newer(tmp_path):
    """Saves cut short at steps 3 and 7 (pre-emptions killed mid-save), complete ones at 2, 4, 6
    and 8, 2 kept: step 3's is older than both kept ones and goes with the rotation; step 7's,
    between them, stays for inspection. Fails on the code before, which kept every incomplete
    checkpoint for good (each up to a checkpoint's size, until the disk filled)."""
    for s in (2, 4, 6, 8):
        fake_checkpoint(tmp_path, s)
    for s in (3, 7):
        fake_checkpoint(tmp_path, s, complete=False)
    assert ckpt.rotate(tmp_path, keep=2, newest=ckpt.tag_of(8)) == [ckpt.tag_of(s) for s in (2, 4, 3)]
    assert ckpt.tags(tmp_path) == [ckpt.tag_of(s) for s in (6, 7, 8)]


def test_rotation_never_deletes_the_checkpoint_just_written_for_one_passed_over(tmp_path):
    """A later checkpoint that passed the size check but did not load (the resume passed it over)
    stays on disk; the job goes on from an earlier one and writes step 6. Rotation counts only
    checkpoints up to the one just written. Fails on the code before: with keep_checkpoints 1
    it counted step 8 as the newest and deleted step 6, the one just written."""
    for s in (4, 6, 8):
        fake_checkpoint(tmp_path, s)
    assert ckpt.rotate(tmp_path, keep=1, newest=ckpt.tag_of(6)) == [ckpt.tag_of(4)]
    assert ckpt.tags(tmp_path) == [ckpt.tag_of(6), ckpt.tag_of(8)]


def test_a_checkpoint_the_resume_passed_over_is_not_counted_once_the_run_is_past_it(tmp_path):
    """The resume passed over step 200 (complete by its marker, but it did not load) and went on
    from step 100 with another ``checkpoint_every`` (75): at step 250, keeping 2, the kept pair
    is 175 and 250, and 200 stays for inspection until both are newer. Fails on the code before,
    which counted 200 once the run was past it: it deleted 100 and 175, leaving 250 as the one
    checkpoint that loads."""
    for s in (100, 175, 200, 250):
        fake_checkpoint(tmp_path, s)
    passed = (ckpt.tag_of(200),)
    assert ckpt.rotate(tmp_path, keep=2, newest=ckpt.tag_of(250), passed_over=passed) == [ckpt.tag_of(100)]
    assert ckpt.tags(tmp_path) == [ckpt.tag_of(s) for s in (175, 200, 250)]
    fake_checkpoint(tmp_path, 325)
    assert ckpt.rotate(tmp_path, keep=2, newest=ckpt.tag_of(325), passed_over=passed) == [ckpt.tag_of(s)
                                                                                            for s in (175, 200)]
    assert ckpt.tags(tmp_path) == [ckpt.tag_of(250), ckpt.tag_of(325)]


def saving_job(run_dir: Path, step: int, write, monkeypatch) -> loop.Job:
    """Rank 0 of 2 of a job at ``step`` whose engine's save is ``write`` (``Job.save`` alone: no
    run-directory owner record, no collectives)."""
    from types import SimpleNamespace

    job = object.__new__(loop.Job)
    job.run_dir, job.rank, job.world, job.step, job.consumed, job.evals = run_dir, 0, 2, step, [64], []
    job.skip_streak_from, job.controllers, job.job = None, {}, SimpleNamespace(keep_checkpoints=3)
    job.skipped_before, job.optimizer = 0, SimpleNamespace(skipped_steps=0)
    job.lock, job.first_on_node = None, True
    job.engine = SimpleNamespace(save=write)
    job._checkpoint_bytes = lambda: (10, 10, "test")
    job._any_rank, job._max_over_ranks = (lambda flag: flag), (lambda value: value)
    job.optimizer_info = job.resume_info = lambda: {}
    job.watchdog = SimpleNamespace(beat=lambda step, what: None)
    monkeypatch.setattr(loop, "dist", SimpleNamespace(barrier=lambda: None))
    return job


def test_the_checkpoint_size_is_read_by_rank_0_alone_and_summed_on_every_rank(tmp_path, monkeypatch):
    """Before a save, rank 0 reads the last complete checkpoint's size and then clears and rotates
    checkpoints; another rank walking them meanwhile met files deleted under it
    (``FileNotFoundError``, the others then waiting in a collective). Now only rank 0 walks them,
    and the estimate's sum over the ranks runs on every rank whatever each sees on disk (a stale
    view of a shared file system would otherwise leave one rank in a collective alone). Fails on
    the code before: rank 1 walked the checkpoints, and rank 0 skipped the sum where it found one."""
    from types import SimpleNamespace

    fake_checkpoint(tmp_path / loop.CHECKPOINTS, 4)
    summed = []
    job = object.__new__(loop.Job)
    job.run_dir, job.engine = tmp_path, SimpleNamespace(checkpoint_bytes=lambda: 1000)
    job._sum_over_ranks = lambda values: summed.append(values) or [v * 2 for v in values]
    job.rank = 1

    def walked(*args):
        raise AssertionError("rank 1 walked the checkpoints")

    with monkeypatch.context() as m:
        m.setattr(ckpt, "tags", walked)
        assert job._checkpoint_bytes() == (2000, 2200 + (1 << 20), "the engine's estimate")
    job.rank = 0
    size = ckpt.size_of(job.ckpt_dir, ckpt.tag_of(4))
    assert job._checkpoint_bytes() == (size, int(size * 1.05) + (1 << 20), f"the size of {ckpt.tag_of(4)}")
    assert summed == [[1000.0], [1000.0]]


def test_ranks_that_see_other_checkpoints_stop_together_before_any_loads(tmp_path, monkeypatch):
    """Rank 1's view of a shared file system is stale: it sees no checkpoint where rank 0 sees
    step 4 (then, with one in view, another newest one). Each rank stops at resume naming what
    each saw, before anything loads. Fails on the code before: each rank chose on its own view,
    so rank 0 resumed while rank 1 started afresh, and they met in different collectives."""
    from types import SimpleNamespace

    from vrgd_ds.train.config import ConfigError

    fake_checkpoint(tmp_path / loop.CHECKPOINTS, 4)
    job = object.__new__(loop.Job)
    job.run_dir, job.rank, job.world = tmp_path, 0, 2
    job.optimizer = SimpleNamespace(param_groups=[])
    for rank1 in ([], [ckpt.tag_of(4), ckpt.tag_of(6)]):
        def gather(out, mine, rank1=rank1):
            out[:] = [mine, rank1 if isinstance(mine, list) else ckpt.tag_of(6)]

        monkeypatch.setattr(loop, "dist", SimpleNamespace(all_gather_object=gather))
        with pytest.raises(ConfigError, match=r"the ranks disagree on the checkpoints \(rank 0: \['step00000004'\]; "
                                              r"rank 1: \[.*\]\).*view differs between nodes"):
            job.resume()
    monkeypatch.setattr(loop, "dist", SimpleNamespace(all_gather_object=lambda out, mine: out.__setitem__(
        slice(None), [mine, mine if isinstance(mine, list) else ckpt.tag_of(6)])))
    with pytest.raises(ConfigError, match=r"disagree on the checkpoint to resume from \(rank 0: 'step00000004'; "
                                          r"rank 1: 'step00000006'\)"):
        job.resume()


def test_a_diverged_run_says_which_checkpoints_to_move_for_a_start_from_the_one_before(tmp_path):
    """Skips from step 11 on, checkpoints at steps 10 (before them) and 12 (during them): the job
    resumes from the newest complete checkpoint, so the message names step 12's to move away
    for a start from step 10's. Fails on the code before, which said to start again from step
    10's checkpoint, where a start resumed from step 12's."""
    from types import SimpleNamespace

    for step in (10, 12):
        fake_checkpoint(tmp_path / loop.CHECKPOINTS, step)
    job = object.__new__(loop.Job)
    job.run_dir, job.rank, job.step, job.skip_streak_from = tmp_path, 0, 13, 10
    job.job = SimpleNamespace(stop_after_skipped_steps=3)
    with pytest.raises(loop.Diverged) as raised:
        job._after_step(True)
    ckpts = tmp_path / loop.CHECKPOINTS
    assert str(raised.value) == (
        "the run diverged: 3 consecutive optimizer steps (11-13) were skipped on non-finite gradients or fp16 "
        f"overflow (job.stop_after_skipped_steps=3); the last checkpoint before them is {ckpts / 'step00000010'} "
        "(kept by the rotation). To start again from it, move the checkpoints taken during the skips "
        f"(step00000012) out of {ckpts}, lower the learning rate or the warmup's peak, and start the job again: "
        "it resumes from the newest complete checkpoint")


def test_a_save_after_the_directory_was_taken_over_leaves_the_new_owners_checkpoint(tmp_path, monkeypatch):
    """The run directory is taken over between the step's agreement and its save, and the new
    owner has already written a complete checkpoint of the same step: the save stops on every rank
    (``RunDirBusy``) before rank 0 clears anything, and that checkpoint stays. Fails on the code
    before, which cleared the tag (a save cut short, as it took it) and wrote its own files there."""
    from types import SimpleNamespace

    from vrgd_ds.train.rundir import RunDirBusy

    tag = fake_checkpoint(tmp_path / loop.CHECKPOINTS, 4)
    writes = []
    job = saving_job(tmp_path, 4, lambda *args: writes.append(args), monkeypatch)
    job.lock = SimpleNamespace(lost="run directory taken over by job 77 on host b", record={})
    with pytest.raises(RunDirBusy, match="taken over by job 77"):
        job.save()
    assert writes == [] and ckpt.problem(tmp_path / loop.CHECKPOINTS, tag) is None


def test_the_last_checkpoint_before_skipped_steps_survives_a_resume_that_passed_one_over(tmp_path, monkeypatch):
    """Keeping 1 checkpoint every 20 steps: step 120's checkpoint failed to load once (an
    out-of-memory error), so the job resumed from step 100 with step 120 passed over; it wrote
    step 120 again, good, then every step from 125 on was skipped. The save at step 140 keeps step
    120's, the last one before the skipped steps. Fails on the code before, which protected step
    120's from the count of kept checkpoints (deleting step 100's) and then deleted it as passed
    over: with only step 140's left, the job had no checkpoint from before the skips to suggest."""
    def write(ckpt_dir, tag, state):
        (ckpt_dir / tag).mkdir(parents=True, exist_ok=True)
        (ckpt_dir / tag / "model.pt").write_bytes(b"w" * 64)

    ckpt_dir = tmp_path / loop.CHECKPOINTS
    for step in (100, 120):
        fake_checkpoint(ckpt_dir, step)
    job = saving_job(tmp_path, 120, write, monkeypatch)
    job.job.keep_checkpoints, job.passed_over = 1, (ckpt.tag_of(120),)
    job.save()  # step 120 again
    assert ckpt.tags(ckpt_dir) == [ckpt.tag_of(120)] and job.passed_over == ()
    job.step, job.skip_streak_from = 140, 124
    job.save()
    assert ckpt.tags(ckpt_dir) == [ckpt.tag_of(120), ckpt.tag_of(140)]
    assert ckpt.problem(ckpt_dir, ckpt.tag_of(120)) is None
    # passed over and not written again (another checkpoint_every): never the one protected
    for step in (100, 120):
        fake_checkpoint(tmp_path / "other" / loop.CHECKPOINTS, step)
    job = saving_job(tmp_path / "other", 130, write, monkeypatch)
    job.job.keep_checkpoints, job.passed_over, job.skip_streak_from = 1, (ckpt.tag_of(120),), 124
    job.save()
    # step 100's kept beyond the count; step 120's, older than the kept ones, goes
    assert ckpt.tags(tmp_path / "other" / loop.CHECKPOINTS) == [ckpt.tag_of(100), ckpt.tag_of(130)]


def test_a_checkpoint_file_removed_while_it_is_checked_is_missing(tmp_path, monkeypatch):
    """Another job reading a run directory while its owner rotates checkpoints: a file removed
    between ``is_file()`` and ``stat()`` makes the checkpoint "missing" a file. Fails on the code
    before, which raised FileNotFoundError (exit 1 with a traceback, before the "in use" message)."""
    fake_checkpoint(tmp_path, 4)
    real_stat = Path.stat

    def gone(self, *args, **kwargs):
        if self.suffix == ".pt":
            raise FileNotFoundError(self)
        return real_stat(self, *args, **kwargs)

    monkeypatch.setattr(Path, "stat", gone)
    assert "missing" in ckpt.problem(tmp_path, ckpt.tag_of(4))


def test_a_save_over_a_save_cut_short_keeps_none_of_its_files(tmp_path, monkeypatch):
    """A save of step 4 on 4 ranks killed half-way left ranks 2-3's files and a conversion of the tag;
    the job, resumed on 2 ranks from an older checkpoint, reaches step 4 again and saves it: the
    checkpoint holds only this save's files (DeepSpeed counts the rank files to learn how many ranks
    wrote it, and a resume on other ranks reads the tag's conversion). Fails on the code before,
    whose DeepSpeed save wrote into the directory as it found it."""
    ckpt_dir = tmp_path / "checkpoints"
    tag = ckpt_dir / "step00000004"
    tag.mkdir(parents=True)
    for r in (2, 3):
        (tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(b"stale")
    (ckpt_dir / ckpt.UNIVERSAL / "step00000004").mkdir(parents=True)

    def write(ckpt_dir, tag, state):  # this save: 2 ranks' files (DeepSpeed makes the directory)
        (ckpt_dir / tag).mkdir(parents=True, exist_ok=True)
        for r in (0, 1):
            (ckpt_dir / tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(b"new")

    saving_job(tmp_path, 4, write, monkeypatch).save()
    assert sorted(p.name for p in tag.iterdir() if p.suffix == ".pt") == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert ckpt.problem(ckpt_dir, "step00000004") is None
    assert not (ckpt_dir / ckpt.UNIVERSAL / "step00000004").exists()


def test_a_checkpoints_files_reach_the_disk_before_its_marker(tmp_path, monkeypatch):
    """The job fsyncs every file and directory of a checkpoint before the marker that lists them,
    and the marker's and ``latest``'s renames with their directory. Fails on the code before, which
    fsynced only the marker's and ``latest``'s own bytes: after a power loss the marker could be
    durable and a rank file it lists empty."""
    ckpt_dir = tmp_path / "checkpoints"

    def write(ckpt_dir, tag, state):  # what DeepSpeed writes, with torch.save's plain close
        (ckpt_dir / tag / "zero").mkdir(parents=True)
        (ckpt_dir / tag / "mp_rank_00_model_states.pt").write_bytes(b"model")
        (ckpt_dir / tag / "zero" / "rank_1.pt").write_bytes(b"optim")

    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd)))
    saving_job(tmp_path, 6, write, monkeypatch).save()
    tag = ckpt_dir / "step00000006"
    marker = next(i for i, p in enumerate(synced) if ckpt.MARKER in p)
    for p in (tag / "mp_rank_00_model_states.pt", tag / "zero" / "rank_1.pt", tag / "zero", tag):
        assert str(p) in synced[:marker], p
    assert synced.count(str(tag)) == 2 and str(ckpt_dir) in synced[marker:]  # the marker's rename, latest's

    out = ckpt_dir / ckpt.UNIVERSAL / "step00000006" / "zero" / "w"  # a universal conversion's files
    out.mkdir(parents=True)
    (out / "fp32.pt").write_bytes(b"w")
    synced.clear()
    ckpt.record_conversion(ckpt_dir, "step00000006", 4, ["step"])
    record = next(i for i, p in enumerate(synced) if ckpt.CONVERTED in p)
    assert str(out / "fp32.pt") in synced[:record] and str(out) in synced[:record]


@pytest.mark.parametrize("rank", range(4))
def test_one_rank_per_host_flushes_the_checkpoint(rank, monkeypatch):
    """Ranks 0-3 on two hosts, interleaved (a, b, a, b): ranks 0 and 1 are their hosts' first."""
    from types import SimpleNamespace

    hosts = "abab"

    def all_gather(out, mine):
        for r, t in enumerate(out):
            t.copy_(mine if hosts[r] == hosts[rank] else mine + 1)

    monkeypatch.setattr(loop, "dist", SimpleNamespace(all_gather=all_gather))
    job = object.__new__(loop.Job)
    job.rank, job.world, job.device = rank, 4, "cpu"
    assert job._first_on_node() == (rank < 2)


def test_the_evaluation_before_training_takes_the_micro_batch_of_the_phase_at_its_length(monkeypatch):
    """Before training the held-out samples are the last phase's length (here 128, trained at
    micro-batch 4), evaluated at that phase's micro-batch, not at the first phase's 8 (BERT-large's
    configs: 64 × 512 tokens, four times any training micro-batch at 512). Fails on the code
    before, which took the current phase's, the first."""
    from types import SimpleNamespace

    seen = []
    monkeypatch.setattr(loop, "eval_batches", lambda held, n, micro, rank, world, collate: seen.append(micro) or [])
    job = object.__new__(loop.Job)
    job.job = SimpleNamespace(phases=[SimpleNamespace(seq_len=64, micro_batch=8),
                                      SimpleNamespace(seq_len=128, micro_batch=4)], data=SimpleNamespace(eval_samples=64))
    job.consumed, job.budget, job.step = [0, 0], [640, 160], 0
    job.engine = SimpleNamespace(data_rank=0, data_world=1, collate=None, task="mlm", evaluate=lambda b: (0.0, 0.0, 0.0))
    job._sum_over_ranks = lambda values: values
    job.watchdog = SimpleNamespace(beat=lambda step, what: None)
    job.evaluate(None, 128)
    job.evaluate(None, 64)  # the current phase's length: its micro-batch
    assert seen == [4, 8]


def test_free_space_check_names_the_path_and_the_sizes(tmp_path):
    import shutil

    free = shutil.disk_usage(tmp_path).free
    ckpt.check_space(tmp_path / "checkpoints", 1 << 20)  # a missing directory is checked on its parent
    with pytest.raises(ckpt.NoSpace, match=rf"no space left on {tmp_path / 'checkpoints'} for the next checkpoint: "
                                           r"need about [\d,]+ MB, [\d,]+ MB free"):
        ckpt.check_space(tmp_path / "checkpoints", free + (1 << 40))


def test_disk_full_errors_are_recognised():
    """torch.save on a full disk raises ``RuntimeError: [enforce fail at inline_container.cc:672]
    . unexpected pos ...`` (seen) with no path: the job turns it into a message that names one."""
    assert ckpt.is_disk_full(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4288 vs 4176"))
    assert ckpt.is_disk_full(OSError(28, "No space left on device"))
    assert not ckpt.is_disk_full(RuntimeError("CUDA out of memory"))


def test_a_full_disk_under_dist_checkpointing_or_at_a_writes_last_chunk_is_recognised(tmp_path, monkeypatch):
    """Megatron's dist-checkpointing reports a rank's failed write as a ``CheckpointException``
    (a ``BaseException``) holding each rank's error; torch.save failing on a file's last chunk
    raises a bare iostream error, a full disk then told by the free space left. Both are a full
    disk (the job's exit 5 naming the directory); an iostream error with room left, or another
    rank failure, is not. Fails on the code before, which read neither (and the job caught
    ``Exception`` only: exit 1 with a traceback)."""
    import traceback

    from torch.distributed.checkpoint import CheckpointException

    wrapped = CheckpointException("write", {1: (OSError(28, "No space left on device"), traceback.StackSummary())})
    assert ckpt.is_disk_full(wrapped)
    other = CheckpointException("write", {0: (ValueError("a bad shape"), traceback.StackSummary())})
    assert not ckpt.is_disk_full(other)
    stream = RuntimeError("basic_ios::clear: iostream error")
    monkeypatch.setattr(ckpt, "free_bytes", lambda path: 4096)
    assert ckpt.is_disk_full(stream, tmp_path) and not ckpt.is_disk_full(stream)
    monkeypatch.setattr(ckpt, "free_bytes", lambda path: 10 * 2**30)
    assert not ckpt.is_disk_full(stream, tmp_path)


# ---- watchdog ------------------------------------------------------------------------------


def test_watchdog_report_names_the_silent_rank(tmp_path):
    a = Watchdog(tmp_path, 0, 3, timeout_s=60, poll_s=0.05)
    b = Watchdog(tmp_path, 1, 3, timeout_s=60, poll_s=0.05)
    try:
        a.beat(7)
        b.beat(6)
        time.sleep(1.3)  # rank 1 stops refreshing (its thread never ran: a stopped process)
        a._write()
        report = a.report()
    finally:
        a.stop()  # also disarms faulthandler's backstop in this process
        b.stop()
    assert "rank(s) 2 never reported" in report
    assert "rank 1 " in report and "unresponsive" in report and "step 6" in report
    assert "rank 0 " not in report


def test_the_watchdog_kills_a_silent_rank_only_while_its_pid_is_the_same_process(tmp_path):
    """Two silent heartbeats on this host name the same live pid: rank 2's as that process (its
    start time and pid namespace), rank 1's from an earlier process whose pid was reused since (an
    earlier start of the job left it). Only rank 2's pid is to be killed. Fails on the code before,
    which killed every silent local pid: an unrelated process holding a reused pid included."""
    import socket
    import subprocess

    from vrgd_ds.train.rundir import pid_namespace, process_start

    sleeper = subprocess.Popen(["sleep", "60"])
    w = Watchdog(tmp_path, 0, 3, timeout_s=60, poll_s=0.05)
    try:
        old = {"rank": 1, "step": 3, "what": "step", "time": 0.0, "alive": 0.0, "host": socket.gethostname(),
               "pid": sleeper.pid, "proc_start": "1", "pid_ns": pid_namespace()}
        (tmp_path / "heartbeat" / "rank1").write_text(json.dumps(old))
        same = dict(old, rank=2, proc_start=process_start(sleeper.pid))
        (tmp_path / "heartbeat" / "rank2").write_text(json.dumps(same))
        w.beat(3)
        report, local_silent = w._examine()
        beat = json.loads((tmp_path / "heartbeat" / "rank0").read_text())
    finally:
        w.stop()
        sleeper.kill()
        sleeper.wait()
    assert "rank 1 " in report and "rank 2 " in report  # both are reported
    assert local_silent == [sleeper.pid]  # once: rank 2's
    assert beat["proc_start"] == process_start(os.getpid()) and beat["pid_ns"] == pid_namespace()


def test_a_preemption_signal_while_the_job_takes_the_signal_over_is_kept():
    """A SIGUSR1 that arrives as the job replaces ``main``'s early handler with its own is kept.
    Fails on the old code, which read (and cleared) the early flag before installing its handler:
    a signal in between set the flag after it was read, and was lost."""
    import signal

    real, fired = signal.signal, []

    def late(signum, handler):  # the signal comes just before the job's handler is in place
        if signum == signal.SIGUSR1 and handler is not loop._early_preempt and not fired:
            fired.append(signum)
            signal.raise_signal(signal.SIGUSR1)  # in this thread, handled before the next line
        return real(signum, handler)

    saved = real(signal.SIGUSR1, loop._early_preempt)
    loop._EARLY_PREEMPT[0] = False
    signal.signal = late
    try:
        job = object.__new__(loop.Job)
        job._take_preempt_signal()
    finally:
        signal.signal = real
        real(signal.SIGUSR1, saved)
    assert fired and job.preempt_requested and not loop._EARLY_PREEMPT[0]


@pytest.mark.exhaustive  # one job of 3 steps in a subprocess (about 15 s; make test: the watchdog's own cases)
def test_the_watchdog_times_a_step_and_the_evaluation_after_it_apart(tmp_path):
    """The heartbeat says a step finished before the evaluation that follows it starts, so the
    watchdog's limit applies to each, as docs/pretraining.md says, and its message names the
    last finished step. Fails on the old code: the step's beat came after the evaluation, which
    therefore saw the step before (after step 2: step 1 done), and a step plus its evaluation
    had to fit in one limit."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import json
        from vrgd_ds.train import loop
        seen, evaluate = [], loop.Job.evaluate
        def watched(self, *args, **kwargs):
            seen.append([self.watchdog._progress["step"], self.watchdog._progress["what"]])
            return evaluate(self, *args, **kwargs)
        loop.Job.evaluate = watched
        rc = loop.main(["--config", {str(TEST_CONFIG)!r}, "--run-dir", {str(tmp_path / "run")!r},
                        "--set", "job.total_steps=3", "--set", "job.eval_every=1", "--set", "job.checkpoint_every=0"])
        print("SEEN", json.dumps(seen), rc)
        """)
    import launching

    one_rank = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(launching.free_port())}  # else DeepSpeed looks for MPI
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                         env={**os.environ, **one_rank})
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("SEEN ")), None)
    assert line is not None, out.stdout[-2000:] + out.stderr[-3000:]
    # before training, after steps 1 and 2 (eval_every), and the final one after step 3
    assert line == 'SEEN [[0, "set-up"], [1, "step"], [2, "step"], [3, "step"]] 0'


def test_a_failed_heartbeat_write_does_not_end_the_watch(tmp_path):
    """The heartbeat's writes fail for a while (a full disk), then the rank stalls: the watchdog still
    ends the job with EXIT_STALLED after its limit. Fails on the code before, where the first OSError
    raised out of the write: from a step's heartbeat it ended training (here: exit 1 at start), from
    the watch thread it ended the watch, and a later stall was never reported."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import pathlib, time
        from vrgd_ds.train.watchdog import Watchdog
        real, failures = pathlib.Path.write_text, [0]
        def write_text(self, *a, **k):
            if failures[0] < 5:
                failures[0] += 1
                raise OSError(28, "No space left on device")
            return real(self, *a, **k)
        pathlib.Path.write_text = write_text
        w = Watchdog(pathlib.Path({str(tmp_path)!r}), 0, 1, timeout_s=1.0, poll_s=0.05).start()
        w.beat(1)
        time.sleep(20)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr[-2000:]
    assert "made no progress" in done.stderr and "could not write its heartbeat" in done.stderr
    assert done.stderr.count("could not write its heartbeat") == 1


@pytest.mark.parametrize("timeout_s", [15.0, 60.0, 1800.0])
def test_collectives_outlive_the_watchdog(timeout_s):
    """Bug: the collective timeout equalled job.timeout_minutes, so a collective entered just after
    a step's heartbeat timed out before the watchdog's next poll, and a stalled job ended with
    gloo's bare "Timed out waiting 15000ms" instead of the message naming the rank (seen in
    test_stalled_rank_ends_the_job_naming_it). Fails on the old code: no ``collective_timeout``."""
    latest_watchdog_exit = timeout_s + poll_interval(timeout_s)
    assert collective_timeout(timeout_s) >= latest_watchdog_exit + 10.0


def test_set_up_has_its_own_limit_until_the_first_step(tmp_path):
    """Bug: the step limit applied from the start, so a set-up slower than job.timeout_minutes (a
    loaded machine, kernels built on first use) ended the job before its first step (seen in
    test_stalled_rank_ends_the_job_naming_it: "no progress for 15 s ... after start at step 0").
    Fails on the old code: Watchdog takes no ``startup_s``."""
    w = Watchdog(tmp_path, 0, 1, timeout_s=15, startup_s=600)
    try:
        assert w.limit == 600
        w.beat(0, "set-up")
        w.beat(0, "resume")
        assert w.limit == 600
        w.beat(1)
        assert w.limit == 15
        w.beat(1, "evaluation")
        assert w.limit == 15
        assert Watchdog(tmp_path, 1, 2, timeout_s=60, startup_s=5).limit == 60  # never shorter than a step's
    finally:
        w.stop()


def test_a_refused_resume_ends_every_rank_together(monkeypatch, capsys):
    """A resume refused from the marker and the config is raised on every rank at once, and the
    ranks leave the process group together. Before, each returned 2 on its own, and a rank could
    die in gloo's teardown (SIGABRT: "terminate called without an active exception"), the launcher
    then reporting -6 for a refused resume (seen for an adaptive phase made fixed). A refusal found
    by one rank alone (the others elsewhere) must not wait for them. Fails on the old code."""
    from vrgd_ds.train.config import ConfigError

    job = object.__new__(loop.Job)

    def refuse():
        raise ConfigError("phase 0 ran with adaptive_batch, the config has none there")

    job.resume = refuse
    with pytest.raises(ConfigError) as raised:
        job.train()
    assert raised.value.agreed is True
    for error, together in ((raised.value, True), (ConfigError("rank 0's own"), False)):
        assert ended_by(monkeypatch, capsys, error) == (loop.EXIT_CONFIG, together)


def ended_by(monkeypatch, capsys, error: Exception) -> tuple[int, bool]:
    """``main``'s exit code for a job whose set-up raises ``error``, and whether its ranks left the
    process group together (``leave_together``); the error is printed."""
    left = []
    monkeypatch.setattr(loop, "leave_together", lambda: left.append(1))

    class Stopped:  # the job as far as main sees it
        rank = 0

        def __init__(self, *args):
            pass

        def setup(self):
            raise error

        def release(self):
            pass

    monkeypatch.setattr(loop, "Job", Stopped)
    rc, err = run_main(capsys)
    assert str(error) in err
    return rc, left == [1]


def test_a_diverged_run_and_a_checkpoint_without_room_end_every_rank_together(monkeypatch, capsys, tmp_path):
    """A diverged run (the skips are agreed over the ranks) and a save refused for room before any
    rank writes (agreed too) end with the ranks leaving the process group together, as a refused
    resume does; a write that fails on one rank's disk does not wait for the others. Before, every
    rank returned 4 or 5 on its own and could die in gloo's teardown. Fails on the old code."""
    from vrgd_ds.train import checkpoints as ckpt

    job = object.__new__(loop.Job)
    job.saved_step, job.step, job.rank, job.run_dir = None, 3, 0, tmp_path
    job._checkpoint_bytes = lambda: (1, 1 << 62, "an estimate")  # more than any disk holds
    job._any_rank, job._max_over_ranks, job.lock = (lambda flag: flag), (lambda value: value), None
    with pytest.raises(ckpt.NoSpace) as no_room:
        job.save()
    assert no_room.value.agreed is True
    for error, rc, together in ((loop.Diverged("the run diverged"), loop.EXIT_DIVERGED, True),
                                (no_room.value, loop.EXIT_NO_SPACE, True),
                                (ckpt.NoSpace("no space left while writing step00000004"), loop.EXIT_NO_SPACE, False)):
        assert ended_by(monkeypatch, capsys, error) == (rc, together), error


def test_phases_of_one_sequence_length_read_one_stream(tmp_path):
    """Phase 2 has phase 0's sequence length: it reads on from where phase 0 stopped (its
    samples, then the next epoch's, each epoch with new masks), not phase 0's samples again.
    Before, every phase started its own stream at epoch 0 (seed + phase index): a recipe that
    split one sequence length into phases (a batch or LR change) trained on the samples and
    masks it had seen while others waited. Fails on the old code."""
    import torch

    from vrgd_ds.train.config import parse_job

    job = object.__new__(loop.Job)
    job.job = parse_job({"job": {"total_steps": 12, "seed": 5, "phases": [
        {"seq_len": 32, "fraction": 0.5, "global_batch": 8, "micro_batch": 4, "lr": 1e-3},
        {"seq_len": 64, "fraction": 0.25, "global_batch": 8, "micro_batch": 4, "lr": 1e-3},
        {"seq_len": 32, "fraction": 0.25, "global_batch": 8, "micro_batch": 2, "lr": 1e-3}]}})
    job.splits = {32: (list(range(100)), None), 64: (list(range(40)), None)}
    job.engine = type("Engine", (), {"data_rank": 0, "data_world": 1, "collate": staticmethod(lambda b: b)})()
    job.device, job.consumed = torch.device("cpu"), [48, 24, 8]
    phase0, _, _ = job._phase_data(0)
    sampler, _, _ = job._phase_data(2)
    assert sampler.seed == phase0.seed == 5 and sampler.stream_offset == 48, vars(sampler)
    assert next(iter(sampler)) == phase0.keys(48 + 8, 2)  # after phase 0's 48 and this phase's 8
    assert job._phase_data(1)[0].stream_offset == 0


ENDED_ON_SIGNAL = """
import signal, sys, threading, time, types
from vrgd_ds.train import loop

class Engine:
    config_errors = staticmethod(lambda: ())
    check_config = staticmethod(lambda raw, job, finished: None)

class Job:  # a job that ends at once, as sys.argv[1] says: checkpointed on the signal, or finished
    rank = 1  # (rank 0 would also plot and print the run's paths)
    def __init__(self, *args): pass
    def setup(self): return self
    def release(self): pass
    def train(self):
        print("trained", flush=True)
        if sys.argv[1] == "preempted":
            raise loop.Preempted("checkpoint step00000005 taken on SIGUSR1")
        return {}

loop.load_config = lambda path, sets: ({}, types.SimpleNamespace(engine="stand-in"))
loop.engine_class, loop.check_data_path, loop.Job = (lambda name: Engine), (lambda job: None), Job
loop.leave_together = lambda: None
# a thread of the process that does not block the signal, as gloo's and the data loaders' do not
threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
sys.exit(loop.run_process(["--config", "job.json", "--run-dir", "run"]))  # as python -m vrgd_ds.train
"""


def test_main_in_a_process_that_goes_on_leaves_its_children_the_signals_default(monkeypatch, capsys):
    """``main`` called in-process (a refused job here) leaves the signal to the children the
    process starts later as torch and the launchers expect it: not ignored, which they would
    inherit. Fails on the code that ignored it from ``main``'s end rather than the process's
    entry point (``run_process``)."""
    class Job:
        rank = 0

        def __init__(self, *args):
            pass

        def setup(self):
            raise loop.ConfigError("refused at setup")

        def release(self):
            pass

    monkeypatch.setattr(loop, "Job", Job)
    monkeypatch.setattr(loop, "check_data_path", lambda job: None)
    before = signal.getsignal(signal.SIGUSR1)
    try:
        rc, err = run_main(capsys)
        child = subprocess.run([sys.executable, "-c", "import signal; print(int(signal.getsignal(signal.SIGUSR1)))"],
                               capture_output=True, text=True, check=True)
    finally:
        signal.signal(signal.SIGUSR1, before)
    assert rc == loop.EXIT_CONFIG and "refused at setup" in err, err
    assert child.stdout.strip() == str(int(signal.SIG_DFL))


@pytest.mark.parametrize("ended, rc", [("preempted", loop.EXIT_REQUEUE), ("finished", 0)])
def test_warnings_after_the_job_has_ended_do_not_end_the_rank(tmp_path, ended, rc):
    """Once the job has checkpointed on ``SIGUSR1`` (or finished, the warning coming in its last
    step), more of them (Slurm's, and one per node alias where a loopback node signals every rank)
    arrive until the rank has exited. Python's shutdown puts the default action back for a signal
    it handles, and a signal sent to the process goes to any thread that does not block it: fails
    on the old code, which blocked the signal in the main thread alone after a checkpoint on it
    (and not at all after a finished run), so a warning taken by another thread during the shutdown
    ended the rank with -10 (seen in the exhaustive pdsh test, 1 run in 3)."""
    child = subprocess.Popen([sys.executable, "-c", ENDED_ON_SIGNAL, ended], cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        assert line == "trained\n", (line, child.stderr.read())
        sent = 0
        while child.poll() is None:  # warnings until the rank has gone
            try:
                os.kill(child.pid, signal.SIGUSR1)
                sent += 1
            except ProcessLookupError:
                break
        child.wait(timeout=60)
    finally:
        child.kill()
    assert child.returncode == rc, (child.returncode, sent, child.stderr.read()[-2000:])


def test_a_sink_that_fails_to_open_is_a_config_error_naming_job_telemetry(monkeypatch, tmp_path):
    """A sink rank 0 cannot open ends the job as a configuration error (agreed over the ranks:
    tests/integration/test_reliability.py), naming ``job.telemetry`` and the error; the wandb
    advice comes with wandb's own errors only. Fails on the old code, which raised the sink's
    error itself (exit 1, a traceback)."""
    from types import SimpleNamespace

    from vrgd_ds.train import telemetry
    from vrgd_ds.train.config import ConfigError

    job = object.__new__(loop.Job)
    job.rank, job.world, job.step, job.run_dir = 0, 1, 0, tmp_path
    job.job = SimpleNamespace(telemetry=SimpleNamespace(jsonl=True, tensorboard=False,
                                                        wandb=SimpleNamespace(model_dump=lambda: {"project": "p"})))
    job.resume = lambda: False
    job._train = lambda sinks: pytest.fail("trained without its sinks")
    usage = type("UsageError", (Exception,), {"__module__": "wandb.errors.errors"})  # a stand-in: wandb is optional
    for error, hint in ((usage("api_key not configured (no-tty)"), True),
                        (IsADirectoryError(21, "Is a directory"), False)):
        monkeypatch.setattr(telemetry, "build_sinks", lambda *a, e=error, **k: (_ for _ in ()).throw(e))
        with pytest.raises(ConfigError) as raised:
            job.train()
        assert str(raised.value).startswith(f"job.telemetry: rank 0 could not open its sinks: {type(error).__name__}: ")
        assert ("set job.telemetry.wandb.mode to \"offline\"" in str(raised.value)) == hint, str(raised.value)
        assert raised.value.agreed


def test_a_sink_that_fails_to_close_does_not_replace_the_error_that_ends_the_training(monkeypatch, tmp_path):
    """Fails on the old code: the sinks were closed in a ``finally``, so a TensorBoard or wandb
    close that failed (a full disk) while ``Preempted`` propagated replaced it, and ``main`` missed
    its exit code (Slurm's requeue) and the ranks' leaving together. A training that ends well still
    raises the close's failure."""
    from types import SimpleNamespace

    from vrgd_ds.train import telemetry

    closed = []

    class Failing(telemetry.MetricSink):
        def write(self, step, metrics):
            pass

        def close(self):
            closed.append(1)
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(telemetry, "build_sinks", lambda *a, **k: telemetry.MultiSink([Failing()]))
    job = object.__new__(loop.Job)
    job.rank, job.world, job.step, job.run_dir = 0, 1, 3, tmp_path
    job.job = SimpleNamespace(telemetry=SimpleNamespace(jsonl=True, tensorboard=True, wandb=None))
    job.resume = lambda: True

    def preempted(sinks):
        raise loop.Preempted("SIGUSR1: checkpoint written, exiting for the requeue")

    job._train = preempted
    with pytest.raises(loop.Preempted):
        job.train()
    job._train = lambda sinks: {"step": 3}
    with pytest.raises(OSError, match="No space left"):
        job.train()
    assert closed == [1, 1]


@pytest.mark.parametrize("jsonl", [True, False])
def test_plots_come_from_this_runs_metrics_while_it_holds_the_run_directory(monkeypatch, capsys, tmp_path, jsonl):
    """The plots were drawn after the run directory was given back (another job could have taken it
    and be writing its metrics), and with ``job.telemetry.jsonl`` false they were drawn from a
    ``metrics.jsonl`` an earlier run had left, and its path printed as this run's metrics. Now they
    are drawn before the release, and only from metrics this run writes, rank 0's watchdog stopped
    first (the other ranks' are: a long plotting took their silence for a stall, exit 3, and
    SIGKILLed them). Fails on the old code."""
    from vrgd_ds.train import plots

    run_dir = tmp_path / "run"
    (run_dir / loop.CHECKPOINTS).mkdir(parents=True)
    (run_dir / loop.CHECKPOINTS / ckpt.LATEST).write_text("step00000004\n")
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "time": 0.0, "train/loss": 9.0}\n')  # an earlier run's
    events = []

    class Watchdog:  # rank 0's, as far as main reaches it
        def stop(self):
            events.append("watchdog stopped")

    class Finished:  # the job as far as main sees it
        rank, watchdog = 0, Watchdog()

        def __init__(self, *args):
            pass

        def setup(self):
            return self

        def train(self):
            figures = {"eval/mlm_loss": 7.0, "eval/mlm_acc": 0.1}
            return {"before": figures, "after": figures, "task": "mlm", "steps": 4}

        def release(self):
            events.append("release")

    monkeypatch.setattr(loop, "Job", Finished)
    monkeypatch.setattr(plots, "plot_run", lambda d: events.append("plot") or [Path(d) / "plots" / "loss.png"])
    rc = loop.main(["--config", str(TEST_CONFIG), "--run-dir", str(run_dir),
                    "--set", f"job.telemetry.jsonl={json.dumps(jsonl)}"])
    out = capsys.readouterr().out
    assert rc == 0
    assert events == (["watchdog stopped", "plot", "release"] if jsonl else ["release"])
    assert ("metrics:" in out) is jsonl and ("plots:" in out) is jsonl


def test_a_read_only_prepared_directory_takes_a_job_of_another_seed(tmp_path, monkeypatch):
    """A prepared directory on a read-only share (``vrgd-data prepare`` ran with its seed, 0 by
    default) and a job of another seed (the job's default is 1234): the job's sample index is not
    there and cannot be written there. It is built in the run directory's ``data/samples`` and
    every rank reads it from there; an index the share has is read where it is, unless it is stale
    (built from other shards or options: seed 7 here), when the job builds its own in the run
    directory too. Fails on the old code, which wrote into the share: rank 0 died with a
    PermissionError while the other ranks waited at the barrier (and, for a stale index, on the
    code before the ``current`` check)."""
    from vrgd_ds.data_pipeline import samples
    from vrgd_ds.data_pipeline.samples import index_filename
    from vrgd_ds.train import data
    from vrgd_ds.train.config import load_config

    share = tmp_path / "share"
    (share / "shards").mkdir(parents=True)
    (share / "samples").mkdir()
    (share / "tokenizer.model").write_bytes(b"a tokenizer")
    (share / "shards" / "manifest.json").write_text("{}")
    (share / "samples" / index_filename(32, 0, None)).write_bytes(b"seed 0's index")
    (share / "samples" / index_filename(32, 7, None)).write_bytes(b"a stale index")  # of other shards, say

    class Corpus:  # the share's shards, as ShardedCorpus reads them
        vocab_size, num_documents = 400, 10

        def __init__(self, path, verify):
            pass

        def check_token_ids(self):
            pass

        def check_tokenizer(self, tokenizer):
            pass

    def build(corpus, n, seed, out_dir, next_sentence=None):
        path = Path(out_dir) / index_filename(n, seed, next_sentence)
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"built")
        return path

    real_access, real_open = os.access, os.open

    def os_open(path, flags, *args, **kwargs):  # the share refuses writes, as it does to any user
        if str(path).startswith(str(share)) and flags & (os.O_RDWR | os.O_WRONLY | os.O_CREAT):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(data, "ShardedCorpus", Corpus)
    monkeypatch.setattr(samples, "build_sample_index", build)
    monkeypatch.setattr(samples, "index_is_current", lambda corpus, path, *a, **k: Path(path).read_bytes() != b"a stale index")
    monkeypatch.setattr(data.Tokenizer, "load", staticmethod(lambda path: object()))
    monkeypatch.setattr(os, "access", lambda path, mode: not str(path).startswith(str(share)) and
                        real_access(path, mode))
    before = sorted(p.relative_to(share) for p in share.rglob("*"))
    for seed, where in ((1234, tmp_path / "run" / "data" / "samples"), (0, share / "samples"),
                        (7, tmp_path / "run" / "data" / "samples")):
        _, job = load_config(TEST_CONFIG, [f'job.data.path="{share}"', f"job.seed={seed}",
                                           'job.phases=[{"seq_len": 32, "fraction": 1.0, "global_batch": 16, '
                                           '"micro_batch": 4, "lr": 0.002}]'])
        prepared = data.prepare_data(job, tmp_path / "run", 0, lambda: None, [32])
        assert prepared.samples == {32: where / index_filename(32, seed, None)}
        assert prepared.samples[32].is_file()
    assert sorted(p.relative_to(share) for p in share.rglob("*")) == before  # nothing written into the share
