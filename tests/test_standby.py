"""A hot standby (issue 51; docs/guides/standby.md): replication, takeover, fencing, elections.

- sans-IO: an election can never be won by both PS of a pair (every split of every roster's votes); a core fed the
  messages of another (``on_step`` -> :mod:`ps_service.standby.messages` -> ``apply_round``), after its state
  transfer, holds the same bits, in every mode and for a top-k job's sparse sums; a standby ``Pair`` acknowledges a
  step before it applies it, and applies it before anything reads its model (the next message, a digest, a
  takeover); a step that fails to apply leaves it unable to take over;
- live (real PS and worker processes, tests/test_standby_live.py): the pair in each mode, the crash loop, the standby
  killed, a partition between the two.
"""
from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest

from ps_service.core import ParameterServerCore
from ps_service.standby import messages
from ps_service.standby.election import Election
from shared import frame
from shared.compression import SparseTensor
from shared.errors import ProtocolError
from shared.protocol import ModelInit, PushRequest
from tests.configs import core_config


@pytest.mark.parametrize("n", range(0, 6))
def test_no_two_pss_ever_win_one_term(n):
    """Every split of the roster's votes (each worker votes once: for the primary, the standby, or neither), and the
    primary knowing one more or one fewer name (a membership change sent and maybe not applied)."""
    names = [f"w{i}" for i in range(n)]
    rosters = [(frozenset(names), frozenset(names)), (frozenset(names), frozenset(names[:-1])),
               (frozenset(names + ["x"]), frozenset(names))]
    for p_rosters, s_roster in [((a, b), s) for a, b in rosters for s in (a, b)]:
        for split in itertools.product((0, 1, 2), repeat=len(p_rosters[0] | s_roster)):
            everyone = sorted(p_rosters[0] | s_roster)
            p, s = Election(2, p_rosters, incumbent=True), Election(2, (s_roster,), incumbent=False)
            for name, side in zip(everyone, split):
                if side:
                    (p if side == 1 else s).vote(name)
            assert not (p.won and s.won), (p_rosters, s_roster, split)
    lone = Election(2, (frozenset(),), incumbent=True)
    assert lone.won and not Election(2, (frozenset(),), incumbent=False).won  # no worker: the primary goes on


def test_ties_go_to_the_primary_and_a_standby_needs_a_majority():
    roster = frozenset({"a", "b"})
    p, s = Election(3, (roster,), incumbent=True), Election(3, (roster,), incumbent=False)
    assert not p.won and p.needed == 1 and p.vote("a") and p.vote("stranger") and p.votes == {"a"}  # a tie: won
    assert not s.vote("b") and s.needed == 1 and s.vote("a")


W = {"b": np.zeros(3, np.float32), "w": np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)}


def grads(step: int, rank: int, sparse: bool) -> dict:
    rng = np.random.default_rng(1000 * step + rank)
    out = {}
    for k, v in W.items():
        g = rng.standard_normal(v.shape).astype(np.float32)
        if sparse:
            idx = np.sort(rng.choice(v.size, 2, replace=False)).astype(np.int64)
            out[k] = SparseTensor(v.shape, idx, g.reshape(-1)[idx].copy())
        else:
            out[k] = g
    return out


def state_bytes(core) -> dict:
    st = core.model_state()
    flat = {f"w/{k}": v.tobytes() for k, v in st["weights"].items()}
    flat.update({f"{s}/{k}": v.tobytes() for s, t in st["optimizer"]["slots"].items() for k, v in t.items()})
    return {**flat, "step": st["global_step"], "iterations": st["optimizer"]["iterations"]}


@pytest.mark.parametrize("mode,optimizer,sparse", [
    ("sync", "momentum", False), ("sync", "adam", False), ("sync", "momentum", True), ("sync", "sgd", True),
    ("async", "adam", False), ("ssp", "adagrad", False)])
