"""Sample index and dynamic masking: packing, layout, staleness, NSP/SOP, 80/10/10."""
import hashlib
import json
import math
import os
import pathlib
import pickle

import numpy as np
import pytest
import torch

from vrgd_ds.data_pipeline import samples as S
from vrgd_ds.data_pipeline.errors import DataError
from vrgd_ds.data_pipeline.sampler import PretrainingSampler


class FakeCorpus:
    """In-memory corpus with ShardedCorpus's attributes; writes a manifest.json to `path`."""

    def __init__(self, docs, path, vocab_size=1000):
        self.docs = [[np.asarray(s, dtype=np.uint16) for s in d] for d in docs]
        self.path = pathlib.Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.vocab_size = vocab_size
        self.dtype = np.dtype(np.uint16)
        self.num_documents = len(self.docs)
        self.num_sentences = sum(len(d) for d in self.docs)
        self.num_tokens = sum(len(s) for d in self.docs for s in d)
        self.tokenizer_sha256 = "0" * 64
        digest = hashlib.sha256(b"".join(s.tobytes() for d in self.docs for s in d))
        self.manifest = {"num_documents": self.num_documents, "sha256": digest.hexdigest()}
        (self.path / "manifest.json").write_text(json.dumps(self.manifest))

    def __len__(self):
        return self.num_documents

    def document(self, i):
        return list(self.docs[i])

    def span(self, i, begin, end):
        return np.concatenate(self.docs[i][begin:end] or [np.zeros(0, np.uint16)])

    def sentence_lengths(self, i):
        return np.array([len(s) for s in self.docs[i]], dtype=np.int64)


def random_docs(rng, num_docs=40, max_sentences=12, max_len=30, unk_rate=0.02, vocab=1000,
                long_every=0):
    """Documents of ordinary tokens with some [UNK]s; optionally some over-long sentences."""
    docs = []
    for d in range(num_docs):
        doc = []
        for s in range(int(rng.integers(1, max_sentences + 1))):
            n = int(rng.integers(1, max_len + 1))
            if long_every and (d * 31 + s) % long_every == 0:
                n = int(rng.integers(200, 400))
            toks = rng.integers(S.FIRST_ORDINARY_ID, vocab, size=n)
            toks[rng.random(n) < unk_rate] = S.UNK_ID
            doc.append(toks)
        docs.append(doc)
    return docs


@pytest.fixture
def corpus(tmp_path):
    return FakeCorpus(random_docs(np.random.default_rng(0), long_every=17), tmp_path / "c")


def sentences(corpus, doc, begin, end):
    return np.concatenate([np.empty(0, np.int64)] +
                          [s.astype(np.int64) for s in corpus.document(doc)[begin:end]])


def is_substring(part, whole):
    n = len(part)
    return any(np.array_equal(whole[i:i + n], part) for i in range(len(whole) - n + 1))


@pytest.mark.parametrize("next_sentence", [None, "nsp", "sop"])
@pytest.mark.parametrize("max_seq_len", [16, 64])
def test_layout_segments_and_truncation(corpus, tmp_path, next_sentence, max_seq_len):
    """Every sample fits max_seq_len, is [CLS] A [SEP] (B [SEP]) with segment ids 0 then 1,
    and A, B are the indexed sentences, whole when they fit and a contiguous piece when
    truncated (which the long sentences force)."""
    path = S.build_sample_index(corpus, max_seq_len, 1, tmp_path / "idx",
                                next_sentence=next_sentence)
    ds = S.BertPretrainingDataset(corpus, path, max_seq_len, seed=0)
    rows = np.load(path)
    truncated = 0
    for i, row in enumerate(rows):
        ids, types, label = ds.tokens(i)
        assert len(ids) <= max_seq_len
        a = sentences(corpus, row[S.DOC_A], row[S.A_BEGIN], row[S.A_END])
        b = sentences(corpus, row[S.DOC_B], row[S.B_BEGIN], row[S.B_END])
        assert ids[0] == S.CLS_ID and ids[-1] == S.SEP_ID
        seps = np.flatnonzero(ids == S.SEP_ID)
        has_b = row[S.B_BEGIN] != row[S.B_END]
        assert len(seps) == (2 if has_b else 1)
        got_a = ids[1:seps[0]]
        got_b = ids[seps[0] + 1:-1] if has_b else ids[:0]
        assert len(got_a) > 0 and (len(got_b) > 0) == has_b
        np.testing.assert_array_equal(types, (np.arange(len(ids)) > seps[0]).astype(np.int64))
        if len(a) + len(b) + 2 + has_b <= max_seq_len:
            np.testing.assert_array_equal(got_a, a)
            np.testing.assert_array_equal(got_b, b)
        else:
            truncated += 1
            assert len(ids) == max_seq_len
            assert is_substring(got_a, a) and is_substring(got_b, b)
        assert label == int(row[S.LABEL])
    assert truncated > 0


def google_truncate(len_a, len_b, max_tokens):
    """Lengths left by Google's token-by-token truncate_seq_pair (ties cut B)."""
    while len_a + len_b > max_tokens:
        if len_a > len_b:
            len_a -= 1
        else:
            len_b -= 1
    return len_a, len_b


def test_truncation_matches_googles_loop_in_lengths_and_is_fair_front_back():
    rng = np.random.default_rng(0)
    fronts = []
    for la in range(0, 30):
        for lb in range(0, 30):
            (fa, ba), (fb, bb) = S.truncate_lengths(la, lb, 20, rng)
            assert (la - fa - ba, lb - fb - bb) == google_truncate(la, lb, 20)
            assert min(fa, ba, fb, bb) >= 0
            fronts += [fa / (fa + ba)] if fa + ba else []
    # front share of each cut is Binomial(cut, 1/2) / cut: its mean is 1/2
    assert abs(np.mean(fronts) - 0.5) < 5 * 0.5 / math.sqrt(len(fronts))


