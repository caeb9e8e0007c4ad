"""Build-on-first-use loader of the fused CPU kernels (``kernels.cpp``).

The extension is compiled once per machine type with the host's vector instructions
(``-march=native``); the build directory name carries a fingerprint of the CPU flags so a
home directory shared by nodes of different CPU generations never serves a binary built
for another CPU. FMA contraction is off so the kernels round like the eager reference.

The build always runs the ``ninja`` of the ``ninja`` Python package (a dependency): a second
ninja on PATH (Debian's ``ninja-build``, say) keeps its build log in another hash format, and
processes alternating between the two would each rebuild the kernels (half a minute per launch).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("kernels.cpp")
_CFLAGS = [
    "-O3",
    "-march=native",
    "-mprefer-vector-width=512",
    "-ffp-contract=off",  # no FMA contraction: round like the eager reference
    "-fopenmp",  # at::parallel_for and omp simd
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fno-unswitch-loops",  # GCC otherwise versions the GSNR loops on gamma and runs a scalar copy
]


class FusedKernelsUnavailable(RuntimeError):
    """The fused CPU kernels cannot be built on this machine."""


def _cpu_fingerprint() -> str:
    flags = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags += line
                break
    except OSError:
        pass
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


def _ninja_dir() -> str | None:
    try:
        import ninja
    except ImportError:
        return None
    return str(ninja.BIN_DIR)


@contextmanager
def _path_first(directory: str | None):
    """``directory`` first on PATH while the build runs (torch runs ``ninja`` by name)."""
    if directory is None:
        yield
        return
    saved = os.environ.get("PATH")
    os.environ["PATH"] = directory + os.pathsep + (saved or "")
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = saved


@functools.lru_cache(maxsize=1)
def load() -> ModuleType:
    """Returns the compiled kernels, building them on first use (about a minute)."""
    ninja_dir = _ninja_dir()
    missing = [tool for tool in ("c++", "ninja")
               if shutil.which(tool, path=ninja_dir if tool == "ninja" else None) is None]
    if missing:
        raise FusedKernelsUnavailable(
            f"fused VRGD kernels need {' and '.join(missing)} on PATH to build "
            "(apt-get install g++; pip install ninja), or construct the optimizer with fused=False"
        )
    from torch.utils import cpp_extension

    name = f"vrgd_ds_fused_{_cpu_fingerprint()}"
    logger.info("building fused VRGD kernels %s (first use on this machine type)", name)
    try:
        with _path_first(ninja_dir):
            return cpp_extension.load(name=name, sources=[str(_SOURCE)], extra_cflags=_CFLAGS,
                                      extra_ldflags=["-fopenmp"])
    except Exception as exc:  # compiler errors surface as RuntimeError/CalledProcessError
        raise FusedKernelsUnavailable(f"building the fused VRGD kernels failed: {exc}") from exc


def available() -> bool:
    """True when the kernels are built or can be built here."""
    try:
        load()
    except FusedKernelsUnavailable as exc:
        logger.warning("%s", exc)
        return False
    return True
