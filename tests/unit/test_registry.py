"""The family as data: every consumer of the member list reads ``REGISTRY``, so a member added
there reaches all of them, and a consumer that keeps a list of its own fails here."""
from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

import pytest
import torch

import vrgd_ds
import vrgd_ds.optim
from vrgd_ds import REGISTRY
from vrgd_ds.ds import integration
from vrgd_ds.optim import registry

ROOT = Path(__file__).resolve().parents[2]
NAMES = list(REGISTRY)


@pytest.mark.parametrize("ours, theirs", [("VRLamb", "lamb"), ("VRAdam", "adam")])
def test_one_word_from_deepspeeds_optimizer_changes_only_the_gsnr(ours, theirs):
    """A DeepSpeed config switched from DeepSpeed's ``"Lamb"``/``"Adam"`` to ``"VRLamb"``/``"VRAdam"``
    and nothing else builds the member with the arguments DeepSpeed's own optimizer defaults to
    (``FusedLamb``, ``FusedAdam``: their signatures here), for every argument both take. Fails on
    the old code: the config names built our classes with apex's eps 1e-6 and weight_decay 0.01,
    so the switch also put weight decay on every parameter."""
    import inspect

    from deepspeed.ops.adam import FusedAdam
    from deepspeed.ops.lamb import FusedLamb

    deepspeed_cls = {"lamb": FusedLamb, "adam": FusedAdam}[theirs]
    defaults = {k: v.default for k, v in inspect.signature(deepspeed_cls.__init__).parameters.items()
                if v.default is not inspect.Parameter.empty}
    group = integration.resolve(ours)([torch.nn.Parameter(torch.ones(3))]).param_groups[0]
    # max_grad_norm: off by default in both (FusedLamb's 0 disables its clipping by the norms handed
    # to step(); ours is NVLAMB's pre-normalisation threshold, used with grad_pre_normalization only)
    shared = sorted(set(defaults) & set(group) - {"max_grad_norm"})
    assert {"lr", "eps", "weight_decay", "betas", "bias_correction"} <= set(shared)
    assert {k: group[k] for k in shared} == {k: tuple(v) if isinstance(v, tuple) else v
                                             for k, v in ((k, defaults[k]) for k in shared)}
    assert integration.resolve(ours)([torch.nn.Parameter(torch.ones(3))]).name == ours


@pytest.mark.parametrize("name", NAMES)
def test_every_member_is_exported_by_name(name):
    info = REGISTRY[name]
    assert info.cls([torch.nn.Parameter(torch.ones(3))], **info.test_kwargs).name == name  # messages, metrics
    assert getattr(vrgd_ds, name) is info.cls and name in vrgd_ds.__all__
    assert getattr(vrgd_ds.optim, name) is info.cls and name in vrgd_ds.optim.__all__


@pytest.mark.parametrize("name", NAMES)
def test_every_member_is_a_deepspeed_type_with_its_own_parameters(name):
    info = REGISTRY[name]
    from vrgd_ds.ds.names import DEEPSPEED_DEFAULTS, DEEPSPEED_LAMB  # "Lamb" is DeepSpeed's name too

    built = DEEPSPEED_DEFAULTS.get(name, info.cls)  # VRLamb, VRAdam: DeepSpeed's defaults for what is left out
    assert integration.NAMES[name] is info.cls and integration.resolve(name) is built
    cfg = {"optimizer": {"type": name, "params": dict(info.test_kwargs)}}
    assert integration.check_optimizer_block(cfg) is (DEEPSPEED_LAMB if name == "Lamb" else built)
    accepted = integration.accepted_params(info.cls)
    assert ("gsnr" in accepted) == info.vr  # a base variant fixes it
    with pytest.raises(integration.UnsupportedConfiguration, match=f"optimizer.params.gama: not a parameter of {name}"):
        integration.check_optimizer_block({"optimizer": {"type": name, "params": {"gama": 0.1}}})


