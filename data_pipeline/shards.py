"""Sharded, memory-mapped token files: parallel writer and lazy, verifiable reader.

Layout of a shard directory (``K`` = 00000, 00001, ...)::

    shard_K.tokens.npy      token ids of all sentences, concatenated        (num_tokens,)
    shard_K.sentences.npy   int64 token offsets of the sentences            (num_sentences + 1,)
    shard_K.documents.npy   int64 sentence offsets of the documents         (num_documents + 1,)
    manifest.json           format version, dtype, vocab_size, tokenizer sha256, per-shard
                            counts, byte sizes and sha256 of every file, totals, source

Offsets are local to their shard and start at 0: sentence ``s`` of a shard is
``tokens[sentences[s]:sentences[s + 1]]`` and document ``d`` is sentences
``documents[d]:documents[d + 1]``. A document never spans two shards; a shard is closed once it
holds ``shard_tokens`` tokens. Tokens are ``uint16`` when the vocabulary fits (<= 65536 ids),
else ``int32``; the dtype is in the manifest. Every file is a plain ``.npy`` that
``np.load(path, mmap_mode="r")`` opens without reading it, so any number of ranks and DataLoader
workers on a node share one copy in the page cache.

Crash safety. Every file is written under a hidden temporary name, fsynced and only then renamed
to its final name; the manifest is written last, the same way. A crash or a full disk (ENOSPC)
therefore leaves either no shard file or a complete one, and never a manifest describing files
that are not all there. Writing into a directory first deletes its old manifest, so a rewrite
that dies halfway leaves shard files without a manifest, which :class:`ShardedCorpus` rejects
with a message saying to rerun. Sizes and offsets (cheap) or sha256 sums (a full read) catch
later damage.

Parallelism. The main process reads documents and cuts them into chunks of about
``chunk_chars`` characters; ``workers`` spawned processes (each loads the tokenizer once)
encode the chunks; results are consumed in submission order with a bounded number of chunks in
flight. Shard contents are therefore byte-identical for any number of workers, and memory stays
bounded for corpora of any size.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import json
import logging
import multiprocessing
import os
import signal
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from vrgd_ds.data_pipeline.errors import DataError
from vrgd_ds.data_pipeline.locks import directory_lock
from vrgd_ds.data_pipeline.tokenizer import Tokenizer, atomic_file, fsync_dir, sha256_file, write_atomic

logger = logging.getLogger(__name__)

FORMAT_NAME = "vrgd-data-shards"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LOCK_SUFFIX = ".lock"  # write_shards holds <parent>/.<out_dir name>.lock (shard_write_lock)
INSIDE_LOCK = ".shard-write.lock"  # or <out_dir>/.shard-write.lock where the parent is read-only
FILE_KINDS = ("tokens", "sentences", "documents")
VERIFY_LEVELS = ("none", "size", "full")
DEFAULT_SHARD_TOKENS = 1 << 25  # 64 MiB of uint16 tokens per shard
DEFAULT_CHUNK_CHARS = 1 << 20  # text per worker task: large enough to amortise pickling


def default_workers() -> int:
    """CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits, else ``int32``."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.int32)


def shard_file(directory: Path, index: int, kind: str) -> Path:
    return directory / f"shard_{index:05d}.{kind}.npy"


# --------------------------------------------------------------------------- encoding (workers)


@dataclass
class _Encoded:
    """One chunk of documents, tokenised; empty sentences and documents are dropped."""

    tokens: np.ndarray  # int32, all sentences concatenated
    sentence_lengths: np.ndarray  # int64 per sentence
    document_sentences: np.ndarray  # int64 sentences per document
    text_chars: int


_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer_path: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = Tokenizer.load(tokenizer_path)


def _encode_in_worker(documents: list[list[str]]) -> _Encoded:
    assert _worker_tokenizer is not None, "worker started without _init_worker"
    return encode_documents(_worker_tokenizer, documents)


