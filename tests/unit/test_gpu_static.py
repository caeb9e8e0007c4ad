"""The static cost report of the GPU step (benchmarks/gpu_static.py) on every CI run: the bytes
the kernels move per parameter, measured from their own loads and stores under Triton's
interpreter, the launches and table copies of a steady step, and the host synchronisations.
The numbers asserted are exact counts (words are whole or half fp32 words per parameter)."""
from __future__ import annotations

import json
import pathlib
import sys

import pytest
import torch

pytest.importorskip("triton", reason="pip install triton (the interpreter runs the kernels on CPU)")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
import gpu_static  # noqa: E402

from vrgd_ds.optim import _triton  # noqa: E402

pytestmark = [pytest.mark.skipif(not _triton.INTERPRETED, reason="counts are taken under TRITON_INTERPRET=1"),
              pytest.mark.slow]  # the kernels interpreted: not in make test-unit


@pytest.fixture(scope="module")
def lamb():
    """Measured with chunks of 4 blocks (a host-side choice): the tensor over two chunks has 32x
    fewer elements for the interpreter, the counts per parameter are the same."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_triton, "CHUNK", 4 * _triton.BLOCK)
        return {t: gpu_static.measure_step("VRLamb", dict(gsnr_placement="first_moment"), tensors=t)
                for t in (5, 12)}


@pytest.mark.exhaustive
def test_vr_lamb_moves_its_floor_plus_the_gradient_check(lamb):
    """VR-LAMB's step: 14 words with the GSNR pass taken by the statistics hook (read g, Σg,
    Σg², p, m, v, p̂; write p̂, m, v in the first pass; read p, m, v, write p in the second), 16
    with its own GSNR pass, plus 1 for the inf/NaN check of the gradient it reads."""
    for r in lamb.values():
        assert r["step_words"] == {"read": 11.0, "written": 4.0, "total": 15.0}
        assert r["zero_step_words"] == 17.0


def test_launches_per_step_do_not_grow_with_the_number_of_tensors(lamb):
    """5 and 12 tensors: the same Triton launches and torch operations; tables copied only
    where a tensor changed (the .grad tensors zero_grad() freed and reallocated), never read
    back; no torch operation over more elements than a table. Host syncs include torch's own
    reads of a value (``aten._local_scalar_dense``): fails on the code before, which advanced
    the step counters with ``_foreach_add_(counters, 0-d tensor)``, an overload that reads the
    scalar on the host."""
    few, many = lamb[5], lamb[12]
    assert few["triton_launches"] == many["triton_launches"] <= 7
    assert few["torch_ops"] <= 6  # 54 before the Adam family's tables were built by kernels of their own
    assert few["torch_ops"] == many["torch_ops"]
    assert few["table_copies"] == many["table_copies"] <= 1
    assert few["host_syncs"] == many["host_syncs"] == 0
    assert many["largest_torch_op_tensor"] <= 8 * many["tensors"]


def test_hooks_words_per_micro_step():
    """The one-process hook writes Σg, Σg² from a fp32 gradient (3 words) on the first
    micro-step and adds to them later (5), taking the GSNR pass in the same pass; the ZeRO
    per_step statistics read an engine's fp16 bucket (half a word) and write its fp32 squares (and
    Σg with gbar=local), reading them back to add on later micro-steps; the segment table's
    reads are scalars, outside these words."""
    h = {k: v["total"] for k, v in gpu_static.measure_hooks().items()}
    assert h["tensor hook, float32 gradient, first"] == 3.0
    assert h["tensor hook, float32 gradient, later"] == h["tensor hook, float32 gradient, last (+pass 1)"] == 5.0
    assert h["tensor hook, bfloat16 gradient, first"] == 2.5
    assert h["ZeRO per_step bucket, fp16 gradient, gbar=engine, first"] == 1.5
    assert h["ZeRO per_step bucket, fp16 gradient, gbar=engine, later"] == 2.5
    assert h["ZeRO per_step bucket, fp16 gradient, gbar=local, first"] == 2.5
    assert h["ZeRO per_step bucket, fp16 gradient, gbar=local, later"] == 4.5


def test_roofline_model_adds_up():
    """The model's arithmetic on BERT-large's shapes from the config (built on the meta device)."""
    shapes = gpu_static.bert_shapes(gpu_static.ROOT / "configs" / "bert_large_64k_32k_vr_lamb.json")
    assert 330e6 < shapes["params"] < 345e6 and shapes["layers"] == 24 and shapes["hidden"] == 1024
    rows = gpu_static.roofline(shapes, {"VRLamb": 17.0}, {"first": 2.5, "later": 4.5}, 0.4)
    r = next(x for x in rows if x["ranks"] == 8 and x["gpu"] == "A100-80GB")
    assert r["micro_steps"] == 65536 // (8 * 64)
    assert r["step_gb"] == pytest.approx(17 * 4 * -(-shapes["params"] // 8) / 1e9)
    assert r["hook_gb"] == pytest.approx((2.5 + 127 * 4.5) * 4 * shapes["params"] / 1e9)
    assert r["step_ms"] == pytest.approx(r["step_gb"] / 2.0)
    # compute: 6·P + 12·L·s·d FLOPs per token, less the MLM head's on the 85% of positions not masked
    P, d, V = shapes["params"], 1024, shapes["vocab"]
    per_token = 6 * P + 12 * 24 * 128 * d - 6 * 0.85 * (d * d + d * V)
    assert r["compute_ms"] == pytest.approx(per_token * 65536 * 128 / 8 / (312e12 * 0.4) * 1e3)


def test_a_flat_partitions_step_launches_do_not_grow_with_its_tensors(monkeypatch):
    """VRLamb on one flat ZeRO partition: the same launches for 4 and 8 tensors in it, and at
    most 10 in all: 7 Triton launches (pass 1 with the gradient's check, its combine, the tables
    kernel, the Adam pass, its combine, the trust and metrics kernel, the apply pass) and 2 torch
    operations (the betas' powers at the step). With 64 tensors it ran 64 (7 and 57 torch
    operations on the per-segment tables) before the tables were built by kernels of their own,
    116 before that.
    VRLars (with its norms pass and local lr): 9 Triton launches and no torch operation."""
    monkeypatch.setattr(_triton, "CHUNK", 4 * _triton.BLOCK)
    few, many = gpu_static.measure_flat_step("VRLamb", 4), gpu_static.measure_flat_step("VRLamb", 8)
    counts = [(r["triton_launches"], r["torch_ops"], r["host_syncs"]) for r in (few, many)]
    assert counts[0] == counts[1] == (7, 2, 0), few["torch_ops_by_name"]
    assert few["triton_launches"] + few["torch_ops"] <= 10
    lars = gpu_static.measure_flat_step("VRLars", 8)  # the SGD members' tables on the device too
    assert (lars["triton_launches"], lars["torch_ops"], lars["host_syncs"]) == (9, 0, 0), lars["torch_ops_by_name"]


def test_the_figures_are_written_as_json(tmp_path):
    """``--json``: the flat steps are keyed by (member, tensors) tuples, which ``json`` refuses.
    Fails on the code before: ``--json`` ended in "keys must be str, int, float, bool or None, not
    tuple" after the whole report had run."""
    result = {"flat": {("VRLamb", 8): {"triton_launches": 7}}, "roofline": [{"member": "VRLamb", "share": 0.02}]}
    gpu_static.write_json(tmp_path / "figures.json", result)
    assert json.loads((tmp_path / "figures.json").read_text()) == {
        "flat": {"VRLamb 8": {"triton_launches": 7}}, "roofline": [{"member": "VRLamb", "share": 0.02}]}


