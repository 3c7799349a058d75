"""The shared adapter store and s3:// adapter sources, against a real S3 API (moto's server on
loopback, credentials enforced): round trips, content addressing, tampering, and each failure
an operator can cause (missing bucket or key, wrong credentials, unreachable endpoint)."""

import hashlib
import os
import subprocess
import sys
import time

import pytest
from hub_server import TINY_LLAMA, peft_files

from loragw.adapters.errors import AdapterError, AdapterNotFound
from loragw.adapters.format import parse_adapter
from loragw.adapters.ids import validate_adapter_id
from loragw.adapters.object_store import ObjectStore, digest, pair_digest
from loragw.adapters.s3 import (
    BucketNotFound,
    ObjectCorrupted,
    ObjectNotFound,
    ObjectStoreDenied,
    ObjectStoreUnavailable,
    S3Options,
    s3_client,
)
from loragw.adapters.source_checks import InvalidSource
from loragw.adapters.sources import (
    AdapterSource,
    parse_source,
    resolve_source,
    s3_adapter_id,
    s3_allowed,
)
from loragw.engine.models import adapter_spec
from loragw.gateway.bench.server import free_port

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
SPEC = adapter_spec(TINY_LLAMA, max_lora_rank=16)
A, B = peft_files(rank=4, seed=0), peft_files(rank=8, seed=1, targets=("q_proj", "down_proj"))
pytest_plugins = ("s3_server",)  # its fixtures: s3_server, s3_env
PICKLE = b"\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00}\x94."  # pickle.dumps({})


