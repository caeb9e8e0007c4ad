"""Each member's step as a public function (``vrgd_ds.optim.vr_lamb`` and the others): one
process, whole tensors, statistics the caller accumulated. What it is for: a reader or another
framework steps a member without the optimizer class, so it must be the class's step exactly."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import vrgd_ds
from vrgd_ds.optim import REGISTRY, functional
from vrgd_ds.stats.source import GivenStatistics

MEMBERS = [name for name, info in REGISTRY.items() if info.function is not None]


def _statistics(params, n, seed):
    """Σg and Σg² of ``n`` noisy gradient groups per parameter, and their mean (the gradient)."""
    g = torch.Generator().manual_seed(seed)
    groups = [[p.detach() * 0.1 + torch.randn(p.shape, generator=g) for p in params] for _ in range(n)]
    sum_g = [sum(gs[i] for gs in groups) for i in range(len(params))]
    sum_sq = [sum(gs[i].square() for gs in groups) for i in range(len(params))]
    return sum_g, sum_sq, [s / n for s in sum_g]


@pytest.mark.parametrize("gsnr", [True, False])
@pytest.mark.parametrize("name", MEMBERS)
def test_the_function_is_the_class_step_bit_for_bit(name, gsnr):
    """Three steps of ``vr_<member>`` on states the caller keeps equal three steps of the class fed
    the same statistics: parameters, every state tensor and the metrics, bit for bit."""
    info = REGISTRY[name]
    kwargs = {**info.test_kwargs, "gsnr": gsnr}
    torch.manual_seed(1)
    ours = [nn.Parameter(torch.randn(5, 4)), nn.Parameter(torch.randn(7))]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    opt = info.cls(theirs, **kwargs)
    states = [{} for _ in ours]
    for step in range(3):
        sum_g, sum_sq, mean = _statistics(ours, 4, seed=step)
        for p, gr in zip(theirs, mean):
            p.grad = gr.clone()
        opt.set_statistics_source(GivenStatistics(theirs, sum_g, sum_sq, 4) if gsnr else None)
        opt.step()
        got = info.function(ours, [m.clone() for m in mean], states, *((sum_g, sum_sq, 4) if gsnr else ()), **kwargs)
        want = opt.gsnr_metrics()
        assert got.keys() == {k for k in want if k != "step/skipped_total"}
        assert all(got[k] == want[k] or (got[k] != got[k] and want[k] != want[k]) for k in got)
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)
    for st, p in zip(states, theirs):
        assert st.keys() == opt.state[p].keys()
        assert all(torch.equal(st[k], opt.state[p][k]) for k in st)


def test_the_function_damps_a_noisy_coordinate_against_its_base():
    """What VR-LAMB is for, through the function: a coordinate whose gradient groups disagree moves
    less, relative to a clean one, than under LAMB (``gsnr=False``) from the same start."""
    n = 8
    g = torch.Generator().manual_seed(0)
    clean = torch.full((n, 1), 1.0)
    noisy = 1.0 + 6.0 * torch.randn(n, 1, generator=g)
    groups = torch.cat([clean, noisy], dim=1)  # [n groups, 2 coordinates]
    moved = {}
    for gsnr in (True, False):
        p = torch.zeros(2)
        p0 = p.clone()
        stats = ([groups.sum(0)], [groups.square().sum(0)], n) if gsnr else ()
        vrgd_ds.optim.vr_lamb([p], [groups.mean(0)], [{}], *stats, lr=0.1, weight_decay=0.0, gsnr=gsnr, beta3=0.0)
        moved[gsnr] = (p - p0).abs()
    assert moved[True][1] / moved[True][0] < 0.5 * (moved[False][1] / moved[False][0])


def test_an_unknown_option_is_named():
    p = torch.zeros(3)
    with pytest.raises(TypeError, match="unknown option 'gama'"):
        vrgd_ds.optim.vr_adam([p], [torch.ones(3)], [{}], gsnr=False, gama=0.1)


def test_an_option_out_of_range_is_refused_as_the_class_refuses_it():
    """The step functions check the ranges the constructors check. Fails on the code before,
    which checked only the members' own options: ``beta3=1`` stepped to NaN."""
    p = torch.zeros(3)
    with pytest.raises(ValueError, match="invalid beta3=1.0"):
        vrgd_ds.optim.vr_adam([p], [torch.ones(3)], [{}], [torch.ones(3)], [torch.ones(3)], 2, beta3=1.0)


