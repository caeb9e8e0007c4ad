"""BERT pretraining samples: a sample index built once, materialised and masked lazily.

The packing follows Google's ``create_pretraining_data.py`` (Devlin et al. 2019, "BERT:
Pre-training of Deep Bidirectional Transformers for Language Understanding", §3.1 and
appendix A.1) as used unchanged by NVIDIA's LAMB recipe (DeepLearningExamples
``PyTorch/LanguageModeling/BERT``): consecutive sentences of one document are packed
greedily into a chunk of at most ``max_seq_len - 3`` tokens (three places are taken by
``[CLS] A [SEP] B [SEP]``); with probability ``short_seq_prob`` the target is a random
shorter length so the model also sees short inputs at fine-tuning time; the chunk is cut
into A and B at a random sentence boundary. Unlike the original script, nothing is
tokenised, truncated or masked ahead of time: the index stores only *which* sentences
form each sample, one row per sample, and :class:`BertPretrainingDataset` turns a row into
tensors when it is read. That keeps the index small (eight int64 per sample) and lets
masking be dynamic (Liu et al. 2019, "RoBERTa", §4.1): each epoch sees new masks, drawn
from an RNG keyed by ``(seed, epoch, sample_index)`` so a resumed run, or one on another
world size, sees exactly the same masks as an uninterrupted one. There is therefore no
``dupe_factor``: the static copies it made are replaced by fresh masks per epoch.

Index file (``samples_seq{L}_seed{S}_{nsp|sop|none}.npy``, int64, shape ``(n, 8)``)::

    column  name        meaning
    0       DOC_A       document of segment A
    1       A_BEGIN     first sentence of A in that document
    2       A_END       one past the last sentence of A
    3       DOC_B       document of segment B (another document for a random-next NSP pair)
    4       B_BEGIN     first sentence of B (B_BEGIN == B_END: no segment B)
    5       B_END       one past the last sentence of B
    6       LABEL       next-sentence label: 1 = random next (NSP) / swapped (SOP); 0 else
    7       TRUNC_SEED  seeds the front/back choices when the pair is truncated

A JSON sidecar (same name, ``.json``) records the parameters and the sha256 of the shard
manifest the index was built from; an index whose sidecar does not match the corpus is
rejected, so editing or re-preparing the shards cannot silently pair a stale index with
new token files.

Edge cases (documented choices):

* A chunk of a single sentence (for instance a one-sentence document) has no boundary to
  cut at. With ``next_sentence="nsp"`` it takes a random-next B (label 1), as in Google's
  script; with ``None`` it becomes an A-only sample ``[CLS] A [SEP]``. With ``"sop"`` a
  chunk is not closed while it holds one sentence and its document has more: it takes the
  next sentence too (the pair truncated when read, as any pair over the length), and a chunk
  that would leave its document's last sentence alone takes that one as well; so every chunk
  of a document of two or more sentences is a pair, and a sentence longer than
  ``max_seq_len - 3`` is trained on (truncated) rather than dropped. Only a one-sentence
  document's chunk has no order to predict: it makes no sample, and the build logs (once) how
  many chunks and sentences that leaves out. (The ``"sop"`` sidecar records this rule,
  ``sop_pairs``: an index built before it, which skipped every one-sentence chunk, is rebuilt.)
* Documents without sentences are skipped.
* A pair longer than ``max_seq_len - 3`` tokens (a single long sentence, or the sentence
  that overshoots the target) is truncated when read, by Google's ``truncate_seq_pair``
  rule: tokens are removed from the longer side, each from the front or the back with
  probability 1/2. The split between sides is computed in closed form and the front count
  drawn as a binomial, which has the same distribution as the token-by-token loop but
  costs O(1) for a 100k-token "sentence".
"""
from __future__ import annotations

import errno
import functools
import hashlib
import json
import logging
import os
import pathlib
import socket
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from vrgd_ds.data_pipeline.errors import DataError

logger = logging.getLogger(__name__)

PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = 0, 1, 2, 3, 4
FIRST_ORDINARY_ID = 5
IGNORE_INDEX = -100  # torch.nn.CrossEntropyLoss's default ignore_index
PAD_MULTIPLE = 8  # collate's default: a batch's width is its longest sample's, rounded up to this

# Column layout of the sample index (see the module docstring).
DOC_A, A_BEGIN, A_END, DOC_B, B_BEGIN, B_END, LABEL, TRUNC_SEED = range(8)
NUM_COLUMNS = 8

INDEX_FORMAT_VERSION = 1
NEXT_SENTENCE_TASKS = ("nsp", "sop", None)

# Domain tags keep the RNG streams of index building, truncation and masking apart even
# when the same user seed is given to all of them.
_TAG_INDEX = 0x696E6478  # "indx"
_TAG_MASK = 0x6D61736B  # "mask"


class TokenCorpus(Protocol):
    """What this module reads from a corpus (``vrgd_ds.data_pipeline.shards.ShardedCorpus``)."""

    num_documents: int
    vocab_size: int
    manifest: dict
    path: pathlib.Path

    def document(self, i: int) -> list[np.ndarray]: ...

    def span(self, i: int, begin: int, end: int) -> np.ndarray: ...

    def sentence_lengths(self, i: int) -> np.ndarray: ...


