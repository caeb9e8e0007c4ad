"""LAMB vs VR-LAMB (each GSNR placement) in the real pretraining job as the global batch
grows at a fixed sample budget: held-out MLM loss and accuracy, and the gradient noise scale.

Every run is ``vrgd-pretrain`` on ``--ranks`` ranks (``deepspeed --num_gpus R``: CPU ranks, or
GPUs where there are), ZeRO-2 fp32, a ``--model`` BERT (tiny by default), one phase at
``--seq-len``, ``--samples`` training samples in all, so a larger batch takes proportionally
fewer steps — but never fewer than ``--min-steps`` optimizer steps (default 50): a run gets
``max(samples, min_steps × batch)`` samples, so a large-batch cell is not decided by a run that
ends where large-batch training begins. The tables show each cell's steps and samples. The batch grows through accumulation (micro-batch
fixed), so the GSNR groups grow with it: n = ranks × accumulation. The peak LR follows
``--lr-rule`` from ``--base-lr`` at ``--base-batch`` (square-root scaling by default), times each
factor of ``--lr-factor`` (the same grid for every optimizer), with 10% linear warmup and the
job's polynomial decay. For each (corpus, batch, optimizer) the factor with the lowest mean
held-out loss over seeds is reported (the job has one held-out split: selection and report
both use it, for every optimizer alike). The noise scale is ``B_simple`` (samples) from the
statistics the VR runs log over the second half of training (``read_metrics``).

Each corpus is prepared once (``vrgd-data prepare``) under ``--work``; runs that finished
before are read back, not repeated, so the command can be stopped and started again. Runs a
committed study holds (``--reuse docs/studies/NAME``, checked to have the same settings) are read
from its ``runs.jsonl``, so a grid can grow piecewise and on other machines;
``--only-finished`` assembles the tables from those alone, with "–" for cells never run and,
for each best cell, the factors it was chosen from.

Past the unigram plateau (``--noise-multiple``): the batches are multiples of the noise scale
that a VR optimizer's runs measure at ``--base-batch`` (the probe; its baseline runs beside it, to
show the budget's margin below the unigram level there), with ``--groups`` GSNR groups per step
at every batch, ``--eval-points`` evaluations along each run (the record keeps the loss and the
noise scale as they evolve) and a larger ``--heldout-fraction`` for a small corpus. On a lent GPU,
``--parallel`` runs cells side by side and ``--time-limit`` keeps the study within the lease,
pausing the runs still going at the limit (checkpointed: the next start in the same ``--work``
resumes them, to the loss an uninterrupted run reaches; ``kill -USR1`` to the study pauses them
so at any time); ``--probe-only`` runs the probe alone
(on one machine, the grid then on another). ``--bracket F`` runs only the part of the
``--lr-factor`` grid that brackets each optimum: every batch starts at ×F, and a round adds the
grid's factors beside an optimizer's best that have not run, until both have (``bracket_plan``;
a best at the grid's end asks for a wider grid), so a lease's runs go where a verdict needs them;
with ``--bracket-carry`` each larger batch starts at the LR the batch below settled on
(``carried_starts``), not at ×F of its own rule LR.

    python studies/bert_batch.py --corpus embedded --corpus wikitext=WIKITEXT2_DIR
    python studies/bert_batch.py --quick     # LAMB and VR-LAMB, 2 tiny runs each (CI)

writes the tables, plots and record to ``--out`` (default ``docs/studies/bert_batch``).
"""
from __future__ import annotations

import argparse
import ctypes.util
import hashlib
import json
import math
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import mean
from typing import Any, Callable, Iterable, Sequence

from common import DOCS, Output, hardware, machine, plt, portable, spread, table

from vrgd_ds.data_pipeline.tokenizer import TRAINER_RELEASE, trainer
from vrgd_ds.optim.adam import GSNR_PLACEMENTS
from vrgd_ds.train.loop import EXIT_DIVERGED, EXIT_REQUEUE
from vrgd_ds.train.plots import METRICS_FILE, read_metrics as read_steps

#: optimizer label -> the job's ``optimizer.params`` besides lr (``"type"``: another member than VRLamb)
OPTIMIZERS: dict[str, dict] = {
    "LAMB": {"gsnr": False},
    **{f"VR-LAMB {pl}": {"gamma": 0.1, "beta3": 0.9, "gsnr_placement": pl} for pl in GSNR_PLACEMENTS},
    "MERIT": {"type": "Merit"},
    "VR-MERIT": {"type": "VRMerit", "gamma": 0.1, "beta3": 0.9},
}
#: a VR optimizer label -> the optimizer it is with GSNR off (the plot's differences)
BASELINE: dict[str, str] = {**{f"VR-LAMB {pl}": "LAMB" for pl in GSNR_PLACEMENTS}, "VR-MERIT": "MERIT"}


def base_config(seq_len: int, micro_batch: int, ranks: int, workers: int, model: str = "tiny") -> dict:
    return {
        "optimizer": {"type": "VRLamb", "params": {"weight_decay": 0.01, "betas": [0.9, 0.999], "eps": 1e-6}},
        "zero_optimization": {"stage": 2},
        "gradient_clipping": 1.0,
        "job": {
            "model": {"size": model},
            "data": {"eval_samples": 512, "workers": workers},
            "total_steps": 1, "log_every": 1, "eval_every": 0, "checkpoint_every": 0, "keep_checkpoints": 1,
            "telemetry": {"tensorboard": False, "per_layer_group": False},
            "phases": [{"seq_len": seq_len, "fraction": 1.0, "global_batch": micro_batch * ranks,
                        "micro_batch": micro_batch, "lr": 1e-3, "warmup_fraction": 0.1}],
        },
    }


