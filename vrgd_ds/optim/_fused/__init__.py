"""Build-on-first-use loader of the fused CPU kernels (``kernels.cpp``).

The extension is compiled once per machine type with the host's vector instructions
(``-march=native``); the build directory name carries a fingerprint of the CPU flags so a
home directory shared by nodes of different CPU generations never serves a binary built
for another CPU. FMA contraction is off so the kernels round like the eager reference.

The name also carries a hash of the source's content and path, so two versions or two checkouts
of the package never share a build directory (torch's ``build.ninja`` names the source by path:
two checkouts alternating in one directory would rebuild at every switch, a minute each). A build killed half-way (a job pre-empted during its first step) leaves torch's
``lock`` file behind, on which every later build would wait forever: a lock older than
``STALE_LOCK_S`` is removed, with a warning naming it.

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
import time
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("kernels.cpp")
def cflags(machine: str | None = None) -> list[str]:
    """The compiler's flags on ``machine`` (``platform.machine()``): the vector-width preference
    is x86's alone (GCC refuses it on aarch64, e.g. a Grace CPU, and the build would fail)."""
    machine = machine or platform.machine()
    return [
        "-O3",
        "-march=native",
        *(["-mprefer-vector-width=512"] if machine in ("x86_64", "AMD64", "i686") else []),
        "-ffp-contract=off",  # no FMA contraction: round like the eager reference
        "-fopenmp",  # at::parallel_for and omp simd
        "-fno-math-errno",
        "-fno-trapping-math",
        "-fno-unswitch-loops",  # GCC otherwise versions the GSNR loops on gamma and runs a scalar copy
    ]


#: a build lock this old was left by a killed build (a build takes under a minute)
STALE_LOCK_S = 15 * 60


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


def ninja_dir() -> str | None:
    """The directory of the ``ninja`` package's binary (None without the package)."""
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


def clear_stale_lock(build_dir: Path, max_age_s: float = STALE_LOCK_S) -> bool:
    """Removes ``build_dir/lock`` when it is older than ``max_age_s`` (a killed build's); True if it did."""
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < max_age_s:
        return False
    logger.warning("removing %s, left %.0f min ago by a build that did not finish (killed?)", lock, age / 60)
    lock.unlink(missing_ok=True)
    return True


def clear_stale_build_lock(name: str) -> bool:
    """``clear_stale_lock`` in torch's build directory of the JIT extension ``name`` (its own choice
    of directory, as ``cpp_extension.load`` makes it); True if a lock was removed."""
    from torch.utils import cpp_extension

    build_dir = getattr(cpp_extension, "_get_build_directory", None)
    return build_dir is not None and clear_stale_lock(Path(build_dir(name, verbose=False)))


def extension_name() -> str:
    """The build's name: this CPU's flags, and this source by its content and its path (torch's
    ``build.ninja`` names the source by path: two checkouts sharing a build directory would
    rebuild each other's kernels at every switch)."""
    source = hashlib.sha1(_SOURCE.read_bytes() + str(_SOURCE.resolve()).encode()).hexdigest()[:8]
    return f"vrgd_ds_fused_{_cpu_fingerprint()}_{source}"


@functools.lru_cache(maxsize=1)
def load() -> ModuleType:
    """Returns the compiled kernels, building them on first use (under a minute on 2 cores)."""
    ninja = ninja_dir()
    missing = [tool for tool in ("c++", "ninja")
               if shutil.which(tool, path=ninja if tool == "ninja" else None) is None]
    if missing:
        raise FusedKernelsUnavailable(
            f"fused VRGD kernels need {' and '.join(missing)} on PATH to build "
            "(apt-get install g++; pip install ninja), or construct the optimizer with fused=False"
        )
    from torch.utils import cpp_extension

    name = extension_name()
    clear_stale_build_lock(name)
    logger.info("building fused VRGD kernels %s (first use on this machine type)", name)
    try:
        with _path_first(ninja):
            return cpp_extension.load(name=name, sources=[str(_SOURCE)], extra_cflags=cflags(),
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
