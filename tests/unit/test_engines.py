"""The job spine and its two engines: the spine knows neither engine, and the Megatron engine's
configuration is checked before any work with the messages and exit code of the DeepSpeed job."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from vrgd_ds.train import loop
from vrgd_ds.train.config import ConfigError, parse_job
from vrgd_ds.train.engines import MODULES, megatron

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "vrgd_ds" / "train"
MEGATRON_CONFIG = ROOT / "configs" / "megatron" / "gpt_tiny_cpu_vr_lamb.json"
ENGINE_FILES = {TRAIN / "engines" / f"{name}.py" for name in MODULES}
FORBIDDEN = ("deepspeed", "megatron", "vrgd_ds.ds", "vrgd_ds.megatron")


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append(node.module)
    return out


def test_the_spine_imports_no_engine_outside_the_two_engine_modules():
    """Every module of ``vrgd_ds.train`` but ``engines/deepspeed.py`` and ``engines/megatron.py``,
    at any depth (a lazy import inside a function counts): no DeepSpeed, Megatron, nor the
    package's DeepSpeed or Megatron integration."""
    offenders = {}
    for path in sorted(TRAIN.rglob("*.py")):
        if path in ENGINE_FILES:
            continue
        bad = [m for m in _imports(path) if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]
        if bad:
            offenders[str(path.relative_to(ROOT))] = bad
    assert not offenders, offenders
    # and the check itself sees the engines' imports
    assert any(m.startswith("megatron.") for m in _imports(TRAIN / "engines" / "megatron.py"))
    assert "deepspeed" in _imports(TRAIN / "engines" / "deepspeed.py")


def _raw(**changes) -> dict:
    raw = json.loads(MEGATRON_CONFIG.read_text())
    for key, value in changes.items():
        node = raw
        *path, last = key.split("__")
        for part in path:
            node = node[int(part)] if isinstance(node, list) else node[part]
        node[last] = value
    return raw


def _check(raw: dict, world: int | None = 2) -> None:
    megatron.check(raw, parse_job(raw), world)


def test_the_shipped_megatron_config_passes_its_checks():
    _check(_raw())
    assert parse_job(_raw()).engine == "megatron"


@pytest.mark.parametrize("change, message", [
    (dict(optimizer__params={"lr": 4e-3, "gama": 0.1}),
     "optimizer.params.gama: not a parameter of VRLamb (type 'VRLamb'); did you mean 'gamma'?"),
    (dict(optimizer__type="VRLam"), "optimizer.type: 'VRLam' is not a VRGD optimizer; did you mean 'VRLamb'?"),
    (dict(megatron__model__num_layer=2), "megatron.model.num_layer: Extra inputs are not permitted; did you mean "
                                         "'num_layers'?"),
    (dict(megatron__tensor_parallel_size=2), "megatron.tensor_parallel_size: Extra inputs are not permitted; did you "
                                             "mean 'tensor_model_parallel_size'?"),
    (dict(megatron__precision="fp8"), "megatron.precision: Input should be 'fp32', 'bf16' or 'fp16'"),
    (dict(zero_optimization={"stage": 2}), "zero_optimization: not a key of a megatron-engine config"),
    (dict(job__model={"size": "tiny"}), "job.model: describes the BERT of the deepspeed engine"),
    (dict(megatron__tensor_model_parallel_size=3), "megatron.model.num_attention_heads: 4 heads do not split over "
                                                   "tensor_model_parallel_size 3"),
    (dict(megatron__model__num_layers=3, megatron__pipeline_model_parallel_size=2),
     "megatron.model.num_layers: 3 layers do not split into pipeline_model_parallel_size 2 stages"),
    # before: accepted, then Megatron's assertion from every rank when the model was built
    (dict(megatron__tensor_model_parallel_size=2, megatron__model__vocab_size=2049),
     "megatron.model.vocab_size: 2049 does not split over tensor_model_parallel_size 2"),
    (dict(megatron__tensor_model_parallel_size=2, megatron__model__ffn_hidden_size=129),
     "megatron.model.ffn_hidden_size: 129 does not split over tensor_model_parallel_size 2"),
    # before: accepted and ignored (Megatron's DDP drops the bucket size without overlap)
    (dict(megatron__bucket_size=1000), "megatron.bucket_size: Megatron's DDP buckets gradients only with "
                                       "megatron.overlap_grad_reduce true"),
    # before: accepted, and the resume fell back to "require" without a word
    (dict(checkpoint={"optimizer_states": "reset_if_incompatible"}),
     "checkpoint.optimizer_states: the megatron engine's checkpoint block has the keys optimizer_state, data_change; "
     "did you mean 'optimizer_state'?"),
])
def test_a_megatron_config_error_names_the_key(change, message):
    with pytest.raises(ConfigError) as e:
        _check(_raw(**change))
    assert message in str(e.value)


