"""Turns a run's ``metrics.jsonl`` into PNG plots: ``vrgd-plots RUN_DIR [--out DIR]``.

The plots are the ones a VRGD run is judged by (docs/design.md §5): loss and MLM accuracy, the
learning rate, GSNR overall and per layer group, the fraction of elements clipped at gamma
and at 1, the gradient noise scale B_simple (McCandlish et al. 2018, the critical batch
size), and throughput. Phase changes (BERT phase 1 → 2: sequence length and batch size
change) are drawn as vertical lines, since every curve is expected to jump there.

Figures are drawn on matplotlib's Agg canvas directly, without pyplot, so the command
needs no display and importing this module does not change the process's backend.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

logger = logging.getLogger(__name__)

__all__ = ["EmptyMetricsError", "main", "plot_run", "read_metrics"]

METRICS_FILE = "metrics.jsonl"


class EmptyMetricsError(ValueError):
    """The metrics file holds no step record."""


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The step records of a JSONL metrics file, one per step, in step order.

    Records of the same step are merged (later keys win), since the loop may write the
    evaluation of a step as its own record. Lines that are not JSON objects with an integer
    ``step`` are skipped with a warning: the last line of a run killed mid-write is cut
    off.
    """
    path = Path(path)
    by_step: dict[int, dict[str, Any]] = {}
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            where = "last line" if lineno == len(lines) else f"line {lineno}"
            logger.warning("%s: skipping corrupt %s", path, where)
            continue
        step = record.get("step") if isinstance(record, dict) else None
        if isinstance(step, bool) or not isinstance(step, int):
            logger.warning("%s: skipping line %d without an integer step", path, lineno)
            continue
        by_step.setdefault(step, {}).update(record)
    return [by_step[s] for s in sorted(by_step)]


