"""A small GPT from ``megatron.core.models`` trained with a VRGD optimizer through
``vrgd_ds.megatron.get_megatron_optimizer``: Megatron's DistributedDataParallel (with its
distributed optimizer), tensor and data parallelism, Megatron's own pipeline schedule
(``get_forward_backward_func``) and gradient finalisation.

    torchrun --nproc_per_node 2 launch/megatron/pretrain_gpt.py \\
        --config configs/megatron/gpt_tiny_cpu_vr_lamb.json --run-dir runs/megatron_gpt
    sbatch launch/megatron/gpt.sbatch        # the same under Slurm (several nodes)

Data: the token shards ``vrgd-data prepare`` writes (``data.path``), cut into windows of
``model.seq_length + 1`` tokens, each rank reading its own micro-batches; ``data.path: null``
prepares the embedded corpus into ``<run dir>/data`` first. Without a GPU the ranks run on the CPU
with gloo (``launch/megatron/cpu_ranks.py`` answers Megatron's CUDA assumptions there).
Per step one JSON line on rank 0: loss, grad norm, the GSNR statistics and their extra bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
DEFAULT_CONFIG = HERE.parents[1] / "configs" / "megatron" / "gpt_tiny_cpu_vr_lamb.json"
SECTIONS = {"model": ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size"),
            "parallel": ("tensor_model_parallel_size", "pipeline_model_parallel_size"),
            "train": ("micro_batch_size", "global_batch_size", "steps", "seed", "log_every", "precision"),
            "optimizer": ("type", "params", "use_distributed_optimizer", "overlap_grad_reduce", "clip_grad",
                          "bucket_size"),
            "data": ("path",)}


PRECISIONS = ("fp32", "bf16", "fp16")


def load_config(path: Path) -> dict:
    """The job's JSON; an unknown section, key or ``train.precision`` is an error naming it."""
    cfg = json.loads(Path(path).read_text())
    for section, body in cfg.items():
        if section not in SECTIONS:
            raise SystemExit(f"{path}: unknown section {section!r} (known: {', '.join(SECTIONS)})")
        unknown = set(body) - set(SECTIONS[section])
        if unknown:
            raise SystemExit(f"{path}: unknown key(s) {sorted(unknown)} in {section!r} "
                             f"(known: {', '.join(SECTIONS[section])})")
    precision = cfg.get("train", {}).get("precision", "fp32")
    if precision not in PRECISIONS:
        raise SystemExit(f"{path}: train.precision {precision!r} (known: {', '.join(PRECISIONS)})")
    return cfg


def init_distributed() -> str:
    """NCCL on GPUs, gloo with the CPU patches otherwise; returns the device."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
        return "cuda"
    sys.path.insert(0, str(HERE))
    import cpu_ranks

    cpu_ranks.apply()
    dist.init_process_group("gloo")
    return "cpu"


def tokens(cfg: dict, run_dir: Path) -> np.ndarray:
    """Every token of the prepared corpus, in order (rank 0 prepares the embedded one if asked)."""
    from vrgd_ds.data_pipeline.shards import ShardedCorpus

    path = cfg["data"].get("path")
    if path is None:
        path = run_dir / "data"
        if dist.get_rank() == 0:
            subprocess.run([sys.executable, "-m", "vrgd_ds.data_pipeline", "prepare", str(path), "--vocab-size",
                            str(cfg["model"]["vocab_size"]), "--seq-len", str(cfg["model"]["seq_length"]),
                            "--no-progress"], check=True)
        dist.barrier()
    corpus = ShardedCorpus(Path(path) / "shards")
    if corpus.vocab_size > cfg["model"]["vocab_size"]:
        raise SystemExit(f"{path}: the corpus has {corpus.vocab_size} token ids, model.vocab_size is "
                         f"{cfg['model']['vocab_size']}: raise model.vocab_size or prepare with a smaller --vocab-size")
    return np.concatenate([np.load(f, mmap_mode="r") for f in sorted((Path(path) / "shards").glob("*.tokens.npy"))])


def build(cfg: dict, device: str):
    """The GPT chunk in Megatron's DDP and its VRGD optimizer. ``train.precision`` bf16/fp16: the
    model in that dtype inside Megatron's ``Float16Module``, gradients reduced in fp32, fp32 main
    parameters in the optimizer (fp16 with Megatron's dynamic loss scale), as Megatron trains."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from vrgd_ds.megatron import get_megatron_optimizer

    m, par, opt = cfg["model"], cfg["parallel"], cfg["optimizer"]
    precision = cfg["train"].get("precision", "fp32")
    half = {"bf16": precision == "bf16", "fp16": precision == "fp16"}
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    ps.initialize_model_parallel(tensor_model_parallel_size=par.get("tensor_model_parallel_size", 1),
                                 pipeline_model_parallel_size=par.get("pipeline_model_parallel_size", 1))
    torch.manual_seed(cfg["train"].get("seed", 1))
    if device == "cuda":
        from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

        get_cuda_rng_tracker().reset()  # a second build in one process (the benchmark) seeds it again
        model_parallel_cuda_manual_seed(cfg["train"].get("seed", 1))
    config = TransformerConfig(num_layers=m["num_layers"], hidden_size=m["hidden_size"],
                               num_attention_heads=m["num_attention_heads"], use_cpu_initialization=device == "cpu",
                               tensor_model_parallel_size=par.get("tensor_model_parallel_size", 1),
                               pipeline_model_parallel_size=par.get("pipeline_model_parallel_size", 1),
                               params_dtype=dtype, **half)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=m["vocab_size"],
                     max_sequence_length=m["seq_length"], pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage(), share_embeddings_and_output_weights=False)
    if device == "cuda":
        model.cuda()
    if precision != "fp32":
        model = Float16Module(config, model)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=opt.get("overlap_grad_reduce", False),
        use_distributed_optimizer=opt.get("use_distributed_optimizer", True),
        bucket_size=opt.get("bucket_size")), model)
    params = dict(opt.get("params", {}))
    ocfg = OptimizerConfig(optimizer="adam", lr=params.pop("lr", 1e-3), weight_decay=params.pop("weight_decay", 0.01),
                           clip_grad=opt.get("clip_grad", 1.0),
                           use_distributed_optimizer=opt.get("use_distributed_optimizer", True),
                           params_dtype=dtype, **half)
    optimizer = get_megatron_optimizer(ocfg, [ddp], optimizer=opt.get("type", "VRLamb"), optimizer_kwargs=params)
    return config, ddp, optimizer


