"""What the store records about each adapter: root/<id>/meta.json, and the nouns it holds.

meta.json is a StoredAdapter less its path (the folder it sits in says that). A folder whose
meta.json is missing, unreadable or names another id holds no adapter.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field

import msgspec

from loragw.adapters.base_identity import BaseIdentity
from loragw.adapters.chat_files import AdapterChat

logger = logging.getLogger(__name__)

META_FILE = "meta.json"


@dataclass(frozen=True)
class StoredMeta:
    """What the caller knows about an adapter it validated: filled from the LoraAdapter."""

    source: str  # "upload", "hf://ORG/REPO@<commit sha>", "s3://BUCKET/PATH/" or "/abs/dir"
    revision: str | None = None  # the Hub revision asked for
    rank: int = 0  # LoraAdapter.max_rank
    targets: tuple[str, ...] = ()  # LoraAdapter.targets
    version: int | None = None  # None: the store's next; set: the fleet catalog's version
    object_key: str = ""  # where the shared object store holds the same bytes, if it does
    warnings: tuple[str, ...] = ()  # LoraAdapter.warnings (accepted, but worth a look)
    owner: str = ""  # the tenant it belongs to ("": shared)
    draft_source: str = ""  # its draft-model LoRA's source (speculative decoding), if any
    chat: AdapterChat = AdapterChat()  # its own chat template, parsers, sampling defaults


@dataclass(frozen=True)
class StoredAdapter:
    adapter_id: str
    version: int  # 1 on first put; +1 on every replace, also across delete and re-put
    sha256: str  # hex digest of adapter_model.safetensors
    num_bytes: int  # size of adapter_model.safetensors
    source: str
    revision: str | None
    rank: int
    targets: tuple[str, ...]
    created_at: float  # unix time of this version's put
    path: str = field(default="", compare=False)  # folder with the PEFT files; not persisted
    config_sha256: str = ""  # hex digest of adapter_config.json
    object_key: str = ""
    warnings: tuple[str, ...] = ()
    owner: str = ""
    base: BaseIdentity | None = None  # the base model it was validated against (None: older)
    draft_source: str = ""
    chat: AdapterChat = AdapterChat()


def encode_meta(stored: StoredAdapter) -> bytes:
    """meta.json's bytes for stored."""
    record = msgspec.to_builtins(stored)
    del record["path"]
    return msgspec.json.format(msgspec.json.encode(record), indent=2) + b"\n"


def read_meta(folder: str, adapter_id: str | None) -> StoredAdapter | None:
    """The adapter stored in folder, or None if folder holds no complete adapter."""
    try:
        with open(os.path.join(folder, META_FILE), "rb") as f:
            raw = f.read()
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        meta = msgspec.json.decode(raw, type=StoredAdapter)
    except msgspec.DecodeError as e:
        logger.warning("ignoring %s: unreadable %s (%s)", folder, META_FILE, e)
        return None
    if adapter_id is not None and meta.adapter_id != adapter_id:
        logger.warning("ignoring %s: its %s names %r", folder, META_FILE, meta.adapter_id)
        return None
    return dataclasses.replace(meta, path=folder)