def sha(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def count_calls(client, operation: str) -> list:
    """Calls of one S3 operation made by `client` from now on (botocore's event hooks)."""
    calls: list = []
    client.meta.events.register(f"before-call.s3.{operation}", lambda **kw: calls.append(kw))
    return calls


@pytest.fixture
def store(s3_env):
    return ObjectStore(f"s3://{s3_env.create_bucket()}/fleet/adapters")


def test_put_get_round_trip_of_a_real_adapter(store):
    key = store.put(A[CONFIG], A[WEIGHTS])
    assert key == f"fleet/adapters/blobs/{digest(A[CONFIG], A[WEIGHTS])}"
    assert digest(A[CONFIG], A[WEIGHTS]) == pair_digest(sha(A[CONFIG]), sha(A[WEIGHTS]))
    config_raw, weights_raw = store.get(key, sha(A[WEIGHTS]), sha(A[CONFIG]))
    assert (config_raw, weights_raw) == (A[CONFIG], A[WEIGHTS])
    adapter = parse_adapter(config_raw, weights_raw, SPEC)
    assert adapter.max_rank == 4 and adapter.sha256 == sha(A[WEIGHTS])
    store.check()


def test_same_content_twice_is_one_key_and_one_upload(store):
    puts = count_calls(store.client, "PutObject")
    key = store.put(A[CONFIG], A[WEIGHTS])
    assert len(puts) == 2  # the two files
    assert store.put(A[CONFIG], A[WEIGHTS]) == key
    assert len(puts) == 2  # found by HEAD, not uploaded again
    other = store.put(B[CONFIG], B[WEIGHTS])
    assert other != key and len(puts) == 4
    assert store.keys() == {key, other}


def test_an_empty_prefix_keeps_pairs_at_the_bucket_root(s3_env):
    bucket = s3_env.create_bucket()
    store = ObjectStore(f"s3://{bucket}/")
    assert store.url == f"s3://{bucket}"
    key = store.put(A[CONFIG], A[WEIGHTS])
    assert key == f"blobs/{digest(A[CONFIG], A[WEIGHTS])}"
    assert store.get(key, sha(A[WEIGHTS]), sha(A[CONFIG])) == (A[CONFIG], A[WEIGHTS])
    assert store.keys() == {key}


@pytest.mark.parametrize("name", [WEIGHTS, CONFIG])
def test_a_tampered_object_is_refused_and_put_repairs_it(s3_env, store, name):
    key = store.put(A[CONFIG], A[WEIGHTS])
    forged = bytearray(A[name])
    forged[-2] ^= 1  # same size: only the bytes tell
    s3_env.client().put_object(Bucket=store.bucket, Key=f"{key}/{name}", Body=bytes(forged))
    with pytest.raises(ObjectCorrupted) as e:
        store.get(key, sha(A[WEIGHTS]), sha(A[CONFIG]))
    assert e.value.status == 502
    assert key in str(e.value) and name in str(e.value) and "tampered" in str(e.value)
    store.put(A[CONFIG], A[WEIGHTS])  # the forged object lacks put()'s recorded sha256
    assert store.get(key, sha(A[WEIGHTS]), sha(A[CONFIG])) == (A[CONFIG], A[WEIGHTS])


def test_an_object_over_the_limit_is_refused(store):
    key = store.put(A[CONFIG], A[WEIGHTS])
    with pytest.raises(ObjectCorrupted, match="at most 100") as e:
        store.get(key, sha(A[WEIGHTS]), sha(A[CONFIG]), max_bytes=100)
    assert e.value.status == 502


def test_missing_key_is_404_naming_it(store):
    key = store.key_for("0" * 64)
    with pytest.raises(ObjectNotFound) as e:
        store.get(key, sha(A[WEIGHTS]), sha(A[CONFIG]))
    assert e.value.status == 404 and key in str(e.value)
    with pytest.raises(ValueError, match="not a pair key"):
        store.get("elsewhere/blobs/" + "0" * 64, sha(A[WEIGHTS]), sha(A[CONFIG]))


def test_missing_bucket_is_404_naming_it(s3_env):
    store = ObjectStore("s3://no-such-bucket/fleet")
    for call in (store.check, lambda: store.put(A[CONFIG], A[WEIGHTS]), store.keys,
                 lambda: store.get(store.key_for("1" * 64), "2" * 64, "3" * 64)):  # fmt: skip
        with pytest.raises(BucketNotFound) as e:
            call()
        assert e.value.status == 404 and "'no-such-bucket'" in str(e.value)


@pytest.mark.parametrize(
    "change, code",
    [
        ({"AWS_SECRET_ACCESS_KEY": "wrong-secret"}, "SignatureDoesNotMatch"),
        ({"AWS_ACCESS_KEY_ID": "AKIAUNKNOWNUNKNOWN12"}, "InvalidAccessKeyId"),
        (None, "AccessDenied"),  # a known key with no permissions
    ],
)
def test_wrong_credentials_are_502_naming_them(s3_env, monkeypatch, change, code):
    bucket = s3_env.create_bucket()
    key = ObjectStore(f"s3://{bucket}/p").put(A[CONFIG], A[WEIGHTS])
    env = s3_env.env_with(**change) if change else s3_env.denied_env
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    store = ObjectStore(f"s3://{bucket}/p")  # a client for the new credentials
    calls = {"keys": store.keys, "get": lambda: store.get(key, sha(A[WEIGHTS]), sha(A[CONFIG])),
             "put": lambda: store.put(B[CONFIG], B[WEIGHTS]), "check": store.check}  # fmt: skip
    for what, call in calls.items():
        with pytest.raises(ObjectStoreDenied) as e:
            call()
        message = str(e.value)
        assert e.value.status == 502 and "refused this server's credentials" in message
        assert "AWS_ACCESS_KEY_ID" in message and "AWS_SECRET_ACCESS_KEY" in message
        assert env["AWS_SECRET_ACCESS_KEY"] not in message
        if what in ("keys", "get"):  # HEAD answers carry no body, so no error code
            assert code in message


def test_unreachable_endpoint_is_503_naming_it(s3_env, monkeypatch):
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    store = ObjectStore("s3://bucket-x/p", options=S3Options(connect_timeout_s=0.5, max_attempts=1))
    started = time.monotonic()
    for call in (store.check, lambda: store.get(store.key_for("1" * 64), "2" * 64, "3" * 64)):
        with pytest.raises(ObjectStoreUnavailable) as e:
            call()
        assert e.value.status == 503 and endpoint in str(e.value)
    assert time.monotonic() - started < 5


def test_delete_and_keys(store):
    a, b = store.put(A[CONFIG], A[WEIGHTS]), store.put(B[CONFIG], B[WEIGHTS])
    assert store.keys() == {a, b}
    store.delete(a)
    assert store.keys() == {b}
    store.delete(a)  # already gone: fine
    with pytest.raises(ObjectNotFound):
        store.get(a, sha(A[WEIGHTS]), sha(A[CONFIG]))
    assert store.get(b, sha(B[WEIGHTS]), sha(B[CONFIG])) == (B[CONFIG], B[WEIGHTS])


@pytest.mark.parametrize(
    "url, problem",
    [
        ("http://bucket/x", "not an s3:// URL"),
        ("s3://ab/x", "bucket name"),
        ("s3://Upper-Case/x", "bucket name"),
        ("s3://-bucket/x", "bucket name"),
        ("s3://bu..cket/x", "bucket name"),
        ("s3://192.168.0.1/x", "bucket name"),
        ("s3://bucket/a/../b", "'..'"),
        ("s3://bucket/../b", "'..'"),
        ("s3://bucket/a//b", "empty"),
        ("s3://bucket/a/./b", "'.'"),
        ("s3://bucket/a b", "must be letters"),
        ("s3://bucket/.hidden", "must be letters"),
        ("s3://bucket/a?versionId=1", "'?'"),
    ],
)
def test_bad_store_urls_are_refused(url, problem):
    with pytest.raises(ValueError, match=problem.replace(".", r"\.").replace("?", r"\?")):
        ObjectStore(url)


def test_parse_s3_sources():  # s3:// adapter sources from here on
    want = AdapterSource("s3", bucket="my-bucket", key="team/adapter-a")
    assert parse_source("s3://my-bucket/team/adapter-a/") == want
    assert parse_source("s3://my-bucket/team/adapter-a") == want
    assert parse_source("s3://my-bucket/team/adapter-a", allow_local=False) == want
    assert want.uri == "s3://my-bucket/team/adapter-a/"
    for bad in ("s3://my-bucket", "s3://my-bucket/", "s3://My_Bucket/a", "s3://my-bucket/a/../b",
                "s3://my-bucket//a", "s3://b/a"):  # fmt: skip
        with pytest.raises(InvalidSource) as e:
            parse_source(bad)
        assert e.value.status == 400
    with pytest.raises(InvalidSource, match="only hf:// and s3:// URLs"):
        parse_source("gs://bucket/a")


def put_folder(s3, bucket: str, prefix: str, files: dict[str, bytes]) -> None:
    client = s3.client()
    for name, raw in files.items():
        client.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=raw)


