"""Aliases with weights (adapters/aliases.py, /admin/aliases): the weighted, sticky choice as a
pure function; the routes on one keyed server (validation that changes nothing, the tenant
rules, requests served by the target the weights say, token for token); and two replicas on a
real redis-server following a flip and a rollback within a heartbeat, and Redis going away.

The binomial bound: n requests at weight share p land k on the minor target with
|k - np| <= SIGMAS * sqrt(np(1-p)); at 4 sigma a correct choice fails once in ~16,000 runs.
"""

from __future__ import annotations

import math
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fleet_harness import running_fleet
from uploads import read_files

from loragw.adapters.aliases import Alias, AliasTarget, choose, sticky_point
from loragw.gateway.app import create_app
from loragw.gateway.common.config import ServerConfig
from loragw.gateway.server import BackgroundServer

SIGMAS = 4.0
N = 400
OP, USER = "op-key", "user-key"
PROMPT = "The quick brown fox"
HEARTBEAT_S = 1.0  # gateway.residency.manager.PUBLISH_INTERVAL_S
FOLLOW_WITHIN_S = 3.0  # a heartbeat, a Redis read, and the polling's own requests


def alias(*weights: int, name: str = "bot") -> Alias:
    return Alias(name, tuple(AliasTarget(f"t{i}", w) for i, w in enumerate(weights)), "", 0)


def within_bound(k: int, n: int, p: float) -> bool:
    return abs(k - n * p) <= SIGMAS * math.sqrt(n * p * (1 - p))


# ---- the choice -----------------------------------------------------------------------------
def test_400_requests_at_90_10_land_within_the_binomial_bound():
    a = alias(90, 10)
    by_user = [choose(a, f"user-{i}") for i in range(N)].count("t1")
    rng = random.Random(1234)
    drawn = [choose(a, None, rng) for _ in range(N)].count("t1")
    assert within_bound(by_user, N, 0.1), by_user
    assert within_bound(drawn, N, 0.1), drawn


def test_the_same_user_keeps_the_same_target_and_a_weight_change_moves_only_some():
    a = alias(90, 10)
    for i in range(50):
        assert len({choose(a, f"u{i}") for _ in range(20)}) == 1
    shifted = alias(80, 20)
    before = {f"u{i}": choose(a, f"u{i}") for i in range(N)}
    after = {u: choose(shifted, u) for u in before}
    # the minor target's users at 10% stay on it at 20%; only users moving to it change
    assert all(after[u] == "t1" for u, t in before.items() if t == "t1")
    moved = sum(before[u] != after[u] for u in before)
    assert within_bound(moved, N, 0.1), moved
    # the alias's name salts the hash: another alias with the same targets and weights sends
    # some users elsewhere
    salted = alias(90, 10, name="other")
    base = alias(90, 10)
    assert sum(choose(salted, f"u{i}") != choose(base, f"u{i}") for i in range(N)) > 0


def test_weight_zero_is_never_chosen():
    a = alias(0, 5, 0, 1, 0)
    rng = random.Random(3)
    chosen = {choose(a, None, rng) for _ in range(2000)} | {choose(a, f"u{i}") for i in range(2000)}
    assert chosen == {"t1", "t3"}
    assert {choose(alias(0, 1), f"u{i}") for i in range(200)} == {"t1"}


def test_sticky_points_cover_the_range():
    points = [sticky_point("bot", f"u{i}", 10) for i in range(1000)]
    assert min(points) == 0 and max(points) == 9


# ---- one keyed server -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def aserver(model_dir, adapter_dirs, tmp_path_factory):
    config = ServerConfig(model=model_dir, served_model_name="demo-base", device="cpu",
                          max_model_len=256, max_num_seqs=8, max_loras=4, admin_key=OP,
                          api_key=USER, adapter_dir=str(tmp_path_factory.mktemp("alias-store")),
                          adapter=tuple(f"{n}={adapter_dirs[n]}" for n in ("lora-0", "lora-1")))
    app = create_app(config)
    with BackgroundServer(app) as background:
        background.wait_ready()
        yield background


@pytest.fixture(scope="module")
def call(aserver):
    clients: dict[str | None, httpx.Client] = {}

    def client(key: str | None) -> httpx.Client:
        if key not in clients:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            clients[key] = httpx.Client(base_url=aserver.url, timeout=120, headers=headers)
        return clients[key]

    yield client
    for c in clients.values():
        c.close()


