"""The job's LR schedule, phase split, overrides and model/tokenizer check (exact numbers)."""
from __future__ import annotations

import pytest

from vrgd_ds.train.config import ConfigError, JobConfig, ModelConfig, apply_overrides
from vrgd_ds.train.model import bert_config
from vrgd_ds.train.schedule import PhaseSchedule


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
    s = PhaseSchedule(job(10))  # phase 1: 9 steps, warmup 4.5 steps; phase 2: 1 step
    assert [s.phase_of(t) for t in (0, 8, 9)] == [(0, 0), (0, 8), (1, 0)]
    assert s.lr(0) == pytest.approx(6e-3 * 1 / 4.5)
    assert s.lr(3) == pytest.approx(6e-3 * 4 / 4.5)
    assert s.lr(5) == pytest.approx(6e-3 * (1 - 0.5 / 4.5) ** 0.5)
    assert s.lr(8) == pytest.approx(6e-3 * (1 - 3.5 / 4.5) ** 0.5)
    assert s.lr(9) == pytest.approx(4e-3)  # no warmup: the phase starts at its peak
    assert all(s.lr(t) > 0 for t in range(10))


def test_overrides_set_nested_keys_and_name_a_missing_one():
    raw = {"job": {"total_steps": 5, "phases": [{"lr": 1.0}]}}
    out = apply_overrides(raw, ["job.total_steps=7", "job.phases.0.lr=0.5", "job.seed=3"])
    assert out["job"] == {"total_steps": 7, "phases": [{"lr": 0.5}], "seed": 3}
    assert raw["job"]["total_steps"] == 5
    with pytest.raises(ConfigError, match="no key 'job.model'"):
        apply_overrides(raw, ["job.model.size=tiny"])


def test_model_vocab_must_match_the_tokenizer():
    assert bert_config(ModelConfig(size="tiny"), 2000, 128).vocab_size == 2000
    with pytest.raises(ConfigError, match="job.model.vocab_size: 3000 does not match the tokenizer's 2000"):
        bert_config(ModelConfig(size="tiny", vocab_size=3000), 2000, 128)
    with pytest.raises(ConfigError, match="job.model.overrides.hidden_sise: not a BertConfig field"):
        bert_config(ModelConfig(size="tiny", overrides={"hidden_sise": 3}), 2000, 128)