def test_packing_is_greedy_and_covers_each_document_once(corpus, tmp_path):
    """Without NSP, chunks tile each document in order; a chunk stops at the first sentence
    that reaches the target, so all but its last sentence stay under max_seq_len - 3."""
    max_seq_len = 64
    rows = np.load(S.build_sample_index(corpus, max_seq_len, 3, tmp_path, short_seq_prob=0.0))
    assert (rows[:, S.DOC_A] == rows[:, S.DOC_B]).all() and (rows[:, S.LABEL] == 0).all()
    assert (rows[:, S.A_END] == rows[:, S.B_BEGIN]).all()
    assert (rows[:, S.A_END] > rows[:, S.A_BEGIN]).all()
    for doc in range(corpus.num_documents):
        mine = rows[rows[:, S.DOC_A] == doc]
        bounds = [(r[S.A_BEGIN], r[S.B_END]) for r in mine]
        assert bounds[0][0] == 0 and bounds[-1][1] == len(corpus.document(doc))
        assert all(bounds[j][1] == bounds[j + 1][0] for j in range(len(bounds) - 1))
        lens = corpus.sentence_lengths(doc)
        for begin, end in bounds:
            assert lens[begin:end - 1].sum() < max_seq_len - 3
            if end < len(lens):
                assert lens[begin:end].sum() >= max_seq_len - 3


def test_short_seq_prob_yields_short_targets(tmp_path):
    """With short_seq_prob=1 every chunk has a random target in [2, max_seq_len - 3], so
    chunks of equal 4-token sentences hold fewer than the 12 that fill 48 tokens."""
    docs = [[np.full(4, 7)] * 60 for _ in range(10)]
    corpus = FakeCorpus(docs, tmp_path / "c")
    full = np.load(S.build_sample_index(corpus, 51, 0, tmp_path / "a", short_seq_prob=0.0))
    short = np.load(S.build_sample_index(corpus, 51, 0, tmp_path / "b", short_seq_prob=1.0))
    sizes_full = full[:, S.B_END] - full[:, S.A_BEGIN]
    sizes_short = short[:, S.B_END] - short[:, S.A_BEGIN]
    assert (sizes_full == 12).all()
    assert sizes_short.mean() < 9 and sizes_short.min() >= 1


def test_index_is_deterministic_and_depends_on_seed(corpus, tmp_path):
    a = np.load(S.build_sample_index(corpus, 64, 5, tmp_path / "a", next_sentence="nsp"))
    b = np.load(S.build_sample_index(corpus, 64, 5, tmp_path / "b", next_sentence="nsp"))
    c = np.load(S.build_sample_index(corpus, 64, 6, tmp_path / "c", next_sentence="nsp"))
    np.testing.assert_array_equal(a, b)
    assert a.shape != c.shape or not np.array_equal(a, c)


def test_index_name_location_sidecar_and_reuse(corpus):
    path = S.build_sample_index(corpus, 128, 42, None, next_sentence="sop")
    assert path == corpus.path / "samples_seq128_seed42_sop.npy"
    meta = json.loads(path.with_suffix(".json").read_text())
    assert meta["manifest_sha256"] == hashlib.sha256(
        (corpus.path / "manifest.json").read_bytes()).hexdigest()
    assert meta["num_samples"] == len(np.load(path)) and meta["next_sentence"] == "sop"
    assert not [p for p in corpus.path.iterdir() if ".tmp" in p.name]
    stamp = path.stat().st_mtime_ns
    os.utime(path, ns=(stamp - 10**9, stamp - 10**9))
    assert S.build_sample_index(corpus, 128, 42, None, next_sentence="sop") == path
    assert path.stat().st_mtime_ns == stamp - 10**9  # reused, not rewritten


def test_stale_index_is_rejected_and_rebuilt(corpus, tmp_path):
    path = S.build_sample_index(corpus, 64, 0, tmp_path)
    with pytest.raises(DataError, match="max_seq_len=64, not 128"):
        S.BertPretrainingDataset(corpus, path, 128, seed=0)
    changed = FakeCorpus([d[::-1] for d in corpus.docs], corpus.path)  # new manifest.json
    with pytest.raises(DataError, match="stale") as err:
        S.BertPretrainingDataset(changed, path, 64, seed=0)
    assert str(path) in str(err.value) and "build_sample_index" in str(err.value)
    rebuilt = S.build_sample_index(changed, 64, 0, tmp_path)
    assert rebuilt == path
    assert len(S.BertPretrainingDataset(changed, path, 64, seed=0)) > 0
    path.with_suffix(".json").unlink()
    with pytest.raises(DataError, match="sidecar"):
        S.BertPretrainingDataset(changed, path, 64, seed=0)


def test_bad_options_name_the_option(corpus, tmp_path):
    with pytest.raises(DataError, match="next_sentence='mlm'"):
        S.build_sample_index(corpus, 64, 0, tmp_path, next_sentence="mlm")
    with pytest.raises(DataError, match="max_seq_len=4"):
        S.build_sample_index(corpus, 4, 0, tmp_path)
    with pytest.raises(DataError, match="short_seq_prob=2"):
        S.build_sample_index(corpus, 64, 0, tmp_path, short_seq_prob=2)
    one_doc = FakeCorpus([[np.arange(5, 9)] * 3], tmp_path / "one")
    with pytest.raises(DataError, match="next_sentence='nsp'"):
        S.build_sample_index(one_doc, 64, 0, tmp_path, next_sentence="nsp")
    path = S.build_sample_index(corpus, 64, 0, tmp_path)
    with pytest.raises(DataError, match="mlm_probability=0"):
        S.BertPretrainingDataset(corpus, path, 64, seed=0, mlm_probability=0)
    with pytest.raises(DataError, match="mask_token_prob=0.95"):
        S.BertPretrainingDataset(corpus, path, 64, seed=0, mask_token_prob=0.95)
    ds = S.BertPretrainingDataset(corpus, path, 64, seed=0)
    with pytest.raises(DataError, match=r"\(epoch, sample_index\)"):
        ds[3]