@pytest.mark.skipif(torch.cuda.is_available(), reason="times the interpreter's launcher: CPU tensors only")
def test_the_host_benchmark_times_the_step_without_running_a_kernel():
    """``benchmarks/host_step.py`` makes every Triton launch a no-op and counts it: a flat VRLamb
    step launches the 7 kernels ``gpu_static`` counts, and VRLars's 9, and the parameters are
    left as they were (no kernel ran). Leaving the block restores the launcher."""
    import host_step
    import triton.runtime.interpreter as interpreter

    run = interpreter.InterpretedFunction.run
    with host_step.NoLaunch() as launches:
        opt = host_step.build("VRLamb", 8, flat=True)
        before = opt.param_groups[0]["params"][0].detach().clone()
        ms, count = host_step.host_ms(opt, 1, launches)
        assert count == 7 and ms > 0
        assert host_step.host_ms(host_step.build("VRLars", 8, flat=True), 1, launches)[1] == 9
        assert torch.equal(opt.param_groups[0]["params"][0], before)
    assert interpreter.InterpretedFunction.run is run


def test_a_host_read_is_counted_once():
    """``item()``, ``float()`` and ``bool()`` dispatch ``_local_scalar_dense``, which the op
    counter counts too; ``tolist()`` reads without a dispatch. Three reads of each kind count 4.
    Fails on the code before, which counted the spy's calls and the dispatches both (7)."""
    with gpu_static.OpCount() as ops, gpu_static.SyncSpy() as syncs:
        x = torch.tensor([1.5, 2.0])
        x[0].item(), float(x[1]), bool(x[0]), x.tolist()
    assert gpu_static.host_syncs(syncs, ops) == 4
