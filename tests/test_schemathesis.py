"""schemathesis against the PS's own OpenAPI schema, on a real uvicorn server: zero 5xx.

The PS is mid-training (model initialised, a worker registered, round 0 open) so generated requests
reach deep paths, not just "not initialised". The msgpack bodies of push and init are generated from
their documented JSON Schema and packed with msgpack (tensor ``data`` as bin). Examples are bounded
(MAX_EXAMPLES per operation, positive and negative generation) to keep the run short.
"""
from __future__ import annotations

from collections import Counter

import msgpack
import numpy as np
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from ps_service.app import create_app
from ps_service.settings import PSSettings
from shared.protocol import MSGPACK
from tests.live_ps import live_ps

MAX_EXAMPLES = 25
STATUSES: Counter = Counter()  # status codes seen, reported at the end


def _wire(value):
    """JSON-Schema-generated values as msgpack can carry them: tensor ``data`` text as bin, ints clamped to 64 bits."""
    if isinstance(value, dict):
        return {k: (v.encode("utf-8", "surrogatepass") if k == "data" and isinstance(v, str) else _wire(v))
                for k, v in value.items()}
    if isinstance(value, list):
        return [_wire(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool):
        return min(max(value, -(2**63)), 2**64 - 1)
    return value


@schemathesis.serializer(MSGPACK)
def _msgpack(ctx, value):
    return msgpack.packb(_wire(value), use_bin_type=True)


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
        wid = c.register("w0")["worker_id"]
        assert c.init_model({"w": np.zeros((3, 2), np.float32), "b": np.zeros(2, np.float32)}, {"name": "adam"})
        assert c.pull(0, wid, wait=5.0) is not None
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
        response = case.call(base_url=ps.url, timeout=10)
        STATUSES[response.status_code] += 1
        case.validate_response(response, checks=[not_a_server_error])
        if response.status_code >= 400:
            assert set(response.json()) == {"error", "detail"}, response.text

    check()