@pytest.fixture(scope="module")
def keys(call, adapter_dirs):
    out = {}
    for name, tenant, role in (("acme", "acme", "admin"), ("globex", "globex", "admin"),
                               ("member", "acme", "member")):
        r = call(OP).post(f"/admin/tenants/{tenant}/keys", json={"role": role})
        assert r.status_code == 201, r.text
        out[name] = r.json()["key"]
    for key, adapter_id in ((out["acme"], "acme/bot"), (out["globex"], "globex/bot")):
        config, weights = read_files(adapter_dirs["lora-2"])
        r = call(key).post("/admin/adapters", data={"adapter_id": adapter_id},
                           files={"adapter_config": ("adapter_config.json", config),
                                  "adapter_model": ("adapter_model.safetensors", weights)})
        assert r.status_code == 201, r.text
    return out


def targets(**weights: int) -> dict:
    return {"targets": [{"adapter": a.replace("_", "-"), "weight": w} for a, w in weights.items()]}


def text(client: httpx.Client, model: str, **extra) -> str:
    r = client.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 6,
                                             "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model  # the name the client sent, alias or not
    return r.json()["choices"][0]["text"]


def test_put_get_list_delete(call):
    r = call(OP).put("/admin/aliases/bot-prod", json=targets(lora_0=90, lora_1=10))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["alias"] == "bot-prod" and body["owner"] == ""
    assert body["targets"] == [{"adapter": "lora-0", "weight": 90},
                               {"adapter": "lora-1", "weight": 10}]
    assert abs(body["updated_at"] - time.time()) < 60
    assert call(OP).get("/admin/aliases/bot-prod").json() == body
    assert "bot-prod" in {a["alias"] for a in call(OP).get("/admin/aliases").json()["data"]}
    r = call(OP).delete("/admin/aliases/bot-prod")
    assert r.status_code == 200 and r.json() == {"alias": "bot-prod", "deleted": True}
    assert call(OP).get("/admin/aliases/bot-prod").status_code == 404
    assert call(OP).delete("/admin/aliases/bot-prod").status_code == 404
    missing = call(OP).post("/v1/completions", json={"model": "bot-prod", "prompt": PROMPT})
    assert missing.status_code == 404


def test_invalid_puts_change_nothing(call):
    assert call(OP).put("/admin/aliases/keep", json=targets(lora_0=1)).status_code == 200
    before = call(OP).get("/admin/aliases").json()
    many = {"targets": [{"adapter": f"lora-{i % 2}@{i + 1}", "weight": 1} for i in range(17)]}
    for name, body, status in (
            ("keep", {"targets": []}, 400),
            ("keep", many, 400),
            ("keep", targets(lora_0=-1, lora_1=2), 400),
            ("keep", {"targets": [{"adapter": "lora-0", "weight": 1.5}]}, 400),
            ("keep", targets(lora_0=0, lora_1=0), 400),
            ("keep", {"targets": [{"adapter": "lora-0", "weight": 1}] * 2}, 400),
            ("keep", {"targets": [{"adapter": "lora-0@x", "weight": 1}]}, 404),
            ("keep", {"targets": [{"adapter": "lora-0@99", "weight": 1}]}, 404),
            ("keep", {"targets": [{"adapter": "../x@1", "weight": 1}]}, 400),
            ("keep", {"targets": [{"adapter": "lora-0", "weight": 1}], "extra": 1}, 400),
            ("a/b/c", targets(lora_0=1), 400),
            ("bad name", targets(lora_0=1), 400),
            ("lora-0", targets(lora_1=1), 409),  # an adapter's id
            ("demo-base", targets(lora_1=1), 409),
            ("other", {"targets": [{"adapter": "keep", "weight": 1}]}, 409),  # an alias
            ("keep", {"targets": [{"adapter": "keep", "weight": 1}]}, 409),  # itself
            ("keep", targets(lora_0=1, nope=1), 404)):
        r = call(OP).put(f"/admin/aliases/{name}", json=body)
        assert r.status_code == status, (name, body, r.text)
        assert r.json()["error"]["message"], r.text
    missing = call(OP).put("/admin/aliases/keep", json=targets(lora_0=1, nope=1))
    assert "'nope'" in missing.json()["error"]["message"]
    assert call(OP).get("/admin/aliases").json() == before
    assert call(OP).delete("/admin/aliases/keep").status_code == 200


