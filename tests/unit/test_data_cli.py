"""`vrgd-data` end to end on a temporary directory, `prepare` idempotency, and error exits."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from launching import wait_until
from pydoc_data.topics import topics

from vrgd_ds.data_pipeline.cli import main
from vrgd_ds.data_pipeline.errors import DataError
from vrgd_ds.data_pipeline.prepare import LOCK_FILE, prepare
from vrgd_ds.data_pipeline.shards import ShardedCorpus
from vrgd_ds.data_pipeline.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # compiles, trains or starts processes: not in make test-unit

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def corpus_file(tmp_path):
    """The pydoc topics as a plain-text corpus, one topic per document."""
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(" ".join(topics[k].split()) for k in sorted(topics)[:40]) + "\n")
    return path


def test_cli_end_to_end(corpus_file, tmp_path, capsys):
    model, shards = tmp_path / "tok.model", tmp_path / "shards"
    assert main(["tokenizer", "--out", str(model), str(corpus_file), "--vocab-size", "400", "--threads", "1"]) == 0
    assert Tokenizer.load(model).vocab_size == 400
    assert main(["shard", "--tokenizer", str(model), "--out", str(shards), str(corpus_file),
                 "--workers", "1", "--no-progress", "--shard-tokens", "10000"]) == 0
    corpus = ShardedCorpus(shards, verify="full")
    assert corpus.num_documents == 40 and corpus.num_shards > 1
    assert main(["samples", str(shards), "--seq-len", "64", "--seq-len", "128", "--seed", "3"]) == 0
    printed = capsys.readouterr().out.split()
    assert [Path(p).name for p in printed[-2:]] == ["samples_seq64_seed3_none.npy", "samples_seq128_seed3_none.npy"]
    assert main(["verify", str(shards), "--full", "--tokenizer", str(model)]) == 0
    assert "ok (full)" in capsys.readouterr().out
    assert main(["info", str(shards), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["num_documents"] == 40 and info["vocab_size"] == 400 and len(info["sample_indices"]) == 2
    assert main(["info", str(model)]) == 0
    assert "special_ids" in capsys.readouterr().out


def test_indices_built_by_the_cli_go_where_jobs_look_and_another_short_seq_prob_keeps_its_own(corpus_file, tmp_path,
                                                                                               capsys):
    """``vrgd-data samples`` on a prepared directory's shards writes to its ``samples/``, where a
    job looks; one built with another ``--short-seq-prob`` is named for it, so the job's index
    (BERT's 0.1) is another file and leaves it alone. Fails on the old code, which wrote beside the
    shards (the job never found it) under the name the job's index takes, and the job's build
    rewrote it in place."""
    import numpy as np

    from vrgd_ds.data_pipeline.samples import build_sample_index

    out = tmp_path / "prepared"
    prepare(out, corpus_file, vocab_size=400, seq_lens=(64,), workers=1, progress=False, tokenizer_threads=1,
            shard_tokens=10000)
    assert main(["samples", str(out / "shards"), "--seq-len", "32", "--short-seq-prob", "0.5"]) == 0
    built = Path(capsys.readouterr().out.split()[-1])
    assert built == out / "samples" / "samples_seq32_seed0_none_short0.5.npy"
    rows = np.load(built).copy()
    job_index = build_sample_index(ShardedCorpus(out / "shards", verify="size"), 32, 0, out / "samples")
    assert job_index == out / "samples" / "samples_seq32_seed0_none.npy"
    assert np.array_equal(np.load(built), rows) and not np.array_equal(np.load(job_index), rows)


def test_indices_the_cli_adds_to_a_prepared_directory_wait_for_its_lock_and_name_the_host(corpus_file, tmp_path,
                                                                                        caplog, monkeypatch):
    """``vrgd-data samples`` into a prepared directory's ``samples/`` takes the directory's prepare
    lock, as a job adding its indices there does: while another holds it, the command waits
    (saying so) and writes nothing, then builds. Its temporary files are named for the host and
    the process (a writer on another node may have the same pid). Fails on the old code, which
    wrote without the lock, under names of the pid alone."""
    from vrgd_ds.data_pipeline import samples
    from vrgd_ds.data_pipeline.locks import directory_lock

    out = tmp_path / "prepared"
    prepare(out, corpus_file, vocab_size=400, seq_lens=(64,), workers=1, progress=False, tokenizer_threads=1,
            shard_tokens=10000)
    caplog.set_level(logging.INFO, logger="vrgd_ds.data_pipeline.locks")
    monkeypatch.setattr(samples.socket, "gethostname", lambda: "node7")
    moved, replace = [], os.replace
    monkeypatch.setattr(samples.os, "replace", lambda a, b: (moved.append(Path(a).name), replace(a, b)))
    index = out / "samples" / "samples_seq32_seed0_none.npy"
    done: dict = {}
    with directory_lock(out, LOCK_FILE, "prepare"):  # a job adding its indices, still at work
        thread = threading.Thread(target=lambda: done.update(code=main(["samples", str(out / "shards"),
                                                                        "--seq-len", "32"])))
        thread.start()
        wait_until(lambda: "waiting for another prepare" in caplog.text or not thread.is_alive(),
                   "the command to wait or finish")
        assert thread.is_alive() and not index.exists()
    thread.join(timeout=120)
    assert done["code"] == 0 and index.is_file()
    assert moved and all(f".tmp.node7.{os.getpid()}" in name for name in moved), moved


def test_cli_errors_exit_2_without_traceback(tmp_path, capsys):
    assert main(["shard", "--tokenizer", str(tmp_path / "none.model"), "--out", str(tmp_path / "s"),
                 str(tmp_path / "missing.txt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "missing.txt does not exist" in err and "Traceback" not in err
    assert main(["verify", str(tmp_path)]) == 2
    assert "manifest.json does not exist" in capsys.readouterr().err


@pytest.mark.exhaustive  # make test: the CLI's main() in-process (test_cli_errors_exit_2_without_traceback)
def test_module_entry_point_subprocess(tmp_path):
    """`python -m vrgd_ds.data_pipeline` really exits 2 with a one-line message, and --help works."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-m", "vrgd_ds.data_pipeline", "verify", str(tmp_path / "x")],
                         capture_output=True, text=True, env=env, cwd=tmp_path)
    assert run.returncode == 2 and run.stderr.startswith("error: shard directory") and "Traceback" not in run.stderr
    run = subprocess.run([sys.executable, "-m", "vrgd_ds.data_pipeline", "--help"], capture_output=True, text=True, env=env)
    assert run.returncode == 0
    for command in ("prepare", "tokenizer", "shard", "samples", "verify", "info"):
        assert command in run.stdout


