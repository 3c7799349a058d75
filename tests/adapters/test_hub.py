"""Adapters from the Hub (a Hub look-alike on loopback) and from local folders."""

import hashlib
import os

import huggingface_hub.constants
import pytest
from hub_server import TINY_LLAMA, HubServer, peft_files

from loragw.adapters.errors import AdapterError, AdapterNotFound
from loragw.adapters.format import read_adapter
from loragw.adapters.hub import HubUnavailable, fetch_hub_adapter
from loragw.adapters.source_checks import InvalidSource
from loragw.adapters.sources import AdapterSource, hub_allowed, parse_source, resolve_source
from loragw.engine.models import adapter_spec

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
SPEC = adapter_spec(TINY_LLAMA, max_lora_rank=16)
A, B = peft_files(rank=4, seed=0), peft_files(rank=8, seed=1, targets=("q_proj", "down_proj"))
PICKLE = b"\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00}\x94."  # pickle.dumps({})


GIVEN_TOKENS = {"hf_ok", "hf_wrong"}  # the only tokens these tests hand the client


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """The fake Hub, and a client with no login of the user's. huggingface_hub sends a stored
    login (HF_TOKEN, else the token file at HF_TOKEN_PATH, a path fixed at import) to whatever
    endpoint it is given: rightly, for the Hub the user logged in to; this fake one is not it."""
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE", "HF_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-login"))
    repos = {
        "org/adapter": {"main": A, "v2": B, "refs/pr/1": B},
        "org/private": {"main": A},
        "org/gated": {"main": A},
        "org/pickled": {"main": {CONFIG: A[CONFIG], "adapter_model.bin": PICKLE}},
        "org/no-weights": {"main": {CONFIG: A[CONFIG], "README.md": b"# hi"}},
        "org/no-config": {"main": {WEIGHTS: A[WEIGHTS]}},
    }
    with HubServer(repos, private={"org/private"}, gated={"org/gated"}, tokens={"hf_ok"}) as h:
        yield h
    assert h.tokens_seen <= GIVEN_TOKENS, f"a token no test gave reached the Hub: {h.tokens_seen}"


def fetch(hub, tmp_path, repo_id, revision=None, **kw):
    return fetch_hub_adapter(
        repo_id, revision, endpoint=hub.endpoint, cache_dir=str(tmp_path / "hf"), **kw
    )


def test_fetch_by_repo_id_gets_only_the_adapter_files(hub, tmp_path):
    got = fetch(hub, tmp_path, "org/adapter")
    assert sorted(os.listdir(got.path)) == [CONFIG, WEIGHTS]
    assert got.path.startswith(str(tmp_path / "hf" / "models--org--adapter" / "snapshots"))
    assert (got.repo_id, got.revision) == ("org/adapter", "main")
    assert got.commit_sha == hub.commit_sha("org/adapter", "main")
    assert got.source == f"hf://org/adapter@{got.commit_sha}"
    adapter = read_adapter(got.path, SPEC)
    assert adapter.sha256 == hashlib.sha256(A[WEIGHTS]).hexdigest()
    assert adapter.max_rank == 4


def test_fetch_by_revision_branch_pr_and_commit(hub, tmp_path):
    main = fetch(hub, tmp_path, "org/adapter")
    v2 = fetch(hub, tmp_path, "org/adapter", "v2")
    assert v2.commit_sha == hub.commit_sha("org/adapter", "v2") != main.commit_sha
    a, b = read_adapter(main.path, SPEC), read_adapter(v2.path, SPEC)
    assert a.sha256 != b.sha256 == hashlib.sha256(B[WEIGHTS]).hexdigest()
    assert b.targets == ("down_proj", "q_proj") and b.max_rank == 8
    pr = fetch(hub, tmp_path, "org/adapter", "refs/pr/1")  # travels as refs%2Fpr%2F1
    assert pr.commit_sha == hub.commit_sha("org/adapter", "refs/pr/1")
    by_sha = fetch(hub, tmp_path / "fresh", "org/adapter", v2.commit_sha)
    assert by_sha.commit_sha == v2.commit_sha
    assert read_adapter(by_sha.path, SPEC).sha256 == b.sha256


def test_cache_hit_downloads_nothing(hub, tmp_path):
    first = fetch(hub, tmp_path, "org/adapter")
    assert hub.downloads("org/adapter", WEIGHTS) == 1
    before = {f: hub.file_requests("org/adapter", f) for f in (CONFIG, WEIGHTS)}
    again = fetch(hub, tmp_path, "org/adapter")
    assert again == first
    assert {f: hub.file_requests("org/adapter", f) for f in (CONFIG, WEIGHTS)} == before
    # a commit sha is immutable: a complete cached copy needs no request at all
    total = hub.total_requests()
    assert fetch(hub, tmp_path, "org/adapter", first.commit_sha).path == first.path
    assert hub.total_requests() == total


def test_hub_unreachable_uses_the_cache_or_says_so(hub, tmp_path):
    cached = fetch(hub, tmp_path, "org/adapter", "v2")
    with HubServer({}) as gone:
        endpoint = gone.endpoint
    kw = dict(endpoint=endpoint, cache_dir=str(tmp_path / "hf"))
    assert fetch_hub_adapter("org/adapter", "v2", **kw) == cached
    with pytest.raises(HubUnavailable, match="cannot reach the Hub") as e:
        fetch_hub_adapter("org/adapter", "main", **kw)
    assert e.value.status == 502