def test_a_target_may_pin_a_version(call):
    r = call(OP).put("/admin/aliases/pinned", json=targets(**{"lora-0@1": 1}))
    assert r.status_code == 200, r.text
    assert text(call(USER), "pinned") == text(call(USER), "lora-0")
    assert call(OP).delete("/admin/aliases/pinned").status_code == 200


def test_the_admin_key_is_required(call, keys):
    body = targets(lora_0=1)
    assert call(None).put("/admin/aliases/x", json=body).status_code == 401
    assert call(USER).put("/admin/aliases/x", json=body).status_code == 401
    assert call(None).get("/admin/aliases").status_code == 401
    for method in ("GET", "PUT", "DELETE"):
        r = call(keys["member"]).request(method, "/admin/aliases/acme/x",
                                         json=body if method == "PUT" else None)
        assert r.status_code == 403, (method, r.text)
    assert call(OP).get("/admin/aliases/x").status_code == 404


def test_tenant_namespaces(call, keys):
    acme, globex = keys["acme"], keys["globex"]
    r = call(acme).put("/admin/aliases/acme/prod", json=targets(**{"acme/bot": 1}))
    assert r.status_code == 200 and r.json()["owner"] == "acme", r.text
    assert call(OP).put("/admin/aliases/acme/shared",
                        json=targets(lora_0=1)).json()["owner"] == ""
    before = call(OP).get("/admin/aliases").json()
    for key, name, body, status in (
            (acme, "globex/x", targets(**{"acme/bot": 1}), 403),
            (acme, "plain", targets(**{"acme/bot": 1}), 403),
            (acme, "acme/prod", {**targets(**{"acme/bot": 1}), "owner": "globex"}, 403),
            (acme, "acme/shared", targets(**{"acme/bot": 1}), 403),  # the operator's
            (acme, "acme/x", targets(**{"globex/bot": 1}), 404),  # not a target it may use
            (globex, "acme/prod", targets(**{"globex/bot": 1}), 403)):
        r = call(key).put(f"/admin/aliases/{name}", json=body)
        assert r.status_code == status, (name, r.text)
    assert call(acme).delete("/admin/aliases/acme/shared").status_code == 403
    # another tenant's alias is answered exactly as one that does not exist
    for method in ("GET", "DELETE"):
        hidden = call(globex).request(method, "/admin/aliases/acme/prod")
        absent = call(globex).request(method, "/admin/aliases/acme/nope")
        assert hidden.status_code == absent.status_code == 404
        assert hidden.json()["error"]["message"].replace("prod", "nope") == \
            absent.json()["error"]["message"]
    for model in ("acme/prod", "acme/nope"):
        r = call(globex).post("/v1/completions", json={"model": model, "prompt": PROMPT})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert {a["alias"] for a in call(globex).get("/admin/aliases").json()["data"]} == \
        {"acme/shared"}
    assert call(OP).get("/admin/aliases").json() == before
    assert text(call(keys["member"]), "acme/prod") == text(call(acme), "acme/bot")
    assert call(acme).delete("/admin/aliases/acme/prod").status_code == 200
    assert call(OP).delete("/admin/aliases/acme/shared").status_code == 200


