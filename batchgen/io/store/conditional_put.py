"""Conditional writes to an object store, through its own SDK: pyarrow.fs has none.

A manifest entry must be written only if its name is free (S3 `If-None-Match: *`, GCS
`ifGenerationMatch=0`), and a lease replaced only if it is still the version this job read (S3
`If-Match: <etag>`, GCS `ifGenerationMatch=<generation>`). With a plain PUT a job that stalled
past its lease and then woke could replace the entry of the job that took over.

boto3 (the `s3` extra) and google-cloud-storage (the `gcs` extra) are optional: an output on a
store whose SDK is missing is refused when it is opened (UnsupportedOutputError, exit 2) rather
than written with an unsafe PUT.
"""

from __future__ import annotations

from typing import Any

from batchgen.errors import OutputError, UnsupportedOutputError

try:  # optional: batchgen[s3]
    import boto3
    import botocore.config
    import botocore.exceptions
except ImportError:
    boto3 = None
try:  # optional: batchgen[gcs]
    import google.api_core.exceptions as gcs_exceptions
    import google.cloud.storage as gcs
except ImportError:
    gcs = None


class PreconditionFailed(Exception):
    """The condition did not hold: the name was taken, or the object changed since it was read."""


class ConditionalPut:
    """put(key, data, if_absent=True) or put(key, data, if_version=token); read(key) -> (data, token).

    A key is "bucket/path", as pyarrow.fs names objects; `where` names the service (its endpoint)."""

    where = ""

    def put(self, key: str, data: bytes, *, if_absent: bool = False, if_version: str | None = None) -> str:
        raise NotImplementedError

    def read(self, key: str) -> tuple[bytes, str]:
        """The object and its version token; FileNotFoundError when it does not exist."""
        raise NotImplementedError


class S3ConditionalPut(ConditionalPut):
    def __init__(self, *, endpoint: str | None, region: str | None, connect_timeout_s: float, request_timeout_s: float):
        # one attempt per call: a conditional PUT retried after it landed fails its own condition,
        # and every attempt must end well inside the lease (batchgen.io.store.lease)
        config = botocore.config.Config(connect_timeout=connect_timeout_s, read_timeout=request_timeout_s,
                                        retries={"total_max_attempts": 1})
        self.client = boto3.client("s3", endpoint_url=endpoint, region_name=region, config=config)
        self.where = self.client.meta.endpoint_url

    def put(self, key: str, data: bytes, *, if_absent: bool = False, if_version: str | None = None) -> str:
        bucket, _, name = key.partition("/")
        extra: dict[str, Any] = {}
        if if_absent:
            extra["IfNoneMatch"] = "*"
        if if_version is not None:
            extra["IfMatch"] = if_version
        try:
            return self.client.put_object(Bucket=bucket, Key=name, Body=data, **extra)["ETag"]
        except botocore.exceptions.ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("PreconditionFailed", "ConditionalRequestConflict"):
                raise PreconditionFailed(key) from e
            raise OutputError(f"cannot write s3://{key}: {e}") from e
        except botocore.exceptions.BotoCoreError as e:
            raise OutputError(f"cannot write s3://{key}: {e}") from e

    def read(self, key: str) -> tuple[bytes, str]:
        bucket, _, name = key.partition("/")
        try:
            response = self.client.get_object(Bucket=bucket, Key=name)
            return response["Body"].read(), response["ETag"]
        except botocore.exceptions.ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                raise FileNotFoundError(key) from e
            raise OutputError(f"cannot read s3://{key}: {e}") from e
        except botocore.exceptions.BotoCoreError as e:
            raise OutputError(f"cannot read s3://{key}: {e}") from e


class GcsConditionalPut(ConditionalPut):
    def __init__(self, *, request_timeout_s: float):
        self.client = gcs.Client()
        self.timeout = request_timeout_s
        self.where = "gcs"

    def _blob(self, key: str):
        bucket, _, name = key.partition("/")
        return self.client.bucket(bucket).blob(name)

    def put(self, key: str, data: bytes, *, if_absent: bool = False, if_version: str | None = None) -> str:
        blob = self._blob(key)
        match = 0 if if_absent else (int(if_version) if if_version is not None else None)
        try:
            blob.upload_from_string(data, if_generation_match=match, timeout=self.timeout)
        except gcs_exceptions.PreconditionFailed as e:
            raise PreconditionFailed(key) from e
        except gcs_exceptions.GoogleAPIError as e:
            raise OutputError(f"cannot write gs://{key}: {e}") from e
        return str(blob.generation)

    def read(self, key: str) -> tuple[bytes, str]:
        blob = self._blob(key)
        try:
            data = blob.download_as_bytes(timeout=self.timeout)
        except gcs_exceptions.NotFound as e:
            raise FileNotFoundError(key) from e
        except gcs_exceptions.GoogleAPIError as e:
            raise OutputError(f"cannot read gs://{key}: {e}") from e
        return data, str(blob.generation)


def conditional_put_for(scheme: str, url: str, *, endpoint: str | None, region: str | None,
                        connect_timeout_s: float, request_timeout_s: float) -> ConditionalPut:
    """The SDK client for `scheme`, or UnsupportedOutputError naming the extra to install."""
    if scheme == "s3":
        if boto3 is None:
            raise UnsupportedOutputError(
                f"--output {url}: writing to s3:// needs boto3 for conditional writes (without them a job that "
                "stalled past its lease could overwrite the next job's commits); pip install 'batchgen[s3]'")
        return S3ConditionalPut(endpoint=endpoint, region=region,
                                connect_timeout_s=connect_timeout_s, request_timeout_s=request_timeout_s)
    assert scheme == "gs", scheme
    if gcs is None:
        raise UnsupportedOutputError(
            f"--output {url}: writing to gs:// needs google-cloud-storage for conditional writes (without them a "
            "job that stalled past its lease could overwrite the next job's commits); pip install 'batchgen[gcs]'")
    return GcsConditionalPut(request_timeout_s=request_timeout_s)
