"""Writes ``docs/results.md`` from ``docs/results.template.md`` and the studies' outputs.

The template holds the prose (what each study shows against the paper's claims); every
``{{study:NAME}}`` line is replaced by that study's generated tables, plots and record
(command, seeds, versions, machine, wall time) from ``docs/studies/NAME/``. Tables are never
typed by hand: ``--check`` fails when ``docs/results.md`` differs from what this writes.

    python studies/page.py            # after running the studies in full mode
    python studies/page.py --check
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from common import DOCS, ROOT, hardware

TEMPLATE = ROOT / "docs" / "results.template.md"
PAGE = ROOT / "docs" / "results.md"
MARK = re.compile(r"^\{\{study:([a-z0-9_]+)\}\}$", re.MULTILINE)


def run_machines(runs_file: Path) -> str:
    """`` Its runs by machine: 62 on x86_64, 2 CPU cores; 4 on NVIDIA H200.`` from a record's
    ``runs.jsonl`` (each run's own ``machine``, wherever it was assembled from), or "" where its
    runs do not say (records written before runs carried it: the machine of the record)."""
    if not runs_file.exists():
        return ""
    counts: dict[str, int] = {}
    for line in runs_file.read_text().splitlines():
        machine = json.loads(line).get("machine") if line.strip() else None
        if machine:
            counts[machine] = counts.get(machine, 0) + 1
    return (" Its runs by machine: " + "; ".join(f"{n} on {machine}" for machine, n in counts.items()) + "."
            if counts else "")


def record(meta: dict, runs_file: Path | None = None) -> str:
    m = meta["machine"]
    versions = ", ".join(f"{k} {m[k]}" for k in ("python", "torch", "deepspeed", "transformers", "sklearn")
                         if m.get(k))
    hw = hardware(m)
    cfg = ", ".join(f"{k}={v}" for k, v in meta["config"].items() if k != "recipe")  # digests: meta.json has them
    runs = f" (the runs themselves: {meta['run_wall_s']:.0f} s)" if "run_wall_s" in meta else ""
    reused = "; ".join(f"`{r['dir']}` (commit {r['commit'] or 'unknown'}, {r['started']}, {r['machine']})"
                       for r in meta.get("reused", []))
    reused = f" Runs read from earlier records: {reused}." if reused else ""
    return (f"*Record:* `python studies/{meta['command']}` at commit {m.get('commit') or 'unknown'}, "
            f"{meta['started']}, {meta['wall_s']:.0f} s{runs} on {hw} ({m['platform']}); {versions}. "
            f"Settings: {cfg}.{reused}{run_machines(runs_file) if runs_file else ''}\n")


def section(name: str) -> str:
    d = DOCS / name
    if not (d / "tables.md").exists():
        raise SystemExit(f"{d}/tables.md is missing: run python studies/{name}.py (full mode) first")
    meta = json.loads((d / "meta.json").read_text())
    tables = (d / "tables.md").read_text().split("\n", 1)[1].strip()  # without the do-not-edit line
    tables = tables.replace("#### ", "##### ")
    plots = "\n".join(f"![{p.stem}](studies/{name}/{p.name})" for p in sorted(d.glob("*.png")))
    return f"{tables}\n\n{plots}\n\n{record(meta, d / 'runs.jsonl')}"


def repeated(text: str) -> list[str]:
    """The headings and study marks that ``text`` holds more than once (a section pasted twice)."""
    seen: dict[str, int] = {}
    for line in text.splitlines():
        if line.startswith("#") or MARK.match(line):
            seen[line] = seen.get(line, 0) + 1
    return [line for line, n in seen.items() if n > 1]


def render(text: str | None = None) -> str:
    text = TEMPLATE.read_text() if text is None else text
    twice = repeated(text)
    if twice:
        raise SystemExit(f"{TEMPLATE.relative_to(ROOT)} repeats {'; '.join(twice)}: keep one of each")
    head = "<!-- written by studies/page.py from docs/results.template.md and docs/studies/; do not edit -->\n"
    for number, line in enumerate(MARK.sub("", text).splitlines(), 1):
        if "{{study:" in line:  # a mark not alone on its line, or misspelt: it would stay on the page as text
            raise SystemExit(f"{TEMPLATE.relative_to(ROOT)} line {number}: {line.strip()!r} is no study mark; write "
                             "{{study:NAME}} alone on its line (NAME: a directory of docs/studies)")
    return head + MARK.sub(lambda mt: section(mt.group(1)), text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="fail if docs/results.md is not what this writes")
    args = ap.parse_args()
    page = render()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != page:
            sys.exit("docs/results.md is out of date: run python studies/page.py")
        print("docs/results.md is up to date")
        return
    PAGE.write_text(page)
    print(f"wrote {PAGE}")


if __name__ == "__main__":
    main()
