"""apex ``FusedLAMB``'s constructor arguments on :class:`vrgd_ds.VRLamb` / :class:`vrgd_ds.VRFusedLAMB`,
against a float64 transcription of apex's semantics (``apex/optimizers/fused_lamb.py`` and
``csrc/multi_tensor_lamb.cu``: global-norm clipping, grad averaging, mode 0/1 decay, per-tensor
trust ratio unclamped and applied where ``use_nvlamb`` or the group's decay is non-zero).

Every flag is checked twice: our step equals the transcription, and the flag changes the result
by far more than the tolerance (a flag that were ignored could not pass)."""
from __future__ import annotations

import math

import pytest
import torch

import vrgd_ds

SHAPES = [(7, 5), (5,), (3, 4, 3), (1,)]
STEPS = 4


def _apex_f64(params, grads, groups, *, lr, betas, eps, bias_correction, grad_averaging, adam_w_mode, max_grad_norm,
              use_nvlamb):
    """apex's LAMB in float64. ``groups``: list of (indices, weight_decay); ``grads``: per step, per param."""
    beta1, beta2 = betas
    p = [t.double().clone() for t in params]
    m = [torch.zeros_like(t) for t in p]
    v = [torch.zeros_like(t) for t in p]
    for t, gs in enumerate(grads, start=1):
        gs = [g.double() for g in gs]
        norm = math.sqrt(sum(float((g * g).sum()) for g in gs))
        clip = norm / max_grad_norm if norm > max_grad_norm else 1.0
        bc1 = 1 - beta1 ** t if bias_correction else 1.0
        bc2 = 1 - beta2 ** t if bias_correction else 1.0
        beta3 = 1 - beta1 if grad_averaging else 1.0
        for idx, decay in groups:
            for i in idx:
                sg = gs[i] / clip
                if not adam_w_mode:
                    sg = sg + decay * p[i]
                m[i] = m[i] * beta1 + beta3 * sg
                v[i] = v[i] * beta2 + (1 - beta2) * sg * sg
                u = (m[i] / bc1) / ((v[i] / bc2).sqrt() + eps)
                if adam_w_mode:
                    u = u + decay * p[i]
                ratio = 1.0
                if use_nvlamb or decay != 0:
                    pn, un = float(p[i].norm()), float(u.norm())
                    ratio = pn / un if pn != 0 and un != 0 else 1.0
                p[i] = p[i] - lr * ratio * u
    return p


APEX_DEFAULTS = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-6, bias_correction=True, grad_averaging=True,
                     adam_w_mode=True, max_grad_norm=1.0, use_nvlamb=False)
FLAGS = {  # one flag away from apex's defaults
    "defaults": {},
    "use_nvlamb": dict(use_nvlamb=True),
    "grad_averaging_off": dict(grad_averaging=False),
    "l2_mode": dict(adam_w_mode=False),
    "no_bias_correction": dict(bias_correction=False),
    "no_clipping": dict(max_grad_norm=1e6),
}


def _problem():
    gen = torch.Generator().manual_seed(3)
    params = [torch.randn(s, generator=gen) for s in SHAPES]
    params[3].zero_()  # a zero-norm tensor: trust ratio guarded to 1
    grads = [[torch.randn(s, generator=gen) * (3.0 if k % 2 else 0.1) for s in SHAPES] for k in range(STEPS)]
    return params, grads, [([0, 2], 0.01), ([1, 3], 0.0)]  # a decayed group and a bias/LN-like group


def _ours(cls, params, grads, groups, flags, fused):
    ps = [torch.nn.Parameter(t.clone()) for t in params]
    opt = cls([{"params": [ps[i] for i in idx], "weight_decay": wd} for idx, wd in groups], gsnr=False, fused=fused,
              **flags)
    for gs in grads:
        for p, g in zip(ps, gs):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in ps]


