"""Hold receipts: a follower's proof, checked by the coordinator with no round trip, that it holds a worker's pieces
(a commit counts only if every follower does: no round names a contributor a follower cannot apply).

The coordinator draws a secret :func:`new_key` and gives it to each follower with its pieces and at every restore (a
live rollback draws a new one: no receipt of an abandoned future is good again); a follower answers a hold it keeps
with :func:`receipt`; :func:`check` refuses a commit unless every follower's receipt in it is good. The MAC covers
(shard, worker id, step), not the pieces' bytes (a digest would hash every byte on the hold's path). No I/O, no clock.
"""
from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from typing import Any

from shared.errors import ProtocolError

KEY_BYTES = 32


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def parse_key(value: Any) -> bytes | None:
    """The key from its wire form (64 hex digits), None if it is not one."""
    return bytes.fromhex(value) if isinstance(value, str) and re.fullmatch("[0-9a-fA-F]{64}", value) else None


def receipt(key: bytes | None, shard: int, worker_id: str, step: int) -> str:
    """HMAC-SHA256 of (shard, worker id, step) under ``key``, 64 hex digits. 409 ``shard_behind`` without a key: a
    follower that restarted and that the coordinator has not restored yet (the worker registers again)."""
    if key is None:
        raise ProtocolError(409, "shard_behind", f"shard {shard} restarted and the coordinator has not restored it "
                                                 "yet: register again")
    msg = f"syncps-hold\n{shard}\n{worker_id}\n{step}".encode("utf-8", "surrogateescape")
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def check(key: bytes, shards: int, worker_id: str, step: int, receipts: Any) -> None:
    """409 ``not_held`` unless every follower's (1..``shards``-1) receipt in ``receipts`` (a list, follower i's at
    i - 1) is :func:`receipt`'s."""
    got = (receipts if isinstance(receipts, list) else []) + [None] * shards
    bad = [i for i in range(1, shards) if not isinstance(got[i - 1], str) or not hmac.compare_digest(
        got[i - 1].encode("ascii", "replace"), receipt(key, i, worker_id, step).encode())]
    if bad:
        raise ProtocolError(409, "not_held", f"shard(s) {bad} gave no receipt of pieces of step {step} held for "
                                             "this worker: hold them on every shard (POST /v1/shard/gradients) and "
                                             "commit with each follower's receipt")