def encode_documents(tokenizer: Tokenizer, documents: Sequence[Sequence[str]]) -> _Encoded:
    """Tokenise ``documents`` sentence by sentence (one sentencepiece thread)."""
    sentences = [s for document in documents for s in document]
    ids = tokenizer.encode_batch(sentences, num_threads=1) if sentences else []
    lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
    per_document = []
    position = 0
    for document in documents:
        n = len(document)
        per_document.append(int(np.count_nonzero(lengths[position:position + n])))
        position += n
    tokens = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(lengths.sum()))
    document_sentences = np.asarray(per_document, dtype=np.int64)
    return _Encoded(
        tokens=tokens,
        sentence_lengths=lengths[lengths > 0],
        document_sentences=document_sentences[document_sentences > 0],
        text_chars=sum(len(s) + 1 for s in sentences),
    )


def _chunks(documents: Iterable[Sequence[str]], chunk_chars: int) -> Iterator[list[list[str]]]:
    chunk: list[list[str]] = []
    size = 0
    for document in documents:
        chunk.append(list(document))
        size += sum(len(s) for s in document)
        if size >= chunk_chars:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


@contextlib.contextmanager
def children_without_usr1() -> Iterator[None]:
    """Child processes started inside have SIGUSR1 blocked for their lifetime. Slurm's warning
    before a pre-emption (``--signal=USR1@120``) goes to every process of the step, and the job
    handles it in the parent (a checkpoint, then exit); a child started by spawn or forkserver
    would die of the signal's default action, losing its task (the parent then waits on it
    forever). A signal that comes to the parent meanwhile is delivered when this ends."""
    if not hasattr(signal, "pthread_sigmask"):  # no POSIX signal masks: nothing to inherit
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def start_pool(workers: int, tokenizer_path: str) -> multiprocessing.pool.Pool:
    """``workers`` encoding processes, each with the tokenizer loaded (``_init_worker``).
    Spawned, not forked: the caller may hold threads (torch, tokenizer) that a fork would copy in
    a locked state."""
    context = multiprocessing.get_context("spawn")
    with children_without_usr1():
        return context.Pool(workers, initializer=_init_worker, initargs=(tokenizer_path,))


def _encoded_chunks(
    documents: Iterable[Sequence[str]], tokenizer: Tokenizer, workers: int, chunk_chars: int
) -> Iterator[tuple[int, _Encoded]]:
    """(documents read, encoded chunk) in input order, encoded in ``workers`` processes."""
    if workers <= 1:
        for chunk in _chunks(documents, chunk_chars):
            yield len(chunk), encode_documents(tokenizer, chunk)
        return
    pool = start_pool(workers, str(tokenizer.path))
    in_flight: deque = deque()
    try:
        # Pool.imap would read the whole input ahead of the workers; a bounded queue of
        # AsyncResults in submission order keeps memory flat and the order deterministic.
        for chunk in _chunks(documents, chunk_chars):
            in_flight.append((len(chunk), pool.apply_async(_encode_in_worker, (chunk,))))
            if len(in_flight) >= 2 * workers:
                n, result = in_flight.popleft()
                yield n, result.get()
        while in_flight:
            n, result = in_flight.popleft()
            yield n, result.get()
        pool.close()
    finally:
        pool.terminate()
        pool.join()


# --------------------------------------------------------------------------- writing


class _HashingWriter:
    """File wrapper for ``np.save`` that hashes and counts the bytes it writes."""

    def __init__(self, fh):
        self._fh = fh
        self.sha256 = hashlib.sha256()
        self.bytes = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.sha256.update(view)
        self.bytes += view.nbytes
        return self._fh.write(view)


def _write_npy(path: Path, array: np.ndarray) -> dict:
    """Write ``array`` to ``path`` via a temporary name; return its size and sha256."""
    # The ".shard_*.tmp" name lets write_shards find leftovers of an interrupted run.
    with atomic_file(path, tmp=path.with_name(f".{path.name}.tmp")) as fh:
        writer = _HashingWriter(fh)
        np.save(writer, array, allow_pickle=False)
    return {"file": path.name, "bytes": writer.bytes, "sha256": writer.sha256.hexdigest()}


