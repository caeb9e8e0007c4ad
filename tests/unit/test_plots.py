"""``vrgd-plots``: a run's metrics.jsonl to PNG files, tolerant of gaps and a cut-off line."""
import json
import logging
import math

import pytest

from vrgd_ds.train import plots as P
from vrgd_ds.train.telemetry import JsonlSink

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ALL = ["loss.png", "lr.png", "gsnr.png", "clip.png", "noise_scale.png", "throughput.png", "batch.png"]


def _record(step):
    phase = 1 if step <= 12 else 2
    r = {
        "phase": phase,
        "train/loss": 8.0 / step,
        "train/lr": 1e-3 * min(step / 5, 1.0),
        "train/tokens_per_s": 1e5 + step,
        "train/step_time_s": 0.5,
        "train/samples": 64 * step,
        "gsnr/mean": 0.1 + 0.01 * step,
        "gsnr/min": 1e-4,
        "gsnr/max": 5.0,
        "gsnr/clip_low_frac": 0.3,
        "gsnr/clip_high_frac": 0.05,
        # A noisy estimate can be negative or NaN: not drawn on the log axis.
        "noise_scale/b_simple": float("nan") if step == 3 else (-1.0 if step == 4 else 100.0 * step),
        "trust_ratio/mean": 1.1,
        "step/skipped_total": 0.0,
        # an adaptive batch in phase 1: doubles at step 6, measured similarity every 4th step
        "train/global_batch": 64.0 if step < 6 else 128.0,
        "adaptive/b_simple": 90.0 + step,
        "adaptive/implied_similarity": 0.3 + 0.01 * step,
    }
    if step % 4 == 0:
        r["adaptive/measured_similarity"] = 0.28 + 0.01 * step
    if step == 5:
        r["adaptive/target_batch"] = 180.0
    if phase == 2:
        for key in ("adaptive/b_simple", "adaptive/implied_similarity", "adaptive/measured_similarity"):
            r.pop(key, None)
    for g in ["embeddings", "encoder.layer.0", "encoder.layer.1", "encoder.layer.10", "head"]:
        r[f"group/{g}/gsnr_mean"] = 0.2
    if step % 5 == 0:
        r["eval/mlm_loss"] = 7.0 / step
        r["eval/mlm_acc"] = 0.1 * step / 20
    return r


@pytest.fixture
def run_dir(tmp_path):
    run = tmp_path / "run"
    with JsonlSink(run / "metrics.jsonl") as sink:
        for s in range(1, 21):
            sink.write(s, _record(s))
    return run


def _assert_pngs(paths, names):
    assert sorted(p.name for p in paths) == sorted(names)
    for p in paths:
        data = p.read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 1000, p


def test_full_run_writes_every_plot(run_dir):
    paths = P.plot_run(run_dir)
    _assert_pngs(paths, ALL)
    assert all(p.parent == run_dir / "plots" for p in paths)


def test_out_dir_and_cut_off_last_line(run_dir, tmp_path, caplog):
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 21, "train/lo')
    with caplog.at_level(logging.WARNING, logger=P.__name__):
        paths = P.plot_run(run_dir, tmp_path / "out")
    _assert_pngs(paths, ALL)
    assert all(p.parent == tmp_path / "out" for p in paths)
    assert "corrupt last line" in caplog.text


def test_missing_keys_skip_plots(tmp_path, caplog):
    run = tmp_path / "run"
    run.mkdir()
    with open(run / "metrics.jsonl", "w") as f:
        for s in range(1, 6):
            # null values and keys missing in some records are both gaps.
            rec = {"step": s, "time": 0.0, "train/loss": None if s == 2 else 1.0 / s}
            if s > 2:
                rec["train/lr"] = 0.01
            f.write(json.dumps(rec) + "\n")
    with caplog.at_level(logging.INFO, logger=P.__name__):
        paths = P.plot_run(run)
    _assert_pngs(paths, ["loss.png", "lr.png"])
    for skipped in ["gsnr.png", "clip.png", "noise_scale.png", "throughput.png", "batch.png"]:
        assert f"skipping {skipped}" in caplog.text


