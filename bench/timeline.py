"""``python -m bench.timeline DIR``: where a partitioned step on shard hosts waits, from the marks of one run.

Run ``bench.hosts`` (or any sharded job with ``PS_PARTITION_BYTES`` > 0) with ``SYNCPS_MARKS_DIR=DIR``
(:mod:`shared.marks`): every process writes its marks there, one clock for all (CLOCK_MONOTONIC, one machine). This
reads them and prints, for each step of one worker (``--worker``: its id; default the first), one JSON line, times in
ms from the worker's push (``step.push``; 0):

- ``compute_ms``: from the worker's last step's weights in (``step.pulled``) to this push: the worker's own time;
- ``up``: the worker's uplink: ``sent_ms`` (the last shard's body handed to the kernel), ``in_ms`` (the last byte at
  the last shard: each frame's arrival estimated from its shard's body progress, linear between two wakes),
  ``detected_lag_ms`` (the largest delay from a frame's arrival to its shard taking it, over the step's frames);
- ``down``: the worker's downlink, from the pulls' chunks (one a partition frame, every shard's connection):
  ``first_ms``/``last_ms`` (its first and last byte), ``busy_ms`` (the union of the chunks' receive intervals) and
  ``gaps`` (a whole answer, the round closed before its pull, is one chunk, ``q`` ``"whole"``): each idle interval of at least ``--gap`` ms from the push to the last byte, and what its next chunk
  waited for: that partition's close on its shard (``close_ms``), and what the close waited for: the last
  contributor's frame (``by``: worker, ``arrived_ms``, ``taken_ms``) or the decision (``decision_ms``);
- ``round``: ``decided_ms`` (the coordinator's partition 0 closed: the round's decision), ``decision_queued_ms`` and
  ``decision_sent_ms`` (queued for the followers' links, written to the last of them) and ``decision_in_ms`` (when it
  reached each follower, whose partitions close only then);
- ``step_ms``: to the weights in (``step.pulled``).

A last line ``{"summary": ...}``: the medians over the steps after ``--skip`` (warm-up), and the link model's terms
(docs/scaling.md: ``M/B``, the fill and drain ``M/(Q·B)``) for ``--rate`` and the run's bytes.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def load(root: Path) -> dict[int, list[dict]]:
    """The marks by process id, in time order."""
    by: dict[int, list[dict]] = defaultdict(list)
    for f in sorted(root.glob("*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                m = json.loads(line)
                by[m["pid"]].append(m)
    for marks in by.values():
        marks.sort(key=lambda m: m["t"])
    return dict(by)


def arrival(wakes: list[dict], end: int) -> int | None:
    """When byte ``end`` of a body arrived, from its wakes ((t, got) in order): linear between the wake before and
    the first wake that had it."""
    before = None
    for w in wakes:
        if w["got"] >= end:
            if before is None or w["got"] == before["got"]:
                return w["t"]
            frac = (end - before["got"]) / (w["got"] - before["got"])
            return int(before["t"] + frac * (w["t"] - before["t"]))
        before = w
    return None


class Shard:
    """One shard's marks: its frames (by worker, step, partition), closes and decisions."""

    def __init__(self, marks: list[dict]) -> None:
        # (the coordinator, shard 0, gets no decisions)
        self.index = next((m["shard"] for m in marks if m["ev"] in ("pull.yield", "decision.in")), 0)
        self.frames: dict[tuple[str, int, int], dict] = {}  # (worker, step, q) -> {taken, arrived}
        self.closes: dict[tuple[int, int], int] = {}  # (step, q) -> t
        self.decisions: dict[int, int] = {}
        self.queued: dict[int, int] = {}  # (the coordinator) step -> its decision queued for the followers
        self.sent: dict[int, int] = {}  # (the coordinator) step -> written to the last follower's link
        wakes: dict[int, list[dict]] = defaultdict(list)  # a body's (a feed's) wakes
        whose: dict[int, tuple[str, int]] = {}  # a body -> (worker, step), from its head
        for m in marks:
            ev = m["ev"]
            if ev == "body.wake":
                if wakes[m["body"]] and wakes[m["body"]][-1]["got"] > m["got"]:  # (an id used again: a new body)
                    wakes[m["body"]] = []
                wakes[m["body"]].append(m)
            elif ev == "frame.in":
                if m["q"] == 0:
                    whose[m["body"]] = (m["worker"], m["step"])
                w, step = whose[m["body"]]
                self.frames[(w, step, m["q"])] = {"taken": m["t"],
                                                  "arrived": arrival(wakes[m["body"]], m["end"]) or m["t"]}
            elif ev == "part.close":
                self.closes.setdefault((m["step"], m["q"]), m["t"])
            elif ev == "decision.in":
                self.decisions.setdefault(m["step"], m["t"])
            elif ev == "decision.queued":
                self.queued.setdefault(m["step"], m["t"])
            elif ev == "decision.sent":
                self.sent[m["step"]] = max(self.sent.get(m["step"], 0), m["t"])

    def waited(self, step: int, q: int | str) -> dict:
        """What partition ``q`` of round ``step`` closed after: the last frame of it taken, or the decision (``q``
        "whole": the round's last partition)."""
        if q == "whole":
            q = max((qq for s, qq in self.closes if s == step), default=max(
                (qq for (_, s, qq) in self.frames if s == step), default=0))
        close = self.closes.get((step, q))
        frames = [(v["taken"], w, v) for (w, s, qq), v in self.frames.items() if s == step and qq == q]
        out: dict = {"close": close}
        if frames:
            taken, w, v = max(frames, key=lambda x: x[0])
            out.update(by=w, taken=taken, arrived=v["arrived"])
        if step in self.decisions:
            out["decision"] = self.decisions[step]
        return out


