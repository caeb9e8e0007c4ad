"""Sentencepiece training with BERT special ids: ids, round trip, determinism, errors."""
from __future__ import annotations

import hashlib
import io
import pickle

import pytest
import sentencepiece as spm
from pydoc_data.topics import topics

from vrgd_ds.data_pipeline.corpus import split_sentences
from vrgd_ds.data_pipeline.errors import DataError
from vrgd_ds.data_pipeline.tokenizer import SPECIAL_IDS, Tokenizer, train_tokenizer

# The language reference pages that ship with CPython: real English prose, about 0.5 MB.
DOCUMENTS = [split_sentences(topics[key]) for key in sorted(topics)]
VOCAB = 600


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "sub" / "tok.model"
    train_tokenizer(DOCUMENTS, path, vocab_size=VOCAB, num_threads=2)
    return path


def test_special_ids_and_vocab(model_path):
    tok = Tokenizer.load(model_path)
    assert tok.vocab_size == len(tok) == VOCAB
    assert (tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id) == (0, 1, 2, 3, 4)
    assert [tok.id_to_piece(i) for i in range(5)] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert {p: tok.piece_to_id(p) for p in SPECIAL_IDS} == SPECIAL_IDS


def test_encode_decode_round_trip(model_path):
    tok = Tokenizer.load(model_path)
    text = "The value of the expression is assigned to the target list, and the object is returned."
    ids = tok.encode(text)
    assert ids and all(5 <= i < VOCAB for i in ids)  # no specials, no [UNK] in covered text
    assert tok.decode(ids) == text
    texts = [text, "Exceptions are raised by the interpreter.", ""]
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]


def test_special_strings_in_text_are_not_special(model_path):
    """Control symbols never come out of encode: user text cannot forge [MASK] or [SEP]."""
    tok = Tokenizer.load(model_path)
    ids = tok.encode("a [MASK] b [SEP] c [CLS] [PAD]")
    assert not set(ids) & {0, 2, 3, 4}
    assert tok.decode([2, *tok.encode("hello")]) == tok.decode(tok.encode("hello"))


def test_training_is_deterministic(model_path, tmp_path):
    """Same documents, seed and threads -> byte-identical model; sha256 is that of the file."""
    again = train_tokenizer(DOCUMENTS, tmp_path / "again.model", vocab_size=VOCAB, num_threads=2)
    assert again.path.read_bytes() == model_path.read_bytes()
    assert again.sha256 == hashlib.sha256(model_path.read_bytes()).hexdigest() == Tokenizer.load(model_path).sha256


SAMPLED = """
import sys
from pydoc_data.topics import topics
from vrgd_ds.data_pipeline.corpus import split_sentences
from vrgd_ds.data_pipeline.tokenizer import train_tokenizer
documents = [split_sentences(topics[key]) for key in sorted(topics)][:40]
print(train_tokenizer(documents, sys.argv[1], vocab_size=400, seed=int(sys.argv[2]), input_sentence_size=300,
                      num_threads=1).sha256)
"""


@pytest.mark.exhaustive  # three trainings in processes of their own, about 15 s (make test: the sample, below)
def test_a_sampled_corpus_trains_the_same_model_in_every_process(tmp_path):
    """A corpus larger than ``input_sentence_size`` is trained on a sample; the same documents and
    seed give the same model in another process (another start of ``prepare``, another machine),
    and another seed another sample. Fails on the old code, which left the sample to
    sentencepiece: its generator, whatever ``set_random_generator_seed`` says, drew another sample
    in each process (0.2.3), so two preparations of a Wikipedia-sized corpus gave two vocabularies."""
    import subprocess
    import sys

    def trained(seed: int, name: str) -> str:
        out = subprocess.run([sys.executable, "-c", SAMPLED, str(tmp_path / name), str(seed)], capture_output=True,
                             text=True, check=True)
        return out.stdout.split()[-1]

    first = trained(0, "a.model")
    assert trained(0, "b.model") == first != trained(1, "c.model")


def test_the_sentence_sample_is_uniform_and_reads_the_stream_once():
    """``sample_sentences``: a corpus within the size comes back whole and in order; a larger one
    gives each sentence the same chance (1,000 seeds drawing 10 of 100: every sentence drawn 100
    times in expectation, all within 5 standard deviations), the same sample for the same seed,
    and the number of sentences read."""
    from collections import Counter

    from vrgd_ds.data_pipeline.tokenizer import sample_sentences

    assert sample_sentences(iter(["a", "b"]), 3, 0) == (["a", "b"], 2)
    assert sample_sentences(iter(["a", "b", "c"]), 3, 0) == (["a", "b", "c"], 3)
    drawn = Counter()
    for seed in range(1000):
        sample, total = sample_sentences(iter(map(str, range(100))), 10, seed)
        assert total == 100 and len(set(sample)) == 10
        drawn.update(sample)
    assert sample_sentences(iter(map(str, range(100))), 10, 7) == sample_sentences(iter(map(str, range(100))), 10, 7)
    sd = (1000 * 0.1 * 0.9) ** 0.5
    assert len(drawn) == 100 and all(abs(n - 100) < 5 * sd for n in drawn.values()), sorted(drawn.values())


