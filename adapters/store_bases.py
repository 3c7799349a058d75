"""One --adapter-dir, many base models: each base's adapters in a store of their own.

Layout::

    adapter_dir/bases/<base key>/...   one AdapterStore per base model (adapters.base_identity)
    adapter_dir/<id>/...               adapters stored before stores were kept per base

A server opens only its own base's store, so a server on another base never lists, serves or
replaces them. Adapters left at the top level by an older server are moved into the store of
the first base they validate against, with their versions; the ones no started base accepts
stay where they are, for the base they were made for.
"""

from __future__ import annotations

import logging
import os

from loragw.adapters.base_identity import BaseIdentity
from loragw.adapters.errors import AdapterError
from loragw.adapters.format import parse_adapter
from loragw.adapters.safetensors_check import CONFIG_FILE, WEIGHTS_FILE
from loragw.adapters.store import AdapterStore
from loragw.adapters.store_meta import StoredAdapter, StoredMeta
from loragw.adapters.types import BaseModelSpec

logger = logging.getLogger(__name__)

BASES_DIR = "bases"


def open_base_store(adapter_dir: str, base: BaseIdentity, spec: BaseModelSpec,
                    versions_kept: int = 1) -> AdapterStore:
    """The store of `base`'s adapters under adapter_dir (keeping `versions_kept` versions of
    each id), with any older top-level adapters that fit `spec` moved into it."""
    store = AdapterStore(os.path.join(adapter_dir, BASES_DIR, base.key), base, versions_kept)
    legacy = AdapterStore(adapter_dir)  # its lock keeps two starting servers from racing
    try:
        for old in legacy.list():
            if old.adapter_id.split("/")[0] != BASES_DIR:
                _move(old, legacy, store, spec)
    finally:
        legacy.close()
    return store


def _move(old: StoredAdapter, legacy: AdapterStore, store: AdapterStore,
          spec: BaseModelSpec) -> None:
    with open(os.path.join(old.path, CONFIG_FILE), "rb") as f:
        config_raw = f.read()
    with open(os.path.join(old.path, WEIGHTS_FILE), "rb") as f:
        weights_raw = f.read()
    try:
        adapter = parse_adapter(config_raw, weights_raw, spec)
    except AdapterError as e:
        logger.info("adapter %s in %s is not for this base (%s); left for its own",
                    old.adapter_id, legacy.root, e)
        return
    if store.get(old.adapter_id) is not None:
        logger.warning("adapter %s is both in %s and in this base's store %s; keeping the "
                       "store's", old.adapter_id, legacy.root, store.root)
        return
    meta = StoredMeta(old.source, old.revision, adapter.max_rank, adapter.targets, old.version,
                      old.object_key, adapter.warnings, old.owner)
    store.put(old.adapter_id, config_raw, weights_raw, meta)
    legacy.delete(old.adapter_id)
    logger.info("moved adapter %s v%d into this base's store %s", old.adapter_id, old.version,
                store.root)
