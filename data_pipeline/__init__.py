"""BERT pretraining data pipeline: corpus -> sentencepiece tokenizer -> memory-mapped shards -> samples.

The pretraining job uses this package; the optimizer library (``vrgd_ds``) never imports it.

Stages, each a module and a ``vrgd-data`` subcommand:

* :mod:`data_pipeline.corpus` reads documents (lists of sentences) from plain text, WikiText,
  JSONL, or the embedded default corpus (the documentation shipped with the interpreter).
* :mod:`data_pipeline.tokenizer` trains and loads a sentencepiece model with the BERT special
  tokens at fixed ids.
* :mod:`data_pipeline.shards` tokenises documents in parallel into sharded ``.npy`` files with a
  checksummed ``manifest.json`` and reads them back through memory maps.
* :mod:`data_pipeline.samples` / :mod:`data_pipeline.sampler` build sample indices and the
  resumable sampler on top of :class:`~data_pipeline.shards.ShardedCorpus`.
* :mod:`data_pipeline.prepare` runs all stages idempotently.

Names are resolved lazily so that ``import data_pipeline.errors`` (or the corpus readers) does not
pull in sentencepiece.
"""
from __future__ import annotations

import importlib
from typing import Any

from data_pipeline.errors import DataError

_LAZY = {
    "read_documents": "data_pipeline.corpus",
    "embedded_corpus": "data_pipeline.corpus",
    "split_sentences": "data_pipeline.corpus",
    "Tokenizer": "data_pipeline.tokenizer",
    "train_tokenizer": "data_pipeline.tokenizer",
    "ShardedCorpus": "data_pipeline.shards",
    "write_shards": "data_pipeline.shards",
    "prepare": "data_pipeline.prepare",
    "Prepared": "data_pipeline.prepare",
}

__all__ = ["DataError", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'data_pipeline' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
