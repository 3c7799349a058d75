"""Fetch a PEFT adapter from the Hugging Face Hub into the standard HF cache.

Only adapter_config.json and adapter_model.safetensors are downloaded. One metadata request
resolves the revision to a commit and lists the repo's files (so a pickle-only repo is refused
before anything is downloaded); each file is then fetched by commit sha, which the HF cache
answers without touching the network once it holds the file. A revision that is already a
commit sha and fully cached costs no request at all. When the Hub cannot be reached, whatever
the cache holds for that revision is used.

huggingface_hub errors become AdapterErrors whose message says what to do.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

import httpx2  # huggingface_hub's HTTP client
from huggingface_hub import HfApi, hf_hub_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from loragw.adapters.chat_files import CHAT_FILES
from loragw.adapters.errors import AdapterError, AdapterNotFound
from loragw.adapters.safetensors_check import CONFIG_FILE, WEIGHTS_FILE
from loragw.adapters.source_checks import (
    HUB_SCHEME,
    PICKLE_SUFFIXES,
    pickle_refusal,
    validate_repo_id,
    validate_revision,
)

logger = logging.getLogger(__name__)

ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
DEFAULT_REVISION = "main"
_COMMIT_SHA = re.compile(r"[0-9a-f]{40}")


class HubUnavailable(AdapterError):
    """The Hub (or HF_ENDPOINT) could not be reached or failed, and the cache cannot help (502)."""

    status = 502


@dataclass(frozen=True)
class FetchedAdapter:
    path: str  # HF cache snapshot folder holding adapter_config.json + adapter_model.safetensors
    repo_id: str
    revision: str  # as asked ("main" when none was given)
    commit_sha: str  # what revision resolved to

    @property
    def source(self) -> str:
        """Provenance to record: pinned to the commit, so it names exactly these bytes."""
        return f"{HUB_SCHEME}{self.repo_id}@{self.commit_sha}"


def fetch_hub_adapter(
    repo_id: str,
    revision: str | None = None,
    *,
    endpoint: str | None = None,
    token: str | None = None,
    cache_dir: str | None = None,
) -> FetchedAdapter:
    """Download (or find in the HF cache) the adapter files of repo_id at revision.

    token defaults to $HF_TOKEN (then huggingface_hub's stored login); endpoint to
    $HF_ENDPOINT read now (huggingface_hub reads it only at import); cache_dir to the
    standard HF cache ($HF_HUB_CACHE, ~/.cache/huggingface/hub).
    """
    validate_repo_id(repo_id)
    revision = validate_revision(revision) if revision else DEFAULT_REVISION
    token = token or os.environ.get("HF_TOKEN") or None
    endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or "").rstrip("/") or None
    where = f"{repo_id}@{revision}"
    kw = dict(endpoint=endpoint, token=token, cache_dir=cache_dir)

    if _COMMIT_SHA.fullmatch(revision):  # immutable: a complete cached copy needs no request
        cached = _from_cache(repo_id, revision, kw)
        if cached is not None:
            return cached
    try:
        info = HfApi(endpoint=endpoint, token=token).model_info(repo_id, revision=revision)
        commit_sha = info.sha
        if not commit_sha:
            raise HubUnavailable(f"the Hub answered for {where} without a commit sha; is "
                                 f"{endpoint or 'HF_ENDPOINT'} a Hugging Face Hub endpoint?")  # fmt: skip
        listed = [s.rfilename for s in info.siblings] if info.siblings is not None else []
        if info.siblings is not None:
            _check_files(where, listed)
        paths = [
            hf_hub_download(repo_id, name, revision=commit_sha, **kw) for name in ADAPTER_FILES
        ]
        for name in (n for n in CHAT_FILES if n in listed):  # its own template, if it has one
            hf_hub_download(repo_id, name, revision=commit_sha, **kw)
    except (httpx2.TransportError, OfflineModeIsEnabled, LocalEntryNotFoundError) as e:
        cached = _from_cache(repo_id, revision, kw)
        if cached is None:
            raise HubUnavailable(
                f"cannot reach the Hub at {endpoint or 'huggingface.co'} to fetch {where} and it"
                f" is not in the HF cache ({type(e).__name__}: {e}); check the network, proxy"
                " and HF_ENDPOINT, or unset HF_HUB_OFFLINE"
            ) from None
        logger.warning("Hub unreachable (%s); using cached %s at %s", e, where, cached.commit_sha)
        return cached
    except Exception as e:  # every huggingface_hub error gets a message saying what to do
        raise _explain(e, repo_id, where) from None
    folder = os.path.dirname(paths[0])
    assert all(os.path.dirname(p) == folder for p in paths), paths
    _record_ref(folder, revision, commit_sha)
    logger.info("fetched %s (commit %s) into %s", where, commit_sha, folder)
    return FetchedAdapter(folder, repo_id, revision, commit_sha)


def _check_files(where: str, files: list[str]) -> None:
    if WEIGHTS_FILE not in files:
        pickled = sorted(f for f in files if f.lower().endswith(PICKLE_SUFFIXES))
        if pickled:
            raise AdapterError(pickle_refusal(f"hf://{where}", pickled))
        raise AdapterNotFound(f"Hub repo {where} has no {WEIGHTS_FILE}; is it a PEFT LoRA adapter?")
    if CONFIG_FILE not in files:
        raise AdapterNotFound(f"Hub repo {where} has no {CONFIG_FILE}; is it a PEFT LoRA adapter?")


def _record_ref(snapshot: str, revision: str, commit_sha: str) -> None:
    """Note revision -> commit in the cache's refs/, as a by-name download would, so the cache
    can answer for this revision when the Hub is unreachable (we download by commit sha)."""
    if revision == commit_sha:
        return
    ref = os.path.join(os.path.dirname(os.path.dirname(snapshot)), "refs", revision)
    try:
        os.makedirs(os.path.dirname(ref), exist_ok=True)
        with open(f"{ref}.{os.getpid()}.tmp", "w") as f:
            f.write(commit_sha)
        os.replace(f"{ref}.{os.getpid()}.tmp", ref)
    except OSError as e:  # a read-only cache still serves; it only loses the offline fallback
        logger.debug("could not record %s -> %s in the HF cache: %s", revision, commit_sha, e)


def _from_cache(repo_id: str, revision: str, kw: dict) -> FetchedAdapter | None:
    try:
        paths = [
            hf_hub_download(repo_id, name, revision=revision, local_files_only=True, **kw)
            for name in ADAPTER_FILES
        ]
    except (LocalEntryNotFoundError, EntryNotFoundError, OSError):
        return None
    folder = os.path.dirname(paths[0])
    return FetchedAdapter(folder, repo_id, revision, os.path.basename(folder))


def _explain(e: Exception, repo_id: str, where: str) -> Exception:
    """An AdapterError saying what went wrong and what to do; anything else passes through."""
    if isinstance(e, AdapterError):
        return e
    if isinstance(e, GatedRepoError):
        return AdapterNotFound(
            f"Hub repo {repo_id} is gated: accept its conditions on the Hub with your account,"
            " then set HF_TOKEN to a token of that account"
        )
    if isinstance(e, RepositoryNotFoundError):
        return AdapterNotFound(
            f"Hub repository {repo_id} not found or needs a token: check the name, and for a"
            " private or gated repo set HF_TOKEN to a token that can read it"
        )
    if isinstance(e, RevisionNotFoundError):
        return AdapterNotFound(
            f"Hub repo {repo_id} has no revision {where.partition('@')[2]!r}; give an existing"
            " branch, tag or commit (hf://ORG/REPO@REV), or none for the default branch"
        )
    if isinstance(e, EntryNotFoundError):
        return AdapterNotFound(
            f"Hub repo {where} has no {' or '.join(ADAPTER_FILES)}: is it a PEFT LoRA adapter?"
        )
    if isinstance(e, HfHubHTTPError):
        status = e.response.status_code if e.response is not None else None
        if status in (401, 403):
            return AdapterNotFound(
                f"the Hub refused access to {repo_id} (HTTP {status}): the token in HF_TOKEN is"
                " invalid or cannot read this repo; set HF_TOKEN to a token that can"
            )
        return HubUnavailable(f"the Hub failed fetching {where} (HTTP {status}): {e}; retry later")
    return e
