"""The job's BERT, whose MLM head runs on the masked positions only (``vrgd_ds/train/model.py``,
``masked_positions_model``), against the library model with the same weights, one training
micro-step each (forward and backward): the matmul FLOPs of each (counted, the same on any
device) and the time of each on this machine, interleaved, with their ratio.

    python benchmarks/masked_head.py                      tiny BERT, 8,000 pieces, micro-batch 100, seq 64
    python benchmarks/masked_head.py --model large --vocab 30522 --micro-batch 4 --seq 128 --repeats 3
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers
from torch.utils.flop_counter import FlopCounterMode

from vrgd_ds.train.config import ModelConfig
from vrgd_ds.train.model import bert_config, build_model


def batch(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, args.vocab, (args.micro_batch, args.seq), generator=gen)
    labels = torch.full_like(ids, -100)
    chosen = torch.rand(ids.shape, generator=gen) < args.mask_share
    labels[chosen] = ids[chosen]
    return dict(input_ids=ids, token_type_ids=torch.zeros_like(ids), attention_mask=torch.ones_like(ids),
                labels=labels)


def micro_step(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> None:
    model.zero_grad(set_to_none=True)
    model(**inputs).loss.backward()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("tiny", "mini", "base", "large"), default="tiny")
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--micro-batch", type=int, default=100)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--mask-share", type=float, default=0.15)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = ModelConfig(size=args.model)
    torch.manual_seed(0)
    ours = build_model(cfg, args.vocab, args.seq, next_sentence=False)
    library = transformers.BertForMaskedLM(bert_config(cfg, args.vocab, args.seq))
    library.load_state_dict(ours.state_dict())
    inputs = batch(args)
    models = {"masked positions": ours, "library (every position)": library}
    flops = {}
    for name, model in models.items():
        with FlopCounterMode(display=False) as counter:
            micro_step(model, inputs)
        flops[name] = counter.get_total_flops()
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(args.repeats):  # interleaved: the machine's drift falls on both alike
        for name, model in models.items():
            t0 = time.perf_counter()
            micro_step(model, inputs)
            times[name].append(time.perf_counter() - t0)
    masked = int((inputs["labels"] != -100).sum())
    print(f"BERT-{args.model}, vocabulary {args.vocab}, micro-batch {args.micro_batch} x seq {args.seq}, "
          f"{masked} of {inputs['labels'].numel()} positions masked; {torch.get_num_threads()} torch threads")
    for name in models:
        print(f"  {name:26s} {flops[name] / 1e9:9.2f} GFLOP   median {statistics.median(times[name]) * 1e3:9.1f} ms "
              f"(min {min(times[name]) * 1e3:.1f}, {args.repeats} micro-steps)")
    a, b = models
    print(f"  ratio library / masked positions: FLOPs {flops[b] / flops[a]:.2f}x, time "
          f"{statistics.median(times[b]) / statistics.median(times[a]):.2f}x")


if __name__ == "__main__":
    main()