def test_nsp_labels_are_correct_and_balanced(tmp_path):
    """Label 1 pairs A with a sentence run of another document, label 0 with the sentences
    that follow A. The label-1 rate is 1/2 (Binomial, 5 sigma) plus the forced random-next
    of one-sentence chunks; with equal short sentences those occur only at a document's
    end, so at most one per document: the upper bound adds num_documents / rows."""
    rng = np.random.default_rng(1)
    docs = [[rng.integers(5, 1000, size=6) for _ in range(150)] for _ in range(20)]
    corpus = FakeCorpus(docs, tmp_path / "c")
    index = S.build_sample_index(corpus, 64, 0, tmp_path, next_sentence="nsp", short_seq_prob=0.0)
    rows = np.load(index)
    rand = rows[:, S.LABEL] == 1
    assert (rows[rand, S.DOC_B] != rows[rand, S.DOC_A]).all()
    assert (rows[~rand, S.DOC_B] == rows[~rand, S.DOC_A]).all()
    assert (rows[~rand, S.B_BEGIN] == rows[~rand, S.A_END]).all()
    assert (rows[:, S.B_END] > rows[:, S.B_BEGIN]).all()
    n = len(rows)
    sigma = math.sqrt(0.25 / n)
    assert 0.5 - 5 * sigma <= rand.mean() <= 0.5 + 5 * sigma + len(docs) / n
    # every sentence of every document is an A or an in-document B exactly once
    seen = np.zeros((len(docs), 150), dtype=int)
    for r in rows:
        seen[r[S.DOC_A], r[S.A_BEGIN]:r[S.A_END]] += 1
        if r[S.LABEL] == 0:
            seen[r[S.DOC_B], r[S.B_BEGIN]:r[S.B_END]] += 1
    assert (seen == 1).all()
    ds = S.BertPretrainingDataset(corpus, index, 64, seed=0)
    assert ds[(0, 0)]["next_sentence_label"].item() == rows[0, S.LABEL]


def test_sop_labels_swap_order_and_are_balanced(tmp_path):
    """SOP: label 1 iff B precedes A in the same document; every row draws the swap with
    p = 1/2, so the rate is within 5 sigma of a Binomial(n, 1/2)."""
    rng = np.random.default_rng(2)
    docs = [[rng.integers(5, 1000, size=6) for _ in range(150)] for _ in range(20)]
    corpus = FakeCorpus(docs, tmp_path / "c")
    rows = np.load(S.build_sample_index(corpus, 64, 0, tmp_path, next_sentence="sop"))
    swapped = rows[:, S.LABEL] == 1
    assert (rows[:, S.DOC_A] == rows[:, S.DOC_B]).all()
    assert (rows[swapped, S.B_END] == rows[swapped, S.A_BEGIN]).all()
    assert (rows[~swapped, S.A_END] == rows[~swapped, S.B_BEGIN]).all()
    assert abs(swapped.mean() - 0.5) <= 5 * math.sqrt(0.25 / len(rows))


def test_single_sentence_documents(tmp_path):
    """None: A-only samples [CLS] A [SEP]; 'sop': skipped; 'nsp': random-next B, label 1."""
    docs = [[np.arange(5, 15)] for _ in range(6)] + [[np.arange(20, 26)] * 4]
    corpus = FakeCorpus(docs, tmp_path / "c")
    rows = np.load(S.build_sample_index(corpus, 64, 0, tmp_path))
    single = rows[rows[:, S.DOC_A] < 6]
    assert len(single) == 6 and (single[:, S.B_BEGIN] == single[:, S.B_END]).all()
    ds = S.BertPretrainingDataset(corpus, tmp_path / "samples_seq64_seed0_none.npy", 64,
                                  seed=0)
    ids, types, _ = ds.tokens(0)
    assert ids.tolist() == [S.CLS_ID] + list(range(5, 15)) + [S.SEP_ID]
    assert (types == 0).all()
    assert "next_sentence_label" not in ds[(0, 0)]
    sop = np.load(S.build_sample_index(corpus, 64, 0, tmp_path, next_sentence="sop"))
    assert (sop[:, S.DOC_A] == 6).all()
    nsp = np.load(S.build_sample_index(corpus, 64, 0, tmp_path, next_sentence="nsp"))
    single = nsp[nsp[:, S.DOC_A] < 6]
    assert len(single) == 6 and (single[:, S.LABEL] == 1).all()
    assert (single[:, S.DOC_B] != single[:, S.DOC_A]).all()


@pytest.fixture
def dataset(tmp_path):
    corpus = FakeCorpus(random_docs(np.random.default_rng(3), num_docs=150, unk_rate=0.05,
                                    vocab=50), tmp_path / "c", vocab_size=50)
    path = S.build_sample_index(corpus, 128, 0, None, next_sentence="nsp")
    return S.BertPretrainingDataset(corpus, path, 128, seed=11)


def test_masking_statistics(dataset):
    """Over all samples of four epochs: exactly max(1, round(0.15 c)) of the c candidates
    (ordinary tokens) are predicted in each sample; specials ([CLS], [SEP], [UNK]) never
    are; unpredicted positions are untouched; and the 80/10/10 split holds.

    With M predictions in all, each one is [MASK] with p = 0.8, a random ordinary token
    with p = 0.1 and kept with p = 0.1. A random draw equals the original with
    q = 1/(V - 5), so the observed "changed to another token" rate is 0.1 (1 - q) and the
    "unchanged" rate 0.1 + 0.1 q. Each observed count is Binomial(M, p); it is asserted
    within 5 sigma = 5 sqrt(M p (1 - p)) of M p, which a correct implementation fails with
    probability below 1e-6 per check. V = 50 keeps q visible (1/45).
    """
    v = dataset.vocab_size
    q = 1 / (v - S.FIRST_ORDINARY_ID)
    counts = {"mask": 0, "random": 0, "keep": 0}
    predicted = candidates = 0
    for epoch, i in [(e, i) for e in range(4) for i in range(len(dataset))]:
        ids, types, _ = dataset.tokens(i)
        item = dataset[(epoch, i)]
        inputs, labels = item["input_ids"].numpy(), item["labels"].numpy()
        cand = ids >= S.FIRST_ORDINARY_ID
        assert ((ids == S.UNK_ID) | (ids == S.CLS_ID) | (ids == S.SEP_ID) | cand).all()
        pred = labels != S.IGNORE_INDEX
        assert not (pred & ~cand).any()
        assert pred.sum() == max(1, round(0.15 * cand.sum()))
        np.testing.assert_array_equal(labels[pred], ids[pred])
        np.testing.assert_array_equal(inputs[~pred], ids[~pred])
        np.testing.assert_array_equal(item["token_type_ids"].numpy(), types)
        assert (item["attention_mask"] == 1).all()
        got = inputs[pred]
        assert ((got == S.MASK_ID) | ((got >= S.FIRST_ORDINARY_ID) & (got < v))).all()
        counts["mask"] += int((got == S.MASK_ID).sum())
        counts["keep"] += int((got == ids[pred]).sum())
        counts["random"] += int(((got != S.MASK_ID) & (got != ids[pred])).sum())
        predicted += int(pred.sum())
        candidates += int(cand.sum())
    m = predicted
    assert m > 10000
    # rounding moves each sample's count by at most 1/2 (the max(1, .) floor by < 1)
    assert abs(predicted - 0.15 * candidates) <= 4 * len(dataset)
    assert abs(predicted / candidates - 0.15) < 0.005
    for name, p in [("mask", 0.8), ("random", 0.1 * (1 - q)), ("keep", 0.1 + 0.1 * q)]:
        assert abs(counts[name] - m * p) <= 5 * math.sqrt(m * p * (1 - p)), (name, counts)


