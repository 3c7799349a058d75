"""S3 (and S3-compatible: MinIO, R2, GCS interop, moto) access shared by the adapter store
(adapters.object_store) and s3:// adapter sources (adapters.sources): one client factory, one
mapping from boto3's errors to AdapterErrors, reads with a size limit.

Endpoint, credentials and region come from boto3's standard chain: AWS_ENDPOINT_URL /
AWS_ENDPOINT_URL_S3, AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, AWS_PROFILE,
web identity (IRSA), instance metadata; AWS_DEFAULT_REGION (or AWS_REGION, else us-east-1).
boto3 is synchronous (call it through asyncio.to_thread) and is imported only when a client is
built, so importing this module costs nothing.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.parse import urlsplit

from loragw.adapters.chat_files import CHAT_FILES, MAX_CHAT_FILE_BYTES
from loragw.adapters.errors import AdapterError, AdapterNotFound, StoreUnavailable
from loragw.adapters.safetensors_check import CONFIG_FILE, WEIGHTS_FILE
from loragw.adapters.source_checks import MAX_CONFIG_BYTES, PICKLE_SUFFIXES, pickle_refusal

DEFAULT_REGION = "us-east-1"
MAX_OBJECT_BYTES = 2 << 30  # the largest weights object read into memory
# What the client depends on; a change (a test, a rotated secret) builds a new client.
_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_REGION", "AWS_REGION")  # fmt: skip
_CREDENTIALS_HELP = (
    "check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN), or AWS_PROFILE"
    " / the pod's IAM role when those are unset, and that they may read and write the bucket"
)
_DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "Forbidden",
           "ExpiredToken", "InvalidToken", "TokenRefreshRequired", "AuthorizationHeaderMalformed",
           "AllAccessDisabled", "AccountProblem"}  # fmt: skip
_BUSY = {"SlowDown", "ServiceUnavailable", "503", "RequestTimeout"}


class ObjectStoreError(AdapterError):
    """The object store answered with an error this server cannot fix (HTTP 502)."""

    status = 502


class ObjectStoreDenied(ObjectStoreError):
    """The object store refused this server's credentials, or has none to use (HTTP 502)."""


class ObjectCorrupted(ObjectStoreError):
    """An object's bytes are not the ones recorded for it: tampered with or corrupted (502)."""


class ObjectStoreUnavailable(StoreUnavailable):
    """The object store cannot be reached, or asks to retry later (HTTP 503)."""


class ObjectNotFound(AdapterNotFound):
    """No object at that key (HTTP 404)."""


class BucketNotFound(ObjectNotFound):
    """No bucket by that name at the endpoint (HTTP 404)."""


class ObjectTooLarge(AdapterError):
    """An object is larger than the caller's limit; nothing past the limit was read (422)."""


@dataclass(frozen=True)
class S3Options:
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0
    max_attempts: int = 3  # botocore's count: the first try included


DEFAULT_OPTIONS = S3Options()

_clients: dict[tuple, object] = {}
_clients_lock = threading.Lock()  # boto3 Session creation is not thread-safe


def s3_client(options: S3Options = DEFAULT_OPTIONS):
    """The process's S3 client for these options and the current AWS_* environment, built once.

    Path-style addressing whenever AWS_ENDPOINT_URL(_S3) points at a non-AWS endpoint (MinIO,
    moto and most interop stores have no per-bucket DNS names).
    """
    cache_key = (options, *(os.environ.get(name) for name in _ENV))
    with _clients_lock:
        client = _clients.get(cache_key)
        if client is None:
            client = _clients[cache_key] = _build_client(options)
        return client


def _build_client(options: S3Options):
    import boto3
    from botocore.config import Config

    session = boto3.session.Session()
    custom_endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    kwargs = dict(
        connect_timeout=options.connect_timeout_s,
        read_timeout=options.read_timeout_s,
        retries={"max_attempts": options.max_attempts, "mode": "standard"},
        s3={"addressing_style": "path"} if custom_endpoint else {},
    )
    # botocore >= 1.36 sends CRC32 checksums on every upload by default, which several
    # S3-compatible stores reject; send them only where the API requires one.
    if "request_checksum_calculation" in Config.OPTION_DEFAULTS:
        kwargs.update(request_checksum_calculation="when_required",
                      response_checksum_validation="when_required")  # fmt: skip
    region = session.region_name or os.environ.get("AWS_REGION") or DEFAULT_REGION
    return session.client("s3", region_name=region, config=Config(**kwargs))


def endpoint_of(client) -> str:
    """The client's endpoint for messages, with any user:password@ dropped."""
    parts = urlsplit(client.meta.endpoint_url or "")
    return f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "")


