"""Hold receipts: a follower's proof, checked by the coordinator with no round trip, that it holds a worker's pieces.

A commit counts on the coordinator only if every follower holds that worker's pieces of that step, else the round
would name a contributor a follower cannot apply (409 ``missing_gradient``: the job rolls back). The coordinator
draws a secret :func:`new_key` and gives it to each follower with its pieces (``PUT /v1/shard/model``) and with
every restore (``POST /v1/shard/restore``: start-up check and live rollback, which draws a new one, so no receipt
of an abandoned future is good again). A follower answers a hold it keeps with :func:`receipt`; the worker's commit
carries one per follower (``receipts``, in shard order) and :func:`refused` names the followers whose receipt is
absent or wrong. No I/O, no clock.

A follower keeps a held push until the round of its step is applied there (or a restore drops every hold, with a
new key): so a receipt good under the current key means the follower can apply that worker in that round. The
MAC covers (shard, worker id, step), not the pieces' bytes: whichever pieces of that step the follower holds are
the ones it applies, and a digest would cost a hash of every byte on the hold's path.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Any

KEY_BYTES = 32


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def parse_key(value: Any) -> bytes | None:
    """The key from its wire form (64 hex digits), None if it is not one."""
    if not isinstance(value, str) or len(value) != 2 * KEY_BYTES:
        return None
    try:
        return bytes.fromhex(value)
    except ValueError:
        return None


def receipt(key: bytes, shard: int, worker_id: str, step: int) -> str:
    """HMAC-SHA256 of (shard, worker id, step) under ``key``, 64 hex digits."""
    msg = f"syncps-hold\n{shard}\n{worker_id}\n{step}".encode("utf-8", "surrogateescape")
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def refused(key: bytes, shards: int, worker_id: str, step: int, receipts: Any) -> list[int]:
    """The followers (1..``shards``-1) whose receipt in ``receipts`` (a list, follower i's at i - 1) is absent or
    not :func:`receipt`'s; [] when every follower's is good."""
    got = (receipts if isinstance(receipts, list) else []) + [None] * shards
    return [i for i in range(1, shards) if not isinstance(got[i - 1], str) or not hmac.compare_digest(
        got[i - 1].encode("ascii", "replace"), receipt(key, i, worker_id, step).encode())]
