"""Tiny random-weight embedding models saved as sentence-transformers directories, built offline.

Each is a real `SentenceTransformer` (Transformer, Pooling, optionally Normalize) over a tiny HF
encoder, saved with `save()`, so the directory is exactly what sentence-transformers writes and its
`encode` is the reference. The tokenizer is tests/tiny.py's byte-level one with a template that wraps
every text in <|bos|> ... <|eos|>, so truncation has special tokens at both ends to keep.
"""

from __future__ import annotations

from pathlib import Path

import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules import Normalize, Transformer
from sentence_transformers.sentence_transformer.modules import Pooling
from tokenizers.processors import TemplateProcessing
from transformers import AutoModel, BertConfig, ModernBertConfig, XLMRobertaConfig

from tests.tiny import VOCAB_SIZE, make_tokenizer

HIDDEN = 32
_ENCODER = dict(vocab_size=VOCAB_SIZE, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=128, pad_token_id=0)

ENCODER_CONFIGS = {
    "bert": lambda: BertConfig(**_ENCODER),
    "xlm-roberta": lambda: XLMRobertaConfig(**_ENCODER),  # pad 0: positions from 1
    # local attention over 8 tokens: longer rows cross the window
    "modernbert": lambda: ModernBertConfig(**{**_ENCODER, "num_attention_heads": 2}, local_attention=8,
                                           bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2),
}


def wrapping_tokenizer():
    tokenizer = make_tokenizer(chat=False)
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|bos|> $A <|eos|>", special_tokens=[("<|bos|>", 1), ("<|eos|>", 2)])
    return tokenizer


def save_st_model(path: Path, arch: str, *, pooling: str = "mean", normalize: bool = True,
                  max_seq_length: int = 24, seed: int = 0) -> Path:
    """A tiny sentence-transformers model of `arch` saved at `path`."""
    torch.manual_seed(seed)
    hf_dir = path.parent / f"{path.name}-hf"
    AutoModel.from_config(ENCODER_CONFIGS[arch](), dtype=torch.float32).save_pretrained(hf_dir)
    wrapping_tokenizer().save_pretrained(hf_dir)
    modules = [Transformer(str(hf_dir), max_seq_length=max_seq_length), Pooling(HIDDEN, pooling_mode=pooling)]
    if normalize:
        modules.append(Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(path))
    return path