def corpus_identity(corpus: TokenCorpus) -> str:
    """sha256 identifying the corpus contents: of ``manifest.json`` in ``corpus.path``.

    The manifest lists every shard with its checksum, so its hash changes whenever any token
    file does. A corpus without a manifest file on disk is identified by the canonical JSON
    of ``corpus.manifest`` instead.
    """
    path = pathlib.Path(corpus.path) / "manifest.json"
    if path.is_file():
        return hashlib.sha256(path.read_bytes()).hexdigest()
    blob = json.dumps(corpus.manifest, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


@functools.cache  # the same for the process: every checkpoint's marker records it
def generator_streams() -> str:
    """16 hex digits of what numpy's ``Generator`` draws, from fixed seeds, in the calls the sample
    streams make at read time (the sampler's ``permutation``; the masking's ``choice`` without
    replacement, ``random`` and ``integers``). The same seed gives the same draws within a numpy
    release only (NEP 19): a resume compares it with its checkpoint's, since another release would
    put the rest of an epoch in another order, repeating some samples and skipping others."""
    rng = np.random.default_rng([_TAG_INDEX, _TAG_MASK, 1])
    draws = (rng.permutation(1000), rng.choice(np.arange(5, 517), size=77, replace=False), rng.random(33),
             rng.integers(5, 30522, size=33))
    digest = hashlib.sha256()
    for d in draws:
        digest.update(np.ascontiguousarray(d, dtype=np.float64 if d.dtype.kind == "f" else np.int64).tobytes())
    return digest.hexdigest()[:16]


#: BERT's probability of a shorter target length, the sample builder's default
SHORT_SEQ_PROB = 0.1


def index_filename(max_seq_len: int, seed: int, next_sentence: str | None,
                   short_seq_prob: float = SHORT_SEQ_PROB) -> str:
    """``samples_seq128_seed42_nsp.npy`` — the name says what the index was built with (another
    ``short_seq_prob`` than BERT's too: ``..._nsp_short0.5.npy``, which a job's index, built with
    the default, then leaves alone)."""
    short = "" if short_seq_prob == SHORT_SEQ_PROB else f"_short{short_seq_prob:g}"
    return f"samples_seq{max_seq_len}_seed{seed}_{next_sentence or 'none'}{short}.npy"


def _sidecar(index_path: pathlib.Path) -> pathlib.Path:
    return index_path.with_suffix(".json")


def check_build_args(max_seq_len: int, seed: int, short_seq_prob: float = SHORT_SEQ_PROB,
                     next_sentence: str | None = None) -> None:
    """``build_sample_index``'s arguments, checked (``prepare`` asks before any work)."""
    if next_sentence not in NEXT_SENTENCE_TASKS:
        raise DataError(
            f"next_sentence={next_sentence!r} is not one of 'nsp', 'sop' or None; "
            "pick one of those")
    if not isinstance(max_seq_len, int) or max_seq_len < 5:
        raise DataError(
            f"max_seq_len={max_seq_len!r} leaves no room for tokens after [CLS] A [SEP] B "
            "[SEP]; use an int >= 5 (BERT uses 128 and 512)")
    if not isinstance(seed, int) or seed < 0:
        raise DataError(f"seed={seed!r} must be a non-negative int")
    if not 0.0 <= short_seq_prob <= 1.0:
        raise DataError(f"short_seq_prob={short_seq_prob!r} must lie in [0, 1] (BERT uses 0.1)")


def _build_rows(corpus: TokenCorpus, max_seq_len: int, seed: int, short_seq_prob: float,
                next_sentence: str | None) -> np.ndarray:
    """The rows of the index; the loop of Google's ``create_instances_from_document``.

    Each document draws from its own RNG keyed by ``(seed, document)``, so a document's
    samples do not depend on the documents before it and the build could be split by
    document without changing the result. The short target length is drawn per chunk;
    Google's script draws it once per document, which makes every chunk of a long document
    short together, whereas per chunk about ``short_seq_prob`` of the samples are short, as
    the paper describes.
    """
    max_tokens = max_seq_len - 3
    num_docs = corpus.num_documents
    # Sentence lengths are read per document when needed (a random-next B reads another
    # document's), so memory stays O(documents) rather than O(sentences).
    def lengths(d: int) -> np.ndarray:
        return np.asarray(corpus.sentence_lengths(d), dtype=np.int64)

    nonempty = np.flatnonzero([len(corpus.sentence_lengths(d)) > 0 for d in range(num_docs)])
    if next_sentence == "nsp" and len(nonempty) < 2:
        raise DataError(
            f"next_sentence='nsp' needs at least two non-empty documents to draw a random "
            f"next sentence from, but the corpus at {corpus.path} has {len(nonempty)}; use "
            "next_sentence=None or 'sop', or prepare a larger corpus")
    rows: list[tuple[int, ...]] = []
    skipped = 0  # SOP: one-sentence documents, each a chunk of one sentence
    for doc in nonempty.tolist():
        lens = lengths(doc)
        rng = np.random.default_rng([seed, _TAG_INDEX, doc])
        target = max_tokens
        if rng.random() < short_seq_prob:
            target = int(rng.integers(2, max_tokens + 1))
        chunk_begin, chunk_tokens, i = 0, 0, 0
        while i < len(lens):
            chunk_tokens += int(lens[i])
            close = i == len(lens) - 1 or chunk_tokens >= target
            if close and next_sentence == "sop" and i < len(lens) - 1 and (i == chunk_begin or i == len(lens) - 2):
                # SOP orders two segments: a chunk of one sentence takes the next, and one that
                # would leave the document's last sentence alone takes it (module docstring)
                close = False
            if close:
                begin, end = chunk_begin, i + 1
                n = end - begin
                a_end = begin + (int(rng.integers(1, n)) if n >= 2 else 1)
                trunc_seed = int(rng.integers(0, 2**63 - 1))
                row = None
                if next_sentence == "nsp" and (n == 1 or rng.random() < 0.5):
                    # Random next: B comes from another document, filled up to what A
                    # leaves of the target, and the chunk's unused sentences are handed
                    # back to the loop (Google's "num_unused_segments").
                    a_tokens = int(lens[begin:a_end].sum())
                    target_b = max(1, target - a_tokens)
                    # Uniform over the other non-empty documents (Google retries up to
                    # 10 times for one that differs; this draws one that does directly).
                    pick = int(rng.integers(0, len(nonempty) - 1))
                    pick += pick >= int(np.searchsorted(nonempty, doc))
                    other = int(nonempty[pick])
                    other_lens = lengths(other)
                    b_begin = int(rng.integers(0, len(other_lens)))
                    cum = np.cumsum(other_lens[b_begin:])
                    b_end = b_begin + min(int(np.searchsorted(cum, target_b)) + 1, len(cum))
                    row = (doc, begin, a_end, other, b_begin, b_end, 1, trunc_seed)
                    i = a_end - 1  # the loop's i += 1 resumes right after A
                if row is None:
                    if next_sentence == "sop" and n == 1:
                        skipped += 1  # a one-sentence document: nothing to order (module docstring)
                    elif next_sentence == "sop" and rng.random() < 0.5:
                        row = (doc, a_end, end, doc, begin, a_end, 1, trunc_seed)
                    else:
                        row = (doc, begin, a_end, doc, a_end, end, 0, trunc_seed)
                if row is not None:
                    rows.append(row)
                chunk_begin, chunk_tokens = i + 1, 0
                target = max_tokens
                if rng.random() < short_seq_prob:
                    target = int(rng.integers(2, max_tokens + 1))
            i += 1
    if skipped:
        total = getattr(corpus, "num_sentences", None)  # a shard set's manifest holds it: no pass over the documents
        if total is None:
            total = sum(len(corpus.sentence_lengths(d)) for d in range(num_docs))
        logger.warning("next_sentence='sop': %d chunks (%d sentences of %d, the documents of one sentence) have no "
                       "sentence order to predict and make no sample of %s", skipped, skipped, total, corpus.path)
    return np.asarray(rows, dtype=np.int64).reshape(-1, NUM_COLUMNS)


def _index_meta(corpus: TokenCorpus, max_seq_len: int, seed: int, short_seq_prob: float,
                next_sentence: str | None) -> dict[str, Any]:
    """What an index's sidecar records of how it was built (``num_samples`` aside)."""
    return {
        "format_version": INDEX_FORMAT_VERSION,
        "columns": ["doc_a", "a_begin", "a_end", "doc_b", "b_begin", "b_end", "label",
                    "trunc_seed"],
        "max_seq_len": max_seq_len,
        "seed": seed,
        "short_seq_prob": short_seq_prob,
        "next_sentence": next_sentence,
        "manifest_sha256": corpus_identity(corpus),
        # SOP's chunks hold two sentences wherever the document has them (module docstring); an
        # index without this key skipped every one-sentence chunk and is rebuilt
        **({"sop_pairs": "two sentences at least"} if next_sentence == "sop" else {}),
    }


def _current_rows(path: pathlib.Path, meta: dict[str, Any]) -> int | None:
    """The rows of the index at ``path`` where its sidecar records ``meta`` and the file holds
    them; else None (missing, stale or cut short)."""
    sidecar = _sidecar(path)
    if not (path.is_file() and sidecar.is_file()):
        return None
    try:
        old = json.loads(sidecar.read_text())
    except (OSError, ValueError):
        return None
    if {k: old.get(k) for k in meta} != meta:
        return None
    rows = old.get("num_samples")
    try:
        return rows if np.load(path, mmap_mode="r").shape == (rows, NUM_COLUMNS) else None
    except (OSError, ValueError):
        return None


def index_is_current(corpus: TokenCorpus, path: str | os.PathLike, max_seq_len: int, seed: int, *,
                     short_seq_prob: float = SHORT_SEQ_PROB, next_sentence: str | None = None) -> bool:
    """Whether the index at ``path`` is the one ``build_sample_index`` would build with these
    arguments (and so reuse)."""
    meta = _index_meta(corpus, max_seq_len, seed, short_seq_prob, next_sentence)
    return _current_rows(pathlib.Path(path), meta) is not None


def build_sample_index(corpus: TokenCorpus, max_seq_len: int, seed: int,
                       out_dir: str | os.PathLike | None = None, *,
                       short_seq_prob: float = SHORT_SEQ_PROB,
                       next_sentence: str | None = None) -> pathlib.Path:
    """Build (or reuse) the sample index of ``corpus`` and return its path.

    The index is written to ``out_dir`` (default: the shard directory ``corpus.path``) as
    ``samples_seq{max_seq_len}_seed{seed}_{next_sentence or 'none'}.npy`` with its JSON
    sidecar, atomically (temporary file + ``os.replace``, the temporary file removed on an
    error), so a crash never leaves a half-written index behind a valid name; a failed write is
    a ``DataError`` naming the file. An existing index whose sidecar matches the
    corpus and the arguments is reused; anything else is rebuilt. The result is a pure
    function of the corpus contents and the arguments. In a multi-process job, build on
    one rank and let the others wait at a barrier before opening the index.

    Args:
        corpus: the sharded corpus (``ShardedCorpus`` or anything with the same attributes).
        max_seq_len: model sequence length, including ``[CLS]`` and both ``[SEP]``.
        seed: seeds the packing, the A/B cut, NSP/SOP draws and truncation choices.
        out_dir: directory for the index; ``None`` puts it next to the shards.
        short_seq_prob: probability of a random shorter target length (BERT: 0.1).
        next_sentence: ``"nsp"`` (BERT's next sentence prediction), ``"sop"`` (ALBERT's
            sentence order prediction) or ``None`` (MLM only, as RoBERTa).
    """
    check_build_args(max_seq_len, seed, short_seq_prob, next_sentence)
    out = pathlib.Path(corpus.path if out_dir is None else out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot create the sample index directory {out} ({e.strerror or e}); check its "
                        "permissions, or pass another out_dir") from e
    path = out / index_filename(max_seq_len, seed, next_sentence, short_seq_prob)
    meta = _index_meta(corpus, max_seq_len, seed, short_seq_prob, next_sentence)
    sidecar = _sidecar(path)
    old_rows = _current_rows(path, meta)
    if old_rows is not None:
        logger.info("reusing sample index %s (%d samples)", path, old_rows)
        return path

    rows = _build_rows(corpus, max_seq_len, seed, short_seq_prob, next_sentence)
    if len(rows) == 0:
        raise DataError(
            f"the corpus at {corpus.path} yields no samples for max_seq_len={max_seq_len}, "
            f"next_sentence={next_sentence!r} (empty documents, or only one-sentence "
            "documents with 'sop'); prepare more text or use next_sentence=None")
    meta["num_samples"] = int(len(rows))
    # The .npy goes first and the sidecar last: a sidecar never vouches for a file that
    # is not yet in place, and a crash in between leaves a sidecar mismatch -> rebuild.
    # Each file through a temporary name of this host and process (a writer on another node may have
    # this pid), removed on an error: atomic_file.
    from vrgd_ds.data_pipeline.tokenizer import atomic_file  # the sentencepiece wrapper, imported when writing

    here = f"{socket.gethostname()}.{os.getpid()}"
    for target, write in ((path, lambda f: np.save(f, rows)),
                          (sidecar, lambda f: f.write((json.dumps(meta, indent=2, sort_keys=True) + "\n").encode()))):
        try:
            with atomic_file(target, target.with_name(f".{target.name}.tmp.{here}")) as f:
                write(f)
        except OSError as e:
            hint = "free disk space there" if e.errno == errno.ENOSPC else "check the directory's permissions and space"
            raise DataError(f"writing sample index file {target} failed ({e.strerror or e}); {hint} and build it "
                            "again (an index without its sidecar is rebuilt, never read)") from e
    logger.info("wrote sample index %s: %d samples from %d documents", path, len(rows),
                corpus.num_documents)
    return path


def load_sample_index(corpus: TokenCorpus, index_path: str | os.PathLike,
                      max_seq_len: int) -> tuple[np.ndarray, dict[str, Any]]:
    """Open an index memory-mapped after checking its sidecar against corpus and seq len."""
    path = pathlib.Path(index_path)
    sidecar = _sidecar(path)
    rebuild = ("rebuild it with vrgd_ds.data_pipeline.samples.build_sample_index(corpus, "
               f"{max_seq_len}, seed, ...), which replaces an index that does not match")
    if not path.is_file() or not sidecar.is_file():
        raise DataError(f"sample index {path} or its sidecar {sidecar} is missing; {rebuild}")
    try:
        meta = json.loads(sidecar.read_text())
        rows = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as e:
        raise DataError(f"sample index {path} cannot be read ({e}); {rebuild}") from e
    if meta.get("format_version") != INDEX_FORMAT_VERSION:
        raise DataError(f"sample index {path} has format {meta.get('format_version')!r}, "
                        f"this code reads {INDEX_FORMAT_VERSION}; {rebuild}")
    if meta.get("manifest_sha256") != corpus_identity(corpus):
        on_disk = pathlib.Path(corpus.path) / "manifest.json"
        if isinstance(getattr(corpus, "manifest", None), dict) and "shards" in corpus.manifest and not on_disk.is_file():
            # shards whose manifest went missing since they were opened: being written again (or moved)
            raise DataError(f"{on_disk} is missing (the shards being written again, or moved), so sample index {path} "
                            "cannot be checked against them; start again once the shards are complete")
        raise DataError(
            f"sample index {path} is stale: it was built from a different corpus than the "
            f"one at {corpus.path} (manifest sha256 differs); {rebuild}")
    if meta.get("max_seq_len") != max_seq_len:
        raise DataError(
            f"sample index {path} was built for max_seq_len={meta.get('max_seq_len')}, not "
            f"{max_seq_len}; pass the matching index or {rebuild}")
    if rows.dtype != np.int64 or rows.ndim != 2 or rows.shape != (meta.get("num_samples"),
                                                                  NUM_COLUMNS):
        raise DataError(f"sample index {path} has shape {rows.shape} / dtype {rows.dtype}, "
                        f"its sidecar promises ({meta.get('num_samples')}, {NUM_COLUMNS}) "
                        f"int64; {rebuild}")
    return rows, meta


def truncate_lengths(len_a: int, len_b: int, max_tokens: int,
                     rng: np.random.Generator) -> tuple[tuple[int, int], tuple[int, int]]:
    """How many tokens to cut from (front, back) of A and of B to fit ``max_tokens``.

    Google's ``truncate_seq_pair`` removes one token at a time from the longer side (B on a
    tie), from the front or the back with probability 1/2. In closed form: the longer side
    first loses the difference, the rest alternates starting with B, and the front count of
    each side is Binomial(cut, 1/2).
    """
    excess = len_a + len_b - max_tokens
    if excess <= 0:
        return (0, 0), (0, 0)
    cut_a = cut_b = 0
    if len_a > len_b:
        cut_a = min(excess, len_a - len_b)
    else:
        cut_b = min(excess, len_b - len_a)
    rest = excess - cut_a - cut_b
    cut_b += (rest + 1) // 2
    cut_a += rest // 2
    front_a = int(rng.binomial(cut_a, 0.5)) if cut_a else 0
    front_b = int(rng.binomial(cut_b, 0.5)) if cut_b else 0
    return (front_a, cut_a - front_a), (front_b, cut_b - front_b)


class BertPretrainingDataset(torch.utils.data.Dataset):
    """BERT pretraining samples with dynamic masking, read by ``(epoch, sample_index)``.

    A sample is ``[CLS] A [SEP] B [SEP]`` (``[CLS] A [SEP]`` without B) with
    ``token_type_ids`` 0 up to and including the first ``[SEP]`` and 1 after it. Masked LM
    follows BERT §3.1: of the candidate positions — ordinary tokens only (id >= 5), so
    ``[CLS]``, ``[SEP]``, ``[PAD]``, ``[MASK]`` and ``[UNK]`` are never predicted; an
    ``[UNK]`` target teaches nothing — ``k = max(1, round(mlm_probability × candidates))``
    are predicted (Google's ``create_masked_lm_predictions``, Python ``round``; 0 when there
    is no candidate), chosen uniformly without replacement. Each predicted position is
    replaced by ``[MASK]`` with probability ``mask_token_prob`` (0.8), by a uniformly random
    ordinary token (ids ``5..vocab_size-1``, never a special token) with probability
    ``random_token_prob`` (0.1), and kept otherwise (0.1) — the 80/10/10 rule that keeps the
    model from learning that only ``[MASK]`` positions matter. ``labels`` holds the original
    token there and -100 elsewhere. No ``max_predictions_per_seq`` cap is applied: labels
    are dense, so the cap Google needed for its fixed-size TFRecord fields has no purpose.

    The masking RNG is ``numpy.random.default_rng([seed, "mask", epoch, sample_index])``:
    the masks depend on nothing but the key, so any sampler order, resume point, world size
    or worker count yields the same masks, while a new epoch draws new ones.

    Args:
        corpus: the sharded corpus the index was built from.
        index_path: path returned by :func:`build_sample_index`; its sidecar must match.
        max_seq_len: sequence length the index was built for.
        seed: masking seed (independent of the index's seed).
        mlm_probability: fraction of candidate tokens predicted (BERT: 0.15).
        mask_token_prob: of those, fraction replaced by ``[MASK]`` (BERT: 0.8).
        random_token_prob: of those, fraction replaced by a random token (BERT: 0.1).
        vocab_size: size of the vocabulary random tokens come from; default
            ``corpus.vocab_size``.
    """

    def __init__(self, corpus: TokenCorpus, index_path: str | os.PathLike, max_seq_len: int,
                 *, seed: int, mlm_probability: float = 0.15, mask_token_prob: float = 0.8,
                 random_token_prob: float = 0.1, vocab_size: int | None = None):
        if not 0.0 < mlm_probability <= 1.0:
            raise DataError(f"mlm_probability={mlm_probability!r} must lie in (0, 1] "
                            "(BERT uses 0.15)")
        if mask_token_prob < 0 or random_token_prob < 0 or \
                mask_token_prob + random_token_prob > 1.0:
            raise DataError(
                f"mask_token_prob={mask_token_prob!r} and random_token_prob="
                f"{random_token_prob!r} must be >= 0 with a sum <= 1 (BERT uses 0.8 and 0.1)")
        if not isinstance(seed, int) or seed < 0:
            raise DataError(f"seed={seed!r} must be a non-negative int")
        vocab_size = corpus.vocab_size if vocab_size is None else vocab_size
        if vocab_size <= FIRST_ORDINARY_ID:
            raise DataError(f"vocab_size={vocab_size} has no ordinary tokens (ids >= "
                            f"{FIRST_ORDINARY_ID}); train a larger tokenizer")
        self.corpus = corpus
        self.index_path = pathlib.Path(index_path)
        self.max_seq_len = max_seq_len
        self.seed = seed
        self.mlm_probability = mlm_probability
        self.mask_token_prob = mask_token_prob
        self.random_token_prob = random_token_prob
        self.vocab_size = vocab_size
        self._rows, meta = load_sample_index(corpus, self.index_path, max_seq_len)
        self.next_sentence: str | None = meta["next_sentence"]

    # The memory-mapped index is reopened in each DataLoader worker rather than pickled
    # (pickling a memmap copies the whole array into every worker).
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_rows"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._rows, _ = load_sample_index(self.corpus, self.index_path, self.max_seq_len)

    def __len__(self) -> int:
        return len(self._rows)

    def _segment(self, doc: int, begin: int, end: int) -> np.ndarray:
        if begin == end:
            return np.empty(0, dtype=np.int64)
        return np.array(self.corpus.span(int(doc), int(begin), int(end)), dtype=np.int64)

    def tokens(self, sample_index: int) -> tuple[np.ndarray, np.ndarray, int]:
        """Unmasked ``input_ids``, ``token_type_ids`` and next-sentence label of a sample."""
        row = self._rows[sample_index]
        a = self._segment(row[DOC_A], row[A_BEGIN], row[A_END])
        b = self._segment(row[DOC_B], row[B_BEGIN], row[B_END])
        has_b = row[B_BEGIN] != row[B_END]
        max_tokens = self.max_seq_len - (3 if has_b else 2)
        if len(a) + len(b) > max_tokens:  # the generator only when it draws (its seeding costs ~6 us)
            (fa, ba), (fb, bb) = truncate_lengths(
                len(a), len(b), max_tokens, np.random.default_rng(int(row[TRUNC_SEED])))
        else:
            fa = ba = fb = bb = 0
        a = a[fa:len(a) - ba]
        b = b[fb:len(b) - bb]
        parts = [[CLS_ID], a, [SEP_ID]] + ([b, [SEP_ID]] if has_b else [])
        ids = np.concatenate(parts).astype(np.int64)
        types = np.zeros(len(ids), dtype=np.int64)
        types[len(a) + 2:] = 1
        return ids, types, int(row[LABEL])

    def mask(self, ids: np.ndarray, epoch: int, sample_index: int) -> tuple[np.ndarray,
                                                                              np.ndarray]:
        """Dynamic 80/10/10 masking of ``ids`` keyed by ``(seed, epoch, sample_index)``."""
        rng = np.random.default_rng([self.seed, _TAG_MASK, int(epoch), int(sample_index)])
        candidates = np.flatnonzero(ids >= FIRST_ORDINARY_ID)
        labels = np.full(len(ids), IGNORE_INDEX, dtype=np.int64)
        inputs = ids.copy()
        if len(candidates) == 0:
            return inputs, labels
        k = max(1, int(round(len(candidates) * self.mlm_probability)))
        chosen = np.sort(rng.choice(candidates, size=k, replace=False))
        labels[chosen] = ids[chosen]
        u = rng.random(k)
        to_mask = u < self.mask_token_prob
        to_random = (u >= self.mask_token_prob) & \
            (u < self.mask_token_prob + self.random_token_prob)
        inputs[chosen[to_mask]] = MASK_ID
        inputs[chosen[to_random]] = rng.integers(
            FIRST_ORDINARY_ID, self.vocab_size, size=int(to_random.sum()))
        return inputs, labels

    def __getitem__(self, key: tuple[int, int]) -> dict[str, torch.Tensor]:
        try:
            epoch, sample_index = key
        except (TypeError, ValueError):
            raise DataError(
                f"BertPretrainingDataset is indexed by (epoch, sample_index), got {key!r}; "
                "use vrgd_ds.data_pipeline.sampler.PretrainingSampler as the batch_sampler") from None
        if not 0 <= sample_index < len(self._rows):
            raise IndexError(f"sample_index {sample_index} out of range [0, {len(self._rows)})")
        ids, types, label = self.tokens(sample_index)
        inputs, labels = self.mask(ids, epoch, sample_index)
        out = {
            "input_ids": torch.from_numpy(inputs),
            "token_type_ids": torch.from_numpy(types),
            "attention_mask": torch.ones(len(ids), dtype=torch.long),
            "labels": torch.from_numpy(labels),
        }
        if self.next_sentence is not None:
            out["next_sentence_label"] = torch.tensor(label, dtype=torch.long)
        return out


def padded_length(length: int, pad_to_multiple_of: int | None = PAD_MULTIPLE) -> int:
    """The width ``collate`` gives a batch whose longest sample has ``length`` tokens."""
    return -(-length // pad_to_multiple_of) * pad_to_multiple_of if pad_to_multiple_of else length


def collate(batch: Sequence[dict[str, torch.Tensor]],
            pad_to_multiple_of: int | None = PAD_MULTIPLE) -> dict[str, torch.Tensor]:
    """Stack samples, padding to the longest one rounded up to ``pad_to_multiple_of``.

    Padding is ``[PAD]`` (0) in ``input_ids`` and ``token_type_ids``, 0 in
    ``attention_mask`` and -100 in ``labels``. A multiple of 8 keeps fp16/bf16 matmuls on
    tensor-core shapes.
    """
    if not batch:
        raise DataError("collate got an empty batch; check the sampler's micro_batch_size")
    longest = padded_length(max(len(s["input_ids"]) for s in batch), pad_to_multiple_of)
    fill = {"input_ids": PAD_ID, "token_type_ids": 0, "attention_mask": 0,
            "labels": IGNORE_INDEX}
    out = {}
    for name, value in fill.items():  # rows copied as numpy views: a torch slice per row costs ~3 us
        t = np.full((len(batch), longest), value, dtype=np.int64)
        for row, sample in enumerate(batch):
            v = sample[name].numpy()
            t[row, :len(v)] = v
        out[name] = torch.from_numpy(t)
    if "next_sentence_label" in batch[0]:
        out["next_sentence_label"] = torch.stack([s["next_sentence_label"] for s in batch])
    return out
