"""``vrgd_ds.fsdp.torchtitan`` without a trainer run (the run is tests/integration/test_torchtitan.py):
names, defaults and the refusals that need no process group."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("torchtitan", reason="the torchtitan extra is not installed")

from vrgd_ds import VRLamb  # noqa: E402
from vrgd_ds.fsdp import UnsupportedFSDPConfiguration  # noqa: E402
from vrgd_ds.fsdp.torchtitan import VRGDOptimizersContainer, vrgd_optimizer, with_vrgd  # noqa: E402


def test_family_names_resolve_beside_torchtitans_own():
    p = [torch.nn.Parameter(torch.zeros(3))]
    assert isinstance(VRGDOptimizersContainer._resolve_optimizer_factory("VRLamb")([{"params": p}]), VRLamb)
    assert VRGDOptimizersContainer._resolve_optimizer_factory("AdamW") is torch.optim.AdamW
    with pytest.raises(ValueError, match="'VRLam' is not a VRGD optimizer"):
        vrgd_optimizer("VRLam", lr=1e-3)


def titan_groups(**optimizer_kwargs) -> list[dict]:
    """A param group as torchtitan 0.3.0's ``_build_param_groups`` makes it ("for-loop")."""
    return [{"params": [torch.nn.Parameter(torch.zeros(3))], "param_names": ["w"], "fused": False, "foreach": False,
             **optimizer_kwargs}]


def test_a_param_groups_optimizer_kwargs_are_made_as_the_constructor_makes_them():
    """torchtitan puts ``optimizer_kwargs`` into the param group and calls the constructor with
    its defaults. Fails on the old code, where they skipped the constructor: VRLamb's
    ``max_grad_norm`` left the pre-normalisation off (apex's clipping silently gone), ``amsgrad=True``
    and a misspelt ``gama`` were kept in the group and ignored, ``Lamb`` ran with the GSNR on,
    and ``set_grad_none`` was dropped."""
    from vrgd_ds import VRAdam

    build = VRGDOptimizersContainer._resolve_optimizer_factory
    group = build("VRLamb")(titan_groups(lr=2e-3, max_grad_norm=0.5)).param_groups[0]
    direct = VRLamb([torch.nn.Parameter(torch.zeros(3))], lr=2e-3, max_grad_norm=0.5).param_groups[0]
    assert {k: v for k, v in group.items() if k not in ("params", "param_names")} == \
        {k: v for k, v in direct.items() if k != "params"}
    assert group["grad_pre_normalization"] is True and group["param_names"] == ["w"]
    assert "fused" not in group and "foreach" not in group
    for name, kwargs, words in (
            ("VRLamb", dict(amsgrad=True), "param group 0 \\(VRLamb\\).*invalid amsgrad=True"),
            ("VRLamb", dict(gama=0.5), "VRLamb takes no 'gama'; did you mean 'gamma'\\?"),
            ("VRLamb", dict(set_grad_none=False), "optimizer_factory_kwargs_by_name=\\{'VRLamb': \\{'set_grad_none'"),
            ("Lamb", dict(gsnr=True), "Lamb is VRLamb with gsnr=False"),
            ("VRAdam", dict(lr=-1.0), "invalid lr=-1.0")):
        with pytest.raises(ValueError, match=words):
            build(name)(titan_groups(**kwargs))
    assert build("Lamb")(titan_groups(lr=1e-3)).param_groups[0]["gsnr"] is False
    assert isinstance(build("VRAdam")(titan_groups(betas=[0.8, 0.99])), VRAdam)
    # the configuration is checked where it is written, the optimizer's own settings set apart
    config = vrgd_optimizer("VRLamb", lr=1e-3, fused=True, set_grad_none=False)
    assert config.optimizer_factory_kwargs_by_name == {"VRLamb": {"fused": True, "set_grad_none": False}}
    assert config.param_groups[0].optimizer_kwargs == {"lr": 1e-3}
    with pytest.raises(ValueError, match="vrgd_optimizer\\('VRAdam'\\): VRAdam takes no 'set_grad_none'"):
        vrgd_optimizer("VRAdam", lr=1e-3, set_grad_none=False)
    config = vrgd_optimizer("VRLamb", lr=1e-3)
    config.param_groups[0].optimizer_kwargs["fused"] = True
    with pytest.raises(UnsupportedFSDPConfiguration, match="optimizer_factory_kwargs_by_name=\\{'VRLamb'"):
        VRGDOptimizersContainer(config, model_parts=[torch.nn.Linear(2, 2)])


