"""The fingerprint is what decides a row's output.

A tokenizer or chat-template change (which the weights' hash did not see) is refused; a KV cache
sized differently (which followed free memory) is accepted; and a directory written without
input identities and prompt hashes (its fingerprint, inputs and parts without those fields) resumes.
"""

from __future__ import annotations

import json
import shutil

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from batchgen.engine.model.loader import load_model
from batchgen.errors import FingerprintMismatch
from batchgen.io.manifest.manifest import MANIFEST_DIR, SUCCESS_FILE, load_manifest
from batchgen.io.store.local_files import file_digest
from batchgen.jobs.commands.run import run_job
from batchgen.jobs.durability.fingerprint import ADDED_KEYS
from tests.jobs.helpers import tiny_job_config

TEXTS = [f"row {i} " + "ab" * i for i in range(10)]


@pytest.fixture
def src(tmp_path):
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": list(range(len(TEXTS))), "text": TEXTS}), path)
    return path


def config(src, out, model_dir, **overrides):
    return tiny_job_config(src, out, model_dir, **{**dict(id_column="id", max_new_tokens=3, commit_every_rows=3,
                                                          batch_size=4), **overrides})


def copy_model(model_dir, path, edit):
    shutil.copytree(model_dir, path)
    settings = json.loads((path / "tokenizer_config.json").read_text())
    edit(path, settings)
    (path / "tokenizer_config.json").write_text(json.dumps(settings))
    return path


def test_a_changed_chat_template_is_refused(tiny_model_dir, loaded, src, tmp_path):
    out = tmp_path / "out"
    run_job(config(src, out, tiny_model_dir, max_rows=4), loaded=loaded)

    def new_template(path, settings):
        template = path / "chat_template.jinja"
        if template.exists():
            template.write_text(template.read_text().replace("<|im_start|>", "<|im_start|> "))
        else:
            settings["chat_template"] = settings["chat_template"].replace("<|im_start|>", "<|im_start|> ")

    other = copy_model(tiny_model_dir, tmp_path / "other-template", new_template)
    other_loaded = load_model(str(other), device="cpu", dtype="float32")
    assert other_loaded.revision == loaded.revision  # the weights' hash cannot tell them apart
    with pytest.raises(FingerprintMismatch, match="tokenizer"):
        run_job(config(src, out, other), loaded=other_loaded)


def test_a_changed_special_token_is_refused(tiny_model_dir, loaded, src, tmp_path):
    out = tmp_path / "out"
    run_job(config(src, out, tiny_model_dir, max_rows=4), loaded=loaded)

    def new_eos(path, settings):
        settings["eos_token"] = "<|im_end|>"

    other = copy_model(tiny_model_dir, tmp_path / "other-eos", new_eos)
    other_loaded = load_model(str(other), device="cpu", dtype="float32")
    with pytest.raises(FingerprintMismatch) as e:
        run_job(config(src, out, other), loaded=other_loaded)
    assert "tokenizer" in str(e.value) and "eos_token_ids" in str(e.value)


def test_a_differently_sized_kv_cache_resumes(tiny_model_dir, loaded, src, tmp_path):
    """The auto-sized KV cache follows free memory, so it must not enter the fingerprint (not even
    through max_context_tokens, the context capped by the cache) and refuse the resume."""
    out = tmp_path / "out"
    run_job(config(src, out, tiny_model_dir, max_rows=4, kv_cache_memory="16MiB"), loaded=loaded)
    rest = run_job(config(src, out, tiny_model_dir, kv_cache_memory="96KiB"), loaded=loaded)
    assert (rest.num_rows, rest.num_rows_skipped) == (len(TEXTS) - 4, 4)


def downgrade(out):
    """Rewrite `out` as a directory without input identities is written: its fingerprint keys, no
    input identities, no prompt hashes in entries or parts."""
    directory = out / MANIFEST_DIR
    for path in sorted(directory.glob("*.json")):
        entry = json.loads(path.read_text())
        if entry["op"] == "begin":
            fp = {k: v for k, v in entry["fingerprint"].items() if k not in ADDED_KEYS}
            fp["output_schema"] = [f for f in fp["output_schema"] if f[0] != "prompt_hash"]
            fp.update(batchgen_version="0.1.0", max_context_tokens=512)
            entry["fingerprint"] = fp
        elif entry["op"] == "inputs":
            entry.pop("orphans", None)
            entry["inputs"] = [{"path": i["path"], "num_rows": i["num_rows"]} for i in entry["inputs"]]
        else:
            for p in entry["write"]:
                p.pop("hashes")
                part = out / p["name"]
                pq.write_table(pq.read_table(part).drop_columns(["prompt_hash"]), part, compression="zstd")
                p["num_bytes"], p["sha256"] = file_digest(part)
        path.write_text(json.dumps(entry))


