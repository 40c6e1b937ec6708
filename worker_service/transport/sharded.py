"""Tensors through a sharded PS (docs/protocol-shards.md, the exchanges): one production transport per shard, used in
parallel; composed of those transports, it calls nothing above them.

Contract: :meth:`ShardedTransport.open` asks the coordinator for the shard URLs and map and plans the map again from its
spec (a digest that differs: 409 ``shard_map_mismatch``), then attaches to every shard as to one PS
(:class:`~worker_service.transport.attach.Attached`). :meth:`push` cuts the gradients into each shard's pieces (views):
every shard holds its pieces, then the step is committed to the coordinator with the followers' receipts while their
next weights are pulled; a refusal by any shard is raised and nothing is committed. With partitioned rounds every shard
gets its pieces as a partitioned push (the coordinator's) or hold (a follower's) with its weights pulled alongside, and
nothing is committed. :meth:`pull` asks every shard in parallel until their answers are of one step. The whole tensors
are reassembled (:mod:`shared.shards`), each shard's slices copied in as its answer arrives, into one of two kept sets
nothing else references (fresh 40 MB cost ~8-18 ms of page faults a step on our VMs).
"""
from __future__ import annotations

import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait as wait_all
from typing import Callable, Mapping

import numpy as np

from shared import frame, marks, refs, shards
from shared.compression import Spec
from shared.errors import ProtocolError
from shared.protocol import API
from worker_service.transport.attach import Attached
from worker_service.transport.base import Pulled, PushAnswer, TensorTransport
from worker_service.transport.endpoint import Endpoint

#: seconds a shard's answers may keep disagreeing on the step before a pull gives up (None: the caller retries)
AGREE_SECONDS = 30.0


