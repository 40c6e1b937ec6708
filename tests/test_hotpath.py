"""The fast lane (ps_service/hotpath.py) serves well-formed per-step calls itself and hands everything
else to FastAPI, so answers are the same either way."""
from __future__ import annotations

import inspect

import numpy as np
import pytest

from ps_service import hotpath
from tests.live_ps import live_ps
from tests.wire import FRAME, push_frame

W0 = {"w": np.arange(4, dtype=np.float32)}


def test_defaults_are_the_routes_defaults():
    for endpoint, parsers, defaults in hotpath.ROUTES.values():
        declared = {k: getattr(p.default, "default", p.default)  # Query(default) or Annotated[..., Query()] = default
                    for k, p in inspect.signature(endpoint).parameters.items() if k != "request"}
        assert declared == defaults and parsers.keys() == declared.keys()


@pytest.fixture
def served(monkeypatch):
    """Counts the calls the fast lane made (path -> n)."""
    counts: dict[str, int] = {}
    for key, (endpoint, parsers, defaults) in list(hotpath.ROUTES.items()):
        async def counted(*a, _e=endpoint, _p=key[1], **kw):
            counts[_p] = counts.get(_p, 0) + 1
            return await _e(*a, **kw)
        monkeypatch.setitem(hotpath.ROUTES, key, (counted, parsers, defaults))
    return counts


@pytest.mark.parametrize("query,fast,status,code", [
    ("", True, 200, None),
    ("?pull=0&timeout=0", True, 200, None),
    ("?pull=no&timeout=0", False, 200, None),  # FastAPI's bool also takes yes/no/on/off: handed over
    ("?timeout=-1", False, 400, "bad_request"),
    ("?timeout=5_0", False, 200, None),  # pydantic reads 50 here: handed over, FastAPI decides
    ("?timeout=nan", False, 400, "bad_request"),
    ("?pull=1&pull=0", False, 200, None),  # a repeated parameter: FastAPI decides
    ("?other=1", False, 200, None),
])
def test_push_query_strings(query, fast, status, code, served):
    with live_ps(min_workers=1, startup_grace_seconds=0) as ps:
        c = ps.client()
        wid = c.register("a")["worker_id"]
        assert c.init_model(W0, {"name": "sgd", "learning_rate": 0.5})
        with ps.http() as h:
            served.clear()
            resp = h.post(f"/v1/gradients{query}", content=push_frame(wid, 0, {"w": np.ones(4, np.float32)}),
                          headers={"content-type": FRAME})
            assert resp.status_code == status, resp.text
            assert resp.json().get("error") == code
            assert served.get("/v1/gradients", 0) == (1 if fast else 0)
        c.close()


def test_pull_and_errors_match_fastapi(served):
    with live_ps(min_workers=1, startup_grace_seconds=0, auth_token="s3cret") as ps:
        with ps.http() as anon, ps.http("s3cret") as h:
            # no token: FastAPI answers 401 and counts it
            resp = anon.get("/v1/model", params={"timeout": 0})
            assert (resp.status_code, resp.json()["error"]) == (401, "unauthorized")
            assert ps.rt.auth_failures == 1 and not served
            # a ProtocolError raised by the endpoint on the fast lane: the app's JSON error body
            resp = h.get("/v1/model", params={"timeout": 0})
            assert (resp.status_code, resp.json()) == (409, {
                "error": "not_initialized", "detail": "the model is not initialised yet (PUT /v1/model)"})
            assert served == {"/v1/model": 1}
            resp = h.get("/v1/model", params={"min_step": "-1"})
            assert (resp.status_code, resp.json()["error"]) == (400, "bad_request") and served == {"/v1/model": 1}
            long_id = "x" * 65
            resp = h.get("/v1/model", params={"worker_id": long_id, "timeout": 0})
            assert (resp.status_code, resp.json()["error"]) == (400, "bad_request") and served == {"/v1/model": 1}


@pytest.mark.parametrize("query", ["", "pull=1", "pull=1&timeout=30&since=5", "a=", "=b", "a=b=c", "a", "a=1&&b=2",
                                   "a=1&", "&a=1", "x=%41", "x=a+b", "timeout=1e3&pull=true", "a=1;b=2", "a=1&a=2"])
def test_the_fast_query_split_is_parse_qsl(query):
    from urllib.parse import parse_qsl

    from ps_service.hotpath import _pairs

    def outcome(fn):
        try:
            return fn(query)
        except ValueError:
            return "ValueError"
    assert outcome(_pairs) == outcome(lambda q: parse_qsl(q, keep_blank_values=True, strict_parsing=bool(q)))
