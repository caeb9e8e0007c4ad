"""BERT pretraining data pipeline: corpus -> sentencepiece tokenizer -> memory-mapped shards -> samples.

The pretraining job uses this package; the optimizer library (``vrgd_ds``) never imports it.

Stages, each a module and a ``vrgd-data`` subcommand:

* :mod:`vrgd_ds.data_pipeline.corpus` reads documents (lists of sentences) from plain text, WikiText,
  JSONL, or the embedded default corpus (the documentation shipped with the interpreter).
* :mod:`vrgd_ds.data_pipeline.tokenizer` trains and loads a sentencepiece model with the BERT special
  tokens at fixed ids.
* :mod:`vrgd_ds.data_pipeline.shards` tokenises documents in parallel into sharded ``.npy`` files with a
  checksummed ``manifest.json`` and reads them back through memory maps.
* :mod:`vrgd_ds.data_pipeline.samples` / :mod:`vrgd_ds.data_pipeline.sampler` build sample indices and the
  resumable sampler on top of :class:`~vrgd_ds.data_pipeline.shards.ShardedCorpus`.
* :mod:`vrgd_ds.data_pipeline.prepare` runs all stages idempotently.

Names are resolved lazily so that ``import vrgd_ds.data_pipeline.errors`` (or the corpus readers) does not
pull in sentencepiece.
"""
from __future__ import annotations

import importlib
from typing import Any

from vrgd_ds.data_pipeline.errors import DataError

_LAZY = {
    "read_documents": "vrgd_ds.data_pipeline.corpus",
    "embedded_corpus": "vrgd_ds.data_pipeline.corpus",
    "split_sentences": "vrgd_ds.data_pipeline.corpus",
    "Tokenizer": "vrgd_ds.data_pipeline.tokenizer",
    "train_tokenizer": "vrgd_ds.data_pipeline.tokenizer",
    "ShardedCorpus": "vrgd_ds.data_pipeline.shards",
    "write_shards": "vrgd_ds.data_pipeline.shards",
    "prepare": "vrgd_ds.data_pipeline.prepare",
    "Prepared": "vrgd_ds.data_pipeline.prepare",
}

__all__ = ["DataError", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'vrgd_ds.data_pipeline' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