def explain_s3_error(e: Exception, *, endpoint: str, bucket: str, key: str | None) -> Exception:
    """The AdapterError for a boto3/botocore error; anything else is returned unchanged.

    key=None means the call was about the bucket itself (head_bucket, listing), so a bare 404
    means the bucket is missing. Messages name the endpoint, bucket and key, never a secret.
    """
    from botocore.exceptions import (
        BotoCoreError,
        ClientError,
        ConnectionError,
        CredentialRetrievalError,
        HTTPClientError,
        NoCredentialsError,
        PartialCredentialsError,
    )

    where = f"s3://{bucket}/{key}" if key else f"bucket {bucket!r}"
    if isinstance(e, (NoCredentialsError, PartialCredentialsError, CredentialRetrievalError)):
        return ObjectStoreDenied(
            f"no usable AWS credentials for {where} at {endpoint} ({type(e).__name__}); "
            + _CREDENTIALS_HELP
        )
    if isinstance(e, (ConnectionError, HTTPClientError)):
        return ObjectStoreUnavailable(
            f"cannot reach the object store at {endpoint} for {where} ({type(e).__name__});"
            " check AWS_ENDPOINT_URL and the network, then retry"
        )
    if isinstance(e, ClientError):
        error = e.response.get("Error", {})
        code = str(error.get("Code", "?"))
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        shown = f"HTTP {code}" if code.isdigit() else code  # HEAD answers have no error code
        if code == "NoSuchBucket" or (code in ("404", "NotFound") and key is None):
            return BucketNotFound(
                f"no bucket {bucket!r} at {endpoint}; create it, or fix the bucket in the URL"
            )
        if code in ("NoSuchKey", "404", "NotFound"):
            return ObjectNotFound(f"no object at {where} (endpoint {endpoint})")
        if code in _DENIED:
            return ObjectStoreDenied(
                f"the object store at {endpoint} refused this server's credentials for"
                f" {where} ({shown}); " + _CREDENTIALS_HELP
            )
        if code in _BUSY:
            return ObjectStoreUnavailable(
                f"the object store at {endpoint} is busy ({shown}) for {where}; retry later"
            )
        message = str(error.get("Message", ""))[:200]
        return ObjectStoreError(
            f"the object store at {endpoint} failed on {where}: {shown} (HTTP {status}) {message}"
        )
    if isinstance(e, BotoCoreError):
        return ObjectStoreError(f"S3 client error on {where} at {endpoint}: {type(e).__name__}")
    return e


@contextmanager
def s3_errors(client, bucket: str, key: str | None = None) -> Iterator[None]:
    """Turn boto3 errors raised inside into AdapterErrors (explain_s3_error)."""
    try:
        yield
    except AdapterError:
        raise
    except Exception as e:
        raise explain_s3_error(e, endpoint=endpoint_of(client), bucket=bucket, key=key) from e


def read_object(client, bucket: str, key: str, limit: int) -> tuple[bytes, str | None]:
    """(bytes, ETag) of one object; ObjectTooLarge past ``limit`` bytes, read no further."""
    with s3_errors(client, bucket, key):
        response = client.get_object(Bucket=bucket, Key=key)
        body = response["Body"]
        try:
            size = response.get("ContentLength")
            if size is not None and size > limit:
                raise ObjectTooLarge(f"s3://{bucket}/{key} is {size} bytes; at most {limit}")
            data = body.read(limit + 1)  # +1: a body without a length still cannot overrun
        finally:
            body.close()
    if len(data) > limit:
        raise ObjectTooLarge(f"s3://{bucket}/{key} is larger than {limit} bytes")
    if size is not None and len(data) != size:
        raise ObjectStoreUnavailable(
            f"s3://{bucket}/{key}: the connection closed after {len(data)} of {size} bytes; retry"
        )
    return data, (response.get("ETag") or "").strip('"') or None


def list_folder(client, bucket: str, prefix: str) -> tuple[dict[str, int], bool]:
    """({file name: size} directly under ``prefix/``, whether it has subfolders)."""
    files: dict[str, int] = {}
    subfolders = False
    with s3_errors(client, bucket):
        pages = client.get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=f"{prefix}/", Delimiter="/"
        )
        for page in pages:
            files.update({o["Key"][len(prefix) + 1 :]: o["Size"] for o in page.get("Contents", [])})
            subfolders = subfolders or bool(page.get("CommonPrefixes"))
    return files, subfolders


def fetch_s3_folder(
    bucket: str, prefix: str, *, max_weights_bytes: int = MAX_OBJECT_BYTES
) -> tuple[bytes, bytes, str | None, dict[str, bytes]]:
    """(adapter_config.json, adapter_model.safetensors, the weights' ETag, the chat files it
    also holds) of s3://bucket/prefix/.

    One listing first, so a pickle-only folder is refused and oversized files are caught
    before anything is downloaded.
    """
    client = s3_client()
    where = f"s3://{bucket}/{prefix}/"
    files, subfolders = list_folder(client, bucket, prefix)
    if not files and not subfolders:
        raise AdapterNotFound(f"no objects under {where}; check the bucket and path")
    if WEIGHTS_FILE not in files:
        pickled = sorted(f for f in files if f.lower().endswith(PICKLE_SUFFIXES))
        if pickled:
            raise AdapterError(pickle_refusal(where, pickled))
        raise AdapterNotFound(f"{where} has no {WEIGHTS_FILE}; is it a PEFT LoRA adapter folder?")
    if CONFIG_FILE not in files:
        raise AdapterNotFound(f"{where} has no {CONFIG_FILE}; is it a PEFT LoRA adapter folder?")
    limits = {CONFIG_FILE: MAX_CONFIG_BYTES, WEIGHTS_FILE: max_weights_bytes}
    for name, limit in limits.items():
        if files[name] > limit:
            raise AdapterError(f"{where}{name} is {files[name]} bytes; at most {limit}")
    # read_object enforces the limits again: a file may be replaced after the listing
    config_raw, _ = read_object(client, bucket, f"{prefix}/{CONFIG_FILE}", MAX_CONFIG_BYTES)
    weights_raw, etag = read_object(client, bucket, f"{prefix}/{WEIGHTS_FILE}", max_weights_bytes)
    chat = {name: read_object(client, bucket, f"{prefix}/{name}", MAX_CHAT_FILE_BYTES)[0]
            for name in CHAT_FILES if name in files}
    return config_raw, weights_raw, etag, chat