class ShardedTransport(TensorTransport):
    def __init__(self, m: shards.ShardMap, links: list[Attached], worker_id: str | None,
                 partitioned: bool = False) -> None:
        self.map, self.links, self.worker_id, self.partitioned = m, links, worker_id, partitioned
        # room for one call per shard, and for the calls a failed batch left running (:meth:`_all`)
        self.pool = ThreadPoolExecutor(max_workers=2 * len(links), thread_name_prefix="shard")
        self._kept: list[dict[str, np.ndarray]] = []  # at most two sets of assembled split tensors

    @property
    def name(self) -> str:
        return "+".join(link.name for link in self.links)

    @classmethod
    def open(cls, coordinator: Endpoint, worker_id: str | None, shm_dir: str | None, compression: Spec,
             partition_bytes: int = 0) -> "ShardedTransport":
        end = time.monotonic() + coordinator.retry_timeout
        while True:
            info = coordinator.call_json("GET", f"{API}/shards", params={"timeout": 10},
                                         timeout=coordinator.timeout + 10)
            if info["map"] is not None or time.monotonic() > end:
                break
        if info["map"] is None:
            raise ProtocolError(409, "not_initialized", "the sharded PS has no model yet")
        try:
            m = shards.from_wire(info["map"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(409, "shard_map_mismatch",
                                f"the coordinator's shard map does not check here: {exc}") from None
        urls = [coordinator.base_url, *info["urls"][1:]]
        # partitioned rounds: a follower's hold is a request body (its frames go to its partitions as they arrive)
        return cls(m, [Attached(coordinator.sibling(url), worker_id, None if i and partition_bytes else shm_dir,
                                compression, partition_bytes) for i, url in enumerate(urls)], worker_id,
                   partition_bytes > 0)

    def _all(self, calls, started: Callable[[], None] | None = None, into: dict[str, np.ndarray] | None = None) -> list:
        """Run the calls in parallel; their results in order, or an error as soon as one fails (e.g. 409
        ``not_active`` from the coordinator after a rollback, while a follower's long-poll pull still waits: it is
        left to end by itself). ``started`` is called once every call is handed to a thread. ``into``: the set the
        calls place their answers in; if one fails, the others may still be writing there: it is dropped, never handed
        out again."""
        futures = [self.pool.submit(c) for c in calls]
        if started is not None:
            started()
        wait_all(futures, return_when=FIRST_EXCEPTION)
        for f in futures:
            if f.done() and f.exception() is not None:
                self._kept = [k for k in self._kept if k is not into]
                raise f.exception()
        return [f.result() for f in futures]

    def _send(self, i: int, meta: dict, grads: Mapping[str, np.ndarray], wait: float, timeout: float,
              hold: dict | None, into: dict[str, np.ndarray]) -> PushAnswer:
        """Shard ``i``'s pieces of ``grads`` as a push (``hold`` None) or a hold, through its link; the weights an
        answer brings (a partitioned push's or hold's, pulled alongside) joined and placed ``into``."""
        if marks.ON:
            marks.mark("push.start", shard=i, peer=self.links[i].endpoint.base_url.split("//")[-1], step=meta["step"])
        pieces = shards.split(grads, self.map.pieces[i])
        dest = {p.key: into[p.name].reshape(-1)[p.start:p.stop] for p in self.map.pieces[i] if not p.whole}
        answer = self.links[i].send(lambda t: t.push(meta, pieces, wait, timeout, hold=hold, into=dest))
        self._placed(i, answer.pulled, into)  # (joined in place already: nothing left to copy)
        if marks.ON:
            marks.mark("shard.done", shard=i, step=meta["step"])
        return answer

    def push(self, meta: dict, grads: Mapping[str, np.ndarray], wait: float, timeout: float,
             on_way: Callable[[], None] | None = None) -> PushAnswer:
        """Every shard's pieces in parallel: partitioned rounds, the coordinator's a push and a follower's a hold,
        each with its weights pulled alongside; else every shard's a hold, then the commit while the followers'
        weights are pulled. ``on_way`` once the calls are with their threads: woken before, its thread took this one's
        core for 1.5-2 ms just as the push was to start
        (bench/results/2026-12-03-where-a-co-located-1e6-x-4-step-between-hosts-goes-and-the-n.jsonl)."""
        step, into = meta["step"], self._target()
        held, hold = {"worker_id": meta["worker_id"], "step": step}, {"map": self.map.digest}
        if marks.ON:
            marks.mark("step.push", step=step, worker=meta["worker_id"])
        if self.partitioned:
            calls = [lambda i=i: self._send(i, held if i else meta, grads, wait, timeout, hold if i else None, into)
                     for i in range(len(self.links))]
            answers = self._all(calls, on_way, into)
            head, parts = answers[0], [a.pulled for a in answers]
        else:
            _, *holds = self._all([lambda i=i: self._send(i, held, grads, 0.0, timeout, hold, into)
                                   for i in range(len(self.links))], on_way)

            def commit() -> PushAnswer:
                answer = self.links[0].current.post(
                    f"{API}/shard/commit", frame.encode({}, {**meta, "receipts": [h.receipt for h in holds]}),
                    {"pull": 1, "timeout": wait}, timeout + wait, step)
                self._placed(0, answer.pulled, into)
                return answer

            head, *rest = self._all([commit, *(lambda i=i: self._pull(i, step + 1, None, wait, timeout, into)
                                               for i in range(1, len(self.links)))], into=into)
            parts = [head.pulled, *rest]
        # the coordinator's answer, with the whole model if every shard sent its weights of one step
        got = PushAnswer(head.status, head.step, head.done,
                         self._joined(parts, into) if all(p is not None for p in parts) else None)
        if marks.ON:
            marks.mark("step.pulled", step=step)
        return got

    def _pull(self, i: int, min_step: int, worker_id: str | None, wait: float, timeout: float,
              into: dict[str, np.ndarray]) -> Pulled | None:
        """Shard ``i``'s answer, its slices copied into ``into`` as soon as it arrives (in the thread that got it:
        the copy of the shard answering first overlaps the wait for the others)."""
        return self._placed(i, self.links[i].pull(min_step, worker_id, wait, timeout), into)

    def _placed(self, i: int, pulled: Pulled | None, into: dict[str, np.ndarray]) -> Pulled | None:
        """``pulled`` (shard ``i``'s answer, if any), its slices copied ``into``."""
        if pulled is not None:
            shards.place(self.map, i, pulled.tensors, into)
        return pulled

    def _joined(self, parts: list[Pulled], into: dict[str, np.ndarray]) -> Pulled | None:
        """The whole model from every shard's answer of one step, each placed ``into`` (None: their steps differ)."""
        if len({p.step for p in parts}) != 1:
            return None
        head = parts[0]
        whole = shards.gathered(self.map, [p.tensors for p in parts], into)
        return Pulled(head.step, head.done, head.ranks, whole)

    def _target(self) -> dict[str, np.ndarray]:
        """The arrays this step's split tensors are assembled into: a kept set none of whose arrays is referenced
        outside it (the weights the caller still computes with are another), else new memory, kept while fewer than
        two sets are."""
        for kept in self._kept:
            if all(refs.free(a) for a in kept.values()):
                return kept
        made = shards.split_memory(self.map)
        if len(self._kept) < 2:
            self._kept.append(made)
        return made

    def pull(self, min_step: int, worker_id: str | None, wait: float, timeout: float) -> Pulled | None:
        end, into = time.monotonic() + AGREE_SECONDS, self._target()
        while True:
            parts = self._all([lambda i=i, s=min_step: self._pull(i, s, None if i else worker_id, wait, timeout, into)
                               for i in range(len(self.links))], into=into)
            if any(p is None for p in parts):
                return None
            joined = self._joined(parts, into)
            if joined is not None or time.monotonic() > end:
                return joined
            min_step = max(p.step for p in parts)  # a shard was behind: ask every shard for the newest step

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        for link in self.links:
            link.close()
            link.endpoint.close()
