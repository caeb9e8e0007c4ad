"""Every file in ``configs/`` is a runnable job config: it validates, its DeepSpeed part builds
for the world sizes it is meant for, the optimizer accepts its parameters, GSNR gets n >= 2
groups, the LAMB/VR-LAMB pairs differ only in the GSNR switch, and the BERT-large figures equal
both NVIDIA's recipe / the derivations and the table in ``configs/README.md``. Plus the errors
``vrgd_ds/train/config.py`` gives for bad configs, each naming the key."""
from __future__ import annotations

import copy
import inspect
import json
import math
import re
from pathlib import Path

import pytest
import torch

import vrgd_ds
from vrgd_ds.train.config import ConfigError, deepspeed_config, gradient_accumulation, load_config, parse_job

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
ALL = sorted(CONFIGS.glob("*.json"))
LARGE = [p for p in ALL if p.name.startswith("bert_large_")]
TINY = [p for p in ALL if p.name.startswith("bert_tiny_cpu_")]
NODES = (1, 2, 4, 8, 16)  # of 8-GPU DGX-A100 nodes
K = 1024

# NVIDIA DeepLearningExamples PyTorch/LanguageModeling/BERT/scripts/configs/pretrain_config.sh,
# dgxa100_8gpu_fp16: 8192 x 8 GPUs = 65536 (micro-batch 64 x 128 accumulation steps) at seq 128,
# 4096 x 8 = 32768 (16 x 256) at seq 512.
RECIPE_64K = dict(p1_batch=64 * K, p1_steps=7038, p1_lr=6e-3, p1_warmup=0.2843,
                  p2_batch=32 * K, p2_steps=1563, p2_lr=4e-3, p2_warmup=0.128)


def derived(p1_batch: int, p2_batch: int) -> dict:
    """The derivation of configs/README.md: the 64k/32k recipe's samples per phase (steps scale
    inversely with the global batch, rounded to the nearest step), peak LR by the square-root
    rule of You et al. (2019) rounded to 3 significant digits, the same warmup shares."""
    r = RECIPE_64K
    lr = lambda base, b, b0: float(f"{base * math.sqrt(b / b0):.3g}")  # noqa: E731
    return dict(p1_batch=p1_batch, p1_steps=round(r["p1_steps"] * r["p1_batch"] / p1_batch),
                p1_lr=lr(r["p1_lr"], p1_batch, r["p1_batch"]), p1_warmup=r["p1_warmup"],
                p2_batch=p2_batch, p2_steps=round(r["p2_steps"] * r["p2_batch"] / p2_batch),
                p2_lr=lr(r["p2_lr"], p2_batch, r["p2_batch"]), p2_warmup=r["p2_warmup"])


EXPECTED = {"64k_32k": RECIPE_64K, "96k_32k": derived(96 * K, 32 * K), "128k_64k": derived(128 * K, 64 * K)}


def figures(path: Path) -> dict:
    raw, job = load_config(path)
    (s1, s2), (p1, p2) = job.phase_steps(), job.phases
    return dict(p1_batch=p1.global_batch, p1_steps=s1, p1_lr=p1.lr, p1_warmup=p1.warmup_fraction,
                p2_batch=p2.global_batch, p2_steps=s2, p2_lr=p2.lr, p2_warmup=p2.warmup_fraction)


def world_sizes(path: Path) -> list[int]:
    return [8 * n for n in NODES] if path in LARGE else [2]


