"""Sharded token files: round trip, checksums, verification, crash safety, worker independence."""
from __future__ import annotations

import errno
import hashlib
import json
import pickle

import numpy as np
import pytest
from pydoc_data.topics import topics

from vrgd_ds.data_pipeline import shards as shards_module
from vrgd_ds.data_pipeline.corpus import split_sentences
from vrgd_ds.data_pipeline.errors import DataError
from vrgd_ds.data_pipeline.shards import MANIFEST, ShardedCorpus, token_dtype, write_shards
from vrgd_ds.data_pipeline.tokenizer import Tokenizer, train_tokenizer

DOCUMENTS = [split_sentences(topics[key]) for key in sorted(topics)]
# An empty document and one whose only sentence is blank are dropped by the writer.
INPUT = DOCUMENTS[:30] + [[], ["   "]] + DOCUMENTS[30:]
SHARD_TOKENS = 20_000  # several shards from ~100k tokens


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tokenizer(DOCUMENTS, tmp_path_factory.mktemp("tok") / "tok.model", vocab_size=500, num_threads=1)


@pytest.fixture(scope="module")
def written(tokenizer, tmp_path_factory):
    out = tmp_path_factory.mktemp("shards")
    return write_shards(INPUT, tokenizer.path, out, shard_tokens=SHARD_TOKENS, workers=1, progress=False,
                        chunk_chars=50_000)


def expected(tokenizer):
    docs = [[tokenizer.encode(s) for s in d] for d in INPUT]
    return [[s for s in d if s] for d in docs if any(d)]


def test_round_trip_equals_direct_encoding(written, tokenizer):
    want = expected(tokenizer)
    corpus = ShardedCorpus(written.path)
    assert corpus.num_shards > 2
    assert len(corpus) == corpus.num_documents == len(want) == len(DOCUMENTS)
    assert corpus.num_sentences == sum(len(d) for d in want)
    assert corpus.num_tokens == sum(len(s) for d in want for s in d)
    assert corpus.vocab_size == 500 and corpus.dtype == np.uint16
    assert corpus.tokenizer_sha256 == tokenizer.sha256
    for i, doc in enumerate(want):
        got = corpus.document(i)
        assert [s.tolist() for s in got] == doc
        assert corpus.sentence_lengths(i).dtype == np.int64
        assert corpus.sentence_lengths(i).tolist() == [len(s) for s in doc]
    assert [s.tolist() for s in corpus[-1]] == want[-1]
    with pytest.raises(IndexError):
        corpus.document(len(want))


