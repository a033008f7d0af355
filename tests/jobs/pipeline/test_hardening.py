"""Bad rows, bad files and bad disks: each case ends in error rows (the job goes on) or in one
clear exit-2 error naming the file, row and column; never in a traceback, a lost or a doubled row.

Policies pinned here (docs/output-and-resume.md, "Bad input"):
  - null, empty, whitespace and non-text prompts, prompts over the context under
    --on-long-prompt error, cells that are not valid text (invalid UTF-8 in Parquet, lone
    surrogates in JSON) -> error rows;
  - duplicate or null ids, invalid UTF-8 bytes on a JSON Lines line, a corrupt Parquet footer,
    an unreadable input -> InputError before any output;
  - a truncated last JSON Lines line (no newline) -> skipped with a warning;
  - ENOSPC / EIO while writing -> OutputError; committed rows stay, the rerun completes the job;
  - an output directory that cannot be created or written -> OutputError before the model loads.
"""

from __future__ import annotations

import errno
import json
import os
import shutil

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from batchgen.cli import app
from batchgen.engine.model.loader import load_model
from batchgen.errors import InputError, OutputError
from batchgen.io.inputs import discovery
from batchgen.io.manifest.manifest import SUCCESS_FILE, load_manifest
from batchgen.io.store import local_files, writers
from batchgen.jobs.commands.run import run_job
from tests.jobs.helpers import committed_rows, tiny_job_config

MAX_NEW = 3


@pytest.fixture(scope="module")
def short_context(tiny_model_dir, tmp_path_factory):
    """The tiny Llama with a 48-token context (rope: only the config changes)."""
    path = tmp_path_factory.mktemp("ctx48")
    for item in tiny_model_dir.iterdir():
        shutil.copy(item, path / item.name)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 48
    (path / "config.json").write_text(json.dumps(config))
    return path, load_model(str(path), device="cpu", dtype="float32")


def config(src, out, model_dir, **overrides):
    # these inputs are mostly bad rows on purpose: any share of error rows is accepted (--max-error-rate 1)
    return tiny_job_config(src, out, model_dir, **{**dict(max_new_tokens=MAX_NEW, chat=False, commit_every_rows=3,
                                                          max_error_rate=1.0), **overrides})


def output(out, id_column="row_id") -> dict:
    return committed_rows(out, id_column)


def write_jsonl_bytes(path, lines: list[bytes], *, final_newline=True):
    path.write_bytes(b"\n".join(lines) + (b"\n" if final_newline else b""))
    return path


# ---------------------------------------------------------------- bad rows become error rows


def test_null_empty_whitespace_and_non_string_prompts(tiny_model_dir, loaded, tmp_path):
    src = tmp_path / "in.jsonl"
    records = [{"text": "fine"}, {"text": None}, {"text": ""}, {"text": "   \n"}, {"text": ["a", "list"]},
               {"other": "no text key"}, {"text": 42}]
    write_jsonl_bytes(src, [json.dumps(r).encode() for r in records])
    out = tmp_path / "out"
    summary = run_job(config(src, out, tiny_model_dir), loaded=loaded)
    rows = output(out)
    assert summary.num_rows == len(records) == len(rows) and (out / SUCCESS_FILE).exists()
    errors = {int(k.split(":")[1]): r["error"] for k, r in rows.items()}
    # numbers are read as text (as from Parquet); an array is no text, though its column of mixed
    # kinds holds its JSON text (passed through as such)
    assert errors[0] is None and errors[6] is None
    assert errors[4] == f"prompt column 'text' holds a list, not text ({src}, row 4)"
    assert rows["in.jsonl:4"]["text"] == '["a", "list"]'
    assert errors[1] == "prompt column 'text' is null"
    assert errors[2] == "prompt column 'text' is empty"
    assert errors[3] == "prompt column 'text' is whitespace only"
    assert errors[5] in ("prompt column 'text' is null", "prompt column 'text' is missing from this row")
    for i in (1, 2, 3, 4, 5):
        assert rows[f"in.jsonl:{i}"]["finish_reason"] == "error"


@pytest.mark.parametrize(("column", "kind"), [(pa.array([b"bytes", b"more"], pa.binary()), "bytes"),
                                              (pa.array([["a"], ["b", "c"]]), "list")])
def test_non_text_parquet_prompt_column_is_an_error_row(tiny_model_dir, loaded, tmp_path, column, kind):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": column}), src)
    out = tmp_path / "out"
    run_job(config(src, out, tiny_model_dir), loaded=loaded)
    assert {r["error"] for r in output(out).values()} == {f"prompt column 'text' holds a {kind}, not text ({src}, "
                                                          f"row {i})" for i in range(2)}


