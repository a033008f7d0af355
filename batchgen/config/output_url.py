"""Which --output URLs a job can write: checked with the config, before any store is opened.

A URL that no store here writes would otherwise become a local directory named "ftp:"; the rule
needs only the URL and pyarrow's build, so it sits with the config's other checks.
"""

from __future__ import annotations

import re

import pyarrow.fs as pafs

from batchgen.errors import UnsupportedOutputError

URL_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
OBJECT_SCHEMES = ("s3", "gs")  # object stores pyarrow.fs reaches; gs only where pyarrow has GcsFileSystem


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
