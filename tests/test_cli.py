"""`batchgen run` end to end through the Typer app, on a tiny random Llama saved as a local dir.

Every successful run must write exactly one output row per input row, readable as one table;
every user mistake must exit 2 with one `error:` line, no traceback and no output left behind.
The tokenizer is byte-level (one token per UTF-8 byte), so prompt token counts are byte counts.
"""

from __future__ import annotations

import gzip
import json
import re
import shutil

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from batchgen import __version__
from batchgen.cli import app

FIXED_COLUMNS = ["generated_text", "finish_reason", "num_prompt_tokens", "num_generated_tokens", "error",
                 "prompt_hash", "prompt_truncated"]
MAX_NEW = 8


@pytest.fixture(scope="module")
def runner():
    return CliRunner()


@pytest.fixture(scope="module")
def short_context_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny Llama with a 64-token context: rope has no learned positions, so only config changes."""
    path = tmp_path_factory.mktemp("tiny-llama-ctx64")
    for item in tiny_model_dir.iterdir():
        shutil.copy(item, path / item.name)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 64
    (path / "config.json").write_text(json.dumps(config))
    return path


def invoke(runner, model_dir, inputs, out, *args):
    inputs = inputs if isinstance(inputs, list) else [inputs]
    argv = ["run", *[a for p in inputs for a in ("--input", str(p))], "--output", str(out),
            "--model", str(model_dir), "--device", "cpu", "--dtype", "float32",
            "--max-new-tokens", str(MAX_NEW), "--kv-cache-memory", "16MiB", "--quiet", *map(str, args)]
    return runner.invoke(app, argv)


def ok(result):
    assert result.exit_code == 0, (result.exit_code, result.output, result.exception)
    return result


def stderr_of(result) -> str:
    try:
        return result.stderr
    except ValueError:  # older click: stderr not captured separately
        return result.output


LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [A-Z]+ ")


def assert_user_error(result, out, *needles, after_model_load=False):
    """Exit 2, exactly one line on stderr starting with "error:", no traceback, no output left.

    A mistake found only once the model is loaded may follow the job's own log lines (when pytest
    does not capture logging); everything else is caught before anything is logged.
    """
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    lines = [line for line in stderr_of(result).splitlines() if line.strip()]
    if after_model_load:
        lines = [line for line in lines if not LOG_LINE.match(line)]
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: "), lines
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert not out.exists() or not any(out.iterdir()), sorted(p.name for p in out.iterdir())
    return lines[0]


def read_output(out) -> pa.Table:
    return ds.dataset(str(out), format="parquet").to_table()


def rows_by_id(table: pa.Table, id_column: str = "row_id") -> dict:
    return {row[id_column]: row for row in table.to_pylist()}


def write_parquet(path, **columns):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)
    return path


def write_jsonl(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in records).encode()
    path.write_bytes(gzip.compress(text) if path.name.endswith(".gz") else text)
    return path


TEXTS = ["Hello there", "A", "The quick brown fox jumps over the lazy dog.", "naïve café ☕", "12345"]


# ---------------------------------------------------------------- inputs and the output table


def test_parquet_input_and_output_schema(runner, tiny_model_dir, tmp_path):
    src = write_parquet(tmp_path / "in.parquet", text=TEXTS, title=[f"t{i}" for i in range(5)],
                        n=list(range(5)))
    out = tmp_path / "out"
    result = ok(invoke(runner, tiny_model_dir, src, out))
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"output": str(out), "rows": 5, "errors": 0,
                                                                 "output_rows": 5, "output_errors": 0}

    table = read_output(out)
    assert table.num_rows == 5
    assert table.column_names == ["row_id", *FIXED_COLUMNS, "text", "title", "n"]
    schema = table.schema
    assert schema.field("row_id").type == pa.string()
    assert schema.field("num_prompt_tokens").type == pa.int32()
    assert schema.field("num_generated_tokens").type == pa.int32()
    assert schema.field("n").type == pa.int64()
    rows = rows_by_id(table)
    assert sorted(rows) == sorted(f"in.parquet:{i}" for i in range(5))
    for i, text in enumerate(TEXTS):
        row = rows[f"in.parquet:{i}"]
        assert row["text"] == text and row["title"] == f"t{i}" and row["n"] == i
        assert row["error"] is None
        assert row["finish_reason"] in ("stop", "length")
        assert isinstance(row["generated_text"], str)
        assert 1 <= row["num_generated_tokens"] <= MAX_NEW
        assert row["num_prompt_tokens"] > len(text.encode())  # chat template on by default
    summary = json.loads((out / "_summary.json").read_text())
    assert summary["num_rows"] == 5 and summary["num_rows_error"] == 0
    # the model calls are timed apart from the host work around them, inside the job's wall time
    engine = summary["engine"]
    assert 0 < engine["forward_seconds"] <= engine["engine_seconds"] <= summary["wall_seconds"]
    assert summary["forward_share"] == round(engine["forward_seconds"] / summary["wall_seconds"], 4)


@pytest.mark.parametrize("name", ["in.jsonl", "in.jsonl.gz"])
def test_jsonl_inputs(runner, tiny_model_dir, tmp_path, name):
    records = [{"text": t, "k": i} for i, t in enumerate(TEXTS)]
    src = write_jsonl(tmp_path / name, records)
    out = tmp_path / "out"
    ok(invoke(runner, tiny_model_dir, src, out))
    table = read_output(out)
    assert table.num_rows == len(records)
    assert table.column_names == ["row_id", *FIXED_COLUMNS, "text", "k"]
    rows = rows_by_id(table)
    assert {rows[f"{name}:{i}"]["text"] for i in range(len(TEXTS))} == set(TEXTS)
    assert all(r["error"] is None for r in rows.values())


def _mixed_directory(root):
    write_parquet(root / "a.parquet", text=["a0", "a1", "a2"])
    write_jsonl(root / "b.jsonl", [{"text": "b0"}, {"text": "b1"}])
    write_jsonl(root / "sub" / "c.jsonl.gz", [{"text": "c0"}])
    (root / "README.txt").write_text("not an input")
    (root / "_SUCCESS").write_text("")


def test_directory_input(runner, tiny_model_dir, tmp_path):
    _mixed_directory(tmp_path / "data")
    out = tmp_path / "out"
    ok(invoke(runner, tiny_model_dir, tmp_path / "data", out))
    table = read_output(out)
    assert table.num_rows == 6
    rows = rows_by_id(table)
    assert set(rows) == {"a.parquet:0", "a.parquet:1", "a.parquet:2", "b.jsonl:0", "b.jsonl:1", "c.jsonl.gz:0"}
    assert {r["text"] for r in rows.values()} == {"a0", "a1", "a2", "b0", "b1", "c0"}


def test_glob_input(runner, tiny_model_dir, tmp_path):
    _mixed_directory(tmp_path / "data")
    write_parquet(tmp_path / "data" / "d.parquet", text=["d0", "d1"])
    out = tmp_path / "out"
    ok(invoke(runner, tiny_model_dir, f"{tmp_path}/data/*.parquet", out))
    table = read_output(out)
    assert sorted(table.column("text").to_pylist()) == ["a0", "a1", "a2", "d0", "d1"]


def test_several_inputs_and_small_parts_read_as_one_table(runner, tiny_model_dir, tmp_path):
    a = write_parquet(tmp_path / "a.parquet", text=[f"a{i}" for i in range(5)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": f"b{i}"} for i in range(4)])
    out = tmp_path / "out"
    ok(invoke(runner, tiny_model_dir, [a, b], out, "--rows-per-part", "2"))
    assert len(list(out.glob("*.parquet"))) == 5  # 9 rows, 2 per part
    table = read_output(out)
    assert table.num_rows == 9
    assert len(set(table.column("row_id").to_pylist())) == 9


def test_keep_columns_restricts_the_passthrough(runner, tiny_model_dir, tmp_path):
    src = write_parquet(tmp_path / "in.parquet", text=["x", "y"], title=["a", "b"], lang=["en", "de"],
                        big=["…" * 100] * 2)
    out = tmp_path / "out"
    ok(invoke(runner, tiny_model_dir, src, out, "--keep-columns", "lang", "--keep-columns", "title"))
    table = read_output(out)
    assert table.column_names == ["row_id", *FIXED_COLUMNS, "lang", "title"]
    assert sorted(table.column("lang").to_pylist()) == ["de", "en"]


def test_derived_ids_are_stable_across_runs(runner, tiny_model_dir, tmp_path):
    src = write_parquet(tmp_path / "docs.parquet", text=TEXTS)
    runs = []
    for name in ("out1", "out2"):
        ok(invoke(runner, tiny_model_dir, src, tmp_path / name))
        runs.append(rows_by_id(read_output(tmp_path / name)))
    first, second = runs
    assert set(first) == set(second) == {f"docs.parquet:{i}" for i in range(len(TEXTS))}
    for row_id, row in first.items():  # greedy: the same text for the same id
        assert second[row_id]["generated_text"] == row["generated_text"]
        assert second[row_id]["text"] == row["text"] == TEXTS[int(row_id.split(":")[1])]


def test_id_column(runner, tiny_model_dir, tmp_path):
    src = write_parquet(tmp_path / "in.parquet", doc_id=[101, 102, 103], text=TEXTS[:3])
    out = tmp_path / "out"
    ok(invoke(runner, tiny_model_dir, src, out, "--id-column", "doc_id"))
    table = read_output(out)
    assert table.column_names == ["doc_id", *FIXED_COLUMNS, "text"]
    assert table.schema.field("doc_id").type == pa.int64()
    rows = rows_by_id(table, "doc_id")
    assert {k: v["text"] for k, v in rows.items()} == {101: TEXTS[0], 102: TEXTS[1], 103: TEXTS[2]}


def test_max_rows(runner, tiny_model_dir, tmp_path):
    src = write_parquet(tmp_path / "in.parquet", text=TEXTS)
    out = tmp_path / "out"
    result = ok(invoke(runner, tiny_model_dir, src, out, "--max-rows", "2"))
    assert json.loads(result.stdout.strip().splitlines()[-1])["rows"] == 2
    assert sorted(read_output(out).column("row_id").to_pylist()) == ["in.parquet:0", "in.parquet:1"]


# ---------------------------------------------------------------- prompts


def test_template_with_several_columns(runner, tiny_model_dir, tmp_path):
    titles, bodies = ["Cats", "Dogs", "Éclair"], ["Meow.", "Woof woof.", "Crème pâtissière"]
    src = write_parquet(tmp_path / "in.parquet", title=titles, body=bodies)  # no "text" column at all
    out = tmp_path / "out"
    # "\n" typed in a shell arrives as backslash + n; the CLI turns it into a newline
    ok(invoke(runner, tiny_model_dir, src, out, "--no-chat", "--template", "Title: {title}\\nBody: {body}"))
    rows = rows_by_id(read_output(out))
    for i, (title, body) in enumerate(zip(titles, bodies, strict=True)):
        prompt = f"Title: {title}\nBody: {body}"
        row = rows[f"in.parquet:{i}"]
        assert row["error"] is None
        assert row["num_prompt_tokens"] == len(prompt.encode())


def _chat_tokens(tokenizer, text, system=None):
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tokenizer(rendered, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("flags", [[], ["--no-chat"], ["--chat", "--system", "Answer in French."]])
def test_chat_template_on_and_off(runner, tiny_model_dir, tokenizer, tmp_path, flags):
    src = write_parquet(tmp_path / "in.parquet", text=TEXTS[:3])
    out = tmp_path / "out"
    ok(invoke(runner, tiny_model_dir, src, out, *flags))
    rows = rows_by_id(read_output(out))
    system = flags[flags.index("--system") + 1] if "--system" in flags else None
    for i, text in enumerate(TEXTS[:3]):
        expected = len(text.encode()) if "--no-chat" in flags else _chat_tokens(tokenizer, text, system)
        assert rows[f"in.parquet:{i}"]["num_prompt_tokens"] == expected


def test_system_prompt_without_chat_is_a_usage_error(runner, tiny_model_dir, tmp_path):
    src = write_parquet(tmp_path / "in.parquet", text=["x"])
    out = tmp_path / "out"
    result = invoke(runner, tiny_model_dir, src, out, "--no-chat", "--system", "Be brief.")
    assert_user_error(result, out, "--system needs the chat template")  # before the model loads


def test_long_prompt_truncate(runner, short_context_model_dir, tmp_path):
    texts = ["short", "x" * 200, "y" * 57]  # context 64 - 8 new tokens = 56 prompt tokens
    src = write_parquet(tmp_path / "in.parquet", text=texts)
    out = tmp_path / "out"
    result = ok(invoke(runner, short_context_model_dir, src, out, "--no-chat", "--on-long-prompt", "truncate"))
    rows = rows_by_id(read_output(out))
    assert [rows[f"in.parquet:{i}"]["num_prompt_tokens"] for i in range(3)] == [5, 56, 56]
    for row in rows.values():
        assert row["error"] is None and row["finish_reason"] in ("stop", "length")
        assert row["num_prompt_tokens"] + row["num_generated_tokens"] <= 64
    assert "2 truncated prompts" in stderr_of(result)


def test_long_prompt_error(runner, short_context_model_dir, tmp_path):
    texts = ["short", "x" * 200, "y" * 56]
    src = write_parquet(tmp_path / "in.parquet", text=texts)
    out = tmp_path / "out"
    result = ok(invoke(runner, short_context_model_dir, src, out, "--no-chat", "--on-long-prompt", "error"))
    assert json.loads(result.stdout.strip().splitlines()[-1])["errors"] == 1
    rows = rows_by_id(read_output(out))
    assert len(rows) == 3
    bad = rows["in.parquet:1"]
    assert bad["finish_reason"] == "error" and bad["generated_text"] is None
    assert "prompt has 200 tokens" in bad["error"] and "56" in bad["error"]
    for i in (0, 2):  # 56 tokens fit exactly
        assert rows[f"in.parquet:{i}"]["error"] is None


def test_max_new_tokens_column(runner, tiny_model_dir, tmp_path):
    limits = [1, 3, 5, None, 2]  # null = the --max-new-tokens default
    src = write_parquet(tmp_path / "in.parquet", text=TEXTS, limit=pa.array(limits, pa.int32()))
    for flags, exact in (([], False), (["--ignore-eos"], True)):
        out = tmp_path / f"out{int(exact)}"
        ok(invoke(runner, tiny_model_dir, src, out, "--max-new-tokens-column", "limit", *flags))
        rows = rows_by_id(read_output(out))
        for i, limit in enumerate(limits):
            row = rows[f"in.parquet:{i}"]
            expected = MAX_NEW if limit is None else limit
            assert row["limit"] == limit
            if exact:
                assert row["num_generated_tokens"] == expected and row["finish_reason"] == "length"
            else:
                assert 1 <= row["num_generated_tokens"] <= expected


def test_bad_per_row_max_new_tokens_is_an_error_row(runner, tiny_model_dir, tmp_path):
    src = write_parquet(tmp_path / "in.parquet", text=TEXTS[:3], limit=[4, 0, -2])
    out = tmp_path / "out"
    ok(invoke(runner, tiny_model_dir, src, out, "--max-new-tokens-column", "limit", "--max-error-rate", "1"))
    rows = rows_by_id(read_output(out))
    assert rows["in.parquet:0"]["error"] is None
    for i in (1, 2):
        assert rows[f"in.parquet:{i}"]["finish_reason"] == "error"
        assert "column 'limit'" in rows[f"in.parquet:{i}"]["error"]


# ---------------------------------------------------------------- rows that fail alone


def test_null_empty_and_whitespace_prompts_are_error_rows(runner, tiny_model_dir, tmp_path):
    texts = ["fine", None, "", "   \n\t", "also fine"]
    src = write_parquet(tmp_path / "in.parquet", text=texts, keep=list(range(5)))
    out = tmp_path / "out"
    result = ok(invoke(runner, tiny_model_dir, src, out, "--max-error-rate", "1"))  # 3 of 5 fail, on purpose
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"output": str(out), "rows": 5, "errors": 3,
                                                                 "output_rows": 5, "output_errors": 3}
    rows = rows_by_id(read_output(out))
    assert len(rows) == 5
    expected = {1: "is null", 2: "is empty", 3: "whitespace only"}
    for i in range(5):
        row = rows[f"in.parquet:{i}"]
        assert row["keep"] == i  # passthrough survives on error rows
        if i in expected:
            assert row["finish_reason"] == "error"
            assert row["generated_text"] is None and row["num_generated_tokens"] == 0
            assert "prompt column 'text'" in row["error"] and expected[i] in row["error"]
        else:
            assert row["error"] is None and row["finish_reason"] in ("stop", "length")


def test_jsonl_row_without_the_prompt_key_is_an_error_row(runner, tiny_model_dir, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}, {"other": 1}, {"text": None}, {"text": "b"}])
    out = tmp_path / "out"
    ok(invoke(runner, tiny_model_dir, src, out))
    rows = rows_by_id(read_output(out))
    assert [rows[f"in.jsonl:{i}"]["finish_reason"] == "error" for i in range(4)] == [False, True, True, False]
    assert "prompt column 'text'" in rows["in.jsonl:1"]["error"]


def test_non_string_prompt_is_an_error_row(runner, tiny_model_dir, tmp_path):
    src = write_parquet(tmp_path / "in.parquet", text=pa.array([["a", "b"], [], None], pa.list_(pa.string())))
    out = tmp_path / "out"
    result = ok(invoke(runner, tiny_model_dir, src, out, "--max-error-rate", "1"))
    assert json.loads(result.stdout.strip().splitlines()[-1])["errors"] == 3
    rows = rows_by_id(read_output(out))
    assert "prompt column 'text' holds a list, not text" in rows["in.parquet:0"]["error"]
    assert "prompt column 'text' holds a list" in rows["in.parquet:1"]["error"]
    assert "prompt column 'text' is null" in rows["in.parquet:2"]["error"]
    assert rows["in.parquet:0"]["text"] == ["a", "b"]  # the list passes through unchanged


def test_numbers_are_read_as_text(runner, tiny_model_dir, tmp_path):
    src = write_parquet(tmp_path / "in.parquet", text=[12345, 7])
    out = tmp_path / "out"
    ok(invoke(runner, tiny_model_dir, src, out, "--no-chat"))
    rows = rows_by_id(read_output(out))
    assert [rows[f"in.parquet:{i}"]["num_prompt_tokens"] for i in range(2)] == [5, 1]


# ---------------------------------------------------------------- user mistakes: exit 2, one line, no output


def test_missing_input_file(runner, tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    result = invoke(runner, tiny_model_dir, tmp_path / "nope.parquet", out)
    assert_user_error(result, out, "nope.parquet", "no such file")


def test_missing_prompt_column_lists_the_columns(runner, tiny_model_dir, tmp_path):
    src = write_parquet(tmp_path / "in.parquet", body=["x"], title=["y"])
    out = tmp_path / "out"
    line = assert_user_error(invoke(runner, tiny_model_dir, src, out), out, "prompt column 'text' not found")
    assert "columns: body, title" in line


def test_corrupt_parquet(runner, tiny_model_dir, tmp_path):
    src = tmp_path / "in.parquet"
    src.write_bytes(b"this is not a parquet file at all \x00\x01\x02" * 20)
    out = tmp_path / "out"
    assert_user_error(invoke(runner, tiny_model_dir, src, out), out, "in.parquet", "not a valid Parquet file")


@pytest.mark.parametrize(("name", "content"), [("in.parquet", b""), ("in.jsonl", b""), ("in.jsonl", b"\n\n  \n")])
def test_empty_file(runner, tiny_model_dir, tmp_path, name, content):
    """An empty partition: exit 0 and _SUCCESS (jobs/pipeline/empty_input.py); exit 2 when refused."""
    src = tmp_path / name
    src.write_bytes(content)
    out = tmp_path / "out"
    result = ok(invoke(runner, tiny_model_dir, src, out))
    assert json.loads(result.stdout.strip().splitlines()[-1])["output_rows"] == 0 and (out / "_SUCCESS").exists()
    strict = tmp_path / "strict"
    assert_user_error(invoke(runner, tiny_model_dir, src, strict, "--no-allow-empty-input"), strict, "holds no rows")


def test_template_naming_a_missing_column(runner, tiny_model_dir, tmp_path):
    src = write_parquet(tmp_path / "in.parquet", text=["x"])
    out = tmp_path / "out"
    result = invoke(runner, tiny_model_dir, src, out, "--template", "{title}: {text}")
    assert_user_error(result, out, "'title'", "does not exist", "columns: text")


def test_rerun_on_finished_output_keeps_one_row_per_input(runner, tiny_model_dir, tmp_path):
    """Whether a second run refuses (exit 2) or resumes (exit 0), finished rows are neither lost,
    duplicated nor changed."""
    src = write_parquet(tmp_path / "in.parquet", text=TEXTS[:3])
    out = tmp_path / "out"
    ok(invoke(runner, tiny_model_dir, src, out))
    before = rows_by_id(read_output(out))
    result = invoke(runner, tiny_model_dir, src, out)
    assert result.exit_code in (0, 2) and "Traceback" not in result.output, (result.output, result.exception)
    if result.exit_code == 2:
        assert stderr_of(result).strip().splitlines()[-1].startswith("error: ")
    after = read_output(out)
    assert after.num_rows == 3
    assert rows_by_id(after) == before


def test_output_path_that_is_a_file(runner, tiny_model_dir, tmp_path):
    src = write_parquet(tmp_path / "in.parquet", text=["x"])
    out = tmp_path / "out.txt"
    out.write_text("keep me")
    result = invoke(runner, tiny_model_dir, src, out)
    assert result.exit_code == 2 and "Traceback" not in result.output, (result.output, result.exception)
    last = stderr_of(result).strip().splitlines()[-1]
    assert last.startswith("error: ") and "not a directory" in last
    assert out.read_text() == "keep me"


@pytest.mark.parametrize(("flags", "needle"), [
    (["--max-new-tokens", "-3"], "--max-new-tokens (YAML max_new_tokens) must be a positive integer, got -3"),
    (["--mode", "fast"], "--mode (YAML mode) must be one of auto, continuous, static; got 'fast'"),
    (["--top-p", "0"], "--top-p (YAML top_p) must be in (0, 1]"),
    (["--on-long-prompt", "skip"], "--on-long-prompt (YAML on_long_prompt) must be one of truncate, error"),
    (["--kv-cache-memory", "lots"], "--kv-cache-memory (YAML kv_cache_memory): cannot read 'lots'"),
    (["--top-k", "-7"], "--top-k (YAML top_k) must be >= 1, or -1 / 0 for no limit; got -7"),
    (["--template", "{text.__class__}"], "not allowed"),
    (["--stop-grace-seconds", "-1"], "--stop-grace-seconds (YAML stop_grace_seconds) must be a number of seconds >= 0"),
    (["--checkpoint-in-flight-every", "-5"],
     "--checkpoint-in-flight-every (YAML checkpoint_in_flight_every) must be a number of seconds >= 0"),
])
def test_bad_config_values(runner, tiny_model_dir, tmp_path, flags, needle):
    src = write_parquet(tmp_path / "in.parquet", text=["x"])
    out = tmp_path / "out"
    assert_user_error(invoke(runner, tiny_model_dir, src, out, *flags), out, needle)


@pytest.mark.parametrize(("text", "needle"), [
    ("max_token: 5\n", "unknown setting 'max_token'; did you mean 'max_tokens'?"),
    ("max_new_tokens: [5\n", "not valid YAML"),
    ("top_k: '40'\n", "--top-k (YAML top_k) must be an integer"),
    ("- a list\n", "expected a mapping"),
])
def test_bad_yaml_config(runner, tiny_model_dir, tmp_path, text, needle):
    src = write_parquet(tmp_path / "in.parquet", text=["x"])
    config = tmp_path / "job.yaml"
    config.write_text(text)
    out = tmp_path / "out"
    result = invoke(runner, tiny_model_dir, src, out, "--config", config)
    assert_user_error(result, out, needle)


def test_missing_config_file(runner, tiny_model_dir, tmp_path):
    src = write_parquet(tmp_path / "in.parquet", text=["x"])
    out = tmp_path / "out"
    result = invoke(runner, tiny_model_dir, src, out, "--config", tmp_path / "nope.yaml")
    assert_user_error(result, out, "config file not found")


def test_missing_model_dir(runner, tmp_path):
    src = write_parquet(tmp_path / "in.parquet", text=["x"])
    out = tmp_path / "out"
    assert_user_error(invoke(runner, tmp_path / "no-model", src, out), out, "model path not found")


# ---------------------------------------------------------------- config file, version, help


def test_yaml_config_with_flags_overriding_it(runner, tiny_model_dir, tmp_path):
    src = write_parquet(tmp_path / "in.parquet", body=["one", "two", "three"], doc=["a", "b", "c"])
    config = tmp_path / "job.yaml"
    config.write_text(
        f"input: {src}\n"
        f"model: {tiny_model_dir}\n"
        "prompt_column: body\n"
        "max_new_tokens: 2\n"
        "ignore_eos: true\n"
        "chat: false\n"
        "keep_columns: [doc]\n"
        "max_rows: 1\n")
    out = tmp_path / "out"
    # --max-new-tokens 5 and --max-rows 3 on the command line win over the file's 2 and 1
    result = runner.invoke(app, ["run", "--config", str(config), "--output", str(out), "--device", "cpu",
                                 "--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-new-tokens", "5",
                                 "--max-rows", "3", "--quiet"])
    ok(result)
    table = read_output(out)
    assert table.column_names == ["row_id", *FIXED_COLUMNS, "doc"]
    assert table.num_rows == 3
    assert set(table.column("num_generated_tokens").to_pylist()) == {5}  # flag, with the file's ignore_eos
    rows = rows_by_id(table)
    assert [rows[f"in.parquet:{i}"]["num_prompt_tokens"] for i in range(3)] == [3, 3, 5]  # body, no chat


def test_version(runner):
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout.strip() == f"batchgen {__version__}"


RUN_FLAGS = [
    "--input", "--output", "--config", "--model", "--trust-remote-code", "--prompt-column", "--id-column",
    "--template", "--system", "--chat", "--no-chat", "--max-new-tokens", "--max-new-tokens-column",
    "--temperature", "--top-p", "--top-k", "--seed", "--stop", "--ignore-eos", "--batch-size",
    "--max-num-batched-tokens", "--kv-cache-memory", "--mode", "--device", "--dtype", "--max-rows",
    "--on-long-prompt", "--keep-columns", "--rows-per-part", "--quiet", "--window-rows", "--length-column",
    "--sort-by-length", "--no-sort-by-length", "--static-min-occupancy", "--attention-backend", "--block-size",
    "--cuda-graphs", "--no-cuda-graphs", "--stop-grace-seconds", "--checkpoint-in-flight-every",
]


def test_run_help_lists_the_flags(runner):
    result = runner.invoke(app, ["run", "--help"])
    assert result.exit_code == 0
    for flag in RUN_FLAGS:
        assert flag in result.output, flag
    # defaults written as [value] in the help text must survive (rich markup would eat "[text]")
    for default in ("[text]", "[256]", "[auto]", "[truncate]"):
        assert default in result.output, default


def test_engine_flags_reach_the_config_and_bad_values_exit_2(runner, tmp_path):
    from batchgen.config.job import build_config

    config = build_config(None, inputs=["x"], output="o", attention_backend="torch", block_size=32, cuda_graphs=False)
    assert (config.attention_backend, config.block_size, config.cuda_graphs) == ("sdpa", 32, False)  # old name
    result = runner.invoke(app, ["run", "--input", "x.parquet", "--output", str(tmp_path / "o"),
                                 "--attention-backend", "flashinfer"])
    assert result.exit_code == 2 and "--attention-backend (YAML attention_backend) must be one of" in result.output


def test_no_arguments_shows_help(runner):
    result = runner.invoke(app, [])
    assert "run" in result.output
    assert "Traceback" not in result.output