def test_an_alias_keeps_its_targets_secret(call, keys, adapter_dirs):
    """An operator alias aimed at a tenant's adapter is, to every other key, a name that does
    not exist: no 404 naming the target, no listing, no GET of its targets."""
    acme, globex = keys["acme"], keys["globex"]
    assert call(OP).put("/admin/aliases/peek", json=targets(**{"acme/bot": 1})).status_code \
        == 200
    for key in (globex, USER.replace("user", "nobody")):
        r = call(key).post("/v1/completions", json={"model": "peek", "prompt": PROMPT})
        assert r.status_code in (401, 404) and "acme" not in r.text, r.text
    r = call(globex).post("/v1/completions", json={"model": "peek", "prompt": PROMPT})
    assert r.status_code == 404 and "'peek'" in r.json()["error"]["message"], r.text
    assert call(globex).get("/admin/aliases/peek").status_code == 404
    assert "peek" not in {a["alias"] for a in call(globex).get("/admin/aliases").json()["data"]}
    assert call(acme).get("/admin/aliases/peek").json()["targets"][0]["adapter"] == "acme/bot"
    assert text(call(keys["member"]), "peek") == text(call(acme), "acme/bot")

    # deleting a target: 409 naming the aliases on it, unless ?force=true
    config, weights = read_files(adapter_dirs["lora-2"])
    r = call(acme).post("/admin/adapters", data={"adapter_id": "acme/gone"},
                        files={"adapter_config": ("adapter_config.json", config),
                               "adapter_model": ("adapter_model.safetensors", weights)})
    assert r.status_code == 201, r.text
    assert call(acme).put("/admin/aliases/acme/soon", json=targets(**{"acme/gone": 1})) \
        .status_code == 200
    refused = call(acme).delete("/admin/adapters/acme/gone")
    assert refused.status_code == 409, refused.text
    assert "'acme/soon'" in refused.json()["error"]["message"]
    assert call(acme).get("/admin/adapters/acme/gone").status_code == 200  # nothing changed
    assert call(acme).delete("/admin/adapters/acme/gone?force=true").status_code == 200
    # the dangling alias answers with the name the client sent, not its target
    r = call(keys["member"]).post("/v1/completions", json={"model": "acme/soon",
                                                           "prompt": PROMPT})
    assert r.status_code == 404, r.text
    assert "acme/soon" in r.json()["error"]["message"] and "gone" not in r.text
    assert call(acme).delete("/admin/aliases/acme/soon").status_code == 200
    # an alias another tenant cannot see is counted, not named, in the 409
    assert call(OP).put("/admin/aliases/globex/spy", json={**targets(**{"acme/bot": 1}),
                                                           "owner": "globex"}).status_code == 200
    refused = call(acme).delete("/admin/adapters/acme/bot")
    assert refused.status_code == 409 and "spy" not in refused.text, refused.text
    assert "cannot see" in refused.json()["error"]["message"]
    for name in ("peek", "globex/spy"):
        assert call(OP).delete(f"/admin/aliases/{name}").status_code == 200


