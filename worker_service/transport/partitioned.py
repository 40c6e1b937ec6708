"""A worker's push and pull at once, in a job with partitioned rounds (docs/partitions.md, The worker;
docs/protocol-partitions.md).

Contract (:class:`Alongside`): while one thread sends a step's push without ``pull=1``, a second thread on a second
kept-alive connection to the same PS asks ``GET /v1/model?min_step=s+1&partitioned=1`` once (no retry: the client's
own pull is the retry); :meth:`Alongside.result` is those weights once the whole answer is in, or None (204, a refused
or failed pull: the client pulls as ever). :func:`whole` puts an answer's frames back together, the inverse of
:meth:`shared.partitions.Plan.split`: the same bytes as the whole answer of that step.
"""
from __future__ import annotations

import threading
from typing import Any, Mapping

import numpy as np

from shared import frame, marks
from shared.partitions import Plan
from shared.protocol import API
from worker_service.transport.base import Pulled
from worker_service.transport.endpoint import Endpoint


def whole(body: bytes | memoryview, plan: Plan, spec: Mapping[str, tuple],
          into: Mapping[str, np.ndarray] | None = None) -> Pulled:
    """The weights of a pull answer: one frame, or the Q frames of one answered partition by partition. ``into``:
    1-D arrays (by tensor name) a tensor cut into several partitions is joined into, in place of new memory (a sharded
    worker's assembled tensors: :func:`shared.shards.place` then has nothing to copy)."""
    meta = frame.peek_meta(body)
    count = meta.get("partitions", 1) if isinstance(meta, dict) else 1
    if count == 1:
        f = frame.decode(body)
        m = f.meta
        return Pulled(m["step"], m["done"], list(m.get("ranks", [])), dict(f.tensors))
    frames = frame.decode_following(body, count)
    head, last = frames[0].meta, frames[-1].meta
    pieces = {k: v for f in frames for k, v in f.tensors.items()}
    tensors: dict[str, np.ndarray] = {}
    for name in sorted(spec):
        shape, dtype = spec[name]
        parts = [pieces[p.key] for q in plan.partitions for p in q if p.name == name]
        out = None if into is None else into.get(name)
        tensors[name] = parts[0] if len(parts) == 1 else np.concatenate(parts, out=out).reshape(shape)
    return Pulled(head["step"], last["done"], list(last["ranks"]), tensors)


class Alongside:
    """The pull of step ``min_step``'s weights, on its own thread and connection (``endpoint``)."""

    def __init__(self, endpoint: Endpoint, min_step: int, worker_id: str | None, wait: float, timeout: float,
                 plan: Plan, spec: Mapping[str, tuple], into: Mapping[str, np.ndarray] | None = None) -> None:
        """``worker_id`` None: a pull naming no worker (a sharded PS's follower's, which holds no lease); ``into``: as
        :func:`whole`'s."""
        self.endpoint, self.plan, self.spec, self.into = endpoint, plan, spec, into
        self.params: dict[str, Any] = {"min_step": min_step, "timeout": wait, "partitioned": 1}
        if worker_id is not None:
            self.params["worker_id"] = worker_id
        self.timeout = timeout + wait
        self._got: Pulled | None = None
        self.thread = threading.Thread(target=self._run, name=f"pull-{min_step}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            resp = self.endpoint.call("GET", f"{API}/model", params=self.params, timeout=self.timeout, attempts=1,
                                      what=f"GET {API}/model (step {self.params['min_step']}, partitioned)")
            if resp.status_code == 200:
                self._got = whole(resp.content, self.plan, self.spec, self.into)
                if marks.ON:
                    marks.mark("pull.done", peer=self.endpoint.base_url.split("//")[-1],
                               step=self.params["min_step"])
        except Exception:  # noqa: BLE001 (the client pulls again: that pull reports what is wrong)
            self._got = None

    def result(self) -> Pulled | None:
        """The weights, once the answer is all in (None: the client pulls)."""
        self.thread.join(self.timeout + 5.0)
        return None if self.thread.is_alive() else self._got

    @property
    def running(self) -> bool:
        return self.thread.is_alive()
