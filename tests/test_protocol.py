"""shared/protocol.py: the push request's copy with tensors keeps every other field."""
from __future__ import annotations

import dataclasses

import numpy as np

from shared.protocol import PhaseTimes, PushRequest


def test_with_tensors_keeps_every_field_but_the_tensors_it_replaces():
    push = PushRequest("w1", 7, {}, 0.5, 32, PhaseTimes(0.1, 0.2, 0.3))
    grads = {"w": np.ones(3, np.float32)}
    out = push.with_tensors(grads, finite_checked=True)
    changed = {"tensors": grads, "finite_checked": True}
    for f in dataclasses.fields(PushRequest):  # a field added to PushRequest must be passed on by with_tensors
        assert getattr(out, f.name) is changed.get(f.name, getattr(push, f.name)), f.name


from hypothesis import given, settings, strategies as st  # noqa: E402

from shared.errors import ProtocolError  # noqa: E402
from shared.protocol import _parse_push_checked, parse_push_meta  # noqa: E402

_values = st.one_of(st.none(), st.booleans(), st.integers(-3, 2**40), st.floats(allow_nan=True, allow_infinity=True),
                    st.text(max_size=3), st.just({}), st.just([]), st.just(0))
_timings = st.one_of(_values, st.dictionaries(st.sampled_from(["fetch", "compute", "push", "other"]), _values, max_size=4))
_metas = st.fixed_dictionaries({}, optional={
    "worker_id": st.one_of(st.text(max_size=4), _values), "step": st.one_of(st.integers(-2, 10), _values),
    "loss": _values, "num_examples": st.one_of(st.integers(-1, 2**33), _values), "timings": _timings,
    "shm_seq": st.one_of(st.integers(-1, 2**50), _values), "compression": st.one_of(st.sampled_from(["topk"]), _values),
    "extra": _values})


def _outcome(parse, meta):
    try:
        push, seq = parse(meta)
        return push, seq
    except ProtocolError as exc:
        return exc.status, exc.code


@settings(max_examples=400, deadline=None)
@given(_metas)
def test_the_quick_push_parser_agrees_with_the_field_by_field_one(meta):
    assert repr(_outcome(parse_push_meta, meta)) == repr(_outcome(_parse_push_checked, meta))