@pytest.mark.parametrize("name", NAMES)
def test_a_switch_written_as_a_string_is_refused_naming_it(name):
    """``"gsnr": "false"`` (a config from YAML or a template): every switch a member takes is refused
    unless a bool, by the constructor and the config check alike, naming the key. Fails on the
    code before, which read "false" as true: VRLamb attached the statistics and trained as VR-LAMB
    where plain LAMB was asked for, and LAMB's use_nvlamb/adam_w_mode turned on."""
    from vrgd_ds.optim.checks import FLAGS

    info = REGISTRY[name]
    switches = [k for k in integration.accepted_params(info.cls) if k in FLAGS]
    assert switches or not info.vr  # every VR member has at least "gsnr"
    for key in switches:
        with pytest.raises(ValueError, match=f"invalid {key}='false': must be true or false"):
            info.cls([torch.nn.Parameter(torch.ones(3))], **dict(info.test_kwargs, **{key: "false"}))
        with pytest.raises(integration.UnsupportedConfiguration, match=f"optimizer.params.{key}: .*'false'"):
            integration.check_optimizer_block({"optimizer": {"type": name, "params": {key: "false"}}})
    with pytest.raises(integration.UnsupportedConfiguration, match="optimizer.params.lr: .*lr=True"):
        integration.check_optimizer_block({"optimizer": {"type": name, "params": {"lr": True}}})
    if info.vr:  # numpy's bools are bools
        import numpy as np

        assert not info.cls([torch.nn.Parameter(torch.ones(3))], **dict(info.test_kwargs, gsnr=np.False_)).param_groups[
            0]["gsnr"]


@pytest.mark.parametrize("name", NAMES)
def test_an_auto_value_nothing_filled_is_named(name):
    """``"weight_decay": "auto"`` in a config given to ``deepspeed.initialize`` directly (HF Trainer
    and Accelerate fill such values; nothing did): refused naming the key. Fails on the code before,
    whose message ("'>=' not supported between instances of 'str' and 'float'") named none."""
    with pytest.raises(integration.UnsupportedConfiguration,
                       match=r'optimizer.params.weight_decay: "auto" is left for HF Trainer or Accelerate'):
        integration.check_optimizer_block({"optimizer": {"type": name, "params": {"lr": 1e-3, "weight_decay": "auto"}}})
    if "betas" in integration.accepted_params(REGISTRY[name].cls):  # HF's "auto" betas, a pair
        with pytest.raises(integration.UnsupportedConfiguration, match=r'optimizer.params.betas: "auto" is left'):
            integration.check_optimizer_block({"optimizer": {"type": name, "params": {"betas": ["auto", "auto"]}}})


