"""The Triton kernels (the CUDA implementation) against the reference, on CPU tensors under
Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest.py without CUDA), and on the GPU
when there is one (marked ``cuda``). Small on purpose: the interpreter runs each kernel
program in numpy (about a second per optimizer step here)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import vrgd_ds
from vrgd_ds import REGISTRY
from vrgd_ds.optim.adam import GSNR_PLACEMENTS
from numerics import sync_from, within_one_ulp

triton = pytest.importorskip("triton", reason="pip install triton (the tests run its interpreter on CPU)")
from vrgd_ds.optim import _triton  # noqa: E402

pytestmark = [pytest.mark.skipif(_triton.available() is not None, reason=str(_triton.available())),
              pytest.mark.slow]  # the kernels interpreted: not in make test-unit
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the members with a GSNR placement (the Adam family), from the registry
ADAM_FAMILY = [n for n, i in REGISTRY.items() if i.vr and "gsnr_placement" in i.accepted_params()]
# the base variants (the same code with gsnr=False, which the gamma = 1 cases also check) in the exhaustive tier
NAMES = [n if REGISTRY[n].vr else pytest.param(n, marks=pytest.mark.exhaustive) for n in REGISTRY]
# make test: every VR member, the Adam family's each with one placement, taken in turn so that
# every placement is met; the other placements exhaustive
CASES = [pytest.param(n, {}, marks=() if REGISTRY[n].vr else pytest.mark.exhaustive)
         for n in REGISTRY if n not in ADAM_FAMILY] + [
    pytest.param(n, dict(gsnr_placement=pl), id=f"{n}-{pl}",
                 marks=() if k % len(GSNR_PLACEMENTS) == j else pytest.mark.exhaustive)
    for k, n in enumerate(ADAM_FAMILY) for j, pl in enumerate(GSNR_PLACEMENTS)]


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Chunks of 4 blocks instead of 128: the same paths (a tensor over two chunks, bodies and
    rests) with 32x fewer elements for the interpreter to run. The chunk size is a host-side
    choice only (the chunk table); the kernels read each chunk's length from it."""
    monkeypatch.setattr(_triton, "CHUNK", 4 * _triton.BLOCK)


