"""The caller's identity on a request one replica forwards to another, in a form a client
cannot forge: `X-LoRAGW-Identity: KEY_ID.TIME.MAC`, MAC = HMAC-SHA256(fleet secret, key id,
time, method, path, sha256 of the body). The fleet secret is made once by the first replica to
find it missing in Redis (SET NX) and read by every other: whoever can read Redis can read the
keys' hashes too, so it adds no new trust. The forwarding replica strips the caller's
Authorization header (its secret goes no further); the serving replica looks the key id up in
its own keyring, so a key revoked meanwhile is refused there too. A MAC older than MAX_AGE_S,
for another path or body, or under another secret is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time

IDENTITY_HEADER = "x-loragw-identity"
MAX_AGE_S = 60.0


def _mac(secret: bytes, key_id: str, stamp: str, method: str, path: str, body: bytes) -> str:
    message = "\n".join((key_id, stamp, method.upper(), path,
                         hashlib.sha256(body).hexdigest())).encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def sign(secret: bytes, key_id: str, method: str, path: str, body: bytes) -> str:
    stamp = str(int(time.time()))
    return f"{key_id}.{stamp}.{_mac(secret, key_id, stamp, method, path, body)}"


def verify(secret: bytes | None, header: str, method: str, path: str,
           body: bytes) -> str | None:
    """The key id a valid identity header names; None for anything else."""
    if secret is None:
        return None
    key_id, _, rest = header.partition(".")
    stamp, _, mac = rest.partition(".")
    if not key_id or not stamp.isdigit() or abs(time.time() - int(stamp)) > MAX_AGE_S:
        return None
    expected = _mac(secret, key_id, stamp, method, path, body)
    return key_id if hmac.compare_digest(mac.encode(), expected.encode()) else None


async def fleet_secret(redis, prefix: str, known: bytes | None = None) -> bytes:
    """The fleet's forwarding secret: made by the first replica to look, and written back
    (`known`) by those that hold it when Redis comes back empty."""
    key = f"{prefix}forward-secret"
    await redis.set(key, known or secrets.token_hex(32), nx=True)
    return await redis.get(key)
