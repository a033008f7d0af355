"""A tiny random-weight BERT saved as a sentence-transformers directory, for embed jobs.

Built offline in a test's tmp dir: a character WordPiece vocabulary (every ASCII letter, digit and
punctuation mark, alone and as a ##continuation), a 2-layer BERT, and the sentence-transformers
modules (mean pooling, Normalize) with a short max_seq_length, so long inputs are cut as
sentence-transformers cuts them.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import BertConfig, BertModel, BertTokenizerFast

MAX_SEQ_LENGTH = 48
HIDDEN_SIZE = 32


def _vocab() -> list[str]:
    chars = string.ascii_lowercase + string.digits + string.punctuation
    return ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *(f"##{c}" for c in chars)]


def save_tiny_encoder_dir(path: Path, *, seed: int = 0, pooling: str = "mean", normalize: bool = True) -> str:
    """The tiny BERT as sentence-transformers saves a model: the transformer at the top, then
    modules.json, sentence_bert_config.json, 1_Pooling/ (and 2_Normalize/ when `normalize`)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab = {token: i for i, token in enumerate(_vocab())}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    tokenizer = BertTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]",
                                  cls_token="[CLS]", mask_token="[MASK]", model_max_length=512)
    tokenizer.save_pretrained(path)
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=len(_vocab()), hidden_size=HIDDEN_SIZE, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64, max_position_embeddings=128)
    BertModel(config).eval().save_pretrained(path)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": HIDDEN_SIZE, "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": pooling == "last", "include_prompt": True}))
    if normalize:
        (path / "2_Normalize").mkdir(exist_ok=True)
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": MAX_SEQ_LENGTH,
                                                                "do_lower_case": False}))
    return str(path)


def reference_embeddings(model_dir: str, texts: list[str]):
    """sentence-transformers' own encode of `texts` (float32 numpy rows)."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(model_dir, device="cpu").encode(texts, batch_size=4, convert_to_numpy=True)