class Net(nn.Module):
    """Tensors of 1, 7, BLOCK - 1, BLOCK + 1 elements and one of CHUNK + 1 (two chunks)."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        sizes = [1, 7, _triton.BLOCK - 1, _triton.BLOCK + 1, _triton.CHUNK + 1]
        self.ps = nn.ParameterList([nn.Parameter(torch.randn(n, generator=g).to(dtype)) for n in sizes])
        self.w = nn.Parameter(torch.randn(6, 5, generator=g).to(dtype))

    def loss(self, z):
        """A different gradient per group ``z`` for every element."""
        out = (self.w.float() @ z[:5]).sin().sum()
        for p in self.ps:
            zp = z[:p.numel()]
            out = out + (p.float() * zp).sum() + 0.01 * (p.float() * zp).square().sum()
        return out


def data(steps: int, groups: int, seed: int = 1) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(_triton.CHUNK + 8, generator=g) + 0.3 for _ in range(groups)] for _ in range(steps)]


def build(name, model, fused, **over):
    info = REGISTRY[name]
    kw = {**info.test_kwargs, **over}
    kw.pop("weight_decay", None)
    return info.cls(model.parameters(), fused=fused, weight_decay=0.01, **kw)


def run(model, opt, batches):
    for step in batches:
        for z in step:
            model.loss(z.to(DEVICE)).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().float().clone() for p in model.parameters()]


@pytest.mark.parametrize("name, over", CASES)
def test_triton_equals_reference_fp32(name, over):
    """Element-wise maths in the reference's order (IEEE division and square root, no FMA);
    only the summation order of the reductions differs."""
    batches = data(2, 3)
    m1, m2 = Net().to(DEVICE), Net().to(DEVICE)
    o1, o2 = build(name, m1, False, **over), build(name, m2, "triton", **over)
    assert type(o2.kernels()).__name__ == "Triton"
    for a, b in zip(run(m1, o1, batches), run(m2, o2, batches)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        for k, v in o1.state[p1].items():
            torch.testing.assert_close(v.cpu().float(), o2.state[p2][k].cpu().float(), rtol=1e-4, atol=1e-5)
    if REGISTRY[name].vr:
        m1_, m2_ = o1.gsnr_metrics(per_tensor=True), o2.gsnr_metrics(per_tensor=True)
        assert m1_.keys() == m2_.keys()
        for k in m1_:
            assert m1_[k] == pytest.approx(m2_[k], rel=1e-3, abs=1e-6, nan_ok=True), k


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["VRSGD", "VRAdam", "VRLamb"])
def test_cuda_gsnr_momentum_at_beta3_near_1_is_the_references(name):
    """The GSNR momentum's weight 1 - beta3 rounded once from float64, as the reference takes it:
    computed from fp32 beta3 on the device it was 1.7e-4 relative off at 0.9999, against this
    test's rtol of 1e-5 (the interpreter computes it in float64, so only a GPU runs the kernels
    that would show it; tests/unit/test_triton_compile.py reads the compiled code)."""
    test_triton_equals_reference_fp32(name, {"beta3": 0.9999})


# make test: each VR member in one of the two dtypes, taken in turn so that both are met; the others exhaustive
LOW_DTYPES = (torch.bfloat16, torch.float16)
LOW_CASES = [pytest.param(n, dt, id=f"{n}-{str(dt).removeprefix('torch.')}",
                          marks=() if REGISTRY[n].vr and k % 2 == j else pytest.mark.exhaustive)
             for k, n in enumerate(sorted(REGISTRY, key=lambda n: not REGISTRY[n].vr))
             for j, dt in enumerate(LOW_DTYPES)]


#: the low-precision test's LR, in multiples of the member's ``test_kwargs`` one: steps of several
#: bf16 ulps (at 1×, VRLamb's step moved 8% of the bf16 elements by more than one)
LOW_LR = 8.0


@pytest.mark.parametrize("name, dtype", LOW_CASES)
def test_triton_low_precision_parameters(name, dtype):
    """bf16/fp16 parameters, fp32 state, step by step from the reference's parameters and state:
    the parameters one unit in the last place apart at most (Triton's interpreter truncates fp32
    -> bf16), each step moving them (``within_one_ulp``), and the fp32 state as in fp32. Fails on
    the test before, whose tolerance of 2e-2 over two steps took a step that wrote nothing
    (VRAdam moves a weight by 0.03 at most here, VRLamb by 0.008) and never read the state."""
    batches = data(3, 3)
    m1, m2 = Net(dtype).to(DEVICE), Net(dtype).to(DEVICE)
    lr = dict(lr=LOW_LR * REGISTRY[name].test_kwargs["lr"])  # steps of several ulps
    o1, o2 = build(name, m1, False, **lr), build(name, m2, "triton", **lr)
    moved = 0.0
    for i, step in enumerate(batches):
        if i:
            sync_from(m1, o1, m2, o2)
        before = [p.detach().clone() for p in m1.parameters()]
        run(m1, o1, [step]), run(m2, o2, [step])
        for p0, p1, p2 in zip(before, m1.parameters(), m2.parameters()):
            moved += within_one_ulp(p0, p1.detach(), p2.detach()) * p0.numel()
            for k, v in o1.state[p1].items():
                torch.testing.assert_close(o2.state[p2][k].float().cpu(), v.float().cpu(), rtol=1e-4, atol=1e-5)
    assert moved > 0.25 * len(batches) * sum(p.numel() for p in m1.parameters())
    for p2 in m2.parameters():
        assert p2.dtype == dtype and all(v.dtype == torch.float32 for v in o2.state[p2].values())


@pytest.mark.exhaustive
def test_triton_many_tensors_in_one_launch():
    """Sixty-four tensors of different sizes in one call: one chunk table, one launch per stage."""
    g = torch.Generator().manual_seed(4)
    results = []
    for fused in (False, "triton"):
        ps = [nn.Parameter(torch.randn(1 + 37 * i, generator=g.manual_seed(i)).to(DEVICE)) for i in range(64)]
        opt = vrgd_ds.VRLamb(ps, lr=1e-2, fused=fused)
        for k in range(3):
            zs = [torch.randn(p.numel(), generator=g.manual_seed(100 + k)).to(DEVICE) + 0.2 for p in ps]
            sum(((p * z).sum() + 0.1 * (p * z).square().sum()) for p, z in zip(ps, zs)).backward()
        opt.step()
        results.append(([p.detach().clone() for p in ps], opt.gsnr_metrics()))
    for a, b in zip(results[0][0], results[1][0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert results[0][1]["trust_ratio/mean"] == pytest.approx(results[1][1]["trust_ratio/mean"], rel=1e-6)


@pytest.mark.parametrize("name, over", [c for c in CASES if REGISTRY[c.values[0]].vr])
def test_triton_gamma_one_is_the_base_optimizer_exactly(name, over):
    """γ = 1 on the kernels is the same optimizer with GSNR off, bit for bit, for every VR member
    (the Adam family's in the placements ``CASES`` takes). Its cases once left out the Adam
    family: its entries were filtered by ``c[0]``, which for a ``pytest.param`` is its values."""
    batches = data(2, 2)
    m1, m2 = Net().to(DEVICE), Net().to(DEVICE)
    vr = run(m1, build(name, m1, "triton", gamma=1.0, **over), batches)
    base = run(m2, build(name, m2, "triton", gsnr=False), batches)
    for a, b in zip(vr, base):
        assert torch.equal(a, b)


class GivenStats:
    def __init__(self, sums, n):
        self.sums, self.n = sums, n

    def moments(self, params):
        return [self.sums[id(p)][0] for p in params], [self.sums[id(p)][1] for p in params]

    def reset(self):
        pass


@pytest.mark.parametrize("name", ["VRAdam", "VRLamb", "VRLars"])
def test_triton_flat_partition_cut_mid_tensor(name):
    """What ZeRO hands the optimizer: one flat tensor holding pieces of model tensors, cut in the
    middle of a tensor (its other part on another rank, absent here). Per-tensor sums (GSNR
    mean, trust norms) come from the layout; both implementations see the same pieces."""
    from vrgd_ds.stats.layout import Layout

    g = torch.Generator().manual_seed(2)
    n = 3
    results = []
    for fused in (False, "triton"):
        flat = nn.Parameter(torch.randn(3000, generator=torch.Generator().manual_seed(5)).to(DEVICE))
        layout = Layout(["a", "b", "c"], [1500, 1200, 900], group=None, device=DEVICE)
        layout.add(flat, [(0, 1100, 0), (1100, 1200, 1), (2300, 700, 2)])  # a and c cut
        opt = REGISTRY[name].cls([flat], fused=fused, **REGISTRY[name].test_kwargs)
        gs = torch.randn(n, 3000, generator=g.manual_seed(9)).to(DEVICE) + 0.2
        opt.set_statistics_source(GivenStats({id(flat): (gs.sum(0), gs.square().sum(0))}, n), layout)
        flat.grad = gs.mean(0)
        opt.step()
        results.append((flat.detach().clone(), opt.gsnr_metrics()))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-6)
    assert results[0][1]["gsnr/mean"] == pytest.approx(results[1][1]["gsnr/mean"], rel=1e-5)


def _same(a, b) -> bool:
    """Bit-equal tensors or floats (NaN equal to NaN)."""
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a.nan_to_num(7.25), b.nan_to_num(7.25)) and torch.equal(
            a.isnan(), b.isnan())
    return a == b or (a != a and b != b)


def _steps_with_and_without_device_tables(name, over, monkeypatch, make):
    """(parameters, state, metrics per step, skipped steps) of three Triton steps, the second on a
    NaN gradient, with the member's tables built on the device and with torch operations."""
    runs, launched = [], []
    launch = _triton.Triton._launch

    def recorded(self, name, *args, **kwargs):
        launched.append(name)
        return launch(self, name, *args, **kwargs)

    monkeypatch.setattr(_triton.Triton, "_launch", recorded)
    for device_tables in (True, False):
        cls = REGISTRY[name].cls
        monkeypatch.setattr(getattr(cls, "of", cls), "device_tables", device_tables)
        launched.clear()
        params, opt, step = make()
        metrics = []
        for i in range(3):
            step(i)
            opt.step()
            opt.zero_grad()
            metrics.append(opt.gsnr_metrics(per_tensor=True))
        runs.append(([p.detach().clone() for p in params], opt.state_dict()["state"], metrics, opt.skipped_steps))
        per_step = len(opt.param_groups) if device_tables else 0  # each group's step, the skipped one too
        tables = launched.count("adam_tables") + launched.count("sgd_tables")
        assert tables == launched.count("finish") == 3 * per_step
    return runs


def _assert_same_runs(runs):
    (p1, s1, m1, k1), (p2, s2, m2, k2) = runs
    assert all(_same(a, b) for a, b in zip(p1, p2))
    assert s1.keys() == s2.keys() and all(_same(v, s2[i][k]) for i, st in s1.items() for k, v in st.items())
    assert [sorted(m) for m in m1] == [sorted(m) for m in m2]
    assert all(_same(a[k], b[k]) for a, b in zip(m1, m2) for k in a), [
        (k, a[k], b[k]) for a, b in zip(m1, m2) for k in a if not _same(a[k], b[k])]
    assert k1 == k2 == 1 and m1[1]["step/skipped"] == 1.0 and m1[2]["step/skipped"] == 0.0


@pytest.mark.parametrize("name, over", [  # make test: VRLamb's on a flat partition (below)
    pytest.param("VRLamb", {}, marks=pytest.mark.exhaustive),
    pytest.param("VRAdam", dict(gsnr_placement="update"), id="VRAdam-update"),
    pytest.param("Lamb", dict(max_grad_norm=0.5, grad_averaging=False, min_coeff=0.9, max_coeff=1.05),
                 id="Lamb-nvlamb-clamped", marks=pytest.mark.exhaustive),
    pytest.param("VRLamb", dict(beta3=0.0, bias_correction=False, gsnr_placement="update"), id="VRLamb-no-momentum",
                 marks=pytest.mark.exhaustive),
    pytest.param("VRAdam", dict(gsnr=False), id="VRAdam-gsnr-off", marks=pytest.mark.exhaustive),
    pytest.param("VRLars", dict(clip=True, beta3=0.5), marks=pytest.mark.exhaustive),  # make test: across ranks
    pytest.param("VRMomentum", dict(nesterov=True), id="VRMomentum-nesterov", marks=pytest.mark.exhaustive),
    pytest.param("VRSGD", {}, marks=pytest.mark.exhaustive),
    pytest.param("Lars", dict(eps=1e-3), id="Lars-eps", marks=pytest.mark.exhaustive)])
def test_device_tables_step_as_the_torch_tables(name, over, monkeypatch):
    """The per-segment tables, skip decision, step counters, trust ratios and metric rows of the
    Adam and SGD members from single-program kernels (``adam_tables`` or ``sgd_tables``, LARS's
    ``lars_trust``, ``finish``) instead of 34 to 61 torch operations: parameters, state (step
    counters and momentum buffers included), every metric and the skip count bit for bit over
    three steps, the second skipped on a NaN gradient, with two param groups (the second without
    weight decay or trust-ratio adaptation). (The kernels' float64 square roots are IEEE, as
    torch's on CUDA; torch's on this CPU may differ in the last bit, which does not reach these
    steps' fp32 roundings.)"""
    def make():
        m = Net().to(DEVICE)
        info = REGISTRY[name]
        kw = {**info.test_kwargs, **over}
        kw.pop("weight_decay", None)
        ps = list(m.parameters())
        opt = info.cls([{"params": ps[:3]}, {"params": ps[3:], "weight_decay": 0.0, "trust_ratio": False}],
                       fused="triton", weight_decay=0.01, **kw)
        batches = data(3, 2)

        def step(i):
            for z in batches[i]:
                m.loss(z.to(DEVICE)).backward()
            if i == 1:
                m.w.grad[0, 0] = float("nan")
        return ps, opt, step

    _assert_same_runs(_steps_with_and_without_device_tables(name, over, monkeypatch, make))


def test_device_tables_on_a_flat_partition_step_as_the_torch_tables(monkeypatch):
    """The same on a ZeRO rank's view: one flat partition holding pieces of three model tensors
    (two cut), per-tensor sums from the layout; the statistics arrive by collective."""
    from vrgd_ds.stats.layout import Layout

    def make():
        flat = nn.Parameter(torch.randn(3000, generator=torch.Generator().manual_seed(5)).to(DEVICE))
        layout = Layout(["a", "b", "c"], [1500, 1200, 900], group=None, device=DEVICE)
        layout.add(flat, [(0, 1100, 0), (1100, 1200, 1), (2300, 700, 2)])
        opt = vrgd_ds.VRLamb([flat], fused="triton", lr=0.05, weight_decay=0.01)
        source = GivenStats({}, 3)
        opt.set_statistics_source(source, layout)

        def step(i):
            gs = torch.randn(3, 3000, generator=torch.Generator().manual_seed(9 + i)).to(DEVICE) + 0.2
            if i == 1:
                gs[0, 17] = float("nan")
            source.sums = {id(flat): (gs.sum(0), gs.square().sum(0))}
            flat.grad = gs.mean(0)
        return [flat], opt, step

    _assert_same_runs(_steps_with_and_without_device_tables("VRLamb", {}, monkeypatch, make))


@pytest.mark.parametrize("name", ["VRSGD", pytest.param("VRAdam", marks=pytest.mark.exhaustive), "VRLamb",
                                  pytest.param("Lamb", marks=pytest.mark.exhaustive)])
def test_triton_skips_a_nonfinite_step_on_the_device(name):
    """NaN in a gradient: the decision is a device flag the kernels read; nothing changes, the
    skip is counted and reported."""
    m = Net().to(DEVICE)
    opt = build(name, m, "triton")
    run(m, opt, data(1, 2))
    before = copy.deepcopy((m.state_dict(), opt.state_dict()))
    for z in data(1, 2, seed=3)[0]:
        m.loss(z.to(DEVICE)).backward()
    m.w.grad[0, 0] = float("nan")
    opt.step()
    opt.zero_grad()
    met = opt.gsnr_metrics()
    assert met["step/skipped"] == 1.0 and met["step/skipped_nonfinite"] == 1.0 and met["step/skipped_total"] == 1.0
    assert opt.skipped_steps == 1
    for k, v in before[0].items():
        assert torch.equal(v, m.state_dict()[k])
    for pid, st in before[1]["state"].items():
        for k, v in st.items():
            assert torch.equal(v, opt.state_dict()["state"][pid][k]), k
    run(m, opt, data(1, 2, seed=4))  # trains on
    assert opt.gsnr_metrics()["step/skipped"] == 0.0


@pytest.mark.parametrize("fused", [False, True, "triton"])
def test_zero_variance_past_fp32s_range_scales_by_one_not_nan(fused):
    """Identical gradients in both groups (var = 0) of |g| 1e14: r = gbar²/eps passed fp32's
    range. Before, r was inf, its tensor's mean inf, and the scale inf · (1/inf) = NaN went into
    the parameters on every path, the step not skipped. Now r stops at 2^64 (``gsnr.R_MAX``):
    those elements have the largest r and a scale of 1, the others gamma, alike on the
    reference, the C++ and the Triton kernels. Fails on the old code."""
    if fused is True and DEVICE == "cuda":
        pytest.skip("the C++ kernels are the CPU's")
    p = nn.Parameter(torch.zeros(4, device=DEVICE))
    opt = vrgd_ds.VRSGD([p], lr=0.1, gamma=0.1, fused=fused)
    g = torch.tensor([1e14, -1e14, 1.0, 2.0], device=DEVICE)
    for _ in range(2):
        (p * g).sum().backward()
    opt.step()
    torch.testing.assert_close(p.detach().cpu(), torch.tensor([-2e13, 2e13, -0.02, -0.04]), rtol=1e-6, atol=0)
    assert opt.gsnr_metrics()["gsnr/max"] == 2.0**64 and opt.gsnr_metrics()["step/skipped"] == 0.0


@pytest.mark.exhaustive  # about 9 s: make test resumes the optimizers' state on the reference (test_optimizers.py)
@pytest.mark.parametrize("name", ["VRMomentum", "VRLamb"])
def test_triton_state_dict_round_trip_continues_the_trajectory(name, tmp_path):
    batches = data(4, 2)
    m1 = Net().to(DEVICE)
    o1 = build(name, m1, "triton")
    run(m1, o1, batches[:2])
    ckpt = copy.deepcopy({"model": m1.state_dict(), "opt": o1.state_dict()})
    straight = run(m1, o1, batches[2:])
    m2 = Net().to(DEVICE)
    m2.load_state_dict(ckpt["model"])
    o2 = build(name, m2, "triton")
    o2.load_state_dict(ckpt["opt"])
    for a, b in zip(straight, run(m2, o2, batches[2:])):
        assert torch.equal(a, b)


# make test: the members with reductions beyond the Adam and SGD passes (LAMB's trust ratio, LARS's
# norms, MERIT's row and column maxima); the others exhaustive
SYNC_NAMES = [n if n in ("VRLamb", "VRLars", "VRMerit") else pytest.param(n, marks=pytest.mark.exhaustive)
              for n in REGISTRY]


@pytest.mark.parametrize("name", SYNC_NAMES)
def test_triton_step_reads_nothing_back_to_the_host(name, monkeypatch):
    """No host synchronisation in step(): on CPU tensors the same code path must not call
    ``.item()``, ``float()``, ``int()``, ``bool()`` or ``.tolist()`` on any tensor (on a GPU each
    would wait for the device). The GPU test with torch.cuda.set_sync_debug_mode covers CUDA."""
    m = Net().to(DEVICE)
    opt = build(name, m, "triton")
    run(m, opt, data(1, 2))  # state created; the second step is the one counted
    for z in data(1, 2, seed=7)[0]:
        m.loss(z.to(DEVICE)).backward()
    calls = []
    for method in ("item", "__float__", "__int__", "__bool__", "tolist", "__index__"):
        original = getattr(torch.Tensor, method)

        def spy(self, *a, _m=method, _o=original, **k):
            calls.append(_m)
            return _o(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, method, spy)
    opt.step()
    monkeypatch.undo()
    assert calls == [], calls
    assert opt.gsnr_metrics()["step/skipped"] == 0.0  # the metrics are read here instead


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", NAMES)
def test_cuda_step_does_not_synchronise(name):
    m = Net().cuda()
    opt = build(name, m, None)
    assert opt.kernels().name == "triton"  # fused=None: the kernels, in the fallback wrapper
    run(m, opt, data(1, 2))
    for z in data(1, 2, seed=7)[0]:
        m.loss(z.cuda()).backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    opt.gsnr_metrics()


def _bucket_table(src_numel: int, dst_base: int):
    """Segments of a bucket, as an engine's bucket cuts parameters: lengths of 1, 7, a block plus
    one, a chunk plus three (two chunks); starts in the source and the buffer that agree modulo
    VEC (an aligned body), that do not (no body), gradient and squares far apart; accumulate
    flags mixed."""
    from vrgd_ds.optim.columns import BucketTable

    lengths = [1, 7, _triton.BLOCK + 1, _triton.CHUNK + 3, 40]
    rows, s, d = [], 3, dst_base
    for i, n in enumerate(lengths):
        shift = 0 if i % 2 == 0 else 1  # odd rows: the buffer's start out of step with the source's
        rows.append([s, d + shift, d + shift + 4 * src_numel, n, i % 3 == 2])
        s += n
        d += n + 8
    return BucketTable(torch.tensor(rows, dtype=torch.long)), s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("g_scale", [None, 0.25, 1.0])
def test_pack_bucket_triton_equals_reference_bit_for_bit(dtype, g_scale):
    """``pack_bucket``: one launch writes or adds ``(c·x)²`` and ``g_scale·x`` for every segment of a
    bucket table, as the reference's torch ops do, on the GPU when there is one (the interpreter
    otherwise); the buffer outside the segments is untouched."""
    from vrgd_ds.optim import _impl

    g = torch.Generator().manual_seed(3)
    table, used = _bucket_table(_triton.CHUNK + 64, 16)
    src = (torch.randn(used + 5, generator=g) * 300).to(dtype)
    start = torch.randn(8 * (_triton.CHUNK + 64), generator=g)
    want, got = start.clone(), start.clone().to(DEVICE)
    _impl.Reference().pack_bucket(src, table, want, 0.25, g_scale)
    _triton.Triton().pack_bucket(src.to(DEVICE), table, got, 0.25, g_scale)
    assert torch.equal(got.cpu(), want)
    assert not torch.equal(want, start)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_bucket_triton_folds_the_engines_accumulation(dtype):
    """``main`` accumulates the source in the same launch: an fp32 ``main`` bit for bit as the
    reference (``Tensor.add_``); a bf16 one rounds to nearest even on the GPU, by truncation
    under the interpreter (its documented difference), so within one bf16 unit there."""
    from vrgd_ds.optim import _impl

    g = torch.Generator().manual_seed(5)
    table, used = _bucket_table(_triton.CHUNK + 64, 16)
    src = (torch.randn(used, generator=g) * 3).to(dtype)
    for main_dtype in {torch.float32, dtype}:
        main0 = torch.randn(used, generator=g).to(main_dtype)
        want, got = main0.clone(), main0.clone().to(DEVICE)
        out_w, out_g = torch.zeros(8 * (_triton.CHUNK + 64)), torch.zeros(8 * (_triton.CHUNK + 64), device=DEVICE)
        _impl.Reference().pack_bucket(src, table, out_w, 0.25, 0.25, want)
        _triton.Triton().pack_bucket(src.to(DEVICE), table, out_g, 0.25, 0.25, got)
        assert torch.equal(out_g.cpu(), out_w)
        if main_dtype == torch.float32 or DEVICE == "cuda":
            assert torch.equal(got.cpu(), want)
        else:
            assert float((got.float() - want.float()).abs().max()) <= float(want.float().abs().max()) * 2 ** -7


@pytest.mark.parametrize("with_g", [False, True])
def test_unpack_bucket_moves_a_reduced_chunk_as_the_reference_does(with_g):
    """``unpack_bucket`` (the hierarchical scheme's move of a reduced chunk into a node buffer),
    rows written and rows added, sources in and out of step with the destinations, in the
    Triton kernels (on the GPU when there is one) and the C++ ones, bit for bit as the reference."""
    from vrgd_ds.optim import _fused, _impl

    g = torch.Generator().manual_seed(9)
    table, used = _bucket_table(_triton.CHUNK + 64, 16)
    src = torch.randn(used + 5 * (_triton.CHUNK + 64), generator=g)
    start = torch.randn(8 * (_triton.CHUNK + 64), generator=g)
    shift = 4 * (_triton.CHUNK + 64) + 1  # the squares' half, out of step by one element
    want = start.clone()
    _impl.Reference().unpack_bucket(src, table, want, shift, with_g)
    got = start.clone().to(DEVICE)
    _triton.Triton().unpack_bucket(src.to(DEVICE), table, got, shift, with_g)
    assert torch.equal(got.cpu(), want) and not torch.equal(want, start)
    if _fused.available():
        cpp = start.clone()
        _impl.Fused().unpack_bucket(src, table, cpp, shift, with_g)
        assert torch.equal(cpp, want)


def test_pack_bucket_fills_the_gpu_from_one_bucket(monkeypatch):
    """Each engine bucket is a launch of its own, so its programs must fill an H100 (132 SMs) on
    their own: DeepSpeed's default 5M-element bucket of BERT-large's tensors is cut into over a
    thousand programs of at most PACK_CHUNK elements. (Cut at CHUNK, 65,536 elements, the same
    bucket ran 77 programs and the statistics took 8.9 ms of GPU time per micro-step on an H100.)"""
    from vrgd_ds.optim.columns import BucketTable

    monkeypatch.setattr(_triton, "CHUNK", 1 << 16)
    sizes = [1024 * 1024, 4096 * 1024 - 7, 1024, 4096]  # a bucket of a layer's tensors, 5M elements in all
    rows, s = [], 0
    for n in sizes:
        rows.append([s, s, 10_000_000 + s, n, 0])
        s += n
    ch = _triton.Triton()._bucket_chunks(BucketTable(torch.tensor(rows)), torch.device("cpu"))
    assert ch.count >= 1200 and int(ch.bounds[:, 3].max()) <= _triton.PACK_CHUNK
    assert _triton.PACK_CHUNK <= _triton.CHUNK // 16


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_pack_bucket_does_not_synchronise():
    table, used = _bucket_table(4096, 0)
    src = torch.randn(used, device="cuda").bfloat16()
    out = torch.zeros(8 * 4096 + 2 * _triton.CHUNK, device="cuda")
    kernels = _triton.Triton()
    kernels.pack_bucket(src, table, out, 0.5, 0.5)  # compiles, copies the table once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        kernels.pack_bucket(src, table, out, 0.5, 0.5)
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ---- a kernel that fails to compile: fused=None falls back, fused="triton" raises --------------------


def _broken(launch: str, tmp_path):
    """``LAUNCHES[launch]`` with a kernel of the same signature that the compiler (and the
    interpreter) rejects: a static assertion that cannot hold."""
    import dataclasses
    import importlib.util
    import inspect

    spec = _triton.LAUNCHES[launch]
    params = inspect.signature(getattr(spec.kernel, "fn", spec.kernel)).parameters
    # the real kernel's annotations, so that compiling ahead on a GPU (placeholders of the annotated
    # types) reaches the compiler and its forced failure
    args = ", ".join(f"{n}: tl.constexpr" if "constexpr" in str(p.annotation) else
                     n if p.annotation is inspect.Parameter.empty else f"{n}: {str(p.annotation)!r}"
                     for n, p in params.items())
    path = tmp_path / f"broken_{launch}.py"
    path.write_text("import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
                    f"def _broken_kernel({args}):\n    tl.static_assert(BLOCK < 0, 'forced compile failure')\n")
    mod_spec = importlib.util.spec_from_file_location(f"broken_{launch}", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return dataclasses.replace(spec, kernel=mod._broken_kernel)


def _with_fallback(opt):
    """What ``select`` returns for ``fused=None`` on CUDA, on this CPU's interpreted kernels: one
    object for the optimizer and the tensor hooks that built their statistics source."""
    from vrgd_ds.optim import _impl

    opt._kernels = _impl.WithFallback(_triton.Triton(), type(opt).__name__)
    if opt.statistics_source is not None:
        opt.statistics_source.kernels = opt._kernels
    return opt


def test_fused_none_on_cuda_selects_the_kernels_with_fallback():
    from vrgd_ds.optim import _impl

    meta = [torch.empty(3, device="meta")]  # not a CPU tensor: the Triton branch of select()
    assert isinstance(_impl.select(None, meta, "X"), _impl.WithFallback)
    assert isinstance(_impl.select("triton", meta, "X"), _triton.Triton)


@pytest.mark.parametrize("name, launch", [("VRAdam", "adam"), ("VRLamb", "nonfinite"), ("VRMomentum", "sgd"),
                                          ("VRLamb", "accumulate"), ("VRLars", "grad_norms")])
def test_a_kernel_failing_to_compile_falls_back_to_the_reference(name, launch, tmp_path, monkeypatch, caplog):
    """fused=None: the compiler's message is logged once and the reference takes over; the
    failed step is redone there from the start (its step count not counted twice), so the run
    equals one on the reference throughout."""
    monkeypatch.setitem(_triton.LAUNCHES, launch, _broken(launch, tmp_path))
    batches = data(3, 2)
    m1, m2 = Net().to(DEVICE), Net().to(DEVICE)
    ref = run(m1, build(name, m1, False), batches)
    opt = _with_fallback(build(name, m2, "triton"))
    with caplog.at_level("WARNING"):
        got = run(m2, opt, batches)
    for a, b in zip(ref, got):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    warned = [r for r in caplog.records if "forced compile failure" in r.getMessage()]
    assert len(warned) == 1 and "using the reference implementation" in warned[0].getMessage()
    assert opt.kernels().name == "reference" and opt.step_calls == 3
    assert all(int(st["step"]) == 3 for st in opt.state.values())


def test_the_gpu_benchmark_times_the_kernels_inside_the_fallback_wrapper(tmp_path, monkeypatch):
    """benchmarks/gpu_optimizer_step.py refuses to time anything but the Triton kernels. Its check
    compared the class name with "Triton", and fused=None on CUDA hands them over inside the
    fallback wrapper, so every member of the family was reported "not measured" on a GPU (fails on
    the old script, which has no check_triton). The reference taking over after a failure is refused."""
    import importlib
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    bench = importlib.import_module("gpu_optimizer_step")
    m = Net().to(DEVICE)
    opt = _with_fallback(build("VRAdam", m, "triton"))
    bench.check_triton(opt, "VRAdam")  # the wrapper around the Triton kernels: accepted
    monkeypatch.setitem(_triton.LAUNCHES, "adam", _broken("adam", tmp_path))
    run(m, opt, data(1, 2))
    with pytest.raises(RuntimeError, match="VRAdam is not running the Triton kernels: reference"):
        bench.check_triton(opt, "VRAdam")
    with pytest.raises(RuntimeError, match="not running the Triton kernels"):
        bench.check_triton(build("VRAdam", Net().to(DEVICE), False), "VRAdam")
    sys.modules.pop("gpu_optimizer_step", None)


def test_fused_triton_raises_the_compile_failure(tmp_path, monkeypatch):
    monkeypatch.setitem(_triton.LAUNCHES, "adam", _broken("adam", tmp_path))
    m = Net().to(DEVICE)
    with pytest.raises(Exception, match="forced compile failure"):
        run(m, build("VRAdam", m, "triton"), data(1, 2))


def test_a_failure_after_the_step_wrote_state_is_not_papered_over(tmp_path, monkeypatch):
    """LAMB's second pass failing after the first pass wrote the moments: redoing the step would
    apply them twice, so under the interpreter (which compiles nothing ahead) it raises, naming
    the way out. On a GPU the second pass is compiled before the first runs, so its compile failure
    surfaces before anything is written and the step is redone on the reference: the run equals
    the reference's. (On an H100 this test failed with ``KeyError: ''``: the stand-in kernel had
    lost the real one's parameter types, which compiling ahead needs.)"""
    monkeypatch.setitem(_triton.LAUNCHES, "lamb_apply", _broken("lamb_apply", tmp_path))
    m = Net().to(DEVICE)
    if _triton.INTERPRETED:
        with pytest.raises(RuntimeError, match="cannot be redone.*fused=False"):
            run(m, _with_fallback(build("VRLamb", m, "triton")), data(1, 2))
        return
    m_ref, batches = Net().to(DEVICE), data(2, 2)
    ref = run(m_ref, build("VRLamb", m_ref, False), batches)
    opt = _with_fallback(build("VRLamb", m, "triton"))
    for a, b in zip(ref, run(m, opt, batches)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert opt.kernels().name == "reference" and all(int(st["step"]) == 2 for st in opt.state.values())


def test_an_untested_triton_release_is_named(monkeypatch, caplog):
    """A Triton outside the releases the compile check passed on: said once, with the way to
    check it; the kernels are still used (a failure hands over to the reference)."""
    from vrgd_ds import log
    from vrgd_ds.optim import _impl

    monkeypatch.setattr(triton, "__version__", "3.2.0")
    monkeypatch.setattr(log, "_warned", set())
    with caplog.at_level("WARNING"):
        kernels, why = _impl._triton()
    assert kernels is not None and why is None
    assert any("Triton 3.2.0" in r.getMessage() and "triton_aot" in r.getMessage() for r in caplog.records)


def test_a_rank_holding_no_piece_of_a_group_gets_empty_tables():
    """Under a layout a rank may hold no piece of a param group (Megatron's distributed optimizer
    with a small bias group), and its plan is empty: the kernels answer with empty tables, as
    the C++ kernels do. Fails on the code before: IndexError (the device of an empty list)."""
    k = _triton.Triton()
    seg = torch.zeros((0, 3), dtype=torch.int64)
    assert k.nonfinite([], seg).numel() == 0
    moments = k.checked_moments([], [], [], seg, 0.5, 1e-12)
    assert moments.shape[0] == 0


def test_a_loaded_state_of_other_strides_steps_as_a_contiguous_one():
    """A state whose moments were saved transposed (column-major strides, the same values) steps
    as the same state made contiguous, on every implementation. Fails on the code before: Triton
    read the moments in memory order (exp_avg 0.45 off, the weights 1.4e-3), the C++ kernels and
    the reference raised."""
    torch.manual_seed(0)
    w0 = torch.randn(6, 5)
    zs = [[torch.randn(5) + 0.3 for _ in range(2)] for _ in range(2)]

    def train(opt, w, steps):
        for step in steps:
            for z in step:
                (w @ z).sin().sum().backward()
            opt.step()
            opt.zero_grad()

    w = nn.Parameter(w0.clone())
    opt = vrgd_ds.VRAdam([w], fused=False)
    train(opt, w, zs[:1])
    saved = opt.state_dict()
    strided = copy.deepcopy(saved)
    for key in ("exp_avg", "exp_avg_sq", "gsnr_avg"):
        strided["state"][0][key] = saved["state"][0][key].t().contiguous().t()
        assert not strided["state"][0][key].is_contiguous()
    out = {}
    for fused, state in ((False, saved), (False, strided), (True, strided), ("triton", strided)):
        p = nn.Parameter(w.detach().clone())
        o = vrgd_ds.VRAdam([p], fused=fused)
        o.load_state_dict(copy.deepcopy(state))
        train(o, p, zs[1:])
        out.setdefault("contiguous" if state is saved else fused, p.detach())
    for fused in (False, True, "triton"):
        torch.testing.assert_close(out[fused], out["contiguous"], rtol=0, atol=1e-6)


def test_lamb_without_trust_ratio_keeps_a_nan_to_its_element():
    """A group without the trust ratio (``weight_decay=0``, ``use_nvlamb=False``) and one NaN
    weight: its update is the element-wise one, so the NaN stays in its element, on Triton as on
    the reference. Fails on the code before, whose "all False" adaptation mask (``n0 != n0``) was
    True where the weight norm was NaN: every element became NaN."""
    out = {}
    for fused in (False, "triton"):
        w = nn.Parameter(torch.arange(1.0, 9.0))
        with torch.no_grad():
            w[3] = float("nan")
        opt = vrgd_ds.VRLamb([w], lr=0.1, weight_decay=0.0, use_nvlamb=False, fused=fused)
        for k in range(2):
            (w * torch.linspace(-1, 1, 8) * (k + 1)).nansum().backward()
        opt.step()
        out[fused] = w.detach().isnan()
    assert out["triton"].sum() == 1 and torch.equal(out["triton"], out[False])


def test_a_nan_in_the_loaded_gsnr_average_reaches_its_element_on_every_implementation():
    """A loaded state whose GSNR momentum holds a NaN (a damaged checkpoint): the NaN reaches its
    weight on Triton as on the reference and the C++ kernels, where a check of the weights sees it.
    Fails on the code before: Triton's clamp to [lo, 1] returned lo for a NaN, so that element was
    damped to gamma for good while its state stayed NaN, and nothing reported it."""
    torch.manual_seed(0)
    w0, zs = torch.randn(8), [torch.randn(8) + 0.3 for _ in range(4)]
    out = {}
    for fused in (False, True, "triton"):
        w = nn.Parameter(w0.clone())
        opt = vrgd_ds.VRAdam([w], lr=0.1, fused=fused)
        for k in (0, 2):
            for z in zs[k:k + 2]:
                (w * z).sin().sum().backward()
            opt.step()
            opt.zero_grad()
            if k == 0:
                opt.state[w]["gsnr_avg"][3] = float("nan")
        out[fused] = w.detach().isnan()
    assert out[False].tolist() == [i == 3 for i in range(8)]
    for fused in (True, "triton"):
        assert torch.equal(out[fused], out[False]), fused


def test_pack_squares_of_a_strided_source_reads_its_elements():
    """A strided 1-D source (every other element): Triton packs its elements, as the reference and
    the fused kernels do. Fails on the code before, whose ``reshape(-1)`` kept the view strided
    and the kernel read the memory in order."""
    from vrgd_ds.optim import _impl

    src = torch.arange(16.0)[::2]
    g, sq = torch.empty(8), torch.empty(8)
    _triton.Triton().pack_squares(src, g, sq, 1.0)
    assert torch.equal(g, src) and torch.equal(sq, src * src)
    ref_g, ref_sq = torch.empty(8), torch.empty(8)
    _impl.Reference().pack_squares(src, ref_g, ref_sq, 1.0)
    assert torch.equal(g, ref_g) and torch.equal(sq, ref_sq)


def _flags(flags: dict) -> tuple:
    return tuple(sorted((k, str(v)) for k, v in flags.items()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name, over", [(n, {}) for n in REGISTRY] + [("Lamb", dict(adam_w_mode=False))],
                         ids=[*REGISTRY, "Lamb-L2"])
def test_every_launch_after_the_first_write_was_compiled_before_it(name, over, dtype, monkeypatch):
    """A step's kernels from the one that first writes state on are compiled before it runs
    (``then``), so that a compile failure on a GPU hands the whole step to the reference before
    anything is written. Every launch after a launch that compiles ahead must be one it (or one
    before it) compiled. Fails on the code before: the SGD family's and LARS's ``finish`` was
    not compiled with ``sgd``, and LAMB's L2 mode on bf16 compiled ``lamb_apply`` for fp32 (the
    copies its first pass reads) where it then stepped bf16; a compile failure there raised "cannot
    be redone". Counted here, on the interpreter, for what a GPU would compile."""
    launched = []
    original = _triton.Triton._launch

    def recorded(self, kernel, grid, *args, then=(), **flags):
        launched.append((kernel, _flags(flags), [(n, _flags(f)) for n, f in then]))
        return original(self, kernel, grid, *args, then=then, **flags)

    monkeypatch.setattr(_triton.Triton, "_launch", recorded)
    info = REGISTRY[name]
    p = nn.Parameter(torch.randn(64, dtype=dtype, device=DEVICE))
    opt = info.cls([p], fused="triton", **{**info.test_kwargs, **over})
    for _ in range(2):
        (p.float() * torch.randn(64, device=DEVICE)).sum().backward()
    opt.step()
    compiled, ahead, late = set(), False, []
    for kernel, flags, then in launched:
        if ahead and (kernel, flags) not in compiled:
            late.append(kernel)
        ahead = ahead or bool(then)
        compiled |= set(then)
    assert ahead and late == [], launched