def test_a_core_fed_the_primarys_steps_holds_the_same_bits(mode, optimizer, sparse):
    settings = {"min_workers": 3, "startup_grace_seconds": 0.0, "mode": mode}
    primary, standby = ParameterServerCore(core_config(**settings)), ParameterServerCore(core_config(**settings))
    sent: list[bytes] = []
    primary.replica = SimpleNamespace(on_step=lambda total, mean_of, n: sent.append(
        messages.encode_step(primary.global_step, total, mean_of, n, {"members": primary.members.export()})))
    primary.init_model(ModelInit({k: v.copy() for k, v in W.items()}, {"name": optimizer, "learning_rate": 0.1}), 0.0)
    ids = [primary.register(f"w{i}", 0.0)[0].worker_id for i in range(3)]
    for step in range(2):
        for rank, wid in enumerate(ids):
            pushed = primary.global_step if mode == "sync" else step
            primary.push(PushRequest(wid, pushed, grads(step, rank, sparse)), 1.0)
    standby.adopt(messages.decode_state(messages.encode_state(primary.export_state())), 2.0)  # the state transfer
    standby.follow()
    sent.clear()
    for step in range(2, 7):
        for rank, wid in enumerate(ids):
            pushed = primary.global_step if mode == "sync" else step
            primary.push(PushRequest(wid, pushed, grads(step, rank, sparse)), 3.0)
    for body in sent:
        meta, total = messages.decode_step(body)
        assert meta["step"] == standby.global_step
        standby.apply_round(total, meta["mean_of"], meta["contributors"])
    assert primary.global_step == (7 if mode == "sync" else 21)
    assert state_bytes(standby) == state_bytes(primary)
    # the takeover: the members the primary last sent, back as expired; each registers again, same id and rank
    taken = ParameterServerCore(core_config(**settings))
    taken.adopt({**standby.model_state(), "members": messages.decode_step(sent[-1])[0]["members"]}, 4.0)
    assert state_bytes(taken) == state_bytes(primary) and not taken.started
    again = [taken.register(f"w{i}", 5.0)[0] for i in (2, 0, 1)]
    assert sorted((m.rank, m.worker_id) for m in again) == [(i, ids[i]) for i in range(3)]
    assert taken.started


def test_a_workers_endpoint_follows_the_pair_and_votes_once_per_term():
    """A (down) -> B (standby, then a candidate: the worker votes, once, then B serves term 2); the term the worker
    saw goes with every request after, and B hears that A lost the worker's connection."""
    from shared.rawhttp import ConnectionLost
    from worker_service.client import PSClient
    from worker_service.transport.mock import Answer, MockTransport

    seen, votes, lost = [], [], []
    b_state = {"role": "standby"}

    def a(req):
        seen.append(("a", req.path, req.headers.get("x-syncps-term")))
        raise ConnectionLost("refused")

    def b(req):
        seen.append(("b", req.path, req.headers.get("x-syncps-term")))
        lost.append(req.headers.get("x-syncps-peer-lost"))
        if req.path == "/v1/ha/vote":
            votes.append(req.json())
            b_state["role"] = "primary"
            return Answer.of_json({"term": 1, "counted": True})
        if b_state["role"] == "standby":
            b_state["role"] = "candidate"
            ans = Answer.of_json({"error": "standby", "detail": "the standby"}, 503)
        elif b_state["role"] == "candidate":
            ans = Answer.of_json({"error": "election", "detail": "vote"}, 503)
        else:
            ans = Answer.of_json({"worker_id": "w", "ok": True})
            ans.headers["x-syncps-term"] = "2"
            return ans
        ans.headers["x-syncps-term"] = "1"
        return ans

    client = PSClient("http://a:1,http://b:2", connection=MockTransport(a), attempts=10, retry_timeout=10)
    client.endpoint._transports["http://b:2"] = MockTransport(b)
    client.endpoint.voter = "w0"
    assert client.endpoint.call_json("GET", "/v1/thing")["ok"] and client.endpoint.term == 2
    assert votes == [{"term": 2, "name": "w0"}] and client.endpoint.ballot == {2: "http://b:2"}
    assert client.base_url == "http://b:2" and client.ps_url == "http://a:1,http://b:2"
    client.endpoint.call_json("GET", "/v1/again")
    assert seen[-1] == ("b", "/v1/again", "2")  # the newest term, sent along
    assert lost[0] == "1"  # B is told that A just lost the worker's connection (a standby asks for votes sooner)
    # B's 503 standby right after A was lost keeps the worker at B (a vanished host's connect would hang seconds)
    assert [s[0] for s in seen[:4]] == ["a", "b", "b", "b"], seen


