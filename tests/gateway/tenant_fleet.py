"""The tenants' fleet (DESIGN.md "Tenants"), shared by the test_tenants_fleet* modules: two
`python -P -m loragw.gateway.server` replicas (r1, r2) on one real redis-server, no shared
store, the operator's key `op-key`, and keys minted through the API.

`shared_fleet(...)` starts it on first use and stops it when the session ends; before each test
it brings back a replica or Redis an earlier test took down. `ensure_world(fleet)` makes what
most tests act among, once per fleet, and waits until Redis holds it (a restart empties Redis;
the replicas write back what they know): keys acme-admin, acme-member (acme/bot* only) and
globex-admin in `fleet.keys`, and the adapters WORLD_ADAPTERS. A test that checks how something
is made makes its own (its keys minted, its ids uploaded), so any test passes alone and in any
order. Helpers for the attacker's calls follow.
"""

from __future__ import annotations

import http.client
import time
from contextlib import ExitStack, contextmanager
from urllib.parse import urlsplit

import httpx
import pytest
from fleet_harness import Fleet, running_fleet
from random_adapters import write_random_adapter
from uploads import read_files

OP = "op-key"
RIDS = ("r1", "r2")
BASE = "demo-base"
PROMPT = "The quick brown fox"
MODEL_LEN = 2048  # long enough for a stream that lasts seconds on the demo model
REVOKE_WITHIN_S = 3.0
# key name -> (tenant, the key name that mints it, the mint's body); OP: the operator's key
WORLD_KEYS = {"acme-admin": ("acme", OP, {"role": "admin"}),
              "acme-member": ("acme", "acme-admin", {"role": "member", "adapters": ["acme/bot*"]}),
              "globex-admin": ("globex", OP, {"role": "admin"})}
# adapter id -> (the replica it is uploaded through, the key name that uploads it; OP: shared);
# acme/bot's bytes are on r1 only (no shared store): r2 forwards every request for it to r1
WORLD_ADAPTERS = {"acme/bot": ("r1", "acme-admin"), "pirate": ("r2", OP),
                  "globex/bot": ("r2", "globex-admin")}
FOLDERS = ("acme/bot", "pirate", "globex/bot", "other", "evil", "bot-private", "parrot",
           "vendor", "audited-acme", "audited-shared", "audited-globex")


class TenantFleet(Fleet):
    """A Fleet whose calls each name their own key (`client` sends none by default), with the
    world's keys by name (`keys`: the mint's JSON) and random adapters by name (`folders`)."""

    def __init__(self, *args, folders: dict[str, str], **options):
        super().__init__(*args, **options)
        self.client = httpx.Client(timeout=120)
        self.keys: dict[str, dict] = {}
        self.folders = folders

    def stop(self) -> None:
        super().stop()
        self.client.close()


_shared: TenantFleet | None = None


@pytest.fixture(name="fleet")
def fleet_fixture(request: pytest.FixtureRequest, model_dir: str, hf_config: dict,
                  tmp_path_factory: pytest.TempPathFactory) -> TenantFleet:
    """The session's tenants fleet, ready for the next test (the tenant test modules import
    this fixture and the three below, by their function names)."""
    global _shared
    if _shared is None:
        workdir = tmp_path_factory.mktemp("tenants")
        folders = {name: write_random_adapter(str(workdir / "adapters" / name), hf_config, seed)
                   for seed, name in enumerate(FOLDERS, start=500)}
        stack = ExitStack()
        request.session.addfinalizer(stack.close)
        _shared = stack.enter_context(running_fleet(
            workdir, model_dir, *RIDS, fleet_type=TenantFleet, folders=folders,
            extra=("--admin-key", OP, "--max-model-len", str(MODEL_LEN))))
    _shared.revive(*RIDS)
    return _shared


@pytest.fixture(name="world")
def world_fixture(fleet: TenantFleet) -> None:
    ensure_world(fleet)


