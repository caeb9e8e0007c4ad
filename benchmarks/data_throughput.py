"""Throughput of the data pipeline on WikiText-2: corpus reading, tokenizer training, sharding,
and the masked BERT samples a DataLoader worker makes.

What is measured, in MB/s of input text (file bytes on disk) and wall time:

* ``read``: parsing the WikiText files into documents (heading detection, joiners, sentence
  splitting), the work every later stage repeats while it streams the corpus;
* ``tokenizer``: :func:`vrgd_ds.data_pipeline.tokenizer.train_tokenizer` (unigram, ``--vocab-size``)
  with 1 and 2 trainer threads, reading the corpus inside the timed region;
* ``shard``: :func:`vrgd_ds.data_pipeline.shards.write_shards` with 1 and 2 worker processes, reading the
  corpus, encoding, writing and fsyncing the shards and manifest; the 2-worker time includes
  spawning the workers and loading the tokenizer in each;
* ``samples``: masked BERT samples per second in one process (what one DataLoader worker makes),
  batched by ``collate`` in micro-batches of 398 (the plateau study's 4x runs), at seq 64 and
  128, reading each sample's sentences as one view of its shard (``ShardedCorpus.span``, what
  ``BertPretrainingDataset`` does) and, side by side, as the per-sentence views of its whole
  document joined (``document(i)[begin:end]``, what it did before), with the ratio.

Each figure is the median of ``--repeats`` runs, taken round-robin over the configurations.
``--copies K`` streams the corpus K times over, so that the fixed cost of starting worker
processes is amortised as it is on a real corpus. The corpus is ../shared/data/wikitext-2 next to
the repository (train.txt, valid.txt, test.txt: whichever exist), or ``--data DIR``.

Measured (WikiText-2 valid+test, 2.38 MB, vocab 8000, median of 3):

    machine                            stage       1 thread/worker   2 threads/workers
    16-core idle host, --copies 8      tokenizer   1.47 MB/s         1.67 MB/s
                                       shard       4.67 MB/s         8.32 MB/s
                                       (read alone: 10.0 MB/s)
    same host, --copies 1              shard       4.22 MB/s         3.22 MB/s (spawn start-up)
    2-CPU host under load ~3, copies 1 tokenizer   1.59 MB/s         0.45 MB/s
                                       shard       5.81 MB/s         2.35 MB/s

The 2-worker shards were byte-identical to the 1-worker ones in every run. On a host whose CPUs
are already busy, extra trainer threads and workers only add contention. The samples stage's
figures are in docs/benchmarks.md.

Run:  python benchmarks/data_throughput.py [--data DIR] [--vocab-size 8000] [--repeats 3] [--copies 1]
          [--stages read tokenizer shard samples]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from vrgd_ds.data_pipeline.corpus import Corpus
from vrgd_ds.data_pipeline.samples import BertPretrainingDataset, build_sample_index, collate
from vrgd_ds.data_pipeline.shards import ShardedCorpus, default_workers, write_shards
from vrgd_ds.data_pipeline.tokenizer import train_tokenizer

STAGES = ("read", "tokenizer", "shard", "samples")
DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "wikitext-2"


class PerSentence:
    """``corpus`` with ``span`` made of the per-sentence views of the whole document, joined: the
    samples stage's reference."""

    def __init__(self, corpus: ShardedCorpus):
        self.corpus = corpus

    def __getattr__(self, name: str):
        return getattr(self.corpus, name)

    def span(self, i: int, begin: int, end: int) -> np.ndarray:
        parts = self.corpus.document(i)[begin:end]
        return np.concatenate(parts) if parts else np.zeros(0, self.corpus.dtype)


def sample_rates(shards: Path, seq_lens: tuple[int, ...], micro_batch: int, seconds: float,
                 repeats: int) -> list[tuple[int, float, float, bool]]:
    """(seq, samples/s by span, samples/s by joined sentence views, same samples) per seq len,
    each rate the median of ``repeats`` round-robin stretches of ``seconds``."""
    corpus = ShardedCorpus(shards)
    out = []
    for seq in seq_lens:
        index = build_sample_index(corpus, seq, 1)
        sets = [BertPretrainingDataset(c, index, seq, seed=1) for c in (corpus, PerSentence(corpus))]
        n = len(sets[0])
        first = [collate([ds[(0, j % n)] for j in range(micro_batch)]) for ds in sets]
        same = all(torch.equal(first[0][k], first[1][k]) for k in first[0])
        rates: list[list[float]] = [[], []]
        for _ in range(repeats):
            for which, ds in enumerate(sets):
                start, made = time.perf_counter(), 0
                while time.perf_counter() - start < seconds:
                    collate([ds[(0, (made + j) % n)] for j in range(micro_batch)])
                    made += micro_batch
                rates[which].append(made / (time.perf_counter() - start))
        out.append((seq, statistics.median(rates[0]), statistics.median(rates[1]), same))
    return out


