"""The job's BERT predicts at the masked positions only (``model.masked_positions_model``): the
same loss, gradients and masked-position logits as the library model with the same weights,
for less compute in the head, counted exactly."""
from __future__ import annotations

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from vrgd_ds.train.config import ModelConfig
from vrgd_ds.train.model import bert_config, build_model, masked_positions_of

VOCAB, SEQ, BATCH = 500, 32, 6


def inputs(next_sentence: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(5, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.full_like(ids, -100)
    chosen = torch.rand(BATCH, SEQ, generator=gen) < 0.15
    labels[chosen] = ids[chosen]
    attention = torch.ones_like(ids)
    attention[0, SEQ - 5:] = 0  # a padded sample
    out = dict(input_ids=ids, token_type_ids=(torch.arange(SEQ) >= SEQ // 2).long().expand(BATCH, SEQ),
               attention_mask=attention, labels=labels)
    if next_sentence:
        out["next_sentence_label"] = torch.randint(0, 2, (BATCH,), generator=gen)
    return out


def pair(next_sentence: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The job's model and the library's, same weights, dropout off (one forward each compared)."""
    cfg = ModelConfig(size="tiny", overrides={"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0})
    torch.manual_seed(0)
    ours = build_model(cfg, VOCAB, SEQ, next_sentence)
    library = (transformers.BertForPreTraining if next_sentence else transformers.BertForMaskedLM)(
        bert_config(cfg, VOCAB, SEQ))
    library.load_state_dict(ours.state_dict())
    return ours, library


@pytest.mark.parametrize("next_sentence", [False, True])
def test_the_masked_positions_model_trains_as_the_library_model(next_sentence):
    """Loss, every gradient, and the logits at the masked positions, against the library model's
    full-sequence head; the parameter names (checkpoints) are the library's."""
    ours, library = pair(next_sentence)
    batch = inputs(next_sentence)
    assert isinstance(ours, type(library)) and list(ours.state_dict()) == list(library.state_dict())
    mine, theirs = ours(**batch), library(**batch)
    torch.testing.assert_close(mine.loss, theirs.loss, rtol=1e-6, atol=1e-6)
    mask = batch["labels"] != -100
    key = "prediction_logits" if next_sentence else "logits"
    torch.testing.assert_close(mine[key], theirs[key][mask], rtol=1e-5, atol=1e-5)
    mine.loss.backward()
    theirs.loss.backward()
    for (name, a), b in zip(ours.named_parameters(), library.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)
    without = ours(**{k: v for k, v in batch.items() if k not in ("labels", "next_sentence_label")})
    assert without.loss is None and without[key].shape == (BATCH, SEQ, VOCAB)  # no labels: the library's forward


def test_the_head_runs_on_the_masked_rows_only():
    """Training FLOPs (forward and backward, every matmul counted): the library's less the head's
    on each position that is not masked, 6 (h² + h V) per row (the transform's h × h and the
    decoder's h × V, each once forward and twice backward), exactly."""
    ours, library = pair(False)
    batch = inputs(False)
    counts = []
    for model in (ours, library):
        with FlopCounterMode(display=False) as counter:
            model(**batch).loss.backward()
        counts.append(counter.get_total_flops())
    hidden = ours.config.hidden_size
    unmasked = int((batch["labels"] == -100).sum())
    assert counts[1] - counts[0] == 6 * (hidden * hidden + hidden * VOCAB) * unmasked


class Ops(TorchDispatchMode):
    """The aten operations a block runs, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_positions_found_on_the_host_leave_the_device_nothing_to_sync():
    """Given ``masked_positions`` (the job finds them on the host, where the collated labels are:
    engines/deepspeed.py), a training micro-step runs no ``nonzero`` (on a GPU the host waits for
    it to learn the count); found from the labels on their device, one. Same loss either way."""
    ours, _ = pair(False)
    batch = inputs(False)
    losses, nonzero = [], []
    for given in (True, False):
        extra = {"masked_positions": masked_positions_of(batch["labels"])} if given else {}
        with Ops() as ops:
            loss = ours(**batch, **extra).loss
            loss.backward()
        losses.append(loss.detach())
        nonzero.append(sum(name.startswith("nonzero") for name in ops.names))
    assert nonzero == [0, 1] and torch.equal(losses[0], losses[1])


def test_a_transformers_release_outside_the_tested_range_is_refused_before_any_work(monkeypatch):
    """The job's BERT subclasses transformers' BERT classes and reads their modules: a release
    outside ``TESTED_TRANSFORMERS`` (4.x, which ``[train]`` allowed, or a next major) is refused by
    the config check that runs before any work, naming the range to install; the release tested
    passes. Fails on the old code, which checked no release."""
    import sys

    from vrgd_ds.train.config import ConfigError, ModelConfig
    from vrgd_ds.train.model import check_model

    check_model(ModelConfig(size="tiny"), 64)
    for release in ("4.45.0", "6.0.0"):  # the module the job imports (transformers' lazy module stands in sys.modules)
        monkeypatch.setattr(sys.modules["transformers"], "__version__", release)
        with pytest.raises(ConfigError, match=rf'transformers {release}: .*pip install "transformers>=5.24,<6"'):
            check_model(ModelConfig(size="tiny"), 64)