class _ShardWriter:
    """Accumulates encoded documents and writes a shard once it holds ``shard_tokens`` tokens."""

    def __init__(self, directory: Path, dtype: np.dtype, shard_tokens: int):
        self.directory = directory
        self.dtype = dtype
        self.shard_tokens = shard_tokens
        self.entries: list[dict] = []
        self._reset()

    def _reset(self) -> None:
        self._tokens: list[np.ndarray] = []
        self._lengths: list[np.ndarray] = []
        self._doc_sentences: list[np.ndarray] = []
        self._num_tokens = 0

    def add(self, encoded: _Encoded) -> None:
        doc_sentences = encoded.document_sentences
        sentence_start = np.concatenate([[0], np.cumsum(doc_sentences)])
        token_start = np.concatenate([[0], np.cumsum(encoded.sentence_lengths)])
        doc_tokens = np.diff(token_start[sentence_start])
        d = 0
        while d < len(doc_sentences):
            # Take documents until the shard is full; the document that crosses the limit goes in
            # whole, so documents never span shards.
            room = self.shard_tokens - self._num_tokens
            cumulative = np.cumsum(doc_tokens[d:])
            take = min(int(np.searchsorted(cumulative, room, side="left")) + 1, len(doc_sentences) - d)
            s0, s1 = sentence_start[d], sentence_start[d + take]
            t0, t1 = token_start[s0], token_start[s1]
            self._tokens.append(encoded.tokens[t0:t1])
            self._lengths.append(encoded.sentence_lengths[s0:s1])
            self._doc_sentences.append(doc_sentences[d:d + take])
            self._num_tokens += int(t1 - t0)
            d += take
            if self._num_tokens >= self.shard_tokens:
                self.flush()

    def flush(self) -> None:
        if not self._doc_sentences:
            return
        index = len(self.entries)
        tokens = np.concatenate(self._tokens).astype(self.dtype, copy=False)
        lengths = np.concatenate(self._lengths)
        doc_sentences = np.concatenate(self._doc_sentences)
        arrays = {
            "tokens": tokens,
            "sentences": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            "documents": np.concatenate([[0], np.cumsum(doc_sentences)]).astype(np.int64),
        }
        files = {kind: _write_npy(shard_file(self.directory, index, kind), arrays[kind]) for kind in FILE_KINDS}
        self.entries.append({
            "name": f"shard_{index:05d}",
            "num_documents": len(doc_sentences),
            "num_sentences": len(lengths),
            "num_tokens": len(tokens),
            "files": files,
        })
        logger.debug("wrote shard %d: %d documents, %d tokens", index, len(doc_sentences), len(tokens))
        self._reset()


