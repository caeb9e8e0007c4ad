"""The small command lines (``python -m vrgd_ds.damping``, ``vrgd_ds.demo``, ``vrgd_ds.run``) on
arguments they cannot run with: one line naming the argument, exit 2, before any work. Each case
failed on the code before with a traceback (exit 1): a ValueError or ZeroDivisionError deep in
the run (after the damping table's header was printed), the optimizer's "GSNR needs at least 2
gradient groups" at its first step, or an ImportError from runpy."""
from __future__ import annotations

import sys

import pytest


@pytest.mark.parametrize("module, argv, words", [
    ("vrgd_ds.damping", ["--window", "0"], "--window must be in [1, --steps=300], got 0"),
    ("vrgd_ds.damping", ["--steps", "10", "--window", "20"], "--window must be in [1, --steps=10], got 20"),
    ("vrgd_ds.damping", ["--groups", "1"], "--groups must be at least 2 (the GSNR needs two gradient groups"),
    ("vrgd_ds.damping", ["--dim", "0"], "--dim must be at least 1, got 0"),
    ("vrgd_ds.demo", ["--micro-batches", "1"], "--micro-batches must be at least 2 (the GSNR needs two gradient"),
    ("vrgd_ds.demo", ["--micro-batch-size", "0"], "--micro-batch-size must be at least 1, got 0"),
    ("vrgd_ds.demo", ["--log-every", "0"], "--log-every must be at least 1, got 0"),
    ("vrgd_ds.demo", ["--steps", "-1"], "--steps must be at least 1, got -1"),
])
def test_bad_arguments_exit_2_naming_them_before_any_work(monkeypatch, capsys, module, argv, words):
    import importlib

    main = importlib.import_module(module).main
    monkeypatch.setattr(sys, "argv", [module, *argv])
    with pytest.raises(SystemExit) as stop:
        main()
    out, err = capsys.readouterr()
    assert stop.value.code == 2 and words in err and "Traceback" not in err, err
    assert out == ""  # nothing ran (the damping table's header came first before)


def test_damping_on_fewer_steps_than_the_default_window_averages_them_all(monkeypatch, capsys):
    """``--steps 10``: the window follows the steps (before, the default window of 100 refused it)."""
    from vrgd_ds import damping

    seen = {}
    monkeypatch.setattr(damping, "family_table", lambda **kw: seen.update(kw) or [("VRSGD", 0.5)])
    monkeypatch.setattr(sys, "argv", ["damping", "--steps", "10"])
    damping.main()
    assert seen["window"] == 10 and "| VRSGD | 0.500 |" in capsys.readouterr().out


def test_run_with_a_module_that_does_not_exist_exits_2(capsys):
    from vrgd_ds import run

    with pytest.raises(SystemExit) as stop:
        run.main(["-m", "no_such_module_here"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("vrgd_ds.run: -m no_such_module_here: no module named "
                                                   "'no_such_module_here'"), err


def test_the_demo_reports_a_skipped_step_instead_of_failing(monkeypatch, capsys):
    """Labels with a NaN make every step's gradients non-finite: the optimizer skips the steps,
    whose metrics have no trust ratio, and the demo says so on its log line. Fails on the code
    before, which read ``trust_ratio/mean`` unguarded: a KeyError at the first log line."""
    import torch

    from vrgd_ds import demo

    make_data = demo.make_data

    def with_nan(n, dim, seed):
        x, y = make_data(n, dim, seed)
        y[0] = float("nan")
        return x, y

    monkeypatch.setattr(demo, "make_data", with_nan)
    monkeypatch.setattr(demo, "student", lambda dim: torch.nn.Linear(dim, 1))
    monkeypatch.setattr(sys, "argv", ["vrgd_ds.demo", "--steps", "1", "--micro-batches", "2",
                                      "--micro-batch-size", "45000"])
    demo.main()
    out = capsys.readouterr().out
    assert "trust – (step skipped: non-finite gradients)" in out, out