def test_missing_repo_revision_or_file_are_clear(hub, tmp_path):
    with pytest.raises(AdapterNotFound, match="org/nope not found") as e:
        fetch(hub, tmp_path, "org/nope")
    assert e.value.status == 404
    with pytest.raises(AdapterNotFound, match="no revision 'v9'"):
        fetch(hub, tmp_path, "org/adapter", "v9")
    with pytest.raises(AdapterNotFound, match=f"has no {WEIGHTS}"):
        fetch(hub, tmp_path, "org/no-weights")
    with pytest.raises(AdapterNotFound, match=f"has no {CONFIG}"):
        fetch(hub, tmp_path, "org/no-config")
    assert hub.downloads("org/no-config", WEIGHTS) == 0  # refused before downloading


def test_private_repo_needs_a_token(hub, tmp_path, monkeypatch):
    with pytest.raises(AdapterNotFound, match="HF_TOKEN"):
        fetch(hub, tmp_path, "org/private")
    with pytest.raises(AdapterNotFound, match="token in HF_TOKEN is invalid"):
        fetch(hub, tmp_path, "org/private", token="hf_wrong")
    assert read_adapter(fetch(hub, tmp_path, "org/private", token="hf_ok").path, SPEC)
    monkeypatch.setenv("HF_TOKEN", "hf_ok")
    assert fetch(hub, tmp_path / "env", "org/private").commit_sha


def test_gated_repo_says_to_accept_and_set_a_token(hub, tmp_path):
    with pytest.raises(AdapterNotFound, match="gated.*HF_TOKEN"):
        fetch(hub, tmp_path, "org/gated")
    assert fetch(hub, tmp_path, "org/gated", token="hf_ok").commit_sha


def test_pickled_weights_are_refused_without_download(hub, tmp_path):
    with pytest.raises(AdapterError, match=r"pickled weights \(adapter_model.bin\)") as e:
        fetch(hub, tmp_path, "org/pickled")
    assert "convert them to adapter_model.safetensors" in str(e.value).lower()
    assert hub.file_requests("org/pickled", "adapter_model.bin") == 0


def test_resolve_hub_and_local_sources(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)  # read per call, not at import
    files = resolve_source(parse_source("hf://org/adapter@v2"), cache_dir=str(tmp_path / "hf"))
    assert (files.config_raw, files.weights_raw) == (B[CONFIG], B[WEIGHTS])
    assert files.origin == f"hf://org/adapter@{hub.commit_sha('org/adapter', 'v2')}"
    assert files.revision == "v2"
    folder = tmp_path / "local"
    folder.mkdir()
    for name, data in A.items():
        (folder / name).write_bytes(data)
    local = resolve_source(parse_source(str(folder)))
    assert (local.weights_raw, local.origin, local.revision) == (A[WEIGHTS], str(folder), None)
    (folder / WEIGHTS).unlink()
    (folder / "adapter_model.bin").write_bytes(PICKLE)
    with pytest.raises(AdapterError, match="pickles are refused"):
        resolve_source(parse_source(str(folder)))


def test_parse_source_forms(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert parse_source("hf://org/repo") == AdapterSource("hub", repo_id="org/repo")
    assert parse_source("hf://gpt2@v1.0") == AdapterSource("hub", repo_id="gpt2", revision="v1.0")
    assert parse_source("org/repo") == AdapterSource("hub", repo_id="org/repo")
    assert parse_source("hf://org/repo@refs/pr/3").uri == "hf://org/repo@refs/pr/3"
    (tmp_path / "org" / "repo").mkdir(parents=True)  # an existing directory wins
    assert parse_source("org/repo") == AdapterSource("local", path=str(tmp_path / "org/repo"))
    assert parse_source("./org/repo").path == str(tmp_path / "org" / "repo")
    assert parse_source(str(tmp_path)).kind == "local"
    with pytest.raises(AdapterNotFound, match="no adapter directory"):
        parse_source("./missing")
    with pytest.raises(InvalidSource, match="not accepted here"):
        parse_source(str(tmp_path), allow_local=False)
    assert parse_source("hf://org/repo", allow_local=False).kind == "hub"
    assert parse_source("org/repo", allow_local=False).kind == "hub"  # the disk is not probed


@pytest.mark.parametrize("bad", [
    "", "   ", "name", "a/b/c", "hf://", "hf://org/repo@", "hf://../etc", "hf://org/re po",
    "hf://org--x/repo", "hf://org/repo.git", "hf://org/repo@..", "hf://org/repo@-x",
    "org/repo@main", "ftp://bucket/x", "hf://org/repo\n", "hf://a/b/c",
])  # fmt: skip
def test_parse_source_refuses_malformed(bad, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidSource) as e:
        parse_source(bad)
    assert e.value.status == 400


def test_hub_allowed_patterns():
    assert hub_allowed("my-org/x", ["my-org/*"])
    assert not hub_allowed("other/x", ["my-org/*"])
    assert not hub_allowed("My-Org/x", ["my-org/*"])  # case-sensitive: allow exactly what's named
    assert hub_allowed("anyone/any", ["*"])
    assert hub_allowed("a/llama-lora", ["b/*", "*/llama-*"])
    assert not hub_allowed("a/x", [])
    assert not hub_allowed("../x", ["*"])
    assert not hub_allowed("a/b/c", ["*"])