def test_requests_through_an_alias_flip_and_stick(call):
    direct = {name: text(call(USER), name) for name in ("lora-0", "lora-1")}
    assert direct["lora-0"] != direct["lora-1"], "the test needs targets that answer apart"
    assert call(OP).put("/admin/aliases/flip", json=targets(lora_0=100, lora_1=0)).status_code \
        == 200
    assert {text(call(USER), "flip") for _ in range(5)} == {direct["lora-0"]}
    assert call(OP).put("/admin/aliases/flip", json=targets(lora_0=0, lora_1=100)).status_code \
        == 200
    assert {text(call(USER), "flip") for _ in range(5)} == {direct["lora-1"]}
    chat = call(USER).post("/v1/chat/completions", json={
        "model": "flip", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200 and chat.json()["model"] == "flip"

    assert call(OP).put("/admin/aliases/flip", json=targets(lora_0=90, lora_1=10)).status_code \
        == 200
    with ThreadPoolExecutor(8) as pool:  # batched, as a server sees traffic
        served = list(pool.map(lambda i: text(call(USER), "flip", user=f"user-{i}",
                                               max_tokens=2), range(N)))
    short = {name: text(call(USER), name, max_tokens=2) for name in direct}
    assert short["lora-0"] != short["lora-1"]
    assert set(served) <= set(short.values())
    minor = served.count(short["lora-1"])
    assert within_bound(minor, N, 0.1), minor
    one = next(i for i, s in enumerate(served) if s == short["lora-1"])
    assert {text(call(USER), "flip", user=f"user-{one}") for _ in range(10)} == \
        {direct["lora-1"]}
    assert call(OP).delete("/admin/aliases/flip").status_code == 200


# ---- two replicas, one Redis ----------------------------------------------------------------
@pytest.fixture(scope="module")
def fleet(model_dir, tmp_path_factory):
    with running_fleet(tmp_path_factory.mktemp("aliases"), model_dir, "r1", "r2") as fleet:
        yield fleet


def served_text(fleet, rid: str, model: str) -> str:
    """Generated on `rid` itself (the forwarded marker keeps it there)."""
    return fleet.text(rid, model, marker="test")


def follow(fleet, rid: str, model: str, expected: str) -> float:
    """Seconds until `rid` serves `model` as `expected` (a 404 until it reads a new alias)."""
    def served_now() -> str | None:
        r = fleet.complete(rid, model, marker="test")
        return r.json()["choices"][0]["text"] if r.status_code == 200 else None

    return fleet.wait_for(f"{rid} to follow the alias", lambda: served_now() == expected,
                          timeout=10)


def test_a_forward_serves_the_target_its_replica_drew(fleet, adapter_dirs):
    """No shared store: lora-2 stays on r1 and lora-3 on r2, so a replica that draws the other's
    target forwards the request there with its draw, and the holder serves that target (drawn
    again there, half the requests would name an adapter it cannot fetch)."""
    for rid, name in (("r1", "lora-2"), ("r2", "lora-3")):
        assert fleet.upload(rid, name, adapter_dirs[name]).status_code == 201
    for rid in ("r1", "r2"):
        fleet.wait_for(f"{rid} to list both", lambda rid=rid: {"lora-2", "lora-3"}
                       <= set(fleet.models(rid)))
    assert fleet.http.put(fleet.urls["r1"] + "/admin/aliases/split",
                          json=targets(lora_2=1, lora_3=1)).status_code == 200
    fleet.wait_for("r2 to read the alias", lambda: fleet.http.get(
        fleet.urls["r2"] + "/admin/aliases/split").status_code == 200)
    holder, seen = {"lora-2": "r1", "lora-3": "r2"}, set()
    for i in range(16):
        response = fleet.complete(("r1", "r2")[i % 2], "split")  # no user; the router decides
        assert response.status_code == 200, response.text
        served = response.headers["x-adapter-version"].split("@")[0]
        assert holder[served] == response.headers["x-served-by"], response.headers
        seen.add(served)
    assert seen == {"lora-2", "lora-3"}
    assert fleet.http.delete(fleet.urls["r2"] + "/admin/aliases/split").status_code == 200


def test_two_replicas_follow_a_flip_and_a_rollback_within_a_heartbeat(fleet, adapter_dirs):
    for name in ("lora-0", "lora-1"):
        r = fleet.register("r1", name, adapter_dirs[name])  # a path both replicas read
        assert r.status_code == 201, r.text
    fleet.wait_for("r2 to list both", lambda: {"lora-0", "lora-1"} <= set(fleet.models("r2")))
    direct = {name: served_text(fleet, "r2", name) for name in ("lora-0", "lora-1")}
    assert direct["lora-0"] != direct["lora-1"]
    put = lambda rid, w0, w1: fleet.http.put(  # noqa: E731
        fleet.urls[rid] + "/admin/aliases/live", json=targets(lora_0=w0, lora_1=w1))

    assert put("r1", 100, 0).status_code == 200
    assert follow(fleet, "r2", "live", direct["lora-0"]) <= FOLLOW_WITHIN_S
    assert fleet.http.get(fleet.urls["r2"] + "/admin/aliases/live").json()["targets"][0] == \
        {"adapter": "lora-0", "weight": 100}
    assert put("r1", 0, 100).status_code == 200  # the flip
    assert follow(fleet, "r2", "live", direct["lora-1"]) <= FOLLOW_WITHIN_S
    assert put("r2", 100, 0).status_code == 200  # the rollback, through the other replica
    assert follow(fleet, "r1", "live", direct["lora-0"]) <= FOLLOW_WITHIN_S
    assert served_text(fleet, "r2", "live") == direct["lora-0"]
    stored = {k.decode() for k in fleet.redis.hkeys(fleet.prefix() + "aliases")}
    assert stored == {"live"}

    # Redis goes away: requests keep resolving the alias as last read; changes answer 503
    fleet.redis_server.kill()
    time.sleep(2 * HEARTBEAT_S)
    for rid in ("r1", "r2"):
        assert served_text(fleet, rid, "live") == direct["lora-0"]
    r = put("r1", 0, 100)
    assert r.status_code == 503 and r.json()["error"]["code"] == "aliases_unavailable", r.text
    assert served_text(fleet, "r1", "live") == direct["lora-0"]