def test_the_expected_configs_exist():
    names = {p.name for p in ALL}
    for batches in EXPECTED:
        assert {f"bert_large_{batches}_vr_lamb.json", f"bert_large_{batches}_lamb.json"} <= names
    assert {"bert_tiny_cpu_vr_lamb.json", "bert_tiny_cpu_lamb.json", "bert_tiny_cpu_test.json"} <= names


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.name)
def test_config_validates_and_its_deepspeed_part_builds(path, monkeypatch):
    """load_config accepts it; for every intended world size each phase's DeepSpeed config passes
    DeepSpeed's own batch arithmetic (train_batch = micro x accumulation x world)."""
    from deepspeed.runtime import config as ds_config

    raw, job = load_config(path)
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda: 0)
    for world in world_sizes(path):
        mpu = type("DataParallel", (), {"get_data_parallel_world_size": staticmethod(lambda w=world: w)})()
        for i, phase in enumerate(job.phases):
            ds = deepspeed_config(raw, phase, world, i)
            built = ds_config.DeepSpeedConfig(ds, mpu=mpu)
            assert built.world_size == world
            assert built.train_batch_size == phase.global_batch
            assert built.train_micro_batch_size_per_gpu == phase.micro_batch
            assert built.gradient_accumulation_steps * phase.micro_batch * world == phase.global_batch
            assert built.zero_optimization_stage == raw["zero_optimization"]["stage"]


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.name)
def test_optimizer_params_are_accepted_by_the_class(path):
    raw, _ = load_config(path)
    info = vrgd_ds.REGISTRY[raw["optimizer"]["type"]]
    params = raw["optimizer"]["params"]
    accepted = set(inspect.signature(info.cls).parameters) - {"params"}
    assert set(params) <= accepted, f"{path.name}: {sorted(set(params) - accepted)} not in {sorted(accepted)}"
    info.cls([torch.nn.Parameter(torch.zeros(3))], **params)  # values pass the class's own checks


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.name)
def test_gsnr_gets_at_least_two_groups_per_step(path):
    """n = ranks x accumulation steps under ZeRO-2/3 (ranks under stage 0/1); the optimizer
    refuses a step with n < 2."""
    raw, job = load_config(path)
    stage = raw["zero_optimization"]["stage"]
    for world in world_sizes(path):
        for i, phase in enumerate(job.phases):
            gas = gradient_accumulation(phase, world, i)
            n = world * gas if stage >= 2 else world
            assert n >= 2, (path.name, world, i, n)


@pytest.mark.parametrize("batches", EXPECTED)
def test_large_configs_carry_the_recipe_figures(batches):
    """64k/32k: NVIDIA's DGX-A100 recipe; 96k/32k and 128k/64k: derived from it (see derived())."""
    for opt in ("vr_lamb", "lamb"):
        path = CONFIGS / f"bert_large_{batches}_{opt}.json"
        assert figures(path) == EXPECTED[batches], path.name
        raw, job = load_config(path)
        assert [(p.seq_len, p.micro_batch, p.decay_power) for p in job.phases] == [(128, 64, 0.5), (512, 16, 0.5)]
        assert job.model.size == "large"
        assert raw["optimizer"]["params"]["weight_decay"] == 0.01
        assert raw["optimizer"]["params"]["lr"] == job.phases[0].lr
        assert raw["gradient_clipping"] == 1.0
        assert raw["zero_optimization"]["stage"] == 2
        assert raw["fp16"]["enabled"] and raw["fp16"].get("loss_scale", 0) == 0  # dynamic loss scale


def test_derived_runs_see_the_64k_recipe_samples_per_phase():
    r = RECIPE_64K
    for f in EXPECTED.values():
        for p in ("p1", "p2"):
            samples, ref = f[f"{p}_steps"] * f[f"{p}_batch"], r[f"{p}_steps"] * r[f"{p}_batch"]
            assert abs(samples - ref) <= f[f"{p}_batch"] / 2


@pytest.mark.parametrize("batches", [*EXPECTED, "tiny_cpu"])
def test_lamb_and_vr_lamb_differ_only_in_the_gsnr_switch(batches):
    """The baseline is VRLamb with gsnr=false (our LAMB, exact under ZeRO), not DeepSpeed's "Lamb"
    (FusedLamb on GPUs): the pair of files is the same but for the GSNR parameters."""
    prefix = "bert_tiny_cpu" if batches == "tiny_cpu" else f"bert_large_{batches}"
    vr = json.loads((CONFIGS / f"{prefix}_vr_lamb.json").read_text())
    lamb = json.loads((CONFIGS / f"{prefix}_lamb.json").read_text())
    assert vr["optimizer"]["type"] == lamb["optimizer"]["type"] == "VRLamb"
    p_vr, p_lamb = vr["optimizer"].pop("params"), lamb["optimizer"].pop("params")
    assert vr == lamb
    assert p_lamb.pop("gsnr") is False and p_vr.get("gsnr", True) is True
    assert (p_vr.pop("gamma"), p_vr.pop("beta3"), p_vr.pop("gsnr_placement")) == (0.1, 0.9, "first_moment")
    assert p_vr == p_lamb


@pytest.mark.parametrize("path", TINY, ids=lambda p: p.name)
def test_tiny_configs_run_on_two_cpu_ranks(path):
    raw, job = load_config(path)
    assert job.model.size == "tiny"
    assert "fp16" not in raw and "bf16" not in raw  # fp32 on CPU
    assert raw["zero_optimization"]["stage"] == 2
    assert job.total_steps <= 300
    if path.name == "bert_tiny_cpu_test.json":
        assert job.total_steps <= 8 and 0 < job.checkpoint_every <= 4 and 0 < job.eval_every <= 4
        assert all(s >= 1 for s in job.phase_steps())


