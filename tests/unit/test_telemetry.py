"""The job's telemetry: layer groups of BERT parameter names, group rows from per-tensor
rows, and the JSONL / TensorBoard / wandb sinks."""
import builtins
import json
import math

import pytest
import torch
from torch import nn

import vrgd_ds
from vrgd_ds.train import telemetry as T


@pytest.mark.parametrize("name, group", [
    ("bert.embeddings.word_embeddings.weight", "embeddings"),
    ("bert.embeddings.LayerNorm.bias", "embeddings"),
    ("embeddings.position_embeddings.weight", "embeddings"),
    ("bert.encoder.layer.11.attention.self.query.weight", "encoder.layer.11"),
    ("encoder.layer.0.output.dense.bias", "encoder.layer.0"),
    ("module.bert.encoder.layer.3.intermediate.dense.weight", "encoder.layer.3"),
    ("module._orig_mod.bert.encoder.layer.23.output.LayerNorm.weight", "encoder.layer.23"),
    ("bert.pooler.dense.weight", "pooler"),
    ("module.pooler.dense.bias", "pooler"),
    ("cls.predictions.transform.dense.weight", "head"),
    ("cls.predictions.bias", "head"),
    ("module.cls.seq_relationship.weight", "head"),
    ("classifier.dense.weight", "classifier.dense"),
    ("qa_outputs.weight", "qa_outputs.weight"),
    ("bias", "bias"),
    # "encoder.layers" (another naming) is not HF BERT's "encoder.layer.<i>".
    ("encoder.layers.1.weight", "encoder.layers"),
    # megatron-core's GPT: one group per layer (before: every layer in "decoder.layers")
    ("module.decoder.layers.3.self_attention.linear_qkv.weight", "decoder.layers.3"),
    ("decoder.layers.11.mlp.linear_fc2.bias", "decoder.layers.11"),
    ("decoder.final_layernorm.weight", "decoder.final_layernorm"),
    # a pipeline stage's rows (Layout.join_stages): the stage, then the layer (before: "stage1.module", one
    # group per stage)
    ("stage1.module.decoder.layers.0.mlp.linear_fc1.weight", "stage1.decoder.layers.0"),
    ("stage0.module.embedding.word_embeddings.weight", "stage0.embedding.word_embeddings"),
    # a rank holding several model chunks (vrgd_ds.megatron.stats names them chunk<i>.): the chunk, then
    # the layer (fails on the old code: every layer of a chunk in one "chunk0.module" group)
    ("stage0.chunk1.module.decoder.layers.2.mlp.linear_fc1.weight", "stage0.chunk1.decoder.layers.2"),
    ("chunk0.module.decoder.layers.0.self_attention.linear_qkv.weight", "chunk0.decoder.layers.0"),
])
def test_layer_group(name, group):
    assert T.layer_group(name) == group


def test_group_summary_by_hand():
    rows = {
        "tensor/bert.encoder.layer.0.attention.self.query.weight/gsnr_mean": 0.2,
        "tensor/bert.encoder.layer.0.attention.self.query.weight/gsnr_min": 0.01,
        "tensor/bert.encoder.layer.0.attention.self.query.weight/gsnr_max": 3.0,
        "tensor/bert.encoder.layer.0.attention.self.query.weight/clip_low_frac": 0.5,
        "tensor/bert.encoder.layer.0.attention.self.query.weight/clip_high_frac": 0.1,
        "tensor/bert.encoder.layer.0.attention.self.query.weight/trust_ratio": 1.5,
        "tensor/bert.encoder.layer.0.output.dense.bias/gsnr_mean": 0.6,
        "tensor/bert.encoder.layer.0.output.dense.bias/gsnr_min": 0.002,
        "tensor/bert.encoder.layer.0.output.dense.bias/gsnr_max": 2.0,
        "tensor/bert.encoder.layer.0.output.dense.bias/clip_low_frac": 0.0,
        "tensor/bert.encoder.layer.0.output.dense.bias/clip_high_frac": 0.3,
        "tensor/bert.encoder.layer.0.output.dense.bias/trust_ratio": 1.0,
        "tensor/cls.predictions.bias/gsnr_mean": 0.25,
        "tensor/cls.predictions.bias/gsnr_min": float("nan"),  # ignored, not propagated
        "tensor/cls.predictions.bias/gsnr_max": 0.9,
        # Not per-tensor rows: ignored.
        "gsnr/mean": 7.0,
        "trust_ratio/mean": 9.0,
        "tensor/x.y/unknown_metric": 5.0,
    }
    out = T.group_summary(rows)
    assert out == pytest.approx({
        "group/encoder.layer.0/gsnr_mean": 0.4,       # (0.2 + 0.6) / 2, unweighted
        "group/encoder.layer.0/gsnr_min": 0.002,
        "group/encoder.layer.0/gsnr_max": 3.0,
        "group/encoder.layer.0/clip_low_frac": 0.25,
        "group/encoder.layer.0/clip_high_frac": 0.2,
        "group/encoder.layer.0/trust_ratio": 1.25,
        "group/head/gsnr_mean": 0.25,
        "group/head/gsnr_max": 0.9,
    }, rel=1e-12)
    assert "group/head/gsnr_min" not in out