def test_embeddings_tied_across_stages_need_the_gsnr_off_for_them():
    """A GPT tied across 2 stages with VRLamb is refused before any work, naming
    megatron.tied_across_stages; with that set to "gsnr_off", with the base optimizer, or on one
    stage, it passes."""
    tied = dict(megatron__model__share_embeddings_and_output_weights=True, megatron__pipeline_model_parallel_size=2)
    with pytest.raises(ConfigError, match=r'megatron.model.share_embeddings_and_output_weights: with 2 pipeline '
                                          r'stages .* set megatron.tied_across_stages to "gsnr_off"'):
        _check(_raw(**tied))
    _check(_raw(**tied, megatron__tied_across_stages="gsnr_off"))
    _check(_raw(**tied, optimizer__type="Lamb"))
    _check(_raw(megatron__model__share_embeddings_and_output_weights=True))
    with pytest.raises(ConfigError, match=r"megatron.tied_across_stages: Input should be 'refuse' or 'gsnr_off'"):
        _check(_raw(megatron__tied_across_stages="off"))


def test_model_chunks_per_stage_are_checked_against_the_stages_layers_and_micro_batches():
    """``megatron.virtual_pipeline_model_parallel_size``: refused on one stage, with layers that do not
    split into stages × chunks, and where a phase's micro-batches per data-parallel rank are not a
    multiple of the stages (Megatron's interleaved schedule would raise at the first step); 4
    layers over 2 stages of 2 chunks with 8 micro-batches pass."""
    chunks = dict(megatron__model__num_layers=4, megatron__pipeline_model_parallel_size=2,
                  megatron__virtual_pipeline_model_parallel_size=2)
    _check(_raw(**chunks))  # 2 ranks, PP 2: DP 1, 32 = 4 × 8 micro-batches
    with pytest.raises(ConfigError, match=r"megatron.virtual_pipeline_model_parallel_size: model chunks interleave "
                                          r"pipeline stages, and pipeline_model_parallel_size is 1"):
        _check(_raw(megatron__virtual_pipeline_model_parallel_size=2))
    with pytest.raises(ConfigError, match=r"megatron.model.num_layers: 2 layers do not split into 2 stages × 2 model "
                                          r"chunks"):
        _check(_raw(**{**chunks, "megatron__model__num_layers": 2}))
    with pytest.raises(ConfigError, match=r"job.phases\[0\].global_batch: 12 gives 3 micro-batches of 4 per "
                                          r"data-parallel rank, .* groups of pipeline_model_parallel_size 2"):
        _check(_raw(**chunks, job__phases__0__global_batch=12))
    with pytest.raises(ConfigError, match=r"virtual_pipeline_model_parallel_size: Input should be greater than or "
                                          r"equal to 2"):
        _check(_raw(**{**chunks, "megatron__virtual_pipeline_model_parallel_size": 1}))


class _Chunk:
    """A model chunk that records the dropout seed each forward runs under."""

    def __init__(self) -> None:
        self.seeds: list[int] = []

    def __call__(self, tokens, position, mask, labels=None):
        import torch

        self.seeds.append(torch.initial_seed())
        return tokens.float().sum()


def _interleaved(forward_step_func, data_iterator, model, num_microbatches, seq_length, micro_batch_size,
                 forward_only):
    """Megatron's interleaved order on one stage: each chunk's micro-batches in groups of PP = 2,
    the loss of the last chunk's in micro-batch order (``forward_backward_pipelining_with_interleaving``)."""
    assert num_microbatches % 2 == 0, num_microbatches  # what megatron-core 0.16.1 raises on
    out = []
    for group in range(0, num_microbatches, 2):
        for v, chunk in enumerate(model):
            for _ in range(2):
                output, loss = forward_step_func(data_iterator[v], chunk)
                if v == len(model) - 1:
                    out.append(loss(output)[1])
    return out


def _chunked_engine() -> megatron.MegatronEngine:
    import torch

    engine = object.__new__(megatron.MegatronEngine)  # the schedule's side only: no process group
    engine.block = megatron.parse_block(_raw(megatron__model__num_layers=4, megatron__pipeline_model_parallel_size=2,
                                             megatron__virtual_pipeline_model_parallel_size=2))
    engine.device, engine.seq_len, engine.micro_batch = torch.device("cpu"), 4, 2
    engine.chunks, engine.forward_backward = [_Chunk(), _Chunk()], _interleaved
    return engine


