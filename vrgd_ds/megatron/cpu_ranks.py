"""megatron-core 0.16.1 on CPU ranks (gloo): its three CUDA assumptions answered for this process.

For tests and for the Megatron job on CPU ranks: the job's engine (``vrgd_ds/train/engines/
megatron.py``) applies it, with a log line, only where no GPU is; nothing else in the package
imports it. The three places: ``torch.cuda.current_device()`` (the grad buffers),
``Tensor.type()`` (the distributed optimizer checks for a ``torch.cuda.*`` type) and tensor
factories asked for ``device="cuda"`` (the optimizer wrappers and gradient clipping). A fourth
for models from ``megatron.core.models``: the model-parallel RNG tracker's ``fork`` (dropout
regions) runs on torch's CPU generator instead of a CUDA RNG state. A fifth for
dist-checkpointing saves: its file writer calls ``torch.cuda.synchronize()`` (nothing to wait
for on CPU ranks). A sixth for fp16 resumes: ``DynamicGradScaler.load_state_dict`` moves the
saved loss scale with ``.cuda()``; it stays on the CPU. A seventh for a GPT whose embeddings are
tied across pipeline stages: ``LanguageModule.setup_embeddings_and_output_layer`` moves the tied
weight with ``.cuda()`` before it sums the stages' copies; while it runs, ``Tensor.cuda`` leaves a
tensor where it is.
"""
from __future__ import annotations

import contextlib
import functools

import torch

_APPLIED = False


def apply() -> None:
    """Patches this process once (idempotent)."""
    global _APPLIED
    if _APPLIED or torch.cuda.is_available():
        return
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None
    original_type = torch.Tensor.type

    def tensor_type(self, *args, **kwargs):
        t = original_type(self, *args, **kwargs)
        if not args and not kwargs and isinstance(t, str) and t.startswith("torch.") and ".cuda." not in t:
            return "torch.cuda." + t[len("torch."):]
        return t

    torch.Tensor.type = tensor_type
    for name in ("tensor", "zeros", "ones", "empty", "full"):
        factory = getattr(torch, name)

        def on_cpu(*args, _factory=factory, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return _factory(*args, **kwargs)

        setattr(torch, name, functools.wraps(factory)(on_cpu))
    from megatron.core.tensor_parallel import random as tp_random

    tp_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler

    def load_scaler(self, state_dict):
        self._scale = state_dict["scale"].to("cpu")
        self._growth_tracker = state_dict["growth_tracker"]
        self._hysteresis_tracker = state_dict["hysteresis_tracker"]

    DynamicGradScaler.load_state_dict = load_scaler
    from megatron.core.models.common.language_module.language_module import LanguageModule

    setup = LanguageModule.setup_embeddings_and_output_layer

    @functools.wraps(setup)
    def setup_on_cpu(self, *args, **kwargs):
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *a, **k: t
        try:
            return setup(self, *args, **kwargs)
        finally:
            torch.Tensor.cuda = cuda

    LanguageModule.setup_embeddings_and_output_layer = setup_on_cpu
    _APPLIED = True