class _TinyBert(nn.Module):
    """The name structure of BertForPreTraining, with two small layers."""

    def __init__(self):
        super().__init__()
        self.bert = nn.ModuleDict({
            "embeddings": nn.ModuleDict({"word_embeddings": nn.Embedding(10, 8), "LayerNorm": nn.LayerNorm(8)}),
            "encoder": nn.ModuleDict({"layer": nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])}),
            "pooler": nn.ModuleDict({"dense": nn.Linear(8, 8)}),
        })
        self.cls = nn.ModuleDict({"predictions": nn.Linear(8, 10)})

    def forward(self, ids):
        h = self.bert["embeddings"]["LayerNorm"](self.bert["embeddings"]["word_embeddings"](ids))
        for layer in self.bert["encoder"]["layer"]:
            h = torch.tanh(layer(h))
        return self.cls["predictions"](h).sum() + self.bert["pooler"]["dense"](h[:, 0]).sum()


def test_group_summary_of_a_real_optimizer_step():
    """The names and metrics ``VRLamb.gsnr_metrics(per_tensor=True)`` produces go through
    ``group_summary`` into one row set per BERT layer group."""
    model = _TinyBert()
    opt = vrgd_ds.VRLamb(vrgd_ds.param_groups(model, 0.01), lr=0.01)
    for _ in range(3):  # three gradient groups: GSNR needs n >= 2
        model(torch.randint(0, 10, (4, 5))).backward()
    opt.step()
    per = opt.gsnr_metrics(per_tensor=True)
    out = T.group_summary(per)
    groups = {k.split("/")[1] for k in out}
    assert groups == {"embeddings", "encoder.layer.0", "encoder.layer.1", "pooler", "head"}
    mins = [v for k, v in per.items() if k.startswith("tensor/bert.encoder.layer.1.") and k.endswith("/gsnr_min")]
    assert len(mins) == 2  # weight and bias
    assert out["group/encoder.layer.1/gsnr_min"] == min(mins)
    for g in groups:
        assert 0.0 <= out[f"group/{g}/clip_low_frac"] <= 1.0


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_round_trip_with_non_finite_as_null(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    with T.JsonlSink(path) as sink:
        sink.write(1, {"train/loss": 2.5, "gsnr/mean": float("nan"), "noise_scale/b_simple": float("inf"),
                       "train/samples": 256, "phase": 1, "label": "p1", "t": torch.tensor(0.5)})
        sink.write(2, {"train/loss": 2.25, "step": 99, "time": -1.0})
        # Flushed at each write: readable before close.
        assert len(path.read_text().splitlines()) == 2
    a, b = _lines(path)
    assert a["step"] == 1 and isinstance(a["time"], float)
    assert a["train/loss"] == 2.5 and a["gsnr/mean"] is None and a["noise_scale/b_simple"] is None
    assert a["train/samples"] == 256 and isinstance(a["train/samples"], int)
    assert a["phase"] == 1 and a["label"] == "p1" and a["t"] == 0.5
    # The sink's step and time win over keys of the same name in the metrics.
    assert b["step"] == 2 and b["time"] > 0 and b["train/loss"] == 2.25
    assert "NaN" not in path.read_text() and "Infinity" not in path.read_text()


def test_jsonl_appends_and_resume_drops_later_steps(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with T.JsonlSink(path) as sink:
        for s in range(1, 6):
            sink.write(s, {"train/loss": float(s)})
    with T.JsonlSink(path) as sink:  # plain reopen appends
        sink.write(6, {"train/loss": 6.0})
    assert [r["step"] for r in _lines(path)] == [1, 2, 3, 4, 5, 6]
    # Resume from the checkpoint of step 3: steps 4..6 will be run again.
    with T.JsonlSink(path, resume_step=3) as sink:
        assert [r["step"] for r in _lines(path)] == [1, 2, 3]
        sink.write(4, {"train/loss": 40.0})
    recs = _lines(path)
    assert [r["step"] for r in recs] == [1, 2, 3, 4] and recs[-1]["train/loss"] == 40.0
    # No temporary file is left beside it.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


@pytest.mark.parametrize("mode", [0o644, 0o640])
def test_a_resume_keeps_the_metrics_files_permissions(tmp_path, mode):
    """The file rewritten on a resume keeps the mode the job's first start gave it, so a group
    sharing the run directory (TensorBoard, plots run as another user) still reads it. Fails on the
    old code: the rewrite went through ``mkstemp``, whose file is 0600."""
    path = tmp_path / "metrics.jsonl"
    with T.JsonlSink(path) as sink:
        for s in range(1, 4):
            sink.write(s, {"train/loss": float(s)})
    path.chmod(mode)
    with T.JsonlSink(path, resume_step=1):
        pass
    assert [r["step"] for r in _lines(path)] == [1]
    assert path.stat().st_mode & 0o777 == mode


@pytest.mark.parametrize("resume_step", [None, 5])
def test_jsonl_drops_a_cut_off_last_line(tmp_path, resume_step):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "time": 0.0, "a": 1.0}\n{"step": 2, "ti')
    with T.JsonlSink(path, resume_step=resume_step) as sink:
        sink.write(2, {"a": 2.0})
    assert [r["step"] for r in _lines(path)] == [1, 2]


def test_tensorboard_sink_scalars_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir = tmp_path / "tb"
    with T.TensorBoardSink(log_dir) as sink:
        sink.write(1, {"train/loss": 3.0, "gsnr/mean": 0.5, "phase": "p1"})
        sink.write(2, {"train/loss": 2.0, "gsnr/mean": float("nan"), "train/samples": 512})
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"train/loss", "gsnr/mean", "train/samples"}
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 3.0), (2, 2.0)]
    assert [(e.step, e.value) for e in acc.Scalars("gsnr/mean")] == [(1, 0.5)]  # NaN skipped
    assert [(e.step, e.value) for e in acc.Scalars("train/samples")] == [(2, 512.0)]