def test_terms_fence_an_old_primary_and_a_standby_checks_its_primarys_messages():
    """Sans-IO: what a pair's PS answers by term (the route layer maps these refusals to 503 / 409)."""
    from ps_service.settings import PSSettings
    from ps_service.standby import Pair
    core = ParameterServerCore(core_config())
    pair = Pair(PSSettings(role="primary", peer_url="http://peer:8000"), core)
    pair.role, pair.term = "primary", 3
    assert pair.refusal(3) is None and pair.refusal(None) is None and pair.refusal(2) is None
    assert pair.refusal(4).code == "fenced" and pair.refusal(4).status == 503  # a worker saw a newer term
    with pytest.raises(ProtocolError) as err:
        pair.from_primary(3, 1, 0.0)  # another PS claiming this PS's own term as primary
    assert err.value.code == "stale_term"
    pair.role, pair.applied = "standby", 5
    assert pair.refusal(9).code == "standby"  # a standby never serves, whatever the term
    for term, seq, code in ((2, 6, "stale_term"), (4, 6, "ha_gap"), (3, 7, "ha_gap")):
        with pytest.raises(ProtocolError) as err:
            pair.from_primary(term, seq, 1.0)
        assert (err.value.status, err.value.code) == (409, code), (term, seq)
    pair.from_primary(3, 6, 2.0)  # the next message of its term: taken, the primary heard from
    assert pair.heard == 2.0


def fed_pair(optimizer: str, workers: int, log_dir: str | None = None):
    """A primary core whose steps are encoded as the primary's link would (``sent``), its workers' ids, and a standby
    ``Pair`` (over a core of its own, with a stand-in runtime) that took the primary's state at message 0 of term 1
    (and made its same-host log in ``log_dir``, if given)."""

    from ps_service.settings import PSSettings
    from ps_service.standby import Pair
    settings = {"min_workers": workers, "startup_grace_seconds": 0.0}
    primary = ParameterServerCore(core_config(**settings))
    sent: list[bytes] = []
    primary.replica = SimpleNamespace(on_step=lambda total, mean_of, n: sent.append(bytes(messages.encode_step(
        primary.global_step, total, mean_of, n, {"members": primary.members.export()}))))
    primary.init_model(ModelInit({k: v.copy() for k, v in W.items()}, {"name": optimizer, "learning_rate": 0.1}), 0.0)
    ids = [primary.register(f"w{i}", 0.0)[0].worker_id for i in range(workers)]
    pair = Pair(PSSettings(role="standby", peer_url="http://peer:8000"), ParameterServerCore(core_config(**settings)))
    pair.rt = SimpleNamespace(now=lambda: 9.0, notify=lambda: None, abort_waits=lambda: None)
    pair.reader.log_dir = log_dir
    pair.adopt(1, 0, messages.decode_state(messages.encode_state(primary.export_state())), 0, 0.0)
    return primary, ids, sent, pair


