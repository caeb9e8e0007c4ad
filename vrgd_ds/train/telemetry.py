"""Where the pretraining job's metrics go: layer groups for the per-tensor rows, and sinks.

The optimizers return their telemetry as ``dict[str, float]`` (docs/design.md §5:
``GSNROptimizer.gsnr_metrics()``); this module is the job's side of that contract. It turns
the per-tensor rows ``tensor/<param name>/<metric>`` into a few rows per layer group (one
row per encoder layer is readable on a plot, one per tensor of BERT-large is not), and
writes step records to a JSONL file, TensorBoard and wandb.

The sinks are plain writers: they do not look at ranks. The caller builds them on rank 0
only, because every rank holds the same metrics (the optimizer completes its sums across
ranks at the step) and several writers on one file would interleave lines.

Run directory layout made by :func:`build_sinks`::

    run_dir/metrics.jsonl    one JSON object per line: {"step": int, "time": float, ...}
    run_dir/tensorboard/     SummaryWriter event files
    run_dir/wandb/           wandb's offline run files (``wandb sync`` uploads them)
"""
from __future__ import annotations

import abc
import json
import logging
import math
import numbers
import os
import re
import stat
import tempfile
import time
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "JsonlSink",
    "MetricSink",
    "MultiSink",
    "TensorBoardSink",
    "WandbSink",
    "build_sinks",
    "group_summary",
    "layer_group",
]

# Wrappers that prefix parameter names: DDP/DeepSpeed engines ("module."), torch.compile
# ("_orig_mod."). They may stack, e.g. a compiled model inside an engine.
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")
_ENCODER_LAYER = re.compile(r"^encoder\.layer\.(\d+)\.")
_DECODER_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")  # megatron-core's GPT
_STAGE = re.compile(r"^(stage\d+\.)")  # a pipeline stage's rows (vrgd_ds.stats.layout.Layout.join_stages)
_CHUNK = re.compile(r"^(chunk\d+\.)")  # a model chunk's, where a rank holds several (vrgd_ds.megatron.stats)


def layer_group(param_name: str) -> str:
    """The layer group of a parameter name (HuggingFace BERT's, megatron-core GPT's, or another).

    ``embeddings`` (``bert.embeddings.*``), ``encoder.layer.<i>``, ``pooler``, ``head``
    (``cls.*``: the MLM and NSP heads), and megatron-core's GPT layers ``decoder.layers.<i>``
    (its transformer layers would otherwise be one group); any other name maps to its first two dotted
    components (the whole name when it has fewer). Wrapper prefixes (``module.``,
    ``_orig_mod.``) and the ``bert.`` model prefix are ignored, so a name from a bare
    ``BertModel`` and one from a DeepSpeed engine around ``BertForPreTraining`` agree. A
    pipeline stage's prefix (``stage<i>.``) and a model chunk's (``chunk<i>.``, an interleaved
    pipeline's rank holding several) are kept in front of the group: Megatron numbers each stage's
    and each chunk's layers from 0.
    """
    m = _STAGE.match(param_name) or _CHUNK.match(param_name)
    if m:
        return m.group(1) + layer_group(param_name[m.end():])
    name = param_name
    stripped = True
    while stripped:
        stripped = False
        for prefix in _WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix):]
                stripped = True
    if name.startswith("bert."):
        name = name[len("bert."):]
    if name.startswith("embeddings."):
        return "embeddings"
    m = _ENCODER_LAYER.match(name)
    if m:
        return f"encoder.layer.{int(m.group(1))}"
    m = _DECODER_LAYER.match(name)
    if m:
        return f"decoder.layers.{int(m.group(1))}"
    if name.startswith("pooler."):
        return "pooler"
    if name.startswith("cls."):
        return "head"
    return ".".join(name.split(".")[:2])


# How each per-tensor metric is reduced over the tensors of a group.
_GROUP_REDUCTIONS = {
    "gsnr_mean": "mean",
    "gsnr_min": "min",
    "gsnr_max": "max",
    "clip_low_frac": "mean",
    "clip_high_frac": "mean",
    "scale_mean": "mean",
    "trust_ratio": "mean",
}


def group_summary(per_tensor: Mapping[str, float]) -> dict[str, float]:
    """Per layer group rows ``group/<group>/<metric>`` from ``tensor/<name>/<metric>`` keys.

    ``gsnr_min`` / ``gsnr_max`` are the extremes over the group's tensors. ``gsnr_mean``,
    ``clip_low_frac``, ``clip_high_frac``, ``scale_mean`` and ``trust_ratio`` are the plain mean over the
    group's tensors: a numel-weighted mean would be the group's true element mean, but the
    per-tensor rows carry no element counts, so a small bias vector weighs as much as a
    1024x4096 weight. Keys that are not per-tensor rows (the rest of ``gsnr_metrics()``)
    are ignored, as are non-finite values, so one bad tensor does not blank its group
    (the global ``gsnr/*`` rows still show it).
    """
    values: dict[tuple[str, str], list[float]] = {}
    for key, value in per_tensor.items():
        if not key.startswith("tensor/"):
            continue
        # Parameter names are dotted, the metric is the last "/" component.
        name, sep, metric = key[len("tensor/"):].rpartition("/")
        if not sep or not name or metric not in _GROUP_REDUCTIONS:
            continue
        v = float(value)
        if not math.isfinite(v):
            continue
        values.setdefault((layer_group(name), metric), []).append(v)
    out: dict[str, float] = {}
    for (group, metric), vs in values.items():
        how = _GROUP_REDUCTIONS[metric]
        if how == "min":
            r = min(vs)
        elif how == "max":
            r = max(vs)
        else:
            r = math.fsum(vs) / len(vs)
        out[f"group/{group}/{metric}"] = r
    return out