def readme_table() -> dict[str, dict]:
    """The figures table of configs/README.md, keyed by config file name."""
    rows = {}
    cols = ("p1_batch", "p1_steps", "p1_lr", "p1_warmup", "p2_batch", "p2_steps", "p2_lr", "p2_warmup", "total")
    for line in (CONFIGS / "README.md").read_text().splitlines():
        m = re.match(r"\|\s*`(bert_large_\w+\.json)`\s*\|(.*)\|", line)
        if not m:
            continue
        cells = [c.strip() for c in m.group(2).split("|")]
        if len(cells) < len(cols) or not re.fullmatch(r"[\d,]+", cells[0]):
            continue
        rows[m.group(1)] = {c: float(v.replace(",", "")) for c, v in zip(cols, cells)}
    return rows


@pytest.mark.parametrize("path", [p for p in ALL if "adaptive" in p.name], ids=lambda p: p.name)
def test_adaptive_configs_build_their_controller_on_every_world_size(path):
    """The batch stays a multiple of micro-batch x ranks (only the accumulation changes) and
    the phase keeps the recipe's samples."""
    from vrgd_ds.train.config import controller_settings, phase_samples

    _, job = load_config(path)
    for world in world_sizes(path):
        for i, phase in enumerate(job.phases):
            if phase.adaptive_batch is not None:
                st = controller_settings(phase, world, i, job.phase_steps()[i])
                assert st.granularity == phase.micro_batch * world and st.max_batch % st.granularity == 0
    assert phase_samples(job)[0] == RECIPE_64K["p1_steps"] * RECIPE_64K["p1_batch"]


def test_readme_states_the_figures_the_configs_use():
    table = readme_table()
    assert set(table) == {p.name for p in LARGE}
    for path in LARGE:
        f = figures(path)
        row = table[path.name]
        assert row.pop("total") == f["p1_steps"] + f["p2_steps"], path.name
        assert row == pytest.approx({k: float(v) for k, v in f.items()}), path.name


# ---- bad configs: config.py names the key -------------------------------------------------------

def tiny_raw() -> dict:
    return json.loads((CONFIGS / "bert_tiny_cpu_test.json").read_text())


def test_unknown_job_key_is_named():
    raw = tiny_raw()
    raw["job"]["phases"][0]["warmup"] = 0.1
    with pytest.raises(ConfigError, match=r"job\.phases\.0\.warmup: Extra inputs are not permitted"):
        parse_job(raw)
    raw = tiny_raw()
    raw["job"]["modle"] = {"size": "tiny"}
    with pytest.raises(ConfigError, match=r"job\.modle"):
        parse_job(raw)


def test_fractions_must_sum_to_one():
    raw = tiny_raw()
    raw["job"]["phases"][1]["fraction"] = 0.4
    with pytest.raises(ConfigError, match=r"job\.phases\[\*\]\.fraction: the fractions sum to 0\.9, not 1"):
        parse_job(raw)


def test_global_batch_not_divisible_by_micro_batch_times_ranks_is_named():
    raw, job = load_config(CONFIGS / "bert_large_64k_32k_vr_lamb.json")
    with pytest.raises(ConfigError, match=r"job\.phases\[1\]\.global_batch: 32768 is not divisible by "
                                          r"micro_batch x ranks = 16 x 24"):
        deepspeed_config(raw, job.phases[1], 24, 1)
    raw = tiny_raw()
    raw["job"]["phases"][0]["micro_batch"] = 5
    with pytest.raises(ConfigError, match=r"job\.phases\[0\]\.global_batch: 16 is not a multiple of micro_batch 5"):
        parse_job(raw)


