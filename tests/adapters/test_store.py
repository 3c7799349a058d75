"""The disk tier: what is stored survives restarts, and no failure or crash leaves a mix."""

import errno
import hashlib
import os
import subprocess
import sys
import threading

import pytest
from hub_server import TINY_LLAMA, peft_files

from loragw.adapters import store as store_mod
from loragw.adapters.errors import AdapterNotFound, InvalidAdapterId
from loragw.adapters.format import read_adapter
from loragw.adapters.store import AdapterExists, AdapterStore
from loragw.adapters.store_meta import StoredMeta
from loragw.engine.models import adapter_spec

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
SPEC = adapter_spec(TINY_LLAMA, max_lora_rank=16)
A, B = peft_files(rank=4, seed=0), peft_files(rank=8, seed=1)
META = StoredMeta(source="upload", rank=4, targets=("q_proj", "v_proj"))


def put(store, adapter_id, files=A, replace=False, meta=META):
    return store.put(adapter_id, files[CONFIG], files[WEIGHTS], meta, replace=replace)


def tree(root):
    """Every path under root -> sha256 of its bytes ('dir' for folders): the store's state."""
    state = {}
    for folder, dirs, files in os.walk(root):
        for d in dirs:
            state[os.path.relpath(os.path.join(folder, d), root)] = "dir"
        for f in files:
            with open(os.path.join(folder, f), "rb") as fh:
                state[os.path.relpath(os.path.join(folder, f), root)] = hashlib.sha256(
                    fh.read()
                ).hexdigest()
    return state


@pytest.fixture
def root(tmp_path):
    return str(tmp_path / "adapters")


def test_put_get_list_delete(root):
    store = AdapterStore(root)
    a = put(store, "a")
    b = put(store, "org/b", B, meta=StoredMeta("hf://org/b@" + "f" * 40, "main", 8, ("q_proj",)))
    assert a.adapter_id == "a" and a.version == 1 and a.source == "upload"
    assert a.sha256 == hashlib.sha256(A[WEIGHTS]).hexdigest() and a.num_bytes == len(A[WEIGHTS])
    assert (b.revision, b.rank, b.targets) == ("main", 8, ("q_proj",))
    assert store.get("a") == a and store.get("org/b") == b and store.get("nope") is None
    assert [m.adapter_id for m in store.list()] == ["a", "org/b"]
    assert b.path == store.path("org/b") == os.path.join(root, "org", "b")
    assert sorted(os.listdir(b.path)) == sorted([CONFIG, WEIGHTS, "meta.json"])
    assert read_adapter(b.path, SPEC).sha256 == b.sha256  # the stored folder is a PEFT folder
    assert store.delete("org/b") == b
    assert store.get("org/b") is None and [m.adapter_id for m in store.list()] == ["a"]
    assert not os.path.exists(os.path.join(root, "org"))  # empty org folder goes too
    with pytest.raises(AdapterNotFound, match="'org/b' is not registered"):
        store.delete("org/b")


def test_replace_bumps_version_and_refuses_without_replace(root):
    store = AdapterStore(root)
    put(store, "org/x")
    before = tree(root)
    with pytest.raises(AdapterExists, match="already exists") as e:
        put(store, "org/x", B)
    assert e.value.status == 409 and tree(root) == before
    new = put(store, "org/x", B, replace=True)
    assert new.version == 2 and new.sha256 == hashlib.sha256(B[WEIGHTS]).hexdigest()
    assert read_adapter(new.path, SPEC).sha256 == new.sha256
    store.delete("org/x")  # versions never repeat, so nothing derived from v2 is reused
    assert put(store, "org/x").version == 3


def test_restart_sees_everything(root):
    store = AdapterStore(root)
    stored = [put(store, i) for i in ("a", "b", "org/c", "org/d", "other/e")]
    put(store, "a", B, replace=True)
    store.close()
    again = AdapterStore(root)
    assert [m.adapter_id for m in again.list()] == [m.adapter_id for m in stored]
    assert again.get("a").version == 2 and again.get("org/c") == stored[2]