CONVERSATIONS = [[{"role": "user", "content": "hi"}],
                 [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why?"}]]


def write_chat(tmp_path, fmt, conversations):
    records = [{"messages": m, "meta": {"n": i}, "text": "plain"} for i, m in enumerate(conversations)]
    src = tmp_path / f"in.{fmt}"
    if fmt == "jsonl":
        write_jsonl_bytes(src, [json.dumps(r).encode() for r in records])
    else:
        pq.write_table(pa.Table.from_pylist(records), src)
    return src


def test_a_chat_messages_column_is_the_conversation_in_either_format(tiny_model_dir, loaded, tmp_path, tokenizer):
    """`--prompt-column messages` on a chat dataset is the conversation, not the JSON text
    `[{"role": ...}]` to generate from, in JSON Lines as in Parquet: both render the
    conversation through the chat template (batchgen.jobs.prompting.chat_rows), as for Batch API requests."""
    results = {}
    for fmt in ("jsonl", "parquet"):
        (tmp_path / fmt).mkdir()
        src = write_chat(tmp_path / fmt, fmt, CONVERSATIONS)
        out = tmp_path / fmt / "out"
        summary = run_job(config(src, out, tiny_model_dir, prompt_column="messages", chat=True), loaded=loaded)
        assert summary.output_rows_error == 0 and (out / SUCCESS_FILE).exists()
        rows = output(out)
        results[fmt] = [{k: rows[f"in.{fmt}:{i}"][k] for k in ("generated_text", "num_prompt_tokens", "prompt_hash")}
                        for i in range(2)]
    assert results["jsonl"] == results["parquet"]
    expected = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in CONVERSATIONS]
    assert [r["num_prompt_tokens"] for r in results["jsonl"]] == [
        len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in expected]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_chat_messages_that_cannot_be_a_conversation_are_error_rows(tiny_model_dir, loaded, tmp_path, fmt):
    src = write_chat(tmp_path, fmt, [[{"role": "tool", "content": "x"}], [{"role": "user", "content": "ok"}]])
    summary = run_job(config(src, tmp_path / "out", tiny_model_dir, prompt_column="messages", chat=True),
                      loaded=loaded)
    rows = output(tmp_path / "out")
    assert summary.output_rows_error == 1 and rows[f"in.{fmt}:1"]["error"] is None
    assert rows[f"in.{fmt}:0"]["error"].startswith("prompt column 'messages', message 0: role 'tool' is not supported")
    # without the chat template: error rows that say so
    run_job(config(src, tmp_path / "plain", tiny_model_dir, prompt_column="messages"), loaded=loaded)
    assert all("need the model's chat template" in r["error"] for r in output(tmp_path / "plain").values())
    # a template column holding messages or an object is no text, naming file, row and column
    run_job(config(src, tmp_path / "out2", tiny_model_dir, template="{text} {messages}"), loaded=loaded)
    errors = {r["error"] for r in output(tmp_path / "out2").values()}
    assert errors == {f"column 'messages' holds a list, not text ({src}, row {i}); chat messages are a conversation "
                      "only as the prompt column with no --template (or as OpenAI Batch requests: --input-format "
                      "openai-batch)" for i in range(2)}
    run_job(config(src, tmp_path / "out3", tiny_model_dir, template="{text} {meta}"), loaded=loaded)
    assert {r["error"] for r in output(tmp_path / "out3").values()} == {
        f"column 'meta' holds a dict, not text ({src}, row {i})" for i in range(2)}


@pytest.mark.parametrize("policy", ["truncate", "error"])
def test_prompts_over_the_context(short_context, tmp_path, policy):
    model_dir, loaded = short_context
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": ["short", "x" * 200]}), src)
    out = tmp_path / "out"
    run_job(config(src, out, model_dir, on_long_prompt=policy), loaded=loaded)
    rows = output(out)
    assert rows["in.parquet:0"]["error"] is None
    long_row = rows["in.parquet:1"]
    if policy == "truncate":
        assert long_row["error"] is None and long_row["num_prompt_tokens"] <= 48 - MAX_NEW
    else:
        assert long_row["finish_reason"] == "error" and "context" in long_row["error"]


def test_invalid_utf8_in_a_parquet_cell_is_an_error_row(tiny_model_dir, loaded, tmp_path):
    text = pa.array([b"good", b"bad \xff\xfe bytes", b"fine too"], pa.binary()).view(pa.string())
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": text, "n": [0, 1, 2]}), src)
    out = tmp_path / "out"
    summary = run_job(config(src, out, tiny_model_dir), loaded=loaded)
    rows = output(out)
    assert summary.num_rows == 3 and summary.num_rows_error == 1
    bad = rows["in.parquet:1"]
    assert bad["error"] == "column 'text' is not valid UTF-8 (byte 0xff at offset 4)"
    assert bad["text"] == "bad \ufffd\ufffd bytes" and bad["n"] == 1  # passed through, with replacements
    assert rows["in.parquet:0"]["error"] is None and rows["in.parquet:2"]["error"] is None


def test_lone_surrogate_in_json_is_an_error_row(tiny_model_dir, loaded, tmp_path):
    src = write_jsonl_bytes(tmp_path / "in.jsonl", [b'{"text": "ok", "tag": "a"}',
                                                    b'{"text": "half a pair \\ud83d here", "tag": "b"}',
                                                    b'{"text": "fine", "tag": "\\udfff"}'])
    out = tmp_path / "out"
    run_job(config(src, out, tiny_model_dir), loaded=loaded)
    rows = output(out)
    assert rows["in.jsonl:0"]["error"] is None
    assert rows["in.jsonl:1"]["error"] == "column 'text' holds a lone surrogate escape, which is not valid Unicode"
    assert rows["in.jsonl:1"]["text"] == "half a pair \ufffd here"
    assert rows["in.jsonl:2"]["error"] == "column 'tag' holds a lone surrogate escape, which is not valid Unicode"


def test_invalid_utf8_bytes_on_a_json_line_fail_before_any_output(tiny_model_dir, loaded, tmp_path):
    src = write_jsonl_bytes(tmp_path / "in.jsonl", [b'{"text": "ok"}', b'{"text": "\xc3\x28"}'])
    out = tmp_path / "out"
    with pytest.raises(InputError, match=r"in.jsonl, row 1: invalid UTF-8 at byte 10 on line 2"):
        run_job(config(src, out, tiny_model_dir), loaded=loaded)
    assert not out.exists()


# ---------------------------------------------------------------- bad files


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_duplicate_ids_name_file_row_and_column(tiny_model_dir, loaded, tmp_path, fmt):
    a = tmp_path / f"a.{fmt}"
    b = tmp_path / f"b.{fmt}"
    for path, ids in ((a, ["x", "y"]), (b, ["z", "x"])):
        if fmt == "parquet":
            pq.write_table(pa.table({"doc": ids, "text": ["t"] * 2}), path)
        else:
            write_jsonl_bytes(path, [json.dumps({"doc": i, "text": "t"}).encode() for i in ids])
    out = tmp_path / "out"
    with pytest.raises(InputError) as info:
        run_job(config([a, b], out, tiny_model_dir, id_column="doc"), loaded=loaded)
    assert str(info.value) == (f"{b}, row 1, column 'doc': duplicate id 'x' (first at {a}, row 0); ids must be "
                               "unique, because the output is keyed by them")
    assert not out.exists()


def test_null_id_and_float_ids(tiny_model_dir, loaded, tmp_path):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"doc": [1, None], "text": ["a", "b"]}), src)
    with pytest.raises(InputError, match=r"row 1, column 'doc': id is null"):
        run_job(config(src, tmp_path / "out", tiny_model_dir, id_column="doc"), loaded=loaded)
    pq.write_table(pa.table({"doc": [1.5, 2.5], "text": ["a", "b"]}), src)
    with pytest.raises(InputError, match="holds double; ids must be integers or strings"):
        run_job(config(src, tmp_path / "out", tiny_model_dir, id_column="doc"), loaded=loaded)


