"""One call from corpus to training-ready data: tokenizer -> shards -> sample indices, idempotently.

Layout of ``output_dir``::

    tokenizer.model        sentencepiece model (vrgd_ds.data_pipeline.tokenizer)
    shards/                token shards + manifest.json (vrgd_ds.data_pipeline.shards)
    samples/               one sample index per sequence length (vrgd_ds.data_pipeline.samples)
    prepare.json           what each finished step was built from, written after each step

Each step is skipped when its output exists, is valid and was built from the same inputs and
options, so a training job can call :func:`prepare` on every (rank-0) start and pay only for the
checks. "Same inputs" is decided by a fingerprint of the corpus: for files, their resolved
paths, sizes and modification times plus format and field (cheap for terabytes of text; an
edited file changes its mtime); for the embedded corpus, the sha256 of its text. Where a file's
path or mtime changed, the files are read once: if they hold the bytes the directory was built
from (``corpus_sha256``, recorded with the tokenizer), the record takes the new fingerprint and
nothing is rebuilt (a corpus copied, restored or staged again). The
tokenizer is reused when ``prepare.json`` records the same fingerprint and options and the
model file's sha256 still matches; the shards when the record matches, the manifest's sha256
matches and every file has its recorded size; sample indices are reused by
:func:`vrgd_ds.data_pipeline.samples.build_sample_index` itself, which checks its sidecar against the
shard manifest. A changed step invalidates the steps after it through the checksums they record.

The tokenizer is trained with a fixed number of threads (``tokenizer_threads``), not the CPU
count: sentencepiece's result depends on the thread count, and the vocabulary must not change
with the machine that happened to prepare the data.

Concurrency. :func:`prepare` holds ``.prepare.lock`` in ``output_dir`` (:func:`prepare_lock`)
from its first check to its last write, so jobs that prepare one directory at once take turns
and the later ones reuse what the first built.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vrgd_ds.data_pipeline.corpus import Corpus, EmbeddedCorpus, PathLike, embedded_corpus
from vrgd_ds.data_pipeline.errors import DataError
from vrgd_ds.data_pipeline.locks import directory_lock
from vrgd_ds.data_pipeline.samples import check_build_args
from vrgd_ds.data_pipeline.shards import DEFAULT_SHARD_TOKENS, MANIFEST, ShardedCorpus, write_shards
from vrgd_ds.data_pipeline.tokenizer import Tokenizer, sha256_file, train_tokenizer, trainer, write_atomic

logger = logging.getLogger(__name__)

RECORD = "prepare.json"
LOCK_FILE = ".prepare.lock"
TOKENIZER_FILE = "tokenizer.model"
SHARDS_DIR = "shards"
SAMPLES_DIR = "samples"
DEFAULT_VOCAB_SIZE = 30522  # BERT's WordPiece vocabulary size
# The embedded corpus (about 1.6 MB of text) supports at most about 10.8k unigram pieces.
DEFAULT_EMBEDDED_VOCAB_SIZE = 8192
DEFAULT_TOKENIZER_THREADS = 8


@dataclass(frozen=True)
class Prepared:
    """Paths produced by :func:`prepare`.

    Attributes:
        output_dir: the directory given to :func:`prepare`.
        tokenizer: the sentencepiece model file.
        shards: the shard directory (open it with :class:`~vrgd_ds.data_pipeline.shards.ShardedCorpus`).
        sample_indices: sequence length -> sample index file.
        built: the steps that ran this time (``"tokenizer"``, ``"shards"``); the others were reused.
    """

    output_dir: Path
    tokenizer: Path
    shards: Path
    sample_indices: dict[int, Path]
    built: tuple[str, ...] = field(default=())


def corpus_fingerprint(corpus: Corpus | EmbeddedCorpus) -> str:
    """sha256 identifying the corpus input (see the module docstring)."""
    digest = hashlib.sha256()
    if isinstance(corpus, EmbeddedCorpus):
        digest.update(b"embedded\0")
        for document in embedded_corpus():
            for sentence in document:
                digest.update(sentence.encode())
                digest.update(b"\n")
            digest.update(b"\0")
        return digest.hexdigest()
    digest.update(json.dumps({"format": corpus.format, "field": corpus.field}).encode())
    for path in corpus.files:
        stat = path.stat()
        digest.update(f"\0{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def corpus_content_sha256(corpus: Corpus) -> str:
    """sha256 of the corpus files' bytes, in order, with format and field: what the fingerprint
    stands for, read whole (``prepare`` reads it where the fingerprint alone would rebuild)."""
    digest = hashlib.sha256(json.dumps({"format": corpus.format, "field": corpus.field}).encode())
    for path in corpus.files:
        digest.update(f"\0{path.stat().st_size}\0".encode())
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                digest.update(block)
    return digest.hexdigest()


def _same_bytes(record: dict, corpus: Corpus | EmbeddedCorpus, fingerprint: str,
                content: Callable[[], str]) -> dict:
    """``record`` with ``fingerprint`` in place of its recorded one where the corpus files moved or
    were touched (other paths or modification times: a copy, a restore, a data set staged again)
    but hold the bytes the record's steps were built from (``corpus_sha256``; ``content()`` reads
    them); else as it was."""
    old = record.get("tokenizer", {})
    if (isinstance(corpus, EmbeddedCorpus) or not old.get("corpus_sha256")
            or old.get("corpus_fingerprint") in (None, fingerprint)):
        return record
    if content() != old["corpus_sha256"]:
        return record
    logger.info("the corpus files have other paths or modification times than when this directory was "
                "prepared, and the same bytes: reusing what was built from them")
    stale = old["corpus_fingerprint"]
    return {step: {**entry, "corpus_fingerprint": fingerprint}
            if isinstance(entry, dict) and entry.get("corpus_fingerprint") == stale else entry
            for step, entry in record.items()}


def prepare_lock(output_dir: Path) -> contextlib.AbstractContextManager[None]:
    """Hold ``output_dir/.prepare.lock`` exclusively (``locks.directory_lock``) while the directory
    is checked and built. Jobs that prepare one directory at once (a Slurm array whose jobs share
    ``job.data.path``) take turns: a later one waits, then finds what the first built and reuses
    it, instead of clearing shards another job has just opened, or both writing the same
    temporary names."""
    return directory_lock(output_dir, LOCK_FILE, "prepare")


def _read_record(path: Path) -> dict:
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        logger.warning("ignoring unreadable %s (%s); every step will be checked from scratch", path, e)
        return {}
    return record if isinstance(record, dict) else {}


def _write_record(path: Path, record: dict) -> None:
    write_atomic(path, (json.dumps(record, indent=1, sort_keys=True) + "\n").encode())


def _differs(old: dict[str, Any], wanted: dict[str, Any], built: str) -> str:
    """What a step recorded against what it is asked for now, for ``keep_built``'s refusal."""
    if not old:  # built by another command (vrgd-data tokenizer/shard), or the record lost
        return (f"inputs or options it has no record of ({RECORD} missing or unreadable, or without this step: "
                f"its {built} built by another command)")
    keys = [k for k in wanted if old.get(k) != wanted[k]]
    if not keys:
        return f"the same options, but its {built} no longer matches its record (edited or damaged)"
    return "other " + ", ".join(f"{k} ({old.get(k)!r} there, {wanted[k]!r} now)" for k in keys)