def micro_batches(data: np.ndarray, cfg: dict, step: int, micro: int, dp_rank: int, dp: int, device: str):
    """This data-parallel rank's micro-batches of the step: windows of seq_length + 1 tokens."""
    seq, mb = cfg["model"]["seq_length"], cfg["train"]["micro_batch_size"]
    windows = (len(data) - 1) // (seq + 1)
    causal = torch.tril(torch.ones(1, 1, seq, seq, device=device)) < 0.5
    position = torch.arange(seq, device=device).expand(mb, seq)
    for i in range(micro):
        first = ((step * micro + i) * dp + dp_rank) * mb
        rows = [(first + j) % windows for j in range(mb)]
        block = torch.from_numpy(np.stack([np.asarray(data[r * (seq + 1):(r + 1) * (seq + 1)]) for r in rows])
                                 .astype(np.int64)).to(device)
        yield {"tokens": block[:, :-1], "labels": block[:, 1:], "position_ids": position, "attention_mask": causal}


def train(cfg: dict, run_dir: Path, device: str, log=print) -> list[dict]:
    """The training loop with Megatron's schedule; returns the per-step records."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    data = tokens(cfg, run_dir)
    config, ddp, optimizer = build(cfg, device)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    config.grad_scale_func = optimizer.scale_loss  # the schedule scales each micro-batch's loss (fp16)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    tr = cfg["train"]
    micro = tr["global_batch_size"] // (tr["micro_batch_size"] * dp)
    if micro * tr["micro_batch_size"] * dp != tr["global_batch_size"]:
        raise SystemExit(f"train.global_batch_size {tr['global_batch_size']} is not a multiple of micro_batch_size × "
                         f"data-parallel ranks ({tr['micro_batch_size']} × {dp})")
    forward_backward = get_forward_backward_func()

    def forward_step(batches, model):
        b = next(batches)
        losses = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"lm loss": loss.detach().clone()}  # the schedule divides the loss in place

        return losses, loss_func

    records = []
    for step in range(tr["steps"]):
        start = time.perf_counter()
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        out = forward_backward(forward_step_func=forward_step,
                               data_iterator=micro_batches(data, cfg, step, micro, dp_rank, dp, device),
                               model=ddp, num_microbatches=micro, seq_length=cfg["model"]["seq_length"],
                               micro_batch_size=tr["micro_batch_size"], forward_only=False)
        ok, grad_norm, _ = optimizer.step()
        loss = torch.stack([o["lm loss"] for o in out]).mean().item() if out else float("nan")
        inner = optimizer.chained_optimizers[0].optimizer
        metrics = inner.gsnr_metrics()
        source = optimizer.vrgd_sources[0]
        record = {"step": step + 1, "loss": round(loss, 5), "grad_norm": None if grad_norm is None else
                  round(float(grad_norm), 5), "ok": bool(ok), "gsnr/n": metrics.get("gsnr/n"),
                  "gsnr/scale_mean": metrics.get("gsnr/scale_mean"), "loss_scale": float(optimizer.get_loss_scale()),
                  "extra_bytes_per_step": source.counters.bytes_sent // (step + 1),
                  "step_s": round(time.perf_counter() - start, 4)}
        records.append(record)
        if dist.get_rank() == 0 and (step + 1) % tr.get("log_every", 1) == 0:
            log(json.dumps(record))
    return records


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    ap.add_argument("--run-dir", type=Path, default=Path("runs/megatron_gpt"))
    args = ap.parse_args(argv)
    cfg = load_config(args.config)
    device = init_distributed()
    args.run_dir.mkdir(parents=True, exist_ok=True)
    records = train(cfg, args.run_dir, device)
    if dist.get_rank() == 0:
        (args.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