def test_model_chunks_take_dropout_seeds_of_their_own_the_same_at_every_run():
    """Chunk 0 of a micro-batch runs under the micro-batch's seed (as one chunk a stage does), chunk
    v > 0 under a hash of the two: every chunk of every micro-batch apart, the same again on a
    second run (a resume's), whatever order the interleaved schedule runs them in."""
    import torch

    from vrgd_ds.train.seeds import hashed_seed

    engine = _chunked_engine()
    batch = {"tokens": torch.ones(2, 4, dtype=torch.long), "labels": torch.ones(2, 4, dtype=torch.long)}
    seeds = [101, 102, 103, 104]
    for _ in range(2):
        engine._run(iter([batch] * 4), 4, False, lambda b, out: (out, {}), seeds)
    first, second = engine.chunks
    assert first.seeds == seeds * 2 and second.seeds == [hashed_seed(s, 1) for s in seeds] * 2
    assert len(set(first.seeds + second.seeds)) == 8


def test_an_evaluation_pass_over_model_chunks_is_padded_to_the_stages_and_counts_its_windows_only():
    """3 micro-batches over 2 stages of chunks: the schedule gets 4 (a repeat of the first), and the
    loss function sees the 3, in order."""
    import torch

    engine = _chunked_engine()
    items = [{"tokens": torch.full((2, 4), i), "labels": torch.full((2, 4), i)} for i in range(3)]
    seen = []
    engine._forward_only(items, lambda b, out: (seen.append(int(b["tokens"][0, 0])), (out, {}))[1])
    assert seen == [0, 1, 2] and len(engine.chunks[0].seeds) == 4


def test_a_megatron_key_the_config_lacks_is_set_from_the_command_line_and_a_misspelt_one_named():
    """``--set megatron.virtual_pipeline_model_parallel_size=2`` on a config without the key: --set's
    guard took it for a misspelling of pipeline_model_parallel_size and refused it (fails on the old
    code); the megatron block is checked by name where it is read, so a misspelt key still stops
    there, naming the close one."""
    from vrgd_ds.train.config import apply_overrides

    raw = apply_overrides(_raw(megatron__model__num_layers=4, megatron__pipeline_model_parallel_size=2),
                          ["megatron.virtual_pipeline_model_parallel_size=2"])
    _check(raw)
    assert megatron.parse_block(raw).virtual_pipeline_model_parallel_size == 2
    with pytest.raises(ConfigError, match=r"megatron.pipeline_model_paralel_size: Extra inputs are not permitted; "
                                          r"did you mean 'pipeline_model_parallel_size'\?"):
        _check(apply_overrides(_raw(), ["megatron.pipeline_model_paralel_size=2"]))


def test_a_resume_that_changes_the_gpts_tie_is_refused(tmp_path):
    """The output layer does not carry over between a tied and an untied GPT (dist-checkpointing
    would drop the saved one, or leave the built one fresh), so a resume across that change stops
    naming the key; a marker without the record holds an untied GPT."""
    from vrgd_ds.train.resume import tie_change

    tie_change(tmp_path, {"engine": "megatron", "share_embeddings_and_output_weights": True}, True)
    tie_change(tmp_path, {"engine": "megatron"}, False)
    for saved, now in (({"engine": "megatron"}, True), ({"engine": "megatron",
                                                         "share_embeddings_and_output_weights": True}, False)):
        with pytest.raises(ConfigError, match=r"saved with megatron.model.share_embeddings_and_output_weights "
                                              rf"{str(not now).lower()}, this configuration builds {str(now).lower()}"):
            tie_change(tmp_path, saved, now)


def test_parallel_sizes_and_batch_arithmetic_are_checked_against_the_ranks():
    with pytest.raises(ConfigError, match=r"megatron.tensor_model_parallel_size × pipeline_model_parallel_size = "
                                          r"4 × 1 does not divide the 2 ranks"):
        _check(_raw(megatron__tensor_model_parallel_size=4), world=2)
    # 32 sequences = micro-batch 4 × accumulation × 3 data-parallel ranks cannot hold
    with pytest.raises(ConfigError, match=r"job\.phases\[0\]\.global_batch: 32 is not divisible by micro_batch x "
                                          r"ranks = 4 x 3.*data-parallel ranks: 6 ranks / \(TP 2 × PP 1\)"):
        _check(_raw(megatron__tensor_model_parallel_size=2), world=6)
    _check(_raw(megatron__tensor_model_parallel_size=2), world=4)  # DP 2: 32 = 4 × 4 × 2
    _check(_raw(), world=None)  # ranks not known yet: the layout's checks wait for the process group


