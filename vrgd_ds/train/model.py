"""BERT for pretraining, built from a ``transformers.BertConfig`` (nothing from a hub)."""
from __future__ import annotations

import functools
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
    from vrgd_ds.data_pipeline.samples import padded_length

    # a batch is as wide as its longest sample rounded up (collate): a position for each column
    fields = dict(MODEL_SIZES[cfg.size], vocab_size=vocab_size, max_position_embeddings=max(512, padded_length(max_seq_len)),
                  type_vocab_size=2, pad_token_id=PAD_ID)
    unknown = sorted(k for k in cfg.overrides if not hasattr(transformers.BertConfig(), k))
    if unknown:
        raise ConfigError(f"job.model.overrides.{unknown[0]}: not a BertConfig field")
    fields.update(cfg.overrides)
    try:
        return transformers.BertConfig(**fields)
    except Exception as e:  # transformers' validation: its own error types, which name the field
        raise _refused(cfg, e) from None


def _refused(cfg: ModelConfig, error: Exception) -> ConfigError:
    """transformers' refusal of the model ``cfg`` makes, as the job's error naming the overrides."""
    keys = ", ".join(sorted(cfg.overrides)) or "none"
    return ConfigError(f"job.model: the {cfg.size} BERT with job.model.overrides ({keys}) is refused by transformers: "
                       f"{type(error).__name__}: {' '.join(str(error).split())[:300]}")


#: the transformers releases the job's BERT is tested on: it subclasses ``BertForPreTraining`` /
#: ``BertForMaskedLM`` and reads their modules (``bert``, ``cls.predictions``, ``cls.seq_relationship``)
#: and ``modeling_bert``'s output classes (pyproject.toml's ``[train]`` extra bounds it the same way)
TESTED_TRANSFORMERS = ((5, 24), (6, 0))


def check_transformers() -> None:
    """Refuses a transformers release outside ``TESTED_TRANSFORMERS``, naming the range."""
    import transformers

    have = tuple(int(part) for part in transformers.__version__.split(".")[:2] if part.isdigit())
    low, high = TESTED_TRANSFORMERS
    if not low <= have < high:
        raise ConfigError(f"transformers {transformers.__version__}: the job's BERT subclasses transformers' BERT "
                          f"classes and reads their modules, tested on releases from {low[0]}.{low[1]} to before "
                          f"{high[0]}.{high[1]}; install them with: pip install \"transformers>={low[0]}.{low[1]},"
                          f"<{high[0]}\"")


def check_model(cfg: ModelConfig, max_seq_len: int) -> None:
    """Builds the model ``cfg`` describes on the meta device (no memory, no data: any vocabulary
    size), so that an override transformers refuses (``"hidden_act": "gleu"``, a head count that
    does not divide the hidden size, a string where a number goes) is a configuration error
    before any work, not a traceback after the data is prepared."""
    import torch

    check_transformers()
    config = bert_config(cfg, cfg.vocab_size or 128, max_seq_len)
    try:
        with torch.device("meta"):
            masked_positions_model(False)(config)
    except Exception as e:
        raise _refused(cfg, e) from None


def build_model(cfg: ModelConfig, vocab_size: int, max_seq_len: int, next_sentence: bool) -> nn.Module:
    """``BertForPreTraining`` (MLM + NSP/SOP head) or ``BertForMaskedLM``, predicting at the masked
    positions only (``masked_positions_model``)."""
    config = bert_config(cfg, vocab_size, max_seq_len)
    return masked_positions_model(next_sentence)(config)


def masked_positions_of(labels: Any) -> Any:
    """The indices, in the flattened batch and in row-major order, of the positions whose label is
    not -100 (the MLM targets)."""
    return (labels.flatten() != -100).nonzero().squeeze(1)


@functools.cache  # one class per head: instances of the same model are of the same type
def masked_positions_model(next_sentence: bool) -> type:
    """``transformers.BertForPreTraining`` or ``BertForMaskedLM`` whose forward, given ``labels``,
    runs the MLM head (transform and vocabulary decoder) on the masked positions only, as the
    reference BERT pretraining does (Devlin et al. 2019, ``masked_lm_positions``). The loss is the
    library's (mean cross-entropy over the labels that are not -100, plus the next-sentence
    loss); ``logits`` / ``prediction_logits`` hold the masked positions' rows in row-major order
    (``labels[labels != -100]`` is their order). ``masked_positions``, those positions' indices in
    the flattened batch (``masked_positions_of``, found on the host where the labels are), spare
    the device the sync that finding them there takes. The head's cost falls to the share of
    positions masked (15%): tiny BERT with 8,000 pieces 2.51x fewer FLOPs per training micro-step,
    BERT-large 1.09x (``benchmarks/masked_head.py``). Without ``labels`` the forward is the
    library's. The library's modules and parameter names: checkpoints are the library model's."""
    import torch.nn.functional as F
    import transformers
    from transformers.models.bert.modeling_bert import BertForPreTrainingOutput, MaskedLMOutput

    base = transformers.BertForPreTraining if next_sentence else transformers.BertForMaskedLM

    class MaskedPositions(base):  # type: ignore[misc, valid-type]
        def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, labels=None,
                    next_sentence_label=None, masked_positions=None, **kwargs):
            extra = {"next_sentence_label": next_sentence_label} if next_sentence else {}
            if labels is None:
                return super().forward(input_ids=input_ids, attention_mask=attention_mask,
                                       token_type_ids=token_type_ids, **extra, **kwargs)
            out = self.bert(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                            return_dict=True, **kwargs)
            if masked_positions is None:
                masked_positions = masked_positions_of(labels)  # on the labels' device
            hidden = out.last_hidden_state.flatten(0, 1).index_select(0, masked_positions)
            head = self.cls.predictions if next_sentence else self.cls
            logits = head(hidden)
            loss = F.cross_entropy(logits, labels.flatten().index_select(0, masked_positions))
            if not next_sentence:
                return MaskedLMOutput(loss=loss, logits=logits)
            order = self.cls.seq_relationship(out.pooler_output)
            total = None if next_sentence_label is None else loss + F.cross_entropy(
                order.view(-1, 2), next_sentence_label.view(-1))
            return BertForPreTrainingOutput(loss=total, prediction_logits=logits, seq_relationship_logits=order)

    MaskedPositions.__name__ = MaskedPositions.__qualname__ = base.__name__
    return MaskedPositions
