"""The fleet's shared adapter store: adapter file pairs in an S3-compatible bucket
(``--adapter-store-url s3://BUCKET/PREFIX``), shared by every replica.

Objects are content-addressed::

    {PREFIX}/blobs/{digest}/adapter_config.json
    {PREFIX}/blobs/{digest}/adapter_model.safetensors

where digest = digest(config, weights), so replacing an adapter writes a new pair and never
overwrites bytes another replica may be reading; the caller (the registry) records which pair
an adapter id points at, with both files' sha256, and deletes pairs nothing points at
(``keys()`` lists them). ``get`` checks both sha256s before returning anything, so a tampered or
corrupted object is refused, never served.

boto3 is synchronous: the gateway calls these methods through asyncio.to_thread. The client is
built on first use (adapters.s3.s3_client), with endpoint and credentials from the AWS chain.
"""

from __future__ import annotations

import hashlib
import logging
import re

from loragw.adapters.s3 import (
    DEFAULT_OPTIONS,
    MAX_OBJECT_BYTES,
    ObjectCorrupted,
    ObjectNotFound,
    ObjectTooLarge,
    S3Options,
    read_object,
    s3_client,
    s3_errors,
)
from loragw.adapters.safetensors_check import CONFIG_FILE, WEIGHTS_FILE
from loragw.adapters.source_checks import MAX_CONFIG_BYTES, S3_SCHEME, parse_s3_url
from loragw.adapters.types import FileDigests

logger = logging.getLogger(__name__)

BLOBS = "blobs"
_SHA256_META = "sha256"  # user metadata (x-amz-meta-sha256) put() writes on each object
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_CONTENT_TYPES = {CONFIG_FILE: "application/json", WEIGHTS_FILE: "application/octet-stream"}


def pair_digest(config_sha256: str, sha256: str) -> str:
    """The digest naming a pair, from its files' hex sha256s (as the registry records them)."""
    assert _SHA256_HEX.fullmatch(config_sha256) and _SHA256_HEX.fullmatch(sha256)
    return hashlib.sha256(f"{config_sha256}\n{sha256}".encode()).hexdigest()


def digest(config_raw: bytes, weights_raw: bytes) -> str:
    """Hex sha256 identifying the pair: over the two files' hex sha256s, config first."""
    files = FileDigests.of(config_raw, weights_raw)
    return pair_digest(files.config, files.weights)