def test_bpe_and_pickle(tmp_path):
    tok = train_tokenizer(DOCUMENTS[:20], tmp_path / "bpe.model", vocab_size=400, model_type="bpe", num_threads=1)
    assert tok.vocab_size == 400 and tok.id_to_piece(4) == "[MASK]"
    copy = pickle.loads(pickle.dumps(tok))
    text = "The import statement finds modules."
    assert copy.encode(text) == tok.encode(text) and copy.sha256 == tok.sha256


def test_errors(tmp_path):
    with pytest.raises(DataError, match="too small for vocab_size=50000.*--vocab-size"):
        train_tokenizer(DOCUMENTS[:3], tmp_path / "big.model", vocab_size=50000, num_threads=1)
    with pytest.raises(DataError, match="empty"):
        train_tokenizer([[], [""]], tmp_path / "empty.model", vocab_size=300)
    with pytest.raises(DataError, match="model_type='wordpiece'"):
        train_tokenizer(DOCUMENTS, tmp_path / "x.model", model_type="wordpiece")
    with pytest.raises(DataError, match="missing.model does not exist"):
        Tokenizer.load(tmp_path / "missing.model")
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"not a model")
    with pytest.raises(DataError, match="garbage.model is not a sentencepiece model"):
        Tokenizer.load(garbage)
    assert not (tmp_path / "big.model").exists()  # nothing is written on failure


def test_a_corpus_error_met_while_training_is_the_readers_and_bad_options_are_named(tmp_path):
    """A reader's error once sentencepiece is reading (a file not UTF-8 past its first block, a
    truncated archive) is raised as the reader said it; a negative seed or sentence budget, and
    a directory given as the model, are errors naming the option or the path. Before, the first
    came out wrapped in sentencepiece's message with a Python traceback's text in it, and the
    others ended in a TypeError, a ValueError and an IsADirectoryError. Fails on the old code."""
    def documents():
        yield from DOCUMENTS[:20]
        raise DataError("corpus.txt:6001: not UTF-8 text; convert the file to UTF-8 or leave it out of the inputs")

    with pytest.raises(DataError) as raised:
        train_tokenizer(documents(), tmp_path / "t.model", vocab_size=300, num_threads=1)
    assert str(raised.value).startswith("corpus.txt:6001: not UTF-8 text"), raised.value
    with pytest.raises(DataError, match=r"seed=-1: .*--seed 0 or above"):
        train_tokenizer(DOCUMENTS[:20], tmp_path / "t.model", vocab_size=300, seed=-1)
    with pytest.raises(DataError, match=r"input_sentence_size=-5: .*--input-sentence-size 0 or above"):
        train_tokenizer(DOCUMENTS[:20], tmp_path / "t.model", vocab_size=300, input_sentence_size=-5)
    assert not (tmp_path / "t.model").exists()
    with pytest.raises(DataError, match=r"is a directory; pass its \.model file"):
        Tokenizer.load(tmp_path)


def test_special_pieces_as_user_defined_symbols_are_rejected(tmp_path):
    """[CLS]..[MASK] at the right ids but user-defined, not control, symbols: the text's own
    "[SEP]" would encode to the separator. Before, such a model loaded (fails on the old code)."""
    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([s for d in DOCUMENTS[:20] for s in d]), model_writer=buffer, vocab_size=300,
        pad_id=0, pad_piece="[PAD]", unk_id=1, unk_piece="[UNK]", bos_id=-1, eos_id=-1,
        user_defined_symbols=["[CLS]", "[SEP]", "[MASK]"], minloglevel=2)
    path = tmp_path / "user.model"
    path.write_bytes(buffer.getvalue())
    with pytest.raises(DataError, match=r"user\.model: \[CLS\], \[SEP\], \[MASK\] are not control symbols"):
        Tokenizer.load(path)


def test_model_with_other_special_ids_is_rejected(tmp_path):
    """A stock sentencepiece model (<unk>=0, <s>=1, </s>=2) must not be taken for a BERT one."""
    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([s for d in DOCUMENTS[:20] for s in d]), model_writer=buffer,
        vocab_size=300, minloglevel=2)
    path = tmp_path / "stock.model"
    path.write_bytes(buffer.getvalue())
    with pytest.raises(DataError, match=r"stock\.model: special tokens are not at the BERT ids"):
        Tokenizer.load(path)
