"""MERIT and VR-MERIT in one process against a float64 transcription of Algorithm 1 as the
authors' code runs it (``vrgd_ds/optim/merit.py`` gives the lines and where paper and code
differ): 2-D, 1-D and odd shapes (3-D, a single row, a single column), several steps, both
implementations; ``gamma=1`` is MERIT bit for bit; the cut of a tensor into pieces (what
ZeRO does) gives the same step as the whole tensor."""
from __future__ import annotations

import pytest
import torch

import vrgd_ds
from vrgd_ds.optim import _fused
from vrgd_ds.optim.merit import MaxTable

IMPLS = [False, pytest.param(None, marks=pytest.mark.skipif(not _fused.available(), reason="no C++ toolchain"))]
SHAPES = [(6, 9), (11,), (3, 5, 4), (1, 7), (8, 1), (4, 6)]
GROUPS = 4


def oracle_step(theta, m, v, grad, step, *, lr, betas, eps, wd, bias_correction, scale=None, adapt=True):
    """One MERIT step in float64 for one tensor; ``scale``: p̂ on the first moment (VR-MERIT)."""
    b1, b2 = betas
    g = grad.double()
    m.mul_(b1).add_((g if scale is None else scale * g) * (1 - b1))
    v.mul_(b2).add_(g * g * (1 - b2))
    mh, vh = (m / (1 - b1**step), v / (1 - b2**step)) if bias_correction else (m, v)
    u = mh / (vh.sqrt() + eps) + wd * theta
    w_abs, u_abs = theta.abs(), u.abs()
    if not adapt:
        s = torch.ones_like(u)
    elif theta.dim() >= 2:
        b = w_abs.max() / u_abs.max()
        rw, cw = w_abs.amax(1, keepdim=True).expand_as(u), w_abs.amax(0, keepdim=True).expand_as(u)
        ru, cu = u_abs.amax(1, keepdim=True).expand_as(u), u_abs.amax(0, keepdim=True).expand_as(u)
        s = torch.maximum(rw / ru, cw / cu).clamp(min=float(b))
        s[(rw == 0) | (ru == 0) | (cw == 0) | (cu == 0)] = 1.0
    else:
        wm, um = w_abs.max(), u_abs.max()
        s = torch.ones_like(u) * (1.0 if wm == 0 or um == 0 else float(wm / um))
    theta.sub_(lr * (u * s).clamp(-1, 1))


def oracle_gsnr(group_grads: list[torch.Tensor], gamma: float) -> torch.Tensor:
    """p̂ without momentum (beta3=0): clamp(r / mean r, gamma, 1), r = ḡ² / var (float64)."""
    g = torch.stack([x.double() for x in group_grads])
    gbar, s = g.mean(0), (g * g).mean(0)
    r = gbar**2 / ((s - gbar**2).clamp_min(0) + 1e-12)
    return (r / r.mean()).clamp(gamma, 1.0)