def test_prepare_is_idempotent_and_notices_changed_input(corpus_file, tmp_path, capsys, monkeypatch):
    out = tmp_path / "prepared"
    first = prepare(out, corpus_file, vocab_size=400, seq_lens=(64,), workers=1, progress=False,
                    tokenizer_threads=1, shard_tokens=10000)
    assert first.built == ("tokenizer", "shards")
    assert first.sample_indices[64].is_file() and first.tokenizer == out / "tokenizer.model"
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and p.name != LOCK_FILE}
    second = prepare(out, corpus_file, vocab_size=400, seq_lens=(64,), workers=1, progress=False,
                     tokenizer_threads=1, shard_tokens=10000)
    assert second.built == () and second.sample_indices == first.sample_indices
    # nothing rewritten (the lock names its last holder)
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and p.name != LOCK_FILE} == stamps
    # the same file named another way (relative, from its directory) is the same input: nothing
    # rebuilt (the old code compared the recorded description, so it retrained and resharded)
    monkeypatch.chdir(corpus_file.parent)
    again = prepare(out, corpus_file.name, vocab_size=400, seq_lens=(64,), workers=1, progress=False,
                    tokenizer_threads=1, shard_tokens=10000)
    assert again.built == ()
    # a damaged shard is caught by the size check and the shards are rewritten
    victim = out / "shards" / "shard_00000.tokens.npy"
    victim.write_bytes(victim.read_bytes()[:-2])
    third = prepare(out, corpus_file, vocab_size=400, seq_lens=(64,), workers=1, progress=False,
                    tokenizer_threads=1, shard_tokens=10000)
    assert third.built == ("shards",)
    # `info` on the prepared directory lists the sample indices, which live beside the shards
    # (before, it looked for them among the shards and always listed none; fails on the old code)
    capsys.readouterr()
    assert main(["info", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["shards"]["sample_indices"] == ["samples_seq64_seed0_none.npy"]
    ShardedCorpus(out / "shards", verify="full")
    # an edited corpus retrains everything
    corpus_file.write_text(corpus_file.read_text() + "\nA new document. With two sentences.\n")
    fourth = prepare(out, corpus_file, vocab_size=400, seq_lens=(64,), workers=1, progress=False,
                     tokenizer_threads=1, shard_tokens=10000)
    assert fourth.built == ("tokenizer", "shards")
    assert ShardedCorpus(out / "shards").num_documents == 41
    # the CLI says what it reused
    assert main(["prepare", str(out), str(corpus_file), "--vocab-size", "400", "--seq-len", "64",
                 "--tokenizer-threads", "1", "--shard-tokens", "10000", "--workers", "1", "--no-progress"]) == 0
    assert "built: nothing (all reused)" in capsys.readouterr().out


def test_a_corpus_touched_or_copied_with_the_same_bytes_is_not_prepared_again(corpus_file, tmp_path, monkeypatch):
    """The fingerprint holds the files' paths and modification times: a corpus staged again (a
    new mtime) or copied elsewhere retrained the tokenizer and rewrote the shards, hours for a
    large corpus. Now the files are read once and, holding the bytes the directory was built
    from, nothing is rebuilt and the record takes the new fingerprint (the next start reads
    nothing); other bytes still rebuild. Fails on the old code."""
    from vrgd_ds.data_pipeline import prepare as prep

    options = dict(vocab_size=400, seq_lens=(64,), workers=1, progress=False, tokenizer_threads=1, shard_tokens=10000)
    out = tmp_path / "prepared"
    tokenizer = prepare(out, corpus_file, **options).tokenizer.read_bytes()
    os.utime(corpus_file, ns=(1, 1))  # staged again
    assert prepare(out, corpus_file, **options).built == ()
    reads = []
    real = prep.corpus_content_sha256
    monkeypatch.setattr(prep, "corpus_content_sha256", lambda corpus: reads.append(1) or real(corpus))
    assert prepare(out, corpus_file, **options).built == () and reads == []  # the record took the new fingerprint
    copy = tmp_path / "elsewhere" / corpus_file.name
    copy.parent.mkdir()
    copy.write_bytes(corpus_file.read_bytes())
    assert prepare(out, copy, **options).built == () and reads == [1]
    assert (out / "tokenizer.model").read_bytes() == tokenizer
    copy.write_text(copy.read_text().replace("e", "a"))  # other bytes, the same size
    os.utime(copy, ns=(2, 2))
    assert prepare(out, copy, **options).built == ("tokenizer", "shards")
    assert reads == [1, 1]  # the rebuild records the digest read once to compare, not read again


def test_another_seed_keeps_the_shards_when_the_tokenizer_comes_out_the_same(corpus_file, tmp_path):
    """Seeds side by side on one prepared directory: the seed seeds the tokenizer's sampling, so
    another seed trains it again, but on a corpus the trainer reads whole it comes out byte for
    byte the same, and the shards stand (a job of the first seed may be reading them). Fails on
    the code that dropped the shards' record whenever the tokenizer was trained: it rewrote them,
    deleting the files a running job had not opened yet."""
    out = tmp_path / "prepared"
    options = dict(vocab_size=400, seq_lens=(64,), workers=1, progress=False, tokenizer_threads=1,
                   shard_tokens=10000)
    first = prepare(out, corpus_file, seed=1, **options)
    shards = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in (out / "shards").iterdir()}
    second = prepare(out, corpus_file, seed=2, **options)
    assert second.built == ("tokenizer",)
    assert second.tokenizer.read_bytes() == first.tokenizer.read_bytes()
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in (out / "shards").iterdir()} == shards
    assert first.sample_indices[64].is_file() and second.sample_indices[64] != first.sample_indices[64]
    assert prepare(out, corpus_file, seed=2, **options).built == ()