def test_truncated_last_json_line_is_skipped(tiny_model_dir, loaded, tmp_path, caplog):
    src = write_jsonl_bytes(tmp_path / "in.jsonl", [b'{"text": "one"}', b'{"text": "two"}', b'{"text": "thr'],
                            final_newline=False)
    out = tmp_path / "out"
    summary = run_job(config(src, out, tiny_model_dir), loaded=loaded)
    assert summary.num_rows == 2 and sorted(output(out)) == ["in.jsonl:0", "in.jsonl:1"]
    assert "skipped the truncated last line 3" in caplog.text
    assert load_manifest(out).inputs["inputs"][0]["num_rows"] == 2
    assert (out / SUCCESS_FILE).exists()


def test_corrupt_parquet_footer(tiny_model_dir, loaded, tmp_path):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": ["a", "b", "c"]}), src)
    data = src.read_bytes()
    src.write_bytes(data[:-12] + b"\x00" * 8 + data[-4:])  # footer length and metadata overwritten
    out = tmp_path / "out"
    with pytest.raises(InputError, match="in.parquet: not a valid Parquet file"):
        run_job(config(src, out, tiny_model_dir), loaded=loaded)
    assert not out.exists()


class _DenyingHandler(pafs.FileSystemHandler):
    """The local filesystem, except that opening `denied` fails as it would without read permission."""

    def __init__(self, denied: str, fs: pafs.FileSystem):
        self.fs = fs
        self.denied = denied

    def _check(self, path):
        if path == self.denied:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)

    def get_type_name(self): return "denying"
    def normalize_path(self, path): return path
    def get_file_info(self, paths): return self.fs.get_file_info(paths)
    def get_file_info_selector(self, selector): return self.fs.get_file_info(selector)
    def open_input_file(self, path): self._check(path); return self.fs.open_input_file(path)  # noqa: E702
    def open_input_stream(self, path): self._check(path); return self.fs.open_input_stream(path)  # noqa: E702
    def create_dir(self, path, recursive): raise NotImplementedError
    def delete_dir(self, path): raise NotImplementedError
    def delete_dir_contents(self, path, missing_dir_ok=False): raise NotImplementedError
    def delete_root_dir_contents(self): raise NotImplementedError
    def delete_file(self, path): raise NotImplementedError
    def move(self, src, dest): raise NotImplementedError
    def copy_file(self, src, dest): raise NotImplementedError
    def open_output_stream(self, path, metadata): raise NotImplementedError
    def open_append_stream(self, path, metadata): raise NotImplementedError


