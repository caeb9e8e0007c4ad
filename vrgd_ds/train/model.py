"""BERT for pretraining, built from a ``transformers.BertConfig`` (nothing from a hub)."""
from __future__ import annotations

from typing import Any

from torch import nn

from vrgd_ds.train.config import MODEL_SIZES, ConfigError, ModelConfig

PAD_ID = 0  # the data pipeline's [PAD]


def bert_config(cfg: ModelConfig, vocab_size: int, max_seq_len: int) -> Any:
    """The ``BertConfig`` of ``cfg`` for a tokenizer of ``vocab_size`` pieces."""
    import transformers

    if cfg.vocab_size is not None and cfg.vocab_size != vocab_size:
        raise ConfigError(f"job.model.vocab_size: {cfg.vocab_size} does not match the tokenizer's {vocab_size} "
                          "pieces; remove the key (it is taken from the tokenizer) or use the matching tokenizer")
    fields = dict(MODEL_SIZES[cfg.size], vocab_size=vocab_size, max_position_embeddings=max(512, max_seq_len),
                  type_vocab_size=2, pad_token_id=PAD_ID)
    unknown = sorted(k for k in cfg.overrides if not hasattr(transformers.BertConfig(), k))
    if unknown:
        raise ConfigError(f"job.model.overrides.{unknown[0]}: not a BertConfig field")
    fields.update(cfg.overrides)
    return transformers.BertConfig(**fields)


def build_model(cfg: ModelConfig, vocab_size: int, max_seq_len: int, next_sentence: bool) -> nn.Module:
    """``BertForPreTraining`` (MLM + NSP/SOP head) or ``BertForMaskedLM``."""
    import transformers

    config = bert_config(cfg, vocab_size, max_seq_len)
    return transformers.BertForPreTraining(config) if next_sentence else transformers.BertForMaskedLM(config)