def test_read_metrics_merges_records_of_one_step(tmp_path):
    """The loop may write a step's evaluation as its own record after the training one."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"step": 2, "train/loss": 1.0},
        {"step": 1, "train/loss": 2.0},
        {"step": 2, "eval/mlm_loss": 1.5},
        {"no_step": 1},
        ["not", "a", "record"],
    ]) + "\n")
    recs = P.read_metrics(path)
    assert recs == [{"step": 1, "train/loss": 2.0}, {"step": 2, "train/loss": 1.0, "eval/mlm_loss": 1.5}]


def test_phase_changes():
    recs = [{"step": 1, "phase": 1}, {"step": 2}, {"step": 3, "phase": 1}, {"step": 4, "phase": 2},
            {"step": 5, "phase": None}, {"step": 6, "phase": 2}, {"step": 7, "phase": "p3"}]
    assert P._phase_changes(recs) == [(4, 2), (7, "p3")]


def test_a_phase_starts_after_the_last_step_of_the_one_before_not_at_its_first_log_step():
    """Fails on the old code: the line was drawn at the new phase's first record (200), up to
    log_every - 1 steps late; the phase's last step (150) is always recorded, so it starts at 151."""
    recs = [{"step": 100, "phase": 0}, {"step": 150, "phase": 0}, {"step": 200, "phase": 1}, {"step": 300, "phase": 1}]
    assert P._phase_changes(recs) == [(151, 1)]


def test_series_skips_null_non_finite_and_strings():
    recs = [{"step": 1, "k": 1.0}, {"step": 2, "k": None}, {"step": 3, "k": math.inf},
            {"step": 4, "k": "x"}, {"step": 5}, {"step": 6, "k": 3}]
    assert P._series(recs, "k") == ([1, 6], [1.0, 3.0])


def test_group_order_follows_the_stack():
    recs = [{"step": 1, **{f"group/{g}/gsnr_mean": 1.0 for g in
                           ["head", "encoder.layer.10", "pooler", "encoder.layer.2", "embeddings"]}}]
    assert P._group_names(recs, "gsnr_mean") == ["embeddings", "encoder.layer.2", "encoder.layer.10", "pooler", "head"]


def test_cli_prints_paths(run_dir, capsys):
    assert P.main([str(run_dir), "--out", str(run_dir / "png")]) == 0
    printed = capsys.readouterr().out.split()
    assert sorted(printed) == sorted(str(run_dir / "png" / n) for n in ALL)


def test_cli_errors_on_missing_or_empty_file(tmp_path, capsys):
    assert P.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(tmp_path / "metrics.jsonl") in err
    (tmp_path / "metrics.jsonl").write_text("\n")
    assert P.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "metrics.jsonl" in err and "no step record" in err
    assert not (tmp_path / "plots").exists()


def test_the_loss_plot_draws_either_engines_held_out_metrics():
    """A Megatron run logs ``eval/lm_loss``/``eval/lm_acc`` (causal LM), a DeepSpeed run
    ``eval/mlm_*``: the loss plot draws whichever is there. Before, a GPT run's plot had its
    training loss only."""
    from matplotlib.figure import Figure

    for task in ("lm", "mlm"):
        records = [{"step": 0, f"eval/{task}_loss": 7.6, f"eval/{task}_acc": 0.01},
                   {"step": 1, "train/loss": 7.5}, {"step": 2, "train/loss": 7.4, f"eval/{task}_loss": 7.3,
                                                   f"eval/{task}_acc": 0.05}]
        fig = Figure()
        P._draw_loss(fig, records)
        loss_ax, acc_ax = fig.axes
        assert [line.get_label() for line in loss_ax.get_lines()] == ["train/loss", f"eval/{task}_loss"]
        assert [line.get_label() for line in acc_ax.get_lines()] == [f"eval/{task}_acc"]
        assert acc_ax.get_ylabel() == f"{task.upper()} accuracy"


