"""Tiny random-weight causal LMs and a byte-level tokenizer, built offline.

Nothing here downloads anything. Models are float32 on the CPU, small enough that a whole
equivalence test runs in seconds. The fixtures in tests/conftest.py and the benchmarks that need a
model of no size (benchmarks/soaks/soak_kill.py, benchmarks/end_to_end/checkpoint_cost.py) build on these.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]
BYTE_OFFSET = len(SPECIAL_TOKENS)
VOCAB_SIZE = BYTE_OFFSET + 256
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer(chat: bool = True) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer: ids 0-4 are specials, then one id per byte (no merges)."""
    byte_to_unicode = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(byte_to_unicode):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|bos|>", eos_token="<|eos|>",
        model_max_length=512,
    )
    if chat:
        fast.chat_template = CHAT_TEMPLATE
    return fast


def _common(**overrides):
    kw = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    kw.update(overrides)
    return kw


TINY_CONFIGS = {
    "llama": lambda: LlamaConfig(**_common()),
    "qwen2": lambda: Qwen2Config(**_common(use_sliding_window=False)),
    "mistral": lambda: MistralConfig(**_common(sliding_window=None)),
}


def make_tiny_model(arch: str = "llama", seed: int = 0, eos_boost: float = 0.0):
    """Random-weight model; `eos_boost` raises the EOS logit bias so some greedy runs stop early."""
    torch.manual_seed(seed)
    config = TINY_CONFIGS[arch]()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    model.eval()
    if eos_boost:
        with torch.no_grad():
            head = model.get_output_embeddings()
            # A bias-free head: shift EOS's row toward the mean hidden direction instead.
            head.weight[config.eos_token_id] += eos_boost * head.weight.mean(0)
    return model


def save_tiny_model_dir(path) -> str:
    """The tiny Llama and its tokenizer saved as a local HF directory, as a user passes --model."""
    make_tiny_model("llama").save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return str(path)
