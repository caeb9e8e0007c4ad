"""The job's data: prepared corpus, per-phase training sets, held-out set, loaders.

Rank 0 prepares the data (tokenizer, shards, sample indices; idempotent) from
``job.data.inputs`` or the embedded corpus into ``job.data.path`` (default ``<run dir>/data``);
a ``job.data.path`` that already holds a tokenizer and no ``inputs`` are given is used as
``vrgd-data prepare`` built it (only missing sample indices are added); the other ranks
wait at a barrier: the run directory must be
on a filesystem every node sees, as a multi-node job's checkpoints must be too. Documents at
the end of the corpus (``job.data.heldout_fraction``) are kept out of training; their samples
form the held-out set, evaluated with fixed masks (epoch 0) so evaluations compare.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from vrgd_ds.data_pipeline.errors import DataError
from vrgd_ds.data_pipeline.sampler import PretrainingSampler
from vrgd_ds.data_pipeline.samples import DOC_A, DOC_B, BertPretrainingDataset, collate, index_filename
from vrgd_ds.data_pipeline.shards import MANIFEST, ShardedCorpus, children_without_usr1
from vrgd_ds.data_pipeline.prepare import SHARDS_DIR, TOKENIZER_FILE
from vrgd_ds.data_pipeline.tokenizer import Tokenizer
from vrgd_ds.train.config import ConfigError, JobConfig

logger = logging.getLogger(__name__)


class Rows(torch.utils.data.Dataset):
    """The samples ``rows`` of a dataset keyed by ``(epoch, sample_index)``."""

    def __init__(self, base: BertPretrainingDataset, rows: np.ndarray) -> None:
        self.base, self.rows = base, rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, key: tuple[int, int]) -> dict[str, torch.Tensor]:
        epoch, i = key
        return self.base[(epoch, int(self.rows[i]))]


@dataclass
class JobData:
    tokenizer: Tokenizer
    corpus: ShardedCorpus
    samples: dict[int, Path]  # seq len -> sample index
    split_document: int  # documents >= this one are held out
    seed: int
    next_sentence: str | None
    streams: tuple[Path, Path] | None = None  # the GPT's (training, held-out) streams on disk (write_streams)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def fingerprint(self, windows: bool = False) -> str:
        """``fingerprint`` of the BERT samples, or with ``windows`` of the causal-LM windows."""
        return fingerprint(self.tokenizer.sha256, self.corpus.path / MANIFEST, self.seed, self.split_document,
                           self.next_sentence, windows)

    def _dataset(self, seq_len: int) -> BertPretrainingDataset:
        return BertPretrainingDataset(self.corpus, self.samples[seq_len], seq_len, seed=self.seed)

    def token_streams(self) -> tuple[np.ndarray, np.ndarray]:
        """(training, held-out) documents' tokens, each concatenated in corpus order with
        ``[SEP]`` after every document: the end-of-document token (Megatron's GPT data appends
        one), so no window runs from one document into the next unmarked, and a model learns where
        documents end. Held out: the documents from ``split_document`` on, as for the BERT samples."""
        return tuple(np.concatenate([*self._stream_pieces(kept), np.zeros(0, dtype=self.corpus.dtype)])
                     for kept in self._stream_documents())

    def _stream_documents(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(training, held-out) streams' documents: (document, its tokens) of those with sentences."""
        out = []
        for first, last in ((0, self.split_document), (self.split_document, self.corpus.num_documents)):
            lengths = (self.corpus.sentence_lengths(i) for i in range(first, last))
            out.append([(i, int(n.sum())) for i, n in zip(range(first, last), lengths) if n.size])
        return out[0], out[1]

    def _stream_pieces(self, kept: list[tuple[int, int]]) -> Iterator[np.ndarray]:
        """A stream a document at a time (``_stream_documents``): its tokens, then ``[SEP]``, in the
        shards' dtype (the windows are made int64 as they are read)."""
        sep = np.array([self.tokenizer.sep_id], dtype=self.corpus.dtype)
        for i, n in kept:
            yield np.concatenate([*self.corpus.document(i), sep]).astype(self.corpus.dtype, copy=False) if n else sep

    def stream_names(self) -> tuple[str, str]:
        """File names of the (training, held-out) streams, keyed by what decides them: the
        tokenizer, the shards and the split (``fingerprint`` with ``windows``, no seed)."""
        key = fingerprint(self.tokenizer.sha256, self.corpus.path / MANIFEST, 0, self.split_document, None, True)
        return f"gpt_stream_{key}_train.npy", f"gpt_stream_{key}_heldout.npy"

    def write_streams(self, paths: tuple[Path, Path]) -> None:
        """``token_streams`` written to ``paths`` (``.npy``, the shards' dtype) a document at a time,
        each file replacing its path once complete (``atomic_file``; a temporary name of this host
        and process, removed on an error): memory does not grow with the corpus, and every rank
        maps the files (``windows``) rather than holding the corpus. Refused, naming the directory,
        where the disk has not the room."""
        import shutil
        import socket

        from numpy.lib import format as npy

        from vrgd_ds.data_pipeline.tokenizer import atomic_file

        dtype = self.corpus.dtype
        parts = self._stream_documents()
        paths[0].parent.mkdir(parents=True, exist_ok=True)
        need = sum(n + 1 for kept in parts for _, n in kept) * dtype.itemsize
        free = shutil.disk_usage(paths[0].parent).free
        if need > free:
            raise DataError(f"{paths[0].parent}: the GPT's token streams need {need / 1e6:.0f} MB, {free / 1e6:.0f} MB "
                            "is free; free space there, or prepare the data where there is room (job.data.path)")
        for path, kept in zip(paths, parts):
            tmp = path.with_name(f".{path.name}.tmp.{socket.gethostname()}.{os.getpid()}")
            with atomic_file(path, tmp) as fh:
                npy.write_array_header_1_0(fh, {"descr": npy.dtype_to_descr(dtype), "fortran_order": False,
                                                "shape": (sum(n + 1 for _, n in kept),)})
                for piece in self._stream_pieces(kept):
                    fh.write(piece.tobytes())

    def windows(self, seq_len: int) -> tuple[Windows, Windows]:
        """(training, held-out) causal-LM windows of ``seq_len`` (``Windows``): of the streams on
        disk, mapped (``streams``, written by ``prepare_data`` for the GPT), or else built here."""
        if not hasattr(self, "_streams"):
            self._streams = (tuple(np.load(p, mmap_mode="r") for p in self.streams) if self.streams
                             else self.token_streams())
        train, held = (Windows(s, seq_len) for s in self._streams)
        if len(train) == 0 or len(held) == 0:
            raise ConfigError(f"job.data.heldout_fraction: the corpus ({self.corpus.num_documents} documents) leaves "
                              f"no training or no held-out window of {seq_len + 1} tokens; use a larger corpus or "
                              "change the fraction")
        return train, held

    def split(self, seq_len: int) -> tuple[Rows, Rows]:
        """(training samples, held-out samples) of the ``seq_len`` index: a sample is on the side
        of the split both its segments' documents are on. A next-sentence pair whose random B
        comes from the other side is in neither, so no held-out text is trained on."""
        ds = self._dataset(seq_len)
        a, b = np.asarray(ds._rows[:, DOC_A]), np.asarray(ds._rows[:, DOC_B])
        cut = self.split_document
        train, held = np.flatnonzero((a < cut) & (b < cut)), np.flatnonzero((a >= cut) & (b >= cut))
        if len(train) == 0 or len(held) == 0:
            raise ConfigError(f"job.data.heldout_fraction: the corpus ({self.corpus.num_documents} documents, "
                              f"{len(a)} samples at seq {seq_len}) leaves no training or no held-out samples; "
                              "use a larger corpus or change the fraction")
        return Rows(ds, train), Rows(ds, held)


