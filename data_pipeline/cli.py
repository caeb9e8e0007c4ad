"""``vrgd-data`` (also ``python -m vrgd_ds.data_pipeline``): the data pipeline's stages as subcommands.

    vrgd-data prepare OUT [INPUT ...]           everything, idempotently (embedded corpus without INPUT)
    vrgd-data tokenizer --out M [INPUT ...]     train a sentencepiece model
    vrgd-data shard --tokenizer M --out D [INPUT ...]   tokenise into shards
    vrgd-data samples D --seq-len 128 ...       build sample indices over shards
    vrgd-data verify D [--full]                 check shards against their manifest
    vrgd-data info PATH                         describe shards, a tokenizer or a prepared directory

A :class:`~vrgd_ds.data_pipeline.errors.DataError` is printed as ``error: <message>`` (which names the
file or option at fault and the fix) and exits with status 2, without a traceback.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from vrgd_ds.data_pipeline.errors import DataError

logger = logging.getLogger(__name__)

EXAMPLES = """\
examples:
  vrgd-data prepare data/                      # embedded corpus, no download
  vrgd-data prepare data/ 'wiki/**/*.txt' --format text --vocab-size 30522
  vrgd-data tokenizer --out tok.model corpus.jsonl --field body --vocab-size 8000
  vrgd-data shard --tokenizer tok.model --out shards/ corpus.jsonl --workers 8
  vrgd-data samples shards/ --seq-len 128 --seq-len 512 --seed 42
  vrgd-data verify shards/ --full
