"""bench/trace.py: one push and one pull per transport through real in-process PS servers, traced. The seam is
one-way: no call goes from the core (ps_service/core/) into the transport, HTTP or sharding layers, on any transport
(a sharded coordinator's included); with partitioned rounds the one call out is the runtime's ``on_partition``, given
to the core, once per call that closed partitions."""
from __future__ import annotations

import pytest

from bench import trace
from tests.timing import allow


#: the most moves between files from the route's entry to the optimizer's apply that each scenario may take (what
#: docs/architecture.md quotes; issue 48 aims at 25 for TCP and 30 for same-host). A sharded commit's count varies
#: with the follower's apply, which runs in another thread of the same process meanwhile (39-95 seen)
ROUTE_MOVES = {"tcp": 22, "shm": 30, "topk": 28, "sharded": 110, "partitioned": 56}
#: the core's one call out with partitioned rounds: the hook the runtime gives it (core.on_partition)
ON_PARTITION = "ps_service/core/__init__.py -> ps_service/runtime.py:_partition_closed"


@pytest.mark.parametrize("scenario", trace.SCENARIOS)
def test_the_core_never_calls_the_transport_http_or_sharding_layers(scenario):
    lines = trace.trace(scenario, patience=allow(10))
    assert [line["request"] for line in lines] == ["push", "pull"]
    push, pull = lines
    # the push closed its round: the route reached the optimizer, through the core, in so many moves at most
    assert push["route_to_optimizer"] is not None and "ps_service/core/optimizers.py" in push["file_list"]
    assert push["route_to_optimizer"] <= ROUTE_MOVES[scenario], push["route_to_optimizer"]
    # no call out, a sharded coordinator's decision included: told (core.told), not called (docs/architecture.md); with
    # partitioned rounds the hook alone, once a frame of the push (W0 in 3 partitions: each frame closed its own)
    hooked = {("partitioned", "push"): ([ON_PARTITION], 3)}
    for line in lines:
        calls, count = hooked.get((scenario, line["request"]), ([], 0))
        assert (line["calls_out"], line["core_calls_out"]) == (calls, count), line["calls_out"]
        assert line["files"] > 0 and line["moves"] > 0
    if scenario == "partitioned":  # (the hook's: the closed partitions' frames encoded for the pulls)
        assert "ps_service/transport/streamed.py" in push["file_list"]
    assert pull["route_to_optimizer"] is None  # a pull applies nothing


def test_moves_are_counted_between_project_files_only():
    events = [("call", "ps_service/api.py", "push", "ps_service/api.py", None),
              ("call", "ps_service/core/__init__.py", "push", "ps_service/core/__init__.py", "ps_service/api.py"),
              ("call", "ps_service/core/optimizers.py", "apply", "ps_service/core/optimizers.py",
               "ps_service/core/__init__.py"),
              ("return", "ps_service/core/optimizers.py", "apply", "ps_service/core/__init__.py", None),
              ("return", "ps_service/core/__init__.py", "push", "ps_service/api.py", None)]
    out = trace.summarise(events)
    assert (out["files"], out["moves"], out["route_to_optimizer"], out["core_calls_out"]) == (3, 4, 2, 0)
    assert out["route"] == ["api -> core/__init__: push", "core/__init__ -> core/optimizers: apply"]
    assert out["file_list"] == ["ps_service/api.py", "ps_service/core/__init__.py", "ps_service/core/optimizers.py"]
    out = trace.summarise([("call", "ps_service/core/model.py", "update", "ps_service/core/model.py", None),
                           ("call", "ps_service/transport/shm.py", "x", "ps_service/transport/shm.py",
                            "ps_service/core/model.py")])
    assert out["calls_out"] == ["ps_service/core/model.py -> ps_service/transport/shm.py:x"]
