"""The BERT pretraining loop under DeepSpeed: phases, accumulation, evaluation, checkpoints,
automatic resume and telemetry.

One engine serves both phases: at a phase boundary the micro-batch and the global batch of
the next phase are set on it (``set_train_micro_batch_size`` / ``set_train_batch_size``), so
the optimizer state, VRGD statistics hooks and loss scaler carry over. Accumulation
boundaries are set explicitly each micro-step (``set_gradient_accumulation_boundary``):
DeepSpeed's own count (``micro_steps % gradient_accumulation_steps``) would misalign once the
accumulation changes between phases.

Exact resume: the model, optimizer (with the VRGD state), loss scaler and LR position come
from the DeepSpeed checkpoint; the data position is the per-phase ``consumed_samples`` in its
client state (the sampler is rebuilt from it); the torch RNG (dropout) is re-seeded from
``(seed, step, rank)`` at every step, so no generator state has to be carried over. A run
stopped after step N and resumed therefore repeats the uninterrupted run's losses (fp32).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

import vrgd_ds
from vrgd_ds.ds import shm
from vrgd_ds.train.config import ConfigError, JobConfig, deepspeed_config, gradient_accumulation, load_config
from vrgd_ds.train.data import JobData, eval_batches, loader, prepare_data
from vrgd_ds.train.model import build_model
from vrgd_ds.train.schedule import PhaseSchedule

logger = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
STATE_KEY = "vrgd_job"


def _seed_step(seed: int, step: int, rank: int) -> None:
    torch.manual_seed((seed * 1_000_003 + step) * 4099 + rank)


def _inputs(batch: dict[str, torch.Tensor], device: torch.device, next_sentence: bool) -> dict[str, torch.Tensor]:
    keys = ("input_ids", "token_type_ids", "attention_mask", "labels") + (("next_sentence_label",) if next_sentence else ())
    return {k: batch[k].to(device, non_blocking=True) for k in keys}


class Trainer:
    def __init__(self, raw: dict[str, Any], job: JobConfig, run_dir: Path, backend: str | None) -> None:
        import deepspeed
        import deepspeed.comm as dist

        self.raw, self.job, self.run_dir = raw, job, run_dir
        cuda = torch.cuda.is_available()
        deepspeed.init_distributed(dist_backend=backend or ("nccl" if cuda else "gloo"), auto_mpi_discovery=True)
        self.dist = dist
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        dist.barrier()  # every rank has mapped its peers' shared memory (CPU accelerator)
        shm.unlink_own_segment(self.rank)
        if cuda:
            local = int(os.environ.get("LOCAL_RANK", self.rank % max(torch.cuda.device_count(), 1)))
            torch.cuda.set_device(local)
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.schedule = PhaseSchedule(job)
        for i, p in enumerate(job.phases):
            gradient_accumulation(p, self.world, i)  # fail before preparing data
        if self.rank == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.json").write_text(json.dumps(raw, indent=2))
        self.data: JobData = prepare_data(job, run_dir, self.rank, dist.barrier, sorted({p.seq_len for p in job.phases}))
        self.next_sentence = self.data.next_sentence is not None
        torch.manual_seed(job.seed)  # the same initial weights on every rank and every start
        model = build_model(job.model, self.data.vocab_size, max(p.seq_len for p in job.phases), self.next_sentence)
        ds_cfg = deepspeed_config(raw, job.phases[0], self.world, 0)
        wd = float(ds_cfg.get("optimizer", {}).get("params", {}).get("weight_decay", 0.0))
        groups = vrgd_ds.param_groups(model, weight_decay=wd)
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=ds_cfg)
        self.optimizer = self.engine.basic_optimizer
        self.step = 0
        self.consumed = [0] * len(job.phases)
        self.evals: list[dict[str, float]] = []

    # -- checkpoints ---------------------------------------------------------------------------

    @property
    def ckpt_dir(self) -> Path:
        return self.run_dir / CHECKPOINTS

    def resume(self) -> bool:
        if not (self.ckpt_dir / "latest").is_file():
            return False
        path, client = self.engine.load_checkpoint(str(self.ckpt_dir))
        if path is None or STATE_KEY not in (client or {}):
            raise RuntimeError(f"{self.ckpt_dir}: the latest checkpoint could not be loaded or holds no job state; "
                               "remove the directory to start afresh")
        state = client[STATE_KEY]
        if state["world_size"] != self.world and self.engine.zero_optimization_stage() > 0:
            raise ConfigError(f"{path}: saved on {state['world_size']} ranks, resumed on {self.world}: ZeRO "
                              "partitions differ. Convert it with python -m vrgd_ds.ds.universal first")
        self.step, self.consumed, self.evals = state["step"], list(state["consumed"]), list(state["evals"])
        if self.rank == 0:
            logger.info("resumed from %s at step %d", path, self.step)
        return True

    def save(self) -> None:
        tag = f"step{self.step:08d}"
        state = {"step": self.step, "consumed": self.consumed, "evals": self.evals, "world_size": self.world}
        self.engine.save_checkpoint(str(self.ckpt_dir), tag=tag, client_state={STATE_KEY: state})
        self.dist.barrier()
        if self.rank == 0:
            tags = sorted(p for p in self.ckpt_dir.glob("step*") if p.is_dir())
            for old in tags[:-self.job.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)

    # -- evaluation ----------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, held) -> dict[str, float]:
        self.engine.eval()
        phase = self.job.phases[self.schedule.phase_of(min(self.step, self.job.total_steps - 1))[0]]
        sums = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, predicted tokens
        for batch in eval_batches(held, self.job.data.eval_samples, phase.micro_batch, self.rank, self.world):
            inputs = _inputs(batch, self.device, self.next_sentence)
            labels = inputs.pop("labels")
            inputs.pop("next_sentence_label", None)
            out = self.engine(**inputs)
            logits = (out.prediction_logits if self.next_sentence else out.logits).float()
            mask = labels != -100
            sums[0] += float(torch.nn.functional.cross_entropy(logits[mask], labels[mask], reduction="sum"))
            sums[1] += float((logits[mask].argmax(-1) == labels[mask]).sum())
            sums[2] += float(mask.sum())
        sums = sums.to(self.device)
        self.dist.all_reduce(sums)
        self.engine.train()
        count = max(float(sums[2]), 1.0)
        return {"eval/mlm_loss": float(sums[0]) / count, "eval/mlm_acc": float(sums[1]) / count,
                "eval/tokens": float(sums[2])}

    # -- training ------------------------------------------------------------------------------

    def _set_phase(self, index: int) -> int:
        p = self.job.phases[index]
        gas = gradient_accumulation(p, self.world, index)
        self.engine.set_train_micro_batch_size(p.micro_batch)
        self.engine.set_train_batch_size(p.global_batch)
        return gas

    def train(self) -> dict[str, Any]:
        from tqdm import tqdm

        from vrgd_ds.train import telemetry

        resumed = self.resume()
        sinks = telemetry.build_sinks(self.run_dir, jsonl=self.job.telemetry.jsonl,
                                      tensorboard=self.job.telemetry.tensorboard, wandb=self.job.telemetry.wandb,
                                      resume_step=self.step if resumed else None) if self.rank == 0 else None
        self.splits = {p.seq_len: self.data.split(p.seq_len) for p in self.job.phases}
        helds = {n: held for n, (_, held) in self.splits.items()}
        final_held = helds[self.job.phases[-1].seq_len]
        if not self.evals:
            self.evals.append({"step": 0, **self.evaluate(final_held)})
            if sinks:
                sinks.write(0, {k: v for k, v in self.evals[-1].items() if k != "step"})
        bar = tqdm(total=self.job.total_steps, initial=self.step, disable=self.rank != 0, dynamic_ncols=True,
                   desc="pretrain")
        gsnr_on = any(g.get("gsnr") for g in self.optimizer.param_groups)
        try:
            while self.step < self.job.total_steps:
                index, _ = self.schedule.phase_of(self.step)
                phase_end = self.schedule.phase_start(index) + self.schedule.steps[index]
                self._run_phase(index, phase_end, sinks, bar, helds[self.job.phases[index].seq_len], gsnr_on)
        finally:
            bar.close()
        last = self.evals[-1]
        if last["step"] != self.step:
            self.evals.append({"step": self.step, **self.evaluate(final_held)})
            if sinks:
                sinks.write(self.step, {k: v for k, v in self.evals[-1].items() if k != "step"})
        if self.job.checkpoint_every == 0 or self.step % self.job.checkpoint_every:
            self.save()
        if sinks:
            sinks.close()
        return {"before": self.evals[0], "after": self.evals[-1], "steps": self.step}

    def _run_phase(self, index: int, phase_end: int, sinks, bar, held, gsnr_on: bool) -> None:
        from data_pipeline.sampler import PretrainingSampler

        from vrgd_ds.train import telemetry

        p = self.job.phases[index]
        gas = self._set_phase(index)
        train, _ = self.splits[p.seq_len]
        sampler = PretrainingSampler(len(train), micro_batch_size=p.micro_batch, rank=self.rank,
                                     world_size=self.world, seed=self.job.seed + index,
                                     consumed_samples=self.consumed[index])
        batches = iter(loader(train, sampler, self.job.data.workers, self.device.type == "cuda"))
        n_groups = self.world * (gas if self.engine.zero_optimization_stage() >= 2 else 1)
        while self.step < phase_end:
            _seed_step(self.job.seed, self.step, self.rank)
            lr = self.schedule.lr(self.step)
            for g in self.optimizer.param_groups:
                g["lr"] = lr
            t0 = time.perf_counter()
            data_time, loss_sum, tokens = 0.0, 0.0, 0
            for j in range(gas):
                td = time.perf_counter()
                batch = next(batches)
                data_time += time.perf_counter() - td
                tokens += int(batch["attention_mask"].sum())
                self.engine.set_gradient_accumulation_boundary(j == gas - 1)
                loss = self.engine(**_inputs(batch, self.device, self.next_sentence)).loss
                self.engine.backward(loss)
                self.engine.step()
                loss_sum += float(loss.detach())
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            step_time = time.perf_counter() - t0
            self.step += 1
            self.consumed[index] += p.global_batch
            logging_step = self.step % self.job.log_every == 0 or self.step == phase_end
            if logging_step:
                red = torch.tensor([loss_sum / gas, float(tokens), data_time], dtype=torch.float64, device=self.device)
                self.dist.all_reduce(red)
                loss_mean, tok = float(red[0]) / self.world, float(red[1])
                record = {"phase": index, "train/loss": loss_mean, "train/lr": lr, "train/step_time_s": step_time,
                          "train/data_time_s": float(red[2]) / self.world, "train/tokens_per_s": tok / step_time,
                          "train/samples": float(sum(self.consumed)), "train/seq_len": p.seq_len}
                m = self.optimizer.gsnr_metrics(per_tensor=self.job.telemetry.per_layer_group,
                                                samples_per_group=p.global_batch // n_groups if gsnr_on else None)
                per_tensor = {k: v for k, v in m.items() if k.startswith("tensor/")}
                record.update({k: v for k, v in m.items() if not k.startswith("tensor/")})
                if per_tensor:
                    record.update(telemetry.group_summary(per_tensor))
                if self.job.eval_every and self.step % self.job.eval_every == 0 and self.step < self.job.total_steps:
                    ev = self.evaluate(held)
                    self.evals.append({"step": self.step, **ev})
                    record.update(ev)
                if sinks:
                    sinks.write(self.step, record)
                bar.set_postfix(loss=f"{loss_mean:.3f}", tok_s=f"{tok / step_time:,.0f}", step_s=f"{step_time:.2f}",
                                phase=index, refresh=False)
            bar.update(1)
            if not math.isfinite(loss_sum):
                logger.warning("non-finite training loss at step %d", self.step)
            if self.job.checkpoint_every and self.step % self.job.checkpoint_every == 0:
                self.save()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="vrgd-pretrain", description="BERT pretraining with VRGD optimizers under "
                                 "DeepSpeed (launch with deepspeed, torchrun, mpirun or srun).")
    ap.add_argument("--config", required=True, help="DeepSpeed JSON config with a 'job' block (see configs/)")
    ap.add_argument("--run-dir", required=True, help="metrics, TensorBoard, plots and checkpoints; the job resumes "
                    "from the latest checkpoint found here")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key, e.g. --set job.total_steps=20 (value parsed as JSON)")
    ap.add_argument("--backend", choices=("nccl", "gloo", "mpi"), default=None,
                    help="torch.distributed backend (default: nccl with CUDA, else gloo)")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        raw, job = load_config(args.config, args.set)
    except ConfigError as e:
        ap.exit(2, f"error: {e}\n")
    run_dir = Path(args.run_dir)
    trainer = Trainer(raw, job, run_dir, args.backend)
    result = trainer.train()
    if trainer.rank == 0:
        plots = []
        try:
            from vrgd_ds.train.plots import plot_run

            plots = plot_run(run_dir)
        except Exception as e:  # plotting must not fail a finished run
            logger.warning("plots were not written: %s", e)
        b, a = result["before"], result["after"]
        print(f"\nheld-out MLM loss {b['eval/mlm_loss']:.4f} -> {a['eval/mlm_loss']:.4f}, accuracy "
              f"{b['eval/mlm_acc']:.4f} -> {a['eval/mlm_acc']:.4f} after {result['steps']} steps")
        print(f"metrics:    {run_dir / 'metrics.jsonl'}")
        if plots:
            print(f"plots:      {plots[0].parent}")
        print(f"checkpoint: {run_dir / CHECKPOINTS} (latest: "
              f"{(run_dir / CHECKPOINTS / 'latest').read_text().strip()})", flush=True)
    trainer.dist.barrier()
    return 0
