"""The VRGD family under FSDP2 (``vrgd_ds.fsdp``): what the statistics add to a training step.

    torchrun --nproc_per_node 2 benchmarks/fsdp_step.py [--layers 2 --width 256 --accumulation 2]

A stack of transformer encoder layers, each its own ``fully_shard`` unit (as torchtitan shards
a transformer's blocks), trained with VRLamb and with Lamb side by side: the steps of the two
alternate, so both see the same machine. Printed per optimizer step, measured:

* the extra collectives the statistics issue and their bytes, against FSDP's own reduce-scatter
  bytes of the gradient (``counters`` of the statistics source; FSDP's counted at its
  reduce-scatter);
* the small per-tensor collectives of the step (GSNR mean, trust-ratio norms, skip flag,
  metrics), each batched over every tensor;
* launches of the statistics kernels and tensor hooks;
* the statistics' memory per rank against the parameters' shard;
* the time of a whole step (forward, backward, step), VRLamb / Lamb, median over repeats.

On CPU ranks (gloo) FSDP needs ``set_force_sum_reduction_for_comms(True)``; the benchmark sets it.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist


def build(layers: int, width: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width,
                                                                  batch_first=True, dropout=0.0)
                                 for _ in range(layers)])


def shard(model: torch.nn.Module, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for m in model.modules():
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--accumulation", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12, help="timed steps per optimizer (after 2 warm-up steps)")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    import vrgd_ds
    import vrgd_ds.fsdp

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    fsdp_bytes = [0]
    default_call = _fsdp_collectives.DefaultReduceScatter.__call__

    def counted(self, output_tensor, input_tensor, group, op, async_op=False):
        fsdp_bytes[0] += input_tensor.numel() * input_tensor.element_size()
        return default_call(self, output_tensor, input_tensor, group, op, async_op)

    _fsdp_collectives.DefaultReduceScatter.__call__ = counted  # FSDP's own gradient bytes (ours inherit it)
    runs = {}
    for name, cls in (("VRLamb", vrgd_ds.VRLamb), ("Lamb", vrgd_ds.Lamb)):
        model = build(args.layers, args.width, seed=0)
        shard(model, mesh)
        opt = cls(model.parameters(), lr=1e-3)
        stats = vrgd_ds.fsdp.attach(model, opt)
        runs[name] = (model, opt, stats)
    gen = torch.Generator().manual_seed(rank)
    data = [torch.randn(args.batch, args.seq, args.width, generator=gen) for _ in range(args.accumulation)]

    def step(name: str) -> dict[str, float]:
        model, opt, stats = runs[name]
        before = (fsdp_bytes[0], stats.counters.collectives if stats else 0, stats.counters.bytes_sent if stats else 0,
                  opt._layout.counters.collectives, stats.stat_counters.launches if stats else 0)
        dist.barrier()
        t0 = time.perf_counter()
        for x in data:
            (model(x).pow(2).mean() / args.accumulation).backward()
        opt.step()
        opt.zero_grad()
        dist.barrier()
        took = time.perf_counter() - t0
        return dict(time=took, fsdp_bytes=fsdp_bytes[0] - before[0] - ((stats.counters.bytes_sent - before[2])
                                                                         if stats else 0),
                    collectives=(stats.counters.collectives - before[1]) if stats else 0,
                    bytes=(stats.counters.bytes_sent - before[2]) if stats else 0,
                    layout=opt._layout.counters.collectives - before[3],
                    launches=(stats.stat_counters.launches - before[4]) if stats else 0)

    for _ in range(2):
        for name in runs:
            step(name)
    seen: dict[str, list[dict[str, float]]] = {name: [] for name in runs}
    for _ in range(args.steps):
        for name in runs:
            seen[name].append(step(name))
    if rank:
        dist.destroy_process_group()
        return
    vr, base = seen["VRLamb"][-1], seen["Lamb"][-1]
    model, opt, stats = runs["VRLamb"]
    shard_numel = sum(p._local_tensor.numel() for p in model.parameters())
    t_vr = statistics.median(s["time"] for s in seen["VRLamb"])
    t_base = statistics.median(s["time"] for s in seen["Lamb"])
    print(f"FSDP2 on {world} CPU ranks (gloo), {args.layers} encoder layers of width {args.width}, "
          f"{sum(p.numel() for p in model.parameters())} parameters, accumulation {args.accumulation}; per step:")
    print(f"  FSDP's own reduce-scatter of the gradient: {base['fsdp_bytes']} B in {len(model) * args.accumulation} "
          "collectives")
    print(f"  statistics: {vr['collectives']:.0f} extra collectives, {vr['bytes']:.0f} B "
          f"({vr['bytes'] / base['fsdp_bytes']:.2f}x FSDP's gradient bytes)")
    print(f"  per-tensor sums: VRLamb {vr['layout']:.0f} small collectives, Lamb {base['layout']:.0f}")
    print(f"  statistics launches: {vr['launches']:.0f} ({vr['launches'] / (len(model) * args.accumulation):.0f} per "
          f"reduction), tensor hooks: {stats.stat_counters.hooks}")
    print(f"  statistics memory per rank: {stats.buffer_bytes()} B = {stats.buffer_bytes() / shard_numel:.2f} B per "
          "parameter of the rank's shard")
    print(f"  whole step: VRLamb {t_vr * 1e3:.1f} ms, Lamb {t_base * 1e3:.1f} ms: VRLamb / Lamb = {t_vr / t_base:.3f} "
          f"(median of {args.steps})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