def _identity(path: Path) -> tuple[int, int] | None:
    """(inode, modification time in ns) of ``path``; None if it is not there."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns


def _clear_directory(directory: Path) -> None:
    """Remove a previous shard set: the manifest first, so that no state in between looks valid."""
    (directory / MANIFEST).unlink(missing_ok=True)
    fsync_dir(directory)
    for path in sorted(directory.glob("shard_*.npy")) + sorted(directory.glob(".shard_*.tmp")):
        path.unlink()


def write_shards(
    documents: Iterable[Sequence[str]],
    tokenizer_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    workers: int | None = None,
    progress: bool = True,
    source: str | None = None,
    chunk_chars: int = DEFAULT_CHUNK_CHARS,
) -> ShardedCorpus:
    """Tokenise ``documents`` into shards in ``out_dir`` and return the reader over them.

    Args:
        documents: iterable of documents (lists of sentences), read once; a
            :class:`~vrgd_ds.data_pipeline.corpus.Corpus` also supplies the source description.
        tokenizer_path: sentencepiece model from :func:`~vrgd_ds.data_pipeline.tokenizer.train_tokenizer`.
        out_dir: shard directory, created if needed; a previous shard set there is replaced.
        shard_tokens: a shard is closed once it holds this many tokens.
        workers: encoding processes (default: the usable CPUs); 1 encodes in this process.
            The output does not depend on it.
        progress: show a tqdm progress bar.
        source: description of the input for the manifest (default: ``documents.description``).
        chunk_chars: characters of text per worker task.
    """
    if shard_tokens < 1:
        raise DataError(f"shard_tokens={shard_tokens} must be positive; pass --shard-tokens >= 1")
    workers = default_workers() if workers is None else int(workers)
    if workers < 1:
        raise DataError(f"workers={workers} must be at least 1; pass --workers >= 1")
    tokenizer = Tokenizer.load(tokenizer_path)
    dtype = token_dtype(tokenizer.vocab_size)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with shard_write_lock(out_dir):
        return _write_shards(documents, tokenizer, dtype, out_dir, shard_tokens, workers, progress, source,
                             chunk_chars)


def _writing(out_dir: Path, write, *args) -> None:
    """``write(*args)``, a write of shard files into ``out_dir``; an OSError there is a DataError
    saying what to do (its temporary files removed)."""
    try:
        write(*args)
    except OSError as e:
        for tmp in out_dir.glob(".shard_*.tmp"):
            tmp.unlink(missing_ok=True)
        hint = "free disk space" if e.errno == errno.ENOSPC else "check the directory"
        raise DataError(
            f"writing shards to {out_dir} failed ({e}); {hint} and rerun: the shards written so far "
            "have no manifest and will not load"
        ) from e


def shard_write_lock(out_dir: Path) -> contextlib.AbstractContextManager[None]:
    """The lock a writer of the shard directory ``out_dir`` holds (``locks.directory_lock``), named
    from its resolved path so that every path to it (a symlink, a relative path) takes the same one:
    ``.<name>.lock`` beside it where its parent may be written (another writer finishes first, even
    one that clears the directory), else ``.shard-write.lock`` inside it; unlocked only where
    ``out_dir`` itself may not be written (no one here changes it)."""
    out_dir = out_dir.resolve()
    if os.access(out_dir.parent, os.W_OK):
        return directory_lock(out_dir.parent, f".{out_dir.name}{LOCK_SUFFIX}", "shard write")
    return directory_lock(out_dir, INSIDE_LOCK, "shard write")


def _write_shards(documents: Iterable[Sequence[str]], tokenizer: Tokenizer, dtype: np.dtype, out_dir: Path,
                  shard_tokens: int, workers: int, progress: bool, source: str | None,
                  chunk_chars: int) -> ShardedCorpus:
    _clear_directory(out_dir)
    writer = _ShardWriter(out_dir, dtype, shard_tokens)
    text_chars = 0
    bar = tqdm(desc=f"sharding -> {out_dir.name}", unit=" docs", unit_scale=True, disable=not progress)
    try:
        # only the writes are a shard-write failure: the corpus readers name an input they cannot read
        for n, encoded in _encoded_chunks(documents, tokenizer, workers, chunk_chars):
            _writing(out_dir, writer.add, encoded)
            text_chars += encoded.text_chars
            bar.update(n)
        _writing(out_dir, writer.flush)
    finally:
        bar.close()
    if not writer.entries:
        raise DataError("the corpus tokenised to nothing (no document has a non-empty sentence); check the inputs")
    entries = writer.entries
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "dtype": dtype.name,
        "vocab_size": tokenizer.vocab_size,
        "tokenizer_sha256": tokenizer.sha256,
        "tokenizer_path": str(tokenizer.path),
        "special_ids": {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4},
        "source": source if source is not None else getattr(documents, "description", "documents (iterable)"),
        "text_chars": text_chars,
        "shard_tokens": shard_tokens,
        "num_shards": len(entries),
        "num_documents": sum(e["num_documents"] for e in entries),
        "num_sentences": sum(e["num_sentences"] for e in entries),
        "num_tokens": sum(e["num_tokens"] for e in entries),
        "shards": entries,
    }
    try:
        fsync_dir(out_dir)  # the shard renames are durable before the manifest that names them
        write_atomic(out_dir / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
    except OSError as e:
        raise DataError(f"writing {out_dir / MANIFEST} failed ({e}); free disk space and rerun") from e
    logger.info(
        "wrote %d shards to %s: %d documents, %d sentences, %d tokens",
        len(entries), out_dir, manifest["num_documents"], manifest["num_sentences"], manifest["num_tokens"],
    )
    return ShardedCorpus(out_dir, verify="size")


# --------------------------------------------------------------------------- reading


def _npy_header(path: Path) -> tuple[tuple[int, ...], np.dtype]:
    with open(path, "rb") as fh:
        version = np.lib.format.read_magic(fh)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(fh)
        else:
            shape, _, dtype = np.lib.format.read_array_header_2_0(fh)
    return shape, dtype


def _first_decrease(offsets: np.ndarray, block: int = 1 << 22) -> int | None:
    """The first ``i`` with ``offsets[i + 1] < offsets[i]`` (None if there is none), read a block at a time."""
    for start in range(0, len(offsets) - 1, block):
        part = np.asarray(offsets[start:start + block + 1])
        down = np.flatnonzero(part[1:] < part[:-1])
        if down.size:
            return start + int(down[0])
    return None


class ShardedCorpus:
    """Read-only view of a shard directory; documents are views into memory-mapped files.

    Files are mapped on first use, shard by shard. Pickling (DataLoader workers, spawn) ships only
    the path and manifest; the copy maps the files again when it first needs them.

    Args:
        path: the shard directory (with ``manifest.json``).
        verify: ``"size"`` (default) checks that every file exists with the size, dtype and shape
            the manifest records, and that the sentence and document offsets run from 0 to the
            shard's token and sentence counts without decreasing (reads the offsets, not the
            tokens); ``"full"`` also recomputes every sha256 (reads everything);
            ``"none"`` trusts the manifest.

    Attributes:
        path, manifest (the parsed ``manifest.json``), num_documents, num_sentences, num_tokens,
        vocab_size, dtype (numpy dtype of the tokens), tokenizer_sha256.
    """

    def __init__(self, path: str | os.PathLike[str], verify: str = "size"):
        self.path = Path(path)
        if verify not in VERIFY_LEVELS:
            raise DataError(f"verify={verify!r} is not one of {VERIFY_LEVELS}")
        self.manifest = self._read_manifest()
        m = self.manifest
        self.num_documents = int(m["num_documents"])
        self.num_sentences = int(m["num_sentences"])
        self.num_tokens = int(m["num_tokens"])
        self.vocab_size = int(m["vocab_size"])
        self.dtype = np.dtype(m["dtype"])
        self.tokenizer_sha256 = str(m["tokenizer_sha256"])
        self._doc_starts = np.cumsum([0] + [int(s["num_documents"]) for s in m["shards"]])
        self._maps: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        # each shard file as opened (inode, modification time): a file mapped later that is no longer
        # it was rewritten meanwhile (_arrays)
        self._opened = {kind_file: _identity(self.path / kind_file) for entry in m["shards"]
                        for kind_file in (entry["files"][kind]["file"] for kind in FILE_KINDS)}
        self.verify(verify)

    def _read_manifest(self) -> dict:
        manifest_path = self.path / MANIFEST
        if not self.path.is_dir():
            raise DataError(f"shard directory {self.path} does not exist; write it with `vrgd-data shard`")
        if not manifest_path.is_file():
            leftovers = sorted(self.path.glob("shard_*.npy"))
            if leftovers:
                raise DataError(
                    f"{manifest_path} is missing but {len(leftovers)} shard files are there (e.g. {leftovers[0].name}): "
                    "an interrupted write (crash, full disk) leaves shards without a manifest; "
                    f"rerun `vrgd-data shard` (or `vrgd-data prepare`) into {self.path}"
                )
            raise DataError(f"{manifest_path} does not exist; write shards there with `vrgd-data shard`")
        try:
            manifest = json.loads(manifest_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(f"{manifest_path} is not valid JSON ({e}); rerun `vrgd-data shard`") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
            raise DataError(f"{manifest_path} is not a {FORMAT_NAME} manifest; point at a directory written by `vrgd-data shard`")
        if manifest.get("format_version") != FORMAT_VERSION:
            raise DataError(
                f"{manifest_path} has format_version {manifest.get('format_version')}, this reader reads "
                f"{FORMAT_VERSION}; rewrite the shards with this version of `vrgd-data shard`"
            )
        missing = [k for k in ("dtype", "vocab_size", "tokenizer_sha256", "num_documents", "num_sentences",
                               "num_tokens", "shards") if k not in manifest]
        if missing:
            raise DataError(f"{manifest_path} lacks {missing}; rerun `vrgd-data shard`")
        return manifest

    # ---------------------------------------------------------------- verification

    def _expected_shape(self, entry: dict, kind: str) -> tuple[int]:
        if kind == "tokens":
            return (int(entry["num_tokens"]),)
        return (int(entry["num_sentences" if kind == "sentences" else "num_documents"]) + 1,)

    def verify(self, level: str = "size") -> None:
        """Check the files against the manifest (``level`` as the constructor's ``verify``).

        Raises DataError naming the first file that is missing, has the wrong size/shape/dtype or
        corrupt offsets, or (``"full"``) the wrong sha256.
        """
        if level not in VERIFY_LEVELS:
            raise DataError(f"verify={level!r} is not one of {VERIFY_LEVELS}")
        if level == "none":
            return
        rerun = f"rerun `vrgd-data shard` into {self.path} (or restore the file)"
        for entry in self.manifest["shards"]:
            for kind in FILE_KINDS:
                record = entry["files"][kind]
                path = self.path / record["file"]
                if not path.is_file():
                    raise DataError(f"shard file {path} is missing; {rerun}")
                size = path.stat().st_size
                if size != record["bytes"]:
                    raise DataError(f"shard file {path} has {size} bytes, the manifest says {record['bytes']}; {rerun}")
                try:
                    shape, dtype = _npy_header(path)
                except ValueError as e:
                    raise DataError(f"shard file {path} is not a valid .npy file ({e}); {rerun}") from None
                want_dtype = self.dtype if kind == "tokens" else np.dtype(np.int64)
                if shape != self._expected_shape(entry, kind) or dtype != want_dtype:
                    raise DataError(
                        f"shard file {path} holds {dtype}{list(shape)}, the manifest says "
                        f"{want_dtype}{list(self._expected_shape(entry, kind))}; {rerun}"
                    )
                if level == "full" and sha256_file(path) != record["sha256"]:
                    raise DataError(f"shard file {path} is corrupt (sha256 differs from the manifest); {rerun}")
            self._check_offsets(entry, rerun)
        if level == "full":
            self.check_token_ids()

    def _check_offsets(self, entry: dict, rerun: str) -> None:
        """Raise DataError naming a shard's offsets file unless its sentence offsets run from 0 to its
        token count and its document offsets from 0 to its sentence count, neither ever decreasing. Part
        of the size check: it reads the offsets (int64 per sentence and per document, a fraction of the
        tokens), and a flipped byte there, which sizes and headers do not see, would make sentences of
        another text or lengths past the end of the shard."""
        for kind, last, of in (("sentences", int(entry["num_tokens"]), "tokens"),
                               ("documents", int(entry["num_sentences"]), "sentences")):
            path = self.path / entry["files"][kind]["file"]
            offsets = np.load(path, mmap_mode="r", allow_pickle=False)
            if int(offsets[0]) != 0 or int(offsets[-1]) != last:
                what = (f"starts at {int(offsets[0])}, not 0" if int(offsets[0]) != 0 else
                        f"ends at {int(offsets[-1])}, not at the shard's {last} {of}")
            else:
                at = _first_decrease(offsets)
                if at is None:
                    continue
                what = f"offset {at + 1} ({int(offsets[at + 1])}) is below offset {at} ({int(offsets[at])})"
            raise DataError(f"shard file {path} holds corrupt {kind[:-1]} offsets ({what}); {rerun}. "
                            f"`vrgd-data verify {self.path} --full` checks every shard file against its sha256")

    def check_token_ids(self) -> None:
        """Raise DataError naming the first shard whose tokens leave ``[0, vocab_size)``.

        Reads every token once (the largest and smallest id per shard, from the memory map): a
        shard with flipped bytes passes the size check but would index past the embedding
        table at the first batch that holds the bad id.
        """
        for shard, entry in enumerate(self.manifest["shards"]):
            tokens = self._arrays(shard)[0]
            if tokens.size == 0:
                continue
            top, bottom = int(tokens.max()), int(tokens.min())
            if top >= self.vocab_size or bottom < 0:
                bad = top if top >= self.vocab_size else bottom
                where = int(np.flatnonzero(tokens == bad)[0])
                path = self.path / entry["files"]["tokens"]["file"]
                raise DataError(
                    f"shard file {path} holds token id {bad} at position {where}, outside the vocabulary "
                    f"[0, {self.vocab_size}): the file is corrupt (its sha256 check, `vrgd-data verify {self.path} "
                    f"--full`, tells); rerun `vrgd-data shard` into {self.path} (or restore the file)")

    def check_tokenizer(self, tokenizer: Tokenizer) -> None:
        """Raise DataError unless these shards were written with ``tokenizer``."""
        if tokenizer.sha256 != self.tokenizer_sha256:
            raise DataError(
                f"{self.path} was tokenised with a different tokenizer (sha256 {self.tokenizer_sha256[:12]}) than "
                f"{tokenizer.path} ({tokenizer.sha256[:12]}); rerun `vrgd-data shard` with that tokenizer"
            )

    # ---------------------------------------------------------------- access

    @property
    def num_shards(self) -> int:
        return len(self.manifest["shards"])

    def _arrays(self, shard: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        arrays = self._maps.get(shard)
        if arrays is None:
            entry = self.manifest["shards"][shard]
            loaded = []
            for kind in FILE_KINDS:
                name = entry["files"][kind]["file"]
                path = self.path / name
                try:
                    loaded.append(np.load(path, mmap_mode="r", allow_pickle=False))
                except FileNotFoundError:
                    raise DataError(f"shard file {path} is missing; rerun `vrgd-data shard` into {self.path}") from None
                if _identity(path) != self._opened.get(name):
                    self._check_rewrite(shard, path)
            arrays = self._maps[shard] = tuple(loaded)
        return arrays

    def _check_rewrite(self, shard: int, path: Path) -> None:
        """``path`` is not the file this corpus opened: accepted if the directory's manifest now
        describes shard ``shard`` as the one opened did (the same bytes, rewritten), else an error
        (another preparation rewrote the directory under this reader, e.g. with another tokenizer:
        its tokens indexed with this manifest's offsets would be another text)."""
        try:
            now = json.loads((self.path / MANIFEST).read_text())["shards"][shard]["files"]
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            now = None
        if now != self.manifest["shards"][shard]["files"]:
            raise DataError(
                f"shard file {path} was rewritten after {self.path} was opened here (another `vrgd-data shard` or "
                "`prepare` into the directory, e.g. with another tokenizer or vocab_size): its tokens no longer "
                "match the manifest read then. Give each tokenizer its own data directory, and restart the job")
        self._opened[path.name] = _identity(path)

    def _locate(self, i: int) -> tuple[np.ndarray, np.ndarray, int, int]:
        """Tokens and sentence offsets of document ``i``'s shard, and its sentence range there."""
        i = int(i)
        if i < 0:
            i += self.num_documents
        if not 0 <= i < self.num_documents:
            raise IndexError(f"document {i} out of range for {self.num_documents} documents")
        shard = int(np.searchsorted(self._doc_starts, i, side="right")) - 1
        tokens, sentences, documents = self._arrays(shard)
        local = i - int(self._doc_starts[shard])
        return tokens, sentences, int(documents[local]), int(documents[local + 1])

    def document(self, i: int) -> list[np.ndarray]:
        """Document ``i`` (global index across shards) as its sentences' token arrays (memmap views)."""
        tokens, sentences, s0, s1 = self._locate(i)
        offsets = sentences[s0:s1 + 1].tolist()
        return [tokens[a:b] for a, b in zip(offsets[:-1], offsets[1:])]

    def span(self, i: int, begin: int, end: int) -> np.ndarray:
        """The tokens of document ``i``'s sentences ``begin:end``, concatenated: one memmap view
        (a document's sentences lie end to end in its shard), where ``document(i)[begin:end]``
        makes a view per sentence of the whole document."""
        tokens, sentences, s0, s1 = self._locate(i)
        n = s1 - s0
        begin, end = max(0, min(int(begin), n)), max(0, min(int(end), n))
        if end <= begin:
            return tokens[:0]
        return tokens[int(sentences[s0 + begin]):int(sentences[s0 + end])]

    def sentence_lengths(self, i: int) -> np.ndarray:
        """Token counts (int64) of document ``i``'s sentences."""
        _, sentences, s0, s1 = self._locate(i)
        return np.diff(sentences[s0:s1 + 1]).astype(np.int64, copy=False)

    def __getitem__(self, i: int) -> list[np.ndarray]:
        return self.document(i)

    def __len__(self) -> int:
        return self.num_documents

    def __iter__(self) -> Iterator[list[np.ndarray]]:
        for i in range(self.num_documents):
            yield self.document(i)

    def __repr__(self) -> str:
        return (f"ShardedCorpus({str(self.path)!r}, shards={self.num_shards}, documents={self.num_documents}, "
                f"tokens={self.num_tokens}, vocab_size={self.vocab_size})")

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_maps"] = {}  # memmaps are reopened lazily in the receiving process
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