def test_ddp_names_every_member_when_given_something_else():
    from vrgd_ds import ddp

    with pytest.raises(TypeError) as exc:
        ddp.attach(torch.nn.Linear(1, 1), torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    assert all(name in str(exc.value) for name in NAMES)


def test_readme_table_is_the_registry():
    text = (ROOT / "README.md").read_text()
    got = re.search(r"<!-- registry table[^>]*-->\n(.*?)\n<!-- end registry table -->", text, re.S)
    assert got is not None, "README.md lost its registry table markers"
    assert got.group(1) == registry.table(), "README's table is stale: paste vrgd_ds.optim.registry.table()"


@pytest.mark.parametrize("name", NAMES)
def test_the_design_lists_every_member(name):
    section = (ROOT / "docs" / "design.md").read_text().split("### 1.1 The family")[1].split("### 1.2")[0]
    assert f"`{name}`" in section


@pytest.mark.parametrize("name", [n for n, i in REGISTRY.items() if i.variant_of is not None])
def test_a_base_variant_is_its_class_with_gsnr_off(name):
    info = REGISTRY[name]
    p = torch.nn.Parameter(torch.ones(3))
    opt = info.cls([p], **info.test_kwargs)
    assert isinstance(opt, info.variant_of) and not opt.param_groups[0]["gsnr"]
    assert REGISTRY[info.base] is info and info.base == name
    with pytest.raises(ValueError, match=f"{name} is {info.variant_of.__name__} with gsnr=False"):
        info.cls([p], gsnr=True)


@pytest.mark.parametrize("name", [n for n, i in REGISTRY.items() if not i.fused])
def test_a_member_without_a_fused_kernel_says_so_once(name, caplog):
    info = REGISTRY[name]
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = info.cls([p], **{**info.test_kwargs, "gsnr": False} if info.vr else info.test_kwargs)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            p.grad = torch.randn(4, 3)
            opt.step()
    lines = [r for r in caplog.records if "no fused kernel" in r.getMessage() and name in r.getMessage()]
    assert len(lines) == 1


@pytest.mark.parametrize("name", NAMES)
def test_every_member_names_kernel_operations_that_exist(name):
    from vrgd_ds.optim._impl import Kernels

    assert set(REGISTRY[name].kernels) <= {m for m in dir(Kernels) if not m.startswith("_")}


ONCE = """
import vrgd_ds
vrgd_ds.register()  # before DeepSpeed is imported: its import hook registers too
from deepspeed.runtime.engine import DeepSpeedEngine

f, wrappers = DeepSpeedEngine._configure_optimizer, 0
while f.__closure__ and "configure" in f.__code__.co_freevars:
    f = f.__closure__[f.__code__.co_freevars.index("configure")].cell_contents
    wrappers += 1
print(wrappers)
"""


@pytest.mark.exhaustive  # a fresh interpreter imports DeepSpeed (seconds)
def test_register_before_deepspeed_is_imported_patches_it_once():
    """``vrgd_ds.register()`` in a process that has not imported DeepSpeed: importing it inside
    ``register`` runs the import hook, which registers first. Fails on the code before, which
    then patched the engine a second time: every engine attached its statistics twice (two
    full-size buffers, an extra collective per step)."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", ONCE], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-1] == "1", run.stdout


def test_the_import_hook_finds_deepspeed_where_an_editable_install_puts_it(monkeypatch):
    """DeepSpeed installed with ``pip install -e`` is found by the editable install's finder,
    which setuptools appends to ``sys.meta_path``, not by the path finder: the hook takes the spec
    the finders after it give, in order, and wraps its loader so that ``import deepspeed``
    registers. Fails on the code that asked the path finder only: it found nothing there, and
    DeepSpeed loaded unregistered."""
    import importlib.util

    from vrgd_ds.ds import lazy

    class Loader(importlib.abc.Loader):
        def create_module(self, spec):
            return None

        def exec_module(self, module):
            raise AssertionError("not executed here")

    class EditableFinder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            return importlib.util.spec_from_loader(fullname, Loader()) if fullname == "deepspeed" else None

    hook = lazy._AfterImport()
    monkeypatch.setattr(sys, "path", [])  # the path finder finds no deepspeed
    monkeypatch.setattr(sys, "meta_path", [hook, *sys.meta_path, EditableFinder()])
    spec = hook.find_spec("deepspeed", None)
    assert spec is not None and isinstance(spec.loader, Loader)
    assert spec.loader.exec_module.__name__ == "exec_then_register"



TWICE = """
import sys
sys.path.insert(0, sys.argv[1])
import vrgd_ds
for attempt in (1, 2):
    try:
        import deepspeed
        print(attempt, "imported", deepspeed.__version__)
    except RuntimeError as e:
        print(attempt, "refused", str(e).split(":")[0])
"""


def test_an_unsupported_deepspeed_fails_every_import_not_the_first_only(tmp_path):
    """``import vrgd_ds``, then a DeepSpeed of another version imported twice: both imports fail
    with the version message. Fails on the code before, whose import hook left on the first try:
    the second import succeeded with nothing registered, and a VRGD name in the config then met
    DeepSpeed's unknown-optimizer error instead of the version's."""
    import subprocess

    (tmp_path / "deepspeed").mkdir()
    (tmp_path / "deepspeed" / "__init__.py").write_text('__version__ = "0.20.0"\n')
    run = subprocess.run([sys.executable, "-c", TWICE, str(tmp_path)], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines() == ["1 refused vrgd_ds supports DeepSpeed 0.19.8, found 0.20.0",
                                       "2 refused vrgd_ds supports DeepSpeed 0.19.8, found 0.20.0"], run.stdout


@pytest.mark.parametrize("name", ["Lamb", "Lars", "Merit"])
def test_a_base_variant_refuses_a_param_group_that_switches_the_gsnr_on(name):
    """``Lamb`` is ``VRLamb`` with ``gsnr=False``, so that VR-X against X differs in nothing
    else: a param group that sets ``gsnr`` True, given at construction or added later, is refused
    naming the group and the member to use, and the optimizer keeps its groups; ``gsnr`` False
    is accepted. Fails on the code before, which refused only the keyword: such a group ran the
    member's GSNR (metrics with n, damping) under the base optimizer's name."""
    import vrgd_ds

    variant = getattr(vrgd_ds, name)
    member = variant.of.__name__
    a, b = torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(2))
    with pytest.raises(ValueError, match=rf"{name} \(param group 1\): {name} is {member} with gsnr=False; use "
                                         rf"{member} for a param group with gsnr=True"):
        variant([{"params": [a]}, {"params": [b], "gsnr": True}], lr=0.1)
    opt = variant([a], lr=0.1)
    with pytest.raises(ValueError, match=rf"{name} \(param group 1\): {name} is {member} with gsnr=False"):
        opt.add_param_group({"params": [b], "gsnr": True})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [b], "gsnr": False})
    assert [g["gsnr"] for g in opt.param_groups] == [False, False]


def test_an_optimizer_pickled_without_fixed_options_takes_param_groups():
    """An optimizer pickled before the variants recorded their fixed options (no ``_fixed`` in its
    state) takes a param group after unpickling, as every attribute added since has a default
    there. Fails on the code before, whose group check read ``self._fixed`` directly: an
    AttributeError at ``add_param_group``."""
    import vrgd_ds

    a, b = torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(2))
    state = vrgd_ds.VRLamb([a], lr=0.1).__getstate__()
    del state["_fixed"]
    opt = vrgd_ds.VRLamb.__new__(vrgd_ds.VRLamb)  # as pickle restores it
    opt.__setstate__(state)
    opt.add_param_group({"params": [b]})
    assert len(opt.param_groups) == 2


@pytest.mark.parametrize("block, message", [
    ({"type": "VRLamb", "parms": {"gamma": 0.5}}, 'optimizer.parms: not a key of the optimizer block; did you mean '
                                                   "'params'"),
    ({"type": "VRLamb", "params": {}, "gsnr": False}, 'optimizer.gsnr: not a key of the optimizer block.*go in "params"'),
    ({"type": "VRLamb", "params": None}, r"optimizer.params: must be an object of VRLamb's arguments .*got null"),
    ({"type": "VRLamb", "params": []}, r"optimizer.params: must be an object .*got a list"),
    ({"type": "vrlamb"}, r"optimizer.type: 'vrlamb' is not a VRGD optimizer; did you mean 'VRLamb'\?"),
    ({"type": "Lamb", "params": {"gsnr": True}}, r"optimizer.params.gsnr: Lamb \(type 'Lamb'\) is VRLamb with "
                                                  r"gsnr=False; for gsnr=True use type 'VRLamb'"),
    ({"type": "Lamb", "params": {"gsnr": "false"}}, r"optimizer.params.gsnr: 'false' is not a bool \(Lamb fixes "
                                                     r"gsnr=False: leave it out\)"),
    ({"type": "VRLamb", "params": {"eps": "1e-8"}}, r"optimizer.params.eps: .*invalid eps='1e-8': must be a finite"),
    ({"type": "VRLamb", "params": {"betas": 0.9}}, r"optimizer.params.betas: .*must be a pair"),
    ({"type": "VRAdam", "params": {"eps": 0}}, r"optimizer.params.eps: .*must be >= 1.175e-38"),
    ({"type": "VRLamb", "params": {"weight_decay": True}}, r"optimizer.params.weight_decay: .*must be a finite"),
])
def test_an_optimizer_block_the_engine_would_misread_is_refused_naming_the_key(block, message):
    """Keys and values DeepSpeed would drop or misread are refused before any work, naming the
    key and the fix. Fails on the code before: a misspelt ``"parms"`` or an option beside
    ``"params"`` was ignored (DeepSpeed trained on the defaults: VR-LAMB where LAMB was asked
    for), ``"params": null`` passed and crashed after the data was prepared and ``[]`` was read
    as no options, ``"vrlamb"`` suggested ``'Lamb'`` (DeepSpeed's FusedLamb on a GPU), ``Lamb``
    with ``gsnr`` suggested ``gsnr_eps``, a string number raised a TypeError naming no key,
    ``betas: 0.9`` "'float' object is not iterable", ``eps: 0`` trained to NaN where an
    element's gradients were all 0, and ``true`` was a weight decay of 1."""
    with pytest.raises(integration.UnsupportedConfiguration, match=message):
        integration.check_optimizer_block({"optimizer": block})


def test_a_base_variant_takes_its_own_fixed_value_and_the_gsnr_options_off_are_said_to_do_nothing(caplog):
    """``Lamb`` with ``"gsnr": false`` (what it is) is accepted; the GSNR's own options with the
    GSNR off are kept (turning it on stays one word) and said, once, to change nothing. Fails on
    the code before, which refused Lamb's ``gsnr: false`` as not a parameter and took VRLamb's
    ``gamma`` with ``gsnr: false`` without a word."""
    from vrgd_ds.ds.names import DEEPSPEED_DEFAULTS

    assert integration.check_optimizer_block({"optimizer": {"type": "Lamb", "params": {"gsnr": False}}})
    with caplog.at_level(logging.WARNING):
        built = integration.check_optimizer_block(
            {"optimizer": {"type": "VRLamb", "params": {"gsnr": False, "gamma": 0.5, "beta3": 0.8}}})
        integration.check_optimizer_block({"optimizer": {"type": "VRLamb", "params": {"gamma": 0.5}}})
    assert built is DEEPSPEED_DEFAULTS["VRLamb"]
    said = [r.getMessage() for r in caplog.records if "change(s) nothing" in r.getMessage()]
    assert said == ["optimizer.params: gamma, beta3 with the GSNR off (gsnr: false) change(s) nothing: only the GSNR "
                    "reads them"]