def _number(value: Any) -> float | int | None:
    """``value`` as a JSON number, or None for non-finite and non-numeric values.

    Accepts Python and NumPy numbers and 0-d tensors (anything ``float()`` takes); ints stay
    ints (the job gives its counters, ``train/samples`` among them, as floats: exact below 2^53).
    """
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


class MetricSink(abc.ABC):
    """A place step records go. ``write`` takes the step and a flat ``{key: value}`` dict
    whose values are numbers (non-finite allowed) or, for labels such as ``phase``, strings.
    Usable as a context manager that closes it."""

    @abc.abstractmethod
    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Records ``metrics`` at optimizer step ``step``."""

    def flush(self) -> None:
        """Pushes buffered records to storage (no-op where every write is already there)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Flushes and releases the sink; later writes are an error."""

    def __enter__(self) -> MetricSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class JsonlSink(MetricSink):
    """One JSON object per line: ``{"step": int, "time": unix seconds, key: value, ...}``.

    Appends, so a resumed run continues the same file. With ``resume_step`` the records of
    steps after it are dropped first: the run restarts from that checkpoint and writes
    those steps again, and two records for one step would make the plots zig-zag. The
    truncation rewrites the file to a temporary sibling and renames it over the original,
    so a kill during it leaves either the old or the new file. A last line without its
    newline (a write cut off by a kill) is dropped in either case.

    Non-finite numbers are written as ``null`` (JSON has no NaN); each write is flushed, so
    the file is complete up to the last step when the process dies.

    Args:
        path: the JSONL file; its directory is created.
        resume_step: the step the run resumes from; records with a larger step are removed
            (-1 for a fresh start in a directory an earlier, checkpoint-less start wrote to).
    """

    def __init__(self, path: str | os.PathLike[str], resume_step: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            self._repair(resume_step)
        self._file = open(self.path, "a", encoding="utf-8")

    def _repair(self, resume_step: int | None) -> None:
        data = self.path.read_bytes()
        if not data:
            return
        complete, _, partial = data.rpartition(b"\n")
        if partial:
            logger.warning("%s: dropping an incomplete last line (%d bytes)", self.path, len(partial))
        if resume_step is None:
            if partial:
                # Only cut bytes off the end, so no rewrite is needed.
                os.truncate(self.path, len(complete) + 1 if complete else 0)
            return
        kept: list[bytes] = []
        dropped = 0
        for line in complete.split(b"\n") if complete else []:
            if not line.strip():
                continue
            try:
                step = json.loads(line)["step"]
            except (ValueError, KeyError, TypeError):
                # A corrupt line in the middle of the file: keep it where it is, the reader
                # skips it with a warning, and its step is unknown.
                kept.append(line)
                continue
            if isinstance(step, (int, float)) and step > resume_step:
                dropped += 1
            else:
                kept.append(line)
        if dropped == 0 and not partial:
            return
        if resume_step < 0:
            logger.warning("%s: a fresh start, dropping the %d records of an earlier start that left no checkpoint",
                           self.path, dropped)
        else:
            logger.info("%s: resuming at step %d, dropping %d later records", self.path, resume_step, dropped)
        fd, tmp = tempfile.mkstemp(prefix=self.path.name + ".", suffix=".tmp", dir=self.path.parent)
        try:
            os.chmod(fd, stat.S_IMODE(self.path.stat().st_mode))  # mkstemp's 0600 would hide it from the group
            with os.fdopen(fd, "wb") as f:
                f.write(b"".join(line + b"\n" for line in kept))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        record: dict[str, Any] = {"step": int(step), "time": time.time()}
        for key, value in metrics.items():
            if key in ("step", "time"):
                continue  # the sink's own fields win; a caller's duplicate would shadow them
            record[key] = value if isinstance(value, str) else _number(value)
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


class TensorBoardSink(MetricSink):
    """Scalars by key into a ``torch.utils.tensorboard.SummaryWriter``.

    Strings and non-finite values are skipped (TensorBoard scalars are finite floats; a NaN
    would flatten the chart's axis range). With ``resume_step`` the writer purges the
    events of later steps (``purge_step``), matching :class:`JsonlSink`.

    Args:
        log_dir: the event file directory.
        resume_step: the step the run resumes from; events with a larger step are hidden
            (-1: all of them).
    """

    def __init__(self, log_dir: str | os.PathLike[str], resume_step: int | None = None):
        # Imported here so that the JSONL sink works without tensorboard installed.
        from torch.utils.tensorboard import SummaryWriter

        purge = None if resume_step is None else int(resume_step) + 1
        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge)

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        for key, value in metrics.items():
            if isinstance(value, str):
                continue
            v = _number(value)
            if v is None:
                continue
            self._writer.add_scalar(key, float(v), global_step=int(step))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


_WANDB_MODES = ("offline", "online", "disabled")


class WandbSink(MetricSink):
    """Step records into a Weights & Biases run, offline unless asked otherwise.

    Offline runs write under ``run_dir/wandb/`` and never touch the network; ``wandb sync``
    uploads them later. ``mode="online"`` is the only mode that connects. A resumed job goes on
    with the same wandb run: its id is kept in ``run_dir/wandb/vrgd_run_id`` (a fresh start,
    ``fresh=True``, takes a new one). wandb drops records whose step is lower than one already
    logged, so a resumed run only adds steps past the last one the run saw.

    Args:
        project: the wandb project name.
        run_dir: the run directory; wandb makes its ``wandb/`` folder inside it.
        mode: ``"offline"`` (default), ``"online"`` or ``"disabled"``.
        name: the run's display name.
        config: the run's configuration, shown next to its charts.
        fresh: start a new wandb run even where the run directory holds one's id.
    """

    def __init__(
        self,
        project: str,
        run_dir: str | os.PathLike[str],
        mode: str = "offline",
        name: str | None = None,
        config: Mapping[str, Any] | None = None,
        fresh: bool = False,
    ):
        if mode not in _WANDB_MODES:
            raise ValueError(f"wandb mode must be one of {_WANDB_MODES}, got {mode!r}")
        try:
            import wandb
        except ImportError as e:
            raise ImportError(
                'WandbSink needs the wandb package: pip install "vrgd-ds[wandb]"'
            ) from e
        self.run_dir = Path(run_dir)
        id_file = self.run_dir / "wandb" / "vrgd_run_id"
        id_file.parent.mkdir(parents=True, exist_ok=True)
        run_id = None if fresh or not id_file.is_file() else id_file.read_text().strip()
        run_id = run_id or uuid.uuid4().hex[:12]  # a wandb run id: letters and digits
        self._run = wandb.init(
            project=project,
            dir=str(self.run_dir),
            mode=mode,
            name=name,
            config=dict(config) if config is not None else None,
            id=run_id,
            resume="allow",
        )
        id_file.write_text(run_id + "\n")

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        record: dict[str, Any] = {}
        for key, value in metrics.items():
            if isinstance(value, str):
                record[key] = value
            else:
                v = _number(value)
                # wandb charts NaN as a gap, which is what a skipped step should look like.
                record[key] = float("nan") if v is None else v
        self._run.log(record, step=int(step))

    def close(self) -> None:
        self._run.finish()


class MultiSink(MetricSink):
    """Writes every record to each of ``sinks``; ``close`` closes them all, even when one
    fails, and then raises the first failure."""

    def __init__(self, sinks: Iterable[MetricSink] = ()):
        self.sinks = list(sinks)

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        for sink in self.sinks:
            sink.write(step, metrics)

    def flush(self) -> None:
        for sink in self.sinks:
            sink.flush()

    def close(self) -> None:
        first: BaseException | None = None
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as e:  # keep closing the others: each holds its own files
                logger.error("closing %s failed: %s", type(sink).__name__, e)
                first = first or e
        if first is not None:
            raise first


def build_sinks(
    run_dir: str | os.PathLike[str],
    *,
    jsonl: bool = True,
    tensorboard: bool = True,
    wandb: Mapping[str, Any] | None = None,
    resume_step: int | None = None,
) -> MultiSink:
    """The job's sinks in the run directory layout of this module's docstring.

    Args:
        run_dir: the run directory; created if missing.
        jsonl: write ``run_dir/metrics.jsonl``.
        tensorboard: write event files under ``run_dir/tensorboard/``.
        wandb: keyword arguments of :class:`WandbSink` other than ``run_dir`` and ``fresh``
            (``project`` required; ``mode``, ``name``, ``config``); None, or ``mode`` "disabled",
            for no wandb (then wandb need not be installed).
        resume_step: the step a resumed run restarts from; later records are dropped (-1: a
            fresh start, every earlier record dropped; None: appended to).
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    sinks: list[MetricSink] = []
    try:
        if jsonl:
            sinks.append(JsonlSink(run_dir / "metrics.jsonl", resume_step=resume_step))
        if tensorboard:
            sinks.append(TensorBoardSink(run_dir / "tensorboard", resume_step=resume_step))
        if wandb is not None and wandb.get("mode") != "disabled":
            sinks.append(WandbSink(run_dir=run_dir, fresh=resume_step == -1, **dict(wandb)))
    except BaseException:
        # Do not leave the sinks made so far holding open files.
        MultiSink(sinks).close()
        raise
    return MultiSink(sinks)