def _compare(ours, want):
    for a, b in zip(ours, want):
        torch.testing.assert_close(a.double(), b, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("fused", [False, None], ids=["reference", "fused"])
@pytest.mark.parametrize("name", list(FLAGS))
def test_vr_fused_lamb_equals_apex_per_flag(name, fused):
    """``VRFusedLAMB(gsnr=False, **flag)`` equals apex's LAMB with that flag over 4 steps (clipping
    active on odd steps, a zero-norm tensor, a group without decay); the flag moves the result."""
    params, grads, groups = _problem()
    flags = dict(APEX_DEFAULTS, **FLAGS[name])
    want = _apex_f64(params, grads, groups, **flags)
    ctor = {k: v for k, v in flags.items()}
    _compare(_ours(vrgd_ds.VRFusedLAMB, params, grads, groups, ctor, fused), want)
    if name != "defaults":
        base = _apex_f64(params, grads, groups, **APEX_DEFAULTS)
        assert max(float((a - b).abs().max()) for a, b in zip(want, base)) > 1e-3, f"{name} changes nothing here"


@pytest.mark.parametrize("fused", [False, True, "triton"])
def test_l2_mode_on_bf16_parameters_feeds_the_moments_in_fp32(fused):
    """apex's L2 mode adds wd · θ to the gradient in fp32. Before, the sum was rounded to the
    parameters' bf16 first: with θ = ±1 and wd 0.01 a gradient of 1e-4 reached the moments as
    0.71e-4 and one of 2e-5 as -0.98e-5 (the wrong sign), on every path. Now bf16 parameters
    give the moments fp32 parameters of the same values give. Fails on the old code."""
    if fused == "triton":
        pytest.importorskip("triton")
    g = torch.tensor([1e-4, -3e-4, 2e-5]).bfloat16().float()  # bf16 values: only the sum could round
    moments = {}
    for dtype in (torch.float32, torch.bfloat16):
        state = [{}]
        vrgd_ds.optim.vr_lamb([torch.tensor([1.0, 1.0, -1.0], dtype=dtype)], [g.to(dtype)], state, gsnr=False,
                              adam_w_mode=False, weight_decay=0.01, fused=fused)
        moments[dtype] = state[0]["exp_avg"]
    assert torch.equal(moments[torch.bfloat16], moments[torch.float32])
    torch.testing.assert_close(moments[torch.float32] / 0.1, g + 0.01 * torch.tensor([1.0, 1.0, -1.0]))


def test_vr_lamb_takes_the_same_arguments_with_explicit_values():
    """:class:`VRLamb` given apex's values explicitly (clamp opened, clipping by passing
    ``max_grad_norm``) is the same optimizer as :class:`VRFusedLAMB`: bit for bit."""
    params, grads, groups = _problem()
    flags = dict(APEX_DEFAULTS, grad_averaging=False, use_nvlamb=False)
    a = _ours(vrgd_ds.VRFusedLAMB, params, grads, groups, flags, None)
    b = _ours(vrgd_ds.VRLamb, params, grads, groups, dict(flags, min_coeff=0.0, max_coeff=math.inf), None)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_max_grad_norm_given_turns_clipping_on_and_grad_pre_normalization_can_turn_it_off():
    """``max_grad_norm`` means what apex means (clip the global norm) when given; without it, or
    with ``grad_pre_normalization=False``, gradients are not pre-normalised."""
    opt = vrgd_ds.VRLamb([torch.nn.Parameter(torch.ones(2))], max_grad_norm=0.5)
    assert opt.param_groups[0]["grad_pre_normalization"] and opt.param_groups[0]["max_grad_norm"] == 0.5
    opt = vrgd_ds.VRLamb([torch.nn.Parameter(torch.ones(2))])
    assert not opt.param_groups[0]["grad_pre_normalization"]
    opt = vrgd_ds.VRLamb([torch.nn.Parameter(torch.ones(2))], max_grad_norm=0.5, grad_pre_normalization=False)
    assert not opt.param_groups[0]["grad_pre_normalization"]


def test_gamma_one_equals_gsnr_off_bit_for_bit():
    """VR-FusedLAMB at ``gamma=1`` is apex's LAMB (2 micro-batches per step through the hooks)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    twin = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    vr = vrgd_ds.VRFusedLAMB(model.parameters(), lr=1e-2, gamma=1.0)
    base = vrgd_ds.VRFusedLAMB(twin, lr=1e-2, gsnr=False)
    x, y = torch.randn(4, 6), torch.randn(4, 1)
    for _ in range(3):
        grads = []
        for half in (slice(0, 2), slice(2, 4)):
            ((model(x[half]) - y[half]) ** 2).mean().div(2).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        vr.step()
        vr.zero_grad()
        for p, g in zip(twin, grads):
            p.grad = g
        base.step()
        base.zero_grad()
    for a, b in zip(model.parameters(), twin):
        assert torch.equal(a, b)


def test_refusals_name_the_argument():
    """``amsgrad=True`` is refused (as apex does); L2 mode with the GSNR on is refused with the reason."""
    p = [torch.nn.Parameter(torch.ones(2))]
    with pytest.raises(ValueError, match="amsgrad"):
        vrgd_ds.VRFusedLAMB(p, amsgrad=True)
    with pytest.raises(ValueError, match="adam_w_mode=False.*gsnr=False"):
        vrgd_ds.VRFusedLAMB(p, adam_w_mode=False)
    vrgd_ds.VRFusedLAMB(p, adam_w_mode=False, gsnr=False)


def test_set_grad_none_sets_the_default_of_zero_grad():
    p = torch.nn.Parameter(torch.ones(2))
    for flag, want_none in ((True, True), (False, False)):
        opt = vrgd_ds.VRFusedLAMB([p], set_grad_none=flag, gsnr=False)
        p.grad = torch.ones(2)
        opt.zero_grad()
        assert (p.grad is None) == want_none