def prepare(
    output_dir: str | os.PathLike[str],
    inputs: PathLike | Iterable[PathLike] | None = None,
    format: str = "auto",
    vocab_size: int | None = None,
    seq_lens: Sequence[int] = (128, 512),
    seed: int = 0,
    workers: int | None = None,
    progress: bool = True,
    *,
    field: str = "text",
    model_type: str = "unigram",
    tokenizer_threads: int = DEFAULT_TOKENIZER_THREADS,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    next_sentence: str | None = None,
    keep_built: bool = False,
) -> Prepared:
    """Build (or reuse) tokenizer, shards and sample indices in ``output_dir``.

    Args:
        output_dir: where everything goes (layout in the module docstring); created if needed.
        inputs: corpus files, directories or glob patterns; ``None`` uses the embedded corpus.
        format: corpus format (:mod:`vrgd_ds.data_pipeline.corpus`); ignored for the embedded corpus.
        vocab_size: tokenizer vocabulary including the 5 specials; default 30522 (BERT), or
            8192 for the embedded corpus, which is too small for more than about 10.8k pieces.
        seq_lens: one sample index per sequence length (BERT phase 1 and 2: 128, 512).
        seed: seeds tokenizer sampling and the sample indices.
        workers: tokenisation processes (default: usable CPUs); does not change the output.
        progress: tqdm progress bars.
        field: text field of JSONL records.
        model_type: ``"unigram"`` or ``"bpe"``.
        tokenizer_threads: sentencepiece trainer threads; part of what determines the model.
        shard_tokens: tokens per shard.
        next_sentence: passed to ``build_sample_index`` when set (``"nsp"``/``"sop"``); by
            default its own default is used.
        keep_built: a tokenizer or shards built here before from other inputs or options, or
            with no record of how (``prepare.json`` missing, unreadable or without that step), are
            not rebuilt (other jobs may read them): a ``DataError`` names what differs.
    """
    from vrgd_ds.data_pipeline.samples import build_sample_index  # the sample builder imports torch

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    corpus = EmbeddedCorpus() if inputs is None else Corpus(inputs, format, field)
    if vocab_size is None:
        vocab_size = DEFAULT_EMBEDDED_VOCAB_SIZE if inputs is None else DEFAULT_VOCAB_SIZE
    seq_lens = tuple(int(n) for n in seq_lens)
    if not seq_lens:
        raise DataError("seq_lens is empty; pass at least one sequence length (--seq-len 128)")
    for n in seq_lens:  # before the tokenizer and the shards, which take the time
        check_build_args(n, seed, next_sentence=next_sentence)
    with prepare_lock(output_dir):  # another job preparing this directory finishes first
        record_path = output_dir / RECORD
        record = _read_record(record_path)
        fingerprint = corpus_fingerprint(corpus)
        # the files' bytes, read at most once a call (a rebuild records the digest that decided it)
        content = functools.cache(lambda: corpus_content_sha256(corpus))
        moved = _same_bytes(record, corpus, fingerprint, content)
        if moved is not record:  # once: the next start finds the new fingerprint
            record = moved
            _write_record(record_path, record)
        built: list[str] = []

        # 1. tokenizer
        tokenizer_path = output_dir / TOKENIZER_FILE
        wanted = {  # the corpus by its fingerprint: the description names the files as they were given
            "corpus_fingerprint": fingerprint, "vocab_size": vocab_size,
            "model_type": model_type, "seed": seed, "num_threads": tokenizer_threads,
        }
        old = record.get("tokenizer", {})
        tokenizer = None
        if {k: old.get(k) for k in wanted} == wanted and tokenizer_path.is_file() and sha256_file(tokenizer_path) == old.get("sha256"):
            try:
                tokenizer = Tokenizer.load(tokenizer_path)
                logger.info("reusing tokenizer %s", tokenizer)
            except DataError as e:
                logger.warning("retraining the tokenizer: %s", e)
        if tokenizer is None and keep_built and (old or tokenizer_path.is_file()):
            raise DataError(f"{output_dir} holds a tokenizer built from {_differs(old, wanted, 'tokenizer.model')}, "
                            "which would be trained again and the shards rewritten")
        if tokenizer is None:
            tokenizer = train_tokenizer(
                corpus, tokenizer_path, vocab_size=vocab_size, model_type=model_type, seed=seed,
                num_threads=tokenizer_threads,
            )
            built.append("tokenizer")
            # the source and the trainer's release are recorded, not compared (a tokenizer trained by another
            # release is still the data the shards were made from); later steps are stale now, unless the
            # tokenizer came out byte for byte as before (another seed on a corpus the trainer reads whole):
            # then the shards stand, and a job reading them while this one prepares goes on
            same = tokenizer.sha256 == old.get("sha256")
            content = {} if isinstance(corpus, EmbeddedCorpus) else {"corpus_sha256": content()}
            record = {**(record if same else {}),
                      "tokenizer": {**wanted, **content, "source": corpus.description, "trainer": trainer(),
                                    "sha256": tokenizer.sha256}}
            _write_record(record_path, record)

        # 2. shards
        shards_dir = output_dir / SHARDS_DIR
        wanted = {"corpus_fingerprint": fingerprint, "tokenizer_sha256": tokenizer.sha256, "shard_tokens": shard_tokens}
        old = record.get("shards", {})
        shards = None
        manifest_path = shards_dir / MANIFEST
        if {k: old.get(k) for k in wanted} == wanted and manifest_path.is_file() and sha256_file(manifest_path) == old.get("manifest_sha256"):
            try:
                shards = ShardedCorpus(shards_dir, verify="size")
                logger.info("reusing shards %s", shards)
            except DataError as e:
                logger.warning("rewriting the shards: %s", e)
        if shards is None and keep_built and (old or manifest_path.exists()):
            raise DataError(f"{output_dir} holds shards built from {_differs(old, wanted, MANIFEST)}, which would be "
                            "rewritten")
        if shards is None:
            shards = write_shards(corpus, tokenizer_path, shards_dir, shard_tokens=shard_tokens, workers=workers, progress=progress)
            built.append("shards")
            record = {"tokenizer": record["tokenizer"],
                      "shards": {**wanted, "manifest_sha256": sha256_file(manifest_path)}}
            _write_record(record_path, record)

        # 3. sample indices (build_sample_index reuses a matching index by itself)
        extra = {} if next_sentence is None else {"next_sentence": next_sentence}
        samples_dir = output_dir / SAMPLES_DIR
        indices = {n: Path(build_sample_index(shards, n, seed, samples_dir, **extra)) for n in seq_lens}
        samples = {str(n): {"file": str(p.relative_to(output_dir)) if p.is_relative_to(output_dir) else str(p),
                            "bytes": p.stat().st_size} for n, p in indices.items()}
        if record.get("samples") != samples:
            record["samples"] = samples
            _write_record(record_path, record)
        logger.info("prepared %s (built: %s)", output_dir, ", ".join(built) or "nothing, all reused")
        return Prepared(output_dir, tokenizer_path, shards_dir, indices, tuple(built))