def test_a_span_is_the_sentences_joined_as_one_view(written, tokenizer):
    """``span(i, begin, end)`` is ``document(i)[begin:end]`` joined, as one view of the shard's
    tokens (no copy), for every range of every document, the empty and out-of-range ones included:
    the BERT samples read their sentences through it."""
    want = expected(tokenizer)
    corpus = ShardedCorpus(written.path)
    for i, doc in enumerate(want):
        n = len(doc)
        for begin in range(n + 1):
            for end in sorted({begin, begin + 1, (begin + n) // 2 + 1, n, n + 3}):
                got = corpus.span(i, begin, end)
                assert got.tolist() == [t for s in doc[begin:end] for t in s], (i, begin, end)
                assert got.dtype == corpus.dtype and (got.size == 0 or isinstance(got, np.memmap)), (i, begin, end)


def test_layout_and_checksums(written):
    manifest = json.loads((written.path / MANIFEST).read_text())
    assert manifest == written.manifest
    assert manifest["format_version"] == 1 and manifest["dtype"] == "uint16"
    shard_docs = 0
    for k, entry in enumerate(manifest["shards"]):
        tokens = np.load(written.path / f"shard_{k:05d}.tokens.npy", mmap_mode="r")
        sentences = np.load(written.path / f"shard_{k:05d}.sentences.npy", mmap_mode="r")
        documents = np.load(written.path / f"shard_{k:05d}.documents.npy", mmap_mode="r")
        assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16
        assert sentences.dtype == documents.dtype == np.int64
        assert len(sentences) == entry["num_sentences"] + 1 and len(documents) == entry["num_documents"] + 1
        assert sentences[0] == 0 and sentences[-1] == len(tokens) == entry["num_tokens"]
        assert documents[0] == 0 and documents[-1] == entry["num_sentences"]
        # every shard but the last is closed at the first document boundary past SHARD_TOKENS
        if k < len(manifest["shards"]) - 1:
            assert entry["num_tokens"] >= SHARD_TOKENS
            last_doc_tokens = sentences[-1] - sentences[documents[-2]]
            assert entry["num_tokens"] - last_doc_tokens < SHARD_TOKENS
        for record in entry["files"].values():
            data = (written.path / record["file"]).read_bytes()
            assert record["bytes"] == len(data) and record["sha256"] == hashlib.sha256(data).hexdigest()
        shard_docs += entry["num_documents"]
    assert shard_docs == manifest["num_documents"]
    assert not list(written.path.glob(".*"))  # no temporary files left behind
    # documents are views into the memory maps, not copies
    assert isinstance(written.document(0)[0].base, np.memmap) or isinstance(written.document(0)[0], np.memmap)


def test_one_and_two_workers_are_byte_identical(tokenizer, written, tmp_path):
    out = write_shards(INPUT, tokenizer.path, tmp_path / "two", shard_tokens=SHARD_TOKENS, workers=2,
                       progress=False, chunk_chars=50_000)
    names = sorted(p.name for p in written.path.iterdir())
    assert names == sorted(p.name for p in out.path.iterdir())
    for name in names:
        if name != MANIFEST:
            assert (written.path / name).read_bytes() == (out.path / name).read_bytes(), name
    strip = lambda m: {k: v for k, v in m.items() if k != "source"}  # noqa: E731
    assert strip(out.manifest) == strip(written.manifest)


def copy_dir(src, dst):
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def test_full_verify_detects_a_flipped_byte(written, tmp_path):
    """Sizes still match after a bit flip, so only verify="full" catches it - naming the file."""
    path = copy_dir(written.path, tmp_path / "flip")
    victim = path / "shard_00001.tokens.npy"
    data = bytearray(victim.read_bytes())
    data[-7] ^= 0x01
    victim.write_bytes(bytes(data))
    ShardedCorpus(path, verify="size")
    with pytest.raises(DataError, match=r"shard_00001\.tokens\.npy is corrupt \(sha256"):
        ShardedCorpus(path, verify="full")


def test_token_id_outside_the_vocabulary_names_the_shard(written, tmp_path):
    """A high byte flipped in a token passes the size check; before the range check it crashed the
    job at its first evaluation with ``IndexError: index out of range in self`` and no file named."""
    path = copy_dir(written.path, tmp_path / "ids")
    victim = path / "shard_00001.tokens.npy"
    data = bytearray(victim.read_bytes())
    data[-5] |= 0xF0  # the high byte of a little-endian uint16 token: id >= 61440 > vocab
    victim.write_bytes(bytes(data))
    corpus = ShardedCorpus(path, verify="size")
    with pytest.raises(DataError, match=r"shard_00001\.tokens\.npy holds token id \d+ at position \d+, outside the "
                                        r"vocabulary \[0, \d+\)"):
        corpus.check_token_ids()
    ShardedCorpus(written.path).check_token_ids()  # the intact shards pass


def test_missing_or_truncated_shard_names_the_file(written, tmp_path):
    path = copy_dir(written.path, tmp_path / "missing")
    (path / "shard_00002.documents.npy").unlink()
    with pytest.raises(DataError, match=r"shard_00002\.documents\.npy is missing"):
        ShardedCorpus(path)
    lazy = ShardedCorpus(path, verify="none")  # trusting the manifest, the error comes on access
    with pytest.raises(DataError, match=r"shard_00002\.documents\.npy is missing"):
        lazy.document(sum(e["num_documents"] for e in lazy.manifest["shards"][:2]))  # first of shard 2
    path = copy_dir(written.path, tmp_path / "truncated")
    victim = path / "shard_00000.sentences.npy"
    victim.write_bytes(victim.read_bytes()[:-8])
    with pytest.raises(DataError, match=r"shard_00000\.sentences\.npy has \d+ bytes, the manifest says"):
        ShardedCorpus(path)


def test_shards_without_manifest_are_rejected(written, tmp_path):
    path = copy_dir(written.path, tmp_path / "nomanifest")
    (path / MANIFEST).unlink()
    with pytest.raises(DataError, match="interrupted write.*rerun"):
        ShardedCorpus(path)
    with pytest.raises(DataError, match="does not exist"):
        ShardedCorpus(tmp_path / "nowhere")


def test_disk_full_leaves_nothing_that_loads(tokenizer, written, tmp_path, monkeypatch):
    """ENOSPC in the middle of a shard: DataError, no manifest (also not the old one), no temp files."""
    path = copy_dir(written.path, tmp_path / "full")  # a valid old shard set is being replaced
    calls = 0
    real_write = shards_module._HashingWriter.write

    def failing_write(self, data):
        nonlocal calls
        calls += 1
        if calls == 8:  # header and body of a few files succeed, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, data)

    monkeypatch.setattr(shards_module._HashingWriter, "write", failing_write)
    with pytest.raises(DataError, match="No space left on device.*free disk space") as info:
        write_shards(INPUT, tokenizer.path, path, shard_tokens=SHARD_TOKENS, workers=1, progress=False)
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
    assert not (path / MANIFEST).exists()
    assert not list(path.glob(".*"))
    # the files that did get their final name are complete .npy files, but without a manifest
    # the set is refused
    for p in path.glob("shard_*.npy"):
        np.load(p, mmap_mode="r")
    with pytest.raises(DataError, match="interrupted write"):
        ShardedCorpus(path)


def test_pickle_reopens_lazily(written):
    corpus = ShardedCorpus(written.path)
    corpus.document(0)
    copy = pickle.loads(pickle.dumps(corpus))
    assert copy._maps == {}
    last = copy.num_documents - 1
    assert [s.tolist() for s in copy.document(last)] == [s.tolist() for s in corpus.document(last)]


def test_tokenizer_mismatch_and_dtypes(written, tokenizer, tmp_path):
    written.check_tokenizer(tokenizer)
    other = train_tokenizer(DOCUMENTS[:40], tmp_path / "other.model", vocab_size=300, num_threads=1)
    with pytest.raises(DataError, match="different tokenizer"):
        written.check_tokenizer(Tokenizer.load(other.path))
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.int32


def test_empty_input_is_an_error(tokenizer, tmp_path):
    with pytest.raises(DataError, match="tokenised to nothing"):
        write_shards([[], [" "]], tokenizer.path, tmp_path / "empty", workers=1, progress=False)
    with pytest.raises(DataError, match="workers=0"):
        write_shards(INPUT, tokenizer.path, tmp_path / "w", workers=0, progress=False)


def test_a_shard_rewritten_under_a_reader_is_an_error_unless_its_bytes_are_the_same(tokenizer, tmp_path):
    """A job maps its shards lazily; another preparation into the same directory (another
    tokenizer) rewrites them in place. A shard first read after that is refused, naming it; one
    rewritten with the same bytes (the same tokenizer again) reads on. Fails on the old code,
    which read the new files with the old manifest's offsets: another text, silently, or here a raw
    IndexError."""
    def write(tok):
        return write_shards(INPUT, tok, tmp_path / "shards", shard_tokens=SHARD_TOKENS, workers=1, progress=False,
                            chunk_chars=50_000)

    write(tokenizer.path)
    reader = ShardedCorpus(tmp_path / "shards")
    last = reader.num_documents - 1
    reader.document(0)  # the first shard mapped, the last not yet
    assert reader.num_shards > 1 and list(reader._maps) == [0]
    write(tokenizer.path)  # the same bytes in new files
    want = [s.copy() for s in reader.document(last)]
    other = train_tokenizer(DOCUMENTS[:40], tmp_path / "other.model", vocab_size=300, num_threads=1)
    again = ShardedCorpus(tmp_path / "shards")
    again.document(0)
    write(other.path)
    with pytest.raises(DataError, match=r"shard_\d+\.\w+\.npy was rewritten after .* was opened here"):
        again.document(last)
    assert [s.tolist() for s in want] == [list(s) for s in expected(tokenizer)[-1]]


def test_two_writers_of_one_shard_directory_take_turns(tokenizer, tmp_path, caplog):
    """``write_shards`` holds a lock beside its directory while it clears and writes there: a
    second writer (a ``vrgd-data shard`` beside a ``prepare``) waits, naming the first, and
    leaves the first's shards untouched until then. Fails on the old code (no lock): the two
    deleted and renamed each other's files, leaving a manifest that describes other files, or a
    raw FileNotFoundError."""
    import logging
    import threading
    import time

    from vrgd_ds.data_pipeline.locks import directory_lock

    out = tmp_path / "shards"
    first = write_shards(INPUT[:20], tokenizer.path, out, shard_tokens=SHARD_TOKENS, workers=1, progress=False)
    caplog.set_level(logging.INFO, logger="vrgd_ds.data_pipeline.locks")
    done: dict = {}
    with directory_lock(tmp_path, ".shards.lock", "test"):  # the first writer, still at work
        thread = threading.Thread(target=lambda: done.update(second=write_shards(
            INPUT, tokenizer.path, out, shard_tokens=SHARD_TOKENS, workers=1, progress=False)))
        thread.start()
        deadline = time.monotonic() + 60
        while "waiting for another shard write" not in caplog.text and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert thread.is_alive() and "waiting for another shard write" in caplog.text
        assert ShardedCorpus(out, verify="full").manifest == first.manifest
    thread.join(timeout=120)
    assert done["second"].num_documents > first.num_documents
    ShardedCorpus(out, verify="full")


def test_another_users_lock_file_in_a_shared_directory_still_locks(tmp_path, monkeypatch):
    """A data directory two users write into (a group share): the lock file the first user's
    ``prepare`` left may not be opened for writing by the second. That is not a read-only
    directory, yet the second went on unlocked, beside the first's writes (fails on the old code:
    its ``open(..., "a+")`` refused, it ran the block without the lock). The lock is now taken
    through a read-only descriptor; where even that is refused the error names the file, its
    owner and the fix; a lock file this user creates is group-writable."""
    import errno
    import fcntl
    import os
    import stat

    from vrgd_ds.data_pipeline import locks
    from vrgd_ds.data_pipeline.errors import DataError

    created = tmp_path / ".mine.lock"
    with locks.directory_lock(tmp_path, created.name, "test"):
        pass
    assert stat.S_IMODE(created.stat().st_mode) & 0o060 == 0o060
    theirs = tmp_path / ".prepare.lock"
    theirs.write_text("other-host pid 1\n")
    real_os_open, real_open = os.open, open

    def refused(path) -> bool:
        return os.path.abspath(path) == str(theirs)

    def os_open(path, flags, *args, **kwargs):
        if refused(path) and flags & (os.O_RDWR | os.O_WRONLY):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_os_open(path, flags, *args, **kwargs)

    def builtin_open(path, mode="r", *args, **kwargs):  # the old code's way in
        if refused(path) and any(c in mode for c in "aw+"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(locks, "open", builtin_open, raising=False)
    with locks.directory_lock(tmp_path, theirs.name, "prepare"):
        with real_open(theirs) as probe:  # another open file description: the lock must be held
            with pytest.raises(BlockingIOError):
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert theirs.read_text() == "other-host pid 1\n"  # read-only: the holder line is left as it was

    def no_read_only_lock(fh, op):
        raise OSError(errno.EBADF, "Bad file descriptor")

    monkeypatch.setattr(locks.fcntl, "flock", no_read_only_lock)
    with pytest.raises(DataError, match=r"\.prepare\.lock: the lock file of this shared directory belongs to .*"
                                        r"\(chmod g\+w"):
        with locks.directory_lock(tmp_path, theirs.name, "prepare"):
            pass


class _Squares:
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return i * i


def _usr1_to(pids):
    import os
    import signal
    import time

    for pid in pids:
        os.kill(pid, signal.SIGUSR1)
    time.sleep(1.0)


@pytest.mark.exhaustive  # two spawned interpreters (about 9 s)
@pytest.mark.timeout(240)  # the old code hung in the pool's teardown
def test_spawned_workers_outlive_the_jobs_preemption_signal(tokenizer):
    """Slurm sends its pre-emption warning (SIGUSR1) to every process of the step; the job
    handles it in the parent. The encoding pool's workers and a spawned DataLoader worker
    (forkserver, Python 3.14's default, starts them alike) get it blocked, so they live on and
    finish their work. Fails on the code before: they died of the signal's default action, the
    pool's task was lost (the parent waited on it forever) and the loader stopped with "worker
    exited unexpectedly"."""
    import signal

    import torch

    from vrgd_ds.train.data import loader

    previous = signal.signal(signal.SIGUSR1, lambda *unused: None)  # the job's handler
    try:
        pool = shards_module.start_pool(1, str(tokenizer.path))
        try:
            workers = list(pool._pool)
            assert pool.apply_async(shards_module._encode_in_worker, ([["one two"]],)).get(timeout=120)
            _usr1_to([w.pid for w in workers])
            assert [w.exitcode for w in workers] == [None]
            assert pool.apply_async(shards_module._encode_in_worker, ([["three four"]],)).get(timeout=120)
        finally:
            pool.terminate()
            pool.join()
        spawn = torch.multiprocessing.get_context("spawn")
        original = torch.utils.data.DataLoader.__init__

        def spawned(self, *args, **kwargs):
            original(self, *args, multiprocessing_context=spawn, **kwargs)

        torch.utils.data.DataLoader.__init__ = spawned
        try:
            batches = loader(_Squares(), [[0, 1], [2, 3]], 1, False, collate_fn=list)
        finally:
            torch.utils.data.DataLoader.__init__ = original
        assert next(batches) == [0, 1]
        _usr1_to([w.pid for w in batches._workers])
        assert next(batches) == [4, 9]
    finally:
        signal.signal(signal.SIGUSR1, previous)


# -- offsets in the size check, read errors, the writer's lock (review fixes) ---------------------


@pytest.mark.parametrize("kind, index, value, what", [
    ("sentences", 10, 1 << 40, r"offset 11 \(\d+\) is below offset 10 \(1099511"),  # a high byte flipped
    ("sentences", 0, 3, "starts at 3, not 0"),
    ("sentences", -1, 7, r"ends at 7, not at the shard's \d+ tokens"),
    ("documents", -1, 1, r"ends at 1, not at the shard's \d+ sentences"),
    ("documents", 2, 0, r"offset 2 \(0\) is below offset 1 \(\d+\)"),
])
def test_corrupt_offsets_fail_the_size_check(written, tmp_path, kind, index, value, what):
    """A flipped byte in a shard's sentence or document offsets keeps its size and header, so the
    size check passed it and the corpus read sentences of 1099511627807 tokens (or another text).
    The size check now reads the offsets: they run from 0 to the shard's token (sentence) count,
    never decreasing; a DataError names the file, what is wrong and the fixes (the shard step, and
    the sha256 check). Fails on the old code (no error at verify="size")."""
    path = copy_dir(written.path, tmp_path / "offsets")
    victim = path / f"shard_00001.{kind}.npy"
    offsets = np.load(victim, mmap_mode="r+")
    offsets[index] = value
    offsets.flush()
    del offsets
    with pytest.raises(DataError, match=rf"shard_00001\.{kind}\.npy holds corrupt {kind[:-1]} offsets \({what}.*"
                                        r"rerun `vrgd-data shard` into .*`vrgd-data verify .* --full`"):
        ShardedCorpus(path, verify="size")
    ShardedCorpus(path, verify="none")  # the caller's choice


@pytest.mark.parametrize("format", ["auto", "text"])
def test_an_input_that_cannot_be_read_is_named_not_a_shard_write_failure(tokenizer, tmp_path, format):
    """An input file removed (or made unreadable) after the corpus listed it: a DataError naming that
    file, from the reader, not "writing shards to ... failed; free disk space" about the output
    directory. Fails on the old code, whose shard writer caught every OSError of its loop, the
    reader's FileNotFoundError included."""
    from vrgd_ds.data_pipeline.corpus import Corpus

    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text("One sentence here. Another one there.\n\nA second document.\n")
    corpus = Corpus([tmp_path / "a.txt", tmp_path / "b.txt"], format=format)
    (tmp_path / "b.txt").unlink()
    with pytest.raises(DataError) as info:
        write_shards(corpus, tokenizer.path, tmp_path / "out", workers=1, progress=False)
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'b.txt'}") and "cannot be read (FileNotFoundError" in message, message
    assert "writing shards" not in message


def _held(lock) -> bool:
    """Whether another open file description holds ``lock`` (flock)."""
    import fcntl

    with open(lock) as probe:
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(probe, fcntl.LOCK_UN)
        return False


def test_the_shard_writer_locks_the_resolved_directory_or_inside_it(tokenizer, tmp_path, monkeypatch):
    """The writer's lock is named from the resolved directory: a writer through a symlink takes
    the lock one through the real path takes (``.shards.lock`` beside it). Where the parent is
    read-only but the directory writable, it locks inside the directory (``.shard-write.lock``)
    rather than going on unlocked. Fails on the old code: the symlink's own lock
    (``.alias.lock``), and no lock at all beside a read-only parent."""
    import os

    real = tmp_path / "data" / "shards"
    real.mkdir(parents=True)
    alias = tmp_path / "alias"
    alias.symlink_to(real)
    seen = []
    clear = shards_module._clear_directory

    def probing(directory):
        lock = (real.parent / ".shards.lock", real / ".shard-write.lock")
        seen.append(tuple(p.is_file() and _held(p) for p in lock))
        clear(directory)

    monkeypatch.setattr(shards_module, "_clear_directory", probing)
    write_shards(INPUT[:3], tokenizer.path, alias, workers=1, progress=False)
    own_lock = (tmp_path / ".alias.lock").exists()

    real_open, real_access = os.open, os.access
    parent = str(real.parent)

    def os_open(path, flags, *args, **kwargs):  # the parent refuses new files, as a read-only one does
        if os.path.dirname(os.path.abspath(path)) == parent and flags & (os.O_RDWR | os.O_WRONLY | os.O_CREAT):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    (real.parent / ".shards.lock").unlink(missing_ok=True)
    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(os, "access", lambda path, mode: os.path.abspath(path) != parent and real_access(path, mode))
    write_shards(INPUT[:3], tokenizer.path, real, workers=1, progress=False)
    assert (seen, own_lock) == ([(True, False), (False, True)], False)