def test_a_standby_acknowledges_a_step_before_it_applies_it_and_applies_it_before_anything_reads_its_model():
    """Sans-IO: ``Pair.apply``'s answer (the acknowledgement) counts the message while its optimizer step is pending;
    the step is applied by ``settle`` (the route's, once the answer went out) or first thing by the next message, a
    digest or a takeover, so the standby's bits are the primary's at each of those; a repeat is not applied again; a
    message that does not fit the model is refused (409 ``ha_gap``: the state again) and changes nothing."""
    primary, ids, sent, pair = fed_pair("adam", 2)
    core = pair.core
    states = [state_bytes(primary)]
    for step in range(4):
        for rank, wid in enumerate(ids):
            primary.push(PushRequest(wid, primary.global_step, grads(step, rank, False)), 1.0)
        states.append(state_bytes(primary))
    assert len(sent) == 4 and primary.global_step == 4

    answer = pair.apply(1, 1, True, bytearray(sent[0]), 1.0)
    assert (answer["applied"], answer["step"], answer["synced"]) == (1, 1, True)
    assert state_bytes(core) == states[0] and pair.pending is not None  # acknowledged, not applied yet
    pair.settle()
    assert state_bytes(core) == states[1] and pair.pending is None
    assert pair.apply(1, 1, True, bytearray(sent[0]), 1.1)["applied"] == 1 and state_bytes(core) == states[1]
    pair.apply(1, 2, True, bytearray(sent[1]), 1.2)
    pair.apply(1, 3, True, bytearray(sent[2]), 1.3)  # message 2's step first, then 3's pending
    assert state_bytes(core) == states[2] and pair.answer()["step"] == 3
    wrong = {"b": np.zeros(3, np.float32), "w": np.zeros((3, 4), np.float32)}  # w is (4, 3)
    bad = bytearray(messages.encode_step(3, wrong, 2, 2, {}))
    with pytest.raises(ProtocolError) as err:
        pair.apply(1, 4, True, bad, 1.4)
    assert err.value.code == "ha_gap" and pair.applied == 3 and state_bytes(core) == states[3]  # (3's step applied)
    assert pair.digest() is not None and pair.costs["messages"] == 3 and pair.costs["apply_s"] > 0
    pair.apply(1, 4, True, bytearray(sent[3]), 1.5)
    assert state_bytes(core) == states[3]
    # the primary is gone: the standby takes over with every step it acknowledged applied first
    pair.watch(10.0)
    assert pair.role == "candidate"
    pair.vote(2, "w0"), pair.vote(2, "w1")
    assert (pair.role, pair.term) == ("primary", 2) and state_bytes(core) == states[4]


def test_a_step_that_fails_to_apply_after_its_acknowledgement_leaves_the_standby_unable_to_take_over():
    """Should the pending step not apply (it cannot, for a message that fits the model), the standby no longer holds
    what it acknowledged: not ``synced`` (no takeover), no message taken (the primary's next message: 409 ``ha_gap``,
    the state again)."""
    primary, (wid,), sent, pair = fed_pair("sgd", 1)
    for step in range(2):
        primary.push(PushRequest(wid, primary.global_step, grads(step, 0, False)), 1.0)
    assert pair.apply(1, 1, True, bytearray(sent[0]), 1.0)["applied"] == 1 and pair.synced

    def broken(*args):
        raise MemoryError("no memory for the step")
    pair.core.apply_round = broken
    pair.settle()
    assert (pair.applied, pair.synced, pair.pending) == (0, False, None)
    pair.watch(10.0)
    assert pair.role == "standby"  # not synced: it never becomes a candidate
    with pytest.raises(ProtocolError) as err:
        pair.apply(1, 2, True, bytearray(sent[1]), 11.0)
    assert err.value.code == "ha_gap"


