"""Per-adapter drafters: a draft-model LoRA registered beside a target adapter (`draft_adapter`
on upload and register), applied to that adapter's rows of the draft model (speculative
decoding with `"method": "draft_model"`, engine/spec/draft.py).

The draft's source (a server directory, hf://ORG/REPO[@REV] or s3://BUCKET/PATH/) is recorded
with the adapter (meta.json and the catalog entry), so every replica that brings the adapter
into its engine brings its draft LoRA too. Its files are read once per content into
<store>/.drafts/<sha256>/ (content-addressed: a version's draft is never overwritten under a
request), then registered in the engine's draft model under the target's id.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import tempfile

from loragw.adapters.durable_fs import fsync_dir, write_synced
from loragw.adapters.errors import AdapterError
from loragw.adapters.safetensors_check import CONFIG_FILE, WEIGHTS_FILE
from loragw.adapters.sources import InvalidSource, parse_source, resolve_source
from loragw.engine.api import EngineClient
from loragw.gateway.common.errors import APIError

DRAFTS_DIR = ".drafts"


def check_draft_source(source: str | None) -> None:
    """400 for a draft source that is no source at all (before anything is stored)."""
    if source is None:
        return
    try:
        parse_source(source)
    except InvalidSource as e:
        raise APIError.bad_request(f"draft_adapter: {e}", param="draft_adapter") from None


async def attach_draft(engine: EngineClient, store_root: str, adapter_id: str, source: str,
                       *, hub_endpoint: str | None, hub_cache_dir: str | None) -> None:
    """`source`'s LoRA as the draft of `adapter_id`'s rows: 422 when it does not fit the draft
    model, 400 when the server drafts with no draft model."""
    files = await asyncio.to_thread(resolve_source, parse_source(source),
                                    endpoint=hub_endpoint, cache_dir=hub_cache_dir)
    folder = await asyncio.to_thread(_written, store_root, files.config_raw, files.weights_raw)
    try:
        await engine.add_draft_adapter(adapter_id, folder)
    except AdapterError:
        raise  # does not fit the draft model: 422 naming why
    except ValueError as e:  # no draft model to apply it to
        raise APIError.bad_request(f"draft_adapter: {e}", param="draft_adapter") from None


def _written(store_root: str, config_raw: bytes, weights_raw: bytes) -> str:
    """The draft's folder under the store, written whole once per content."""
    digest = hashlib.sha256(hashlib.sha256(config_raw).digest() + weights_raw).hexdigest()
    folder = os.path.join(store_root, DRAFTS_DIR, digest)
    if os.path.isdir(folder):
        return folder
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(folder))
    try:
        write_synced(os.path.join(tmp, CONFIG_FILE), config_raw)
        write_synced(os.path.join(tmp, WEIGHTS_FILE), weights_raw)
        fsync_dir(tmp)
        os.rename(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.isdir(folder):  # else another load wrote the same content first
            raise
    return folder