def _finite(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


def _series(records: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """Steps and values of ``key`` over the records that hold a finite number for it."""
    xs: list[int] = []
    ys: list[float] = []
    for r in records:
        v = r.get(key)
        if not _finite(v):
            continue
        xs.append(r["step"])
        ys.append(float(v))
    return xs, ys


def _gaps(records: Sequence[dict[str, Any]], key: str) -> list[int]:
    """Steps whose record holds ``key`` without a finite number: the sink writes a non-finite
    value as null (a step without the key, such as one between evaluations, is no gap)."""
    return [r["step"] for r in records if key in r and not _finite(r[key])]


def _present(records: Sequence[dict[str, Any]], key: str) -> bool:
    return bool(_series(records, key)[0])


def _phase_changes(records: Sequence[dict[str, Any]]) -> list[tuple[int, Any]]:
    """``(first step, phase)`` of every phase after the first: the step after the previous
    phase's last record (a phase's last step is always recorded, ``loop.record_due``; its next
    phase's first only on a log step); records without a phase key do not end a phase."""
    out: list[tuple[int, Any]] = []
    current: Any = None
    last = None
    for r in records:
        if "phase" not in r or r["phase"] is None:
            continue
        if last is not None and r["phase"] != current:
            out.append((last + 1, r["phase"]))
        current, last = r["phase"], r["step"]
    return out


def _natural_key(text: str) -> list[Any]:
    """Sort key putting ``encoder.layer.2`` before ``encoder.layer.10``."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text)]


def _group_names(records: Sequence[dict[str, Any]], metric: str) -> list[str]:
    names = {k[len("group/"):-len(metric) - 1] for r in records for k in r
             if k.startswith("group/") and k.endswith("/" + metric)}
    # Data order of a BERT stack: embeddings, layers 0..N-1, pooler, head.
    order = {"embeddings": 0, "pooler": 2, "head": 3}
    return sorted(names, key=lambda g: (order.get(g, 1), _natural_key(g)))


class _Plot:
    """One figure: which keys make it worth drawing and how it is drawn."""

    def __init__(self, file: str, keys: Sequence[str], draw: Callable[[Figure, Sequence[dict[str, Any]]], None]):
        self.file, self.keys, self.draw = file, tuple(keys), draw


#: the ``gid`` of the marks under an axis (steps with a non-finite value, skipped steps): not data
MARK = "vrgd-mark"


def _mark(ax: Any, steps: Sequence[int], label: str, marker: str, color: str) -> None:
    """Ticks at the bottom of ``ax`` at ``steps`` (in axes height, whatever the y scale)."""
    ax.plot(steps, [0.0] * len(steps), transform=ax.get_xaxis_transform(), linestyle="none", marker=marker,
            markersize=9, color=color, label=label, gid=MARK, clip_on=False)


def _line(ax: Any, records: Sequence[dict[str, Any]], key: str, **kw: Any) -> bool:
    """``key`` over the steps; a step where it is not finite breaks the line there and is
    ticked at the bottom of the axes (not joined across, as if the run had been fine)."""
    xs, ys = _series(records, key)
    if not xs:
        return False
    # Markers when there are few points: evaluation runs every few thousand steps.
    kw.setdefault("marker", "o" if len(xs) < 30 else None)
    label = kw.pop("label", key)
    gaps = _gaps(records, key)
    if gaps:
        points = sorted([*zip(xs, ys), *((x, math.nan) for x in gaps)])
        xs, ys = [x for x, _ in points], [y for _, y in points]
    ax.plot(xs, ys, label=label, markersize=3, **kw)
    if gaps:
        _mark(ax, gaps, f"{label}: not finite", "|", "red")
    return True


def _finish(ax: Any, ylabel: str) -> None:
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")


#: the held-out metrics of each engine's task: masked LM (DeepSpeed's BERT), causal LM (Megatron's GPT)
EVAL_TASKS = (("mlm", "MLM"), ("lm", "LM"))


def _draw_loss(fig: Figure, records: Sequence[dict[str, Any]]) -> None:
    ax = fig.add_subplot()
    _line(ax, records, "train/loss", alpha=0.8)
    skipped = [r["step"] for r in records if _finite(r.get("step/skipped")) and r["step/skipped"] > 0]
    if skipped:  # the optimizer left its state untouched there (non-finite gradients, fp16 overflow)
        _mark(ax, skipped, "skipped step", "x", "black")
    for task, _ in EVAL_TASKS:
        _line(ax, records, f"eval/{task}_loss", color="C1")
    _finish(ax, "loss")
    accuracy = [(task, name) for task, name in EVAL_TASKS if _present(records, f"eval/{task}_acc")]
    if accuracy:
        acc = ax.twinx()
        for task, name in accuracy:
            _line(acc, records, f"eval/{task}_acc", color="C2", linestyle="--")
        acc.set_ylabel(f"{accuracy[0][1]} accuracy")
        # One legend for both axes, in the loss axis.
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = acc.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, fontsize="small")
    ax.set_title("loss")


def _draw_lr(fig: Figure, records: Sequence[dict[str, Any]]) -> None:
    ax = fig.add_subplot()
    _line(ax, records, "train/lr")
    _finish(ax, "learning rate")
    ax.set_title("learning rate")


def _log_if_positive(ax: Any, *extra: Sequence[float]) -> None:
    """Log y when every value drawn (the lines', and ``extra``: a band's edges) is positive;
    GSNR spans decades across layers."""
    ys = [y for line in ax.get_lines() if line.get_gid() != MARK for y in line.get_ydata()]
    ys = [y for y in (*ys, *(y for values in extra for y in values)) if math.isfinite(y)]
    if ys and min(ys) > 0:
        ax.set_yscale("log")


def _draw_gsnr(fig: Figure, records: Sequence[dict[str, Any]]) -> None:
    groups = _group_names(records, "gsnr_mean")
    has_global = any(_present(records, k) for k in ("gsnr/mean", "gsnr/min", "gsnr/max"))
    panels = int(has_global) + int(bool(groups))
    i = 1
    if has_global:
        ax = fig.add_subplot(panels, 1, i)
        i += 1
        _line(ax, records, "gsnr/mean", color="C0")
        lo_x, lo = _series(records, "gsnr/min")
        hi_x, hi = _series(records, "gsnr/max")
        if lo_x and lo_x == hi_x:
            ax.fill_between(lo_x, lo, hi, color="C0", alpha=0.15, label="gsnr/min..max")
        else:
            _line(ax, records, "gsnr/min", color="C0", linestyle=":")
            _line(ax, records, "gsnr/max", color="C0", linestyle="--")
            lo = hi = []
        _log_if_positive(ax, lo, hi)  # a min of 0 (a tensor's elements with no gradient) keeps it linear
        _finish(ax, "GSNR (before normalisation)")
        ax.set_title("GSNR")
    if groups:
        ax = fig.add_subplot(panels, 1, i)
        colours = colormaps["viridis"]
        for j, g in enumerate(groups):
            _line(ax, records, f"group/{g}/gsnr_mean", label=g,
                  color=colours(j / max(len(groups) - 1, 1)), linewidth=1)
        _log_if_positive(ax)
        ax.set_xlabel("step")
        ax.set_ylabel("mean GSNR of the group's tensors")
        ax.grid(True, alpha=0.3)
        # A BERT-large stack has 27 groups: the legend goes beside the axes in columns.
        ax.legend(fontsize="x-small", ncol=max(1, math.ceil(len(groups) / 14)),
                  loc="upper left", bbox_to_anchor=(1.01, 1.0))
        ax.set_title("GSNR by layer group")


def _draw_clip(fig: Figure, records: Sequence[dict[str, Any]]) -> None:
    ax = fig.add_subplot()
    _line(ax, records, "gsnr/clip_low_frac", label="raised to gamma (clip_low_frac)")
    _line(ax, records, "gsnr/clip_high_frac", label="cut to 1 (clip_high_frac)")
    _line(ax, records, "gsnr/scale_mean", label="mean scale p̂ applied (scale_mean)")
    _finish(ax, "fraction of elements / mean scale")
    ax.set_title("GSNR clipping and the scale applied")


def _draw_noise_scale(fig: Figure, records: Sequence[dict[str, Any]]) -> None:
    ax = fig.add_subplot()
    # B_simple in samples when the loop passed samples_per_group, else in gradient groups.
    key = "noise_scale/b_simple" if _present(records, "noise_scale/b_simple") else "noise_scale/b_simple_groups"
    xs, ys = _series(records, key)
    pos = [(x, y) for x, y in zip(xs, ys) if y > 0]
    if len(pos) < len(xs):
        # The bias-corrected |G|² can come out negative when the gradient is mostly noise;
        # such steps have no place on a log axis.
        logger.info("noise_scale.png: %d of %d steps with B_simple <= 0 not drawn", len(xs) - len(pos), len(xs))
    if pos:
        ax.plot([p[0] for p in pos], [p[1] for p in pos], label=key,
                marker="o" if len(pos) < 30 else None, markersize=3)
        ax.set_yscale("log")
    gaps = _gaps(records, key)
    if gaps:
        _mark(ax, gaps, f"{key}: not finite", "|", "red")
    _finish(ax, "B_simple (samples)" if key == "noise_scale/b_simple" else "B_simple (gradient groups)")
    ax.set_title("gradient noise scale B_simple = tr(Σ)/|G|²")


def _draw_throughput(fig: Figure, records: Sequence[dict[str, Any]]) -> None:
    keys = [k for k in ("train/tokens_per_s", "train/step_time_s") if _present(records, k)]
    labels = {"train/tokens_per_s": "tokens / s", "train/step_time_s": "step time (s)"}
    first = None
    for i, key in enumerate(keys, 1):
        ax = fig.add_subplot(len(keys), 1, i, sharex=first)
        first = first or ax
        _line(ax, records, key, color=f"C{i - 1}")
        ax.ticklabel_format(axis="y", useOffset=False)  # "+1e5" offsets hide the actual rate
        _finish(ax, labels[key])
    first.set_title("throughput")


def _draw_batch(fig: Figure, records: Sequence[dict[str, Any]]) -> None:
    """The adaptive batch: global batch, the smoothed noise scale and the target it implies;
    below, the half-batch similarity the noise scale implies and, where measured, SimiGrad's."""
    top = fig.add_subplot(2, 1, 1)
    _line(top, records, "train/global_batch", label="global batch", drawstyle="steps-post")
    _line(top, records, "adaptive/b_simple", label="B_simple (smoothed, samples)", alpha=0.8)
    _line(top, records, "adaptive/target_batch", label="target batch", linestyle="none", marker="x")
    _log_if_positive(top)
    _finish(top, "samples")
    top.set_title("adaptive batch")
    bottom = fig.add_subplot(2, 1, 2, sharex=top)
    _line(bottom, records, "adaptive/implied_similarity", label="implied by B_simple: 1/(1 + 2 B_simple/B)")
    _line(bottom, records, "adaptive/measured_similarity", label="measured: cos(half-batch gradients)",
          linestyle="none", marker="o")
    _finish(bottom, "half-batch cosine")


PLOTS = (
    _Plot("loss.png", ("train/loss", "eval/mlm_loss", "eval/lm_loss"), _draw_loss),
    _Plot("lr.png", ("train/lr",), _draw_lr),
    _Plot("gsnr.png", ("gsnr/mean", "gsnr/min", "gsnr/max", "group/*/gsnr_mean"), _draw_gsnr),
    _Plot("clip.png", ("gsnr/clip_low_frac", "gsnr/clip_high_frac"), _draw_clip),
    _Plot("noise_scale.png", ("noise_scale/b_simple", "noise_scale/b_simple_groups"), _draw_noise_scale),
    _Plot("throughput.png", ("train/tokens_per_s", "train/step_time_s"), _draw_throughput),
    _Plot("batch.png", ("adaptive/b_simple",), _draw_batch),
)


def _keys(records: Sequence[dict[str, Any]], keys: Sequence[str]) -> list[str]:
    """``keys`` with each pattern (``group/*/gsnr_mean``) replaced by the keys of the records it matches."""
    out: list[str] = []
    for key in keys:
        if "*" in key:
            prefix, _, suffix = key.partition("*")
            out += sorted({k for r in records for k in r if k.startswith(prefix) and k.endswith(suffix)})
        else:
            out.append(key)
    return out


def _metrics_path(run_dir: Path) -> Path:
    return run_dir if run_dir.is_file() else run_dir / METRICS_FILE


def plot_run(run_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """Writes the PNG plots of a run and returns their paths.

    Args:
        run_dir: the run directory holding ``metrics.jsonl`` (or the JSONL file itself).
        out_dir: where the PNGs go; default ``<run_dir>/plots``.

    Plots whose keys the run never wrote are skipped (logged at INFO). Raises
    ``FileNotFoundError`` when there is no metrics file and :class:`EmptyMetricsError` when
    it holds no step record.
    """
    run_dir = Path(run_dir)
    path = _metrics_path(run_dir)
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file {path}")
    records = read_metrics(path)
    if not records:
        raise EmptyMetricsError(f"{path} holds no step record")
    out = Path(out_dir) if out_dir is not None else (path.parent / "plots")
    out.mkdir(parents=True, exist_ok=True)
    phases = _phase_changes(records)
    written: list[Path] = []
    for plot in PLOTS:
        keys = _keys(records, plot.keys)
        gaps = {key: n for key in keys if (n := len(_gaps(records, key)))}
        if not any(_present(records, key) for key in keys):
            if gaps:
                logger.warning("skipping %s: %s in %s with no finite value (%s)", plot.file, ", ".join(gaps), path,
                               ", ".join(f"{key}: {n} step(s)" for key, n in gaps.items()))
            else:
                logger.info("skipping %s: none of %s in %s", plot.file, ", ".join(plot.keys), path)
            continue
        if gaps:
            logger.warning("%s: steps where %s is not finite are gaps in the lines, ticked at the bottom (%s)",
                           plot.file, ", ".join(gaps), ", ".join(f"{key}: {n}" for key, n in gaps.items()))
        fig = Figure(figsize=(9, 6 if plot.file in ("gsnr.png", "throughput.png", "batch.png") else 4.5))
        FigureCanvasAgg(fig)
        plot.draw(fig, records)
        for ax in fig.axes:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
            for step, phase in phases:
                ax.axvline(step, color="grey", linestyle="--", linewidth=0.8, alpha=0.7)
        if phases:
            # Label each boundary once, on the top axes, at its top edge.
            top = fig.axes[0]
            for step, phase in phases:
                top.annotate(f"phase {phase}", xy=(step, 1.0), xycoords=("data", "axes fraction"),
                             xytext=(2, -10), textcoords="offset points", fontsize="x-small", color="grey")
        fig.tight_layout()
        target = out / plot.file
        fig.savefig(target, dpi=110)
        written.append(target)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """``vrgd-plots RUN_DIR [--out DIR]``: writes the plots and prints their paths."""
    parser = argparse.ArgumentParser(prog="vrgd-plots", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="run directory with metrics.jsonl (or the file itself)")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default RUN_DIR/plots)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
    try:
        written = plot_run(args.run_dir, args.out)
    except (OSError, EmptyMetricsError) as e:  # no metrics file, an output that cannot be written
        print(f"error: {e}", file=sys.stderr)
        return 2
    except UnicodeDecodeError as e:
        print(f"error: {_metrics_path(args.run_dir)} is not a metrics file (not UTF-8 text: {e.reason})",
              file=sys.stderr)
        return 2
    if not written:
        print(f"error: {_metrics_path(args.run_dir)} holds none of the plotted keys", file=sys.stderr)
        return 2
    for p in written:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