@pytest.mark.parametrize("key", ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"])
def test_batch_keys_at_top_level_are_rejected(key):
    raw = tiny_raw()
    raw[key] = 8
    with pytest.raises(ConfigError, match=f"'{key}' is derived per phase .* remove it"):
        parse_job(raw)


def test_override_of_a_config_file_is_validated(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(tiny_raw()))
    _, job = load_config(path, ["job.total_steps=3"])
    assert job.phase_steps() == [2, 1]
    with pytest.raises(ConfigError, match=r"job\.total_steps"):
        load_config(path, ["job.total_steps=0"])
    assert copy.deepcopy(tiny_raw()) == json.loads(path.read_text())  # the file itself is untouched


def test_every_key_of_the_job_blocks_has_its_docstring():
    """Every field of the ``"job"``, ``"megatron"`` and ``"vrgd"`` blocks' models carries its
    docstring as its description (docs/pretraining.md: one docstring per field), where a schema
    or an editor shows it. Fails on the code before: no field had a description (the docstrings
    were not read), and 23 had no docstring."""
    import pydantic

    from vrgd_ds.ds import config as ds_config
    from vrgd_ds.train import config as job_config
    from vrgd_ds.train.engines import megatron

    models = [cls for mod in (job_config, megatron, ds_config) for cls in vars(mod).values()
              if inspect.isclass(cls) and issubclass(cls, pydantic.BaseModel) and cls.__module__ == mod.__name__]
    assert {"JobConfig", "PhaseConfig", "MegatronBlock", "ReductionConfig"} <= {m.__name__ for m in models}
    missing = [f"{m.__name__}.{name}" for m in models for name, field in m.model_fields.items()
               if not (field.description or "").strip()]
    assert not missing, missing


def test_the_config_examples_of_docs_pretraining_load(tmp_path):
    """Each whole config shown in docs/pretraining.md (a JSON block with a ``"job"``) validates as
    the job reads it. Fails on the schema that capped every phase's ``seq_len`` at BERT's 512:
    the Megatron example's GPT context of 1,024 was refused."""
    text = (CONFIGS.parent / "docs" / "pretraining.md").read_text()
    examples = [json.loads(block) for block in re.findall(r"```json\n(.*?)```", text, re.S)
                if block.lstrip().startswith("{") and '"job"' in block]
    assert len(examples) >= 2
    for i, raw in enumerate(examples):
        path = tmp_path / f"example{i}.json"
        path.write_text(json.dumps(raw))
        _, job = load_config(path)
        assert job.phases and job.total_steps > 0
    assert {job.engine for job in (parse_job(raw) for raw in examples)} >= {"deepspeed", "megatron"}



def test_a_batch_of_full_length_samples_has_a_position_for_every_column():
    """``collate`` rounds a batch's width up to a multiple of 8, so a ``seq_len`` that is none
    (516) makes batches 520 wide: the model gets that many positions, and an override with fewer
    is refused naming the key. Fails on the old code: 516 positions, and the first full-length
    batch raised in the embeddings ("The size of tensor a (520) must match ... b (516)"); an
    override equal to ``seq_len`` (100) passed validation and raised there too."""
    from vrgd_ds.data_pipeline.samples import collate
    from vrgd_ds.train.model import bert_config

    raw = json.loads((CONFIGS / "bert_tiny_cpu_test.json").read_text())
    raw["job"]["phases"][1]["seq_len"] = 516
    job = parse_job(raw)
    sample = {k: torch.ones(516, dtype=torch.long) for k in ("input_ids", "token_type_ids", "attention_mask")}
    width = collate([dict(sample, labels=torch.full((516,), -100))])["input_ids"].shape[1]
    assert width == 520 and bert_config(job.model, 1000, 516).max_position_embeddings >= width
    raw["job"]["phases"][1]["seq_len"] = 100
    raw["job"]["model"] = dict(raw["job"].get("model", {}), overrides={"max_position_embeddings": 100})
    with pytest.raises(ConfigError, match=r"job\.model\.overrides\.max_position_embeddings: 100 .*\(104\)"):
        parse_job(raw)


@pytest.mark.parametrize("steps", [3, 12, 30000])
def test_the_warmup_fraction_hint_is_one_that_parses(steps):
    """A phase of ``steps`` steps whose warmup would fill it: the largest fraction the error names
    parses. Fails on the hint before, rounded up (0.6667 of 3 steps is still 3 warmup steps; "at
    most 1" for 30000, outside the key's range)."""
    raw = tiny_raw()
    raw["job"]["total_steps"] = steps
    raw["job"]["phases"] = [dict(raw["job"]["phases"][0], fraction=1.0, warmup_fraction=0.99999)]
    with pytest.raises(ConfigError, match="use a warmup_fraction of at most ") as e:
        parse_job(raw)
    hint = float(str(e.value).split("at most ")[1].split()[0])
    raw["job"]["phases"][0]["warmup_fraction"] = hint
    parse_job(raw)