def test_a_directory_without_input_identities_or_prompt_hashes_resumes(tiny_model_dir, loaded, src, tmp_path):
    out = tmp_path / "out"
    run_job(config(src, out, tiny_model_dir, max_rows=4), loaded=loaded)
    downgrade(out)
    rest = run_job(config(src, out, tiny_model_dir), loaded=loaded)
    assert (rest.num_rows, rest.num_rows_skipped) == (len(TEXTS) - 4, 4)
    result = ds.dataset(str(out), format="parquet").to_table()
    assert "prompt_hash" not in result.column_names  # the directory keeps one schema
    assert sorted(result.column("id").to_pylist()) == list(range(len(TEXTS)))
    assert (out / SUCCESS_FILE).exists()
    load_manifest(out).check_integrity()
    # with derived ids too: the old inputs entry has no identity, so only the file set is compared
    out2 = tmp_path / "out2"
    run_job(config(src, out2, tiny_model_dir, id_column=None, max_rows=4), loaded=loaded)
    downgrade(out2)
    rest = run_job(config(src, out2, tiny_model_dir, id_column=None), loaded=loaded)
    assert (rest.num_rows, rest.num_rows_skipped) == (len(TEXTS) - 4, 4)


def test_int4_fingerprint_carries_the_recipe(tmp_path):
    from batchgen.engine.quant.recipe import INT4_RECIPE
    from batchgen.jobs.durability.fingerprint import job_fingerprint

    def fingerprint(**overrides):
        config = tiny_job_config(tmp_path / "in.parquet", tmp_path / "out", tmp_path / "model", **overrides)
        return job_fingerprint(config, None, pa.schema([("id", pa.int64())]))

    assert fingerprint(quantize="int4")["int4_recipe"] == INT4_RECIPE
    assert fingerprint(quantize="auto")["int4_recipe"] == INT4_RECIPE  # a Q4 GGUF maps to int4
    assert "int4_recipe" not in fingerprint() and "int4_recipe" not in fingerprint(quantize="int8")


def test_int8_fingerprint_carries_the_calibration_recipe(tmp_path):
    from batchgen.engine.quant.recipe import INT8_RECIPE
    from batchgen.jobs.durability.fingerprint import job_fingerprint

    def fingerprint(**overrides):
        config = tiny_job_config(tmp_path / "in.parquet", tmp_path / "out", tmp_path / "model", **overrides)
        return job_fingerprint(config, None, pa.schema([("id", pa.int64())]))

    # the exact string jobs begun under the default recipe recorded: it must not change, or they stop resuming
    assert INT8_RECIPE == "per-token,outliers-0.03,down_proj:asym,stacked"
    assert fingerprint(quantize="int8")["int8_recipe"] == INT8_RECIPE  # auto: onednn where the CPU has VNNI/AMX
    assert fingerprint(quantize="int8", quantize_backend="onednn")["int8_recipe"] == INT8_RECIPE
    assert "int8_recipe" not in fingerprint(quantize="int8", quantize_backend="torchao")
    assert "int8_recipe" not in fingerprint() and "int8_recipe" not in fingerprint(quantize="int4")


@pytest.mark.parametrize("setting", [dict(repetition_penalty=1.3), dict(min_tokens=2)])
def test_a_resume_that_drops_a_setting_is_refused(tiny_model_dir, loaded, src, tmp_path, setting):
    """Such settings are recorded only when not at their default: a resume without the flag that
    compared only its own keys would find no change and mix two configurations in one output."""
    out = tmp_path / "out"
    run_job(config(src, out, tiny_model_dir, max_rows=4, **setting), loaded=loaded)
    with pytest.raises(FingerprintMismatch, match=next(iter(setting))):
        run_job(config(src, out, tiny_model_dir), loaded=loaded)
    rest = run_job(config(src, out, tiny_model_dir, **setting), loaded=loaded)  # the original flags resume
    assert (rest.num_rows, rest.num_rows_skipped) == (len(TEXTS) - 4, 4)


def test_fingerprints_compare_the_union_of_their_keys(tmp_path):
    from batchgen.jobs.durability.fingerprint import fingerprint_changes, job_fingerprint

    def fingerprint(**overrides):
        config = tiny_job_config(tmp_path / "in.parquet", tmp_path / "out", tmp_path / "model", **overrides)
        return job_fingerprint(config, None, pa.schema([("id", pa.int64())]))

    plain = fingerprint()
    for setting in (dict(quantize="int8"), dict(kv_cache_dtype="int8"), dict(input_format="jsonl"),
                    dict(num_shards=2, shard_index=0), dict(sampling_column="s"), dict(presence_penalty=0.5)):
        dropped = fingerprint_changes(fingerprint(**setting), plain)
        added = fingerprint_changes(plain, fingerprint(**setting))
        assert dropped and added, setting
        assert any(change.startswith(next(iter(setting))) for change in dropped), dropped
    # a key written at its default (an older batchgen that recorded it always) is the same as absent
    assert fingerprint_changes({**plain, "repetition_penalty": 1.0, "quantize": "none"}, plain) == []
    assert fingerprint_changes(plain, {**plain, "min_tokens": 0}) == []
    # keys only an older fingerprint has, and the model keys a check before loading lacks, are not compared
    assert fingerprint_changes({**plain, "batchgen_version": "0.1.0", "dtype": "float32"}, plain) == []
    # an int4 job begun before the embedding setting was recorded had its embedding unquantized
    int4 = fingerprint(quantize="int4")
    assert any(c.startswith("quantize_embedding") for c in
               fingerprint_changes({k: v for k, v in int4.items() if k != "quantize_embedding"}, int4))