class Repeated:
    """The corpus ``copies`` times over, to amortise worker start-up on a small corpus."""

    def __init__(self, corpus: Corpus, copies: int):
        self.corpus, self.copies = corpus, copies
        self.description = f"{corpus.description} x{copies}"

    def __iter__(self):
        for _ in range(self.copies):
            yield from self.corpus


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="directory with WikiText-2 .txt files")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--copies", type=int, default=1,
                        help="stream the corpus this many times over (amortises process start-up)")
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    args = parser.parse_args()

    files = [args.data / n for n in ("train.txt", "valid.txt", "test.txt") if (args.data / n).is_file()]
    if not files:
        print(f"no WikiText-2 files (train/valid/test.txt) in {args.data}; the benchmark needs the shared "
              "data directory next to the repository, or pass --data DIR", file=sys.stderr)
        return 2
    corpus = Corpus(files, format="wikitext")
    megabytes = corpus.num_bytes / 1e6
    documents = sum(1 for _ in corpus)
    print(f"corpus: {', '.join(f.name for f in files)} ({megabytes:.2f} MB, {documents} documents) "
          f"x{args.copies}; {default_workers()} usable CPUs; median of {args.repeats}")

    source = Repeated(corpus, args.copies)
    megabytes *= args.copies
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        train_tokenizer(source, tmp / "tok.model", vocab_size=args.vocab_size, num_threads=1)  # for sharding
        configs = [("read", "-", lambda: sum(1 for _ in source))] if "read" in args.stages else []
        for threads in (1, 2) if "tokenizer" in args.stages else ():
            configs.append((f"tokenizer (vocab {args.vocab_size})", f"{threads} threads",
                            lambda t=threads: train_tokenizer(source, tmp / f"tok{t}.model",
                                                              vocab_size=args.vocab_size, num_threads=t)))
        for workers in (1, 2) if "shard" in args.stages else ():
            configs.append(("shard", f"{workers} workers",
                            lambda w=workers: write_shards(source, tmp / "tok.model", tmp / f"shards{w}",
                                                           workers=w, progress=False)))
        # Round-robin, one run of each configuration per repeat, so that load from other processes
        # hits all of them alike; the table reports medians.
        times: dict[int, list[float]] = {i: [] for i in range(len(configs))}
        load_before = os.getloadavg()[0]
        for _ in range(args.repeats):
            for i, (_, _, fn) in enumerate(configs):
                start = time.perf_counter()
                fn()
                times[i].append(time.perf_counter() - start)
        rows = [(stage, parallel, statistics.median(times[i])) for i, (stage, parallel, _) in enumerate(configs)]
        if "shard" in args.stages:
            tokens = ShardedCorpus(tmp / "shards1").num_tokens
            files = [{p.name for p in (tmp / d).iterdir() if p.name != "manifest.json"} for d in ("shards1", "shards2")]
            same = files[0] == files[1] and all((tmp / "shards1" / name).read_bytes() == (tmp / "shards2" / name).read_bytes()
                                                for name in files[0])
        if "samples" in args.stages:
            if "shard" not in args.stages:
                write_shards(corpus, tmp / "tok.model", tmp / "shards1", workers=1, progress=False)
            samples = sample_rates(tmp / "shards1", (64, 128), 398, 2.0, args.repeats)

    if rows:
        print(f"\n{'stage':<24} {'parallel':<12} {'seconds':>8} {'MB/s':>8}")
    for stage, parallel, seconds in rows:
        print(f"{stage:<24} {parallel:<12} {seconds:>8.2f} {megabytes / seconds:>8.2f}")
    if "samples" in args.stages:
        print(f"\n{'samples (1 process)':<24} {'span /s':>10} {'joined /s':>10} {'ratio':>7}  same samples")
        for seq, span, joined, equal in samples:
            print(f"{'seq ' + str(seq):<24} {span:>10,.0f} {joined:>10,.0f} {span / joined:>7.2f}  {equal}")
    print(f"\nload average (1 min) before/after: {load_before:.2f}/{os.getloadavg()[0]:.2f}")
    if "shard" in args.stages:
        print(f"shards: {tokens} tokens; 1-worker and 2-worker shards byte-identical: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