def run(cls, kwargs, steps=4, seed=0, shapes=SHAPES, fused=False):
    """``steps`` of ``cls`` on tensors of ``shapes`` with GROUPS backward()s a step; returns the
    optimizer's parameters and the float64 oracle's."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    params[1].data[3] = 0.0  # a zero weight in a 1-D tensor
    params[0].data[2] = 0.0  # a whole zero row: the guard sets s = 1 there
    opt = cls(params, fused=fused, **kwargs)
    ref = [p.detach().double().clone() for p in params]
    mom = [(torch.zeros_like(r), torch.zeros_like(r)) for r in ref]
    for step in range(1, steps + 1):
        grads = [[torch.randn(p.shape, generator=gen) * (1 + 3 * torch.rand(p.shape, generator=gen))
                  for p in params] for _ in range(GROUPS)]
        for k in range(GROUPS):
            loss = sum((p * g).sum() for p, g in zip(params, grads[k])) / GROUPS
            loss.backward()
        opt.step()
        opt.zero_grad()
        for i, (r, (m, v)) in enumerate(zip(ref, mom)):
            mean = sum(g[i].double() for g in grads) / GROUPS
            scale = oracle_gsnr([g[i] for g in grads], kwargs["gamma"]) if kwargs.get("gsnr", True) and \
                cls is vrgd_ds.VRMerit and kwargs.get("gamma", 0.1) < 1 else None
            oracle_step(r, m, v, mean, step, lr=kwargs["lr"], betas=kwargs.get("betas", (0.9, 0.999)),
                        eps=kwargs.get("eps", 1e-6), wd=kwargs.get("weight_decay", 0.0),
                        bias_correction=kwargs.get("bias_correction", False), scale=scale)
    return [p.detach() for p in params], ref


def assert_close(got, want, start_seed=0):
    gen = torch.Generator().manual_seed(start_seed)
    init = [torch.randn(p.shape, generator=gen).double() for p in got]
    for a, b, b0 in zip(got, want, init):
        moved = float((b - b0).abs().max())
        assert float((a.double() - b).abs().max()) <= 2e-5 * max(moved, 1e-3), (a.shape, moved)


@pytest.mark.parametrize("fused", IMPLS)
@pytest.mark.parametrize("kwargs", [dict(lr=1e-2), dict(lr=3e-2, weight_decay=0.1),
                                    dict(lr=1e-2, bias_correction=True, betas=(0.8, 0.99), eps=1e-8)])
def test_merit_equals_the_float64_transcription(kwargs, fused):
    got, want = run(vrgd_ds.Merit, kwargs, fused=fused)
    assert_close(got, want)


@pytest.mark.parametrize("fused", IMPLS)
def test_vr_merit_equals_the_transcription_with_p_hat_on_the_first_moment(fused):
    kwargs = dict(lr=1e-2, weight_decay=0.1, gamma=0.1, beta3=0.0)
    got, want = run(vrgd_ds.VRMerit, kwargs, fused=fused)
    assert_close(got, want)
    plain, _ = run(vrgd_ds.Merit, dict(lr=1e-2, weight_decay=0.1), fused=fused)
    # the GSNR matters: the run without it ends elsewhere, by far more than the tolerance above
    assert max(float((a - b).abs().max()) for a, b in zip(got, plain)) > 1e-3


@pytest.mark.parametrize("fused", IMPLS)
def test_gamma_one_is_merit_bit_for_bit(fused):
    kwargs = dict(lr=1e-2, weight_decay=0.1)
    vr, _ = run(vrgd_ds.VRMerit, dict(kwargs, gamma=1.0), fused=fused)
    base, _ = run(vrgd_ds.Merit, kwargs, fused=fused)
    assert all(torch.equal(a, b) for a, b in zip(vr, base))


def test_trust_ratio_false_keeps_s_one_and_still_clips():
    gen = torch.Generator().manual_seed(3)
    w = torch.nn.Parameter(torch.randn(5, 4, generator=gen))
    ref = w.detach().double().clone()
    opt = vrgd_ds.Merit([{"params": [w], "trust_ratio": False}], lr=0.5)
    g = torch.randn(5, 4, generator=gen)
    w.grad = g.clone()
    opt.step()
    oracle_step(ref, torch.zeros_like(ref), torch.zeros_like(ref), g, 1, lr=0.5, betas=(0.9, 0.999), eps=1e-6,
                wd=0.0, bias_correction=False, adapt=False)
    assert torch.allclose(w.detach().double(), ref, atol=1e-6)


def test_max_table_positions_follow_dims_zero_and_one():
    """Rows are maxima over dim 1, columns over dim 0, further dims kept apart (the authors' code)."""
    table = MaxTable({0: (3, 4, 2), 1: (5,)})
    assert table.size == 2 + 2 * (3 + 4) * 2 + 2
    w_row, w_col, u_row, u_col = table.indices(0, 0, 24, torch.device("cpu"))
    e = torch.arange(24).view(3, 4, 2)
    i, j, k = torch.meshgrid(torch.arange(3), torch.arange(4), torch.arange(2), indexing="ij")
    assert torch.equal(w_row.view(3, 4, 2), 2 + i * 2 + k)
    assert torch.equal(w_col.view(3, 4, 2), 2 + 6 + j * 2 + k)
    assert torch.equal(u_row - w_row, torch.full_like(e.view(-1), 14))
    assert torch.equal(u_col - w_col, torch.full_like(e.view(-1), 14))
    assert table.indices(1, 0, 5, torch.device("cpu")) is None


class _CutLayout:
    """Every tensor of one group as pieces of several flat tensors, as ZeRO cuts them (one rank)."""

    def __init__(self, shapes, flats, cuts):
        self.names = [f"t{i}" for i in range(len(shapes))]
        self.shapes = [tuple(s) for s in shapes]
        self.numel = torch.tensor([float(torch.Size(s).numel()) for s in shapes], dtype=torch.float64)
        self._pieces = {id(f): c for f, c in zip(flats, cuts)}
        self.replicated = None

    @property
    def num_keys(self):
        return len(self.names)

    def segments(self, p):
        return [(s, n, k) for s, n, k, _ in self._pieces[id(p)]]

    def offsets(self, p):
        return [o for *_, o in self._pieces[id(p)]]

    def all_reduce(self, t, op):
        pass

    def all_reduce_stages(self, t, op):
        pass

    def join_stages(self, sums, maxs):
        return sums, maxs, self.names


@pytest.mark.parametrize("fused", IMPLS)
def test_a_tensor_cut_into_pieces_steps_as_the_whole(fused):
    """Two flat tensors holding a [6, 9] matrix cut mid-row (and so through every column) and a
    1-D tensor: the same step as the optimizer over the whole tensors."""
    gen = torch.Generator().manual_seed(5)
    shapes = [(6, 9), (7,)]
    whole = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    flat = torch.cat([p.detach().reshape(-1) for p in whole])
    flats = [torch.nn.Parameter(flat[:23].clone()), torch.nn.Parameter(flat[23:].clone())]
    layout = _CutLayout(shapes, flats, [[(0, 23, 0, 0)], [(0, 31, 0, 23), (31, 7, 1, 0)]])
    kwargs = dict(lr=1e-2, weight_decay=0.1, gsnr=False)
    a, b = vrgd_ds.VRMerit(whole, fused=fused, **kwargs), vrgd_ds.VRMerit(flats, fused=fused, **kwargs)
    b.set_statistics_source(None, layout)
    for _ in range(3):
        g = torch.randn(flat.numel(), generator=gen)
        for p, piece in zip(whole, g.split([54, 7])):
            p.grad = piece.view(p.shape).clone()
        flats[0].grad, flats[1].grad = g[:23].clone(), g[23:].clone()
        a.step()
        b.step()
    assert torch.equal(torch.cat([p.detach().reshape(-1) for p in whole]), torch.cat([f.detach() for f in flats]))
