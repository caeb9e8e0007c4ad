"""Trains a tiny BERT masked-LM with ``transformers.Trainer`` whose DeepSpeed config names a VRGD
optimizer (``"optimizer": {"type": "VRLamb"}``), ZeRO-2, and writes what rank 0 saw as JSON.
Launched by ``test_hf_trainer.py``:

    deepspeed --num_gpus 2 tests/distributed/hf_trainer_worker.py --out r.json

Nothing is downloaded: the model is built from a ``BertConfig`` and the data are random tokens.
"""
from __future__ import annotations

import argparse
import json
import math
import os

import torch

import vrgd_ds  # noqa: F401  (registers the VRGD names with DeepSpeed; must precede the Trainer)
from transformers import BertConfig, BertForMaskedLM, Trainer, TrainerCallback, TrainingArguments

VOCAB = 64
SEQ = 16
SAMPLES = 64
MICRO = 4
GAS = 2
STEPS = 6
LR = 1e-3
WD = 0.01


class RandomTokens(torch.utils.data.Dataset):
    """``SAMPLES`` sequences of random token ids; the labels are the inputs (every position predicted)."""

    def __init__(self, seed: int = 0, samples: int = SAMPLES):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (samples, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        ids = self.ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def tiny_bert(seed: int = 0) -> BertForMaskedLM:
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64)
    return BertForMaskedLM(cfg)


def ds_config(gbar: str | None = None) -> dict:
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "VRLamb", "params": {"lr": LR, "weight_decay": WD}},
        "gradient_clipping": 1.0,
        **({"vrgd": {"squares": "per_step", "gbar": gbar}} if gbar else {}),
    }


def engine_of(trainer: Trainer):
    """The DeepSpeedEngine the Trainer built (``trainer.deepspeed`` and ``model_wrapped`` are the same)."""
    return trainer.deepspeed if getattr(trainer, "deepspeed", None) is not None else trainer.model_wrapped


class StepMetrics(TrainerCallback):
    """Records ``gsnr_metrics()`` after each optimizer step."""

    def __init__(self):
        self.trainer: Trainer | None = None
        self.rows: list[dict] = []

    def on_step_end(self, args, state, control, **kwargs):
        opt = engine_of(self.trainer).basic_optimizer
        momentum = [v["gsnr_avg"].double().pow(2).sum() for v in opt.state.values() if "gsnr_avg" in v]
        scheduler = self.trainer.lr_scheduler
        self.rows.append({"step": state.global_step, **opt.gsnr_metrics(), "lr": opt.param_groups[0]["lr"],
                          "scheduler_lr": scheduler.get_last_lr()[0] if scheduler is not None else None,
                          "gsnr_avg_sq": float(sum(momentum)) if momentum else None})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--output_dir", default=None, help="Trainer output_dir (default: beside --out)")
    ap.add_argument("--register", choices=("lazy", "eager"), default="lazy",
                    help="lazy: rely on `import vrgd_ds` alone (registration when DeepSpeed is imported); "
                         "eager: also call vrgd_ds.register() before the Trainer is built")
    ap.add_argument("--samples", type=int, default=SAMPLES,
                    help="the dataset's length: one that is not a multiple of ranks x micro-batch x accumulation "
                         "ends each epoch with a step of fewer micro-steps")
    ap.add_argument("--gbar", choices=("engine", "local"), default=None,
                    help="the per-step scheme with this mean gradient (default: the config's defaults)")
    ap.add_argument("--save-steps", type=int, default=0, help="a checkpoint every N steps (0: none)")
    ap.add_argument("--resume", default=None, help="a Trainer checkpoint folder to resume from")
    ap.add_argument("--warmup", type=int, default=0, help="the linear schedule's warmup steps")
    ap.add_argument("--local_rank", type=int, default=-1)  # passed by the deepspeed launcher
    args = ap.parse_args()
    if args.register == "eager":
        vrgd_ds.register()
    output_dir = args.output_dir or os.path.join(os.path.dirname(os.path.abspath(args.out)), "hf_out")

    model = tiny_bert()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}

    targs = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=GAS,
        max_steps=STEPS,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        warmup_steps=args.warmup,
        # the Trainer checks the config's optimizer.params against these
        learning_rate=LR,
        weight_decay=WD,
        max_grad_norm=1.0,
        seed=0,
        dataloader_num_workers=0,
        deepspeed=ds_config(args.gbar),
    )
    cb = StepMetrics()
    trainer = Trainer(model=model, args=targs, train_dataset=RandomTokens(samples=args.samples),
                      callbacks=[cb])
    cb.trainer = trainer
    trainer.train(resume_from_checkpoint=args.resume)

    engine = engine_of(trainer)
    opt = engine.basic_optimizer
    final = dict(trainer.model.named_parameters())
    moved = {n: float((final[n].detach().float() - initial[n].float()).norm()) for n in initial}
    if int(os.environ.get("RANK", "0")) == 0:
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        from vrgd_ds.ds import integration

        result = {
            "register": args.register,
            "registered": bool(integration._registered),
            "engine": type(engine).__name__,
            "basic_optimizer": type(opt).__name__,
            "wrapped_optimizer": type(engine.optimizer).__name__,
            "zero_stage": int(engine.zero_optimization_stage()),
            "world_size": int(engine.world_size),
            "gradient_accumulation_steps": int(engine.gradient_accumulation_steps()),
            "global_steps": int(engine.global_steps),
            "log_history": trainer.state.log_history,
            "losses": losses,
            "losses_finite": bool(losses) and all(math.isfinite(x) for x in losses),
            "gsnr_metrics": opt.gsnr_metrics(),
            "step_metrics": cb.rows,
            "param_delta_norm": moved,
            "params": {n: p.detach().double().flatten().tolist() for n, p in final.items()},
            "params_changed": any(v > 0 for v in moved.values()),
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
    # a rank that exits while its peer still writes can die in gloo's teardown (seen once under load)
    from vrgd_ds.run import leave_together

    leave_together()


if __name__ == "__main__":
    main()