@pytest.fixture(name="revoked")
def revoked_fixture(world, fleet: TenantFleet) -> None:
    ensure_revoked(fleet)


@pytest.fixture(name="rotated")
def rotated_fixture(world, fleet: TenantFleet) -> None:
    ensure_rotated(fleet)


def ensure_world(fleet: TenantFleet) -> None:
    """The world's keys (each used once on every replica, so each replica knows it) and
    adapters, made where missing; Redis holding them, and the fleet's forwarding secret."""
    for name, (tenant, by, body) in WORLD_KEYS.items():
        if name not in fleet.keys:
            fleet.keys[name] = minted(fleet, "r1", tenant, key(fleet, by), **body)
            for rid in RIDS:
                assert BASE in model_ids(fleet, rid, key(fleet, name))
    for adapter_id, (rid, by) in WORLD_ADAPTERS.items():
        if adapter_id not in admin_ids(fleet, rid, OP):
            response = upload(fleet, rid, key(fleet, by), adapter_id, fleet.folders[adapter_id])
            assert response.status_code == 201, response.text
    for rid in RIDS:
        wait_until(f"{rid} to list the world's adapters", lambda rid=rid: set(WORLD_ADAPTERS)
                   <= admin_ids(fleet, rid, OP), timeout=3)
    wait_until("Redis to hold the world", lambda: whole(fleet), timeout=10)


def whole(fleet: TenantFleet) -> bool:
    """Redis holds the world's keys and adapters and the fleet's forwarding secret (a restart
    empties it; the replicas write back what they know within a heartbeat or two)."""
    ids = {fleet.keys[name]["id"] for name in WORLD_KEYS}
    return (set(WORLD_ADAPTERS) <= fleet.catalog()
            and ids <= {k.decode() for k in fleet.redis.hkeys("loragw:tenant:keys")}
            and fleet.redis.get("loragw:forward-secret") is not None)


def ensure_revoked(fleet: TenantFleet) -> None:
    """fleet.keys["victim"]: an acme member key both replicas knew, then revoked; both refuse it."""
    if "victim" in fleet.keys:
        return
    acme = key(fleet, "acme-admin")
    victim = fleet.keys["victim"] = minted(fleet, "r1", "acme", acme, role="member")
    for rid in RIDS:
        assert complete(fleet, rid, victim["key"]).status_code == 200
    revoked = call(fleet, "r1", "DELETE", f"/admin/tenants/acme/keys/{victim['id']}", acme)
    assert revoked.status_code == 200, revoked.text
    for rid in RIDS:
        wait_until(f"{rid} to refuse the revoked key", lambda rid=rid: call(
            fleet, rid, "GET", "/v1/models", victim["key"]).status_code == 401, REVOKE_WITHIN_S)


def ensure_rotated(fleet: TenantFleet) -> None:
    """fleet.keys["rotated"]: an acme member key rotated (no grace), its new secret known to
    both replicas."""
    if "rotated" in fleet.keys:
        return
    acme = key(fleet, "acme-admin")
    old = minted(fleet, "r1", "acme", acme, role="member")
    rotated = call(fleet, "r2", "POST", f"/admin/tenants/acme/keys/{old['id']}/rotate", acme,
                   json={"grace_seconds": 0})
    assert rotated.status_code == 200, rotated.text
    fleet.keys["rotated"] = rotated.json()
    for rid in RIDS:
        assert complete(fleet, rid, key(fleet, "rotated")).status_code == 200


# ---- calls ----------------------------------------------------------------------------------
def call(fleet: TenantFleet, rid: str, method: str, path: str, key: str | None = None,
         headers: dict | None = None, **kw) -> httpx.Response:
    sent = {"Authorization": f"Bearer {key}"} if key else {}
    sent.update(headers or {})
    return fleet.client.request(method, fleet.urls[rid] + path, headers=sent, **kw)


