"""torchtitan 0.3.0's trainer on CPU ranks (gloo), for tests only: the config registry that
``torchtitan.train --module torchtitan_cpu`` imports (this directory on ``PYTHONPATH``).

torchtitan assumes a GPU. Two stand-ins make its trainer run on CPU ranks, applied when this
module is imported, before the trainer is built (never in the package):

* torchtitan binds ``device_type = _get_available_device_type() or "cuda"`` and ``device_module``
  at import (``tools/utils.py``) and several modules copy them: each copy is set to ``"cpu"`` and
  a stand-in device module (no-op device selection and memory statistics);
* FlexAttention has no backward on CPU: torchtitan's compiled flex attention is replaced by eager
  scaled-dot-product attention on the dense mask of the same block mask (causal, per document).

``make_assets`` writes what the llama3 debug model reads, offline: a byte-level BPE tokenizer
trained on the embedded corpus and a c4-shaped JSON-lines dataset of its documents.
"""
from __future__ import annotations

import json
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import torch

from torchtitan.components.optimizer import ParamGroupConfig

from vrgd_ds.fsdp.torchtitan import VRGDOptimizersContainer, with_vrgd


def _device_stand_in() -> types.SimpleNamespace:
    props = types.SimpleNamespace(total_memory=64 * 2**30, name="cpu")
    nothing = lambda *a, **k: None  # noqa: E731
    return types.SimpleNamespace(
        set_device=nothing, synchronize=nothing, reset_peak_memory_stats=nothing, empty_cache=nothing,
        device_count=lambda: 1, current_device=lambda: 0, is_available=lambda: True,
        get_device_name=lambda *a, **k: "cpu", get_device_properties=lambda *a, **k: props,
        memory_stats=lambda *a, **k: {}, manual_seed=torch.manual_seed, manual_seed_all=torch.manual_seed,
        get_rng_state=torch.get_rng_state, set_rng_state=torch.set_rng_state, Stream=torch.cpu.Stream,
        current_stream=torch.cpu.current_stream, stream=torch.cpu.stream)


def _eager_flex_attention() -> None:
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import AuxOutput, create_mask
    from torchtitan.models.common.attention import FlexAttention

    def attend(q, k, v, *, score_mod=None, block_mask=None, scale=None, enable_gqa=False, return_aux=None,
               kernel_options=None):
        if score_mod is not None or (return_aux is not None and return_aux.lse):
            raise NotImplementedError("the CPU stand-in of flex attention takes a block mask only")
        mask = None
        if block_mask is not None:
            batch = q.shape[0] if block_mask.shape[0] != 1 else 1
            mask = create_mask(block_mask.mask_mod, batch, 1, q.shape[-2], k.shape[-2], device=q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa), AuxOutput()

    FlexAttention._compiled_flex_attn = staticmethod(attend)


def on_cpu() -> None:
    import torchtitan.trainer  # noqa: F401  (every module that copies the device binding is loaded by now)

    stand_in = _device_stand_in()
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("torchtitan"):
            continue
        if getattr(module, "device_type", None) == "cuda":
            module.device_type = "cpu"
        if getattr(module, "device_module", None) is torch.cuda:
            module.device_module = stand_in
    _eager_flex_attention()


class LoggedContainer(VRGDOptimizersContainer):
    """The VRGD container printing each step's n and mean GSNR on rank 0 (the test reads them)."""

    @dataclass(kw_only=True, slots=True)
    class Config(VRGDOptimizersContainer.Config):
        pass

    def step(self, closure=None):
        super().step(closure)
        metrics = self.gsnr_metrics()
        if torch.distributed.get_rank() == 0:
            print(f"VRGD step: n={metrics.get('gsnr/n')} gsnr_mean={metrics.get('gsnr/mean')} "
                  f"skipped={metrics.get('step/skipped')}", flush=True)


def llama3_debugmodel_vr_lamb_cpu():
    """The llama3 debug model with VRLamb, FSDP reducing with sums (gloo)."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    on_cpu()
    config = with_vrgd(llama3_debugmodel(), "VRLamb", lr=8e-4, weight_decay=0.1, gamma=0.1, beta3=0.9)
    config.optimizer = LoggedContainer.Config(param_groups=config.optimizer.param_groups,
                                              force_sum_reduction_for_comms=True)
    return config


def make_assets(root: Path, vocab: int = 2000) -> tuple[Path, Path]:
    """(tokenizer directory, dataset directory) for the debug model, from the embedded corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from vrgd_ds.data_pipeline.corpus import embedded_corpus

    texts = ["\n".join(doc) for doc in embedded_corpus()]
    data = root / "c4_test"
    data.mkdir(parents=True, exist_ok=True)
    with open(data / "c4-mini.json", "w") as fh:
        for text in texts:
            fh.write(json.dumps({"text": text}) + "\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tokenizer = root / "tokenizer"
    tokenizer.mkdir(parents=True, exist_ok=True)
    tok.save(str(tokenizer / "tokenizer.json"))
    (tokenizer / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_bos_token": True,
        "add_eos_token": True}))
    return tokenizer, data


def llama3_debugmodel_adamw_cpu():
    """The same with torch's AdamW through the same container (the baseline of a resume)."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    on_cpu()
    config = llama3_debugmodel()
    config.optimizer = LoggedContainer.Config(param_groups=[ParamGroupConfig(
        pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 8e-4, "weight_decay": 0.1})],
        force_sum_reduction_for_comms=True)
    return config
