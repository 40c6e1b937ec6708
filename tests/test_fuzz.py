"""hypothesis fuzzing of the wire decoders: ``shared.codec.unpack`` / ``decode_tensor(s)`` and
``shared.protocol.parse_push``. Whatever the bytes, nothing but ProtocolError escapes (so the PS answers
4xx, never 500), a decoded tensor is a read-only view of bytes that were actually received (no allocation
from a declared shape), and a hostile body cannot make the decoder allocate much beyond its own size."""
from __future__ import annotations

import math
import tracemalloc

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.codec import DTYPES, MAX_ITEMS, ZERO_COPY_MIN_BYTES, decode_tensor, decode_tensors, encode_tensors, pack, unpack, unpack_view
from shared.errors import ProtocolError
from shared.protocol import MAX_NUM_EXAMPLES, MAX_PHASE_SECONDS, PushRequest, parse_push

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---- strategies ------------------------------------------------------------------------------------------------
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=True),
                    st.text(max_size=12), st.binary(max_size=24))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=5)),
                      max_leaves=20)
dims = st.one_of(st.integers(0, 6), st.integers(-3, 2**64 - 1), st.booleans(), st.floats(0, 4), st.text(max_size=2))
dtypes = st.one_of(st.sampled_from(sorted(DTYPES)), st.sampled_from(["object", "O", "<U4", ">f4", "complex64", "bool", ""]),
                   st.text(max_size=10), st.integers())


@st.composite
def tensors(draw):
    """Mostly tensor-shaped maps: sometimes consistent, often not."""
    dtype = draw(dtypes)
    shape = draw(st.one_of(st.lists(st.integers(0, 6), max_size=8), st.lists(dims, max_size=10), values,
                           st.lists(st.sampled_from([0, 1, 7, 2**31, 2**62, 2**63, 2**64 - 1]), min_size=1, max_size=8)))
    consistent = isinstance(dtype, str) and dtype in DTYPES and isinstance(shape, list) and \
        all(type(d) is int and d >= 0 for d in shape) and math.prod(shape) <= 4096
    if consistent and draw(st.booleans()):
        data = b"\x01" * (math.prod(shape) * DTYPES[dtype].itemsize)
    else:
        data = draw(st.one_of(st.binary(max_size=64), values))
    obj = {"dtype": dtype, "shape": shape, "data": data}
    for key in draw(st.lists(st.sampled_from(["dtype", "shape", "data"]), max_size=1)):
        del obj[key]
    if draw(st.integers(0, 9)) == 0:
        obj["pickle"] = draw(values)
    return obj


@st.composite
def push_bodies(draw):
    obj = {"worker_id": draw(st.one_of(st.text(max_size=20), values)),
           "step": draw(st.one_of(st.integers(-5, 2**64 - 1), values)),
           "tensors": draw(st.one_of(st.dictionaries(st.one_of(st.text(max_size=8), st.binary(max_size=4)), tensors(),
                                                     max_size=4), values)),
           "loss": draw(st.one_of(st.none(), st.floats(), values)),
           "num_examples": draw(st.one_of(st.none(), st.integers(-5, 2**64 - 1), values)),
           "timings": draw(st.one_of(st.none(), st.dictionaries(st.sampled_from(["fetch", "compute", "push", "x"]),
                                                               st.one_of(st.floats(), values), max_size=4), values))}
    for key in draw(st.lists(st.sampled_from(sorted(obj)), max_size=2)):
        obj.pop(key, None)
    return obj


def refused(fn, *args):
    """Call fn; a ProtocolError is fine (returned), anything else fails the test."""
    try:
        return fn(*args)
    except ProtocolError as exc:
        assert exc.status in (400, 413, 422) and exc.code and exc.detail
        return exc


# ---- decode_tensor: only ProtocolError; results are read-only views of the received bytes ---------------------
@FUZZ
@given(tensors())
def test_decode_tensor_refuses_or_returns_a_view_of_the_bytes(obj):
    out = refused(decode_tensor, obj)
    if isinstance(out, ProtocolError):
        return
    data = obj["data"]
    assert isinstance(out, np.ndarray) and not out.flags.writeable
    assert out.dtype in DTYPES.values() and out.nbytes == len(data)
    if out.nbytes:
        assert np.shares_memory(out, np.frombuffer(data, np.uint8)), "decode copied or allocated"


@FUZZ
@given(st.one_of(st.dictionaries(st.one_of(st.text(max_size=300), st.binary(max_size=4), st.integers()), tensors(),
                                 max_size=4), values))
def test_decode_tensors_only_protocol_errors(obj):
    refused(decode_tensors, obj)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=8), st.sampled_from(sorted(DTYPES)), st.binary(max_size=64))
def test_a_declared_shape_never_allocates(shape, dtype, data):
    """However large the declared shape, decoding allocates nothing proportional to it."""
    tracemalloc.start()
    try:
        refused(decode_tensor, {"dtype": dtype, "shape": shape, "data": data})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024


# ---- unpack: only ProtocolError(400), and both parsers agree -----------------------------------------------------
@FUZZ
@given(st.binary(max_size=200))
def test_unpack_random_bytes(body):
    out = refused(unpack, body)
    if isinstance(out, ProtocolError):
        assert out.status == 400 and out.code == "bad_msgpack"
    view = refused(unpack_view, body)  # the zero-copy parser of large bodies, on the same bytes
    if not isinstance(out, ProtocolError) and not isinstance(view, ProtocolError):
        assert _plain(view) == _plain(out)


