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
    assert VRGDOptimizersContainer._resolve_optimizer_factory("VRLamb") is VRLamb
    assert VRGDOptimizersContainer._resolve_optimizer_factory("AdamW") is torch.optim.AdamW
    with pytest.raises(ValueError, match="'VRLam' is not a VRGD optimizer"):
        vrgd_optimizer("VRLam", lr=1e-3)


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