def test_masks_are_keyed_by_seed_epoch_and_index(dataset):
    """Same key -> identical sample (also after pickling, as a DataLoader worker gets it);
    another epoch or seed -> other masked positions."""
    clone = pickle.loads(pickle.dumps(dataset))
    assert clone._rows is not None
    reseeded = S.BertPretrainingDataset(dataset.corpus, dataset.index_path, 128, seed=12)
    compared = 0
    for i in range(len(dataset)):
        x = dataset[(3, i)]
        for name, t in clone[(3, i)].items():
            assert torch.equal(t, x[name]), name
        if (dataset.tokens(i)[0] >= S.FIRST_ORDINARY_ID).sum() < 60:
            continue  # with >= 60 candidates two draws coincide with p < 1e-10
        compared += 1
        assert not torch.equal(x["labels"], dataset[(4, i)]["labels"])
        assert not torch.equal(x["labels"], reseeded[(3, i)]["labels"])
    assert compared > 20


def test_collate_pads_to_a_multiple_of_eight(dataset):
    batch = [dataset[(0, i)] for i in range(5)]
    out = S.collate(batch)
    longest = max(len(b["input_ids"]) for b in batch)
    width = -(-longest // 8) * 8
    assert out["input_ids"].shape == (5, width)
    for row, b in enumerate(batch):
        n = len(b["input_ids"])
        for name, pad in [("input_ids", 0), ("token_type_ids", 0), ("attention_mask", 0),
                          ("labels", -100)]:
            assert torch.equal(out[name][row, :n], b[name])
            assert (out[name][row, n:] == pad).all()
    assert out["next_sentence_label"].shape == (5,)
    assert S.collate(batch, pad_to_multiple_of=None)["input_ids"].shape == (5, longest)


def test_dataloader_with_workers_matches_direct_reads(dataset):
    sampler = PretrainingSampler(len(dataset), micro_batch_size=4, rank=1, world_size=2,
                                 seed=0, max_samples=40)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=2,
                                         collate_fn=S.collate)
    ref = PretrainingSampler(len(dataset), micro_batch_size=4, rank=1, world_size=2, seed=0)
    batches = list(loader)
    assert len(batches) == 5
    for got, keys in zip(batches, ref):
        want = S.collate([dataset[k] for k in keys])
        for name in want:
            assert torch.equal(got[name], want[name]), name


def test_on_real_shards_and_stale_after_resharding(tmp_path):
    """End to end on ShardedCorpus: the index sits next to the shards, samples are the
    shard's sentences, the dataset survives pickling with the corpus, its manifest missing while
    it is reopened is named as such (fails on the code before, which called the index stale), and
    re-sharding other text into the same directory makes the index stale."""
    shards = pytest.importorskip("vrgd_ds.data_pipeline.shards")
    tokenizer = pytest.importorskip("vrgd_ds.data_pipeline.tokenizer")
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "light", "paper", "north",
             "garden", "quiet", "signal"]

    def docs(n):
        return [[" ".join(rng.choice(words, size=int(rng.integers(4, 15)))) + "."
                 for _ in range(int(rng.integers(1, 9)))] for _ in range(n)]

    text = docs(60)
    tokenizer.train_tokenizer(text, tmp_path / "tok.model", vocab_size=32)
    corpus = shards.write_shards(text, tmp_path / "tok.model", tmp_path / "shards", workers=1,
                                 progress=False, shard_tokens=500)
    path = S.build_sample_index(corpus, 32, 0, None, next_sentence="nsp")
    assert path.parent == corpus.path
    ds = pickle.loads(pickle.dumps(S.BertPretrainingDataset(corpus, path, 32, seed=0)))
    rows = np.load(path)
    assert len(ds) == len(rows) > 50
    for i in range(len(ds)):
        ids, types, label = ds.tokens(i)
        row = rows[i]
        a = sentences(corpus, row[S.DOC_A], row[S.A_BEGIN], row[S.A_END])
        got_a = ids[1:np.flatnonzero(ids == S.SEP_ID)[0]]
        assert len(ids) <= 32 and is_substring(got_a, a)
        item = ds[(0, i)]
        assert (item["input_ids"][item["labels"] != -100] != S.SEP_ID).all()
    # the manifest gone while the dataset goes to a worker (the shards being written again): the
    # message names the manifest, not the index (before: "stale", a different corpus)
    manifest = corpus.path / "manifest.json"
    manifest.rename(tmp_path / "manifest.aside")
    with pytest.raises(DataError, match=r"manifest.json is missing \(the shards being written again, or moved\)"):
        pickle.loads(pickle.dumps(S.BertPretrainingDataset(corpus, path, 32, seed=0)))
    (tmp_path / "manifest.aside").rename(manifest)
    shards.write_shards(docs(50), tmp_path / "tok.model", tmp_path / "shards", workers=1,
                        progress=False, shard_tokens=500)
    resharded = shards.ShardedCorpus(tmp_path / "shards")
    if path.exists():  # write_shards replaces shard files only; an index left behind is stale
        with pytest.raises(DataError, match="stale"):
            S.BertPretrainingDataset(resharded, path, 32, seed=0)
    rebuilt = S.build_sample_index(resharded, 32, 0, None, next_sentence="nsp")
    assert len(S.BertPretrainingDataset(resharded, rebuilt, 32, seed=0)) > 0