def malformed_steps(step: int, total: dict) -> dict[str, bytes]:
    """Step messages of ``step`` whose tensors fit the model but whose meta or sparse layout lies."""
    members = [{"worker_id": "a", "name": "w0", "rank": 0, "state": "active"}]
    k = next(iter(total))
    idx, values = np.array([0, 1], np.int64), np.ones(1, np.float32)
    rest = {n: v for n, v in total.items() if n != k}
    sparse_meta = {"step": step, "total": True, "mean_of": 1, "contributors": 1, "sparse": {k: list(total[k].shape)}}

    def sparse(i, v, meta=sparse_meta):
        return bytes(frame.encode_bytes({f"{k}#indices": i, f"{k}#values": v, **rest}, meta))
    return {
        "contributors -1": bytes(messages.encode_step(step, total, 1, -1, {})),
        "total a string": bytes(frame.encode_bytes(total, {"step": step, "total": "yes", "mean_of": 1,
                                                             "contributors": 1})),
        "members a string": bytes(messages.encode_step(step, total, 1, 1, {"members": "x"})),
        "a member without its rank": bytes(messages.encode_step(step, total, 1, 1, {"members": [
            {k: v for k, v in members[0].items() if k != "rank"}]})),
        "staleness malformed": bytes(messages.encode_step(step, total, 1, 1, {"staleness": {"floor": "x"}})),
        "an unknown field": bytes(messages.encode_step(step, total, 1, 1, {"members": members, "zz": 1})),
        "sparse values fewer than indices": sparse(idx, values),
        "sparse indices of floats": sparse(idx.astype(np.float64), np.ones(2, np.float32)),
        "sparse indices 2-D": sparse(idx.reshape(1, 2), np.ones(2, np.float32)),
        "sparse shape not a list of ints": sparse(idx, np.ones(2, np.float32), {**sparse_meta, "sparse": {k: "3"}}),
    }


def test_a_step_message_whose_meta_or_sparse_layout_lies_is_refused_before_its_acknowledgement():
    """docs/protocol-standby.md: a step message's meta is of the form given (``total`` a bool, ``contributors`` >= 0,
    ``members`` as in the state, ``staleness`` as there, no other field) and a sparse tensor's indices and values are
    1-D, integer and float32, of one length; else 400 ``bad_field`` before anything changes. Such messages were
    acknowledged: a sparse one then failed to apply (the standby no longer synced), the others set a roster or clocks
    a takeover could not read."""
    primary, (wid,), sent, pair = fed_pair("sgd", 1)
    primary.push(PushRequest(wid, primary.global_step, grads(0, 0, False)), 1.0)
    before = state_bytes(pair.core)
    for case, body in malformed_steps(0, {k: np.ones(v.shape, np.float32) for k, v in W.items()}).items():
        with pytest.raises(ProtocolError) as err:
            pair.apply(1, 1, True, bytearray(body), 1.0)
        assert (err.value.status, err.value.code) == (400, "bad_field"), case
        pair.settle()
        assert (pair.applied, pair.synced, pair.pending) == (0, True, None), case
        assert state_bytes(pair.core) == before and pair.members == primary.members.export(), case
    assert pair.apply(1, 1, True, bytearray(sent[0]), 1.0)["applied"] == 1  # the primary's own message is taken
    pair.settle()
    assert state_bytes(pair.core) == state_bytes(primary)


def test_a_standby_takes_over_with_every_record_committed_in_its_log_and_fences_the_old_primarys_next(tmp_path):
    """Sans-IO, the same-host log (ring.py): the standby made it with the state; records committed by the primary are
    applied in order as the standby reads behind; a takeover first applies every record committed (not a torn one),
    then the primary's next record is refused with the new term (it is deposed) and the file is gone."""
    from ps_service.standby import ring
    primary, ids, sent, pair = fed_pair("adam", 2, str(tmp_path))
    states = [state_bytes(primary)]
    for step in range(4):
        for rank, wid in enumerate(ids):
            primary.push(PushRequest(wid, primary.global_step, grads(step, rank, False)), 1.0)
        states.append(state_bytes(primary))
    advert = pair.answer()["log"]
    w = ring.LogWriter.open(str(tmp_path), advert)

    def record(seq: int, commit: bool = True) -> int:
        n = len(messages.copied([sent[seq - 1]], w.begin(seq)))
        return w.commit(seq, 1, True, n) if commit else 0
    assert record(1) == 0 and pair.reader.drain(1.0) == 1 and state_bytes(pair.core) == states[1] and w.applied == 1
    assert record(2) == 0 and record(3) == 0 and record(4, commit=False) == 0  # 4: the primary killed mid-record
    pair.watch(10.0)  # silence: a candidate (its records not read yet)
    pair.vote(2, "w0"), pair.vote(2, "w1")
    assert (pair.role, pair.term, pair.applied) == ("primary", 2, 3) and state_bytes(pair.core) == states[3]
    assert pair.costs["logged"] == 3 and pair.reader.log is None and not (tmp_path / advert["name"]).exists()
    assert w.commit(4, 1, True, 100) == 2  # the old primary's record after the takeover: refused, with term 2