def test_resolve_an_s3_folder(s3_env):
    bucket = s3_env.create_bucket()
    put_folder(s3_env, bucket, "team/adapter-a", {**A, "README.md": b"# hi"})
    put_folder(s3_env, bucket, "team/adapter-a/older", B)  # a subfolder is not the adapter
    files = resolve_source(parse_source(f"s3://{bucket}/team/adapter-a"))
    assert (files.config_raw, files.weights_raw) == (A[CONFIG], A[WEIGHTS])
    assert files.origin == f"s3://{bucket}/team/adapter-a/"
    assert files.revision == hashlib.md5(A[WEIGHTS]).hexdigest()  # the ETag of one PUT
    assert parse_adapter(files.config_raw, files.weights_raw, SPEC).max_rank == 4


def test_a_pickle_only_folder_is_refused_without_downloading(s3_env):
    bucket = s3_env.create_bucket()
    put_folder(s3_env, bucket, "pickled", {CONFIG: A[CONFIG], "adapter_model.bin": PICKLE})
    gets = count_calls(s3_client(), "GetObject")
    with pytest.raises(AdapterError, match="pickled weights") as e:
        resolve_source(parse_source(f"s3://{bucket}/pickled/"))
    assert e.value.status == 422 and "adapter_model.bin" in str(e.value)
    assert gets == []


def test_missing_folders_and_files_are_404(s3_env):
    bucket = s3_env.create_bucket()
    put_folder(s3_env, bucket, "no-config", {WEIGHTS: A[WEIGHTS]})
    put_folder(s3_env, bucket, "no-weights", {CONFIG: A[CONFIG]})
    for path, message in (("nothing-here", "no objects under"), ("no-config", CONFIG),
                          ("no-weights", WEIGHTS)):  # fmt: skip
        with pytest.raises(AdapterNotFound, match=message) as e:
            resolve_source(parse_source(f"s3://{bucket}/{path}/"))
        assert e.value.status == 404
    with pytest.raises(BucketNotFound, match="'no-such-bucket'"):
        resolve_source(parse_source("s3://no-such-bucket/a/"))


def test_an_oversized_config_is_refused_before_download(s3_env):
    bucket = s3_env.create_bucket()
    put_folder(s3_env, bucket, "big", {WEIGHTS: A[WEIGHTS], CONFIG: b" " * ((1 << 20) + 1)})
    gets = count_calls(s3_client(), "GetObject")
    with pytest.raises(AdapterError, match="at most 1048576") as e:
        resolve_source(parse_source(f"s3://{bucket}/big/"))
    assert e.value.status == 422 and gets == []


def test_s3_allowed():
    patterns = ["team-bucket/adapters/*", "other/exact"]
    assert s3_allowed("s3://team-bucket/adapters/a/", patterns)
    assert s3_allowed("s3://team-bucket/adapters/a/b", patterns)
    assert s3_allowed("s3://other/exact/", patterns)
    assert not s3_allowed("s3://other/exact/more", patterns)
    assert not s3_allowed("s3://team-bucket/private/a", patterns)
    assert not s3_allowed("s3://team-bucket/adapters/../private", patterns)
    assert not s3_allowed("s3://team-bucket/adapters/a", [])
    assert not s3_allowed("hf://team-bucket/adapters/a", ["*"])


def test_s3_adapter_id():
    assert s3_adapter_id("team-bucket", "adapters/a") == "s3.team-bucket/adapters--a"
    assert s3_adapter_id("team-bucket", "adapters/a/") == "s3.team-bucket/adapters--a"
    assert s3_adapter_id("b.c", "x") == "s3.b.c/x"
    ids = {s3_adapter_id("bkt", p) for p in ("a/b", "a-b", "a/b/c", "a-b/c", "a/b-c", "a_b")}
    assert len(ids) == 6  # distinct folders, distinct ids
    for adapter_id in ids:
        assert validate_adapter_id(adapter_id) == adapter_id
    for bad in ("a--b", "a-/b", "", "../x", "x" * 200):
        with pytest.raises(InvalidSource):
            s3_adapter_id("bkt", bad)


def test_importing_the_modules_does_not_import_boto3():
    code = ("import sys, loragw.adapters.sources, loragw.adapters.object_store, loragw.adapters.s3;"
            " assert 'boto3' not in sys.modules and 'botocore' not in sys.modules")  # fmt: skip
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-P", "-c", code], check=True, cwd=root)