@pytest.fixture
def no_wandb(monkeypatch):
    """An interpreter without wandb: its import raises ImportError."""
    real_import = builtins.__import__

    def blocked(name, *args, **kwargs):
        if name == "wandb" or name.startswith("wandb."):
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", blocked)


def test_wandb_missing_gives_install_hint(tmp_path, no_wandb):
    with pytest.raises(ImportError, match=r'pip install "vrgd-ds\[wandb\]"'):
        T.WandbSink("proj", tmp_path)
    # build_sinks closes the sinks it already opened before re-raising.
    with pytest.raises(ImportError, match="vrgd-ds"):
        T.build_sinks(tmp_path / "run", tensorboard=False, wandb={"project": "proj"})
    assert not (tmp_path / "run" / "wandb").exists()


def test_wandb_disabled_needs_no_wandb(tmp_path, no_wandb):
    """``"mode": "disabled"`` passes the config check without wandb installed; the job then failed
    building its sinks (an ImportError after set-up, exit 1). Fails on the old code."""
    with T.build_sinks(tmp_path / "run", tensorboard=False, wandb={"project": "p", "mode": "disabled"}) as sinks:
        assert [type(s) for s in sinks.sinks] == [T.JsonlSink]


@pytest.mark.exhaustive  # three wandb starts (about 3 s)
def test_a_resumed_job_goes_on_with_its_wandb_run(tmp_path, monkeypatch):
    """A job resumed from a checkpoint (``resume_step``) logs into the wandb run it started; a
    fresh start (-1) takes a new one. Fails on the old code, where every start made a new run, the
    first keeping the steps the resumed one ran again."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run, cfg = tmp_path / "run", {"project": "p", "mode": "offline"}
    ids = []
    for resume_step in (-1, 2, -1):
        with T.build_sinks(run, tensorboard=False, wandb=cfg, resume_step=resume_step) as sinks:
            ids.append(sinks.sinks[-1]._run.id)
            sinks.write(3, {"train/loss": 1.0})
    assert ids[0] == ids[1] != ids[2], ids
    assert (run / "wandb" / "vrgd_run_id").read_text().strip() == ids[2]


def test_wandb_rejects_unknown_mode(tmp_path):
    with pytest.raises(ValueError, match="offline"):
        T.WandbSink("proj", tmp_path, mode="offlne")


class _Recorder(T.MetricSink):
    def __init__(self, fail_close=False):
        self.records, self.closed, self.fail_close = [], False, fail_close

    def write(self, step, metrics):
        self.records.append((step, dict(metrics)))

    def close(self):
        self.closed = True
        if self.fail_close:
            raise OSError("disk gone")


def test_multisink_fans_out_and_closes_all():
    a, b, c = _Recorder(), _Recorder(fail_close=True), _Recorder()
    multi = T.MultiSink([a, b, c])
    multi.write(7, {"x": 1.0})
    assert a.records == b.records == c.records == [(7, {"x": 1.0})]
    with pytest.raises(OSError, match="disk gone"):
        multi.close()
    assert a.closed and b.closed and c.closed


def test_build_sinks_layout_and_resume(tmp_path):
    run = tmp_path / "run"
    with T.build_sinks(run) as sinks:
        assert [type(s) for s in sinks.sinks] == [T.JsonlSink, T.TensorBoardSink]
        for s in range(1, 4):
            sinks.write(s, {"train/loss": 1.0 / s})
    assert (run / "metrics.jsonl").is_file()
    assert any(p.name.startswith("events.out.tfevents") for p in (run / "tensorboard").iterdir())
    with T.build_sinks(run, tensorboard=False, resume_step=1) as sinks:
        assert [type(s) for s in sinks.sinks] == [T.JsonlSink]
        sinks.write(2, {"train/loss": math.pi})
    assert [(r["step"], r["train/loss"]) for r in _lines(run / "metrics.jsonl")] == [(1, 1.0), (2, math.pi)]


def test_tensorboard_resume_hides_later_steps(tmp_path):
    """A resumed run's TensorBoard shows the re-run steps once, not the old and new ones."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with T.TensorBoardSink(tmp_path) as sink:
        for s in range(1, 4):
            sink.write(s, {"train/loss": float(s)})
    with T.TensorBoardSink(tmp_path, resume_step=1) as sink:
        sink.write(2, {"train/loss": 20.0})
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 1.0), (2, 20.0)]


