"""The package as users install it: the wheel's contents, the console scripts' extras.

The fast checks read pyproject.toml against the tree; the wheel test (``exhaustive``: it creates a
virtual environment and installs torch and DeepSpeed into it, about a minute) builds the wheel,
installs it without extras and with ``[train]``, and runs what a user runs first.
"""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

from vrgd_ds import commands

ROOT = pathlib.Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _package_dirs() -> dict[str, pathlib.Path]:
    setuptools = PYPROJECT["tool"]["setuptools"]
    mapping = setuptools.get("package-dir", {})
    out = {}
    for name in setuptools["packages"]:
        root = next((k for k in sorted(mapping, key=len, reverse=True) if name == k or name.startswith(k + ".")),
                    None)
        rel = (mapping[root] + name[len(root):].replace(".", "/")) if root else name.replace(".", "/")
        out[name] = ROOT / rel
    return out


def test_every_package_folder_is_listed_and_data_pipeline_is_inside_the_namespace():
    """The explicit package list (needed by the data pipeline's mapping) misses no folder with an
    ``__init__.py``, and nothing installs as a top-level package other than ``vrgd_ds``."""
    dirs = _package_dirs()
    assert all(d.is_dir() and (d / "__init__.py").exists() for d in dirs.values()), dirs
    listed = {d.resolve() for d in dirs.values()}
    on_disk = {p.parent.resolve() for top in ("vrgd_ds", "data_pipeline") for p in (ROOT / top).rglob("__init__.py")}
    assert on_disk == listed, f"not listed in pyproject.toml: {sorted(map(str, on_disk - listed))}"
    assert {name.split(".")[0] for name in dirs} == {"vrgd_ds"}


def test_the_torch_requirement_admits_only_the_releases_the_fsdp_integration_supports():
    """pip picks the newest torch the requirement admits. Before, "torch>=2.13,<3" let a plain
    install take 2.14.1, whose FSDP2 internals ``vrgd_ds.fsdp`` refuses at attach (fails on the
    old pyproject.toml)."""
    from packaging.requirements import Requirement

    from vrgd_ds.fsdp.internals import SUPPORTED_TORCH

    torch_req = next(Requirement(r) for r in PYPROJECT["project"]["dependencies"] if r.startswith("torch"))
    for release in ("2.12.1", "2.13.0", "2.13.5", "2.14.0", "2.14.1", "3.0.0"):
        admitted = torch_req.specifier.contains(release)
        assert admitted == (release.rsplit(".", 1)[0] in SUPPORTED_TORCH), (release, str(torch_req))


def test_console_scripts_go_through_the_extra_check():
    """Every console script is one of ``commands``' functions, each checking its extra first."""
    scripts = PYPROJECT["project"]["scripts"]
    assert set(scripts) == set(commands.NEEDS)
    for name, target in scripts.items():
        module, func = target.split(":")
        assert module == "vrgd_ds.commands" and callable(getattr(commands, func)), (name, target)


def test_extras_table_matches_pyproject():
    """``commands.EXTRAS`` names the import names of exactly the extra's requirements."""
    import_names = {"scikit-learn": "sklearn"}
    extras = PYPROJECT["project"]["optional-dependencies"]
    for extra, modules in commands.EXTRAS.items():
        reqs = [re.split(r"[<>=\[; ]", r, maxsplit=1)[0] for r in extras[extra]]
        assert sorted(import_names.get(r, r).replace("-", "_") for r in reqs) == sorted(modules), extra
    for command, (extra, modules) in commands.NEEDS.items():
        assert set(modules) <= set(commands.EXTRAS[extra]), command


def test_a_command_without_its_extra_names_it(monkeypatch, capsys):
    """A missing module of the extra exits with status 2 and ``pip install "vrgd-ds[train]"``,
    before anything is imported from the job."""
    real = commands.importlib.util.find_spec
    monkeypatch.setattr(commands.importlib.util, "find_spec",
                        lambda name, *a: None if name == "sentencepiece" else real(name, *a))
    for command in ("vrgd-data", "vrgd-pretrain"):
        with pytest.raises(SystemExit) as exc:
            commands.require(command)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "sentencepiece not installed" in err and 'pip install "vrgd-ds[train]"' in err, err
    commands.require("vrgd-plots")  # matplotlib is there


@pytest.mark.parametrize("module, command", [("vrgd_ds.train", "vrgd-pretrain"), ("vrgd_ds.data_pipeline", "vrgd-data")])
def test_python_dash_m_checks_the_extra_as_the_command_does(monkeypatch, capsys, module, command):
    """``python -m vrgd_ds.train`` and ``python -m vrgd_ds.data_pipeline`` are the same commands as
    ``vrgd-pretrain`` and ``vrgd-data``, and name the missing extra as they do. Fails on the old
    code, whose ``__main__`` imported the job or the command line directly: an import traceback
    where the extra was missing (here: the command ran and printed its own usage error)."""
    import runpy

    real = commands.importlib.util.find_spec
    monkeypatch.setattr(commands.importlib.util, "find_spec",
                        lambda name, *a: None if name == "sentencepiece" else real(name, *a))
    monkeypatch.setattr(sys, "argv", [module])
    with pytest.raises(SystemExit) as exc:
        runpy.run_module(module, run_name="__main__")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"{command}: needs the 'train' extra (sentencepiece not installed)" in err, err