@pytest.mark.parametrize("name", ["VRLamb", "VRLars", "VRMerit", "Lamb"])
def test_a_param_group_left_unadapted_by_the_trust_ratio_is_taken(name):
    """LAMB's and LARS's recipe leaves biases and norms unadapted (``trust_ratio=False``, as
    ``vrgd_ds.param_groups`` sets it): a group option the constructor does not take. A torchtitan
    param group with it builds that group; the members without it still refuse it. Fails on the
    code before, which took only the constructor's keywords and said the groups took no
    ``trust_ratio``."""
    build = VRGDOptimizersContainer._resolve_optimizer_factory
    group = build(name)(titan_groups(lr=1e-3, weight_decay=0.0, trust_ratio=False)).param_groups[0]
    assert group["trust_ratio"] is False and group["weight_decay"] == 0.0
    assert build(name)(titan_groups(lr=1e-3)).param_groups[0]["trust_ratio"] is True
    assert vrgd_optimizer(name, lr=1e-3, trust_ratio=False).param_groups[0].optimizer_kwargs["trust_ratio"] is False
    with pytest.raises(ValueError, match="VRAdam takes no 'trust_ratio'"):
        build("VRAdam")(titan_groups(lr=1e-3, trust_ratio=False))


def test_a_group_option_among_the_factory_kwargs_is_refused_naming_where_it_goes():
    """Every VRGD param group is built with all of its options (``group_options``), so a group
    option in ``optimizer_factory_kwargs_by_name`` changed only the optimizer's ``defaults``:
    ``gamma=0.5`` there trained with 0.1. Fails on the old code, which accepted it silently."""
    config = vrgd_optimizer("VRLamb", lr=1e-3, set_grad_none=False)
    config.optimizer_factory_kwargs_by_name["VRLamb"]["gamma"] = 0.5
    with pytest.raises(UnsupportedFSDPConfiguration, match="optimizer_factory_kwargs_by_name\\['VRLamb'\\] sets "
                                                           "'gamma', a param group's option"):
        VRGDOptimizersContainer(config, model_parts=[torch.nn.Linear(2, 2)])


def test_the_container_injects_no_fused_kernels_by_default():
    """torchtitan's own default, implementation="fused", puts fused=True into every param group,
    which a VRGD optimizer refuses at attach."""
    assert vrgd_optimizer("VRLamb", lr=1e-3).implementation == "for-loop"


@pytest.mark.parametrize("field, value, words", [
    ("implementation", "fused_opt_states_bf16", "optimizer.implementation='fused_opt_states_bf16'"),
    # before: refused at attach, naming param-group keys a torchtitan user cannot edit
    ("implementation", "fused", "optimizer.implementation='fused' is not supported with a VRGD optimizer"),
    ("implementation", "foreach", "--optimizer.implementation for-loop"),
    ("parts", 2, "pipeline parallelism (2 model parts"),
    # the option to change, in torchtitan's words (the message before named none)
    ("parts", 2, "set parallelism.pipeline_parallel_degree to 1"),
])
def test_container_refusals_name_the_option(field, value, words):
    config = vrgd_optimizer("VRLamb", lr=1e-3)
    parts = [torch.nn.Linear(2, 2)]
    if field == "parts":
        parts = parts * value
    else:
        setattr(config, field, value)
    with pytest.raises(UnsupportedFSDPConfiguration, match=words.replace("(", r"\(")):
        VRGDOptimizersContainer(config, model_parts=parts)


def test_a_seed_checkpoint_builds_the_container_and_its_state_and_refuses_a_step():
    """torchtitan's seed checkpoint (``--checkpoint.create_seed_checkpoint``) builds the optimizers
    on one rank with the model unsharded (``parallelize_fn`` skipped): the container is built with
    the VRGD optimizers unattached, and their state is made for a checkpoint, but a training
    step is refused, naming the sharding to train with. Fails on the old code, which raised at
    attach ("needs a model sharded with torch.distributed.fsdp.fully_shard"), so no seed
    checkpoint could be made with a VRGD optimizer."""
    model = torch.nn.Linear(4, 3)
    container = VRGDOptimizersContainer(vrgd_optimizer("VRLamb", lr=1e-3), model_parts=[model])
    assert container.statistics == [] and "seed checkpoint" in container.not_attached
    state = container.state_dict()
    assert {"state.weight.gsnr_avg", "state.bias.exp_avg"} <= set(state)
    container.load_state_dict(state)
    model(torch.ones(2, 4)).sum().backward()
    with pytest.raises(UnsupportedFSDPConfiguration, match="a training step, but the model has no FSDP module "
                                                           r".*data_parallel_shard_degree >= 2"):
        container.step()
    assert torch.equal(state["state.weight.gsnr_avg"], container.state_dict()["state.weight.gsnr_avg"])


