"""Sentencepiece tokenizer with BERT's special tokens at fixed ids: training and loading.

Ids 0-4 are reserved, in every model this module trains, so that the sample builder, the
masking code and the model config can use them as constants:

    [PAD]=0  [UNK]=1  [CLS]=2  [SEP]=3  [MASK]=4

In sentencepiece terms: ``pad_id=0`` (piece ``[PAD]``), ``unk_id=1`` (piece ``[UNK]``), BOS/EOS
disabled, and ``[CLS]``, ``[SEP]``, ``[MASK]`` as *control* symbols, which take the next ids in
order. Control symbols never come out of :meth:`Tokenizer.encode` - text that happens to contain
``"[MASK]"`` is split into ordinary pieces - so user text cannot forge a special token. After
training, the ids are read back from the model and a model that has them elsewhere is rejected.

The model type is the *unigram* language model (Kudo 2018), sentencepiece's default: it trains
in one pass over a sample of sentences, its segmentation is the most likely one under a fitted
unigram model (BPE is available with ``model_type="bpe"``). Training reads sentences from an
iterator (no temporary text file) and is deterministic given the documents, ``seed`` and
``num_threads`` (sentencepiece partitions the work by thread, so the thread count is an input
of the result, like the seed, and defaults to a fixed 8 rather than the CPU count): a corpus of
more than ``input_sentence_size`` sentences is sampled here (``sample_sentences``, seeded with
``seed``), not by sentencepiece, whose sample differs from one process to the next whatever
``set_random_generator_seed`` says (0.2.3); the model file is written atomically (temporary
file, fsync, rename).

The sentencepiece release is an input too: from the same WikiText-2 text, seed and threads,
0.2.2 and 0.2.3 train other models (another normalization table and other pieces, so other
token counts and samples). pyproject.toml pins ``TRAINER_RELEASE``, the release the committed
study records were prepared with; training with another logs a warning naming both, and
``prepare`` records the release that trained each tokenizer (``trainer`` in ``prepare.json``).

:attr:`Tokenizer.sha256` (of the model file's bytes) is recorded in shard manifests so that a
training job can refuse shards tokenised with a different vocabulary.
"""
from __future__ import annotations

import hashlib
import io
import logging
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import numpy as np
import sentencepiece as spm

from vrgd_ds.data_pipeline.errors import DataError

#: the sentencepiece release pyproject.toml pins: the one whose tokenizers the records carry
TRAINER_RELEASE = "0.2.3"


def trainer() -> str:
    """The tokenizer trainer that is installed, as ``prepare.json`` records it."""
    return f"sentencepiece {spm.__version__}"

logger = logging.getLogger(__name__)

PAD, UNK, CLS, SEP, MASK = "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"
SPECIAL_IDS = {PAD: 0, UNK: 1, CLS: 2, SEP: 3, MASK: 4}
MODEL_TYPES = ("unigram", "bpe")
# sentencepiece drops longer sentences from training with a warning; 16 KiB keeps all but
# pathological ones (tables flattened into one line) while bounding the trainer's memory.
MAX_SENTENCE_BYTES = 16384


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file's bytes, read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


@contextmanager
def atomic_file(path: Path, tmp: Path | None = None) -> Iterator[IO[bytes]]:
    """A binary file handle whose content replaces ``path`` only once complete.

    The bytes go to ``tmp`` (default: a hidden name with the pid, in the same directory), are
    fsynced, and replace ``path`` with ``os.replace`` (atomic on POSIX and Windows); the
    directory is fsynced so the rename survives a power loss. On error the temporary file is
    removed and ``path`` is untouched.
    """
    tmp = tmp or path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that ``path`` is either the old file or the complete new one."""
    with atomic_file(path) as fh:
        fh.write(data)


def fsync_dir(directory: Path) -> None:
    """fsync a directory so that renames in it are durable (a no-op where unsupported)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems (and Windows) refuse fsync on directories
    finally:
        os.close(fd)