def logged_pair(tmp_path, steps: int):
    """:func:`fed_pair` with its log, ``steps`` rounds of the primary (``states``: its bits after each) and a writer of
    the log (``record(seq)``: message ``seq`` committed by the primary of term 1; 0 if it counts)."""
    from ps_service.standby import ring
    primary, ids, sent, pair = fed_pair("adam", 2, str(tmp_path))
    states = [state_bytes(primary)]
    for step in range(steps):
        for rank, wid in enumerate(ids):
            primary.push(PushRequest(wid, primary.global_step, grads(step, rank, False)), 1.0)
        states.append(state_bytes(primary))
    w = ring.LogWriter.open(str(tmp_path), pair.answer()["log"])

    def record(seq: int) -> int:
        return w.commit(seq, 1, True, len(messages.copied([sent[seq - 1]], w.begin(seq))))
    return pair, sent, states, w, record


def test_a_full_ring_sends_the_next_message_over_http_after_the_records_before_it(tmp_path):
    """A reader that lags by every slot: the primary's writer does not wait for room, it sends the message over HTTP
    (ps_service/standby/link.py); the standby's route takes the records committed first (``drain``), then the
    message: in order, the primary's bits."""
    from ps_service.standby.link import Link
    pair, sent, states, w, record = logged_pair(tmp_path, 6)
    for seq in range(1, w.slots + 1):
        assert record(seq) == 0
    nxt = w.slots + 1
    assert not w.room(nxt)
    link = Link(pair)  # (the standby's pair stands in for the primary's: the writer reads its epoch, feeding, log)
    link.log, pair.feeding = w, True
    try:
        assert link._into_log(pair.epoch, nxt, [sent[nxt - 1]]) is None  # over HTTP
        assert pair.reader.drain(2.0) == w.slots  # POST /v1/ha/steps: the records before it, then the message
        pair.apply(1, nxt, True, bytearray(sent[nxt - 1]), 2.0)
        pair.settle()
        assert pair.applied == nxt and state_bytes(pair.core) == states[nxt] and w.room(nxt + 1)
        assert link._into_log(pair.epoch, nxt + 1, [sent[nxt]]) == 200  # room again: the next one in the log
    finally:
        import asyncio
        link.conn.close()
        asyncio.run(link.client.aclose())
        pair.feeding = False


# ---- the term kept on disk (PS_CHECKPOINT_DIR): a primary that restarts while its peer does not answer --------------
def restarted_primary(tmp_path, monkeypatch, kept_term: int | None, peer: dict | None = None, workers: int = 3):
    """A PS configured ``primary`` started (``Pair.start``) with its peer answering ``peer`` (None: not at all), its
    checkpoint directory holding term ``kept_term`` (None: no directory) and a core restored from a state with
    ``workers`` members (back as expired, as from a checkpoint); no network (the link stubbed, its peer look too)."""
    import asyncio

    import ps_service.standby as standby
    from ps_service.settings import PSSettings
    from ps_service.standby.kept import KeptTerm

    class NoLink:
        def __init__(self, pair) -> None:
            pass

        def start(self) -> None:
            pass

        def log_behind(self):
            return None, 0

        async def peer(self, timeout=None):
            return peer

    monkeypatch.setattr(standby, "Link", NoLink)
    settings = {"min_workers": max(workers, 1), "startup_grace_seconds": 0.0}
    old = ParameterServerCore(core_config(**settings))
    old.init_model(ModelInit({k: v.copy() for k, v in W.items()}, {"name": "sgd", "learning_rate": 0.1}), 0.0)
    for i in range(workers):
        old.register(f"w{i}", 0.0)
    core = ParameterServerCore(core_config(**settings))
    core.adopt(old.export_state(), 1.0)  # what the checkpoint's restore does: every member back as expired
    if kept_term is not None:
        KeptTerm(tmp_path).save(kept_term, "primary")
    ckpt = None if kept_term is None else str(tmp_path)
    pair = standby.Pair(PSSettings(role="primary", peer_url="http://peer:8000", checkpoint_dir=ckpt), core)
    asyncio.run(pair.start(SimpleNamespace(now=lambda: 5.0, notify=lambda: None, abort_waits=lambda: None)))
    return pair


