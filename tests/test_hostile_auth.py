"""The form of the ``Authorization`` header (RFC 6750 section 2.1, RFC 9110 section 11), as a client written from
docs/protocol.md sends it: ``Bearer`` in any case, one or more spaces, a token without spaces; one such field. On a
real PS (uvicorn on loopback), through FastAPI's routes and through the hot path alike; a refusal changes nothing."""
from __future__ import annotations

import httpx
import numpy as np
import pytest
from pydantic import ValidationError

from cluster.processes import free_port, wait_for
from ps_service.settings import PSSettings
from ps_service.standby import messages
from shared import frame, shards
from shared.protocol import MAX_INT
from shared.tokens import presented_token
from tests.live_ps import live_ps, state_hash
from tests.test_shards import W0, post_frame, two_shards
from tests.timing import allow
from worker_service.settings import WorkerSettings

TOKEN = "train-3f9c1e7a5b2d4c6e8f0a1b3c5d7e9f11"
NO_TOKEN, MALFORMED = "", None

FORMS = {  # Authorization field values -> presented_token's answer
    "one space": ([f"Bearer {TOKEN}"], TOKEN),
    "spaces": ([f"Bearer   {TOKEN}"], TOKEN),  # "Bearer" 1*SP b64token
    "lower-case scheme": ([f"bearer {TOKEN}"], TOKEN),
    "upper-case scheme": ([f"BEARER {TOKEN}"], TOKEN),
    "surrounding whitespace": ([f" \tBearer {TOKEN} \t"], TOKEN),  # a field value's OWS is not part of it
    "no field": ([], NO_TOKEN),
    "scheme alone": (["Bearer"], NO_TOKEN),
    "scheme and spaces": (["Bearer   "], NO_TOKEN),
    "another scheme": (["Basic dXNlcjpwdw=="], NO_TOKEN),
    "a tab after the scheme": ([f"Bearer\t{TOKEN}"], NO_TOKEN),  # 1*SP: no scheme "Bearer" then
    "a tab before the token": ([f"Bearer \t{TOKEN}"], MALFORMED),
    "a space in the token": ([f"Bearer {TOKEN} x"], MALFORMED),
    "two fields": ([f"Bearer {TOKEN}", f"Bearer {TOKEN}"], MALFORMED),
    "two fields, the right one second": (["Bearer wrong", f"Bearer {TOKEN}"], MALFORMED),
}


@pytest.mark.parametrize("case", sorted(FORMS))
def test_the_token_a_request_presents(case):
    values, want = FORMS[case]
    assert presented_token(values) == want


@pytest.mark.parametrize("token", ["a b", "tab\there", "caf\u00e9", " lead"])
def test_a_token_that_cannot_travel_as_a_bearer_token_is_refused_at_start(token):
    with pytest.raises(ValidationError, match="visible ASCII"):
        PSSettings(auth_token=token)
    with pytest.raises(ValidationError, match="visible ASCII"):
        WorkerSettings(auth_token=token)


@pytest.fixture(scope="module")
def ps():
    with live_ps(auth_token=TOKEN, lease_seconds=600, startup_grace_seconds=0) as ps:
        c = ps.client(TOKEN)
        ps.wid = c.register("a")["worker_id"]
        assert c.init_model({"w": np.zeros(3, np.float32)})
        yield ps
        c.close()


CHALLENGE = {NO_TOKEN: 'Bearer realm="syncps"', MALFORMED: 'Bearer realm="syncps", error="invalid_request"'}


SENDABLE = sorted(c for c, (values, _) in FORMS.items() if all(v == v.strip(" \t") for v in values))  # (httpx's rule)


@pytest.mark.parametrize("route", ["heartbeat", "pull (hot path)"])
@pytest.mark.parametrize("case", SENDABLE)
def test_each_form_on_a_live_ps(ps, case, route):
    values, want = FORMS[case]
    path = f"/v1/workers/{ps.wid}/heartbeat" if route == "heartbeat" else "/v1/model?timeout=0"
    before, failures = state_hash(ps.rt), ps.rt.auth_failures
    with httpx.Client(base_url=ps.url, timeout=allow(10.0)) as h:
        r = h.request("POST" if route == "heartbeat" else "GET", path,
                      headers=[("Authorization", v) for v in values])
    if want == TOKEN:
        assert r.status_code == 200, r.text
        return
    assert (r.status_code, r.json()["error"]) == (401, "unauthorized"), r.text
    assert r.headers["www-authenticate"] == CHALLENGE[want]
    assert ps.rt.auth_failures == failures + 1 and state_hash(ps.rt) == before