def test_the_pretraining_command_without_tensorboard_names_the_extra(monkeypatch, capsys):
    """The job logs to TensorBoard by default: without it, ``vrgd-pretrain`` prepared the data and
    built the engine, then failed with a ModuleNotFoundError traceback (exit 1). Fails on the old
    code, whose check named only transformers and sentencepiece."""
    real = commands.importlib.util.find_spec
    monkeypatch.setattr(commands.importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(SystemExit) as exc:
        commands.require("vrgd-pretrain")
    assert exc.value.code == 2 and "tensorboard not installed" in capsys.readouterr().err


def test_the_virtual_environment_is_ignored_also_as_a_link(tmp_path):
    """``.venv`` is ignored whether it is the environment's folder or a link to one (a second
    checkout of the repository sharing the first one's environment). Fails on the old
    ``.gitignore``, whose ``.venv/`` matched folders only: ``git add -A`` then committed the
    link, and checking that commit out replaced the folder it stood for."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / ".gitignore").write_text((ROOT / ".gitignore").read_text())
    (repo / ".venv").symlink_to(tmp_path)
    git = ["git", "-C", str(repo)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    staged = subprocess.run([*git, "diff", "--cached", "--name-only"], capture_output=True, text=True, check=True)
    assert staged.stdout.split() == [".gitignore"]


def _run(args: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=600, **kw)


@pytest.mark.exhaustive
def test_wheel_installs_and_runs_without_and_with_the_train_extra(tmp_path):
    """The built wheel in a fresh virtual environment: without extras the optimizers import and
    every command says which extra it needs (no traceback); with ``[train]`` every command's
    ``--help`` works. The wheel holds ``vrgd_ds/data_pipeline`` and no top-level ``data_pipeline``,
    exactly the package's tracked modules (built from a copy of the tracked files: a build in the
    checkout leaves ``build/lib``, whose leftovers a later wheel would ship), and the licence."""
    import shutil
    import zipfile

    source = tmp_path / "source"
    tracked = _run(["git", "-C", str(ROOT), "ls-files", "-z"]).stdout.split("\0")
    for name in filter(None, tracked):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    wheels = tmp_path / "wheels"
    built = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(source)])
    assert built.returncode == 0, built.stderr
    (wheel,) = wheels.glob("vrgd_ds-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("vrgd_ds/data_pipeline/cli.py") for n in names)
    assert not [n for n in names if not n.startswith(("vrgd_ds/", "vrgd_ds-"))], "only vrgd_ds in the wheel"
    modules = {n for n in tracked if n.endswith(".py") and n.startswith(("vrgd_ds/", "data_pipeline/"))}
    assert {n for n in names if n.endswith(".py")} == {n.replace("data_pipeline/", "vrgd_ds/data_pipeline/", 1)
                                                       if n.startswith("data_pipeline/") else n for n in modules}
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names

    venv = tmp_path / "venv"
    assert _run([sys.executable, "-m", "venv", str(venv)]).returncode == 0
    py, bin_ = venv / "bin" / "python", venv / "bin"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # the CPU wheel of torch first, as the Makefile does: a bare "torch" requirement pulls a CUDA build
    inst = _run([str(py), "-m", "pip", "install", "-q", "torch==2.13.0", str(wheel)], env=env, cwd=tmp_path)
    assert inst.returncode == 0, inst.stderr[-3000:]

    imp = _run([str(py), "-c", "import vrgd_ds; print(vrgd_ds.VRLamb.__name__, vrgd_ds.__version__)"],
               env=env, cwd=tmp_path)
    assert imp.returncode == 0 and imp.stdout.startswith("VRLamb"), imp.stderr
    for command in commands.NEEDS:
        res = _run([str(bin_ / command), "--help"], env=env, cwd=tmp_path)
        assert res.returncode == 2 and "Traceback" not in res.stderr, (command, res.stderr)
        assert 'pip install "vrgd-ds[train]"' in res.stderr, (command, res.stderr)

    extra = _run([str(py), "-m", "pip", "install", "-q", f"{wheel}[train]"], env=env, cwd=tmp_path)
    assert extra.returncode == 0, extra.stderr[-3000:]
    for command in commands.NEEDS:
        res = _run([str(bin_ / command), "--help"], env=env, cwd=tmp_path)
        assert res.returncode == 0 and "usage:" in res.stdout, (command, res.stderr[-2000:])