@FUZZ
@given(values)
def test_both_parsers_round_trip_what_msgpack_writes(value):
    body = msgpack.packb(value, use_bin_type=True)
    assert _plain(unpack_view(body)) == _plain(msgpack.unpackb(body, raw=False, strict_map_key=False)) or \
        _has_non_str_key(value)


def _has_non_str_key(v) -> bool:
    if isinstance(v, dict):
        return any(not isinstance(k, (str, bytes)) or _has_non_str_key(x) for k, x in v.items())
    return isinstance(v, list) and any(_has_non_str_key(x) for x in v)


def _plain(v):
    """bytes for memoryviews, and NaN-safe float comparison."""
    if isinstance(v, memoryview):
        return bytes(v)
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    if isinstance(v, dict):
        return {(bytes(k) if isinstance(k, memoryview) else k): _plain(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v


# ---- parse_push on decoded bodies, and on mutated real bodies --------------------------------------------------
def check_push(out):
    if isinstance(out, ProtocolError):
        return
    assert isinstance(out, PushRequest)
    assert isinstance(out.worker_id, str) and type(out.step) is int and out.step >= 0
    assert out.loss is None or math.isfinite(out.loss)
    assert out.num_examples is None or 0 <= out.num_examples <= MAX_NUM_EXAMPLES
    assert all(0 <= getattr(out.timings, k) <= MAX_PHASE_SECONDS for k in ("fetch", "compute", "push"))
    assert all(isinstance(k, str) and not a.flags.writeable for k, a in out.tensors.items())


@FUZZ
@given(push_bodies())
def test_parse_push_structured(obj):
    check_push(refused(parse_push, obj))


@FUZZ
@given(push_bodies(), st.booleans())
def test_parse_push_through_the_wire(obj, large):
    """The same bodies packed and unpacked, small (msgpack's parser) or padded past ZERO_COPY_MIN_BYTES."""
    if large:
        obj = {**obj, "padding": b"\0" * ZERO_COPY_MIN_BYTES}
    try:
        body = msgpack.packb(obj, use_bin_type=True)
    except (ValueError, OverflowError, TypeError):
        return  # not representable in msgpack
    decoded = refused(unpack, body)
    if not isinstance(decoded, ProtocolError):
        check_push(refused(parse_push, decoded))


VALID = pack({"worker_id": "abc", "step": 3, "loss": 0.25, "num_examples": 8,
              "timings": {"fetch": 0.01, "compute": 0.02, "push": 0.0},
              "tensors": encode_tensors({"w": np.arange(6, dtype=np.float32).reshape(3, 2), "b": np.ones(2, np.float64)})})
VALID_LARGE = pack({"worker_id": "abc", "step": 3,
                    "tensors": encode_tensors({"w": np.arange(20000, dtype=np.float32), "b": np.ones(2, np.float64)})})


@FUZZ
@given(st.sampled_from([VALID, VALID_LARGE]), st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), max_size=6),
       st.integers(0, 1 << 20), st.binary(max_size=8))
def test_mutated_real_push_bodies(base, flips, cut, tail):
    """Bit flips, truncation and trailing garbage on a real push (small and zero-copy-sized)."""
    body = bytearray(base)
    for pos, byte in flips:
        body[pos % len(body)] = byte
    body = bytes(body[:max(1, cut % (len(body) + 1))]) + tail
    decoded = refused(unpack, body)
    if not isinstance(decoded, ProtocolError):
        check_push(refused(parse_push, decoded))


# ---- allocation bounds of unpack -------------------------------------------------------------------------------
def peak_of(fn, *args) -> int:
    tracemalloc.start()
    try:
        refused(fn, *args)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_small_item_bombs_are_refused_before_they_allocate():
    """A body that declares millions of tiny items (each would become a ~64-byte Python object) is refused
    by its declared count, before the items are built."""
    bomb = b"\xdd" + (4 << 20).to_bytes(4, "big") + b"\x80" * (4 << 20)  # array32 of 4 Mi empty maps: 4 MiB
    assert isinstance(refused(unpack, bomb), ProtocolError)
    peak = peak_of(unpack, bomb)
    assert peak < 1 << 20, f"{peak} bytes allocated for a refused 4 MiB bomb"


@pytest.mark.parametrize("depth,leaf", [(1, b"\x80"), (2, b"\xa1a"), (4, b"\x90")])
def test_nested_bombs_within_the_item_budget_stay_bounded(depth, leaf):
    """Nested arrays of tiny items, as many as MAX_ITEMS allows in all: the parse stays within a bounded
    multiple of the budget (not of the body)."""
    per = max(2, int(MAX_ITEMS ** (1 / depth)))
    body = leaf
    for _ in range(depth):
        body = b"\xdd" + per.to_bytes(4, "big") + body * per
        if len(body) > 8 << 20:
            break
    body += b"\0" * max(0, ZERO_COPY_MIN_BYTES - len(body))  # trailing bytes: refused, after the parse
    peak = peak_of(unpack, body)
    assert peak < 200 * MAX_ITEMS + 2 * len(body), peak
