"""shared/protocol.py: the push meta's two parsers agree."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from shared.errors import ProtocolError
from shared.protocol import _parse_push_checked, parse_push_meta

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