"""


def _corpus(args: argparse.Namespace):
    from vrgd_ds.data_pipeline.corpus import Corpus, EmbeddedCorpus

    return EmbeddedCorpus() if not args.inputs else Corpus(args.inputs, args.format, args.field)


def _add_corpus_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="*", metavar="INPUT",
                   help="corpus files, directories or glob patterns (quote them); none: the embedded "
                        "corpus (pydoc topics + standard-library docstrings)")
    p.add_argument("--format", default="auto", choices=("auto", "text", "wikitext", "jsonl"),
                   help="corpus format (default: auto-detect per file by extension and content)")
    p.add_argument("--field", default="text", help="text field of JSONL records (default: text)")


def _add_workers_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=None,
                   help="tokenisation processes (default: usable CPUs); the output does not depend on it")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def _cmd_tokenizer(args: argparse.Namespace) -> int:
    from vrgd_ds.data_pipeline.tokenizer import train_tokenizer

    tok = train_tokenizer(
        _corpus(args), args.out, vocab_size=args.vocab_size, model_type=args.model_type, seed=args.seed,
        input_sentence_size=args.input_sentence_size, character_coverage=args.character_coverage,
        byte_fallback=args.byte_fallback, num_threads=args.threads,
    )
    print(f"{tok.path}: vocab_size={tok.vocab_size} sha256={tok.sha256}")
    return 0


def _cmd_shard(args: argparse.Namespace) -> int:
    from vrgd_ds.data_pipeline.shards import write_shards

    corpus = write_shards(_corpus(args), args.tokenizer, args.out, shard_tokens=args.shard_tokens,
                          workers=args.workers, progress=args.progress)
    print(f"{corpus.path}: {corpus.num_shards} shards, {corpus.num_documents} documents, "
          f"{corpus.num_sentences} sentences, {corpus.num_tokens} tokens ({corpus.dtype})")
    return 0


def _cmd_samples(args: argparse.Namespace) -> int:
    from vrgd_ds.data_pipeline.prepare import SAMPLES_DIR, SHARDS_DIR, TOKENIZER_FILE, prepare_lock
    from vrgd_ds.data_pipeline.samples import build_sample_index
    from vrgd_ds.data_pipeline.shards import ShardedCorpus

    corpus = ShardedCorpus(args.shards, verify="size")
    out = args.out
    shards = Path(args.shards).resolve()
    if out is None and shards.name == SHARDS_DIR and (shards.parent / TOKENIZER_FILE).is_file():
        out = shards.parent / SAMPLES_DIR  # a prepared directory's: where its jobs look for them
    extra = {} if args.next_sentence is None else {
        "next_sentence": None if args.next_sentence == "none" else args.next_sentence}
    if args.short_seq_prob is not None:
        extra["short_seq_prob"] = args.short_seq_prob
    prepared = out is not None and Path(out).resolve() == shards.parent / SAMPLES_DIR
    # into a prepared directory's samples/: one writer at a time, as the jobs that add theirs there
    with prepare_lock(shards.parent) if prepared else contextlib.nullcontext():
        for n in args.seq_len:
            print(build_sample_index(corpus, n, args.seed, out, **extra))
    return 0


def _cmd_prepare(args: argparse.Namespace) -> int:
    from vrgd_ds.data_pipeline.prepare import prepare

    result = prepare(
        args.output_dir, args.inputs or None, format=args.format, vocab_size=args.vocab_size,
        seq_lens=args.seq_len or (128, 512), seed=args.seed, workers=args.workers, progress=args.progress,
        field=args.field, model_type=args.model_type, tokenizer_threads=args.tokenizer_threads,
        shard_tokens=args.shard_tokens,
        next_sentence=None if args.next_sentence in (None, "none") else args.next_sentence,
    )
    print(f"tokenizer: {result.tokenizer}")
    print(f"shards:    {result.shards}")
    for n, path in result.sample_indices.items():
        print(f"samples (seq {n}): {path}")
    print(f"built: {', '.join(result.built) or 'nothing (all reused)'}")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from vrgd_ds.data_pipeline.shards import ShardedCorpus
    from vrgd_ds.data_pipeline.tokenizer import Tokenizer

    level = "full" if args.full else "size"
    corpus = ShardedCorpus(args.shards, verify=level)
    if args.tokenizer:
        corpus.check_tokenizer(Tokenizer.load(args.tokenizer))
    print(f"ok ({level}): {corpus}")
    return 0


def _describe(path: Path) -> dict:
    from vrgd_ds.data_pipeline.prepare import RECORD, SAMPLES_DIR, SHARDS_DIR
    from vrgd_ds.data_pipeline.shards import MANIFEST, ShardedCorpus
    from vrgd_ds.data_pipeline.tokenizer import Tokenizer

    if path.is_file():
        tok = Tokenizer.load(path)
        return {"tokenizer": str(path), "vocab_size": tok.vocab_size, "sha256": tok.sha256,
                "special_ids": {"pad": tok.pad_id, "unk": tok.unk_id, "cls": tok.cls_id,
                                "sep": tok.sep_id, "mask": tok.mask_id}}
    if (path / RECORD).is_file():
        info = {"prepared": str(path), "record": json.loads((path / RECORD).read_text())}
        if (path / SHARDS_DIR / MANIFEST).is_file():
            info["shards"] = _describe(path / SHARDS_DIR)
            info["shards"]["sample_indices"] = sorted(p.name for p in (path / SAMPLES_DIR).glob("samples_*.npy"))
        return info
    corpus = ShardedCorpus(path, verify="none")
    m = corpus.manifest
    return {
        "shards": str(path), "source": m.get("source"), "num_shards": corpus.num_shards,
        "num_documents": corpus.num_documents, "num_sentences": corpus.num_sentences,
        "num_tokens": corpus.num_tokens, "dtype": corpus.dtype.name, "vocab_size": corpus.vocab_size,
        "tokenizer_sha256": corpus.tokenizer_sha256,
        "sample_indices": sorted(p.name for p in path.glob("samples_*.npy")),
    }


def _cmd_info(args: argparse.Namespace) -> int:
    info = _describe(Path(args.path))
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        for key, value in info.items():
            print(f"{key}: {json.dumps(value) if isinstance(value, (dict, list)) else value}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vrgd-data",
        description="BERT pretraining data: corpus -> sentencepiece tokenizer -> memory-mapped shards -> sample indices.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("prepare", help="tokenizer + shards + sample indices, skipping what is up to date",
                       description="Build everything a pretraining run needs in OUTPUT_DIR (tokenizer.model, shards/, "
                                   "samples/, prepare.json); steps whose outputs are valid and current are reused.")
    p.add_argument("output_dir", metavar="OUTPUT_DIR")
    _add_corpus_args(p)
    p.add_argument("--vocab-size", type=int, default=None,
                   help="vocabulary incl. 5 specials (default: 30522; 8192 for the embedded corpus)")
    p.add_argument("--model-type", default="unigram", choices=("unigram", "bpe"))
    p.add_argument("--tokenizer-threads", type=int, default=8,
                   help="sentencepiece trainer threads; the model depends on it (default: 8)")
    p.add_argument("--seq-len", type=int, action="append", help="sample index per sequence length (repeatable; default: 128 and 512)")
    p.add_argument("--seed", type=int, default=0, help="seed for tokenizer sampling and sample indices (default: 0)")
    p.add_argument("--shard-tokens", type=int, default=1 << 25, help="tokens per shard (default: 2^25)")
    p.add_argument("--next-sentence", choices=("nsp", "sop", "none"), default=None,
                   help="sentence-pair task of the sample indices (default: the sample builder's)")
    _add_workers_args(p)
    p.set_defaults(func=_cmd_prepare, command_parser=p)

    p = sub.add_parser("tokenizer", help="train a sentencepiece tokenizer with BERT special ids",
                       description="Train a sentencepiece model; [PAD]=0 [UNK]=1 [CLS]=2 [SEP]=3 [MASK]=4.")
    _add_corpus_args(p)
    p.add_argument("--out", required=True, help="model file to write, e.g. tokenizer.model")
    p.add_argument("--vocab-size", type=int, default=30522, help="vocabulary incl. 5 specials (default: 30522)")
    p.add_argument("--model-type", default="unigram", choices=("unigram", "bpe"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=8, help="trainer threads; the model depends on it (default: 8)")
    p.add_argument("--input-sentence-size", type=int, default=4_000_000,
                   help="train on a seeded sample of at most this many sentences; 0: all (default: 4M)")
    p.add_argument("--character-coverage", type=float, default=0.9995)
    p.add_argument("--byte-fallback", action="store_true", help="encode uncovered characters as bytes, not [UNK]")
    p.set_defaults(func=_cmd_tokenizer, command_parser=p)

    p = sub.add_parser("shard", help="tokenise a corpus into memory-mapped shards",
                       description="Tokenise documents into shard_*.npy files plus manifest.json in --out "
                                   "(a previous shard set there is replaced).")
    _add_corpus_args(p)
    p.add_argument("--tokenizer", required=True, help="sentencepiece model from `vrgd-data tokenizer`")
    p.add_argument("--out", required=True, help="shard directory")
    p.add_argument("--shard-tokens", type=int, default=1 << 25, help="tokens per shard (default: 2^25)")
    _add_workers_args(p)
    p.set_defaults(func=_cmd_shard, command_parser=p)

    p = sub.add_parser("samples", help="build sample indices over shards",
                       description="Build one sample index per --seq-len (reused when up to date).")
    p.add_argument("shards", help="shard directory")
    p.add_argument("--seq-len", type=int, action="append", required=True, help="sequence length (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="directory for the indices (default: a prepared directory's samples/, "
                   "where its jobs look; else the shard directory)")
    p.add_argument("--next-sentence", choices=("nsp", "sop", "none"), default=None,
                   help="sentence-pair task (default: the sample builder's)")
    p.add_argument("--short-seq-prob", type=float, default=None, help="probability of a shorter target length (BERT: 0.1)")
    p.set_defaults(func=_cmd_samples, command_parser=p)

    p = sub.add_parser("verify", help="check shards against their manifest",
                       description="Check that every shard file exists with the recorded size and shape; "
                                   "--full also recomputes every sha256.")
    p.add_argument("shards", help="shard directory")
    p.add_argument("--full", action="store_true", help="recompute sha256 sums (reads every byte)")
    p.add_argument("--tokenizer", default=None, help="also check the shards were written with this model")
    p.set_defaults(func=_cmd_verify, command_parser=p)

    p = sub.add_parser("info", help="describe shards, a tokenizer model or a prepared directory")
    p.add_argument("path", help="shard directory, .model file, or `prepare` output directory")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_info, command_parser=p)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, with a command's inputs allowed after its options
    (``prepare OUT --vocab-size 8000 a.txt b.txt``): argparse fills a ``nargs="*"`` positional at
    its first chance and calls later ones unrecognized, so what the first pass leaves over is
    settled by parsing the command's arguments again, intermixed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args, rest = build_parser().parse_known_args(argv)
    if rest:
        own = argv[argv.index(args.command) + 1:]  # only -v precedes the command, and it takes no value
        vars(args).update(vars(args.command_parser.parse_intermixed_args(own)))
    return args


#: the file system's refusals ``main`` reports as one line naming the file
_REFUSED = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``vrgd-data``; returns the exit status."""
    args = parse_args(argv)
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the file system's refusal (a read-only share, no space): the file and why, no traceback
        if e.errno not in _REFUSED or not e.filename:
            raise
        print(f"error: {e.filename}: {e.strerror}; this user must be able to read the inputs and write the output "
              "directory, and its disk must have room", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