def test_the_job_s_held_out_split_keeps_each_pair_on_one_side(tmp_path):
    """With ``next_sentence="nsp"`` a random-next pair's B comes from any document: the job's
    split (``vrgd_ds.train.data.JobData.split``) keeps a sample only on the side both its
    documents are on, so no held-out sentence is trained on and no training sentence is
    evaluated. Fails on the code before, which split by A's document alone."""
    from vrgd_ds.train.data import JobData

    corpus = FakeCorpus(random_docs(np.random.default_rng(5)), tmp_path / "corpus")
    path = S.build_sample_index(corpus, 64, 1, tmp_path / "idx", next_sentence="nsp")
    cut = 30
    data = JobData(None, corpus, {64: path}, cut, 1, "nsp")
    train, held = data.split(64)
    rows = np.load(path)
    crossing = int(np.sum((rows[:, S.DOC_A] < cut) != (rows[:, S.DOC_B] < cut)))
    assert crossing > 0  # the case exists in this corpus
    assert (rows[train.rows][:, [S.DOC_A, S.DOC_B]] < cut).all()
    assert (rows[held.rows][:, [S.DOC_A, S.DOC_B]] >= cut).all()
    assert len(train) + len(held) + crossing == len(rows)


def test_the_gpt_windows_mark_where_each_document_ends(tmp_path):
    """The causal-LM windows (``JobData.windows``, the Megatron engine's GPT data) read the
    documents end to end with ``[SEP]`` after each, the end-of-document token Megatron's GPT data
    appends: a window that runs from one document into the next has the token at the boundary, so
    the model is not trained to continue one document's text with an unrelated one's as if it were
    the same. The training and held-out streams split at the held-out document, and the GPT
    fingerprint is another than the BERT samples' (a checkpoint of windows made without the token
    resumes as other data). Fails on the code before, which joined the documents unmarked."""
    from types import SimpleNamespace

    from vrgd_ds.train.data import JobData

    docs = random_docs(np.random.default_rng(7), num_docs=12)
    corpus = FakeCorpus(docs, tmp_path / "corpus")
    cut, seq = 9, 16
    data = JobData(SimpleNamespace(sep_id=S.SEP_ID, sha256="0" * 64), corpus, {}, cut, 1, None)
    train, held = data.windows(seq)
    for windows, first, last in ((train, 0, cut), (held, cut, len(docs))):
        expected = np.concatenate([t for d in docs[first:last] for t in (*d, [S.SEP_ID])])
        assert np.array_equal(windows.stream, expected)
        # every window's tokens, read back, are the stream cut at seq tokens with one shared
        got = [windows[(0, i)] for i in range(len(windows))]
        assert len(got) == (len(expected) - 1) // seq > 0
        for i, w in enumerate(got):
            assert torch.equal(w["tokens"], torch.from_numpy(expected[i * seq:(i + 1) * seq].astype(np.int64)))
            assert torch.equal(w["labels"], torch.from_numpy(expected[i * seq + 1:(i + 1) * seq + 1].astype(np.int64)))
        ends = np.cumsum([sum(len(s) for s in d) + 1 for d in docs[first:last]]) - 1
        assert np.array_equal(np.flatnonzero(windows.stream == S.SEP_ID), ends)  # no [SEP] in the text itself
        crossing = [i for i in range(len(got)) if any(i * seq < e < (i + 1) * seq for e in ends)]
        assert crossing and all((got[i]["tokens"] == S.SEP_ID).any() for i in crossing)
    assert data.fingerprint(windows=True) != data.fingerprint()


def test_the_gpt_streams_are_written_once_and_mapped_by_every_rank(tmp_path):
    """The GPT's token streams go to disk a document at a time (``JobData.write_streams``, rank 0
    in ``prepare_data``) and every rank maps them (``windows``): the same tokens and windows as
    the streams built in memory, but no rank holds the corpus. Before, every rank (each tensor-
    and pipeline-parallel one too) concatenated the whole training corpus into its own memory:
    about 20 GB a rank for a 10-billion-token uint16 corpus. Fails on the old code (no streams on
    disk). The files' names change with the split (another held-out fraction: other streams)."""
    from types import SimpleNamespace

    from vrgd_ds.train.data import JobData

    docs = random_docs(np.random.default_rng(11), num_docs=15)
    docs[4] = []  # a document without sentences: no [SEP] of its own, as in the streams built in memory
    corpus = FakeCorpus(docs, tmp_path / "corpus")
    tokenizer = SimpleNamespace(sep_id=S.SEP_ID, sha256="0" * 64)
    in_memory = JobData(tokenizer, corpus, {}, 11, 1, None)
    on_disk = JobData(tokenizer, corpus, {}, 11, 1, None)
    names = on_disk.stream_names()
    paths = tuple(tmp_path / "samples" / n for n in names)
    on_disk.write_streams(paths)
    on_disk.streams = paths
    for a, b in zip(in_memory.token_streams(), (np.load(p) for p in paths)):
        assert np.array_equal(a, b) and b.dtype == corpus.dtype
    for mine, theirs in zip(on_disk.windows(16), in_memory.windows(16)):
        assert isinstance(mine.stream, np.memmap) and len(mine) == len(theirs) > 0
        assert all(torch.equal(mine[(0, i)]["tokens"], theirs[(0, i)]["tokens"]) for i in range(len(mine)))
    assert JobData(tokenizer, corpus, {}, 12, 1, None).stream_names() != names
    assert not list((tmp_path / "samples").glob(".*tmp*"))  # each file replaced its path once complete