def test_a_request_without_the_training_token_cannot_fence_a_primary():
    """A hot-standby pair's headers (``x-syncps-term``, ``x-syncps-peer-lost``) count only on a request that holds the
    training token: without it the route answers 401 and the primary stays the primary (it was deposed: 503
    ``fenced``, the pair left with no primary)."""
    with live_ps(auth_token=TOKEN, role="primary", peer_url=f"http://127.0.0.1:{free_port()}") as ps:
        pair = ps.rt.ha
        wait_for(lambda: pair.role == "primary", allow(10), "the primary of term 1 (its peer does not answer)")
        term, hostile = pair.term, {"x-syncps-term": str(pair.term + 5), "x-syncps-peer-lost": "1"}
        with httpx.Client(base_url=ps.url, timeout=allow(10.0)) as h:
            for auth in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {TOKEN}, Bearer x"}):
                r = h.post("/v1/workers", json={"name": "x"}, headers={**hostile, **auth})
                assert (r.status_code, r.json()["error"]) == (401, "unauthorized"), r.text
                assert (pair.role, pair.term) == ("primary", term)
            r = h.post("/v1/workers", json={"name": "x"}, headers={**hostile, "Authorization": f"Bearer {TOKEN}"})
            assert (r.status_code, r.json()["error"]) == (503, "fenced")  # a worker's newer term: as documented


MALFORMED_TERMS = {"letters": ["abc"], "negative": ["-1"], "fraction": ["1.5"], "empty": [""], "hex": ["0x10"],
                   "past 2^53 - 1": [str(MAX_INT + 1)], "41 digits": ["1" + "0" * 40], "twice": ["1", "1"]}