def kept_on_disk(tmp_path) -> dict:
    import json

    from ps_service.standby.kept import NAME
    return json.loads((tmp_path / NAME).read_text())


def test_a_primary_of_term_3_restarted_alone_is_a_candidate_for_term_4_and_wins_only_with_the_votes(tmp_path,
                                                                                                 monkeypatch):
    """(1) Term 3 kept, the peer unreachable: not the primary of term 1 but a candidate for term 4, taking no push
    (503 ``election``), winning with more than half of its checkpoint's members (a stranger's vote does not count),
    then the primary of term 4 from its own state, the term on disk before it acts in it."""
    pair = restarted_primary(tmp_path, monkeypatch, 3)
    assert (pair.role, pair.term, pair.election.term, pair.election.incumbent) == ("candidate", 3, 4, False)
    assert pair.refusal().code == "election" and pair.refusal(3).code == "election"  # no push taken
    assert pair.status().election.model_dump() == {"term": 4, "votes": [], "needed": 2}
    assert pair.vote(3, "w0")["counted"] is False  # another term's vote
    assert pair.vote(4, "stranger")["counted"] is False and pair.vote(4, "w0")["counted"] and pair.role == "candidate"
    assert kept_on_disk(tmp_path)["term"] == 3  # nothing served in term 4 yet
    assert pair.vote(4, "w1")["role"] == "primary" and pair.term == 4 and pair.refusal() is None
    assert kept_on_disk(tmp_path) == {"term": 4, "role": "primary"}
    assert pair.core.global_step == 0 and not pair.restarted


def served_by(pair):
    """A worker transport's handler that answers as the pair's gate and vote route would (ps_service/standby/gate.py,
    routes.py): a training request refused unless this PS is the primary (``fenced`` deposes it), the term marked."""
    from worker_service.transport.mock import Answer

    def handle(req):
        term = str(pair.term)
        if req.path == "/v1/ha/vote":
            ans = Answer.of_json(pair.vote(req.json()["term"], req.json()["name"]))
        else:
            seen = req.headers.get("x-syncps-term")
            exc = pair.refusal(int(seen) if seen else None)
            if exc is not None and exc.code == "fenced":
                pair.deposed(exc.detail)
            ans = (Answer.of_json({"ok": True}) if exc is None
                   else Answer.of_json({"error": exc.code, "detail": exc.detail}, exc.status))
        ans.headers["x-syncps-term"] = term
        return ans
    return handle


