"""Which --output URLs a job can write: checked with the config, before any store is opened.

A URL that no store here writes would otherwise become a local directory named "ftp:"; the rule
needs only the URL and pyarrow's build, so it sits with the config's other checks.

An --output that ends in `.jsonl` names one file, as `vllm run-batch -o` does: the OpenAI Batch
output file itself (jobs/openai/batch_file.py). A job needs a directory for its exactly-once
bookkeeping (manifest, parts, lock or lease), so it keeps them in a sibling, `<file>.batchgen/`,
and every command that takes --output (status, compact, finalize, report) finds them there from
the file's name. A trailing slash (`out.jsonl/`) still names a directory.
"""

from __future__ import annotations

import os
import re

import pyarrow.fs as pafs

from batchgen.errors import UnsupportedOutputError

URL_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
OBJECT_SCHEMES = ("s3", "gs")  # object stores pyarrow.fs reaches; gs only where pyarrow has GcsFileSystem


BATCH_FILE_SUFFIX = ".jsonl"
BOOKKEEPING_SUFFIX = ".batchgen"  # the sibling directory of a .jsonl --output


def names_batch_file(output) -> bool:
    """True when `output` names one .jsonl file rather than a directory (a trailing slash keeps one)."""
    return isinstance(output, (str, os.PathLike)) and str(output).lower().endswith(BATCH_FILE_SUFFIX)


def job_output_dir(output):
    """Where a job's bookkeeping lives for an --output value: a .jsonl file's sibling
    `<file>.batchgen`, else the value itself."""
    return f"{output}{BOOKKEEPING_SUFFIX}" if names_batch_file(output) else output


def batch_file_of(job_dir) -> str | None:
    """The .jsonl --output whose bookkeeping `job_dir` holds (job_output_dir's inverse), else None."""
    text = str(job_dir).rstrip("/")
    if text.lower().endswith(BATCH_FILE_SUFFIX + BOOKKEEPING_SUFFIX):
        return text[:-len(BOOKKEEPING_SUFFIX)]
    return None


def is_url(text) -> bool:
    return isinstance(text, str) and URL_RE.match(text) is not None


def check_output_url(text: str) -> None:
    """Refuse an output URL that no object store here can write (exit 2); a local path passes."""
    if is_url(text):
        check_object_url(text)


def check_object_url(text: str) -> None:
    """Refuse an output URL that no object store here can write (exit 2)."""
    m = URL_RE.match(text)
    assert m is not None, "a URL"
    scheme = m.group(1).lower()
    if scheme == "gs" and not hasattr(pafs, "GcsFileSystem"):
        raise UnsupportedOutputError(f"--output {text}: this pyarrow was built without Google Cloud Storage "
                                     "support; write to s3://, a local or a mounted directory")
    if scheme not in OBJECT_SCHEMES:
        raise UnsupportedOutputError(f"--output {text}: writing to a {scheme}:// URL is not supported; use "
                                     "s3://bucket/prefix, gs://bucket/prefix, or a local or mounted directory")
    bucket_and_prefix = text[m.end():].strip("/")
    if "/" not in bucket_and_prefix or not bucket_and_prefix.split("/", 1)[1]:
        raise UnsupportedOutputError(f"--output {text}: give a prefix inside the bucket "
                                     f"({scheme}://BUCKET/PREFIX): a job's output never takes a whole bucket")
