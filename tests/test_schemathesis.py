"""schemathesis against the PS's own OpenAPI schema, on a real uvicorn server: zero 5xx.

The PS is mid-training (model initialised, a worker registered, round 0 open) so generated requests
reach deep paths, not just "not initialised". The schema declares the push and init bodies as binary
frames (``application/x-syncps-frame``); their bodies come from a strategy registered for that media
type: frames of the model's tensors or others (any values, dtypes, shapes), under push or init metas
naming the live worker or not, sometimes cut short or with bytes to spare. Examples are bounded
(MAX_EXAMPLES per operation, positive and negative generation) to keep the run short.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from ps_service.app import create_app
from ps_service.settings import PSSettings
from shared import frame
from tests.live_ps import live_ps
from tests.strategies import gradients, push_metas, values
from tests.timing import allow
from tests.wire import FRAME

MAX_EXAMPLES = 25
STATUSES: Counter = Counter()  # status codes seen, reported at the end
MODEL = {"w": np.zeros((3, 2), np.float32), "b": np.zeros(2, np.float32)}
LIVE: dict[str, str] = {}  # the worker the fixture registered (drawn into push metas)


@st.composite
def frame_bodies(draw) -> bytes:
    live = st.builds(lambda: LIVE.get("worker_id", ""))
    honest_push = st.fixed_dictionaries({"worker_id": live, "step": st.integers(0, 3)}, optional={
        "loss": st.floats(), "num_examples": st.integers(0, 100),
        "timings": st.fixed_dictionaries({}, optional={k: st.floats(0, 10) for k in ("fetch", "compute", "push")})})
    optimizers = st.one_of(st.fixed_dictionaries({"name": st.sampled_from(["sgd", "adam", "pickle"])},
                                                 optional={"learning_rate": st.one_of(st.floats(), values)}), values)
    meta = draw(st.one_of(honest_push, push_metas(st.one_of(live, st.text(max_size=20)), st.one_of(st.integers(0, 3), values)),
                          st.fixed_dictionaries({}, optional={"optimizer": optimizers}),
                          st.dictionaries(st.text(max_size=8), values, max_size=3)))
    try:
        body = frame.encode_bytes(draw(gradients({k: v.shape for k, v in MODEL.items()})), meta)
    except (ValueError, OverflowError, TypeError):
        return draw(st.binary(max_size=200))  # not representable in msgpack
    end = draw(st.sampled_from([len(body)] * 4 + [len(body) - 1, 8]))
    return body[:end] + draw(st.sampled_from([b""] * 4 + [b"\0"]))


schemathesis.openapi.media_type(FRAME, frame_bodies())

SCHEMA = schemathesis.openapi.from_dict(create_app(PSSettings()).openapi())
OPERATIONS = [result.ok() for result in SCHEMA.get_all_operations()]
CASES = [(op, mode) for op in OPERATIONS for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
         # an operation without parameters or body has no negative examples
         if mode is GenerationMode.POSITIVE or len(op.query) + len(op.path_parameters) + len(op.body)]


@pytest.fixture(scope="module")
def ps():
    with live_ps(lease_seconds=600, startup_grace_seconds=0, pull_timeout_max_seconds=0.05,
                 body_idle_timeout_seconds=2.0) as ps:
        c = ps.client()
        wid = LIVE["worker_id"] = c.register("w0")["worker_id"]
        assert c.init_model(MODEL, {"name": "adam"})
        assert c.pull(0, wid, wait=allow(5.0)) is not None
        yield ps
        c.close()
    print(f"[schemathesis] {sum(STATUSES.values())} requests, statuses {dict(sorted(STATUSES.items()))}")


@pytest.mark.parametrize("operation,mode", CASES, ids=[f"{op.label} {mode.value}" for op, mode in CASES])
def test_no_server_errors(ps, operation, mode):
    # schemathesis' own pytest plugin does not run under this pytest; its strategies do, through hypothesis
    @given(operation.as_strategy(mode))
    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def check(case):
        response = case.call(base_url=ps.url, timeout=allow(10))
        STATUSES[response.status_code] += 1
        case.validate_response(response, checks=[not_a_server_error])
        if response.status_code >= 400:
            assert set(response.json()) == {"error", "detail"}, response.text

    check()