def test_mapped_gpt_windows_go_to_a_spawned_worker_as_their_path(tmp_path):
    """A DataLoader worker that forkserver (Python 3.14's default) or spawn starts receives the
    dataset pickled: the windows of a mapped stream go as its path and length, mapped again there
    (the same windows), not as the stream's bytes; a stream built in memory goes whole, and a file
    written again with another length is refused when mapped again. Fails on the old code, which
    pickled the memmap's data: every worker held a copy of the training stream (about 20 GB for a
    10-billion-token uint16 corpus)."""
    import pickle
    from types import SimpleNamespace

    from vrgd_ds.data_pipeline.errors import DataError
    from vrgd_ds.train.data import JobData

    corpus = FakeCorpus(random_docs(np.random.default_rng(5), num_docs=15), tmp_path / "corpus")
    tokenizer = SimpleNamespace(sep_id=S.SEP_ID, sha256="0" * 64)
    on_disk, in_memory = JobData(tokenizer, corpus, {}, 11, 1, None), JobData(tokenizer, corpus, {}, 11, 1, None)
    paths = tuple(tmp_path / "samples" / n for n in on_disk.stream_names())
    on_disk.write_streams(paths)
    on_disk.streams = paths
    train = on_disk.windows(16)[0]
    sent = pickle.dumps(train)
    assert len(sent) < 600 < 2000 < train.stream.nbytes, (train.stream.nbytes, len(sent))
    there = pickle.loads(sent)
    assert isinstance(there.stream, np.memmap) and len(there) == len(train) > 0
    assert all(torch.equal(there[(0, i)]["tokens"], train[(0, i)]["tokens"]) for i in range(len(train)))
    built = in_memory.windows(16)[0]
    assert len(pickle.dumps(built)) > built.stream.nbytes  # not mapped from a file: its data goes
    np.save(paths[0], np.asarray(train.stream[:-5]))
    with pytest.raises(DataError, match=r"tokens, not the \d+ of the stream it was opened as"):
        pickle.loads(sent)


def test_gpt_streams_the_disk_has_no_room_for_are_refused_before_writing(tmp_path, monkeypatch):
    """Too little free space for the streams: a DataError naming the directory and both sizes
    before a byte is written (a full disk met through a mapping would end rank 0 with SIGBUS,
    the other ranks waiting at the barrier); nothing is left behind. Fails on the old code, which
    wrote through a mapping without looking at the free space."""
    import shutil
    from types import SimpleNamespace

    from vrgd_ds.data_pipeline.errors import DataError
    from vrgd_ds.train.data import JobData

    corpus = FakeCorpus(random_docs(np.random.default_rng(3), num_docs=6), tmp_path / "corpus")
    data = JobData(SimpleNamespace(sep_id=S.SEP_ID, sha256="0" * 64), corpus, {}, 4, 1, None)
    paths = tuple(tmp_path / "samples" / n for n in data.stream_names())
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=100))
    with pytest.raises(DataError, match=r"samples: the GPT's token streams need \d+ MB, 0 MB is free"):
        data.write_streams(paths)
    assert list((tmp_path / "samples").iterdir()) == []