class Tokenizer:
    """A trained sentencepiece model with BERT special ids.

    Args:
        path: the ``.model`` file (use :meth:`load`).

    Attributes:
        pad_id, unk_id, cls_id, sep_id, mask_id: 0, 1, 2, 3, 4 (checked on load).
        vocab_size: number of pieces, specials included.
        sha256: hex sha256 of the model file; identifies the vocabulary in shard manifests.
        path: the model file.
    """

    pad_id, unk_id, cls_id, sep_id, mask_id = 0, 1, 2, 3, 4

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            raise DataError(f"tokenizer model {self.path} does not exist; train one with `vrgd-data tokenizer`") from None
        except IsADirectoryError:
            raise DataError(f"tokenizer model {self.path} is a directory; pass its .model file (`vrgd-data prepare` "
                            "writes tokenizer.model)") from None
        except OSError as e:
            raise DataError(f"tokenizer model {self.path} cannot be read: {e.strerror}") from None
        self._init(data)

    def _init(self, data: bytes) -> None:
        self._data = data
        self.sha256 = hashlib.sha256(data).hexdigest()
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(data)
        except Exception as e:  # sentencepiece raises RuntimeError/OSError for a corrupt proto
            raise DataError(f"{self.path} is not a sentencepiece model ({e}); retrain it with `vrgd-data tokenizer`") from None
        check_special_ids(self._sp, self.path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load a model file written by :func:`train_tokenizer`."""
        return cls(path)

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no [CLS]/[SEP]; the sample builder adds them)."""
        return self._sp.encode(text, out_type=int)

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """Token ids of each text; ``num_threads`` sentencepiece threads (-1: all cores)."""
        return self._sp.encode(list(texts), out_type=int, num_threads=num_threads)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; control tokens ([PAD], [CLS], [SEP], [MASK]) decode to nothing."""
        return self._sp.decode([int(i) for i in ids])

    def id_to_piece(self, i: int) -> str:
        return self._sp.id_to_piece(int(i))

    def piece_to_id(self, piece: str) -> int:
        return self._sp.piece_to_id(piece)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, sha256={self.sha256[:12]})"

    # sentencepiece processors do not pickle everywhere; ship the model bytes instead.
    def __getstate__(self) -> dict:
        return {"path": self.path, "data": self._data}

    def __setstate__(self, state: dict) -> None:
        self.path = state["path"]
        self._init(state["data"])


def check_special_ids(sp: spm.SentencePieceProcessor, path: os.PathLike[str] | str) -> None:
    """Raise DataError unless [PAD]..[MASK] have ids 0..4 in ``sp``, [UNK] as the unknown piece
    and the others as control symbols, which no text encodes to (a user-defined symbol would
    turn a literal "[SEP]" in the text into a separator)."""
    found = {piece: sp.piece_to_id(piece) for piece in SPECIAL_IDS}
    # piece_to_id maps unknown pieces to unk_id, so also check the reverse direction.
    wrong = {p: i for p, i in found.items() if i != SPECIAL_IDS[p] or sp.id_to_piece(SPECIAL_IDS[p]) != p}
    if wrong or sp.pad_id() != 0 or sp.unk_id() != 1:
        raise DataError(
            f"{path}: special tokens are not at the BERT ids {SPECIAL_IDS} (found {found}); "
            "retrain the tokenizer with `vrgd-data tokenizer`"
        )
    typed = [p for p, i in SPECIAL_IDS.items() if not (sp.is_unknown(i) if i == 1 else sp.is_control(i))]
    if typed:
        raise DataError(f"{path}: {', '.join(typed)} are not control symbols (user-defined ones?), so the text "
                        "itself can produce them; retrain the tokenizer with `vrgd-data tokenizer`")


def sentence_stream(documents: Iterable[Sequence[str]], max_bytes: int = MAX_SENTENCE_BYTES) -> Iterator[str]:
    """Non-empty sentences of ``documents``, cut to ``max_bytes`` UTF-8 bytes."""
    for document in documents:
        for sentence in document:
            if not sentence:
                continue
            if len(sentence) * 4 > max_bytes and len(sentence.encode()) > max_bytes:
                sentence = sentence.encode()[:max_bytes].decode(errors="ignore")
            yield sentence


#: keys the sentence sample's generator apart from the seed's other uses
SAMPLE_TAG = 0x5E47


def sample_sentences(sentences: Iterable[str], size: int, seed: int) -> tuple[list[str], int]:
    """A uniform sample of ``size`` of ``sentences`` (all of them, in order, when there are no
    more) and how many there were, read once: reservoir sampling with geometric skips (Li's
    Algorithm L, ACM TOMS 20(4), 1994), one draw per replacement rather than per sentence, from
    ``numpy.random.default_rng([seed, SAMPLE_TAG])``: the same sample in every process."""
    stream = iter(sentences)
    sample = [s for _, s in zip(range(size), stream)]
    if len(sample) < size:
        return sample, len(sample)
    rng, seen = np.random.default_rng([seed, SAMPLE_TAG]), size

    def shrink() -> float:  # the next weight factor: u^(1/size), u uniform on (0, 1]
        return math.exp(math.log(1.0 - rng.random()) / size)

    weight = shrink()
    while True:
        if weight <= 0.0:  # underflow: no later sentence would be taken
            return sample, seen + sum(1 for _ in stream)
        gap = 0.0 if weight >= 1.0 else math.floor(math.log(1.0 - rng.random()) / math.log1p(-weight))
        for _ in range(int(min(gap, 2**62))):
            if next(stream, None) is None:
                return sample, seen
            seen += 1
        taken = next(stream, None)
        if taken is None:
            return sample, seen
        seen += 1
        sample[int(rng.integers(size))] = taken
        weight *= shrink()


def _drained(items: list[str]) -> Iterator[str]:
    """``items`` in order, each let go as it is yielded: the list does not stay beside the copy
    sentencepiece makes of every sentence."""
    items.reverse()
    while items:
        yield items.pop()


def train_tokenizer(
    documents: Iterable[Sequence[str]],
    out_path: str | os.PathLike[str],
    vocab_size: int = 30522,
    model_type: str = "unigram",
    seed: int = 0,
    input_sentence_size: int = 4_000_000,
    character_coverage: float = 0.9995,
    byte_fallback: bool = False,
    num_threads: int = 8,
) -> Tokenizer:
    """Train a sentencepiece model on the sentences of ``documents`` and write it to ``out_path``.

    Args:
        documents: iterable of documents (lists of sentences), read once.
        out_path: the ``.model`` file to write (atomically); parent directories are created.
        vocab_size: number of pieces including the 5 specials (BERT-base uses 30522). A corpus too
            small for the vocabulary is a DataError that says so.
        model_type: ``"unigram"`` (default) or ``"bpe"``.
        seed: seeds the sample of ``input_sentence_size`` sentences (``sample_sentences``).
        input_sentence_size: at most this many sentences are used for training, a uniform sample
            (reservoir sampling, seeded) when the corpus has more; 0 uses all.
        character_coverage: fraction of characters covered by the vocabulary; the rest map to
            [UNK] (or to bytes with ``byte_fallback``).
        byte_fallback: encode uncovered characters as UTF-8 byte pieces instead of [UNK] (adds
            256 pieces; needs ``vocab_size`` well above 261).
        num_threads: trainer threads. The model depends on it (sentencepiece splits the work
            statically), so keep it fixed rather than tying it to the machine's CPU count.

    Returns:
        The loaded :class:`Tokenizer`.
    """
    if model_type not in MODEL_TYPES:
        raise DataError(f"model_type={model_type!r} is not supported; use one of {MODEL_TYPES}")
    if vocab_size <= len(SPECIAL_IDS):
        raise DataError(f"vocab_size={vocab_size} leaves no room next to the {len(SPECIAL_IDS)} special tokens; use a larger --vocab-size")
    if seed < 0:
        raise DataError(f"seed={seed}: sentencepiece takes a seed of 0 or more; pass --seed 0 or above")
    if input_sentence_size < 0:
        raise DataError(f"input_sentence_size={input_sentence_size}: must be 0 (every sentence) or more; pass "
                        "--input-sentence-size 0 or above")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if spm.__version__ != TRAINER_RELEASE:
        logger.warning("training the tokenizer with sentencepiece %s, not %s (pyproject.toml's pin): another release "
                       "trains another model from the same text, so these samples will differ from those of a machine "
                       "with %s; pip install sentencepiece==%s for the same data", spm.__version__, TRAINER_RELEASE,
                       TRAINER_RELEASE, TRAINER_RELEASE)
    spm.set_random_generator_seed(seed)
    model = io.BytesIO()
    count = 0
    failed: list[DataError] = []  # the reader's error, which sentencepiece wraps once it is reading
    sentences: Iterable[str] = sentence_stream(documents)
    sampled = False
    if input_sentence_size:  # read here first: sentencepiece's own sample is not reproducible
        sample, total = sample_sentences(sentences, input_sentence_size, seed)
        sentences, sampled = _drained(sample), total > input_sentence_size

    def counted() -> Iterator[str]:
        nonlocal count
        try:
            for sentence in sentences:
                count += 1
                yield sentence
        except DataError as e:
            failed.append(e)
            raise

    verbose = logger.isEnabledFor(logging.DEBUG)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=counted(),
            model_writer=model,
            model_type=model_type,
            vocab_size=vocab_size,
            pad_id=0, pad_piece=PAD,
            unk_id=1, unk_piece=UNK,
            bos_id=-1, eos_id=-1,
            control_symbols=[CLS, SEP, MASK],
            # A corpus within input_sentence_size goes in whole, as it always did; a larger one's
            # sample (taken above) goes in whole too, so sentencepiece samples nothing.
            input_sentence_size=0 if sampled else input_sentence_size,
            shuffle_input_sentence=not sampled,
            character_coverage=character_coverage,
            byte_fallback=byte_fallback,
            max_sentence_length=MAX_SENTENCE_BYTES,
            num_threads=num_threads,
            minloglevel=0 if verbose else 2,
        )
    except DataError:
        raise  # an empty corpus, raised by the document iterator inside the trainer
    except RuntimeError as e:
        if failed:  # the corpus's own error (a file that is not UTF-8, a truncated archive), as the reader said it
            raise failed[0] from None
        message = str(e)
        if count == 0:
            raise DataError("tokenizer training got no sentences: the corpus is empty; check the inputs") from None
        if "Vocabulary size" in message or "vocab_size" in message:
            raise DataError(
                f"the corpus ({count} sentences) is too small for vocab_size={vocab_size} ({message.strip()}); "
                "lower --vocab-size or add text"
            ) from None
        raise DataError(f"sentencepiece training failed: {message.strip()}; check the corpus and options") from None
    data = model.getvalue()
    sp = spm.SentencePieceProcessor()
    sp.LoadFromSerializedProto(data)
    check_special_ids(sp, out_path)
    write_atomic(out_path, data)
    tokenizer = Tokenizer(out_path)
    logger.info("trained %s tokenizer on %d sentences%s: %s", model_type, count,
                f" (a sample of {total}; input_sentence_size)" if sampled else "", tokenizer)
    return tokenizer