def test_input_files_may_follow_the_options(corpus_file, tmp_path, capsys):
    """``prepare OUT --options... INPUT`` (how scripts append their file lists) reads the inputs;
    an unknown option is still an error naming it. On the old code the first command exited
    with "unrecognized arguments" (SystemExit 2)."""
    out = tmp_path / "p"
    assert main(["prepare", str(out), "--vocab-size", "400", "--seq-len", "64", "--tokenizer-threads", "1",
                 "--shard-tokens", "10000", "--workers", "1", "--no-progress", str(corpus_file)]) == 0
    assert ShardedCorpus(out / "shards").num_documents == 40  # the file's, not the embedded corpus
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["prepare", str(out), "--no-such-option", str(corpus_file)])
    assert exc.value.code == 2 and "--no-such-option" in capsys.readouterr().err


def test_prepare_rejects_empty_seq_lens(corpus_file, tmp_path):
    with pytest.raises(DataError, match="seq_lens is empty"):
        prepare(tmp_path / "p", corpus_file, vocab_size=400, seq_lens=(), progress=False)


def test_prepare_refuses_a_sequence_length_before_any_work(corpus_file, tmp_path):
    """A sequence length too short for [CLS] A [SEP] B [SEP] is refused before the tokenizer and
    the shards are built. Before, it was refused only once they were, after the run's longest
    parts. Fails on the old code (the tokenizer was written)."""
    with pytest.raises(DataError, match="max_seq_len=4 leaves no room"):
        prepare(tmp_path / "p", corpus_file, vocab_size=400, seq_lens=(128, 4), progress=False)
    assert not list((tmp_path / "p").rglob("*.model"))


