"""Every model family the README lists, as a user runs it: a tiny random checkpoint saved to a
directory (safetensors) and passed to `batchgen run --model DIR`, through the loader, the engine and
the written Parquet. The rows' tokens equal `model.generate`'s greedy ones, token for token.

tests/engine/test_families_generate.py builds the same families in process and hands them to the
engine; this file is the path a user takes, where the loader picks the attention transformers
builds each family with (engine/model/load_attention.py)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from batchgen.cli import app
from tests.tiny import _common
from tests.tiny_gguf import write_gguf

WINDOW = 12  # tokens: shorter than the longer prompts and the outputs below
MAX_NEW_TOKENS = 16
MOE = dict(num_experts_per_tok=2)

# the README's families -> (config class name, its arguments); SmolLM is a Llama
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", dict(use_sliding_window=False)),
    "qwen2-sliding": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "qwen3": ("Qwen3Config", dict(head_dim=16)),
    "qwen3-sliding": ("Qwen3Config", dict(head_dim=16, use_sliding_window=True, sliding_window=WINDOW,
                                          max_window_layers=1)),
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW)),
    "gemma2": ("Gemma2Config", dict(head_dim=16, sliding_window=WINDOW, attn_logit_softcapping=5.0,
                                    final_logit_softcapping=3.0, query_pre_attn_scalar=20)),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=20,
                                        layer_types=["sliding_attention", "full_attention"])),
    "cohere2": ("Cohere2Config", dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])),
    "gpt_oss": ("GptOssConfig", dict(head_dim=16, sliding_window=WINDOW, num_local_experts=4, **MOE)),
    "mixtral": ("MixtralConfig", dict(sliding_window=WINDOW, num_local_experts=4, **MOE)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                         **MOE)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=16, num_experts=4, moe_intermediate_size=32, **MOE)),
    "olmoe": ("OlmoeConfig", dict(num_experts=4, **MOE)),
}
# the families transformers converts from GGUF, as their GGUFs hold them: GGUF metadata has no
# Qwen3 head size nor Qwen-MoE expert sizes (transformers takes its defaults); llama.cpp writes
# Gemma's tied head once
_QWEN2_MOE = transformers.Qwen2MoeConfig()
GGUF_FAMILIES = {
    "llama": {},
    "qwen2": {},
    "qwen3": dict(head_dim=128),
    "gemma2": dict(tie_word_embeddings=True),
    "gemma3": dict(tie_word_embeddings=True),
    "qwen2_moe": dict(moe_intermediate_size=_QWEN2_MOE.moe_intermediate_size,
                      shared_expert_intermediate_size=_QWEN2_MOE.shared_expert_intermediate_size),
    "qwen3_moe": dict(head_dim=128, moe_intermediate_size=transformers.Qwen3MoeConfig().moe_intermediate_size),
}
# a prompt of 1 byte, one shorter and one longer than the window, one past twice the window
TEXTS = ["x", "short prompt", "a prompt longer than the window", "the longest prompt here, past twice the window"]

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def build(family: str, **overrides):
    cls, kwargs = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, cls)(**_common(**{**kwargs, **overrides}))
    # eager: the reference math every family accepts
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()


def greedy(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW_TOKENS,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def run_job(model_path, tmp_path, *flags: str) -> dict:
    """`batchgen run --model model_path` on TEXTS, greedy through EOS; the committed rows by id."""
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": list(range(len(TEXTS))), "text": TEXTS}), src)
    out = tmp_path / "out"
    result = CliRunner().invoke(app, [
        "run", "--input", str(src), "--output", str(out), "--model", str(model_path), "--id-column", "id",
        "--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "16MiB", "--no-chat", "--ignore-eos",
        "--max-new-tokens", str(MAX_NEW_TOKENS), "--logprobs", "0", "--quiet", *flags])
    assert result.exit_code == 0, (result.exit_code, result.output, result.exception)
    return {row["id"]: row for row in ds.dataset(str(out), format="parquet").to_table().to_pylist()}


def assert_rows_equal_generate(rows: dict, model, tokenizer) -> None:
    for i, text in enumerate(TEXTS):
        prompt = tokenizer(text, add_special_tokens=True)["input_ids"]
        ref = greedy(model, prompt)
        row = rows[i]
        assert row["error"] is None and row["num_prompt_tokens"] == len(prompt)
        assert [t["token_id"] for t in row["logprobs"]] == ref, text
        assert row["generated_text"] == tokenizer.decode(ref, skip_special_tokens=True), text


@pytest.mark.parametrize("family", [f for f, (cls, _) in FAMILIES.items() if hasattr(transformers, cls)])
def test_a_saved_checkpoint_runs_through_batchgen_run_as_generate_does(family, tokenizer, tmp_path):
    model = build(family)
    model_dir = tmp_path / family
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    assert any(p.suffix == ".safetensors" for p in model_dir.iterdir())
    assert_rows_equal_generate(run_job(model_dir, tmp_path), model, tokenizer)


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])  # their classes refuse SDPA
def test_a_checkpoint_quantized_while_it_streams_in_loads_with_an_attention_its_class_accepts(family, tokenizer,
                                                                                            tmp_path):
    """--quantize int4 on the CPU builds the model on the meta device and quantizes each layer as it
    is read (engine/model/stream_load.py): that build picks its attention as the loader does."""
    model_dir = tmp_path / family
    build(family).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    rows = run_job(model_dir, tmp_path, "--quantize", "int4")
    assert all(row["error"] is None and row["num_generated_tokens"] == MAX_NEW_TOKENS for row in rows.values())


@pytest.mark.parametrize("family", list(GGUF_FAMILIES))
def test_a_gguf_runs_through_batchgen_run_as_transformers_reads_it(family, tokenizer, tmp_path, monkeypatch):
    """The reference is transformers' own reading of the file, model and tokenizer, which batchgen
    converts once into its cache (a Gemma 3 GGUF, for one, holds no layer pattern: transformers
    gives it its default; Gemma's vocabulary is sentencepiece, as in its real GGUFs)."""
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "gguf").mkdir()
    path = write_gguf(build(family, **GGUF_FAMILIES[family]), tokenizer, tmp_path / "gguf" / f"{family}.gguf")
    kwargs = dict(gguf_file=f"{family}.gguf", local_files_only=True)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "gguf", attn_implementation="eager",
                                                     dtype=torch.float32, **kwargs).eval()
    assert_rows_equal_generate(run_job(path, tmp_path), reference,
                               AutoTokenizer.from_pretrained(tmp_path / "gguf", **kwargs))