def test_cli_errors_on_a_file_that_is_no_metrics_and_an_output_that_cannot_be_made(run_dir, tmp_path, capsys):
    """A PNG given as the metrics file, and ``--out`` naming a file: one line, exit 2. Fails on
    the code before: a UnicodeDecodeError and a FileExistsError traceback."""
    png = tmp_path / "loss.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    assert P.main([str(png)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {png} is not a metrics file (not UTF-8 text") and len(err.splitlines()) == 1, err
    taken = tmp_path / "taken"
    taken.write_text("a file")
    assert P.main([str(run_dir), "--out", str(taken)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(taken) in err and len(err.splitlines()) == 1, err


def test_a_non_finite_stretch_breaks_the_line_and_is_ticked_and_skipped_steps_are_marked(tmp_path, caplog):
    """A loss that is NaN from step 15 to 30 (the sink writes null) is a gap in the line, ticked
    at the bottom of the axes and warned about with its count; the optimizer's skipped steps are
    marked on the loss plot; a key null on every step is named as such, not as absent. Fails on
    the old code, which dropped the null steps and joined step 14 to step 31 with a straight line,
    never drew a skipped step, and said "none of ... in" for a key written only as null."""
    from matplotlib.figure import Figure

    records = [{"step": s, "train/loss": math.nan if 15 <= s <= 30 else 8.0 / s,
                "step/skipped": 1.0 if s in (15, 16) else 0.0, "gsnr/mean": math.nan} for s in range(1, 41)]
    with JsonlSink(tmp_path / "metrics.jsonl") as sink:
        for r in records:
            sink.write(r["step"], {k: v for k, v in r.items() if k != "step"})
    recs = P.read_metrics(tmp_path / "metrics.jsonl")
    assert recs[20]["train/loss"] is None
    fig = Figure()
    P._draw_loss(fig, recs)
    (ax,) = fig.axes
    lines = {line.get_label(): line for line in ax.get_lines()}
    x, y = (list(v) for v in lines["train/loss"].get_data())
    assert x == list(range(1, 41)) and all(math.isnan(v) for v in y[14:30]) and not any(map(math.isnan, y[:14]))
    assert list(lines["train/loss: not finite"].get_xdata()) == list(range(15, 31))
    assert list(lines["skipped step"].get_xdata()) == [15, 16]
    with caplog.at_level(logging.INFO, logger=P.__name__):
        written = {p.name for p in P.plot_run(tmp_path)}
    assert "loss.png" in written and "gsnr.png" not in written
    assert "loss.png: steps where train/loss is not finite are gaps in the lines, ticked at the bottom " \
           "(train/loss: 16)" in caplog.text
    assert "skipping gsnr.png: gsnr/mean in " in caplog.text and "with no finite value (gsnr/mean: 40 step(s))" \
        in caplog.text


def test_the_gsnr_axis_stays_linear_where_the_bands_minimum_is_zero():
    """``gsnr/min`` is 0 where a tensor's elements had no gradient (embedding rows of absent
    tokens): the min..max band would be clipped on a log axis, so the axis stays linear; a
    positive band still gets a log axis. Fails on the old code, which judged by the lines alone
    (the mean) and clipped the band's floor at the axis' lower limit."""
    from matplotlib.figure import Figure

    for floor, scale in ((0.0, "linear"), (1e-4, "log")):
        fig = Figure()
        P._draw_gsnr(fig, [{"step": s, "gsnr/mean": 0.1 * s, "gsnr/min": floor, "gsnr/max": 5.0} for s in range(1, 9)])
        assert fig.axes[0].get_yscale() == scale, floor