def test_a_malformed_term_is_refused_by_a_ps_of_a_pair_and_not_read_by_a_lone_one():
    """docs/protocol-standby.md: on a PS of a pair, a training request (with the token) whose ``x-syncps-term`` is not
    one decimal integer in [0, 2^53 - 1] given once is 400 ``bad_request`` and changes nothing (it was read as no
    term: served); a lone PS reads no pair header."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with live_ps(auth_token=TOKEN, role="primary", peer_url=f"http://127.0.0.1:{free_port()}") as ps:
        pair = ps.rt.ha
        wait_for(lambda: pair.role == "primary", allow(10), "the primary of term 1 (its peer does not answer)")
        with httpx.Client(base_url=ps.url, timeout=allow(10.0)) as h:
            for case, terms in MALFORMED_TERMS.items():
                before = state_hash(ps.rt)
                headers = [("x-syncps-peer-lost", "1"), *(("x-syncps-term", t) for t in terms), *auth.items()]
                r = h.post("/v1/workers", json={"name": "x"}, headers=headers)
                assert (r.status_code, r.json()["error"]) == (400, "bad_request"), (case, r.text)
                assert r.headers["x-syncps-term"] == str(pair.term) and "x-syncps-term" in r.json()["detail"]
                assert (pair.role, pair.term) == ("primary", 1) and state_hash(ps.rt) == before
            r = h.post("/v1/workers", json={"name": "x"}, headers={"x-syncps-term": str(MAX_INT), **auth})
            assert (r.status_code, r.json()["error"]) == (503, "fenced")  # the largest term is one
    with live_ps(auth_token=TOKEN) as ps, httpx.Client(base_url=ps.url, timeout=allow(10.0)) as h:
        for case, terms in MALFORMED_TERMS.items():
            r = h.post("/v1/workers", json={"name": case}, headers=[*(("x-syncps-term", t) for t in terms),
                                                                     *auth.items()])
            assert r.status_code == 200, (case, r.text)


def test_with_a_peer_token_a_workers_token_cannot_make_a_follower_apply_a_round():
    """PS_PEER_TOKEN (docs/protocol-shards.md): a sharded PS's routes from the coordinator to a follower take it and
    only it. A worker's training token there is 401 and changes nothing (without a peer token it made a follower apply
    its own pieces as a whole round, a step ahead of the coordinator); the job runs on, the coordinator's links
    carrying the peer token, and the peer token opens no worker route."""
    peer, grads = "peer-9d7c5b3a1f2e4d6c8b0a9f7e5d3c1b2a", {"w": np.ones((3, 1)), "b": np.ones(1)}
    with two_shards(auth_token=TOKEN, peer_token=peer) as (c, f), c.http(TOKEN) as hc, f.http(TOKEN) as hf:
        ids = [hc.post("/v1/workers", json={"name": f"w{i}"}).json()["worker_id"] for i in range(2)]
        body = b"".join(bytes(p) for p in frame.encode(W0, {"optimizer": {"name": "sgd", "learning_rate": 0.5}}))
        assert hc.put("/v1/model", content=body, headers={"content-type": frame.MEDIA_TYPE}).status_code == 201
        m = shards.from_wire(hc.get("/v1/shards").json()["map"])
        wait_for(lambda: c.rt.core.round is not None and f.rt.core.initialized, allow(10),
                 "round 0 and the follower's model")
        before = state_hash(f.rt)
        for method, path, msg in [("POST", "apply", {"step": 0, "contributors": [], "mean_of": 1}),
                                  ("POST", "progress", {"step": 0, "start": 0, "folded": [], "turns": None}),
                                  ("POST", "lost", {"step": 0, "workers": ids}),
                                  ("POST", "restore", {"step": 0, "receipt_key": "0" * 64}),
                                  ("PUT", "model", {})]:
            r = hf.request(method, f"/v1/shard/{path}", json=msg)
            assert (r.status_code, r.json()["error"]) == (401, "unauthorized"), (path, r.text)
        assert state_hash(f.rt) == before and f.rt.core.global_step == 0
        assert hf.get("/v1/shard/state").status_code == 200  # either token
        with f.http(peer) as as_peer:
            assert as_peer.get("/v1/shard/state").status_code == 200
            assert as_peer.post("/v1/workers", json={"name": "x"}).status_code == 401
        for w in ids:  # what a worker does: hold on both shards, commit with the follower's receipt
            pieces = [shards.split(grads, m.pieces[i]) for i in range(2)]
            held = [post_frame(h, "/v1/shard/gradients", pieces[i], {"worker_id": w, "step": 0}, map=m.digest)
                    for i, h in enumerate((hc, hf))]
            assert all(r.status_code == 200 for r in held), [r.text for r in held]
            r = post_frame(hc, "/v1/shard/commit", {}, {"worker_id": w, "step": 0,
                                                        "receipts": [held[1].json()["receipt"]]})
            assert r.status_code == 200, r.text
        wait_for(lambda: f.rt.core.global_step == 1, allow(10),
                 "the follower to apply round 0 (the peer token's links)")


def test_with_a_peer_token_a_workers_token_cannot_feed_a_standby():
    """PS_PEER_TOKEN (docs/protocol-standby.md): a pair's routes from the primary to its standby take it and only it. A
    worker's training token there is 401 and changes nothing (without a peer token a forged step made the standby's
    bits differ from the primary's, and it would have taken over with them); ``GET /v1/ha`` takes either, its log's
    advert only the peer's; the pair replicates on the peer token, bit for bit, and the standby takes over."""
    peer, pp, sp = "peer-9d7c5b3a1f2e4d6c8b0a9f7e5d3c1b2a", free_port(), free_port()
    pair_of = {"auth_token": TOKEN, "peer_token": peer, "failover_timeout_seconds": 2.0, "min_workers": 2,
               "startup_grace_seconds": 0.0}
    grads = {"w": np.ones((3, 1), np.float32), "b": np.ones(1, np.float32)}
    with live_ps(sp, role="standby", peer_url=f"http://127.0.0.1:{pp}", **pair_of) as s, s.http(TOKEN) as hs:
        with live_ps(pp, role="primary", peer_url=f"http://127.0.0.1:{sp}", **pair_of) as p:
            wait_for(lambda: p.rt.ha.role == "primary", allow(30), "the primary of term 1")
            c = p.client(TOKEN)
            ids = [c.register(f"w{i}")["worker_id"] for i in range(2)]
            assert c.init_model({k: np.zeros_like(v) for k, v in grads.items()}, {"name": "sgd", "learning_rate": 0.5})
            wait_for(lambda: s.rt.core.initialized and p.rt.ha.gated, allow(30), "the standby to take the state")
            before, info = (state_hash(s.rt), s.rt.ha.digest()), s.rt.ha.answer()
            forged = bytes(messages.encode_step(info["step"], {k: 100 * v for k, v in grads.items()}, 1, 1,
                                                {"members": p.rt.core.members.export()}))
            at = {"term": info["term"], "seq": info["applied"] + 1, "gated": 1}
            for method, path, body in [("POST", "steps", forged), ("POST", "ping", None),
                                       ("PUT", "state", messages.encode_state(s.rt.core.export_state()))]:
                r = hs.request(method, f"/v1/ha/{path}", params=at, content=body,
                               headers={"content-type": frame.MEDIA_TYPE})
                assert (r.status_code, r.json()["error"]) == (401, "unauthorized"), (path, r.text)
            assert (state_hash(s.rt), s.rt.ha.digest()) == before and s.rt.ha.answer()["applied"] == info["applied"]
            seen = hs.get("/v1/ha")
            assert seen.status_code == 200 and seen.json()["log"] is None  # either token; the advert: the peer's
            with s.http(peer) as as_peer:
                assert as_peer.get("/v1/ha").json()["log"] == s.rt.ha.answer()["log"]
                assert as_peer.post("/v1/workers", json={"name": "x"}).status_code == 401
            wait_for(lambda: p.rt.core.round is not None, allow(10), "round 0")
            for w in ids:
                c.push(w, 0, grads)
            wait_for(lambda: s.rt.ha.answer()["step"] == 1 and p.rt.core.global_step == 1, allow(30), "step 1 on both")
            held = p.rt.ha.digest()
            assert s.rt.ha.digest() == held != before[1]
            c.close()
        term = s.rt.ha.term  # the primary is gone: the workers vote, and the standby serves with the primary's bits
        wait_for(lambda: s.rt.ha.role == "candidate", allow(30), "the standby to ask for votes")
        for i in range(2):
            assert hs.post("/v1/ha/vote", json={"term": term + 1, "name": f"w{i}"}).status_code == 200
        wait_for(lambda: s.rt.ha.role == "primary", allow(30), "the standby to take over")
        assert s.rt.ha.digest() == held and np.array_equal(s.rt.core.weights["w"], np.full((3, 1), -0.5))