def test_id_and_org_namespaces_do_not_collide(root):
    store = AdapterStore(root)
    put(store, "foo")
    with pytest.raises(AdapterExists, match="under adapter 'foo'"):
        put(store, "foo/bar")
    put(store, "org/x")
    with pytest.raises(AdapterExists, match="'org/...'"):
        put(store, "org")


BAD_IDS = ["../evil", "a/../../evil", "/etc/x", "a/b/c", "..", ".hidden", "a\\b", "a\x00b",
           "a/", "/", "", "a//b", "-rf", "é"]  # fmt: skip


@pytest.mark.parametrize("bad", BAD_IDS)
def test_unsafe_ids_are_refused_and_nothing_is_written(bad, tmp_path):
    root = str(tmp_path / "adapters")
    store = AdapterStore(root)
    before = tree(tmp_path)
    for call in (lambda: put(store, bad), lambda: store.get(bad), lambda: store.delete(bad)):
        with pytest.raises(InvalidAdapterId) as e:
            call()
        assert e.value.status == 400
    assert tree(tmp_path) == before


def test_symlink_out_of_the_store_is_refused(root, tmp_path):
    store = AdapterStore(root)
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", os.path.join(root, "evil"))
    with pytest.raises(InvalidAdapterId, match="outside"):
        put(store, "evil/x")
    assert os.listdir(tmp_path / "outside") == []


def _fail_at(monkeypatch, n, exc):
    """Make the n-th filesystem step a put takes (fsync, rename, mkdir, exchange) raise."""
    calls = [0]

    def wrap(fn):
        def step(*args, **kwargs):
            calls[0] += 1
            if calls[0] == n:
                raise exc
            return fn(*args, **kwargs)

        return step

    for name in ("fsync", "rename", "replace", "makedirs", "mkdir"):
        monkeypatch.setattr(os, name, wrap(getattr(os, name)))
    monkeypatch.setattr(store_mod, "exchange", wrap(store_mod.exchange))
    return calls


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
@pytest.mark.parametrize("adapter_id", ["org/new", "org/old", "new"])
def test_failure_at_any_step_leaves_the_store_unchanged(root, monkeypatch, adapter_id, exchange):
    """Fail each filesystem step of a put in turn: the store is byte-for-byte as before, or
    (a failure after the commit point, which is only logged) the put took effect whole."""
    store = AdapterStore(root)
    put(store, "org/old")
    if not exchange:
        monkeypatch.setattr(store_mod, "exchange", lambda a, b: False)
    new_sha = hashlib.sha256(B[WEIGHTS]).hexdigest()
    for n in range(1, 100):
        before, meta_before = tree(root), store.get(adapter_id)
        with monkeypatch.context() as m:
            calls = _fail_at(m, n, OSError(errno.EIO, "injected"))
            try:
                put(store, adapter_id, B, replace=True)
            except OSError:
                assert tree(root) == before, f"a failure at step {n} changed the store"
                assert store.get(adapter_id) == meta_before
                continue
        assert store.get(adapter_id).sha256 == new_sha
        if calls[0] < n:  # no step failed: every step has been tried
            break
        if adapter_id == "org/old":
            put(store, "org/old", replace=True)
        else:
            store.delete(adapter_id)
    assert n > 5, "the injection never reached the put"
    assert {m.adapter_id for m in AdapterStore(root).list()} == {"org/old", adapter_id}


