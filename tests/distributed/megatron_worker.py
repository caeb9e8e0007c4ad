"""Cases for the VRGD family under megatron-core on CPU ranks (gloo), run in a rank pool of their
own (``test_megatron.py``): Megatron's ``DistributedDataParallel`` over a tensor-parallel model,
with and without the distributed optimizer and overlap, against the single-process optimizer on
the unsharded model.

megatron-core 0.16.1 assumes CUDA in three places; ``prepare`` patches them for these ranks only
(test-only, never in the package): ``torch.cuda.current_device`` answers ``"cpu"``,
``Tensor.type()`` reports a ``torch.cuda.*`` type (the distributed optimizer checks it), and
tensor factories asked for ``device="cuda"`` build on the CPU.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist

_PATCHED = False


def prepare(case: dict) -> dict:
    """Megatron's three CUDA assumptions, answered for CPU ranks (once per process)."""
    global _PATCHED
    if _PATCHED:
        return {}
    torch.cuda.current_device = lambda: "cpu"
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
    _PATCHED = True
    return {}


@contextlib.contextmanager
def model_parallel(tp: int, pp: int = 1):
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    try:
        yield ps
    finally:
        ps.destroy_model_parallel()


def _config(tp: int, **kwargs):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, use_cpu_initialization=True,
                             tensor_model_parallel_size=tp, **kwargs)


class TwoLayers(torch.nn.Module):
    """A column-parallel then a row-parallel linear layer: weights split on either axis, a
    split bias (column) and a bias every tensor-parallel rank holds whole (row)."""

    def __init__(self, cfg) -> None:
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        super().__init__()
        init = functools.partial(torch.nn.init.normal_, std=0.3)
        self.c = ColumnParallelLinear(8, 16, config=cfg, init_method=init, bias=True, gather_output=False)
        self.r = RowParallelLinear(16, 4, config=cfg, init_method=init, bias=True, input_is_parallel=True,
                                   skip_bias_add=False)

    def forward(self, x):
        h, _ = self.c(x)
        y, _ = self.r(torch.tanh(h))
        return y


def _gather(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    parts = [torch.zeros_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim)


def _full(model: TwoLayers, ps) -> list[torch.Tensor]:
    """The unsharded weights, in the reference model's order."""
    g = ps.get_tensor_model_parallel_group()
    return [_gather(model.c.weight.data, 0, g), _gather(model.c.bias.data, 0, g),
            _gather(model.r.weight.data, 1, g), model.r.bias.data.clone()]


def _batch(dp_rank: int, micro: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + 97 * step + 13 * dp_rank + micro)
    return torch.randn(6, 8, generator=gen) * (1.0 + 0.5 * micro)


def equals_unsharded(case: dict) -> dict:
    """3 steps of ``case["optimizer"]`` through ``vrgd_ds.megatron`` against the same member on
    the unsharded model in one process (one backward per micro-batch of every data-parallel
    rank, the mean gradient, Megatron's clipping). Returns the largest relative difference."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups

    from vrgd_ds.megatron import get_megatron_optimizer
    from vrgd_ds.optim.registry import REGISTRY

    tp, accumulation, steps = case["tp"], case["accumulation"], case.get("steps", 3)
    with model_parallel(tp) as ps:
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        cfg = _config(tp)
        torch.manual_seed(0)
        model = TwoLayers(cfg)
        ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        with torch.no_grad():
            for p, w in zip(ref.parameters(), _full(model, ps)):
                p.copy_(w)
        ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=case["overlap"],
            use_distributed_optimizer=case["distributed"], bucket_size=case.get("bucket_size", 40)), model)
        ocfg = OptimizerConfig(optimizer="adam", lr=case.get("lr", 1e-2), weight_decay=0.1,
                               use_distributed_optimizer=case["distributed"], clip_grad=case.get("clip", 1.0))
        kwargs = dict(case.get("kwargs", {}))
        opt = get_megatron_optimizer(ocfg, [ddp], optimizer=case["optimizer"], optimizer_kwargs=kwargs)
        # the reference: the same member, groups and arguments on the unsharded model
        inner = opt.chained_optimizers[0].optimizer
        defaults = {k: v for k, v in inner.defaults.items() if k in REGISTRY[case["optimizer"]].accepted_params()}
        order = {id(p): i for i, p in enumerate(model.parameters())}
        full = list(ref.parameters())
        ref_groups = [{"params": [full[order[id(p)]] for p in g["params"]],
                       **{k: g[k] for k in ("lr", "weight_decay") if k in g}}
                      for g in _get_param_groups([ddp], ocfg, None) if g["params"]]
        ref_opt = REGISTRY[case["optimizer"]].cls(ref_groups, **defaults)
        oks = []
        for step in range(steps):
            ddp.zero_grad_buffer()
            opt.zero_grad()
            for m in range(accumulation):
                sync = contextlib.nullcontext() if m == accumulation - 1 else ddp.no_sync()
                with sync:
                    (ddp(_batch(dp_rank, m, step)).pow(2).sum() / accumulation).backward()
            ddp.finish_grad_sync()
            ok, _, _ = opt.step()
            oks.append(bool(ok))
            ref_opt.zero_grad()
            for d in range(dp):
                for m in range(accumulation):
                    (ref(_batch(d, m, step)).pow(2).sum() / accumulation).backward()
            for p in ref.parameters():
                p.grad /= dp
            if ocfg.clip_grad > 0:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), ocfg.clip_grad)
            ref_opt.step()
        got = _full(model, ps)
        import os
        if os.environ.get("MDEBUG"): print(dist.get_rank(), [((a - b).abs().max().item(), b.abs().max().item()) for a, b in zip(got, ref.parameters())], [x.abs().max().item() for x in _initial(case, tp, ps)], flush=True)
        rel = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, ref.parameters()))
        moved = max(((a - b).abs().max()).item() for a, b in zip(got, _initial(case, tp, ps)))
        source = opt.vrgd_sources[0]
        out = {"rel": rel, "moved": moved, "ok": oks, "n": source.n if source.n else None,
               "collectives": source.counters.collectives, "bytes": source.counters.bytes_sent,
               "grad_bytes": source.counters.grad_bytes_fp32, "dp": dp}
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, out)
        return {"worst": max(o["rel"] for o in everyone), "ranks": everyone}


def _initial(case: dict, tp: int, ps) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return _full(TwoLayers(_config(tp)), ps)