def test_a_restarted_primary_whose_workers_voted_for_the_other_ps_never_becomes_primary(tmp_path, monkeypatch):
    """(2) Term 3 kept, the peer unreachable from it, but the workers' clients (worker_service.transport.endpoint)
    voted in term 4 for the other PS: w0 saw it serve term 4 (its requests fence this PS: it becomes a standby), w1
    voted for it and did not see it win yet (its ballot sends it back there), w2 never reached it and votes here:
    1 vote of 3, never the primary."""
    from shared.rawhttp import ConnectionLost
    from worker_service.client import PSClient
    from worker_service.transport.endpoint import ServerError
    from worker_service.transport.mock import Answer, MockTransport

    a, b = "http://a:1", "http://b:2"

    def other(name):  # the other PS: the primary of term 4 to w0, unreachable to the others
        def handle(req):
            if name != "w0":
                raise ConnectionLost("unreachable")
            ans = Answer.of_json({"ok": True})
            ans.headers["x-syncps-term"] = "4"
            return ans
        return handle

    for first in ("w2", "w1", "w0"), ("w0", "w1", "w2"):
        pair = restarted_primary(tmp_path, monkeypatch, 3)
        roles, asked = [], served_by(pair)
        for name in first:
            seen = []
            client = PSClient(f"{a},{b}", connection=MockTransport(lambda req: seen.append(req) or asked(req)),
                              attempts=2, retry_timeout=0.5)
            client.endpoint._transports[b] = MockTransport(other(name))
            ep = client.endpoint
            ep.voter = name
            if name != "w2":
                ep.ballot = {4: b}
                ep.term = 4 if name == "w0" else 3
            try:
                answer = client.endpoint.call_json("GET", "/v1/model")
                assert answer == {"ok": True} and name == "w0"  # from the other PS
            except (ProtocolError, ServerError, ConnectionLost):  # (w1: the PS it voted for does not answer; w2: this PS does not win)
                assert name != "w0"
            assert seen, name  # each asked this PS first
            roles.append(pair.role)
            # w0 and w1 voted for the other; w2 here, unless this PS is a standby by then (no vote asked)
            assert ep.ballot.get(4) == (b if name != "w2" else a if roles[-1] == "candidate" else None)
        assert "primary" not in roles and pair.term == 3, (first, roles)
        # a candidate with w2's vote alone until w0 asks, which fences it: a standby (of term 3) waiting for a state
        assert roles == (["candidate", "candidate", "standby"] if first[0] == "w2" else ["standby"] * 3), roles
        assert kept_on_disk(tmp_path)["term"] == 3


def test_without_a_checkpoint_directory_a_primary_starts_as_before(tmp_path, monkeypatch):
    """(3) No directory: nothing kept; the peer unreachable: the primary of term 1 (as before this file existed)."""
    pair = restarted_primary(tmp_path, monkeypatch, None)
    assert (pair.role, pair.term, pair.kept) == ("primary", 1, None) and not list(tmp_path.iterdir())


def test_a_restarted_primary_with_a_term_kept_follows_its_peer_when_it_answers(tmp_path, monkeypatch):
    """A peer that answers: as before, it serves a term (its standby), or it has none (both restarted): the primary of
    the term after the one kept (a worker that saw it is not sent away, 503 ``fenced``). No roster (no member in its
    checkpoint): a candidate that cannot win, until its peer answers without a term."""
    pair = restarted_primary(tmp_path, monkeypatch, 3, peer={"role": "primary", "term": 4})
    assert (pair.role, pair.term) == ("standby", 0) and kept_on_disk(tmp_path) == {"term": 3, "role": "standby"}
    pair = restarted_primary(tmp_path, monkeypatch, 3, peer={"role": "standby", "term": 0})
    assert (pair.role, pair.term) == ("primary", 4) and pair.refusal(3) is None and pair.refusal(4) is None
    lone = restarted_primary(tmp_path, monkeypatch, 4, workers=0)
    assert lone.role == "candidate" and not lone.election.won and lone.status().election.needed == 1
    lone.peer_answers({"role": "primary", "term": 5})  # its state will come
    assert lone.role == "candidate"
    lone.peer_answers({"role": "standby", "term": 0})
    assert (lone.role, lone.term) == ("primary", 5) and kept_on_disk(tmp_path) == {"term": 5, "role": "primary"}


def test_a_votes_term_is_a_json_integer():
    """protocol.md, Errors: a JSON body that does not fit the route's schema is 400 ``bad_request``; pydantic's lax
    int took ``true`` as term 1 and ``"2"`` as term 2."""
    from ps_service.http import parse_json
    from ps_service.standby.routes import Vote
    for body in (b'{"term": true, "name": "w0"}', b'{"term": "2", "name": "w0"}'):
        with pytest.raises(ProtocolError) as refused:
            parse_json(body, Vote)
        assert (refused.value.status, refused.value.code) == (400, "bad_request")
    assert parse_json(b'{"term": 2, "name": "w0"}', Vote).term == 2