def worker_steps(marks: list[dict]) -> tuple[str, list[dict]]:
    """A worker's id and its steps: per step the marks from its push to its weights in."""
    wid = next(m["worker"] for m in marks if m["ev"] == "step.push")
    steps, cur = [], None
    for m in marks:
        if m["ev"] == "step.push":
            cur = {"step": m["step"], "push": m["t"], "marks": []}
            steps.append(cur)
        elif cur is not None:
            cur["marks"].append(m)
            if m["ev"] == "step.pulled":
                cur["pulled"] = m["t"]
                cur = None
    return wid, [s for s in steps if "pulled" in s]


def gaps(intervals: list[tuple[int, int, object]], start: int, end: int, least_ns: int) -> list[tuple[int, int, object]]:
    """Idle stretches of ``[start, end]`` not covered by ``intervals`` ((a, b, what)), each with the interval that
    ends it."""
    out, at = [], start
    for a, b, what in sorted(intervals, key=lambda x: x[0]):
        if a - at >= least_ns:
            out.append((at, a, what))
        at = max(at, b)
    return out


def step_line(s: dict, prev_pulled: int | None, shards: dict[str, Shard], wid: str, least_ns: int) -> dict:
    t0 = s["push"]
    ms = lambda t: None if t is None else round((t - t0) / 1e6, 1)  # noqa: E731
    step = s["step"]
    sent = [m["t"] for m in s["marks"] if m["ev"] == "http.sent" and m["target"].endswith("gradients")]
    arrived, lags = [], []
    for sh in shards.values():
        for (w, st, q), v in sh.frames.items():
            if w == wid and st == step:
                arrived.append(v["arrived"])
                lags.append(v["taken"] - v["arrived"])
    chunks, open_ = [], {}
    for m in s["marks"]:
        if m["ev"] == "chunk.first":
            open_[m["peer"]] = m["t"]
        elif m["ev"] == "chunk.last" and m["peer"] in open_:
            chunks.append((open_.pop(m["peer"]), m["t"], m["peer"], m.get("whole", False)))
    per_peer: dict[str, int] = defaultdict(int)
    tagged = []
    for a, b, peer, whole in chunks:  # a whole answer (the round closed before the pull): its last partition's close
        tagged.append((a, b, (peer, "whole" if whole else per_peer[peer])))
        per_peer[peer] += 1
    busy, at = 0, None
    for a, b, _ in sorted(tagged):
        if at is None or a > at:
            busy += b - a
            at = b
        elif b > at:
            busy += b - at
            at = b
    idle = []
    for a, b, (peer, q) in gaps(tagged, t0, max((c[1] for c in tagged), default=t0), least_ns):
        sh = shards.get(peer)
        g = {"from_ms": ms(a), "to_ms": ms(b), "ms": round((b - a) / 1e6, 1), "next": {"shard": sh and sh.index, "q": q}}
        if sh is not None:
            w = sh.waited(step, q)
            g["next"].update(close_ms=ms(w.get("close")), by=w.get("by"), arrived_ms=ms(w.get("arrived")),
                             taken_ms=ms(w.get("taken")), decision_ms=ms(w.get("decision")))
        idle.append(g)
    coordinator = next((sh for sh in shards.values() if sh.index == 0), None)
    followers = sorted({sh.index: sh for sh in shards.values() if sh.index}.items())
    decided = None if coordinator is None else coordinator.closes.get((step, 0))
    return {"step": step, "compute_ms": None if prev_pulled is None else round((t0 - prev_pulled) / 1e6, 1),
            "round": {"decided_ms": ms(decided), "decision_queued_ms": ms(coordinator and coordinator.queued.get(step)),
                      "decision_sent_ms": ms(coordinator and coordinator.sent.get(step)),
                      "decision_in_ms": [ms(sh.decisions.get(step)) for _, sh in followers]},
            "up": {"sent_ms": ms(max(sent, default=None)), "in_ms": ms(max(arrived, default=None)),
                   "detected_lag_ms": round(max(lags, default=0) / 1e6, 1)},
            "down": {"first_ms": ms(min((c[0] for c in tagged), default=None)),
                     "last_ms": ms(max((c[1] for c in tagged), default=None)), "busy_ms": round(busy / 1e6, 1),
                     "gaps": idle},
            "step_ms": ms(s["pulled"])}


