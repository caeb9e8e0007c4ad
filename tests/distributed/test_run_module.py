"""``python -m vrgd_ds.run``: a DeepSpeed script that imports only ``deepspeed`` (nobody may edit
it) selects ``"VRLamb"`` by its JSON alone when the launcher starts it through the module.

The same script started directly is rejected by DeepSpeed (the name is unknown without
``vrgd_ds``): the control that shows the module is what makes it work."""
from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import launching
import pytest

from vrgd_ds import run as run_module

SCRIPT = textwrap.dedent('''
    import argparse, json, sys
    import torch
    import deepspeed

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--deepspeed_config", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=args.deepspeed_config)
    gen = torch.Generator().manual_seed(100 + engine.global_rank)
    losses = []
    for _ in range(3 * engine.gradient_accumulation_steps()):
        x = torch.randn(4, 8, generator=gen)
        loss = (engine(x) - x.sum(1, keepdim=True)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    if engine.global_rank == 0:
        with open(args.out, "w") as f:
            json.dump({"optimizer": type(engine.basic_optimizer).__name__, "argv0": sys.argv[0],
                       "local_rank": args.local_rank, "world": engine.world_size,
                       "steps": engine.global_steps, "losses": losses,
                       "vrgd_ds_in_script_globals": "vrgd_ds" in globals()}, f)
''')

CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
          "optimizer": {"type": "VRLamb", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 2}}


@pytest.fixture
def job(tmp_path):
    script = tmp_path / "pretrain.py"
    script.write_text(SCRIPT)
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(CONFIG))
    return script, cfg


def _deepspeed(ranks: int, *args: str, cwd: Path):
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(ranks), "--master_port",
           str(launching.free_port()), *args]
    return launching.run(cmd, timeout=300, marker=cwd, cwd=cwd)


@pytest.mark.exhaustive  # a deepspeed launch (about 20 s): make test starts the job through deepspeed (test_pretrain.py)
def test_unmodified_script_selects_vrlamb_by_its_json_through_the_module(job, tmp_path):
    """``deepspeed --module vrgd_ds.run pretrain.py ...`` on 2 ranks: DeepSpeed builds VRLamb from
    the config, the script sees its own path as argv[0] and the launcher's --local_rank, and trains."""
    script, cfg = job
    out = tmp_path / "out.json"
    proc = _deepspeed(2, "--module", "vrgd_ds.run", str(script), "--deepspeed_config", str(cfg), "--out", str(out),
                      cwd=tmp_path)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["optimizer"] == "VRLamb" and res["world"] == 2 and res["steps"] == 3
    assert res["argv0"] == str(script) and res["local_rank"] == 0
    assert not res["vrgd_ds_in_script_globals"]
    assert all(x == x and abs(x) < 1e6 for x in res["losses"])


@pytest.mark.exhaustive
def test_the_same_script_started_directly_is_rejected_by_deepspeed(job, tmp_path):
    """The control: without the module, DeepSpeed does not know the name and the script fails."""
    script, cfg = job
    out = tmp_path / "out.json"
    proc = _deepspeed(1, str(script), "--deepspeed_config", str(cfg), "--out", str(out), cwd=tmp_path)
    assert proc.returncode != 0 and not out.exists()
    assert "VRLamb" in proc.stdout + proc.stderr


def test_launcher_arguments_move_after_the_script_and_errors_name_the_fix(tmp_path, capsys):
    assert run_module._split(["--local_rank=3", "a.py", "--x"]) == (["--local_rank=3"], ["a.py", "--x"])
    assert run_module._split(["--local_rank", "1", "-m", "pkg.mod"]) == (["--local_rank", "1"], ["-m", "pkg.mod"])
    with pytest.raises(SystemExit) as exc:
        run_module.main([str(tmp_path / "missing.py")])
    assert exc.value.code == 2 and "missing.py: no such script" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        run_module.main([])
    assert exc.value.code == 2 and "usage: python -m vrgd_ds.run" in capsys.readouterr().err


def test_torch_launchs_local_rank_spelling_moves_after_the_script_too():
    """``torch.distributed.launch`` passes ``--local-rank=N`` (torch >= 2.0). Fails on the old
    code, which took it for the script's name ("--local-rank=0: no such script", exit 2)."""
    assert run_module._split(["--local-rank=0", "a.py", "--x"]) == (["--local-rank=0"], ["a.py", "--x"])
    assert run_module._split(["--local-rank", "2", "a.py"]) == (["--local-rank", "2"], ["a.py"])


def test_the_scripts_file_is_absolute_as_under_python(tmp_path, monkeypatch):
    """``__file__`` is the script's absolute path, as ``python SCRIPT`` gives it (3.9+), so a script
    that changes directory still finds files beside it (``sys.argv[0]``, which runpy sets to the
    same path, names the script too). Fails on the old code: ``__file__`` was the relative path
    typed."""
    (tmp_path / "s.py").write_text("import sys\nopen('seen.txt', 'w').write(__file__ + ' ' + sys.argv[0])\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    run_module.main(["s.py"])
    assert (tmp_path / "seen.txt").read_text() == f"{tmp_path / 's.py'} {tmp_path / 's.py'}"


@pytest.mark.exhaustive  # a subprocess, about 7 s
def test_the_script_chooses_deepspeeds_accelerator_itself(tmp_path):
    """Nothing before the script fixes DeepSpeed's accelerator: a script that sets
    ``DS_ACCELERATOR`` at its top gets that accelerator, as under ``python SCRIPT``. Fails on the
    old code: the module asked ``get_accelerator()`` first (for DeepSpeed's CPU op build), which
    cached the CPU accelerator for the process."""
    import subprocess

    script = tmp_path / "accel.py"
    script.write_text("import os\nos.environ['DS_ACCELERATOR'] = 'cuda'\n"
                      "from deepspeed.accelerator import real_accelerator\n"
                      "print('device:', real_accelerator.get_accelerator().device_name())\n")
    outs = [subprocess.run([sys.executable, *how, str(script)], capture_output=True, text=True, timeout=300)
            for how in ([], ["-m", "vrgd_ds.run"])]
    assert [o.stdout.strip() for o in outs] == ["device: cuda"] * 2, [o.stdout + o.stderr[-2000:] for o in outs]


def test_the_module_leaves_the_process_group_after_the_script(tmp_path, monkeypatch):
    """A script run through the module that ends without ``destroy_process_group`` leaves the
    group when it ends: ``main`` returns with no group initialized. The old module left it to the
    interpreter's exit; once, in a fresh-clone ``make test``, both ranks of
    test_unmodified_script_selects_vrlamb_by_its_json_through_the_module died there in gloo's
    teardown ("terminate called without an active exception", rc 250) after training."""
    import torch.distributed as dist

    script = tmp_path / "script.py"
    script.write_text("import torch.distributed as dist\n"
                      "dist.init_process_group('gloo', rank=0, world_size=1)\n"
                      "dist.barrier()\n")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(launching.free_port()))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        run_module.main([str(script)])
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