def test_with_vrgd_refuses_context_and_expert_parallelism_after_the_optimizer_is_built():
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    calls = []
    config.model_spec.post_optimizer_build_fn = lambda *args: calls.append(args)  # the model's own hook
    config = with_vrgd(config, "VRLamb", lr=1e-3)
    assert type(config.optimizer).__qualname__ == "VRGDOptimizersContainer.Config"
    hook = config.model_spec.post_optimizer_build_fn
    # pipeline parallelism: before, one stage per rank passed and each stage's sums ran over every rank
    for dims, words in ((SimpleNamespace(cp=2, ep=1), "parallelism.context_parallel_degree=2"),
                        (SimpleNamespace(cp=1, ep=4), "parallelism.expert_parallel_degree=4"),
                        (SimpleNamespace(pp=2, cp=1, ep=1), "parallelism.pipeline_parallel_degree=2")):
        with pytest.raises(UnsupportedFSDPConfiguration, match=words):
            hook(None, [], dims)
    assert not calls
    hook("opt", ["part"], SimpleNamespace(cp=1, ep=1))
    assert calls == [("opt", ["part"], SimpleNamespace(cp=1, ep=1))]
    # a config without its model spec yet: before, with_vrgd returned it with no check installed
    # anywhere, and the run went unchecked (fails on the old code)
    bare = llama3_debugmodel()
    bare.model_spec = None
    with pytest.raises(ValueError, match="config.model_spec is None; set the model spec first"):
        with_vrgd(bare, "VRLamb", lr=1e-3)


def test_the_containers_metrics_are_over_every_vrgd_optimizers_tensors():
    """torchtitan builds an optimizer per optimizer name (VRLamb on one tensor, VRAdam on
    another): the container's metrics are those of one optimizer over both tensors (the noise
    scale's moments summed, the GSNR mean over both), and a step one of them skipped is a skipped
    step. Fails on the old code, which merged the optimizers' dicts key by key: the last one's
    figures alone, and beside its skip the other's noise scale."""
    import math

    import vrgd_ds

    torch.manual_seed(0)

    def step(opt, w, mu, nan=False):
        for _ in range(8):
            z = mu + torch.randn(16, w.numel())
            (-(z @ w).mean()).backward()
        if nan:
            w.grad[0] = float("nan")
        opt.step()
        opt.zero_grad()

    wa, wb = torch.nn.Parameter(torch.zeros(1000)), torch.nn.Parameter(torch.zeros(1000))
    a, b = vrgd_ds.VRLamb([wa], lr=0.0), vrgd_ds.VRAdam([wb], lr=0.0)
    step(a, wa, torch.full((1000,), 1.0))
    step(b, wb, torch.full((1000,), 0.01))
    container = SimpleNamespace(optimizers=[a, b])
    got, ma, mb = VRGDOptimizersContainer.gsnr_metrics(container), a.gsnr_metrics(), b.gsnr_metrics()
    for key in ("noise_scale/trace_cov", "noise_scale/grad_sq"):
        assert math.isclose(got[key], ma[key] + mb[key], rel_tol=1e-9), key
    assert math.isclose(got["noise_scale/b_simple_groups"], got["noise_scale/trace_cov"] / got["noise_scale/grad_sq"],
                        rel_tol=1e-9)
    assert math.isclose(got["gsnr/mean"], (ma["gsnr/mean"] + mb["gsnr/mean"]) / 2, rel_tol=1e-9)
    assert got["gsnr/max"] == max(ma["gsnr/max"], mb["gsnr/max"]) and got["step/skipped"] == 0.0
    step(a, wa, torch.full((1000,), 1.0))
    step(b, wb, torch.full((1000,), 0.01), nan=True)
    got = VRGDOptimizersContainer.gsnr_metrics(container)
    assert got["step/skipped"] == 1.0 and got["step/skipped_total"] == 1.0
    assert not any(k.startswith(("noise_scale/", "gsnr/mean")) for k in got), got
    # the first optimizer with the GSNR off records no gradient groups (n = 0): the container's
    # are the other's. Fails on the old code, which took the first record's n: the noise scale raised
    off = vrgd_ds.VRLamb([wa], lr=0.0, gsnr=False)
    step(off, wa, torch.full((1000,), 1.0))
    step(b, wb, torch.full((1000,), 0.01))
    got, mb = VRGDOptimizersContainer.gsnr_metrics(SimpleNamespace(optimizers=[off, b])), b.gsnr_metrics()
    assert got["gsnr/n"] == mb["gsnr/n"] == 8
    for key in ("noise_scale/trace_cov", "noise_scale/grad_sq", "gsnr/mean"):
        assert math.isclose(got[key], mb[key], rel_tol=1e-9), key


