"""Prints the pip requirements of vrgd-ds (with the given extras) minus torch, one per line.

The GPU image keeps the torch of its NGC base: NVIDIA's builds carry versions such as
``2.13.0a0+<git>``, which pip reads as pre-releases outside ``torch>=2.13``, so installing the
package with its dependencies would replace the tuned torch with a PyPI wheel. The image installs
the package with ``--no-deps`` and these requirements beside it; pyproject.toml stays the one list.

    python docker/requirements.py train > /tmp/requirements.txt
    python docker/requirements.py --only megatron     (the extra's own: megatron-core==0.16.1)
    python docker/requirements.py --check-torch 2.13.0a0+abc   (exit 1 unless pyproject's range holds it)
"""
from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def requirements(extras: list[str], base: bool = True) -> list[str]:
    """The requirements of ``extras`` (the extras they include too), after the package's own
    unless ``base`` is False; torch left out."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    found = list(project["dependencies"]) if base else []
    optional = project.get("optional-dependencies", {})
    todo = list(extras)
    while todo:
        extra = todo.pop()
        if extra not in optional:
            raise SystemExit(f"{PYPROJECT}: no extra {extra!r} (extras: {', '.join(optional)})")
        for req in optional[extra]:
            m = re.fullmatch(r"vrgd-ds\[(.+)\]", req.replace(" ", ""))
            if m:  # an extra that includes others
                todo += m.group(1).split(",")
            else:
                found.append(req)
    out = []
    for req in found:
        name = re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower()
        if name != "torch" and req not in out:
            out.append(req)
    return out


def torch_outside(version: str) -> str | None:
    """Why a torch ``version`` is outside pyproject.toml's ``torch`` range, None if inside. An NGC
    build (``2.13.0a0+<git>``) is read as its release (``2.13.0``): pip reads it as a pre-release
    below ``>=2.13``, but it is that release's code."""
    try:
        from packaging.specifiers import SpecifierSet
        from packaging.version import Version
    except ImportError:  # an image without the package: pip's own copy of it
        from pip._vendor.packaging.specifiers import SpecifierSet
        from pip._vendor.packaging.version import Version

    (spec,) = [r for r in tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
               if re.match(r"torch\b", r)]
    if Version(Version(version).base_version) in SpecifierSet(spec[len("torch"):]):
        return None
    return (f"torch {version} is outside {PYPROJECT.name}'s {spec!r}, the release vrgd_ds couples to (vrgd_ds.fsdp "
            "reads its FSDP2 internals): pick a base image of that torch (--build-arg BASE_IMAGE=...)")


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--check-torch"] and len(args) == 2:
        why = torch_outside(args[1])
        if why:
            raise SystemExit(why)
        sys.exit(0)
    only = "--only" in args  # the extras' own requirements, not the package's
    print("\n".join(requirements([a for a in args if a != "--only"], base=not only)))