@pytest.mark.parametrize("name", ["in.parquet", "in.jsonl"])
def test_unreadable_input_file(tiny_model_dir, loaded, tmp_path, monkeypatch, name):
    src = tmp_path / name
    if name.endswith(".parquet"):
        pq.write_table(pa.table({"text": ["a"]}), src)
    else:
        write_jsonl_bytes(src, [b'{"text": "a"}'])
    out = tmp_path / "out"
    if os.geteuid() == 0:  # root reads through permission bits: deny at the filesystem layer instead
        denying = pafs.PyFileSystem(_DenyingHandler(str(src), pafs.LocalFileSystem()))
        monkeypatch.setattr(discovery.pafs, "LocalFileSystem", lambda: denying)
    else:
        src.chmod(0)
    try:
        with pytest.raises(InputError, match=rf"{name}: cannot open: .*Permission denied"):
            run_job(config(src, out, tiny_model_dir), loaded=loaded)
    finally:
        src.chmod(0o644)
    assert not out.exists()


# ---------------------------------------------------------------- bad disks


@pytest.mark.parametrize("stage", ["write", "fsync", "file_write", "file_rename", "rename", "fsync_staged"])
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_disk_errors_while_writing_then_resume(tiny_model_dir, loaded, tmp_path, monkeypatch, stage, code):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": [f"row {i}" for i in range(10)]}), src)
    out = tmp_path / "out"
    calls = []

    def fail(current):
        if current == stage:
            calls.append(current)
            if len(calls) == 3:  # a few commits in: there is committed output to protect
                raise OSError(code, os.strerror(code))

    monkeypatch.setattr(local_files, "_fault_hook", fail)
    with pytest.raises(OutputError, match=os.strerror(code)) as info:
        run_job(config(src, out, tiny_model_dir), loaded=loaded)
    assert info.value.exit_code == 2
    monkeypatch.setattr(local_files, "_fault_hook", None)
    assert not (out / SUCCESS_FILE).exists()
    committed = load_manifest(out).num_committed_rows
    summary = run_job(config(src, out, tiny_model_dir), loaded=loaded)
    assert summary.num_rows == 10 - committed
    assert sorted(output(out)) == sorted(f"in.parquet:{i}" for i in range(10))
    assert not list(out.glob(".*"))


def test_disk_full_through_the_cli_is_one_line_and_exit_2(tiny_model_dir, tmp_path, monkeypatch):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": ["a", "b"]}), src)

    def full(stage):
        if stage == "write":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(local_files, "_fault_hook", full)
    result = CliRunner().invoke(app, ["run", "--input", str(src), "--output", str(tmp_path / "out"), "--model",
                                      str(tiny_model_dir), "--device", "cpu", "--max-new-tokens", "2", "--quiet",
                                      "--kv-cache-memory", "16MiB"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "error: cannot write output part" in result.output and "No space left on device" in result.output


def test_output_dir_that_cannot_be_created(tiny_model_dir, tmp_path):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": ["a"]}), src)
    (tmp_path / "file").write_text("")
    with pytest.raises(OutputError, match="cannot create output directory"):
        run_job(config(src, tmp_path / "file" / "out", tmp_path / "no-model"))  # refused before loading


def test_output_dir_that_is_not_writable(tiny_model_dir, tmp_path, monkeypatch):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": ["a"]}), src)
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o555)
    try:
        if os.geteuid() == 0:  # root writes through permission bits: fail the write probe as EROFS would
            def read_only(self, *args, **kwargs):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS))

            monkeypatch.setattr(writers.Path, "touch", read_only)
        with pytest.raises(OutputError, match="output directory is not writable"):
            run_job(config(src, out, tmp_path / "no-model"))  # refused before the model loads
    finally:
        out.chmod(0o755)
    assert list(out.iterdir()) == []