def test_prepare_records_the_sentencepiece_release_that_trained_its_tokenizer(corpus_file, tmp_path, caplog,
                                                                               monkeypatch):
    """From the same WikiText-2 files, seed and trainer threads, sentencepiece 0.2.2 and 0.2.3
    train different tokenizers (552,533 tokens and 6,769 samples of 64 against 636,666 and
    7,498), so the release is an input of the data. ``prepare.json`` now records the release that trained each tokenizer
    (the old code recorded none and fails here). Training with a release other than
    pyproject.toml's pin warns, naming both. A tokenizer already prepared is reused under
    another release."""
    import logging
    import tomllib

    import sentencepiece as spm

    from vrgd_ds.data_pipeline.tokenizer import TRAINER_RELEASE

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert f"sentencepiece=={TRAINER_RELEASE}" in extras["train"]
    options = dict(vocab_size=400, seq_lens=(64,), workers=1, progress=False, tokenizer_threads=1, shard_tokens=10000)
    out = tmp_path / "prepared"
    prepare(out, corpus_file, **options)
    assert json.loads((out / "prepare.json").read_text())["tokenizer"]["trainer"] == f"sentencepiece {spm.__version__}"
    monkeypatch.setattr(spm, "__version__", "0.0.1")
    with caplog.at_level(logging.WARNING, logger="vrgd_ds.data_pipeline"):
        assert prepare(out, corpus_file, **options).built == ()
        assert "sentencepiece" not in caplog.text
        assert prepare(tmp_path / "other", corpus_file, **options).built == ("tokenizer", "shards")
    assert f"training the tokenizer with sentencepiece 0.0.1, not {TRAINER_RELEASE}" in caplog.text
    assert json.loads((tmp_path / "other" / "prepare.json").read_text())["tokenizer"]["trainer"] == "sentencepiece 0.0.1"


#: prepare() in another process that stops, holding whatever it holds, between training its
#: tokenizer and writing its shards until the file ``release`` exists (``paused`` says it stopped)
HELD_PREPARE = """
import sys, time
from pathlib import Path
import vrgd_ds.data_pipeline.prepare as prep
out, corpus, paused, release = map(Path, sys.argv[1:5])
write_shards = prep.write_shards
def held(*args, **kwargs):
    paused.touch()
    while not release.exists():
        time.sleep(0.05)
    return write_shards(*args, **kwargs)
prep.write_shards = held
prep.prepare(out, corpus, vocab_size=400, seq_lens=(64,), workers=1, progress=False)
"""


def test_a_prepare_of_a_directory_another_job_is_preparing_waits_and_reuses_what_it_built(corpus_file, tmp_path,
                                                                                         caplog):
    """Two jobs that prepare one directory at once (a Slurm array sharing ``job.data.path``) take
    turns: the second waits for the first, naming it, then reuses its tokenizer and shards. Fails
    on the old code (no lock): the second, started while the first was between its tokenizer and
    its shards, wrote the shards itself (built ``("shards",)``), into the directory the first
    then cleared and rewrote under it."""
    out, paused, release = tmp_path / "p", tmp_path / "paused", tmp_path / "release"
    first = subprocess.Popen([sys.executable, "-c", HELD_PREPARE, str(out), str(corpus_file), str(paused),
                              str(release)])
    try:
        wait_until(lambda: paused.exists() or first.poll() is not None, "the first prepare to reach its shards")
        assert first.poll() is None, "the first prepare ended before its shards"
        caplog.set_level(logging.INFO, logger="vrgd_ds.data_pipeline.locks")
        second: dict = {}
        thread = threading.Thread(target=lambda: second.update(prepared=prepare(
            out, corpus_file, vocab_size=400, seq_lens=(64,), workers=1, progress=False)))
        thread.start()
        wait_until(lambda: "waiting for another prepare" in caplog.text or not thread.is_alive(),
                  "the second prepare to wait or finish")
        release.touch()
        thread.join(timeout=300)
        assert first.wait(timeout=300) == 0
    finally:
        release.touch()
        if first.poll() is None:
            first.kill()
    assert f"pid {first.pid}" in caplog.text  # the waiting one says whom it waits for
    assert second["prepared"].built == ()
    ShardedCorpus(out / "shards", verify="full").check_tokenizer(Tokenizer.load(out / "tokenizer.model"))


@pytest.mark.parametrize("code, why", [(13, "Permission denied"), (28, "No space left on device")])
def test_a_refused_write_is_one_line_naming_the_file(tmp_path, capsys, monkeypatch, code, why):
    """``vrgd-data`` on a directory this user cannot write (a read-only share of prepared data,
    asked for another sequence length) or on a full disk: one line naming the file and what to
    do, exit 2. Fails on the old code, which ended in a Python traceback."""
    from vrgd_ds.data_pipeline import cli

    def refused(args):
        raise OSError(code, why, str(tmp_path / "data" / "prepare.json"))

    monkeypatch.setattr(cli, "_cmd_info", refused)
    assert main(["info", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'data' / 'prepare.json'}: {why}; ") and err.count("\n") == 1
