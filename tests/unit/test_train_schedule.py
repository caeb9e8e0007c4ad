"""The job's LR schedule, phase split, overrides and model/tokenizer check (exact numbers)."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
from pydantic import ValidationError

from vrgd_ds.train.config import ConfigError, JobConfig, ModelConfig, apply_overrides, load_config
from vrgd_ds.train.model import bert_config
from vrgd_ds.train.schedule import PhaseSchedule

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def job(total: int = 10) -> JobConfig:
    return JobConfig.model_validate({
        "total_steps": total,
        "phases": [
            {"seq_len": 128, "fraction": 0.9, "global_batch": 64, "micro_batch": 8, "lr": 6e-3,
             "warmup_fraction": 0.5, "decay_power": 0.5},
            {"seq_len": 512, "fraction": 0.1, "global_batch": 32, "micro_batch": 4, "lr": 4e-3,
             "warmup_fraction": 0.0, "decay_power": 1.0},
        ]})


def test_phase_steps_add_up_and_follow_the_fractions():
    assert job(10).phase_steps() == [9, 1]
    assert job(8601).phase_steps() == [7741, 860]
    assert sum(job(7).phase_steps()) == 7


def test_lr_warmup_then_polynomial_decay_per_phase():
    s = PhaseSchedule(job(10))  # phase 1: 9 steps, warmup 0.5 x 9 = 4.5 -> 5 whole steps; phase 2: 1 step
    assert [s.phase_of(t) for t in (0, 8, 9)] == [(0, 0), (0, 8), (1, 0)]
    assert s.lr(0) == pytest.approx(6e-3 * 1 / 5)
    assert s.lr(3) == pytest.approx(6e-3 * 4 / 5)
    assert s.lr(4) == 6e-3  # the last warmup step reaches the peak exactly
    assert s.lr(5) == 6e-3  # the decay starts from the peak
    assert s.lr(8) == pytest.approx(6e-3 * (1 - 3 / 4) ** 0.5)
    assert s.lr(9) == pytest.approx(4e-3)  # no warmup: the phase starts at its peak
    assert all(s.lr(t) > 0 for t in range(10))


def _assert_never_above_peak(cfg: JobConfig) -> None:
    s = PhaseSchedule(cfg)
    seen = [0.0] * len(cfg.phases)
    for t in range(cfg.total_steps):
        i, _ = s.phase_of(t)
        lr = s.lr(t)
        assert 0 < lr <= cfg.phases[i].lr, (t, i, lr, cfg.phases[i].lr)
        seen[i] = max(seen[i], lr)
    assert seen == [p.lr for p in cfg.phases]  # and each phase reaches its peak


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.json")), ids=lambda p: p.name)
def test_no_config_schedule_exceeds_its_peak(path):
    """Fails on the schedule with a fractional warmup (peak·(t+1)/w with w = fraction·T):
    bert_tiny_cpu_test.json's phase 0 reached 2.0x its peak, the demo config 1.032x and 1.071x,
    bert_large_64k_32k_*'s phase 2 1.0047x."""
    _assert_never_above_peak(load_config(path)[1])


def test_random_phase_lengths_never_exceed_the_peak():
    rng = random.Random(0)
    checked = 0
    for _ in range(300):
        fractions = [rng.uniform(0.05, 1.0) for _ in range(rng.randint(1, 3))]
        fractions = [f / sum(fractions) for f in fractions]
        fractions[-1] = 1.0 - sum(fractions[:-1])
        total = rng.randint(len(fractions) * 3, 400)
        phases = [{"seq_len": 128, "fraction": f, "global_batch": 8, "micro_batch": 8, "lr": rng.uniform(1e-4, 1e-1),
                   "warmup_fraction": rng.choice([0.0, rng.uniform(0.0, 0.99)]),
                   "decay_power": rng.uniform(0.1, 2.0)} for f in fractions]
        try:
            cfg = JobConfig.model_validate({"total_steps": total, "phases": phases})
        except ValidationError as exc:  # a phase left without a step: not a schedule to check
            assert "step" in str(exc), exc
            continue
        _assert_never_above_peak(cfg)
        checked += 1
    assert checked >= 250, checked  # 292 of the 300 draws make a schedule


def test_overrides_set_nested_keys_and_name_a_missing_one():
    raw = {"job": {"total_steps": 5, "phases": [{"lr": 1.0}]}}
    out = apply_overrides(raw, ["job.total_steps=7", "job.phases.0.lr=0.5", "job.seed=3"])
    assert out["job"] == {"total_steps": 7, "phases": [{"lr": 0.5}], "seed": 3}
    assert raw["job"]["total_steps"] == 5
    with pytest.raises(ConfigError, match="no key 'job.model'"):
        apply_overrides(raw, ["job.model.size=tiny"])


@pytest.mark.parametrize("item, message", [
    ("job.phases.5.lr=1", r"--set job.phases.5.lr: 'job.phases' has 1 entries \(0..0\); there is no job.phases.5"),
    ("job.phases.x.lr=1", r"--set job.phases.x.lr: 'job.phases' is a list; 'x' is not an index \(0..0\)"),
    ("job.total_steps.foo=1", r"--set job.total_steps.foo: 'job.total_steps' is a value \(5\), not an object"),
    ("job.phases.1=2", r"there is no job.phases.1"),
])
def test_bad_override_paths_name_the_key(item, message):
    """Fails on the code that indexed blindly: these raised a raw IndexError, ValueError and
    TypeError."""
    raw = {"job": {"total_steps": 5, "phases": [{"lr": 1.0}]}}
    with pytest.raises(ConfigError, match=message):
        apply_overrides(raw, [item])


def test_model_vocab_must_match_the_tokenizer():
    assert bert_config(ModelConfig(size="tiny"), 2000, 128).vocab_size == 2000
    with pytest.raises(ConfigError, match="job.model.vocab_size: 3000 does not match the tokenizer's 2000"):
        bert_config(ModelConfig(size="tiny", vocab_size=3000), 2000, 128)
    with pytest.raises(ConfigError, match="job.model.overrides.hidden_sise: not a BertConfig field"):
        bert_config(ModelConfig(size="tiny", overrides={"hidden_sise": 3}), 2000, 128)
