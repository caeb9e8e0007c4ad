"""The documentation holds together: links resolve, design citations name real sections, and the
README stays a short front page that still carries the two set-up commands.

Fast and static: reads Markdown and source files, runs nothing.
"""
from __future__ import annotations

import os
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DESIGN = ROOT / "docs" / "design.md"
README_MAX_LINES = 320

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"\[([^\]]*)\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = ("http://", "https://", "mailto:")
# "docs/design.md §3", "§1.3", "§2–3" (a range of sections)
CITATION = re.compile(r"docs/design\.md §(\d+(?:\.\d+)?)(?:\s*[–-]\s*(\d+(?:\.\d+)?))?")
BARE_CITATION = re.compile(r"\b" + "DESIGN" + r" §")
SECTION_NUMBER = re.compile(r"^(\d+(?:\.\d+)*)\.?(?:\s|$)")
SOURCE_SUFFIXES = (".py", ".md", ".cpp", ".sh")
SKIP_DIRS = {".git", ".venv", "build", "dist", "runs", "node_modules", "__pycache__"}


def markdown_pages() -> list[pathlib.Path]:
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    pages += [p for p in (ROOT / "configs" / "README.md", ROOT / "docker" / "README.md") if p.exists()]
    return pages


def prose_lines(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` outside fenced code blocks."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link markup reduced to its text, lowercase, punctuation
    dropped except ``-`` and ``_``, spaces turned into ``-``."""
    text = LINK.sub(lambda m: m.group(1), heading).strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(page: pathlib.Path) -> set[str]:
    """Every heading anchor of a Markdown page, with GitHub's ``-1``, ``-2`` suffixes for repeats."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(page.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def links(page: pathlib.Path) -> list[tuple[int, str]]:
    """``(line number, target)`` of every Markdown link outside code (fenced blocks and code
    spans); a link whose text wraps onto the next line counts too."""
    lines = page.read_text(encoding="utf-8").splitlines()
    prose = dict(prose_lines("\n".join(lines)))
    # fenced lines become empty and code spans runs of "x" of the same length, so that
    # "[`x`](y)" stays a link, "`[a](b)`" is none, and offsets still give line numbers
    text = "\n".join(CODE_SPAN.sub(lambda m: "x" * len(m.group(0)), prose.get(n, ""))
                     for n in range(1, len(lines) + 1))
    return [(text.count("\n", 0, m.start()) + 1, m.group(2)) for m in LINK.finditer(text)]


def repo_files(suffixes: tuple[str, ...]) -> list[pathlib.Path]:
    """The repository's files with these suffixes: tracked and untracked but not ignored (from
    git), or, without git, a walk that leaves out virtual environments and build outputs."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                                capture_output=True, check=True).stdout.decode().split("\0")
        paths = [ROOT / p for p in listed if p]
    except (OSError, subprocess.CalledProcessError):
        paths = []
        for folder, dirs, files in os.walk(ROOT):
            dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
            paths += [pathlib.Path(folder) / f for f in files]
    return sorted(p for p in paths if p.suffix in suffixes and p.is_file())


def design_sections() -> set[str]:
    """The section numbers of docs/design.md's headings ("3", "1.3", ...)."""
    out = set()
    for _, line in prose_lines(DESIGN.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if m:
            number = SECTION_NUMBER.match(m.group(2))
            if number:
                out.add(number.group(1))
    return out


@pytest.mark.parametrize("page", markdown_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_existing_files_and_headings(page: pathlib.Path):
    """Every relative link of the README, the docs/ pages, configs/README.md and docker/README.md
    names a file that exists (relative to the page), and its ``#anchor``, when it has one, is a
    heading of that file under GitHub's slug rules. External (http, https, mailto) links are not
    checked."""
    broken = []
    for number, target in links(page):
        if target.startswith(EXTERNAL):
            continue
        path, _, anchor = target.partition("#")
        dest = page if not path else (page.parent / path).resolve()
        where = f"{page.relative_to(ROOT)}:{number}: {target}"
        if not dest.exists():
            broken.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{where} (no heading with that anchor in {dest.name})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_design_citations_name_existing_sections():
    """Every "docs/design.md §N" citation in the repository's .py, .md, .cpp and .sh files (ranges
    such as §2–3 included) names a section number that is a heading of docs/design.md, and no
    citation of the old, missing design document (the bare upper-case form) is left."""
    sections = design_sections()
    assert {"1", "1.1", "1.2", "1.3", "2", "3", "4", "5", "6", "7"} <= sections, sections
    bad, bare, cited = [], [], 0
    for path in repo_files(SOURCE_SUFFIXES):
        text = path.read_text(encoding="utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            where = f"{path.relative_to(ROOT)}:{number}"
            if BARE_CITATION.search(line):
                bare.append(where)
            for m in CITATION.finditer(line):
                cited += 1
                first, last = m.group(1), m.group(2)
                wanted = [first]
                if last is not None:
                    if "." in first or "." in last:
                        wanted.append(last)
                    else:
                        wanted = [str(s) for s in range(int(first), int(last) + 1)]
                bad += [f"{where}: §{s}" for s in wanted if s not in sections]
    assert cited > 0, "no docs/design.md citation found: is the file list empty?"
    assert not bad, "citations of sections docs/design.md does not have:\n" + "\n".join(bad)
    assert not bare, "citations of a design document that does not exist (use docs/design.md):\n" + "\n".join(bare)


def test_readme_is_short():
    """The README is a front page (what the project is, set-up, short usage, where to go next):
    at most 320 lines; the details live in docs/."""
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"


def test_readme_keeps_the_two_setup_commands():
    """The README's set-up commands are the Makefile's: a code block runs ``make test`` (the test
    command CI's .ci/run runs) and ``make demo`` (the main job), and both targets exist in the
    Makefile."""
    targets = set(re.findall(r"^([A-Za-z][\w-]*):", (ROOT / "Makefile").read_text(encoding="utf-8"), re.M))
    commands = set()
    fenced = False
    for line in README.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif fenced:
            commands.add(line.split("#")[0].strip())
    for target in ("test", "demo"):
        assert target in targets, f"the Makefile has no '{target}' target"
        assert f"make {target}" in commands, f"README.md has no code line running 'make {target}'"
    assert "make test" in (ROOT / ".ci" / "run").read_text(encoding="utf-8"), ".ci/run no longer runs make test"


def test_readme_opens_with_the_switch_and_the_two_commands():
    """The README's first screen (40 lines) says what the project is, shows the one-word switch in
    a DeepSpeed config (a JSON code line naming ``"type": "VRLamb"``) and the two set-up commands."""
    first = README.read_text(encoding="utf-8").splitlines()[:40]
    fenced, code = False, []
    for line in first:
        if FENCE.match(line):
            fenced = not fenced
        elif fenced:
            code.append(line.split("#")[0].strip())
    assert any('"type": "VRLamb"' in line for line in code), "the first screen lacks the DeepSpeed switch"
    assert {"make test", "make demo"} <= set(code), "the first screen lacks the two set-up commands"