@pytest.mark.parametrize("count, world, micro", [(256, 6, 2), (256, 24, 2), (10, 3, 4), (7, 7, 1), (64, 2, 8)])
def test_every_rank_evaluates_as_many_batches(count, world, micro):
    """``vrgd_ds.train.data.eval_batches``: each data-parallel rank gets the same number of
    held-out samples and batches, distinct samples over the ranks, ``count`` rounded down to a
    multiple of the ranks. Fails on the code before: 256 samples on 6 ranks at micro-batch 2
    gave ranks 0-3 22 batches and ranks 4-5 21, and a ZeRO-3 evaluation (whose forward gathers
    parameters over the ranks) hung."""
    from vrgd_ds.train.data import eval_batches

    held = {(0, i): i for i in range(1000)}  # (epoch, index) -> sample, as the held-out set is read
    per_rank = [eval_batches(held, count, micro, r, world, collate_fn=list) for r in range(world)]
    assert len({len(b) for b in per_rank}) == 1
    seen = [i for b in per_rank for batch in b for i in batch]
    assert sorted(seen) == list(range(count // world * world))


def test_fewer_held_out_samples_than_ranks_is_a_config_error():
    from vrgd_ds.train.config import ConfigError
    from vrgd_ds.train.data import eval_batches

    with pytest.raises(ConfigError, match="job.data.heldout_fraction: 3 held-out sample"):
        eval_batches({(0, i): i for i in range(3)}, 256, 2, 0, 4, collate_fn=list)
    with pytest.raises(ConfigError, match="job.data.eval_samples: 3 for 4 data-parallel ranks"):
        eval_batches({(0, i): i for i in range(100)}, 3, 2, 0, 4, collate_fn=list)


#: sha256 of every collated micro-batch of ``pinned_samples`` (the samples, masks and padding the
#: records' data fingerprints stand for), taken before the per-sample path was sped up
PINNED_SAMPLES_SHA256 = "68d009e8e5e145c65a57b842f79a1ae29590a0f287e27b0a08b56f48ea3335a1"


def pinned_samples(tmp_path) -> str:
    """Every sample of a corpus with over-long sentences (truncation) at seq 64, NSP and not,
    epochs 0 and 1, collated 7 at a time: the sha256 of every tensor's bytes."""
    corpus = FakeCorpus(random_docs(np.random.default_rng(5), num_docs=60, long_every=9), tmp_path / "pin")
    digest = hashlib.sha256()
    for next_sentence in (None, "nsp"):
        ds = S.BertPretrainingDataset(corpus, S.build_sample_index(corpus, 64, 2, None, next_sentence=next_sentence),
                                      64, seed=3)
        for epoch in (0, 1):
            for start in range(0, len(ds), 7):
                batch = S.collate([ds[(epoch, i)] for i in range(start, min(start + 7, len(ds)))])
                for name in sorted(batch):
                    digest.update(name.encode() + batch[name].numpy().tobytes())
    return digest.hexdigest()


def test_the_samples_are_those_the_records_were_made_with(tmp_path):
    """A faster sample path makes the same samples: the same tokens, truncation, masks, padding
    and labels, bit for bit (a changed sample would change every record's data fingerprint)."""
    assert pinned_samples(tmp_path) == PINNED_SAMPLES_SHA256


# -- SOP pairs, the index's write, and the job's decision to prepare (review fixes) ----------------


def test_sop_pairs_every_sentence_of_a_document_that_has_two(tmp_path, caplog):
    """``next_sentence="sop"`` at seq 16 on documents whose sentences mostly exceed the 13 tokens a
    chunk holds: every sentence of a document of two or more sentences is in exactly one sample, each
    sample a pair (A and B non-empty, from its own document), and only the one-sentence documents
    make none, which the build logs once with their count. Fails on the old code, which closed a
    chunk at its first over-long sentence and skipped every one-sentence chunk silently (on
    WikiText-2 at seq 16: 131 of 2596 sentences trained on). Also pins that an index built before
    this rule (its sidecar without ``sop_pairs``) is rebuilt, not reused."""
    import logging

    rng = np.random.default_rng(11)
    docs = [[rng.integers(5, 1000, size=int(rng.integers(4, 40))) for _ in range(int(rng.integers(2, 9)))]
            for _ in range(30)]
    docs += [[rng.integers(5, 1000, size=30)] for _ in range(3)]  # one sentence each: no order to predict
    corpus = FakeCorpus(docs, tmp_path / "c")
    with caplog.at_level(logging.WARNING, logger=S.__name__):
        path = S.build_sample_index(corpus, 16, 0, tmp_path, next_sentence="sop")
    rows = np.load(path)
    assert (rows[:, S.DOC_A] == rows[:, S.DOC_B]).all()
    assert (rows[:, S.A_END] > rows[:, S.A_BEGIN]).all() and (rows[:, S.B_END] > rows[:, S.B_BEGIN]).all()
    seen = [np.zeros(len(d), dtype=int) for d in docs]
    for r in rows:
        seen[r[S.DOC_A]][r[S.A_BEGIN]:r[S.A_END]] += 1
        seen[r[S.DOC_B]][r[S.B_BEGIN]:r[S.B_END]] += 1
    assert all((s == 1).all() for s in seen[:30]) and all((s == 0).all() for s in seen[30:])
    total = sum(len(d) for d in docs)
    warned = [r.getMessage() for r in caplog.records if "sop" in r.getMessage()]
    assert len(warned) == 1 and f"3 chunks (3 sentences of {total}" in warned[0], warned
    sidecar = path.with_suffix(".json")
    meta = json.loads(sidecar.read_text())
    del meta["sop_pairs"]  # as the old code wrote it
    sidecar.write_text(json.dumps(meta))
    assert not S.index_is_current(corpus, path, 16, 0, next_sentence="sop")
    S.build_sample_index(corpus, 16, 0, tmp_path, next_sentence="sop")
    assert json.loads(sidecar.read_text())["sop_pairs"]


def test_the_none_and_nsp_indices_are_those_the_records_were_made_with(tmp_path):
    """The SOP rule leaves ``None`` and ``"nsp"`` alone: their index rows, at lengths where most
    chunks hold one sentence (8, 16) and at 64, with BERT's and a larger short-target share, hash as
    they did before it (they feed the committed records, whose data fingerprints must not change).
    A pin: it passes on the old code too (the hash was taken there)."""
    docs = random_docs(np.random.default_rng(7), num_docs=40, max_sentences=8, max_len=20, long_every=5)
    docs += [[np.arange(5, 30)] for _ in range(3)]
    corpus = FakeCorpus(docs, tmp_path / "c")
    digest = hashlib.sha256()
    for next_sentence in (None, "nsp"):
        for max_seq_len in (8, 16, 64):
            for short in (0.1, 0.5):
                rows = np.load(S.build_sample_index(corpus, max_seq_len, 4, tmp_path / "idx", short_seq_prob=short,
                                                    next_sentence=next_sentence))
                digest.update(np.ascontiguousarray(rows).tobytes())
    assert digest.hexdigest() == "c1ba28e73f6c221f77e420b0f9fc9171892a60a4a290a914e48ee9b57366593a"


def test_a_failed_index_write_names_the_file_and_leaves_no_temporary(corpus, tmp_path, monkeypatch):
    """A full disk while the index is written, or a refused rename of its sidecar: a DataError
    naming the file, and no ``.samples_*.tmp.<host>.<pid>`` left behind; an index without its
    sidecar is rebuilt by the next build. Fails on the old code: a raw OSError without the file's
    name, and the temporary file left in the directory."""
    import errno

    out = tmp_path / "idx"
    real_save = np.save

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(np, "save", full)
    with pytest.raises(DataError, match=r"samples_seq64_seed0_none\.npy failed \(No space left on device\); free "
                                        r"disk space"):
        S.build_sample_index(corpus, 64, 0, out)
    assert list(out.iterdir()) == []
    monkeypatch.setattr(np, "save", real_save)
    real_replace = os.replace

    def refused(src, dst):
        if str(dst).endswith(".json"):
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", refused)
    with pytest.raises(DataError, match=r"samples_seq64_seed0_none\.json failed \(Permission denied\)"):
        S.build_sample_index(corpus, 64, 0, out)
    assert [p.name for p in out.iterdir()] == ["samples_seq64_seed0_none.npy"]
    monkeypatch.setattr(os, "replace", real_replace)
    assert not S.index_is_current(corpus, out / "samples_seq64_seed0_none.npy", 64, 0)
    S.build_sample_index(corpus, 64, 0, out)
    assert S.index_is_current(corpus, out / "samples_seq64_seed0_none.npy", 64, 0)


JOB_CONFIG = pathlib.Path(__file__).resolve().parents[2] / "configs" / "bert_tiny_cpu_test.json"


def _users_prepared_directory(root: pathlib.Path) -> pathlib.Path:
    """What ``vrgd-data prepare`` of a user's corpus leaves (files as placeholders)."""
    out = root / "prepared"
    (out / "shards").mkdir(parents=True)
    (out / "tokenizer.model").write_bytes(b"the user's tokenizer")
    (out / "shards" / "manifest.json").write_text("{}")
    record = {"tokenizer": {"corpus_fingerprint": "the user's corpus", "vocab_size": 400, "model_type": "unigram",
                            "seed": 0, "num_threads": 8, "sha256": "0" * 64}}
    (out / "prepare.json").write_text(json.dumps(record))
    return out


def test_a_job_decides_under_the_lock_whether_a_given_directory_is_prepared(tmp_path, monkeypatch, caplog):
    """A job with ``job.data.path`` and no ``inputs`` starts while another preparation rewrites that
    directory (holding its lock, the manifest deleted first): the job waits for the lock, then takes
    the directory as prepared, never preparing it from the embedded corpus. Fails on the old code,
    which looked before taking the lock, found no manifest and ran ``prepare`` with the embedded
    corpus into the user's directory."""
    import logging
    import threading
    import time

    from vrgd_ds.data_pipeline import prepare as prepare_module
    from vrgd_ds.data_pipeline import samples
    from vrgd_ds.data_pipeline.prepare import prepare_lock
    from vrgd_ds.train import data
    from vrgd_ds.train.config import load_config

    out = _users_prepared_directory(tmp_path)
    manifest = out / "shards" / "manifest.json"

    class Corpus:  # the directory's shards, as ShardedCorpus reads them
        vocab_size = 400

        def __init__(self, path, verify):
            assert manifest.is_file()

        def check_token_ids(self):
            pass

    def checked_then_rewritten(job):  # the other preparation starts right after the job's first look
        check_data_path(job)
        manifest.unlink(missing_ok=True)

    def prepare(out, **kwargs):
        calls.append(kwargs)
        raise RuntimeError("prepared from the embedded corpus")

    def load(path):
        raise RuntimeError("tokenizer loaded")

    calls: list = []
    check_data_path = data.check_data_path
    monkeypatch.setattr(data, "check_data_path", checked_then_rewritten)
    monkeypatch.setattr(data, "ShardedCorpus", Corpus)
    monkeypatch.setattr(samples, "build_sample_index", lambda *args, **kwargs: None)
    monkeypatch.setattr(prepare_module, "prepare", prepare)
    monkeypatch.setattr(data.Tokenizer, "load", staticmethod(load))
    _, job = load_config(JOB_CONFIG, [f'job.data.path="{out}"'])
    caplog.set_level(logging.INFO, logger="vrgd_ds.data_pipeline.locks")
    result: dict = {}

    def run():
        try:
            data.prepare_data(job, tmp_path / "run", 0, lambda: None, [64])
        except Exception as e:  # noqa: BLE001 - read back below
            result["error"] = e

    with prepare_lock(out):  # the other preparation, at work
        thread = threading.Thread(target=run)
        thread.start()
        deadline = time.monotonic() + 30
        while "waiting for another prepare" not in caplog.text and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        manifest.write_text("{}")  # its shards written
    thread.join(timeout=30)
    assert calls == [] and "tokenizer loaded" in str(result.get("error")), (calls, result)
    assert "waiting for another prepare" in caplog.text


def test_a_job_never_prepares_the_embedded_corpus_over_a_users_data(tmp_path, monkeypatch):
    """``job.data.prepare: true`` and no ``inputs`` on a directory holding a user's preparation whose
    shards are being rewritten (no manifest now): the job stops with a ConfigError naming the key
    and what differs, and nothing there changes, where the old code ran ``prepare`` with the
    embedded corpus and ``keep_built`` off, training a tokenizer over the user's and rewriting the
    shards. Fails on the old code (prepare called to rebuild)."""
    from vrgd_ds.data_pipeline import prepare as prepare_module
    from vrgd_ds.train import data
    from vrgd_ds.train.config import ConfigError, load_config

    out = _users_prepared_directory(tmp_path)
    (out / "shards" / "manifest.json").unlink()
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    real = prepare_module.prepare
    kept = []

    def prepare(out, **kwargs):
        kept.append(kwargs["keep_built"])
        if not kwargs["keep_built"]:
            raise RuntimeError("rebuilt from the embedded corpus")
        return real(out, **kwargs)

    monkeypatch.setattr(prepare_module, "prepare", prepare)
    monkeypatch.setattr(prepare_module, "corpus_fingerprint", lambda corpus: "the embedded corpus")  # not collected
    _, job = load_config(JOB_CONFIG, [f'job.data.path="{out}"', "job.data.prepare=true"])
    with pytest.raises(ConfigError, match=r"job.data.path: .* holds a tokenizer built from other corpus_fingerprint "
                                          r".*does not fill a directory holding prepared data with the embedded "
                                          r"corpus"):
        data.prepare_data(job, tmp_path / "run", 0, lambda: None, [64])
    assert kept == [True]
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".prepare.lock"} == before


def test_a_jobs_own_embedded_preparation_cut_off_part_way_is_prepared_again(tmp_path, monkeypatch):
    """``job.data.prepare: true`` on a directory whose preparation of the embedded corpus was cut
    off (pre-empted) after its tokenizer, before its shards: the next start prepares it again
    (``keep_built`` off), where a user's corpus's preparation is refused (above). Fails on the code
    that took any record or tokenizer there for a user's: every requeued start stopped."""
    from vrgd_ds.data_pipeline import prepare as prepare_module
    from vrgd_ds.train import data
    from vrgd_ds.train.config import load_config

    out = tmp_path / "prepared"
    (out / "shards").mkdir(parents=True)
    (out / "tokenizer.model").write_bytes(b"the job's tokenizer")
    monkeypatch.setattr(prepare_module, "corpus_fingerprint", lambda corpus: "the embedded corpus")
    kept = []

    def prepare(out, **kwargs):
        kept.append(kwargs["keep_built"])
        raise RuntimeError("prepared again")

    monkeypatch.setattr(prepare_module, "prepare", prepare)
    _, job = load_config(JOB_CONFIG, [f'job.data.path="{out}"', "job.data.prepare=true"])
    for record in (None, {"tokenizer": {"corpus_fingerprint": "the embedded corpus", "sha256": "0" * 64}}):
        if record is not None:
            (out / "prepare.json").write_text(json.dumps(record))
        with pytest.raises(RuntimeError, match="prepared again"):
            data.prepare_data(job, tmp_path / "run", 0, lambda: None, [64])
    assert kept == [False, False]