class Windows(torch.utils.data.Dataset):
    """Causal language-model samples: window ``i`` holds tokens ``[i·L, i·L + L + 1)`` of a token
    stream (``L`` = ``seq_len``; consecutive windows share one token, as Megatron's GPT dataset
    cuts them), as ``tokens`` (the first ``L``) and ``labels`` (the last ``L``). Keyed by
    ``(epoch, i)`` like the BERT samples; a window is the same in every epoch (the sampler's
    permutation changes the order)."""

    def __init__(self, stream: np.ndarray, seq_len: int) -> None:
        self.stream, self.seq_len = stream, seq_len

    def __getstate__(self) -> dict:
        # a stream mapped from its file goes to a DataLoader worker that forkserver (Python 3.14's
        # default) or spawn starts as its path, mapped again there: pickled, a memmap is its data
        state = self.__dict__.copy()
        if isinstance(self.stream, np.memmap) and self.stream.filename is not None:
            state["stream"] = (Path(self.stream.filename), len(self.stream))
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if isinstance(self.stream, tuple):
            path, length = self.stream
            self.stream = np.load(path, mmap_mode="r")
            if len(self.stream) != length:  # a part of the file's stream, or the file written again since
                raise DataError(f"{path}: {len(self.stream)} tokens, not the {length} of the stream it was opened "
                                "as; was it written again while the job ran?")

    def __len__(self) -> int:
        return max((len(self.stream) - 1) // self.seq_len, 0)

    def __getitem__(self, key: tuple[int, int]) -> dict[str, torch.Tensor]:
        _, i = key
        window = torch.from_numpy(np.asarray(self.stream[i * self.seq_len:(i + 1) * self.seq_len + 1], dtype=np.int64))
        return {"tokens": window[:-1], "labels": window[1:]}


def stack(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A micro-batch of equal-length samples (``Windows``)."""
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


#: the manifest's entries that say where the data was prepared from and to, not what it is
WHERE_KEYS = ("source", "tokenizer_path")


def fingerprint(tokenizer_sha256: str, manifest: Path, seed: int, split_document: int,
                next_sentence: str | None, windows: bool = False) -> str:
    """What decides the sample stream, in 16 hex digits: the tokenizer, the shards (their
    manifest, whose entries hash each shard's files, less ``WHERE_KEYS``: the same corpus prepared
    from another folder, or moved, is the same data), the seed, the held-out split and the
    sentence-pair task; with ``windows``, that the stream is the causal-LM windows with their
    end-of-document tokens (``JobData.token_streams``: a GPT checkpoint from windows without them
    is another stream)."""
    import hashlib
    import json

    content = {k: v for k, v in json.loads(manifest.read_text()).items() if k not in WHERE_KEYS}
    shards = hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()
    parts = {"tokenizer": tokenizer_sha256, "shards": shards, "seed": seed,
             "split_document": split_document, "next_sentence": next_sentence}
    if next_sentence == "nsp":  # pairs split by both segments' documents (JobData.split)
        parts["split"] = "both segments"
    if next_sentence == "sop":  # chunks of two sentences wherever a document has them (samples' docstring)
        parts["sop_pairs"] = "two sentences at least"
    if windows:
        parts["windows"] = "documents end with [SEP]"
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def split_document(num_documents: int, heldout_fraction: float) -> int:
    """The first held-out document: the last ``heldout_fraction`` of the corpus, at least one
    document on each side."""
    split = int(round(num_documents * (1.0 - heldout_fraction)))
    return min(max(split, 1), num_documents - 1)


def prepared_fingerprint(out: Path, seed: int, heldout_fraction: float, next_sentence: str | None,
                         windows: bool = False) -> str | None:
    """``fingerprint`` of the data prepared in ``out`` as a job with this seed, held-out share and
    sentence-pair task reads it, or with ``windows`` as the GPT's windows (None if nothing is
    prepared there)."""
    import json

    from vrgd_ds.data_pipeline.tokenizer import sha256_file

    manifest = out / SHARDS_DIR / MANIFEST
    if not (out / TOKENIZER_FILE).is_file() or not manifest.is_file():
        return None
    documents = int(json.loads(manifest.read_text())["num_documents"])
    return fingerprint(sha256_file(out / TOKENIZER_FILE), manifest, seed, split_document(documents, heldout_fraction),
                       next_sentence, windows)


def configured_fingerprint(job: JobConfig, run_dir: Path) -> str | None:
    """``fingerprint`` of the data a job with this configuration would read, if it is prepared
    (None if not: the job would prepare it)."""
    out = Path(job.data.path) if job.data.path else run_dir / "data"
    return prepared_fingerprint(out, job.seed, job.data.heldout_fraction, job.data.next_sentence,
                                windows=job.engine == "megatron")


def check_data_path(job: JobConfig) -> None:
    """A ``job.data.path`` without ``inputs`` must hold prepared data: the job never fills a
    directory the user named with the embedded corpus (a mistyped path would train on Python's
    documentation and exit 0)."""
    cfg = job.data
    if not cfg.path or cfg.inputs or cfg.prepare:
        return
    out = Path(cfg.path)
    if not out.is_dir():
        raise ConfigError(f"job.data.path: {out} does not exist. Prepare it first (vrgd-data prepare {out} "
                          "'corpus/*.txt'), list raw files in job.data.inputs to have the job prepare them there "
                          "(job.data.prepare: true for the embedded corpus), or set job.data.path to null for the "
                          "embedded corpus in the run directory")
    missing = [name for name in (TOKENIZER_FILE, f"{SHARDS_DIR}/{MANIFEST}") if not (out / name).is_file()]
    if missing:
        raise ConfigError(f"job.data.path: {out} holds no prepared data (no {' or '.join(missing)}). Prepare it "
                          f"with vrgd-data prepare {out} 'corpus/*.txt', or list raw files in job.data.inputs to "
                          "have the job prepare them there (job.data.prepare: true for the embedded corpus)")


def sample_index(out: Path, run_dir: Path, filename: str, built: bool = False,
                 current: Callable[[Path], bool] | None = None) -> Path:
    """Where a job's sample index (or GPT stream) ``filename`` is: beside the prepared data
    (``out/samples``) where it is there (and ``current`` says it is the one the job builds) or can
    be written there; else, for a prepared directory this job may not write into (a read-only
    share prepared with another seed or length, or holding a stale index), in the run directory's
    ``data/samples``. With ``built`` (every rank, after rank 0 has built it): where it is, beside
    the data or else the run directory's, whatever this node's ``os.access`` says."""
    from vrgd_ds.data_pipeline.prepare import SAMPLES_DIR

    beside = out / SAMPLES_DIR / filename
    if beside.is_file() and (current is None or current(beside)):
        return beside
    writable = not built and os.access(out / SAMPLES_DIR if (out / SAMPLES_DIR).is_dir() else out, os.W_OK)
    return beside if writable else run_dir / "data" / SAMPLES_DIR / filename


def prepare_data(job: JobConfig, run_dir: Path, rank: int, barrier: Any, seq_lens: list[int],
                 windows: bool = False) -> JobData:
    """Opens (rank 0 first prepares) the job's data; every rank returns the same view. With
    ``windows`` (the GPT), rank 0 also writes the token streams the windows are cut from
    (``JobData.write_streams``, beside the sample indices: ``sample_index``) unless they are
    there, and every rank maps them."""
    from vrgd_ds.data_pipeline.prepare import prepare_lock

    cfg = job.data
    out = Path(cfg.path) if cfg.path else run_dir / "data"
    check_data_path(job)

    def index_check(corpus: Any, n: int) -> Callable[[Path], bool]:
        """Whether an index found beside the data is the one this job builds (else it is stale:
        another ``--short-seq-prob``, format or shards, and the job's own goes elsewhere if it
        cannot replace it there)."""
        from vrgd_ds.data_pipeline.samples import index_is_current

        return lambda path: index_is_current(corpus, path, n, job.seed, next_sentence=cfg.next_sentence)
    if rank == 0:  # rank 0's alone: the other ranks look the files up after the barrier only (a lookup
        # before rank 0 wrote them could be cached as missing on a network filesystem)
        if not (cfg.path and not cfg.inputs and not cfg.prepare):  # else check_data_path found it there
            out.mkdir(parents=True, exist_ok=True)  # so that the decision below is taken under its lock
        # Decided under the lock: another job or ``vrgd-data prepare`` rewriting ``out`` (its manifest
        # deleted first) finishes before this one looks, so a directory prepared beforehand is never
        # taken, halfway through a rewrite, for one to prepare (``prepare`` takes the lock again).
        with prepare_lock(out):
            _prepare_on_rank_0(job, out, run_dir, seq_lens, index_check)
    barrier()
    corpus = ShardedCorpus(out / SHARDS_DIR, verify="size")
    tokenizer = Tokenizer.load(out / TOKENIZER_FILE)
    corpus.check_tokenizer(tokenizer)
    samples = {n: sample_index(out, run_dir, index_filename(n, job.seed, cfg.next_sentence), built=True,
                               current=index_check(corpus, n)) for n in seq_lens}
    split = split_document(corpus.num_documents, cfg.heldout_fraction)
    data = JobData(tokenizer, corpus, samples, split, job.seed, cfg.next_sentence)
    if windows:
        if rank == 0:
            with prepare_lock(out):  # another job sharing the prepared data writes them, or has: once
                paths = tuple(sample_index(out, run_dir, name) for name in data.stream_names())
                if not all(p.is_file() for p in paths):
                    data.write_streams(paths)
        barrier()  # the other ranks look the files up only now (a lookup before could be cached as missing)
        data.streams = tuple(sample_index(out, run_dir, name, built=True) for name in data.stream_names())
    return data


def _prepared_from_a_corpus(record: Path) -> bool:
    """Whether ``prepare.json`` says its tokenizer was trained on a user's corpus (its bytes'
    ``corpus_sha256``, or another corpus fingerprint than the embedded corpus's): a job's own
    embedded preparation cut off part-way (no record yet, or the embedded corpus's) is prepared
    again, a user's never overwritten."""
    from vrgd_ds.data_pipeline import prepare as preparing
    from vrgd_ds.data_pipeline.corpus import EmbeddedCorpus

    try:
        tokenizer = json.loads(record.read_text()).get("tokenizer") or {}
    except (OSError, ValueError, AttributeError):
        return False
    if not isinstance(tokenizer, dict) or not tokenizer:
        return False
    return bool(tokenizer.get("corpus_sha256")) or \
        tokenizer.get("corpus_fingerprint") != preparing.corpus_fingerprint(EmbeddedCorpus())


def _prepare_on_rank_0(job: JobConfig, out: Path, run_dir: Path, seq_lens: list[int],
                       index_check: Callable[[Any, int], Callable[[Path], bool]]) -> None:
    """Rank 0's part of ``prepare_data``, under ``out``'s ``prepare_lock``: open a directory prepared
    beforehand (adding only missing sample indices), or prepare it (idempotent: checks and reuses
    what an earlier start built)."""
    from vrgd_ds.data_pipeline.prepare import RECORD, SAMPLES_DIR, prepare

    cfg = job.data
    prepared = (out / TOKENIZER_FILE).is_file() and (out / SHARDS_DIR / MANIFEST).is_file()
    embedded_into_given = bool(cfg.path) and not cfg.inputs
    if embedded_into_given and prepared:
        # A directory prepared beforehand (vrgd-data prepare): use its tokenizer and shards as
        # they are; only sample indices for this job's seed / lengths are added if missing. One
        # that a preparation left half done (a tokenizer, no shards) is prepared when the job is
        # asked to (``prepare``; else ``check_data_path`` refused it).
        from vrgd_ds.data_pipeline.samples import build_sample_index

        corpus = ShardedCorpus(out / SHARDS_DIR, verify="size")
        corpus.check_token_ids()
        if "vocab_size" in cfg.model_fields_set and cfg.vocab_size != corpus.vocab_size:
            logger.warning("job.data.vocab_size: %d is not used: %s was prepared with a tokenizer of %d pieces, "
                           "which the job uses (the key sizes a tokenizer the job trains)", cfg.vocab_size, out,
                           corpus.vocab_size)
        for n in seq_lens:
            where = sample_index(out, run_dir, index_filename(n, job.seed, cfg.next_sentence),
                                 current=index_check(corpus, n)).parent
            if where != out / SAMPLES_DIR:
                logger.info("%s cannot be written: the sample index of seq_len %d and seed %d goes to %s", out, n,
                            job.seed, where)
            build_sample_index(corpus, n, job.seed, where, next_sentence=cfg.next_sentence)
        return
    if embedded_into_given:
        # not prepared now, though check_data_path found it so when the job started (another preparation
        # rewriting it, or its files removed since): refused as then, unless asked to prepare there
        check_data_path(job)
    # given and prepared already (vrgd-data prepare, another job); or, for the embedded corpus, a given
    # directory whose record names a user's corpus (its data being rewritten, say): prepare() then
    # rebuilds nothing the embedded corpus with these options did not build, and refuses instead
    user_data = embedded_into_given and _prepared_from_a_corpus(out / RECORD)
    keep = (bool(cfg.path) and prepared) or user_data
    if not prepared:
        logger.info("preparing %s in the job (tokenizer, shards, sample indices): every rank waits for it within "
                    "job.startup_timeout_minutes (%g min, or job.timeout_minutes where longer); prepare a large "
                    "corpus beforehand with vrgd-data prepare, or raise the key", out,
                    max(job.startup_timeout_minutes, job.timeout_minutes))
    try:
        prepare(out, inputs=cfg.inputs or None, format=cfg.format, vocab_size=cfg.vocab_size,
                seq_lens=tuple(seq_lens), seed=job.seed, workers=cfg.prepare_workers, progress=True,
                next_sentence=cfg.next_sentence, keep_built=keep)
    except DataError as e:
        if not keep:
            raise
        if user_data:
            raise ConfigError(f"job.data.path: {e}; the job does not fill a directory holding prepared data with the "
                              f"embedded corpus (job.data.inputs is empty). If another preparation is rewriting {out}, "
                              "start the job again once it is done; else list the corpus in job.data.inputs, or set "
                              "job.data.path to another directory") from None
        raise ConfigError(f"job.data.inputs: {e} (vocab_size: job.data.vocab_size, seed: job.seed, the corpus: "
                          f"job.data.inputs and format); other jobs may read it. Drop job.data.inputs to train "
                          f"on {out} as prepared (the job adds only its sample indices), or set job.data.path to "
                          "another directory") from None
    ShardedCorpus(out / SHARDS_DIR, verify="size").check_token_ids()


def loader(dataset: torch.utils.data.Dataset, sampler: PretrainingSampler, workers: int, pin_memory: bool,
           collate_fn: Any = collate) -> Iterator[Any]:
    """The batches of ``sampler``, read by ``workers`` processes started now, SIGUSR1 blocked in
    them (``children_without_usr1``: the job's pre-emption signal is the parent's, and a worker
    that forkserver, Python 3.14's default, or spawn starts would die of it)."""
    batches = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_fn, num_workers=workers,
                                          pin_memory=pin_memory, persistent_workers=False)
    with children_without_usr1():
        return iter(batches)


def eval_batches(held: torch.utils.data.Dataset, count: int, micro_batch: int, rank: int, world: int,
                 collate_fn: Any = collate) -> list[dict[str, torch.Tensor]]:
    """This rank's share of the first ``count`` held-out samples (epoch 0 masks), batched. Every
    rank gets as many samples, so as many batches: the count is rounded down to a multiple of
    ``world`` (a ZeRO-3 forward gathers parameters over the ranks, and a rank with one batch
    more would wait for the others forever)."""
    total = min(count, len(held)) // world * world
    if total == 0:
        if len(held) < world:
            raise ConfigError(f"job.data.heldout_fraction: {len(held)} held-out sample(s) for {world} data-parallel "
                              "ranks, one at least for each; hold out more documents, or use a larger corpus")
        raise ConfigError(f"job.data.eval_samples: {count} for {world} data-parallel ranks; evaluate at least "
                          f"{world} (one per rank)")
    idx = list(range(total))[rank::world]
    items = [held[(0, i)] for i in idx]
    return [collate_fn(items[j:j + micro_batch]) for j in range(0, len(items), micro_batch)]
