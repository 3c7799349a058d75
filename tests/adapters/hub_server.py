"""A Hugging Face Hub look-alike on loopback, serving in-memory repos to huggingface_hub 2.x.

    repos = {"org/repo": {"main": {"adapter_config.json": b"...", ...}, "v2": {...}}}
    with HubServer(repos, private={"org/secret"}, tokens={"hf_ok"}) as hub:
        fetch_hub_adapter("org/repo", endpoint=hub.endpoint, cache_dir=tmp)
        assert hub.downloads("org/repo", "adapter_model.safetensors") == 1

What huggingface_hub needs, and what this serves (huggingface_hub/hf_api.py, file_download.py,
utils/_http.py):
- ``GET /api/models/{repo}[/revision/{rev}]``: JSON ``id``, ``sha`` (the commit), ``siblings``.
- ``GET /api/models/{repo}/tree/{rev}?recursive=true``: ``[{type, path, size, oid}]``.
- ``HEAD|GET /{repo}/resolve/{rev|sha}/{path}``: ``X-Repo-Commit``, ``ETag`` (names the blob
  in the cache), ``Content-Length``.
- Errors: status + ``X-Error-Code`` (RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo),
  which hf_raise_for_status turns into typed errors; HEAD answers carry no body. Like the Hub,
  a private repo answers 401 RepoNotFound without a token, and any request with a token it
  does not know answers 401 "Invalid credentials in Authorization header".
Revisions in the URL are percent-encoded (``refs%2Fpr%2F1``). Each revision gets a stable
fake commit sha. Every request is counted by (method, decoded path), and every token one
carried is kept in ``tokens_seen``.

Also here: `peft_files`, a tiny PEFT LoRA adapter (adapter_config.json +
adapter_model.safetensors bytes) for the tiny Llama of `TINY_LLAMA`, written without peft.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

Files = dict[str, bytes]

TINY_LLAMA = dict(architectures=["LlamaForCausalLM"], hidden_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                  vocab_size=128)  # fmt: skip


class HubServer:
    def __init__(
        self,
        repos: dict[str, dict[str, Files]],
        *,
        private: set[str] = frozenset(),
        gated: set[str] = frozenset(),
        tokens: set[str] = frozenset(),
    ) -> None:
        self.repos = repos  # repo id -> revision name -> path -> bytes; may change while serving
        self.private, self.gated, self.tokens = set(private), set(gated), set(tokens)
        self.requests: Counter[tuple[str, str]] = Counter()  # (method, decoded path) -> count
        self.tokens_seen: set[str] = set()  # the token of each request that carried one
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> HubServer:
        handler = type("Handler", (_Handler,), {"hub": self})
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()

    @property
    def endpoint(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    # -- what tests look at ------------------------------------------------------------------

    def commit_sha(self, repo_id: str, revision: str) -> str:
        """The fake commit a revision name resolves to (stable for the same files)."""
        h = hashlib.sha1(f"{repo_id}\0{revision}".encode())
        for path, data in sorted(self.repos[repo_id][revision].items()):
            h.update(path.encode() + b"\0" + hashlib.sha256(data).digest())
        return h.hexdigest()

    def file_requests(self, repo_id: str, filename: str, method: str | None = None) -> int:
        """HEAD and GET requests (or only `method`) for repo_id's filename at any revision."""
        prefix, suffix = f"/{repo_id}/resolve/", f"/{filename}"
        with self._lock:
            return sum(n for (m, path), n in self.requests.items()
                       if path.startswith(prefix) and path.endswith(suffix)
                       and method in (None, m))  # fmt: skip

    def downloads(self, repo_id: str, filename: str) -> int:
        """GET requests for a file's bytes: what a cache hit must not add to."""
        return self.file_requests(repo_id, filename, "GET")

    def total_requests(self) -> int:
        with self._lock:
            return sum(self.requests.values())

    # -- resolution --------------------------------------------------------------------------

    def _resolve(self, repo_id: str, rev: str) -> tuple[str, str] | None:
        """(revision name, commit sha) for a revision name or a commit sha."""
        revisions = self.repos[repo_id]
        if rev in revisions:
            return rev, self.commit_sha(repo_id, rev)
        for name in revisions:
            if self.commit_sha(repo_id, name) == rev:
                return name, rev
        return None


