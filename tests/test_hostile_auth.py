"""The form of the ``Authorization`` header (RFC 6750 section 2.1, RFC 9110 section 11), as a client written from
docs/protocol.md sends it: ``Bearer`` in any case, one or more spaces, a token without spaces; one such field. On a
real PS (uvicorn on loopback), through FastAPI's routes and through the hot path alike; a refusal changes nothing."""
from __future__ import annotations

import httpx
import numpy as np
import pytest
from pydantic import ValidationError

from ps_service.settings import PSSettings
from shared.tokens import presented_token
from tests.live_ps import live_ps, state_hash
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
    with httpx.Client(base_url=ps.url, timeout=10.0) as h:
        r = h.request("POST" if route == "heartbeat" else "GET", path,
                      headers=[("Authorization", v) for v in values])
    if want == TOKEN:
        assert r.status_code == 200, r.text
        return
    assert (r.status_code, r.json()["error"]) == (401, "unauthorized"), r.text
    assert r.headers["www-authenticate"] == CHALLENGE[want]
    assert ps.rt.auth_failures == failures + 1 and state_hash(ps.rt) == before