def prepare(name: str, source: str | None, out: Path, seq_len: int, vocab: int) -> Path:
    data = out / "data" / name  # vrgd-data prepare is idempotent: a second call checks and reuses
    cmd = [sys.executable, "-m", "vrgd_ds.data_pipeline", "prepare", str(data.resolve())]  # the inputs after it
    if source:
        src = Path(source)
        files = sorted(src.glob("*.txt")) if src.is_dir() else [src]
        if not files:
            raise SystemExit(f"--corpus {name}={source}: no .txt files there")
        cmd += [str(f.resolve()) for f in files] + ["--format", "wikitext" if "wikitext" in name else "auto"]
    cmd += ["--vocab-size", str(vocab), "--seq-len", str(seq_len), "--seed", "1", "--no-progress"]
    print(f"[prepare] {name}: {' '.join(cmd[3:])}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run(cmd, check=True, cwd=out)  # outside the checkout: see Runner.start
    return data


def lr_for(batch: int, args: argparse.Namespace) -> float:
    ratio = batch / args.base_batch
    return args.base_lr * (ratio if args.lr_rule == "linear" else math.sqrt(ratio))


def steps(run_dir: Path) -> list[dict]:
    """The run's logged steps (``vrgd_ds.train.plots.read_metrics``: one record per step, an
    evaluation merged into its step's record, a line a stop cut skipped); none before it logged."""
    metrics = run_dir / METRICS_FILE
    return read_steps(metrics) if metrics.is_file() else []


def read_metrics(run_dir: Path) -> tuple[dict | None, float | None]:
    """The last evaluation record, and the noise scale ``B_simple`` (samples) over the second half
    of training: the ratio of the mean ``noise_scale/trace_cov`` to the mean
    ``noise_scale/grad_sq`` (as the batch controller smooths them), not the mean of the per-step
    ratios, which a step whose unbiased ``|G|^2`` estimate is near or below 0 throws off."""
    last, moments, per_group = None, [], None
    for rec in steps(run_dir):
        if "eval/mlm_loss" in rec:
            last = rec
        if rec.get("noise_scale/trace_cov") is not None:
            moments.append((rec["noise_scale/trace_cov"], rec["noise_scale/grad_sq"]))
        per_group = samples_per_group(rec) or per_group
    return last, noise_scale(moments[len(moments) // 2:], per_group)


def samples_per_group(rec: dict) -> float | None:
    """A step's samples per statistics group: its global batch over its groups ``gsnr/n`` (None
    where it logged no statistics)."""
    n, batch = rec.get("gsnr/n"), rec.get("train/global_batch")
    return batch / n if n and batch else None


def noise_scale(moments: list[tuple[float, float]], per_group: float | None) -> float | None:
    """``B_simple`` in samples from logged ``(trace_cov, grad_sq)`` pairs: the ratio of their means
    times the samples per group (None without pairs, groups, or a positive mean ``grad_sq``)."""
    if not moments or per_group is None:
        return None
    grad_sq = mean(g for _, g in moments)
    return per_group * mean(t for t, _ in moments) / grad_sq if grad_sq > 0 else None


def trajectory(run_dir: Path) -> list[dict]:
    """Each held-out evaluation of a run: its step, training samples so far and loss, with the
    noise scale ``B_simple`` (samples) over the steps since the one before (as ``read_metrics``
    derives it; None where those steps logged no statistics), to show how it evolves."""
    points, moments, per_group, samples = [], [], None, 0.0
    for rec in steps(run_dir):
        samples = rec.get("train/samples", samples)
        if rec.get("noise_scale/trace_cov") is not None:
            moments.append((rec["noise_scale/trace_cov"], rec["noise_scale/grad_sq"]))
        per_group = samples_per_group(rec) or per_group
        if "eval/mlm_loss" in rec:
            points.append({"step": rec.get("step"), "samples": samples, "mlm_loss": rec["eval/mlm_loss"],
                           "b_simple": noise_scale(moments, per_group)})
            moments = []
    return points


#: the settings that make two runs of the same cell the same run (``--reuse`` checks them)
RUN_SETTINGS = ("samples", "seq_len", "micro_batch", "groups", "ranks", "lr_rule", "base_lr", "base_batch",
                "vocab_size", "model", "zero", "quick", "heldout_fraction", "eval_points", "dropout")


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:12]


#: a carried run's label digest where the record it came from had no recipe (``carried_recipe``)
UNRECORDED = "unrecorded"


def recipe(optimizers: dict[str, dict], fixed_extra: dict | None = None) -> dict:
    """What every run's config holds beside the settings a study records and the cell (corpus,
    batch, LR, seed, steps), as digests: the job's fixed settings (``base_config``: weight decay,
    betas, eps, clipping, ZeRO stage, warmup, evaluation samples; not the DataLoader workers, which
    change no result; ``fixed_extra``: a study's own constants) and each optimizer label's
    parameters (``optimizers``: label -> params). ``--reuse`` compares them (``same_recipe``)."""
    fixed = base_config(0, 0, 0, 0, "")
    del fixed["job"]["data"]["workers"]
    return {"job": _digest([fixed, fixed_extra] if fixed_extra else fixed),
            "optimizers": {label: _digest(params) for label, params in optimizers.items()}}


def carried_recipe(ours: dict, carried: list[dict], out_dir: Path) -> dict:
    """``ours`` with the digests of the labels whose runs ``--out`` carries over from its record
    (``carried_runs``) without this study running them, as that record had them (``UNRECORDED``
    where it had none): the record written keeps them, so a later ``--reuse`` still checks them."""
    labels = sorted({r["optimizer"] for r in carried} - set(ours["optimizers"]))
    if not labels:
        return ours
    theirs = json.loads((out_dir / "meta.json").read_text())["config"].get("recipe") or {}
    kept = {label: theirs.get("optimizers", {}).get(label, UNRECORDED) for label in labels}
    return {**ours, "optimizers": {**ours["optimizers"], **kept}}


def same_recipe(d: Path, theirs: dict | None, ours: dict) -> set[str]:
    """``--reuse d`` with its record's recipe ``theirs``: the same fixed settings, and the same
    parameters for every optimizer label both know, else an error naming what differs. A record
    written before recipes were recorded has none: its runs are taken as this code's (the
    parameters and fixed settings had not changed since the first record), and that is said.
    Returns the labels outside ``ours`` whose parameters there differ from this code's
    (``OPTIMIZERS``): their runs are no cell of this study, but one may be its noise-scale probe
    (``probe_label``), so they are left out (``load_reused``)."""
    unrecorded = [label for label, digest in (theirs or {}).get("optimizers", {}).items()
                  if digest == UNRECORDED and label in ours["optimizers"]]
    if theirs is None or unrecorded:
        print(f"--reuse {d}: {'its runs of ' + ', '.join(unrecorded) if unrecorded else 'its runs'} were recorded "
              "before the recipe was (optimizer parameters, fixed job settings); taken as made with this study's",
              flush=True)
        if theirs is None:
            return set()
    differ = (["fixed job settings (base_config)"] if theirs.get("job") != ours["job"] else []) + [
        f"parameters for {label}" for label, digest in theirs.get("optimizers", {}).items()
        if label in ours["optimizers"] and digest not in (ours["optimizers"][label], UNRECORDED)]
    if differ:
        raise SystemExit(f"--reuse {d}: its runs were made with other {' and other '.join(differ)} than this "
                         "study's: run them again, or leave that directory out")
    return {label for label, digest in (theirs or {}).get("optimizers", {}).items()
            if label not in ours["optimizers"] and label in OPTIMIZERS
            and digest not in (_digest(OPTIMIZERS[label]), UNRECORDED)}


RunKey = tuple[str, int, str, float, int]  # corpus, batch, optimizer, LR factor, seed


def run_key(record: dict) -> RunKey:
    return record["corpus"], record["batch"], record["optimizer"], record["factor"], record["seed"]


def steps_for(batch: int, samples: int, min_steps: int | None) -> int:
    """Optimizer steps of a run at ``batch``: the sample budget's, at least ``min_steps``
    (a study recorded before the minimum existed has none)."""
    return max(samples // batch, min_steps or 0)


def heldout_share(heldout_fraction: float | None) -> float:
    """The held-out share of the documents a run uses: the study's ``--heldout-fraction``, else the job's default."""
    from vrgd_ds.train.config import DataConfig

    return DataConfig().heldout_fraction if heldout_fraction is None else heldout_fraction


def data_fingerprint(data: Path, seed: int, heldout_fraction: float | None = None) -> str | None:
    """What decides a run's samples, masks and held-out set: the tokenizer, the shards, the seed
    and the held-out split of the data prepared in ``data`` (``vrgd_ds.train.data``; the study's
    runs use ``heldout_share(heldout_fraction)`` and no sentence-pair task)."""
    from vrgd_ds.train.data import prepared_fingerprint

    return prepared_fingerprint(data, seed, heldout_share(heldout_fraction), None)


def set_aside_other_data(reused: dict[RunKey, dict], corpus: str, fingerprint_of, python: str) -> list[dict]:
    """Removes from ``reused`` the runs of ``corpus`` that read other data than this study's and
    returns them: a recorded data fingerprint that differs from ``fingerprint_of(seed)`` (the
    tokenizer, shards, seed or held-out split changed; None: nothing prepared here to compare
    with), or, where either is missing, an
    embedded corpus made by another Python release than ``python`` (the embedded corpus is the
    running interpreter's documentation: another release, other documents, so another tokenizer,
    other samples and another held-out set)."""
    out = []
    for key, r in list(reused.items()):
        if r["corpus"] != corpus:
            continue
        recorded, here = r.get("data"), fingerprint_of(r["seed"])
        if recorded is not None and here is not None:
            other = recorded != here
        else:  # no fingerprint on one side (recorded before them, or no data prepared here)
            other = corpus == "embedded" and r.get("reused_python") not in (None, python)
        if other:
            out.append(reused.pop(key))
    return out


def load_reused(dirs: list[Path], config: dict, settings: tuple[str, ...] = RUN_SETTINGS
                ) -> tuple[dict[RunKey, dict], list[dict], list[dict]]:
    """The runs of committed studies whose ``settings`` match ``config`` (a study's ``meta.json``
    config), keyed by cell and seed, where each came from, and the runs left out because they
    took another number of steps than this study gives their batch (``steps_for``: e.g. 10-step
    cells recorded before ``--min-steps``). A setting or a corpus that differs, or one run
    recorded twice with different results, is an error naming it."""
    runs: dict[RunKey, dict] = {}
    read_from: dict[RunKey, Path] = {}  # the --reuse directory each run was read from
    sources, shorter = [], []
    specs = dict(spec.partition("=")[::2] for spec in config["corpora"])
    for d in dirs:
        meta_path, runs_path = d / "meta.json", d / "runs.jsonl"
        if not (meta_path.is_file() and runs_path.is_file()):
            raise SystemExit(f"--reuse {d}: needs meta.json and runs.jsonl there (a study's --out directory)")
        meta = json.loads(meta_path.read_text())
        theirs = meta["config"]
        stale = same_recipe(d, theirs.get("recipe"), config["recipe"]) if "recipe" in config else set()
        for key in settings:
            if theirs.get(key) != config[key]:
                raise SystemExit(f"--reuse {d}: its runs used {key}={theirs.get(key)!r}, this study {config[key]!r}: "
                                 "run with its settings or leave that directory out")
        their_specs = dict(spec.partition("=")[::2] for spec in theirs["corpora"])
        records = [json.loads(line) for line in runs_path.read_text().splitlines()]
        if dropped := sum(r["optimizer"] in stale for r in records):
            print(f"--reuse {d}: {dropped} run(s) of {', '.join(sorted(stale))}, which this study does not run, were "
                  "made with other parameters than this code gives them; not reused here (not as the noise-scale "
                  "probe either): they stay in that record", flush=True)
            records = [r for r in records if r["optimizer"] not in stale]
        where = portable(str(d))  # as the record keeps it: no scratch path of this machine
        for name, source in their_specs.items():
            # a file corpus found elsewhere on another machine is the same corpus when every run of it
            # recorded its data fingerprint (set_aside_other_data compares them); else the paths decide
            fingerprinted = all(r.get("data") for r in records if r["corpus"] == name)
            if name in specs and specs[name] != source and not (source and specs[name] and fingerprinted):
                raise SystemExit(f"--reuse {d}: corpus {name!r} was {source or 'embedded'!r} there, "
                                 f"{specs[name] or 'embedded'!r} here")
        for r in records:
            if r["steps"] != steps_for(r["batch"], config["samples"], config.get("min_steps")):
                shorter.append({"reused_from": where} | r)  # another budget: kept in its record, not used here
                continue
            key = run_key(r)
            if key in runs and runs[key]["mlm_loss"] != r["mlm_loss"]:
                raise SystemExit(f"--reuse: {key} is recorded with loss {runs[key]['mlm_loss']} in "
                                 f"{read_from[key]} (made in {runs[key]['reused_from']}) and "
                                 f"{r['mlm_loss']} in {d}")
            # the machine a run came from and the record it was first read from: its own, else its study's
            # (runs recorded before each kept them; a record assembled from records keeps where each run was made)
            read_from.setdefault(key, d)
            runs.setdefault(key, {"machine": hardware(meta["machine"]), "reused_from": where,
                                  "reused_python": meta["machine"].get("python")} | r)
        m = meta["machine"]
        sources.append({"dir": where, "commit": m.get("commit"), "started": meta["started"],
                        "machine": hardware(m)})
    return runs, sources, shorter


def carried_runs(reuse: list[Path], out_dir: Path) -> list[dict]:
    """With ``--out`` among ``--reuse``: that record's runs, read before ``Output`` starts it anew,
    so that those the study does not write again (another step count, other data, cells or seeds
    outside this invocation) are carried over (``keep_carried``), not lost with its runs.jsonl."""
    own = (out_dir / "runs.jsonl").resolve()
    return [json.loads(line) for d in reuse if (Path(d) / "runs.jsonl").resolve() == own
            for line in own.read_text().splitlines() if line.strip()]


def keep_carried(out: Output, carried: list[dict], written: set[tuple]) -> None:
    """Logs each of ``carried`` whose (``run_key``, steps) the study has not written."""
    kept = [r for r in carried if (run_key(r), r["steps"]) not in written]
    for r in kept:
        out.log_run(r)
    if kept:
        print(f"--out is among --reuse: {len(kept)} run(s) of its record this study does not use are kept in it",
              flush=True)


def finish(out: Output, results: list[dict], args: argparse.Namespace) -> None:
    """``out.finish``; then, if runs failed (``Runner``: the others went on), their logs' ends in
    meta.json and exit 1 naming the first."""
    failed = getattr(args, "failed", None)
    if failed:
        out.meta["failed"] = failed
    out.finish(results)
    if failed:
        raise SystemExit(f"{len(failed)} run(s) failed, the first {failed[0]['run']} (exit "
                         f"{failed[0]['returncode']}); meta.json's \"failed\" holds each log's end")


def micro_batch_for(batch: int, args: argparse.Namespace) -> int:
    """The micro-batch of a run at ``batch``: ``--micro-batch``, or with ``--groups N`` the batch
    split into N GSNR groups (``batch / N`` samples each: N = ranks × accumulation, fixed as the
    batch grows, as on a fixed cluster whose per-rank batch grows)."""
    groups = getattr(args, "groups", None)
    if groups is None:
        return args.micro_batch
    if batch % groups:
        raise SystemExit(f"batch {batch}: not a multiple of --groups {groups}")
    return batch // groups


#: ``<run dir>/study_paused.json``: the segments of a run the time limit paused, each {"machine",
#: "wall_s", "step", "samples"}; the next start of the same run resumes from its checkpoint
PAUSED = "study_paused.json"

#: how a run ends when the pause's SIGUSR1 reaches a rank before its job handles it (in its
#: start-up): the rank dies of the signal, and DeepSpeed's launcher exits with that code (-10 & 255)
ENDED_BY_SIGUSR1 = (-signal.SIGUSR1, -signal.SIGUSR1 & 255)


def rank_pids(group: int) -> list[int]:
    """The training ranks among the processes of the launcher's process group ``group`` (read from
    Linux's /proc; none elsewhere): each ``python -m vrgd_ds.train`` whose parent is not one (a
    DataLoader worker is a copy of its rank). The launcher's own processes do not handle SIGUSR1."""
    def is_rank(argv: list[bytes]) -> bool:
        return any(a == b"-m" and b == b"vrgd_ds.train" for a, b in zip(argv, argv[1:]))

    procs: dict[int, tuple[int, bool]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        if int(fields[2]) == group:
            procs[int(entry.name)] = (int(fields[1]), is_rank(argv))
    return [pid for pid, (parent, rank) in procs.items() if rank and not procs.get(parent, (0, False))[1]]


def stop(*procs: subprocess.Popen, grace: float = 10.0) -> None:
    """Ends runs' launchers and every process of their groups: SIGTERM to every group at once,
    then SIGKILL to those still there ``grace`` seconds later (one deadline for all, so stopping
    many runs takes no longer than one: within ``timeout -k 15``, ``benchmarks/gpu_suite.sh``)."""
    going = [proc for proc in procs if proc.poll() is None]
    for proc in going:
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in going:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@dataclass
class Launch:
    """A run to start: its directory, its command and job configuration, and what its result records
    besides the metrics."""
    run_dir: Path
    cmd: list[str]
    config: dict
    record: dict
    data: Path
    heldout_fraction: float | None = None

    def result(self, wall_s: float, machine: str, diverged: bool = False) -> dict:
        """The run's record, with the ``machine`` it ran on (a grid that grows piecewise mixes
        machines; the page names each cell's; a run paused on one and resumed on another names
        both, joined by " + "). ``diverged``: the job stopped on its skipped steps
        (``EXIT_DIVERGED``); such a run, or one whose held-out loss is not finite, is recorded
        with a loss of +inf and ``"diverged"``, so that a bracket and a verdict rank it last."""
        ev, noise = read_metrics(self.run_dir)
        if ev is None and not diverged:
            raise SystemExit(f"{self.run_dir / METRICS_FILE}: no evaluation record")
        diverged = diverged or not math.isfinite(ev["eval/mlm_loss"])
        before = self.segments()  # a run paused and resumed: its earlier segments' time counts too
        r = self.record | {"mlm_loss": math.inf if diverged else ev["eval/mlm_loss"],
                           "mlm_acc": 0.0 if diverged else ev["eval/mlm_acc"],
                           "eval_tokens": None if diverged else ev.get("eval/tokens"), "b_simple": noise,
                           "wall_s": round(wall_s + sum(g["wall_s"] for g in before), 1),
                           "data": data_fingerprint(self.data, self.record["seed"], self.heldout_fraction),
                           # a run resumed on another machine: each one, the first first
                           "machine": " + ".join(dict.fromkeys([*(g["machine"] for g in before), machine])),
                           "data_wait": self.data_wait()}
        if diverged:
            r["diverged"] = True
        if before:
            r["segments"] = before + [{"machine": machine, "wall_s": round(wall_s, 1), "step": r["steps"],
                                       "samples": r["samples"]}]
        curve = trajectory(self.run_dir)
        if len(curve) > 2:  # evaluated along the way (--eval-points)
            r["trajectory"] = curve
        # the result first, whole (a stop in between leaves the run finished, not a directory the
        # next start clears and runs again), then what it replaces
        partial = self.run_dir / "result.json.partial"
        partial.write_text(json.dumps(r))
        os.replace(partial, self.run_dir / "result.json")
        (self.run_dir / PAUSED).unlink(missing_ok=True)
        shutil.rmtree(self.run_dir / "checkpoints", ignore_errors=True)  # the figures are what the study keeps
        wait = "" if r["data_wait"] is None else f", {100 * r['data_wait']:.1f}% of it waiting for data"
        print(f"[{r['corpus']} b{r['batch']} {r['optimizer']} lr x{r['factor']:g} seed {r['seed']}] loss "
              f"{r['mlm_loss']:.4f} acc {r['mlm_acc']:.4f} lr {r['lr']:.3g} ({r['wall_s']:.0f} s{wait})", flush=True)
        return r

    def segments(self) -> list[dict]:
        """The segments this run ran before it was paused (``PAUSED``), oldest first; [] for none."""
        paused = self.run_dir / PAUSED
        return json.loads(paused.read_text()) if paused.is_file() else []

    def samples_left(self) -> int:
        """The samples still to train: all of them, less what a paused run's segments trained."""
        done = self.segments()
        return self.record["samples"] - int(done[-1]["samples"]) if done else self.record["samples"]

    def samples_unsent(self) -> int:
        """The samples a run in flight has still to train: ``samples_left`` less what its steps
        logged so far trained."""
        rows = self.trained()
        return max(self.record["samples"] - int(rows[-1]["train/samples"]), 0) if rows else self.samples_left()

    def trained(self) -> list[dict]:
        """The run's logged training steps (those with their samples and time)."""
        return [rec for rec in steps(self.run_dir) if "train/samples" in rec and "time" in rec]

    def data_wait(self, rows: list[dict] | None = None) -> float | None:
        """The share of the run's step time spent waiting for its DataLoader (``train/data_time_s``
        over ``train/step_time_s``, summed over ``rows``, default every logged step; None without
        any): near 1 when the data bounds the run, near 0 when the model does."""
        rows = [r for r in (self.trained() if rows is None else rows)
                if "train/data_time_s" in r and r.get("train/step_time_s")]
        if not rows:
            return None
        return round(sum(r["train/data_time_s"] for r in rows) / sum(r["train/step_time_s"] for r in rows), 4)

    def step_s(self, since: float = 0.0) -> float | None:
        """The longest of the run's last three step times (None before two steps are logged): how
        long a pause signal may wait for the step in flight to end before the job checkpoints.
        ``since`` (unix seconds): the start of this segment; a resumed run's steps logged before it
        are left out, as the gap between its last paused step and its first resumed one is none."""
        times = [rec["time"] for rec in self.trained() if rec["time"] >= since][-4:]
        return max((b - a for a, b in zip(times, times[1:])), default=None)

    def progress(self, wall_s: float) -> dict:
        """How far a run the time limit stopped got in its ``wall_s``: its last logged step and
        samples, the seconds until its first step was logged (start-up: interpreter, DeepSpeed,
        data, and that step) and its rate from its first logged step to its last, which is what
        a later lease can plan with when none of its runs finished (a resumed run: over this
        segment's steps)."""
        began = time.time() - wall_s
        rows = self.trained()
        r = self.record
        out = {"run": f"{r['corpus']} b{r['batch']} {r['optimizer']} ×{r['factor']:g} seed {r['seed']}",
               "steps": r["steps"], "step": rows[-1]["step"] if rows else 0,
               "samples": rows[-1]["train/samples"] if rows else 0.0, "wall_s": round(wall_s, 1),
               "setup_s": None, "samples_per_s": None, "paused": False}
        rows = [rec for rec in rows if rec["time"] >= began]
        out["data_wait"] = self.data_wait(rows)  # this segment's steps
        if rows:
            out["setup_s"] = round(rows[0]["time"] - (time.time() - wall_s), 1)
        if len(rows) > 1 and rows[-1]["time"] > rows[0]["time"]:
            out["samples_per_s"] = round((rows[-1]["train/samples"] - rows[0]["train/samples"])
                                         / (rows[-1]["time"] - rows[0]["time"]), 1)
        return out


#: settings of a run's config that do not change its result: where the data lies, how it is read, what
#: is logged and kept (a finished run read back with others is still the same run)
UNCHANGING = {"job.data.path", "job.data.workers", "job.log_every", "job.checkpoint_every", "job.keep_checkpoints"}


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"job.phases.0.lr": ...}``: a config by dotted key (a list of objects by index)."""
    if isinstance(tree, list) and tree and all(isinstance(x, dict) for x in tree):
        tree = dict(enumerate(tree))
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): tree}


def _settings(cfg: dict) -> dict[str, Any]:
    """The settings of a run's config that decide its result: ``UNCHANGING`` and telemetry aside."""
    return {k: v for k, v in _flat(json.loads(json.dumps(cfg))).items()
            if k not in UNCHANGING and not k.startswith("job.telemetry")}


def same_settings(run_dir: Path, cfg: dict) -> None:
    """A finished run in ``--work`` is read back only where its ``study_config.json`` has the
    settings this study would run it with (``UNCHANGING`` aside); else the study stops naming the
    settings that differ (its directory name holds the batch, optimizer, factor, seed, steps,
    groups and dropout, not the samples' LR rule, model, sequence, held-out share or evaluation)."""
    saved_file = run_dir / "study_config.json"
    if not saved_file.is_file():
        return  # finished before runs kept their config: nothing to compare
    saved, now = _settings(json.loads(saved_file.read_text())), _settings(cfg)
    differ = sorted(k for k in saved.keys() | now.keys() if saved.get(k) != now.get(k))
    if differ:
        shown = "; ".join(f"{k}: {saved.get(k)!r} there, {now.get(k)!r} here" for k in differ[:6])
        raise SystemExit(f"{run_dir}: a finished run with other settings than this study's ({shown}): give the "
                         "settings it ran with, another --work, or remove the directory to run it again")


def same_data(run_dir: Path, what: str, recorded: str | None, data: Path, seed: int, args: argparse.Namespace) -> None:
    """A run in ``--work`` is read back (``what``: finished) or resumed (paused) only where the data
    it read (``recorded``: its fingerprint) is the data prepared in ``data`` now: ``prepare`` writes
    another vocabulary size or source of a corpus name into the same directory, and ``same_settings``
    leaves the data's path aside. Else the study stops naming both fingerprints."""
    here = data_fingerprint(data, seed, getattr(args, "heldout_fraction", None))
    if recorded is not None and here is not None and recorded != here:
        raise SystemExit(f"{run_dir}: a {what} run of other data than this study's (fingerprint {recorded} there, "
                         f"{here} in {data}: another --vocab-size, corpus or Python's embedded corpus prepared "
                         "there since): give another --work, or remove the directory to run it again")


def plan_run(label: str, corpus: str, data: Path, batch: int, factor: float, seed: int, args: argparse.Namespace,
             params: dict | None = None, phase_extra: dict | None = None) -> dict | Launch | None:
    """One job run: its result when it finished before (here, or in ``args.reused``), else the
    ``Launch`` that runs it; None when it never ran and ``args.only_finished`` is set. ``params``
    replace the label's optimizer parameters, ``phase_extra`` is merged into the phase (e.g.
    ``adaptive_batch``)."""
    reused = getattr(args, "reused", {}).get((corpus, batch, label, factor, seed))
    if reused is not None:
        return reused
    steps = steps_for(batch, args.samples, getattr(args, "min_steps", None))
    run_dir = args.work / "runs" / corpus / f"b{batch}" / label.replace(" ", "_") / f"lr{factor:g}" / (
        f"seed{seed}" if steps == args.samples // batch else f"seed{seed}-steps{steps}")  # a raised budget: its own
    micro = micro_batch_for(batch, args)
    if getattr(args, "groups", None) is not None:  # another split of the same batch: another run
        run_dir = run_dir.with_name(f"{run_dir.name}-groups{args.groups}")
    dropout = getattr(args, "dropout", None)
    if dropout is not None:
        run_dir = run_dir.with_name(f"{run_dir.name}-dropout{dropout:g}")
    cfg = base_config(args.seq_len, micro, args.ranks, args.workers, getattr(args, "model", "tiny"))
    lr = lr_for(batch, args) * factor
    chosen = dict(OPTIMIZERS[label] if params is None else params)
    cfg["optimizer"]["type"] = chosen.pop("type", cfg["optimizer"]["type"])
    cfg["optimizer"]["params"].update(chosen)
    cfg["job"].update(seed=seed, total_steps=steps)
    if getattr(args, "eval_points", None):
        cfg["job"]["eval_every"] = max(1, steps // args.eval_points)
    cfg["job"]["data"]["path"] = str(data.resolve())
    if dropout is not None:
        cfg["job"]["model"]["overrides"] = {"hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout}
    if getattr(args, "heldout_fraction", None) is not None:
        cfg["job"]["data"]["heldout_fraction"] = args.heldout_fraction
    cfg["job"]["phases"][0].update(global_batch=batch, lr=lr, **(phase_extra or {}))
    done = run_dir / "result.json"
    if done.is_file():  # the noise scale is derived again: its definition here may be newer than the run
        same_settings(run_dir, cfg)
        result = json.loads(done.read_text())
        same_data(run_dir, "finished", result.get("data"), data, seed, args)
        if result.get("steps") != steps or not math.isclose(result.get("lr", math.nan), lr, rel_tol=1e-9):
            # a run finished before runs kept their config: its directory's name holds neither the samples
            # (a budget of samples // batch steps is named without them) nor the LR rule
            raise SystemExit(f"{run_dir}: a finished run of {result.get('steps')} steps at LR {result.get('lr')!r}, "
                             f"this study's {steps} at {lr!r}: give the settings it ran with (--samples, --lr-rule, "
                             "--base-lr), another --work, or remove the directory to run it again")
        return result | {"b_simple": read_metrics(run_dir)[1], "run_dir": str(run_dir.relative_to(args.work))}
    if (run_dir / PAUSED).is_file():  # the job would refuse its checkpoint (checkpoint.data_change), every start
        from vrgd_ds.train import checkpoints as ckpt

        tag = ckpt.choose(run_dir / "checkpoints").tag
        if tag is not None:
            same_data(run_dir, "paused", (ckpt.marker(run_dir / "checkpoints", tag).get("info") or {}).get("data"),
                      data, seed, args)
    if getattr(args, "only_finished", False):
        return None
    # the launcher through this interpreter: a DeepSpeed installed with ``pip --target`` (a GPU image's
    # packages on PYTHONPATH) has no ``deepspeed`` script beside it
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(args.ranks), "--master_port",
           "PORT", "--module", "vrgd_ds.train", "--config", str(run_dir.resolve() / "study_config.json"),
           "--run-dir", str(run_dir.resolve())]
    record = {"corpus": corpus, "batch": batch, "optimizer": label, "seed": seed, "steps": steps, "lr": lr,
              "factor": factor, "groups": batch // micro, "ranks": args.ranks, "samples": steps * batch,
              "run_dir": str(run_dir.relative_to(args.work))}  # under --work: no machine's path in the record
    return Launch(run_dir, cmd, cfg, record, data, getattr(args, "heldout_fraction", None))


def cpu_allocator() -> dict[str, str]:
    """The environment that gives a run tcmalloc (``LD_PRELOAD`` of ``libtcmalloc_minimal``, found
    by the loader's own search) where it is installed, else {} (glibc's ``malloc``). A run's
    activations are freed and allocated again every micro-step; at the study's micro-batches on
    CPUs (hundreds of samples) glibc unmaps them and faults their pages in anew each time, and
    glibc kept from doing so (``GLIBC_TUNABLES`` mmap and trim thresholds) grows the heap without
    bound (``benchmarks/cpu_allocator.py``). Results are the same bit for bit."""
    found = ctypes.util.find_library("tcmalloc_minimal")
    return {"LD_PRELOAD": found} if found else {}


def master_port(base: int | None, slot: int) -> int:
    """The rendezvous (master) port of the run in ``slot``. With ``--port``: ``base + slot``, or an
    error naming ``--port`` where something on this host already listens there (another study or
    job: the run would fail at its rendezvous). Without: a port the OS has free now, so that
    studies side by side on one machine (CPU studies, a study beside the tests) never meet on one."""
    with socket.socket() as s:
        # as the rendezvous store binds: a port whose last connections are in TIME_WAIT is free
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if base is None:
            s.bind(("", 0))
            return s.getsockname()[1]
        port = base + slot
        try:
            s.bind(("", port))
        except OSError as e:
            raise SystemExit(f"--port {base}: port {port} (run slot {slot}) is in use on this host ({e.strerror}): "
                             "another study or job listens there; give another --port, or none to take free "
                             "ports") from None
        return port


class Runner:
    """Runs planned ``Launch``es, up to ``--parallel`` at a time (each on its own master port; on
    CPUs, each with an equal share of the cores unless ``OMP_NUM_THREADS`` is set), within the
    study's ``--time-limit``: a run starts only while the time left holds it and what the runs in
    flight still have to train, together, at the machine's rate (``aggregate_rate``: the runs side
    by side share it, so a run started beside others slows them), and runs still going when the
    limit comes are paused
    (SIGUSR1 to their ranks: each finishes its step, the job checkpoints and exits, as before a
    Slurm time limit), their directories kept; the next start of the same run in the same work
    directory (another call of a lease, the next lease or session) resumes it from there, and its
    record sums its segments. A run that has checkpointed but not exited by then is stopped and kept
    as paused; one that did not checkpoint in time (``lead``) is stopped and removed, the end of its
    log printed, unless it was resumed: that one is kept at the checkpoint it resumed from (a pause
    in its start-up, before the job handles SIGUSR1, ends it so); one that crashed meanwhile is a
    failed run (``collect``). SIGUSR1 to the study (``pause_on_signal``) pauses its runs in flight the same way at
    once and starts no more, so a study without a time limit (a long CPU run) can be stopped from
    outside and resumed later. Its runs get tcmalloc where it is installed (``cpu_allocator``)
    unless ``LD_PRELOAD`` is set. The study always assembles what finished and lists the rest as not
    run. A failed run ends with the end of its log printed; the others go on (``collect``)."""

    #: seconds of the time limit kept for assembling the tables and the record
    ASSEMBLY_S = 15.0
    #: seconds of the time limit kept for pausing the runs still going (a step and a checkpoint); a run
    #: whose steps take longer is signalled earlier (``lead``)
    PAUSE_S = 45.0

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.parallel = max(1, getattr(args, "parallel", 1))
        limit = getattr(args, "time_limit", None)
        self.stop_at = None if limit is None else args.started + limit - self.ASSEMBLY_S - self.PAUSE_S
        # the machine's samples/s each finished run showed (``collect``), shared by a study's Runners (rounds)
        self.rates: list[float] = vars(args).setdefault("run_rates", [])
        self.load: dict[int, float] = {}  # launch index -> ∫ runs in flight dt over its time so far
        self.resumed: set[int] = set()  # launch indices resumed from a pause: their segment's rate is mostly start-up
        self.timed_out = False  # the time limit paused the runs in flight
        self.not_started: list[Path] = []
        self.stopped: list[dict] = vars(args).setdefault("stopped", [])  # Launch.progress of each run stopped
        self.failed: list[dict] = vars(args).setdefault("failed", [])  # each failed run, with its log's end
        # before any run starts: the versions' imports take seconds, which would otherwise fall
        # between a run's end and the time taken of the runs finishing beside it
        self.machine = hardware(machine())
        self.env = dict(os.environ)
        if "LD_PRELOAD" not in self.env:  # one the caller set is kept
            self.env.update(cpu_allocator())
        if self.parallel > 1 and "OMP_NUM_THREADS" not in self.env:
            self.env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // (self.parallel * args.ranks)))

    def lead(self, launches: list[Launch], active: dict) -> float:
        """Seconds before the end of the pause window to signal the active runs: ``PAUSE_S``, or twice
        the slowest run's step and 15 s for the checkpoint when that is longer (a signal waits for
        the step in flight: a 16× CPU step of about 70 s never paused within 45 s)."""
        now, mono = time.time(), time.monotonic()
        worst = max((launches[i].step_s(since=now - (mono - t0)) or 0.0 for i, _, t0, *_ in active.values()),
                    default=0.0)
        return max(self.PAUSE_S, 2 * worst + 15.0)

    def aggregate_rate(self) -> float | None:
        """The machine's samples/s over all the runs side by side, which they share: the lowest that
        a finished run showed (its rate times the runs in flight beside it on average, itself
        included), or before any has finished ``--expect-rate`` × ``--expect-share`` (a run's rate
        when that many ran side by side; by default ``--parallel``); None without either. It
        assumes the machine's rate does not fall with fewer runs: one run alone takes the whole of
        it (on a GPU, while one run's kernels keep it busy)."""
        if self.rates:
            return min(self.rates)
        expect = getattr(self.args, "expect_rate", None)
        if not expect:
            return None
        return expect * (getattr(self.args, "expect_share", None) or self.parallel)

    def fits(self, launch: Launch, beside: Sequence[Launch] = ()) -> bool:
        """Whether the time left holds the run and what the runs in flight (``beside``) still have to
        train, all at the machine's rate (``aggregate_rate``; with none known every run fits until
        one finishes)."""
        if self.stop_at is None:
            return True
        left = self.stop_at - time.monotonic()
        rate = self.aggregate_rate()
        if left <= 0 or rate is None:
            return left > 0
        return (launch.samples_left() + sum(b.samples_unsent() for b in beside)) / rate < left

    def run(self, launches: list[Launch], record: Callable[[dict], None] | None = None) -> list[dict | None]:
        """The results in the order of ``launches`` (each also handed to ``record`` as it finishes);
        None for a run the time limit left out."""
        results: list[dict | None] = [None] * len(launches)
        pending = list(range(len(launches)))
        if self.args.port is not None:  # every slot's port before any run starts: a failure would stop the others
            for slot in range(min(self.parallel, len(launches))):
                master_port(self.args.port, slot)
        active: dict[int, tuple[int, subprocess.Popen, float, Any]] = {}  # slot -> (index, process, start, log)
        lead, lead_at, tick = self.PAUSE_S, 0.0, time.monotonic()
        try:
            while pending or active:
                if getattr(self.args, "pause_requested", False):
                    print("SIGUSR1: pausing the runs in flight (each checkpoints), then assembling what finished",
                          flush=True)
                    self.not_started += [launches[i].run_dir for i in pending]
                    pending.clear()
                    if active:  # no time limit to keep: each run's step in flight ends, however long
                        self.pause_active(launches, active, results, record, None, "SIGUSR1")
                    break
                for slot in range(self.parallel):
                    if slot in active or not pending:
                        continue
                    beside = [launches[i] for i, *_ in active.values()]
                    while pending and not self.fits(launches[pending[0]], beside):
                        self.not_started.append(launches[pending.pop(0)].run_dir)
                    if pending:
                        i = pending.pop(0)
                        if launches[i].segments():
                            self.resumed.add(i)
                        active[slot] = (i, *self.start(launches[i], slot))
                        self.load[i] = 0.0
                time.sleep(0.2)
                tick = self.tick(active, tick)
                self.collect(launches, active, results, record)
                if self.stop_at is not None and active and time.monotonic() - lead_at > 10.0:
                    lead, lead_at = self.lead(launches, active), time.monotonic()
                if self.stop_at is not None and active and time.monotonic() > self.stop_at + self.PAUSE_S - lead:
                    self.timed_out = True
                    self.pause_active(launches, active, results, record,
                                      self.stop_at + self.PAUSE_S - time.monotonic(), "--time-limit")
                    break
        finally:
            stop(*(proc for _, proc, _, _ in active.values()))  # a failure elsewhere or the time limit: the rest
            for i, proc, _, log in active.values():
                log.close()
                if not launches[i].segments():  # a run resumed from a pause keeps its checkpoint and segments
                    shutil.rmtree(launches[i].run_dir, ignore_errors=True)
        requested = getattr(self.args, "pause_requested", False)
        if self.not_started:
            why = "SIGUSR1: paused" if requested else "--time-limit: the time left would not hold them"
            print(f"{why}: {len(self.not_started)} run(s) not started (the first: {self.not_started[0]})", flush=True)
        if requested or self.timed_out or (self.stop_at is not None and time.monotonic() > self.stop_at):
            self.args.only_finished = self.args.time_over = True  # the time is over: later cells assemble from
            # what finished
        return results

    def tick(self, active: dict, since: float) -> float:
        """Adds the runs in flight since ``since`` to each active run's ``load``; returns now."""
        now = time.monotonic()
        for i, *_ in active.values():
            self.load[i] = self.load.get(i, 0.0) + (now - since) * len(active)
        return now

    def collect(self, launches: list[Launch], active: dict, results: list[dict | None],
                record: Callable[[dict], None] | None, paused: bool = False) -> None:
        """Takes the runs that ended out of ``active``: each result into ``results`` (and to
        ``record``), the machine's rate it showed into ``self.rates`` (this segment's samples over
        its time, times the runs in flight beside it on average). A failed run goes to ``self.failed``
        with its log's last lines, which are printed, and the others go on: the study assembles what
        finished and then exits 1 (``main``). After a pause (``paused``), a run the pause's signal
        ended in its start-up (``ENDED_BY_SIGUSR1``), or that checkpointed and exited only after the
        pause judged it (``EXIT_REQUEUE``), is left for the caller to remove, as the pause said.
        Outside a pause, a run that checkpointed and exited for a ``SIGUSR1`` sent to its ranks from
        outside the study (``requeue.json`` written) is paused, not failed: its segment is kept
        beside its checkpoint (``PAUSED``), which the next start resumes."""
        for slot, (i, proc, t0, log) in list(active.items()):
            if proc.poll() is None or (paused and proc.returncode in (*ENDED_BY_SIGUSR1, EXIT_REQUEUE)):
                continue
            log.close()
            del active[slot]
            if proc.returncode == EXIT_REQUEUE and (launches[i].run_dir / "requeue.json").is_file():
                got = self.keep_paused(launches[i], i, t0)
                self.stopped.append(got)
                print(f"run paused by a signal from outside the study at step {got['step']} of {got['steps']}: "
                      f"{launches[i].run_dir} (checkpoint kept: the next start resumes it)", flush=True)
                continue
            if proc.returncode not in (0, EXIT_DIVERGED):
                path = launches[i].run_dir / "log.txt"
                tail = path.read_text(errors="replace").splitlines()[-40:] if path.is_file() else []
                print(f"run failed ({proc.returncode}): {path} (kept); the other runs go on, and the study exits 1 "
                      "once it has assembled what finished. The log's end:", flush=True)
                print("".join(f"    | {line}\n" for line in tail), end="", flush=True)
                self.failed.append({"run": str(launches[i].run_dir), "returncode": proc.returncode, "log_tail": tail})
                continue
            wall, samples = max(time.monotonic() - t0, 1e-3), launches[i].samples_left()  # this segment's
            results[i] = launches[i].result(wall, self.machine, diverged=proc.returncode == EXIT_DIVERGED)
            if record is not None:
                record(results[i])
            if i not in self.resumed:  # a resumed segment's few steps after its start-up would set the rate
                self.rates.append(samples / wall * max(self.load.get(i, 0.0) / wall, 1.0))

    def progress(self, launch: Launch, i: int, t0: float) -> dict:
        """``launch.progress`` of the segment started at ``t0``, with the runs side by side."""
        got = launch.progress(time.monotonic() - t0)
        got["side_by_side"] = round(self.load.get(i, 0.0) / max(got["wall_s"], 1e-3), 2)  # with its rate: the machine's
        return got

    def keep_paused(self, launch: Launch, i: int, t0: float) -> dict:
        """A run that checkpointed and exited: this segment (begun at ``t0``) added to its ``PAUSED``
        file, beside the segments before it; returns its progress."""
        got = self.progress(launch, i, t0)
        got["paused"] = True
        segment = {"machine": self.machine, "wall_s": got["wall_s"], "step": got["step"], "samples": got["samples"]}
        (launch.run_dir / PAUSED).write_text(json.dumps(launch.segments() + [segment]))
        return got

    def pause_active(self, launches: list[Launch], active: dict, results: list[dict | None],
                     record: Callable[[dict], None] | None, wait_s: float | None, why: str) -> None:
        """Pauses every active run (``pause``), then takes out of ``active`` the runs that finished,
        diverged or failed while it waited (``collect``); what is left there, a run the pause
        stopped before it checkpointed, the caller stops and removes."""
        for slot in self.pause(launches, active, wait_s, why):
            del active[slot]
        self.collect(launches, active, results, record, paused=True)

    def pause(self, launches: list[Launch], active: dict, wait_s: float | None, why: str = "--time-limit") -> list[int]:
        """At the time limit (or on ``why``): SIGUSR1 to every active run's ranks, then up to ``wait_s`` (None:
        until it exits, as for the study's own SIGUSR1) for each job to checkpoint and exit
        (``requeue.json`` in its directory). A paused run's segment is
        added to its ``PAUSED`` file; a resumed run that did not checkpoint again keeps the file as
        it was. A run that ended on its own meanwhile (finished, diverged, or failed: any exit but
        the checkpoint's or the signal's own, ``ENDED_BY_SIGUSR1``) is left to the caller. Every other
        active run's progress goes to ``self.stopped``, and is printed. Returns the slots of the runs
        paused (the rest are stopped by the caller)."""
        signalled = set()
        for slot, (i, proc, _, _) in active.items():
            ranks = rank_pids(proc.pid)
            for pid in ranks:
                try:
                    os.kill(pid, signal.SIGUSR1)
                except ProcessLookupError:
                    continue
            if ranks:
                signalled.add(slot)
        deadline, paused = None if wait_s is None else time.monotonic() + max(wait_s, 0.0), []
        since = time.monotonic()
        for slot, (i, proc, t0, log) in active.items():
            if slot in signalled:
                try:
                    proc.wait(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        self.tick(active, since)  # the wait is in each run's wall time: the runs beside it count through it
        # the runs that have checkpointed first: stopping one (up to 20 s) gives the rest that long
        # to finish their checkpoints before they are judged
        order = sorted(active.items(), key=lambda kv: not (launches[kv[1][0]].run_dir / "requeue.json").is_file())
        for slot, (i, proc, t0, log) in order:
            launch = launches[i]
            code = proc.poll()  # before the marker: one written after this poll is seen, with the run still going
            marked = (launch.run_dir / "requeue.json").is_file()
            if code is not None and not marked and code not in ENDED_BY_SIGUSR1:
                continue  # it finished its last step, diverged or crashed meanwhile: the caller records it
            earlier = launch.segments()  # the segments before this one: a resumed run's checkpoint
            if proc.poll() is None and (marked or earlier):  # checkpointed (the marker follows the complete
                stop(proc, grace=20.0)  # save), or resumed from one: either way kept, so stopped, not left running
            if proc.poll() is not None and marked:
                got = self.keep_paused(launch, i, t0)
                log.close()
                paused.append(slot)
            else:
                got = self.progress(launch, i, t0)
                if earlier:  # resumed, stopped before it checkpointed again (e.g. in its start-up): the
                    # checkpoint it resumed from still stands, and its segments; this segment is lost
                    got.update(paused=True, step=earlier[-1]["step"], samples=earlier[-1]["samples"])
                    log.close()
                    paused.append(slot)
            self.stopped.append(got)
            rate = "–" if got["samples_per_s"] is None else (f"{got['samples_per_s']:,.0f} samples/s, "
                                                             f"{got['side_by_side']:g} run(s) side by side")
            if got["data_wait"] is not None:
                rate += f", {100 * got['data_wait']:.1f}% of the step time waiting for data"
            what = ("paused (checkpoint kept: the next start resumes it)" if marked and got["paused"] else
                    "stopped before it checkpointed again, kept at its last checkpoint (the next start resumes "
                    "it there)" if got["paused"] else "stopped, removed")
            print(f"{why}: {launch.run_dir} {what} at step {got['step']} of {got['steps']} after "
                  f"{got['wall_s']:.0f} s (start-up {got['setup_s']} s, then {rate})", flush=True)
            if not got["paused"]:  # the directory goes: its log's end says where the pause got to
                tail = (launch.run_dir / "log.txt").read_text(errors="replace").splitlines()[-15:] \
                    if (launch.run_dir / "log.txt").is_file() else []
                print("".join(f"    | {line}\n" for line in tail), end="", flush=True)
        return paused

    def start(self, launch: Launch, slot: int) -> tuple[subprocess.Popen, float, Any]:
        port = str(master_port(self.args.port, slot))  # before the run's directory is touched
        done, recorded = launch.segments(), launch.run_dir / "study_config.json"
        # paused at a time limit with the settings it would run with now (how its data is read may differ)
        resume = bool(done) and recorded.is_file() and _settings(json.loads(recorded.read_text())) == _settings(
            launch.config)
        if resume:  # the job resumes from its checkpoint
            print(f"resuming {launch.run_dir} from step {done[-1]['step']}", flush=True)
        elif launch.run_dir.exists():  # an interrupted run, or one paused with other settings: from scratch
            if done:
                print(f"{launch.run_dir}: paused with other settings than this study's: it starts again from step 0",
                      flush=True)
            shutil.rmtree(launch.run_dir)
        (launch.run_dir / "requeue.json").unlink(missing_ok=True)  # the last pause's: not this segment's
        launch.run_dir.mkdir(parents=True, exist_ok=True)
        (launch.run_dir / "study_config.json").write_text(json.dumps(launch.config, indent=2))
        cmd = [port if part == "PORT" else part for part in launch.cmd]
        log = open(launch.run_dir / "log.txt", "a" if resume else "w")
        # in the run's directory: ``python -m`` puts the working directory first on sys.path, and in a
        # checkout that is not installed (a GPU image: benchmarks/source_tree.sh on PYTHONPATH) the
        # checkout's own vrgd_ds/ would shadow the laid-out package, whose data_pipeline it lacks
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True,
                                cwd=launch.run_dir)
        return proc, time.monotonic(), log


def pause_on_signal(args: argparse.Namespace) -> None:
    """SIGUSR1 to the study pauses it (``Runner``): its runs in flight checkpoint and exit (their
    directories kept: the next start in the same ``--work`` resumes them), no run starts after,
    and the study assembles what finished, as at ``--time-limit``. The runs are in sessions of
    their own, so the signal reaches the study alone."""
    def request(signum: int, frame: Any) -> None:  # only the flag: the Runner says what it does
        args.pause_requested = True

    signal.signal(signal.SIGUSR1, request)
    end_on_sigterm()


def end_on_sigterm() -> None:
    """SIGTERM to the study (``timeout``'s, as ``benchmarks/gpu_suite.sh`` stops a part) ends it
    at once, as a failure would: ``Runner.run`` stops its runs in flight, whose sessions of their
    own the signal does not reach (those not resumed from a checkpoint are removed), and the study
    exits 143: no run outlives it on the machine the next parts time."""
    def end(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, end)


def run_one(label: str, corpus: str, data: Path, batch: int, factor: float, seed: int,
            args: argparse.Namespace, params: dict | None = None, phase_extra: dict | None = None) -> dict | None:
    """``plan_run``, and the run itself when it has not finished before (alone, in this process)."""
    planned = plan_run(label, corpus, data, batch, factor, seed, args, params, phase_extra)
    return Runner(args).run([planned])[0] if isinstance(planned, Launch) else planned


def run_all(cells: list[tuple], args: argparse.Namespace, record: Callable[[dict], None]) -> list[dict]:
    """``plan_run`` for each cell's arguments (label, corpus, data, batch, factor, seed), the new
    runs through one ``Runner`` (``--parallel`` at a time): the results there are, each handed to
    ``record`` as soon as it is there (a study stopped from outside keeps the runs that finished)."""
    planned = [plan_run(*cell, args) for cell in cells]
    done = [p for p in planned if isinstance(p, dict)]
    for r in done:
        record(r)
    launches = [p for p in planned if isinstance(p, Launch)]
    return done + [r for r in (Runner(args).run(launches, record) if launches else []) if r is not None]


def recorded(reused: dict[RunKey, dict], corpus: str, batch: int, label: str, seeds: list[int]) -> bool:
    """Whether ``reused`` holds ``label``'s run at ``batch`` and the ×1 LR for every seed."""
    return all((corpus, batch, label, 1.0, seed) in reused for seed in seeds)


def probe_label(labels: list[str], reused: dict[RunKey, dict], corpus: str, batch: int, seeds: list[int]) -> str | None:
    """The VR optimizer whose runs at ``batch`` measure ``B_simple``: one whose probe runs are
    recorded already (among ``labels`` first, then any), else the first VR optimizer in ``labels``.
    A study that runs some of a record's optimizers reuses its probe rather than starting another."""
    vr = [lab for lab in labels if lab in BASELINE] + [lab for lab in BASELINE if lab not in labels]
    done = next((lab for lab in vr if recorded(reused, corpus, batch, lab, seeds)), None)
    return done or next((lab for lab in labels if lab in BASELINE), None)


def noise_batches(multiples: list[float], noise_scale: float, granularity: int) -> list[int]:
    """Global batches at ``multiples`` × ``noise_scale`` (``B_simple``, samples), each rounded to a
    multiple of ``granularity`` (ranks × micro-batch; halves round up), at least one."""
    return [max(granularity, int(m * noise_scale / granularity + 0.5) * granularity) for m in multiples]


def measured_noise_scale(results: list[dict | None], batch: int, seeds: Sequence[int] | None = None
                         ) -> float | None:
    """The mean ``B_simple`` the VR runs at ``batch`` measured; None until one has (with ``seeds``:
    until one has on every seed, so that the grid's batches do not depend on which seeds a time
    limit let finish)."""
    measured = [r for r in results if r is not None and r["batch"] == batch and r.get("b_simple") is not None]
    if not measured or (seeds is not None and set(seeds) - {r["seed"] for r in measured}):
        return None
    return mean(r["b_simple"] for r in measured)


def unigram_loss(data: Path, seed: int, seq_len: int, count: int, heldout_fraction: float | None = None,
                 ranks: int = 1) -> float:
    """The held-out MLM loss of the unigram model: every masked token predicted with its frequency
    over the training documents (add-one smoothing). The early loss of every run sits there (the
    decoder's bias learns the unigram distribution first); a run has learned something past it
    only below it. Over the held-out samples the job evaluates on ``ranks`` ranks (the first
    ``count``, rounded down to a multiple of ``ranks``) with their epoch-0 masks
    (``vrgd_ds.train.data.eval_batches``)."""
    import numpy as np

    from vrgd_ds.data_pipeline.prepare import SAMPLES_DIR, SHARDS_DIR, TOKENIZER_FILE
    from vrgd_ds.data_pipeline.samples import build_sample_index
    from vrgd_ds.data_pipeline.shards import ShardedCorpus
    from vrgd_ds.data_pipeline.tokenizer import Tokenizer
    from vrgd_ds.train.data import JobData, eval_batches, split_document

    corpus = ShardedCorpus(data / SHARDS_DIR)
    index = build_sample_index(corpus, seq_len, seed, data / SAMPLES_DIR)  # reuses a matching index, replaces a stale one
    job_data = JobData(Tokenizer.load(data / TOKENIZER_FILE), corpus, {seq_len: index},
                       split_document(corpus.num_documents, heldout_share(heldout_fraction)), seed, None)
    train_tokens, _ = job_data.token_streams()
    text = train_tokens[train_tokens != job_data.tokenizer.sep_id]  # the documents' tokens, not the GPT's separators
    counts = np.bincount(np.asarray(text, dtype=np.int64), minlength=job_data.vocab_size) + 1.0
    log_p = np.log(counts / counts.sum())
    _, held = job_data.split(seq_len)
    labels = np.concatenate([batch["labels"].numpy().ravel() for rank in range(ranks)
                             for batch in eval_batches(held, count, count, rank, ranks)])
    return float(-log_p[labels[labels != -100]].mean())


def unbracketed(cells: dict, key: tuple[str, int, str], best: list[dict], grid: list[float]) -> str | None:
    """Why the best LR factor of ``key`` (its runs ``best``) is not bracketed, or None: both its
    neighbours on ``grid`` must have run on its seeds (``cells``: ``by_factor``); one at the grid's
    end is open until the grid is extended past it."""
    factor, seeds, grid = best[0]["factor"], {r.get("seed") for r in best}, sorted(set(grid))  # as typed: unsorted
    run = {f for f, rs in cells.get(key, {}).items() if {r.get("seed") for r in rs} >= seeds}
    if factor not in grid:
        return f"{key[2]}'s best LR ×{factor:g} is off the grid (×{grid[0]:g}–×{grid[-1]:g})"
    i = grid.index(factor)
    gaps = [f"×{grid[j]:g}" for j in (i - 1, i + 1) if 0 <= j < len(grid) and grid[j] not in run]
    why = [f"has {' and '.join(gaps)} beside it on the grid not run on {len(seeds)} seeds"] if gaps else []
    if i in (0, len(grid) - 1):
        side, where = ("lowest", "below") if i == 0 else ("highest", "above")
        why.append(f"is the grid's {side} factor (×{grid[0]:g}–×{grid[-1]:g}): extend --lr-factor {where} it")
    return f"{key[2]}'s best LR ×{factor:g} {', and '.join(why)}" if why else None


def verdicts(best: dict, corpus: str, batches: list[int], label: str, baseline: str,
             unigram: float | dict[int, float] | None, cells: dict | None = None,
             grid: list[float] | None = None) -> list[tuple]:
    """Per batch: ``label`` against ``baseline`` at each one's best LR. A verdict needs 2 seeds each,
    each one's best LR bracketed on ``grid`` (when ``cells``, ``by_factor``, is given:
    ``unbracketed``) and each of the baseline's runs ending below the unigram level of its seed's
    held-out masks (``unigram``: per seed, or one level for every seed; None, or a seed without
    one, decides nothing: not computed), the same seeds in both arms, and no seed diverged at a
    best LR where another did not; it is "better" or "worse" only when the seed ranges do not
    overlap. Beside it, ``label``'s loss less the baseline's seed by seed (a seed's runs read the
    same samples and masks under every optimizer). A batch not decided says everything it misses.
    Then the baseline's degradation from the first batch to the last and the share of it
    ``label`` recovers there: "not decided" unless both ends' verdicts are, with the end rows'
    reasons."""
    rows = []
    for batch in batches:
        vr, base = best.get((corpus, batch, label)), best.get((corpus, batch, baseline))
        arms = ((baseline, base), (label, vr))
        missing = [name for name, rs in arms if rs is None or len(rs) < 2]
        why = [f"{' and '.join(missing)} {'lacks' if len(missing) == 1 else 'lack'} 2 seeds"] if missing else []
        seeds = [sorted({r.get("seed") for r in rs}, key=str) for _, rs in arms if rs]
        if not missing and seeds[0] != seeds[1]:  # each seed has its own samples and masks: compare like with like
            why.append(f"not the same seeds ({baseline} {', '.join(map(str, seeds[0]))}; "
                       f"{label} {', '.join(map(str, seeds[1]))})")
        for name, rs in arms:  # a seed diverged at the best LR and another not: no difference (+inf) to give
            gone = [str(r.get("seed")) for r in rs or [] if not math.isfinite(r["mlm_loss"])]
            if rs and 0 < len(gone) < len(rs):
                why.append(f"{name} diverged on seed {', '.join(gone)} at its best LR")
        if cells is not None:
            why += [edge for name, rs in arms if rs and len(rs) >= 2
                    if (edge := unbracketed(cells, (corpus, batch, name), rs, grid or sorted(cells.get(
                        (corpus, batch, name), {}))))]
        shown = [spread([r["mlm_loss"] for r in rs], "{:.3f}") if rs and len(rs) >= 2 else "–" for rs in (base, vr)]
        paired = by_seed(base or [], vr or [])
        if why:
            rows.append((corpus, batch, *shown, paired, "–", f"not decided: {'; '.join(why)}"))
            continue
        lv, lb = [r["mlm_loss"] for r in vr], [r["mlm_loss"] for r in base]
        diff = mean(lv) - mean(lb)
        levels = [unigram.get(r["seed"]) if isinstance(unigram, dict) else unigram for r in base]
        below = None if None in levels else min(u - r["mlm_loss"] for u, r in zip(levels, base))
        if below is None:  # a verdict past the plateau needs the baseline below it: not known, none given
            verdict = "not decided: the unigram level is not computed (no prepared data)"
        elif below <= 0:
            verdict = f"not decided: {baseline} ends {-below:.3f} nats above the unigram level"
        elif max(lv) < min(lb):
            verdict = f"{label} better by {-diff:.3f} nats (seed ranges apart)"
        elif min(lv) > max(lb):
            verdict = f"{label} worse by {diff:.3f} nats (seed ranges apart)"
        else:
            verdict = f"no difference beyond the seeds ({diff:+.3f} nats)"
        rows.append((corpus, batch, *shown, paired, "–" if below is None else f"{below:.3f}", verdict))
    if len(batches) < 2:
        return rows
    span = f"{batches[0]} → {batches[-1]}"
    # the share counts only between batches whose verdicts are decided (2 seeds each, past the
    # plateau, best LRs bracketed): otherwise the losses it divides are not the ones the verdicts
    # stand on; the end rows say why not
    ends = {row[1]: str(row[-1]) for row in (rows[0], rows[-1]) if str(row[-1]).startswith("not decided")}
    undecided = "not decided: " + "; ".join(f"batch {batch}: {why.removeprefix('not decided: ')}"
                                            for batch, why in ends.items())
    first, last = best.get((corpus, batches[0], baseline)), best.get((corpus, batches[-1], baseline))
    vr_last = best.get((corpus, batches[-1], label))
    if any(not rs or len(rs) < 2 for rs in (first, last, vr_last)):  # no loss to show either
        rows.append((corpus, span, "–", "–", "", "", undecided))
        return rows
    lost = mean(r["mlm_loss"] for r in last) - mean(r["mlm_loss"] for r in first)
    won = mean(r["mlm_loss"] for r in last) - mean(r["mlm_loss"] for r in vr_last)
    share = (undecided if ends else f"recovered share {won / lost:.0%}" if lost > 0 else
             "recovered share – (no degradation)")
    samples = [rs[0].get("samples") for rs in (first, last)]
    if None not in samples and samples[0] != samples[1]:  # --min-steps: the larger batch trained on more samples
        share += f" (not at equal samples: {samples[0]:,} and {samples[1]:,})"
    rows.append((corpus, span, f"{baseline} loses {lost:+.3f}", f"{label} recovers {won:+.3f}", "", "", share))
    return rows


def by_seed(base: list[dict], other: list[dict]) -> str:
    """``other``'s loss less ``base``'s for each seed both ran ("1: +0.061, 2: +0.076"), or "–"."""
    losses = [{r.get("seed"): r["mlm_loss"] for r in rs} for rs in (base, other)]
    seeds = [seed for seed in losses[0] if seed is not None and seed in losses[1]]
    if not seeds or any(len(d) != len(rs) for d, rs in zip(losses, (base, other))):
        return "–"
    return ", ".join(f"{seed}: {losses[1][seed] - losses[0][seed]:+.3f}" for seed in sorted(seeds))


def unrun_cells(results: list[dict], corpora: list[str], batches: list[int], labels: list[str],
                factors: list[float], seeds: list[int]) -> list[str]:
    """The grid's runs that neither ran nor were reused, one line each."""
    done = {run_key(r) for r in results}
    return [f"{c} b{b} {lab} ×{f:g} seed {s}" for c in corpora for b in batches for lab in labels for f in factors
            for s in seeds if (c, b, lab, f, s) not in done]


def bracket_step(runs: dict[float, list[dict]], start: float, seeds: list[int],
                 grid: list[float]) -> tuple[list[tuple[float, int]], float | None]:
    """One optimizer's bracket at one batch (``runs``: LR factor -> its runs): the (factor, seed)
    runs it needs next, and the factor it settled on (None while it needs any). Its factors in
    play are ``start`` and every factor of ``grid`` it ran; first each of them on every seed, then
    the grid's factors beside its best mean loss that are not in play (a gap between factors run
    counts: the optimum may lie in it); it has settled when both are in play, or one is past the
    grid's end (``unbracketed`` then asks for a wider grid)."""
    in_play = sorted({start} | {f for f in runs if f in grid})
    missing = [(f, seed) for f in in_play for seed in seeds if seed not in {r["seed"] for r in runs.get(f, [])}]
    if missing:
        return missing, None
    best = min(in_play, key=lambda f: (ranked_loss(r for r in runs[f] if r["seed"] in seeds), f))
    i = grid.index(best)
    grow = [grid[j] for j in (i - 1, i + 1) if 0 <= j < len(grid) and grid[j] not in in_play]
    return [(f, seed) for f in grow for seed in seeds], None if grow else best


def bracket_plan(cells: dict[tuple[str, int, str], dict[float, list[dict]]], corpus: str, batch: int,
                 labels: list[str], seeds: list[int], grid: list[float],
                 start: float | dict[str, float]) -> list[tuple[str, float, int]]:
    """The runs (optimizer, LR factor, seed) ``--bracket`` needs next at ``batch`` (``cells``:
    ``by_factor``), [] when every optimizer's best factor is bracketed or at the grid's edge.
    Each optimizer on the same grid, each bracketed on its own (``bracket_step``) from ``start``
    (one factor, or one per optimizer: ``carried_starts``)."""
    return [(label, f, seed) for label in labels
            for f, seed in bracket_step(cells.get((corpus, batch, label), {}),
                                        start[label] if isinstance(start, dict) else start, seeds, grid)[0]]


def nearest(grid: list[float], want: float) -> float:
    """The grid's factor nearest ``want`` on a log scale; halfway between two, the lower (a stall
    at the plateau is what too high an LR costs)."""
    return min(grid, key=lambda g: (round(abs(math.log(g / want)), 9), g))


def carried_starts(cells: dict, corpus: str, batches: list[int], labels: list[str], seeds: list[int],
                   grid: list[float], start: float, lr_of: Callable[[int], float]) -> dict[int, dict[str, float]]:
    """``--bracket-carry``: each batch's starting factor per optimizer. The smallest batch starts at
    ``start``; each larger one at the LR the batch below settled on for that optimizer
    (``bracket_step``), or, while it has not, at the LR the batch below starts from (before rounding),
    as a factor of this batch's rule LR (``lr_of``), the grid's nearest (``nearest``). The LR
    rule's growth with the batch is then a guess the bracket corrects from below, not the place
    every batch starts."""
    starts: dict[int, dict[str, float]] = {}
    below, wanted = None, {}
    for batch in sorted(batches):
        here = {}
        for label in labels:
            if below is not None:
                f = bracket_step(cells.get((corpus, below, label), {}), starts[below][label], seeds, grid)[1] \
                    or wanted[label]
                wanted[label] = f * lr_of(below) / lr_of(batch)
            else:
                wanted[label] = start
            here[label] = nearest(grid, wanted[label])
        starts[batch], below = here, batch
    return starts


def run_bracketed(name: str, data: Path, batches: list[int], labels: list[str], seeds: list[int],
                  grid: list[float], args: argparse.Namespace, record: Callable[[dict], None]) -> tuple[list[dict], list[str]]:
    """``--bracket``: every run of the grid that finished before (here or reused), then rounds of
    the runs ``bracket_plan`` asks for at each batch, each round through one ``Runner``, until it
    asks for none, asks again for runs the time limit left out, or the time is over. Returns the
    results and the runs needed next, one line each (the record's "unrun")."""
    only = getattr(args, "only_finished", False)
    args.only_finished = True  # gather what finished: nothing runs yet
    planned = [plan_run(label, name, data, batch, f, seed, args) for batch in batches for label in labels
               for f in grid for seed in seeds]
    args.only_finished = only
    results = [p for p in planned if isinstance(p, dict)]
    for r in results:
        record(r)

    def needed() -> list[tuple]:
        cells = by_factor(results)
        starts = (carried_starts(cells, name, batches, labels, seeds, grid, args.bracket, lambda b: lr_for(b, args))
                  if getattr(args, "bracket_carry", False) else {batch: args.bracket for batch in batches})
        return [(label, name, data, batch, f, seed) for batch in batches
                for label, f, seed in bracket_plan(cells, name, batch, labels, seeds, grid, starts[batch])]

    tried: set[tuple] = set()
    while not args.only_finished and (cells := [c for c in needed() if c not in tried]):
        tried |= set(cells)
        results += run_all(cells, args, record)
    return results, [f"{name} b{batch} {label} ×{f:g} seed {seed}" for label, _, _, batch, f, seed in needed()]


def by_factor(results: list[dict]) -> dict[tuple[str, int, str], dict[float, list[dict]]]:
    """(corpus, batch, optimizer) -> LR factor -> the runs (one per seed)."""
    cells: dict[tuple[str, int, str], dict[float, list[dict]]] = {}
    for r in results:
        cells.setdefault((r["corpus"], r["batch"], r["optimizer"]), {}).setdefault(r["factor"], []).append(r)
    return cells


def best_cells(results: list[dict]) -> dict[tuple[str, int, str], list[dict]]:
    """(corpus, batch, optimizer) -> the runs (one per seed) of the LR factor with the lowest mean
    loss, among the factors with the most seeds (a factor run with fewer is not chosen on them)."""
    best = {}
    for key, runs in by_factor(results).items():
        most = max(len(rs) for rs in runs.values())
        best[key] = min((rs for rs in runs.values() if len(rs) == most), key=lambda rs: (ranked_loss(rs), rs[0]["factor"]))
    return best


def ranked_loss(runs: Iterable[dict]) -> float:
    """The mean held-out loss of ``runs`` as a bracket and the best LR rank them: +inf where one
    diverged or did not end finite (a NaN would compare as neither better nor worse). Ties go to
    the lower factor (the callers' second key)."""
    losses = [r["mlm_loss"] for r in runs]
    return mean(losses) if all(math.isfinite(x) for x in losses) else math.inf


def plot(out: Output, best: dict, corpora: list[str], batches: list[int],
         labels: list[str]) -> None:
    """Top: held-out loss at the best LR per batch, with the corpus's unigram level
    (``out.meta["unigram_loss"]``) where computed. Bottom, the noise-scale view: each VR
    optimizer's loss minus its baseline's (``BASELINE``; below 0: the GSNR scale helps) against
    the batch. The vertical line is the ``B_simple`` the batches are multiples of
    (``out.meta["noise_scale"]``, measured at the small batch), or without one the mean the runs
    measured at their best LR (it depends on how far training got: the further, the smaller
    ``|G|^2``). A corpus's panels show only the optimizers run on it."""
    pyplot = plt()
    fig, axes = pyplot.subplots(2, len(corpora), figsize=(5 * len(corpora), 6.6), squeeze=False, sharex="col")
    for col, name in enumerate(corpora):
        ax, dax = axes[0][col], axes[1][col]
        for label in labels:
            cells = [(b, [r["mlm_loss"] for r in best[name, b, label]]) for b in batches if (name, b, label) in best]
            if not cells:
                continue
            bars = ax.errorbar([b for b, _ in cells], [mean(v) for _, v in cells],
                               yerr=[[mean(v) - min(v) for _, v in cells], [max(v) - mean(v) for _, v in cells]],
                               marker="o", capsize=3, label=label)
            base = BASELINE.get(label)
            diff = [(b, mean(v) - mean(r["mlm_loss"] for r in best[name, b, base]))
                    for b, v in cells if (name, b, base) in best]
            if diff:
                dax.plot([b for b, _ in diff], [d for _, d in diff], marker="o", label=f"{label} − {base}",
                         color=bars[0].get_color())
        unigram = out.meta.get("unigram_loss", {}).get(name)
        if unigram is not None:
            ax.axhline(unigram, color="black", ls=":", lw=0.8, label=f"unigram level {unigram:.3f}")
        scale = out.meta.get("noise_scale", {}).get(name)
        if scale is not None:
            where, what = scale, f"B_simple {scale:.0f} (the ×1 batch)"
        else:
            noise = [r["b_simple"] for (corpus, _, _), rs in best.items() if corpus == name  # at each cell's best LR
                     for r in rs if r.get("b_simple") is not None]
            where, what = (mean(noise), f"mean B_simple {mean(noise):.0f} (best LRs)") if noise else (None, "")
        for a in (ax, dax):
            if where is not None:
                a.axvline(where, color="grey", ls="--", lw=0.8, label=what)
            a.legend(fontsize=7)
        dax.axhline(0.0, color="black", lw=0.6)
        ax.set(xscale="log", ylabel="held-out MLM loss (best LR)", title=name)
        dax.set(xscale="log", xlabel="global batch", ylabel="VR − baseline loss (best LR each)")
    out.savefig(fig, "bert_batch.png")


def compared(runs: list[dict], other: Path, config: dict) -> list[dict]:
    """Each of ``runs`` that ran here against the run of the same cell and seed that ``other`` (a
    study's output, e.g. from another machine) holds: both losses, their difference, and whether
    it is within 1e-3 of the loss the run trained away (its held-out loss at step 0 less its
    last: the GPU-vs-CPU test's tolerance, 1e-3 of the distance trained, carried to the loss), and
    whether both read the same data (fingerprints). ``other``'s runs must have this study's
    ``config`` settings (e.g. ``dropout``): an error names the one that differs."""
    meta = other / "meta.json"
    if not meta.is_file():
        raise SystemExit(f"--compare {other}: needs meta.json and runs.jsonl there (a study's --out directory)")
    their_config = json.loads(meta.read_text())["config"]
    for key in RUN_SETTINGS:
        if their_config.get(key) != config.get(key):
            raise SystemExit(f"--compare {other}: its runs used {key}={their_config.get(key)!r}, this study "
                             f"{config.get(key)!r}: run with its settings to compare")
    theirs = {(run_key(r), r["steps"]): r  # a cell recorded at another length is another run
              for r in map(json.loads, (other / "runs.jsonl").read_text().splitlines())}
    rows = []
    for r in runs:
        o = theirs.get((run_key(r), r["steps"]))
        if o is None or "reused_from" in r:
            continue
        drop = [c["mlm_loss"] for c in r.get("trajectory", []) if c["step"] == 0]
        tol = 1e-3 * (drop[0] - r["mlm_loss"]) if drop else None
        diff = r["mlm_loss"] - o["mlm_loss"]
        rows.append({"cell": f"{r['corpus']} b{r['batch']} {r['optimizer']} ×{r['factor']:g} seed {r['seed']}",
                     "here": r["mlm_loss"], "there": o["mlm_loss"], "difference": diff, "tolerance": tol,
                     "within": None if tol is None else abs(diff) <= tol,
                     "same_data": r.get("data") is not None and r.get("data") == o.get("data")})
    return rows


def quarters(curve: list[dict]) -> list[str]:
    """``loss (B_simple)`` at the evaluations nearest a quarter, half, three quarters and all of
    the run's samples."""
    total = curve[-1]["samples"]
    cells = []
    for q in (0.25, 0.5, 0.75, 1.0):
        point = min(curve, key=lambda c: abs(c["samples"] - q * total))
        noise = "–" if point["b_simple"] is None else f"{point['b_simple']:.0f}"
        cells.append(f"{point['mlm_loss']:.3f} ({noise})")
    return cells


def plot_trajectories(out: Output, runs: list[dict], best: dict[tuple[str, int, str], list[dict]]) -> None:
    """Held-out loss (top) and ``B_simple`` (bottom) against the samples seen (``runs``: those with a
    trajectory), one column per corpus and batch: each optimizer's runs at its best LR there
    (``best``: ``best_cells`` of every run, those with a trajectory drawn), a colour per optimizer
    and a line style per seed (the table beside it lists every run)."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import EngFormatter, MaxNLocator

    pyplot = plt()
    traced = {id(r) for r in runs}
    best = {key: drawn for key, rs in best.items() if (drawn := [r for r in rs if id(r) in traced])}
    columns = sorted({(corpus, batch) for corpus, batch, _ in best}, key=lambda cb: (
        [r["corpus"] for r in runs].index(cb[0]), cb[1]))
    optimizers = list(dict.fromkeys(r["optimizer"] for r in runs))
    seeds = sorted({r["seed"] for rs in best.values() for r in rs})
    colors = {name: f"C{k % 10}" for k, name in enumerate(optimizers)}
    styles = {seed: ("-", "--", ":", "-.")[k % 4] for k, seed in enumerate(seeds)}
    fig, axes = pyplot.subplots(2, len(columns), figsize=(2.6 * len(columns) + 1.0, 6.6), squeeze=False,
                                sharex="col", sharey="row")
    for col, (corpus, batch) in enumerate(columns):
        ax, nax = axes[0][col], axes[1][col]
        for name in optimizers:
            for r in best.get((corpus, batch, name), []):
                curve = r["trajectory"]
                style = dict(color=colors[name], ls=styles[r["seed"]], lw=1.2)
                ax.plot([c["samples"] for c in curve], [c["mlm_loss"] for c in curve], **style)
                noisy = [c for c in curve if c["b_simple"] is not None]
                nax.plot([c["samples"] for c in noisy], [c["b_simple"] for c in noisy], **style)
        factors = ", ".join(f"{name.replace('VR-LAMB ', '')} ×{best[corpus, batch, name][0]['factor']:g}"
                            for name in optimizers if (corpus, batch, name) in best)
        ax.set_title(f"{corpus} b{batch}\n{factors}", fontsize=7)
        nax.set(xlabel="training samples", yscale="log")
        nax.xaxis.set_major_locator(MaxNLocator(4))
        nax.xaxis.set_major_formatter(EngFormatter(sep=""))  # 400k, 1.6M
        for a in (ax, nax):
            a.tick_params(labelsize=7)
    axes[0][0].set_ylabel("held-out MLM loss")
    axes[1][0].set_ylabel("B_simple (samples)")
    handles = [Line2D([], [], color=colors[name], label=name) for name in optimizers] + [
        Line2D([], [], color="black", ls=styles[seed], label=f"seed {seed}") for seed in seeds]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    out.savefig(fig, "trajectories.png")


def parser() -> argparse.ArgumentParser:
    """The study's command line."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="embedded corpus, batches 16 and 64, 256 samples, "
                    "1 seed, LAMB and VR-LAMB first_moment, a 2,000-piece vocabulary: a smoke run")
    ap.add_argument("--corpus", action="append", default=None, metavar="NAME[=PATH]",
                    help="'embedded' (Python's documentation) or NAME=PATH of text files; repeatable")
    ap.add_argument("--batch", type=int, action="append", default=None,
                    help="global batch; repeatable (default 64 256 1024)")
    ap.add_argument("--seed", type=int, action="append", default=None, help="repeatable (default 1 2)")
    ap.add_argument("--optimizer", action="append", default=None, choices=list(OPTIMIZERS))
    ap.add_argument("--lr-factor", type=float, action="append", default=None,
                    help="grid around the rule's LR; repeatable (default 0.5 1 2)")
    ap.add_argument("--bracket", type=float, default=None, metavar="F",
                    help="run only the part of the --lr-factor grid that brackets each optimum: each batch starts at "
                         "factor F, then adds the grid's factors beside an optimizer's best until both have run (each "
                         "optimizer on the same grid); the record lists the runs needed next as not run")
    ap.add_argument("--bracket-carry", action="store_true",
                    help="with --bracket: each batch after the smallest starts each optimizer at the LR it settled on at "
                         "the batch below (its best factor there, bracketed on every seed), else at the LR the batch "
                         "below starts from, as the nearest factor of the grid at this batch; the rule's LR growth "
                         "is then a guess the bracket corrects from below")
    ap.add_argument("--samples", type=int, default=10240, help="training samples per run (fixed budget)")
    ap.add_argument("--min-steps", type=int, default=50,
                    help="optimizer steps per run at least: a run gets max(samples, min_steps x batch) samples")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=8, help="also the samples per GSNR group (ZeRO-2: "
                    "every micro-batch of every rank is one group)")
    ap.add_argument("--ranks", type=int, default=1, help="CPU ranks per run (the groups do not depend on it)")
    ap.add_argument("--workers", type=int, default=1, help="DataLoader workers per rank")
    ap.add_argument("--vocab-size", type=int, default=8000)
    ap.add_argument("--model", choices=("tiny", "mini", "base", "large"), default="tiny",
                    help="the job's BERT size (mini: the GPU study at 4k-32k)")
    ap.add_argument("--base-lr", type=float, default=4e-3)
    ap.add_argument("--base-batch", type=int, default=64)
    ap.add_argument("--lr-rule", choices=("linear", "sqrt"), default="sqrt")
    ap.add_argument("--port", type=int, default=None,
                    help="master port of the first run slot (slot k: PORT+k); default: a port the OS has free at "
                         "each run's start, so that studies side by side on one machine never share one")
    ap.add_argument("--work", type=Path, default=Path("runs/studies/bert_batch"),
                    help="prepared data and the runs' directories")
    ap.add_argument("--out", type=Path, default=None,
                    help="tables, plots, record (default docs/studies/bert_batch; quick: <work>/quick)")
    ap.add_argument("--reuse", type=Path, action="append", default=[], metavar="DIR",
                    help="a committed study's --out directory whose runs are read, not run again (same "
                         "settings, checked); repeatable")
    ap.add_argument("--noise-multiple", type=float, action="append", default=None, metavar="M",
                    help="batches at M × the noise scale B_simple instead of --batch; repeatable (e.g. 1 4 16 64)")
    ap.add_argument("--noise-scale", default="auto", metavar="SAMPLES|auto",
                    help="with --noise-multiple: B_simple in samples, or 'auto': measured by the first VR optimizer's "
                         "runs at --base-batch (×1 LR, every seed), which run first")
    ap.add_argument("--probe-only", action="store_true",
                    help="with --noise-scale auto: run the B_simple probe (and its baseline) at --base-batch, then "
                         "only assemble: the grid's batches are named and listed as not run (a probe on one machine, "
                         "the grid on another)")
    ap.add_argument("--compare", type=Path, default=None, metavar="DIR",
                    help="set the runs made here beside the same cells of DIR (a study's output from another machine): "
                         "losses, difference, the tolerance, the data fingerprints")
    ap.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                    help="end within this many seconds: start a run only while the time left holds it and what the "
                         "runs in flight still have to train, at the machine's rate as the runs finished so far showed "
                         "it (their rate times the runs beside them), pause the runs still going at the limit (each checkpoints; "
                         "the next start in the same --work resumes it), then assemble what finished, like "
                         "--only-finished (a lent GPU's time: the record grows piecewise, the rest is listed as not "
                         "run yet)")
    ap.add_argument("--expect-rate", type=float, default=None, metavar="SAMPLES_PER_S",
                    help="with --time-limit, before any run finishes: a run's samples/s when --expect-share of them "
                         "ran side by side (over a run's whole time, start-up included; e.g. an earlier lease's "
                         "finished runs on the same machine); their product is the machine's rate, which the runs in "
                         "flight share: a run starts only while the time left holds it and what those still have to "
                         "train, so that runs too long for the time do not take a share of the machine from those "
                         "that can finish")
    ap.add_argument("--expect-share", type=int, default=None, metavar="N",
                    help="the runs side by side that --expect-rate was measured with (default: --parallel)")
    ap.add_argument("--parallel", type=int, default=1, metavar="N",
                    help="runs at a time (one GPU runs several small ones side by side; on CPUs each gets "
                         "cores / N threads unless OMP_NUM_THREADS is set)")
    ap.add_argument("--heldout-fraction", type=float, default=None, metavar="F",
                    help="the documents held out for evaluation (default: the job's, 0.02; a small corpus needs more "
                         "for a held-out loss that separates the optimizers)")
    ap.add_argument("--eval-points", type=int, default=None, metavar="N",
                    help="evaluate about N times along each run: the record keeps each run's held-out loss and noise "
                         "scale as they evolve (default: at the end only)")
    ap.add_argument("--groups", type=int, default=None, metavar="N",
                    help="GSNR groups per step fixed at N as the batch grows (micro-batch = batch / N, "
                         "accumulation N / ranks) instead of a fixed --micro-batch")
    ap.add_argument("--dropout", type=float, default=None, metavar="P",
                    help="BERT's hidden and attention dropout (default: the model's, 0.1). At 0 a run uses no "
                         "torch RNG after its initial weights: a GPU and a CPU then run the same samples, masks and "
                         "weights and differ in arithmetic only (their dropout streams differ: docs/results.md)")
    ap.add_argument("--only-finished", action="store_true",
                    help="run nothing: assemble from finished and --reuse runs, '–' for cells never run")
    return ap


def grid_of(args: argparse.Namespace) -> tuple[list[int], list[int], list[float]]:
    """The study's batches, seeds and LR factors from its options (each once: a repeat would run one
    directory twice; with ``--bracket`` the factors in order, a ladder), after the checks that
    need no data: the bracket's start on the grid, the groups, and each ``--batch`` split into
    them (not with ``--noise-multiple``, whose batches the noise scale gives)."""
    batches = list(dict.fromkeys(args.batch or [64, 256, 1024]))
    seeds = list(dict.fromkeys(args.seed or [1, 2]))
    factors = list(dict.fromkeys(args.lr_factor or [0.5, 1.0, 2.0]))
    if args.bracket is not None:
        factors = sorted(factors)  # a ladder: each factor's neighbours on it
    if args.bracket_carry and args.bracket is None:
        raise SystemExit("--bracket-carry: carries a --bracket from batch to batch; add --bracket F (the smallest "
                         "batch's starting factor)")
    if args.bracket is not None and args.bracket not in factors:
        raise SystemExit(f"--bracket {args.bracket:g}: not among the --lr-factor grid "
                         f"({', '.join(f'{f:g}' for f in factors)}); the bracket starts on the grid")
    if args.groups is not None and (args.groups < 2 or args.groups % args.ranks):
        raise SystemExit(f"--groups {args.groups}: needs at least 2 groups (the GSNR's variance) and a multiple of "
                         f"--ranks {args.ranks}")
    granularity = args.groups or args.ranks * args.micro_batch
    for batch in [] if args.noise_multiple else batches:
        if batch % granularity:
            raise SystemExit(f"--batch {batch}: not a multiple of " + (
                f"--groups {args.groups}" if args.groups else f"ranks x micro-batch = {granularity}"))
    return batches, seeds, factors


def main() -> None:
    args = parser().parse_args()
    if args.quick:
        args.corpus, args.batch, args.seed = ["embedded"], [16, 64], [1]
        args.optimizer, args.lr_factor, args.samples = ["LAMB", "VR-LAMB first_moment"], [1.0], 256
        args.min_steps = 1  # a smoke run: the budget alone
        args.vocab_size = min(args.vocab_size, 2000)  # a smoke run: the tokenizer trains in a few seconds
        args.work = args.work / "quick"
    args.started = time.monotonic()
    pause_on_signal(args)
    if "LD_PRELOAD" not in os.environ:
        preload = cpu_allocator().get("LD_PRELOAD")
        print(f"the runs' allocator: {preload}" if preload else "the runs' allocator: glibc malloc (tcmalloc not "
              "found: on CPUs, Debian's libtcmalloc-minimal4 makes the steps of large micro-batches faster)", flush=True)
    if args.noise_multiple:
        args.noise_multiple = sorted(set(args.noise_multiple))
    if args.probe_only and not (args.noise_multiple and args.noise_scale == "auto"):
        raise SystemExit("--probe-only: needs --noise-multiple and --noise-scale auto (the probe measures B_simple)")
    specs = args.corpus or ["embedded"]
    corpora = [spec.partition("=")[0] for spec in specs]
    batches, seeds, factors = grid_of(args)
    labels = args.optimizer or list(OPTIMIZERS)
    granularity = args.groups or args.ranks * args.micro_batch  # what every batch is a multiple of
    config = {"corpora": specs, "batches": batches, "seeds": seeds, "lr_factors": factors, "optimizers": labels,
              "samples": args.samples, "min_steps": args.min_steps, "seq_len": args.seq_len,
              "micro_batch": None if args.groups else args.micro_batch, "groups": args.groups, "ranks": args.ranks,
              "lr_rule": args.lr_rule, "base_lr": args.base_lr, "base_batch": args.base_batch,
              "vocab_size": args.vocab_size, "model": args.model, "zero": 2, "quick": args.quick,
              "heldout_fraction": args.heldout_fraction, "eval_points": args.eval_points, "dropout": args.dropout,
              **({"noise_multiples": args.noise_multiple, "noise_scale": args.noise_scale} if args.noise_multiple else {}),
              **({"bracket": args.bracket} if args.bracket is not None else {}),
              **({"bracket_carry": True} if args.bracket_carry else {}),
              "recipe": recipe({label: OPTIMIZERS[label] for label in labels})}
    args.reused, sources, shorter = load_reused(args.reuse, config)  # before Output: --out may be one of them
    args.work.mkdir(parents=True, exist_ok=True)
    out_dir = Path(args.out or (args.work if args.quick else DOCS / "bert_batch"))
    carried = carried_runs(args.reuse, out_dir)
    config["recipe"] = carried_recipe(config["recipe"], carried, out_dir)
    out = Output(out_dir, "bert_batch", config)
    logged: set[RunKey] = set()
    written: set[tuple] = set()  # (cell and seed, steps) of each run written

    def log_run(record: dict) -> None:
        """Each run once in ``runs.jsonl``: a probe run at the base batch may be a grid cell too."""
        if run_key(record) not in logged:
            logged.add(run_key(record))
            written.add((run_key(record), record["steps"]))
            out.log_run(record)

    if sources:
        out.meta["reused"] = sources
    if shorter:
        out.meta["not_reused_other_steps"] = len(shorter)
        print(f"--reuse: {len(shorter)} recorded run(s) took another number of steps than this study gives their "
              f"batch (--samples {args.samples}, --min-steps {args.min_steps}); they stay in their records, unused "
              "here", flush=True)
    results, corpus_batches, unigram, unigram_by_seed, probe_runs, unrun = [], {}, {}, {}, [], []
    only_finished = args.only_finished
    for spec, name in zip(specs, corpora):
        if args.probe_only:  # each corpus gets its probe (the grid, another machine's, is left out below)
            args.only_finished = only_finished or getattr(args, "time_over", False)
        data = (args.work / "data" / name if args.only_finished
                else prepare(name, spec.partition("=")[2] or None, args.work, args.seq_len, args.vocab_size))
        if not (data / "tokenizer.model").is_file():
            print(f"[{name}] no data prepared in {data}: the reused runs' data fingerprints are not checked and no "
                  "unigram level is computed (no verdict past the plateau); assemble with the --work that prepared "
                  f"{name!r}, or run once without --only-finished to prepare it there", flush=True)
        other = set_aside_other_data(args.reused, name,
                                     lambda seed: data_fingerprint(data, seed, args.heldout_fraction),
                                     platform.python_version())
        if other:
            out.meta.setdefault("not_reused_other_data", 0)
            out.meta["not_reused_other_data"] += len(other)
            print(f"--reuse: {len(other)} recorded run(s) of corpus {name!r} read other data than this study's (another "
                  "tokenizer, shards, seed or held-out split; for the embedded corpus, another Python release; the "
                  f"tokenizer also depends on its trainer's release: {trainer()} here, {TRAINER_RELEASE} pinned); they "
                  "stay in their records, unused here", flush=True)
        here = batches
        if args.noise_multiple:  # batches at multiples of the noise scale measured at a small batch
            scale = None if args.noise_scale == "auto" else float(args.noise_scale)
            if scale is None:
                probe = probe_label(labels, args.reused, name, args.base_batch, seeds)
                if probe is None:
                    raise SystemExit("--noise-scale auto: needs a VR optimizer among --optimizer to measure B_simple")
                # the probe's baseline beside it: the budget's margin below the unigram level at a small batch
                probes = [probe] + [BASELINE[probe]] * (BASELINE[probe] in labels or recorded(
                    args.reused, name, args.base_batch, BASELINE[probe], seeds))
                for lab in probes:  # runs this record writes: a later --reuse checks their parameters too
                    config["recipe"]["optimizers"].setdefault(lab, _digest(OPTIMIZERS[lab]))
                measured = run_all([(lab, name, data, args.base_batch, 1.0, seed) for lab in probes for seed in seeds],
                                   args, log_run)
                probe_runs += measured
                scale = measured_noise_scale(measured, args.base_batch, seeds)
            if scale is None:
                print(f"[{name}] no B_simple measured at batch {args.base_batch} yet: its batches are unknown", flush=True)
                here = []
                out.meta.setdefault("unrun_probes", []).append(
                    f"{name}: the B_simple probe at batch {args.base_batch}, then the whole grid of its batches")
            else:
                here = sorted(set(noise_batches(args.noise_multiple, scale, granularity)))
                out.meta.setdefault("noise_scale", {})[name] = scale
                print(f"[{name}] B_simple {scale:.0f} samples at batch {args.base_batch}: batches {here}", flush=True)
            if args.probe_only:
                args.only_finished = True  # the grid is another machine's
            if (data / "tokenizer.model").is_file():
                per_seed = {seed: unigram_loss(data, seed, args.seq_len, base_config(
                    args.seq_len, args.micro_batch, args.ranks, args.workers)["job"]["data"]["eval_samples"],
                    args.heldout_fraction, args.ranks) for seed in seeds}
                unigram[name] = mean(per_seed.values())
                unigram_by_seed[name] = per_seed
                out.meta.setdefault("unigram_loss", {})[name] = unigram[name]
        corpus_batches[name] = here
        if args.bracket is not None:
            ran, next_runs = run_bracketed(name, data, here, labels, seeds, factors, args, log_run)
            results += ran
            unrun += next_runs
            continue
        cells = [(label, name, data, batch, factor, seed) for batch in here for label in labels for factor in factors
                 for seed in seeds]
        results += run_all(cells, args, log_run)
        unrun += unrun_cells(results, [name], here, labels, factors, seeds)
    unrun += out.meta.pop("unrun_probes", [])  # a corpus whose batches are not known yet
    out.meta["unrun"] = unrun
    if getattr(args, "stopped", None):
        out.meta["stopped"] = args.stopped
        out.add_table("Runs the time limit or SIGUSR1 stopped unfinished (paused ones checkpointed: the next start "
                      "in this work directory resumes them; removed ones, stopped before their first checkpoint, start "
                      "again from step 0; their rate after start-up is what the next lease can plan with)",
                      table(["run", "step", "samples", "seconds", "start-up (s)", "samples/s after",
                             "runs side by side", "waiting for data", "kept"],
                            [(g["run"], f"{g['step']} of {g['steps']}", f"{g['samples']:,.0f}", f"{g['wall_s']:.0f}",
                              "–" if g["setup_s"] is None else f"{g['setup_s']:.0f}",
                              "–" if g["samples_per_s"] is None else f"{g['samples_per_s']:,.0f}",
                              f"{g['side_by_side']:g}" if "side_by_side" in g else "–",
                              "–" if g.get("data_wait") is None else f"{100 * g['data_wait']:.1f}%",
                              "paused" if g["paused"] else "removed")
                             for g in args.stopped]))
    # a staged bracket lists its next round (a factor in play on every seed before it widens)
    unrun_what = "the bracket's next round needs" if args.bracket is not None else "of the grid not run yet"
    if unrun:
        print(f"{len(unrun)} run(s) {unrun_what}: {'; '.join(unrun[:8])}{' ...' if len(unrun) > 8 else ''}",
              flush=True)
    if args.noise_multiple:  # the multiples' batches, in the record's settings too (not the default grid)
        batches = config["batches"] = sorted({b for bs in corpus_batches.values() for b in bs})
    if not results and not probe_runs:
        if args.time_limit is None:
            raise SystemExit("--only-finished: no finished or reused run matches these corpora, batches and optimizers")
        print("--time-limit: no run finished in the time; the record lists the runs not run yet", flush=True)
    if probe_runs:
        rows = [(r["corpus"], r["batch"], r["optimizer"], r["seed"], r["steps"], r["samples"], f"{r['mlm_loss']:.4f}",
                 *((f"{unigram_by_seed[r['corpus']][r['seed']]:.4f}",
                    f"{unigram_by_seed[r['corpus']][r['seed']] - r['mlm_loss']:+.4f}")
                   if r["seed"] in unigram_by_seed.get(r["corpus"], {}) else ("–", "–")),
                 "–" if r.get("b_simple") is None else f"{r['b_simple']:.0f}")
                for r in sorted(probe_runs, key=lambda r: (r["corpus"], r["optimizer"], r["seed"]))]
        out.add_table(f"The budget at a small batch: each run at batch {args.base_batch} (×1 LR) against the unigram "
                      "level of its held-out masks (below it by: unigram − loss)",
                      table(["corpus", "batch", "optimizer", "seed", "steps", "samples", "MLM loss", "unigram level",
                             "below it by", "B_simple (samples)"], rows))
    # a probe run may be a grid cell too; the grid's order, not the order the runs finished or were found in
    everyone = sorted({run_key(r): r for r in probe_runs + results}.values(), key=lambda r: (
        corpora.index(r["corpus"]) if r["corpus"] in corpora else len(corpora), r["corpus"], r["batch"],
        labels.index(r["optimizer"]) if r["optimizer"] in labels else len(labels), r["optimizer"], r["factor"],
        r["seed"]))
    traced = [r for r in everyone if r.get("trajectory")]
    if traced:
        out.add_table("Held-out loss and the noise scale as training goes: MLM loss (B_simple over the steps since the "
                      "evaluation before) at each quarter of a run's samples",
                      table(["corpus", "batch", "optimizer", "LR (factor)", "seed", "¼", "½", "¾", "end"],
                            [(r["corpus"], r["batch"], r["optimizer"], f"×{r['factor']:g}", r["seed"],
                              *quarters(r["trajectory"])) for r in traced]))
        plot_trajectories(out, traced, best_cells(everyone))
    if results:
        cells = by_factor(results)  # every factor, to show how each optimizer's loss depends on the LR
        best = best_cells(results)
        rows = []
        for (corpus, batch, label), rs in sorted(best.items(), key=lambda kv: (corpora.index(kv[0][0]), kv[0][1],
                                                                               labels.index(kv[0][2]))):
            noise = [r["b_simple"] for r in rs if r.get("b_simple") is not None]
            tried = sorted(cells[corpus, batch, label])
            rows.append((corpus, batch, rs[0]["steps"], rs[0]["samples"], rs[0]["groups"], label,
                         f"{rs[0]['lr']:.3g} (×{rs[0]['factor']:g})", f"×{tried[0]:g}–×{tried[-1]:g} ({len(tried)})",
                         spread([r["mlm_loss"] for r in rs]), spread([r["mlm_acc"] for r in rs]),
                         spread(noise, "{:.0f}") if noise else "–",
                         ", ".join(sorted({r.get("machine", "–") for r in rs}))))
        out.add_table(f"Held-out MLM loss and accuracy at the best LR factor ({len(seeds)} seeds, mean (min–max); "
                      f"max({args.samples}, {args.min_steps} steps × batch) samples per run, seq {args.seq_len}, LR {args.lr_rule} rule from {args.base_lr:g} "
                      f"at batch {args.base_batch} × the factors tried)",
                      table(["corpus", "batch", "steps", "samples", "groups n", "optimizer", "LR (factor)", "factors tried",
                             "MLM loss", "MLM accuracy", "B_simple (samples)", "machine"], rows))
        grid = [(name, batch, label, *(spread([r["mlm_loss"] for r in cells[name, batch, label][f]], "{:.3f}")
                                       if f in cells.get((name, batch, label), {}) else "–" for f in factors))
                for name in corpora for batch in batches for label in labels if (name, batch, label) in cells]
        out.add_table(f"Held-out MLM loss at every LR factor ({len(seeds)} seeds, mean (min–max); – never run)",
                      table(["corpus", "batch", "optimizer", *(f"×{f:g}" for f in factors)], grid))
        if args.noise_multiple:
            rows = [row for name in corpora if corpus_batches[name] for label in labels if BASELINE.get(label) in labels
                    for row in verdicts(best, name, corpus_batches[name], label, BASELINE[label],
                                        unigram_by_seed.get(name), cells, factors)]
            levels = ", ".join(f"{name} {unigram[name]:.3f} (seeds {', '.join(f'{s}: {u:.3f}' for s, u in by.items())})"
                               for name in corpora if (by := unigram_by_seed.get(name))) or "not computed"
            # below: the least margin of the baseline's runs, each under its own seed's level
            out.add_table(f"Verdict per batch (multiples {', '.join(f'×{m:g}' for m in args.noise_multiple)} of B_simple; "
                          f"unigram level, nats: {levels}; {len(unrun)} run(s) {unrun_what}; each optimizer's best LR "
                          "is chosen on the held-out loss it is judged by)",
                          table(["corpus", "batch", "baseline loss", "VR loss", "VR − baseline by seed",
                                 "baseline below unigram", "verdict"], rows))
        plot(out, best, corpora, batches, labels)
    if args.compare is not None:
        rows = compared(everyone, args.compare, config)
        out.meta["compared"] = {"with": str(args.compare), "runs": rows}
        out.add_table(f"Against the same cells of {args.compare} (tolerance: 1e-3 of the loss each run trained away)",
                      table(["run", "loss here", "loss there", "difference", "tolerance", "within", "same data"],
                            [(c["cell"], f"{c['here']:.5f}", f"{c['there']:.5f}", f"{c['difference']:+.2e}",
                              "–" if c["tolerance"] is None else f"{c['tolerance']:.2e}",
                              {True: "yes", False: "no", None: "–"}[c["within"]], "yes" if c["same_data"] else "no")
                             for c in rows]))
    keep_carried(out, carried, written)
    finish(out, everyone, args)


if __name__ == "__main__":
    main()
