"""A tiny HF model and the byte-level tokenizer of tests/tiny.py written as a GGUF file, laid out
as llama.cpp's convert_hf_to_gguf.py lays one out, so transformers' GGUF reader turns it back into
the same model (engine/model/gguf_cache.py converts a user's .gguf that way).

The gguf package writes the file; the tensor names are the inverse of the map transformers reads
them with, and each tensor is stored as llama.cpp stores it (Llama's q/k rows permuted for its
rotary layout, Gemma's norms as 1 + weight, MoE experts' gate and up apart), the inverse of
transformers' tensor processors.
Float32 throughout: the round trip is exact.
"""

from __future__ import annotations

import gguf
import numpy as np
from transformers import PreTrainedModel, PreTrainedTokenizerFast
from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

# HF model_type -> GGUF architecture, for the families transformers converts and this writer lays out
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
                      "gemma3_text": "gemma3", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
TOKEN_TYPE_NORMAL, TOKEN_TYPE_CONTROL, TOKEN_TYPE_BYTE = 1, 3, 6


def write_gguf(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, path) -> str:
    config = model.config
    arch = GGUF_ARCHITECTURES[config.model_type]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {config.model_type}")
    _add_config(writer, arch, config)
    if arch.startswith("gemma"):
        _add_sentencepiece_tokenizer(writer, tokenizer)
    else:
        _add_tokenizer(writer, tokenizer)
    state = model.state_dict()
    gguf_names = get_gguf_hf_weights_map(model, TENSOR_PROCESSORS.get(arch, TensorProcessor)(), model_type=arch)
    embedding = model.get_input_embeddings().weight.data_ptr()
    # every tensor but a tied head, which llama.cpp writes once, as the embedding
    assert set(state) - set(gguf_names.values()) <= {n for n, t in state.items() if t.data_ptr() == embedding}
    for gguf_name, hf_name in gguf_names.items():
        weights = _as_stored(arch, gguf_name, state[hf_name].float().numpy(), config)
        writer.add_tensor(gguf_name if gguf_name.endswith((".weight", ".bias")) else f"{gguf_name}.weight", weights)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _add_config(writer: gguf.GGUFWriter, arch: str, config) -> None:
    writer.add_context_length(config.max_position_embeddings)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_embedding_length(config.hidden_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])  # Gemma 3: the global layers'
    writer.add_vocab_size(config.vocab_size)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    else:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    if getattr(config, "num_experts", None):
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)


def _add_sentencepiece_tokenizer(writer: gguf.GGUFWriter, tokenizer: PreTrainedTokenizerFast) -> None:
    """As Gemma's GGUFs hold theirs: a sentencepiece vocabulary ("llama"), here the same specials
    at the same ids, then one byte-fallback token per byte in byte order (another text's ids than
    the byte-level tokenizer's: read the tokenizer back from the file)."""
    specials = sorted(tokenizer.get_added_vocab().items(), key=lambda item: item[1])
    assert [i for _, i in specials] == list(range(len(specials)))
    writer.add_tokenizer_model("llama")
    writer.add_token_list([token for token, _ in specials] + [f"<0x{b:02X}>" for b in range(256)])
    writer.add_token_types([TOKEN_TYPE_CONTROL] * len(specials) + [TOKEN_TYPE_BYTE] * 256)
    writer.add_token_scores([0.0] * (len(specials) + 256))
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)


def _add_tokenizer(writer: gguf.GGUFWriter, tokenizer: PreTrainedTokenizerFast) -> None:
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    assert [i for _, i in vocab] == list(range(len(vocab)))
    special = set(tokenizer.all_special_ids)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([TOKEN_TYPE_CONTROL if i in special else TOKEN_TYPE_NORMAL for _, i in vocab])
    writer.add_token_scores([0.0] * len(vocab))  # no merges: transformers derives none from these
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)


def _as_stored(arch: str, gguf_name: str, weights: np.ndarray, config) -> np.ndarray:
    """The tensor as llama.cpp stores it: the inverse of transformers' processor for `arch`."""
    processor = TENSOR_PROCESSORS.get(arch)
    if processor is not None and processor.__name__ == "LlamaTensorProcessor":
        if ".attn_q." in gguf_name:
            return _permute(weights, config.num_attention_heads)
        if ".attn_k." in gguf_name:
            return _permute(weights, config.num_key_value_heads)
    if processor is not None and processor.__name__ == "Gemma2TensorProcessor" and "norm.weight" in gguf_name:
        return weights + 1
    if gguf_name.endswith(("ffn_gate_exps", "ffn_up_exps")):  # HF's [experts, gate rows + up rows, hidden]
        half = weights.shape[1] // 2
        return weights[:, :half] if gguf_name.endswith("ffn_gate_exps") else weights[:, half:]
    if "ffn_gate_inp_shexp" in gguf_name:  # the shared expert's gate, [1, hidden] in HF
        return weights[0]
    return weights


def _permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rotary halves interleaved."""
    return (weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))
