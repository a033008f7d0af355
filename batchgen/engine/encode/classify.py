"""classify: a sequence classifier's logits per row, as scores and a label.

Where the head of the checkpoint's class is known, the base model runs once over the packed batch and
the head runs on each row's pooled position, as the class's own forward pools it:
- BERT: the pooler (dense + tanh) and the classifier on the [CLS] position (the row's first token);
- RoBERTa, XLM-RoBERTa, CamemBERT: the classification head on the <s> position (the row's first token);
- ModernBERT: its prediction head and classifier on the first token or the row's mean, as its
  config's classifier_pooling says;
- decoders on transformers' GenericForSequenceClassification (Llama, Qwen2/3, Mistral, Gemma 2/3 reward
  models): the `score` linear on the row's rightmost token that is not the pad token (the class's own
  rule, so a row ending in pad-valued tokens, where eos is the pad, reads the same token it does).
Any other class (DistilBERT, DeBERTa, ELECTRA, remote code, ...) pools or projects its own way: its
rows run through the whole HF model as one padded batch (`padded_logits`), the model's forward verbatim.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum

import numpy as np
import torch
from transformers import PreTrainedModel
from transformers.modeling_layers import GenericForSequenceClassification

_FIRST_TOKEN_HEADS = ("roberta", "xlm-roberta", "camembert", "xlm-roberta-xl")


class HeadKind(Enum):
    BERT_POOLER = "bert_pooler"  # base_model.pooler then classifier, on the first token
    FIRST_TOKEN = "first_token"  # classifier (a RobertaClassificationHead) on the first token
    LAST_TOKEN = "last_token"  # score on the rightmost non-pad token
    MODERNBERT = "modernbert"  # head then classifier, on the first token or the row's mean
    PADDED = "padded"  # the whole HF model on a padded batch


def head_kind(model: PreTrainedModel) -> HeadKind:
    """How this classifier's head is applied to packed hidden states (HeadKind.PADDED: it is not)."""
    model_type = model.config.model_type
    if isinstance(model, GenericForSequenceClassification) and isinstance(getattr(model, "score", None),
                                                                          torch.nn.Linear):
        return HeadKind.LAST_TOKEN
    if model_type == "bert" and getattr(model.base_model, "pooler", None) is not None \
            and isinstance(getattr(model, "classifier", None), torch.nn.Linear):
        return HeadKind.BERT_POOLER
    if model_type == "modernbert" and model.config.classifier_pooling in ("cls", "mean") \
            and hasattr(model, "head") and hasattr(model, "classifier"):
        return HeadKind.MODERNBERT
    if model_type in _FIRST_TOKEN_HEADS and getattr(model, "classifier", None) is not None:
        return HeadKind.FIRST_TOKEN
    return HeadKind.PADDED


def is_causal(model: PreTrainedModel) -> bool:
    """Does the base model attend causally (a decoder reward model) or both ways (an encoder)?"""
    return head_kind(model) is HeadKind.LAST_TOKEN


@torch.no_grad()
def classify_hidden(model: PreTrainedModel, hidden: torch.Tensor, input_ids: torch.Tensor,
                    cu_seqlens: Sequence[int]) -> torch.Tensor:
    """Logits [rows, num_labels] from the base model's hidden states [T, hidden] of a packed batch
    whose rows span input_ids [T] at cu_seqlens; only for a head_kind other than PADDED."""
    kind = head_kind(model)
    assert kind is not HeadKind.PADDED, "a padded head runs through padded_logits"
    assert hidden.shape[0] == input_ids.shape[0] == cu_seqlens[-1], (hidden.shape, input_ids.shape, cu_seqlens)
    device = hidden.device
    starts = torch.tensor(list(cu_seqlens[:-1]), device=device, dtype=torch.long)
    if kind is HeadKind.LAST_TOKEN:
        pooled = hidden[_last_non_pad(model, input_ids.to(device), cu_seqlens)]
        return model.score(pooled)
    if kind is HeadKind.MODERNBERT:
        if model.config.classifier_pooling == "cls":
            pooled = hidden[starts]
        else:
            pooled = _row_means(hidden, cu_seqlens)
        return model.classifier(model.head(pooled))
    first = hidden[starts][:, None, :]  # [rows, 1, hidden]: the heads read features[:, 0]
    if kind is HeadKind.BERT_POOLER:
        return model.classifier(model.base_model.pooler(first))
    return model.classifier(first)


