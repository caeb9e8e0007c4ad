"""Communication model of the GSNR statistics for BERT-large pretraining on 1-16 DGX-A100 nodes.

Per optimizer step of the 64k/32k and 128k/64k recipes (configs/bert_large_*), for 1, 2, 4, 8
and 16 nodes: the compute time, DeepSpeed's own gradient traffic under ZeRO-2, and the extra
traffic of the statistics in each scheme, with how much of it the backward pass cannot hide.

Hardware (NVIDIA DGX A100 datasheet): 8x A100-80GB per node; NVLink 3 / NVSwitch, 600 GB/s
bidirectional per GPU (300 GB/s each way); 8x 200 Gb/s HDR InfiniBand per node, one HCA per
GPU (25 GB/s each way per GPU); A100 dense bf16/fp16 tensor-core peak 312 TFLOPS.

Model (the formulas are below, stated once):

* compute: 6 · P · tokens FLOPs per optimizer step (forward + backward; Kaplan et al. 2020,
  "Scaling Laws for Neural Language Models", attention terms left out: at seq 128-512 and
  hidden 1024 they add ~5-20%) at ``--mfu`` of the peak, spread evenly over the GPUs. Backward
  is 2/3 of it.
* collectives: ring algorithms (NCCL's at these sizes). An all-reduce of B bytes over G GPUs
  moves 2 (G-1)/G · B through each GPU, a reduce-scatter (G-1)/G · B; the time is that over the
  bus bandwidth: NVLink on one node (``--nvlink-gbps``), else one GPU's InfiniBand share
  (``--ib-gbps``), each at ``--efficiency`` of the line rate (NCCL's bus bandwidth is ~80%).
* DeepSpeed ZeRO-2 reduces every micro-step's gradient in bf16 (2 B/param) with an all-reduce
  (``allreduce_and_scatter``); it hides behind the backward of the same micro-step.
* the statistics, bytes per optimizer step with A micro-steps:
  - ``per_micro_step``: the fused fp32 ``[g | g²]`` (8 B/param) replaces DeepSpeed's bf16
    reduction (2 B/param) at every micro-step: 6 B/param extra, A times;
  - ``per_step``: DeepSpeed's reduction untouched; one reduce-scatter of the local fp32 Σg² per
    optimizer step (4 B/param; 2 with bf16 squares), plus Σg in fp32 in bf16/fp16 training
    (``gbar="local"``: 8 B/param); it can overlap the last micro-step's backward.
  - ``hierarchical``: every micro-step one reduce-scatter of the bucket's fp32 statistics (4
    B/param, 8 with Σg) over the node's 8 GPUs on NVLink; once per step one reduce-scatter of the
    node buffer (1/8 of the flat statistics) over the nodes' GPUs of the same local index on
    InfiniBand. Both schemes send the same bytes out of each node per step; in this model's flat
    rings ``per_step``'s one collective crosses InfiniBand at every hop, the hierarchical one only
    among its N ranks.
  Exposed time: the link is shared, so the extra bytes cost what they add beyond the backward
  that covers DeepSpeed's own reduction (the whole backward per micro-step; the last micro-step's
  backward for the per-step collective; a micro-step's backward for its NVLink reduction).

Memory (``--memory``): bytes per GPU of the model states (bf16 parameters and gradients, fp32
master weights and the two LAMB/Adam moments, partitioned as ZeRO-2 or ZeRO-3 partitions them)
and of each scheme's statistics (bf16 training: Σg beside the squares): ``per_step`` a full-size
fp32 ``[Σg | Σg²]`` (8 B/param) and the partition's sums; ``hierarchical`` 1/8 of that, the
partition's sums and one bucket's transient buffers (8 B × the bucket: DeepSpeed's default
reduce_bucket_size, 5e8 elements, or the whole model where it is smaller); ``per_micro_step`` the partition's sums only. Activations are not counted:
"fits" leaves a quarter of the 80 GB to them. ``"squares": "auto"`` follows this model: the
per-step scheme where its buffer fits, the hierarchical one where it does not, and the
hierarchical one on a single node, where it sends nothing over InfiniBand
(``vrgd_ds.ds.config.auto_scheme``, which reads the device's free memory at attach).

Run: ``python benchmarks/comm_model.py [--mfu 0.45]`` (prints a Markdown table).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

PARAMS = 336_226_108  # transformers.BertForPreTraining, BERT-large, 30,522-token vocabulary (counted)
GPUS_PER_NODE = 8
PEAK_TFLOPS = 312.0  # A100 bf16/fp16 dense


@dataclass(frozen=True)
class Phase:
    name: str
    global_batch: int
    micro_batch: int
    seq: int


RECIPES = {
    "64k/32k": [Phase("p1", 65536, 64, 128), Phase("p2", 32768, 16, 512)],
    "128k/64k": [Phase("p1", 131072, 64, 128), Phase("p2", 65536, 16, 512)],
}
SCHEMES = {  # name: (bytes per parameter, once per micro-step?)
    "per_micro_step fp32": (8 - 2, True),
    "per_step fp32": (4, False),
    "per_step bf16 squares": (2, False),
    "per_step fp32 + Σg": (8, False),
    "hierarchical fp32 + Σg": (8, None),  # within the node every micro-step, across nodes once per step
}
MODEL_SIZES = {"0.3B": 0.336e9, "1.3B": 1.3e9, "7B": 7e9, "13B": 13e9}
GPU_BYTES = 80e9
FIT_SHARE = 0.75  # of the GPU's memory for model states and statistics: the rest for activations
BUCKET = 5e8  # DeepSpeed's default reduce_bucket_size, elements


def ring_time(nbytes: float, gpus: int, busbw: float, all_reduce: bool) -> float:
    if gpus == 1:
        return 0.0
    return (2 if all_reduce else 1) * (gpus - 1) / gpus * nbytes / busbw


def model(phase: Phase, nodes: int, args: argparse.Namespace) -> dict[str, float]:
    gpus = nodes * GPUS_PER_NODE
    accumulation = phase.global_batch // (phase.micro_batch * gpus)
    compute = 6 * PARAMS * phase.global_batch * phase.seq / (gpus * PEAK_TFLOPS * 1e12 * args.mfu)
    backward = compute * 2 / 3
    busbw = (args.nvlink_gbps if nodes == 1 else args.ib_gbps) * 1e9 * args.efficiency
    ds = accumulation * ring_time(2 * PARAMS, gpus, busbw, all_reduce=True)
    out = dict(gpus=gpus, accumulation=accumulation, compute_s=compute, ds_comm_s=ds)
    nvlink = args.nvlink_gbps * 1e9 * args.efficiency
    for name, (per_param, micro) in SCHEMES.items():
        if micro is None:  # hierarchical: NVLink every micro-step, InfiniBand once per step
            intra = ring_time(per_param * PARAMS, GPUS_PER_NODE, nvlink, all_reduce=False)
            inter = ring_time(per_param * PARAMS / GPUS_PER_NODE, nodes, args.ib_gbps * 1e9 * args.efficiency,
                              all_reduce=False)
            t = accumulation * intra + inter
            last_ds, last_bwd = ds / accumulation, backward / accumulation
            exposed = accumulation * max(0.0, intra - last_bwd) + max(
                0.0, last_ds + inter - last_bwd) - max(0.0, last_ds - last_bwd)
            out[name] = (per_param * PARAMS / GPUS_PER_NODE / 1e9 if nodes > 1 else 0.0, t,
                         exposed if args.overlap else t)
            continue
        nbytes = per_param * PARAMS * (accumulation if micro else 1)
        t = ring_time(nbytes, gpus, busbw, all_reduce=micro)
        if micro:
            exposed = max(0.0, ds + t - backward) - max(0.0, ds - backward)
        else:
            last_ds, last_bwd = ds / accumulation, backward / accumulation
            exposed = max(0.0, last_ds + t - last_bwd) - max(0.0, last_ds - last_bwd)
        out[name] = (nbytes / 1e9, t, exposed if args.overlap else t)
    return out


def memory(params: float, stage: int, nodes: int) -> dict[str, float]:
    """GB per GPU: the model states and each scheme's statistics (module docstring)."""
    gpus = nodes * GPUS_PER_NODE
    bf16_params = 2 * params / (gpus if stage == 3 else 1)
    states = bf16_params + 2 * params / gpus + 12 * params / gpus
    part = 8 * params / gpus
    stats = {"per_step": 8 * params + part, "hierarchical": 8 * params / GPUS_PER_NODE + part + 8 * min(BUCKET, params),
             "per_micro_step": part}
    return {"states": states / 1e9, **{k: v / 1e9 for k, v in stats.items()}}