def test_a_fresh_start_replaces_an_earlier_starts_records_and_any_exit_closes_the_sinks(tmp_path, monkeypatch):
    """``Job.train`` in a run directory where an earlier start logged steps 0-3 and was killed
    before its first checkpoint: the fresh start's records replace those (before: appended, so
    steps 0-1 were in ``metrics.jsonl`` twice), and a ``Preempted`` (as a ``Diverged`` or any
    failure) still closes the sinks, so TensorBoard's queued events reach the file (before:
    closed only at the normal end). Both fail on the old code."""
    from types import SimpleNamespace

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from vrgd_ds.train import loop

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "time": 0.0, "train/loss": 9.0}) + "\n"
                                               for s in range(4)))
    job = object.__new__(loop.Job)
    job.run_dir, job.rank, job.world, job.step, job.evals, job.consumed, job.budget = run, 0, 1, 0, [], [0], [2]
    job.job = SimpleNamespace(telemetry=SimpleNamespace(jsonl=True, tensorboard=True, wandb=None),
                              phases=[SimpleNamespace(seq_len=8)], total_steps=2)
    job.resume = lambda: False
    job.engine = SimpleNamespace(datasets=lambda seq_len: (None, None))
    job.evaluate = lambda held, seq_len: {"eval/mlm_loss": 5.0}
    job.optimizer = SimpleNamespace(param_groups=[{"gsnr": True}])
    job.current_phase = lambda: 0

    def run_phase(index, sinks, bar, held, gsnr_on):
        job.step = 1
        sinks.write(1, {"train/loss": 4.0})
        raise loop.Preempted("checkpoint step00000001 taken on SIGUSR1")

    job._run_phase = run_phase
    closed = []
    close = T.MultiSink.close
    monkeypatch.setattr(T.MultiSink, "close", lambda self: (closed.append(len(self.sinks)), close(self)))
    with pytest.raises(loop.Preempted):
        job.train()
    assert closed == [2]
    assert [(r["step"], r.get("train/loss"), r.get("eval/mlm_loss")) for r in _lines(run / "metrics.jsonl")] == [
        (0, None, 5.0), (1, 4.0, None)]
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 4.0)]