def test_gsnr_without_statistics_is_refused_with_the_fix():
    p = torch.zeros(3)
    with pytest.raises(ValueError, match="pass Σg and Σg²"):
        vrgd_ds.optim.vr_adam([p], [torch.ones(3)], [{}])
    with pytest.raises(RuntimeError, match="at least 2 gradient groups"):
        vrgd_ds.optim.vr_adam([p], [torch.ones(3)], [{}], [torch.ones(3)], [torch.ones(3)], 1)


@pytest.mark.parametrize("fused", [None, False])
def test_statistics_not_fp32_or_not_shaped_like_their_parameter_are_named(fused):
    """Σg and Σg² are fp32 and shaped like each parameter, and the error says which is not.
    Fails on the code before: bf16 statistics stepped on the reference (``fused=False``) and,
    under the default ``fused=None``, failed in the C++ kernels ("sum_g: tensors must be
    float32", no index, no fix); a transposed Σg² failed inside a ``view``."""
    p, g = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"sum_g\[0\] is torch.bfloat16 .* the statistics are fp32"):
        vrgd_ds.optim.vr_adam([p], [g], [{}], [g.bfloat16()], [g.bfloat16()], 2, fused=fused)
    with pytest.raises(ValueError, match=r"sum_sq\[0\] is a non-contiguous torch.float32 of shape \(3, 2\)"):
        vrgd_ds.optim.vr_adam([p], [g], [{}], [g], [g.t()], 2, fused=fused)


@pytest.mark.parametrize("fused", [None, False])
def test_gradients_unlike_their_parameter_are_named(fused):
    """A gradient is its parameter's dtype, shape and device, and contiguous, as ``.grad`` is, and
    the statistics are contiguous: the error names the index and the fix. Fails on the code before,
    where the kernels read each tensor in memory order for the parameter's length: the C++ path
    stepped with half a gradient (reading past it), and the Triton one applied a transposed
    gradient untransposed and an fp32 gradient of a bf16 parameter as bf16 bits."""
    p, g = torch.zeros(4, 3), torch.ones(4, 3)
    step = vrgd_ds.optim.vr_adam
    with pytest.raises(ValueError, match=r"grads\[0\] is a non-contiguous float32 of shape \(4, 3\).*contiguous"):
        step([p], [torch.ones(3, 4).t()], [{}], gsnr=False, fused=fused)
    with pytest.raises(ValueError, match=r"grads\[0\] is float32 .* its parameter's dtype \(bfloat16\)"):
        step([p.bfloat16()], [g], [{}], gsnr=False, fused=fused)
    with pytest.raises(ValueError, match=r"grads\[0\] is float32 of shape \(6,\)"):
        step([p], [torch.ones(6)], [{}], gsnr=False, fused=fused)
    with pytest.raises(ValueError, match=r"1 gradients and 2 states given for 1 parameters"):
        step([p], [g], [{}, {}], gsnr=False, fused=fused)
    with pytest.raises(ValueError, match=r"sum_g\[0\] is a non-contiguous torch.float32 .* and contiguous"):
        step([p], [g], [{}], [torch.ones(3, 4).t()], [g], 2, fused=fused)
    assert not p.any()  # nothing stepped
    step([p], [g], [{}], [g], [g], 2, fused=fused)  # what is right steps
    assert p.any()


def test_options_are_the_classes_group_options():
    """``functional.options`` builds the group a constructor builds (defaults, derived values)."""
    for name in MEMBERS:
        info = REGISTRY[name]
        built = info.cls([nn.Parameter(torch.ones(2))], **info.test_kwargs).defaults
        assert functional.options(info.cls, info.test_kwargs) == {k: v for k, v in built.items()
                                                                  if k != "differentiable"}


def test_tensors_of_two_dtypes_in_one_call_are_refused_as_a_mixed_param_group_is():
    """fp32 and bf16 tensors in one functional call: refused naming both dtypes, as a param group
    mixing them is, unless ``fused=False``, which steps them on the reference. Fails on the code
    before: the C++ kernels' "expected scalar type Float but found BFloat16" (fused None or True)."""
    params = [torch.ones(3), torch.ones(3, dtype=torch.bfloat16)]
    grads = [torch.full((3,), 0.5), torch.full((3,), 0.5, dtype=torch.bfloat16)]
    for fused in (None, True):
        with pytest.raises(ValueError, match="VRAdam: the group mixes bfloat16 and float32 tensors"):
            vrgd_ds.optim.vr_adam(params, grads, [{}, {}], gsnr=False, fused=fused)
    vrgd_ds.optim.vr_adam(params, grads, [{}, {}], gsnr=False, fused=False, lr=0.1)
    assert all(bool((p < 1).all()) for p in params)