class ObjectStore:
    """Adapter pairs under ``s3://BUCKET/PREFIX/blobs/``; a pair's key is its folder's key."""

    def __init__(self, url: str, *, options: S3Options = DEFAULT_OPTIONS) -> None:
        self.bucket, self.prefix = parse_s3_url(url, require_prefix=False)  # ValueError if bad
        self.url = f"{S3_SCHEME}{self.bucket}/{self.prefix}".rstrip("/")
        self._blobs = f"{self.prefix}/{BLOBS}/" if self.prefix else f"{BLOBS}/"
        self._options = options
        self._client = None

    def __repr__(self) -> str:
        return f"ObjectStore({self.url!r})"

    @property
    def client(self):
        """The boto3 S3 client, built (boto3 imported) on first use."""
        if self._client is None:
            self._client = s3_client(self._options)
        return self._client

    def key_for(self, pair_digest_hex: str) -> str:
        """``{PREFIX}/blobs/{digest}``: the key put() returns for a pair with that digest."""
        assert _SHA256_HEX.fullmatch(pair_digest_hex), pair_digest_hex
        return self._blobs + pair_digest_hex

    def check(self) -> None:
        """One cheap call at start-up: fails with what to fix when the bucket is missing, the
        credentials are refused or the endpoint cannot be reached."""
        with s3_errors(self.client, self.bucket):
            self.client.head_bucket(Bucket=self.bucket)

    def put(self, config_raw: bytes, weights_raw: bytes,
            digests: FileDigests | None = None) -> str:
        """Upload a pair and return its key; a file already there (same size and recorded
        sha256, one HEAD) is not uploaded again. Weights go first, so a pair whose config is
        present was complete once. `digests`: the files' sha256s where the caller has them.
        """
        digests = digests or FileDigests.of(config_raw, weights_raw)
        key = self.key_for(pair_digest(digests.config, digests.weights))
        for name, raw, sha256 in ((WEIGHTS_FILE, weights_raw, digests.weights),
                                  (CONFIG_FILE, config_raw, digests.config)):
            object_key = f"{key}/{name}"
            if self._head(object_key) == (len(raw), sha256):
                continue  # content-addressed: these bytes are there already
            with s3_errors(self.client, self.bucket, object_key):
                self.client.put_object(Bucket=self.bucket, Key=object_key, Body=raw,
                                       ContentType=_CONTENT_TYPES[name],
                                       Metadata={_SHA256_META: sha256})  # fmt: skip
            logger.info("uploaded %s (%d bytes) to s3://%s", object_key, len(raw), self.bucket)
        return key

    def get(
        self, key: str, sha256: str, config_sha256: str, *, max_bytes: int = MAX_OBJECT_BYTES
    ) -> tuple[bytes, bytes]:
        """(adapter_config.json, adapter_model.safetensors) of the pair at key, each checked
        against its recorded hex sha256 (sha256: the weights', config_sha256: the config's)
        before anything is returned. Weights over max_bytes are refused unread."""
        self._check_key(key)
        files = []
        for name, expected, limit in (
            (CONFIG_FILE, config_sha256, MAX_CONFIG_BYTES),
            (WEIGHTS_FILE, sha256, max_bytes),
        ):
            where = f"{S3_SCHEME}{self.bucket}/{key}/{name}"
            try:
                raw, _ = read_object(self.client, self.bucket, f"{key}/{name}", limit)
            except ObjectTooLarge as e:
                raise ObjectCorrupted(
                    f"adapter object {key}: {e}; the store holds only what this gateway"
                    " uploaded, so it was tampered with or written by a server with a larger"
                    " limit; upload the adapter again"
                ) from None
            actual = hashlib.sha256(raw).hexdigest()
            if actual != expected:
                raise ObjectCorrupted(
                    f"adapter object {key}: {where} has sha256 {actual[:16]}..., not the"
                    f" recorded {expected[:16]}...: the object was tampered with or corrupted;"
                    " upload the adapter again to replace it"
                )
            files.append(raw)
        config_raw, weights_raw = files
        return config_raw, weights_raw

    def delete(self, key: str) -> None:
        """Delete a pair's objects; objects already gone are fine."""
        self._check_key(key)
        for name in (CONFIG_FILE, WEIGHTS_FILE):  # config first: a pair without it is partial
            with s3_errors(self.client, self.bucket, f"{key}/{name}"):
                self.client.delete_object(Bucket=self.bucket, Key=f"{key}/{name}")

    def keys(self) -> set[str]:
        """Keys of the pairs present (complete or not) under ``{PREFIX}/blobs/``."""
        found: set[str] = set()
        with s3_errors(self.client, self.bucket):
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._blobs, Delimiter="/"
            )
            for page in pages:
                for common in page.get("CommonPrefixes", []):
                    key = common["Prefix"].rstrip("/")
                    if _SHA256_HEX.fullmatch(key[len(self._blobs) :]):
                        found.add(key)
        return found

    def _head(self, object_key: str) -> tuple[int, str | None] | None:
        """(size, the sha256 put() recorded) of an object, None if there is none. The sha256
        lets put() repair a same-sized object that was overwritten; get() never trusts it."""
        try:
            with s3_errors(self.client, self.bucket, object_key):
                head = self.client.head_object(Bucket=self.bucket, Key=object_key)
        except ObjectNotFound:
            return None
        return head["ContentLength"], head.get("Metadata", {}).get(_SHA256_META)

    def _check_key(self, key: str) -> None:
        if not (key.startswith(self._blobs) and _SHA256_HEX.fullmatch(key[len(self._blobs) :])):
            raise ValueError(
                f"{key!r} is not a pair key of {self.url} ({self._blobs}<sha256 hex>);"
                " use the key put() returned"
            )