_CRASH = """
import os, sys
from loragw.adapters import store as S
from loragw.adapters.store_meta import StoredMeta
root, n, exchange = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
st = S.AdapterStore(root)
calls = [0]
def wrap(fn):
    def step(*a, **k):
        calls[0] += 1
        if calls[0] == n:
            os._exit(17)  # the process dies here: no cleanup, no finally
        return fn(*a, **k)
    return step
os.fsync, os.rename = wrap(os.fsync), wrap(os.rename)
S.exchange = wrap(S.exchange if exchange else (lambda a, b: False))
with open(os.path.join(root, "..", "w"), "rb") as f, open(os.path.join(root, "..", "c"), "rb") as g:
    st.put("org/x", g.read(), f.read(), StoredMeta("upload"), replace=True)
os._exit(0)
"""


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
def test_crash_at_any_step_recovers_old_or_new(tmp_path, exchange):
    """Kill the process at every step of a replace: a new store sees the old or the new
    adapter, complete, and no debris."""
    root = str(tmp_path / "adapters")
    (tmp_path / "w").write_bytes(B[WEIGHTS])
    (tmp_path / "c").write_bytes(B[CONFIG])
    script = _CRASH
    old_sha, new_sha = (hashlib.sha256(f[WEIGHTS]).hexdigest() for f in (A, B))
    seen = set()
    for n in range(1, 100):
        store = AdapterStore(root)
        if store.get("org/x") is None or store.get("org/x").sha256 != old_sha:
            put(store, "org/x", replace=True)
        store.close()
        rc = subprocess.run(
            [sys.executable, "-P", "-c", script, root, str(n), str(int(exchange))]
        ).returncode
        recovered = AdapterStore(root)
        (meta,) = recovered.list()
        with open(os.path.join(meta.path, WEIGHTS), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == meta.sha256  # never a mix
        with open(os.path.join(meta.path, CONFIG), "rb") as f:
            assert f.read() == (A if meta.sha256 == old_sha else B)[CONFIG]
        assert sorted(os.listdir(root)) == [".lock", "org"]  # no debris
        seen.add(meta.sha256)
        recovered.close()
        if rc == 0:
            break
        assert rc == 17
    assert seen == {old_sha, new_sha} and n > 3


def test_leftovers_of_a_crash_are_cleaned_at_start(root):
    store = AdapterStore(root)
    put(store, "kept")
    put(store, "org/lost")
    store.close()
    os.makedirs(os.path.join(root, ".tmp-abc"))
    with open(os.path.join(root, ".tmp-abc", WEIGHTS), "wb") as f:
        f.write(b"half a file")
    os.makedirs(os.path.join(root, ".del-1", "x"))
    os.makedirs(os.path.join(root, ".old-stale"))
    os.rename(os.path.join(root, "org", "lost"), os.path.join(root, ".old-2"))
    os.makedirs(os.path.join(root, ".old-2x"))  # died between the two renames of a replace
    os.rename(os.path.join(root, ".old-2"), os.path.join(root, ".old-2x", "x"))
    os.rmdir(os.path.join(root, "org"))
    store = AdapterStore(root)
    assert sorted(os.listdir(root)) == [".lock", "kept", "org"]
    assert [m.adapter_id for m in store.list()] == ["kept", "org/lost"]


def test_foreign_folders_are_ignored(root):
    os.makedirs(os.path.join(root, "lost+found", "x"))  # what a fresh volume's root holds
    os.makedirs(os.path.join(root, "empty-org"))
    store = AdapterStore(root)
    put(store, "a")
    assert [m.adapter_id for m in store.list()] == ["a"]
    assert sorted(os.listdir(root)) == [".lock", "a", "lost+found"]


def test_unreadable_meta_is_skipped_not_fatal(root):
    store = AdapterStore(root)
    put(store, "good")
    put(store, "bad")
    with open(os.path.join(root, "bad", "meta.json"), "wb") as f:
        f.write(b"{not json")
    assert [m.adapter_id for m in AdapterStore(root).list()] == ["good"]
    assert put(store, "bad", replace=True).version == 1  # debris is replaced


def test_concurrent_puts(root):
    store = AdapterStore(root)
    ids = [f"org{i % 3}/a{i}" for i in range(12)]
    threads = [threading.Thread(target=put, args=(store, i)) for i in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [m.adapter_id for m in store.list()] == sorted(ids)