class _Reply(Exception):
    def __init__(self, status: int, code: str | None, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers or {}


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer  # set on the subclass HubServer makes

    def log_message(self, format: str, *args: object) -> None:  # quiet test output
        pass

    def do_GET(self) -> None:
        self._serve(head=False)

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def _serve(self, head: bool) -> None:
        url = urlsplit(self.path)
        raw_parts = url.path.split("/")[1:]
        auth = self.headers.get("Authorization", "")
        with self.hub._lock:
            self.hub.requests[(self.command, unquote(url.path))] += 1
            if auth:
                self.hub.tokens_seen.add(auth.removeprefix("Bearer "))
        try:
            if raw_parts[:2] == ["api", "models"]:
                status, headers, body = self._api(raw_parts[2:], url.query)
            elif "resolve" in raw_parts:
                status, headers, body = self._resolve_file(raw_parts)
            else:
                raise _Reply(404, None, f"no route for {url.path}")
        except _Reply as r:
            status, headers = r.status, dict(r.headers)
            body = json.dumps({"error": r.message}).encode()
            headers["Content-Type"] = "application/json"
            if r.code:
                headers["X-Error-Code"] = r.code
            headers["X-Error-Message"] = r.message
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _api(self, parts: list[str], query: str) -> tuple[int, dict, bytes]:
        for i, part in enumerate(parts):
            if part in ("revision", "tree") and i > 0:
                repo_id, op, rest = unquote("/".join(parts[:i])), part, parts[i + 1 :]
                break
        else:
            repo_id, op, rest = unquote("/".join(parts)), "revision", ["main"]
        if not rest:
            raise _Reply(404, None, "missing revision")
        name, sha = self._checked(repo_id, unquote(rest[0]))
        files = self.hub.repos[repo_id][name]
        if op == "revision":
            info = {"id": repo_id, "modelId": repo_id, "sha": sha,
                    "private": repo_id in self.hub.private, "gated": repo_id in self.hub.gated,
                    "siblings": [{"rfilename": p} for p in sorted(files)]}  # fmt: skip
            return 200, {"Content-Type": "application/json"}, json.dumps(info).encode()
        under = unquote("/".join(rest[1:])).strip("/")  # /tree/{rev}/{path_in_repo}
        if under:
            files = {p: d for p, d in files.items() if p.startswith(under + "/")}
        folders = sorted({p.rsplit("/", 1)[0] for p in files if "/" in p} - {under})
        tree = [{"type": "directory", "path": d, "oid": hashlib.sha1(d.encode()).hexdigest()}
                for d in folders]  # fmt: skip
        tree += [{"type": "file", "path": p, "size": len(data), "oid": _git_oid(data)}
                 for p, data in sorted(files.items())]  # fmt: skip
        return 200, {"Content-Type": "application/json"}, json.dumps(tree).encode()

    def _resolve_file(self, raw_parts: list[str]) -> tuple[int, dict, bytes]:
        i = raw_parts.index("resolve")
        repo_id = unquote("/".join(raw_parts[:i]))
        if len(raw_parts) < i + 3:
            raise _Reply(404, None, "missing revision or path")
        name, sha = self._checked(repo_id, unquote(raw_parts[i + 1]))
        path = unquote("/".join(raw_parts[i + 2 :]))
        data = self.hub.repos[repo_id][name].get(path)
        if data is None:
            raise _Reply(404, "EntryNotFound", f"{path} does not exist on {name!r}",
                         {"X-Repo-Commit": sha})  # fmt: skip
        headers = {
            "Content-Type": "application/octet-stream",
            "X-Repo-Commit": sha,
            "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
            "Accept-Ranges": "none",
        }
        return 200, headers, data

    def _checked(self, repo_id: str, rev: str) -> tuple[str, str]:
        """Auth and existence checks the Hub makes, in its order; (revision name, sha)."""
        auth = self.headers.get("Authorization", "")
        token = auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else None
        if token is not None and token not in self.hub.tokens:
            raise _Reply(401, None, "Invalid credentials in Authorization header")
        if repo_id not in self.hub.repos:
            raise _Reply(404, "RepoNotFound", "Repository not found")
        if repo_id in self.hub.gated and token is None:
            raise _Reply(401, "GatedRepo", "Access to this model is restricted; log in")
        if repo_id in self.hub.private and token is None:
            raise _Reply(401, "RepoNotFound", "Repository not found")
        resolved = self.hub._resolve(repo_id, rev)
        if resolved is None:
            raise _Reply(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return resolved


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def peft_files(
    rank: int = 4,
    seed: int = 0,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    lora_alpha: float = 8.0,
) -> Files:
    """A PEFT LoRA adapter for TINY_LLAMA, as PEFT's save_pretrained would write it.

    Keys ``base_model.model.model.layers.{i}.{self_attn|mlp}.{target}.lora_A.weight``
    A: [r, in], B: [out, r], float32; B is random too (PEFT initializes it to zero) so that
    adapters with different seeds have different outputs.
    """
    import safetensors.torch
    import torch

    c = TINY_LLAMA
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    shapes = {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
              "o_proj": (hidden, q), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
              "down_proj": (hidden, inter)}  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(c["num_hidden_layers"]):
        for target in targets:
            block = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            out_f, in_f = shapes[target]
            prefix = f"base_model.model.model.layers.{layer}.{block}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) * 0.1
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * 0.1
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": lora_alpha,
        "target_modules": list(targets), "lora_dropout": 0.0, "bias": "none",
        "base_model_name_or_path": "tiny-llama", "use_rslora": False, "use_dora": False,
        "fan_in_fan_out": False, "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
    }  # fmt: skip
    return {
        "adapter_config.json": json.dumps(config, indent=2).encode(),
        "adapter_model.safetensors": safetensors.torch.save(tensors, metadata={"format": "pt"}),
    }