def auto(params: float, stage: int, nodes: int) -> str:
    """The scheme ``"squares": "auto"`` picks under this model."""
    if stage == 3:
        return "per_micro_step"
    if nodes == 1:
        return "hierarchical"
    m = memory(params, stage, nodes)
    return "per_step" if m["states"] + m["per_step"] <= FIT_SHARE * GPU_BYTES / 1e9 else "hierarchical"


def print_memory() -> None:
    print(f"\nMemory per GPU, GB (A100-80GB: model states and statistics fit in {FIT_SHARE:.0%}), bf16 training "
          "with Σg beside the squares\n")
    print("| model | ZeRO | nodes | model states | per_step | hierarchical | per_micro_step | per_step fits | auto |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, params in MODEL_SIZES.items():
        for stage in (2, 3):
            for nodes in (1, 8, 16):
                m = memory(params, stage, nodes)
                fits = m["states"] + m["per_step"] <= FIT_SHARE * GPU_BYTES / 1e9
                print(f"| {name} | {stage} | {nodes} | {m['states']:.1f} | {m['per_step']:.1f} | "
                      f"{m['hierarchical']:.1f} | {m['per_micro_step']:.2f} | {'yes' if fits else 'no'} | "
                      f"{auto(params, stage, nodes)} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mfu", type=float, default=0.45, help="model FLOPs utilisation of the A100 peak")
    ap.add_argument("--nvlink-gbps", type=float, default=300.0, help="NVLink bus bandwidth per GPU, one way")
    ap.add_argument("--ib-gbps", type=float, default=25.0, help="InfiniBand bandwidth per GPU, one way (200 Gb/s)")
    ap.add_argument("--efficiency", type=float, default=0.8, help="achieved share of the line rate")
    ap.add_argument("--no-overlap", dest="overlap", action="store_false", help="nothing hides behind backward")
    ap.add_argument("--memory", action="store_true", help="also the memory table of 0.3B-13B models")
    args = ap.parse_args()
    print(f"BERT-large {PARAMS:,} parameters, ZeRO-2 bf16, {GPUS_PER_NODE} A100 per node, MFU {args.mfu}, bus "
          f"bandwidth {args.nvlink_gbps:g} GB/s NVLink / {args.ib_gbps:g} GB/s IB per GPU x {args.efficiency}; cells: "
          "GB per optimizer step, seconds, exposed share of the compute time\n")
    names = list(SCHEMES)
    print("| recipe | phase | nodes | A | compute s | DeepSpeed grads s | " + " | ".join(names) + " |")
    print("| --- | --- | --- | --- | --- | --- | " + " | ".join("---" for _ in names) + " |")
    for recipe, phases in RECIPES.items():
        for phase in phases:
            for nodes in (1, 2, 4, 8, 16):
                m = model(phase, nodes, args)
                cells = [f"{m[n][0]:.1f} GB, {m[n][1]:.2f} s, {m[n][2] / m['compute_s']:.1%}" for n in names]
                print(f"| {recipe} | {phase.name} seq {phase.seq} | {nodes} | {m['accumulation']} | "
                      f"{m['compute_s']:.2f} | {m['ds_comm_s']:.2f} | " + " | ".join(cells) + " |")
    if args.memory:
        print_memory()


if __name__ == "__main__":
    main()