def test_with_vrgd_turns_cuda_graphs_off_and_a_capture_is_refused(monkeypatch):
    """torchtitan captures forward and backward in a CUDA graph on NVIDIA GPUs unless
    ``training.disable_cuda_graphs``; a replay runs none of the statistics' Python (their counts stay
    0 and the step fails on n=0, or the capture itself fails). ``with_vrgd`` turns the graphs off,
    and a reduction under capture is refused naming the option. Fails on the code before, which
    left the llama3 debug model's default (False) and had no check."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from vrgd_ds.fsdp.stats import FSDPStats

    assert llama3_debugmodel().training.disable_cuda_graphs is False  # torchtitan's default here
    assert with_vrgd(llama3_debugmodel(), "VRLamb", lr=1e-3).training.disable_cuda_graphs is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(UnsupportedFSDPConfiguration, match="CUDA graph.*training.disable_cuda_graphs"):
        object.__new__(FSDPStats).about_to_reduce(0)


EXPERTS = """
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
from torch.distributed.tensor import Shard
from vrgd_ds.fsdp import UnsupportedFSDPConfiguration
from vrgd_ds.fsdp.torchtitan import VRGDOptimizersContainer, vrgd_optimizer

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
experts = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "efsdp"))["efsdp"]
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
moe = set(model[1].parameters())
infos = {True: _get_mesh_info(experts, None), False: _get_mesh_info(mesh, None)}
fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), infos[p in moe]))
try:
    VRGDOptimizersContainer(vrgd_optimizer("VRLamb", lr=1e-3), model_parts=[model])
except UnsupportedFSDPConfiguration as e:
    print(e)
"""


@pytest.mark.exhaustive  # a subprocess, about 5 s
def test_expert_parallelism_is_refused_by_the_container_naming_torchtitans_option():
    """torchtitan under expert parallelism shards a MoE block's experts on a mesh of their own
    (``shard_placement_fn``: two FSDP parameter groups in one module); the container, built before
    ``with_vrgd``'s check runs, refuses it naming ``parallelism.expert_parallel_degree``. Fails on
    the code before, whose refusal named ``shard_placement_fn`` only, which a torchtitan user does
    not set. 4 ranks of a fake process group, in a process of its own."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", EXPERTS], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "several FSDP parameter groups" in run.stdout, run.stdout
    assert "set parallelism.expert_parallel_degree to 1" in run.stdout, run.stdout


@pytest.mark.parametrize("comm, hinted", [("SymmMemReduceScatter", True), ("ProcessGroupAllocReduceScatter", False)])
def test_a_replaced_reduce_scatter_names_torchtitans_option_only_for_symmetric_memory(comm, hinted):
    """FSDP's refusal of a replaced reduce-scatter names every FSDP option that replaces it and the
    class that did; the container adds torchtitan's ``parallelism.enable_fsdp_symm_mem`` only where
    that class is symmetric memory's, the one torchtitan's option installs. Fails on the code
    before, which matched the option's name, in every such refusal: a custom ``parallelize_fn``
    allocating from the process group was told to turn symmetric memory off."""
    from vrgd_ds.fsdp.torchtitan import _in_torchtitan_terms

    refusal = (f"vrgd_ds.fsdp: FSDP's reduce-scatter replaced by {comm} (set_custom_reduce_scatter, "
               "set_symm_mem_for_comm, allocation from the process group) is not supported")
    with pytest.raises(UnsupportedFSDPConfiguration) as raised, _in_torchtitan_terms():
        raise UnsupportedFSDPConfiguration(refusal)
    assert str(raised.value).startswith(refusal)
    assert ("set parallelism.enable_fsdp_symm_mem to false" in str(raised.value)) == hinted
