"""What every study writes next to its results: the tables (Markdown, generated), the runs
(JSON lines), the record of how they were obtained (command, seeds, versions, machine) and the
plots. One directory per study, ``docs/studies/<name>/`` for the committed full runs;
``studies/page.py`` assembles ``docs/results.md`` from them."""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from statistics import mean
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "studies"
#: the checkout's folders whose code a study runs: a change there not yet committed marks the record's commit
CODE = ("vrgd_ds", "data_pipeline", "studies")


def hardware(m: dict[str, Any]) -> str:
    """A ``machine()`` record in a few words: the GPU, else the processor and its cores."""
    return m.get("cuda") or f"{m.get('processor')}, {m.get('cpus')} CPU cores"


def machine() -> dict[str, Any]:
    """Versions and hardware the numbers came from."""
    import torch

    out: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    for mod in ("deepspeed", "transformers", "sklearn", "numpy", "sentencepiece"):
        try:
            out[mod] = __import__(mod).__version__
        except ImportError:  # not installed: not used by this study
            continue
    out["commit"] = commit()
    return out


def commit() -> str | None:
    """The checkout's commit, marked "+uncommitted changes" where the code a study runs differs
    from it (``CODE``); None outside a git checkout."""
    try:
        git = ["git", "-C", str(ROOT)]
        out = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             check=True).stdout.strip()
        changed = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no", "--", *CODE],
                                 capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return out + "+uncommitted changes" if changed else out  # the code that ran is not the commit's


def at_least_one(text: str) -> int:
    """A count option of at least 1 (``--seeds``: 0 seeds would train nothing, then average nothing)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return value


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def spread(values: Sequence[float], fmt: str = "{:.4f}") -> str:
    """``mean (min–max)``, or the value alone for one seed."""
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(mean(values))} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def portable(arg: str) -> str:
    """A command-line argument as a committed record keeps it: an absolute path (also after
    ``NAME=``) relative to the checkout when inside it, else ``.../`` and its last part (a
    scratch directory of the machine that ran it)."""
    name, eq, value = arg.rpartition("=") if "=" in arg and not arg.startswith("-") else ("", "", arg)
    path = Path(value)
    if not path.is_absolute():
        return arg
    try:
        value = str(path.resolve().relative_to(ROOT))
    except ValueError:
        value = f".../{path.name}"
    return f"{name}{eq}{value}"


class Output:
    """A study's output directory: ``runs.jsonl``, ``tables.md``, ``meta.json``, plots."""

    def __init__(self, directory: Path, study: str, config: dict[str, Any], resume: bool = False) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        # a new record's runs go to a file of their own until ``finish`` puts it in place: a study
        # that ends early (an error, SIGTERM) leaves the directory's record as it was, whole
        self.logging = self.runs_path if resume else self.dir / ".runs.jsonl.partial"
        if not resume:
            self.logging.unlink(missing_ok=True)
        self.study = study
        self.t0 = time.time()
        # quoted as a shell would need it: a label such as "VR-LAMB first_moment" is one argument
        self.meta = {"study": study, "command": shlex.join([Path(sys.argv[0]).name, *map(portable, sys.argv[1:])]),
                     "config": config, "machine": machine(), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        self.sections: list[tuple[str, str]] = []

    @property
    def runs_path(self) -> Path:
        return self.dir / "runs.jsonl"

    def log_run(self, record: dict[str, Any]) -> None:
        with open(self.logging, "a") as fh:
            fh.write(json.dumps(record) + "\n")

    def add_table(self, title: str, markdown: str) -> None:
        self.sections.append((title, markdown))
        print(f"\n{title}\n\n{markdown}", flush=True)

    def savefig(self, fig: Any, name: str) -> Path:
        path = self.dir / name
        fig.savefig(path, dpi=110, bbox_inches="tight")
        import matplotlib.pyplot as plt

        plt.close(fig)
        return path

    def finish(self, runs: Sequence[dict[str, Any]] = (), wall_s: float | None = None) -> None:
        """Writes the record and the tables. ``runs`` with a ``wall_s`` each: runs read back from
        an earlier invocation or output took their time there, and the record gives it too.
        ``wall_s``: the record's own time, where its tables are written again from its runs."""
        self.meta["wall_s"] = round(time.time() - self.t0, 1) if wall_s is None else wall_s
        self.logging.touch()  # a record with no run yet is still one --reuse reads
        self.logging.replace(self.runs_path)
        self.logging = self.runs_path  # (a later log_run, if any, appends to the record)
        if runs:
            self.meta["run_wall_s"] = round(sum(r["wall_s"] for r in runs), 1)
        (self.dir / "meta.json").write_text(json.dumps(self.meta, indent=2) + "\n")
        body = [f"<!-- written by studies/{self.study}.py; do not edit -->\n"]
        body += [f"#### {title}\n\n{md}" for title, md in self.sections]
        (self.dir / "tables.md").write_text("\n".join(body))
        print(f"\nwrote {self.dir}/tables.md, meta.json, runs.jsonl and plots", flush=True)


def plt():
    """matplotlib with a file-only backend."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    return pyplot