def test_the_job_exits_2_on_a_megatron_config_error_before_any_work(tmp_path, capsys, monkeypatch):
    """What a user sees for the typo the DeepSpeed job names: exit 2, the key, a close match, and
    nothing made (no process group, no run directory). Before the Megatron job ran through the
    spine it ended in ``TypeError: VRLamb.__init__() got an unexpected keyword argument 'gama'``
    from every rank, exit 1."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = tmp_path / "gpt.json"
    config.write_text(json.dumps(_raw(optimizer__params={"lr": 4e-3, "gama": 0.1})))
    run_dir = tmp_path / "run"
    assert loop.main(["--config", str(config), "--run-dir", str(run_dir)]) == loop.EXIT_CONFIG
    err = capsys.readouterr().err
    assert "optimizer.params.gama: not a parameter of VRLamb" in err and "did you mean 'gamma'?" in err
    assert not run_dir.exists()


def test_an_unknown_engine_is_named():
    raw = _raw(job__engine="megatron-lm")
    with pytest.raises(ConfigError, match=r"job\.engine: Input should be 'deepspeed' or 'megatron'"):
        parse_job(raw)


def test_the_megatron_engine_names_a_missing_or_other_megatron_core(monkeypatch):
    """Without the ``megatron`` extra, or with another megatron-core release, the job stops before
    any work naming the install (instead of an import traceback from every rank)."""
    from vrgd_ds.megatron import internals

    def absent():
        raise ImportError("no megatron")

    monkeypatch.setattr(internals, "version", absent)
    with pytest.raises(ConfigError, match=r"job\.engine 'megatron': vrgd_ds\.megatron needs megatron-core: pip install "
                                          r"'vrgd-ds\[megatron\]'"):
        megatron.MegatronEngine.check_config(_raw(), parse_job(_raw()))
    monkeypatch.setattr(internals, "version", lambda: "0.15.0")
    with pytest.raises(ConfigError, match=r"supports megatron-core 0\.16\.1, found 0\.15\.0"):
        megatron.MegatronEngine.check_config(_raw(), parse_job(_raw()))


BERT_CONFIG = ROOT / "configs" / "bert_tiny_cpu_vr_lamb.json"


@pytest.mark.parametrize("config, sets, said", [
    (BERT_CONFIG, ["job.phases.1.micro_batch=32"], "job.phases[1].global_batch: 32 in micro-batches of 32 gives a "
                                                   "step of 1 gradient group(s)"),
    (MEGATRON_CONFIG, ["job.phases.0.micro_batch=32"], "job.phases[0].global_batch: 32 in micro-batches of 32"),
    (BERT_CONFIG, ["job.phases.1.micro_batch=32", "optimizer.params.gsnr=false"], None),
])
def test_a_phase_of_one_gradient_group_is_refused_before_any_work(tmp_path, capsys, monkeypatch, config, sets,
                                                                   said):
    """A step's gradient groups are ``global_batch / micro_batch`` (ranks × micro-steps) on any
    number of ranks, and the GSNR needs two. The engine checked only the batch it starts with, so
    a later phase of one group (the BERT config's seq-128 phase in micro-batches of 32) was
    accepted and the run crashed when that phase began, hours in, with a bare RuntimeError and on
    every resume too. The job now exits 2 before any work, naming the phase (fails on the old
    code); with the GSNR off one group is fine."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    run_dir = tmp_path / "run"
    if said is None:
        from vrgd_ds.train.config import check_gsnr_groups, load_config

        check_gsnr_groups(*load_config(config, sets))
        return
    args = ["--config", str(config), "--run-dir", str(run_dir), *[a for s in sets for a in ("--set", s)]]
    assert loop.main(args) == loop.EXIT_CONFIG
    err = capsys.readouterr().err
    assert said in err and "and the GSNR needs >= 2" in err, err
    assert not run_dir.exists()


@pytest.mark.parametrize("config", [BERT_CONFIG, MEGATRON_CONFIG], ids=["deepspeed", "megatron"])
def test_an_optimizer_lr_other_than_the_first_phases_is_refused_naming_the_phases_key(tmp_path, capsys, config):
    """The job sets every group's LR from its phases before each step, so ``optimizer.params.lr``
    only builds the optimizer: an LR sweep by ``--set optimizer.params.lr=...`` trained every run
    alike. One other than ``job.phases[0].lr`` is refused before any work, on both engines (and by
    ``--check-resume``: tests/unit/test_check_resume.py); the same value, or none, is accepted.
    Fails on the old code, which accepted it and said nothing."""
    from vrgd_ds.train.config import check_optimizer_lr, load_config

    lr = json.loads(config.read_text())["job"]["phases"][0]["lr"]
    run_dir = tmp_path / "run"
    args = ["--config", str(config), "--run-dir", str(run_dir), "--set", f"optimizer.params.lr={lr * 2}"]
    assert loop.main(args) == loop.EXIT_CONFIG
    err = capsys.readouterr().err
    assert f"optimizer.params.lr: {lr * 2:g} has no effect" in err and f"job.phases[0].lr is {lr:g}" in err, err
    assert "--set optimizer.params.lr=X beside it" in err  # how a sweep of the phases' LR is written
    assert not run_dir.exists()
    for value in (lr, None):  # the same LR, or none (the member's default builds the optimizer)
        check_optimizer_lr(*load_config(config, [f"optimizer.params.lr={json.dumps(value)}"]))


def test_a_deepspeed_batch_that_does_not_split_over_the_launchers_ranks_is_refused_before_any_work(
        tmp_path, capsys, monkeypatch):
    """Phase 0's batch of 64 in micro-batches of 8 does not split over 3 ranks. The DeepSpeed
    engine's ``check_for_ranks`` refuses it, and the job refuses it with the launcher's world size
    before the process group, the run directory or the watchdog exist (as the Megatron engine
    did). Fails on the old code: the DeepSpeed engine checked the split only in ``Job.setup``,
    after the process group and the run directory's lock."""
    from vrgd_ds.train.config import load_config
    from vrgd_ds.train.engines import engine_class

    raw, job = load_config(BERT_CONFIG)
    with pytest.raises(ConfigError, match=r"job.phases\[0\].global_batch: 64 is not divisible by micro_batch x ranks"):
        engine_class("deepspeed").check_for_ranks(raw, job, 3)
    engine_class("deepspeed").check_for_ranks(raw, job, 2)
    monkeypatch.setenv("WORLD_SIZE", "3")
    run_dir = tmp_path / "run"
    assert loop.main(["--config", str(BERT_CONFIG), "--run-dir", str(run_dir)]) == loop.EXIT_CONFIG
    assert "64 is not divisible by micro_batch x ranks = 8 x 3" in capsys.readouterr().err
    assert not run_dir.exists()


def test_an_adaptive_phase_without_the_statistics_is_refused_before_any_work():
    """``adaptive_batch`` with ``optimizer.params.gsnr`` false is refused from the config
    (``check_gsnr_groups``), not after the engine and the optimizer are built. Fails on the old
    code, which refused it in ``Job.setup`` only."""
    from vrgd_ds.train.config import ADAPTIVE_NEEDS_GSNR, check_gsnr_groups, load_config

    config = ROOT / "configs" / "bert_large_adaptive_8k_128k_vr_lamb.json"
    check_gsnr_groups(*load_config(config))
    with pytest.raises(ConfigError) as e:
        check_gsnr_groups(*load_config(config, ["optimizer.params.gsnr=false"]))
    assert str(e.value) == ADAPTIVE_NEEDS_GSNR and "job.phases[*].adaptive_batch needs" in str(e.value)


def test_a_deepspeed_scheduler_block_is_refused_naming_the_phases_keys(tmp_path, capsys):
    """The job sets the LR from its phases before every step, over any DeepSpeed scheduler's,
    which DeepSpeed still builds, steps and checkpoints (OneCycle also rewrites the betas): a
    ``scheduler`` block had no effect on the LR and said nothing. It is refused before any work,
    naming the keys that set the LR. Fails on the old code."""
    raw = json.loads(BERT_CONFIG.read_text())
    raw["scheduler"] = {"type": "WarmupDecayLR", "params": {"total_num_steps": 100, "warmup_max_lr": 0.1}}
    config = tmp_path / "bert.json"
    config.write_text(json.dumps(raw))
    assert loop.main(["--config", str(config), "--run-dir", str(tmp_path / "run")]) == loop.EXIT_CONFIG
    err = capsys.readouterr().err
    assert "scheduler: the job sets the learning rate from its phases (job.phases[*].lr" in err, err
    assert not (tmp_path / "run").exists()