def raw_call(fleet: TenantFleet, rid: str, method: str, path: str, key: str) -> tuple[int, str]:
    """A request whose path goes out byte for byte (httpx would resolve '..')."""
    parts = urlsplit(fleet.urls[rid])
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        conn.request(method, path, headers={"Authorization": f"Bearer {key}"})
        response = conn.getresponse()
        return response.status, response.read().decode(errors="replace")
    finally:
        conn.close()


def key(fleet: TenantFleet, name: str) -> str:
    """The secret of the key `name` in fleet.keys; OP is the operator's own."""
    return OP if name == OP else fleet.keys[name]["key"]


def mint(fleet: TenantFleet, rid: str, tenant: str, by: str, **body) -> httpx.Response:
    return call(fleet, rid, "POST", f"/admin/tenants/{tenant}/keys", by, json=body)


def minted(fleet: TenantFleet, rid: str, tenant: str, by: str, **body) -> dict:
    """The mint's JSON: id, key (the secret), tenant, role, ..."""
    response = mint(fleet, rid, tenant, by, **body)
    assert response.status_code == 201, response.text
    return response.json()


def upload(fleet: TenantFleet, rid: str, by: str, adapter_id: str, folder: str,
           replace: bool = False, owner: str | None = None) -> httpx.Response:
    config, weights = read_files(folder)
    data = {"adapter_id": adapter_id, "replace": str(replace).lower()}
    if owner is not None:
        data["owner"] = owner
    return call(fleet, rid, "POST", "/admin/adapters", by, data=data,
                files={"adapter_config": ("adapter_config.json", config),
                       "adapter_model": ("adapter_model.safetensors", weights)})


def complete(fleet: TenantFleet, rid: str, by: str | None, model: str = BASE,
             headers: dict | None = None, **extra) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, **extra}
    return call(fleet, rid, "POST", "/v1/completions", by, headers=headers, json=body)


def model_ids(fleet: TenantFleet, rid: str, by: str) -> set[str]:
    response = call(fleet, rid, "GET", "/v1/models", by)
    assert response.status_code == 200, response.text
    return {card["id"] for card in response.json()["data"]}


def admin_ids(fleet: TenantFleet, rid: str, by: str) -> set[str]:
    response = call(fleet, rid, "GET", "/admin/adapters", by)
    assert response.status_code == 200, response.text
    return {info["id"] for info in response.json()["data"]}


# ---- what a refused call must leave alone, and how it is refused -----------------------------
def snapshot(fleet: TenantFleet) -> tuple:
    """What a refused write must leave alone: the catalog in Redis, and every adapter as the
    operator sees it on each replica."""
    views = {}
    for rid in RIDS:
        response = call(fleet, rid, "GET", "/admin/adapters", OP)
        assert response.status_code == 200, response.text
        views[rid] = {a["id"]: (a["version"], a["sha256"], a["owner"], a["pinned"])
                      for a in response.json()["data"]}
    return fleet.redis.hgetall(f"{fleet.prefix()}catalog"), views


@contextmanager
def unchanged(fleet: TenantFleet):
    before = snapshot(fleet)
    yield
    assert snapshot(fleet) == before


def error(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"}, body
    return body["error"]


def shape(response: httpx.Response, adapter_id: str) -> tuple:
    """A response as a caller can compare it, with the id it names taken out."""
    err = error(response)
    return (response.status_code, err["type"], err["code"], err["param"],
            err["message"].replace(adapter_id, "<ID>"))


def assert_rate_limited(response: httpx.Response, *header_groups: tuple[str, ...]) -> None:
    assert response.status_code == 429, response.text
    err = error(response)
    assert err["type"] == "rate_limit_exceeded" and err["code"] == "rate_limit_exceeded", err
    assert int(response.headers["retry-after"]) >= 1
    for group in header_groups:
        assert all(h in response.headers for h in group), (group, dict(response.headers))


def wait_until(what: str, predicate, timeout: float) -> float:
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout, f"timed out after {timeout} s: {what}"
        time.sleep(0.1)
    return time.monotonic() - started