def summary(lines: list[dict], rate_bits: float, model_bytes: float, q: int) -> dict:
    def med(f):
        vals = [v for v in (f(x) for x in lines) if v is not None]
        return round(statistics.median(vals), 1) if vals else None
    mb = model_bytes / (rate_bits / 8) * 1e3
    return {"summary": {"steps": len(lines), "step_ms": med(lambda x: x["step_ms"]),
                        "compute_ms": med(lambda x: x["compute_ms"]), "up_sent_ms": med(lambda x: x["up"]["sent_ms"]),
                        "up_in_ms": med(lambda x: x["up"]["in_ms"]),
                        "detected_lag_ms": med(lambda x: x["up"]["detected_lag_ms"]),
                        "down_first_ms": med(lambda x: x["down"]["first_ms"]),
                        "down_last_ms": med(lambda x: x["down"]["last_ms"]),
                        "down_busy_ms": med(lambda x: x["down"]["busy_ms"]),
                        "down_idle_ms": med(lambda x: sum(g["ms"] for g in x["down"]["gaps"])),
                        "decided_ms": med(lambda x: x["round"]["decided_ms"]),
                        "decision_lag_ms": med(lambda x: max(
                            (d - x["round"]["decided_ms"] for d in x["round"]["decision_in_ms"] if d is not None),
                            default=None) if x["round"]["decided_ms"] is not None else None),
                        "model_M_over_B_ms": round(mb, 1), "model_fill_ms": round(mb / q, 1),
                        "model_link_ms": round(mb * (1 + 1 / q), 1)}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.timeline", description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path, help="SYNCPS_MARKS_DIR of the run")
    ap.add_argument("--worker", help="the worker id (default: the first worker's marks)")
    ap.add_argument("--skip", type=int, default=2, help="steps left out of the summary (warm-up)")
    ap.add_argument("--gap", type=float, default=5.0, help="the least idle ms reported")
    ap.add_argument("--rate", type=float, default=1e9, help="a link's bits/s (the model's B)")
    ap.add_argument("--model-bytes", type=float, default=4e7, help="the model's bytes M")
    ap.add_argument("--partitions", type=int, default=3, help="partitions a shard Q")
    args = ap.parse_args(argv)
    procs = load(args.dir)
    shards: dict[str, Shard] = {}
    addr: dict[str, str] = {}  # shard ip:port -> its pid's Shard, through the workers' push.start peers
    by_index: dict[int, Shard] = {}
    for pid, marks in procs.items():
        if any(m["ev"] in ("frame.in", "pull.yield") for m in marks):
            sh = Shard(marks)
            by_index[sh.index] = sh
    workers = {pid: m for pid, m in procs.items() if any(x["ev"] == "step.push" for x in m)}
    for marks in workers.values():
        for m in marks:
            if m["ev"] == "push.start":
                addr[m["peer"]] = m["shard"]
    shards = {peer: by_index[i] for peer, i in addr.items() if i in by_index}
    chosen = None
    for marks in workers.values():
        wid, steps = worker_steps(marks)
        if args.worker in (None, wid):
            chosen = (wid, steps)
            break
    if chosen is None:
        print(f"no worker {args.worker} in {args.dir}", file=sys.stderr)
        return 1
    wid, steps = chosen
    lines, prev = [], None
    for s in steps:
        line = {"worker": wid, **step_line(s, prev, shards, wid, int(args.gap * 1e6))}
        prev = s["pulled"]
        lines.append(line)
        print(json.dumps(line))
    print(json.dumps(summary(lines[args.skip:], args.rate, args.model_bytes, args.partitions)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