def _row_means(hidden: torch.Tensor, cu_seqlens: Sequence[int]) -> torch.Tensor:
    """The mean hidden state of each row of a packed batch, summed in the model's dtype as the
    padded forward sums its masked rows."""
    lengths = torch.tensor([cu_seqlens[i + 1] - cu_seqlens[i] for i in range(len(cu_seqlens) - 1)],
                           device=hidden.device)
    rows = torch.repeat_interleave(torch.arange(lengths.numel(), device=hidden.device), lengths)
    sums = torch.zeros((lengths.numel(), hidden.shape[1]), dtype=hidden.dtype, device=hidden.device)
    return sums.index_add_(0, rows, hidden) / lengths[:, None].to(hidden.dtype)


def _last_non_pad(model: PreTrainedModel, input_ids: torch.Tensor, cu_seqlens: Sequence[int]) -> torch.Tensor:
    """Each row's rightmost token that is not the pad token (its first where every token is the pad
    token; its last where the model has no pad token), as GenericForSequenceClassification pools."""
    device = input_ids.device
    lengths = torch.tensor([cu_seqlens[i + 1] - cu_seqlens[i] for i in range(len(cu_seqlens) - 1)], device=device)
    starts = torch.tensor(list(cu_seqlens[:-1]), device=device, dtype=torch.long)
    pad_id = model.config.get_text_config().pad_token_id
    if pad_id is None:
        return starts + lengths - 1
    rows = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)
    offsets = torch.arange(input_ids.numel(), device=device) - starts[rows]
    keep = torch.where(input_ids != pad_id, offsets, torch.zeros_like(offsets))
    last = torch.zeros(lengths.numel(), dtype=torch.long, device=device).scatter_reduce(
        0, rows, keep, reduce="amax", include_self=True)
    return starts + last


@torch.no_grad()
def padded_logits(model: PreTrainedModel, rows: Sequence[Sequence[int]]) -> torch.Tensor:
    """Logits [rows, num_labels] of the whole HF model on the rows right-padded into one batch; one
    row at a time where the model has no pad token (its class refuses a batch then)."""
    device = next(model.parameters()).device
    pad_id = model.config.get_text_config().pad_token_id
    if pad_id is None:
        return torch.cat([model(input_ids=torch.tensor([list(r)], device=device)).logits for r in rows])
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(rows), width), dtype=torch.long, device=device)
    for i, row in enumerate(rows):
        input_ids[i, :len(row)] = torch.tensor(list(row), device=device)
        mask[i, :len(row)] = 1
    return model(input_ids=input_ids, attention_mask=mask).logits


def scores_and_labels(logits: torch.Tensor, problem_type: str | None, id2label: dict[int, str]
                      ) -> list[tuple[np.ndarray, str | None]]:
    """(float32 scores, label) per row, as the model's problem_type reads its logits: sigmoid per
    label for multi_label_classification, the raw value for regression or a single output (no label),
    else softmax; the label is id2label of the highest score (its index where id2label lacks it)."""
    logits = logits.float()
    num_labels = logits.shape[-1]
    if problem_type == "regression" or num_labels == 1:
        return [(row, None) for row in logits.cpu().numpy()]
    probs = logits.sigmoid() if problem_type == "multi_label_classification" else logits.softmax(-1)
    best = probs.argmax(-1).tolist()
    return [(row, id2label.get(i, str(i))) for row, i in zip(probs.cpu().numpy(), best, strict=True)]
