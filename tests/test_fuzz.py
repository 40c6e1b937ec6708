"""hypothesis fuzzing of the wire decoders: ``shared.frame.decode``, ``shared.codec.unpack`` and
``shared.protocol.parse_push_meta``. Whatever the bytes, nothing but ProtocolError escapes (so the PS answers
4xx, never 500), a decoded tensor is a view of bytes that were actually received (no allocation from a
declared shape), and a hostile body cannot make the decoder allocate much beyond its own size."""
from __future__ import annotations

import math
import tracemalloc

import msgpack
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared import frame
from shared.codec import DTYPES, bfloat16, unpack
from shared.errors import ProtocolError
from shared.protocol import MAX_NUM_EXAMPLES, MAX_PHASE_SECONDS, PushRequest, parse_push_meta
from tests.strategies import push_metas, rarely, values
from tests.wire import PREFIX, pack, push_frame, raw_frame, repeated

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---- strategies ------------------------------------------------------------------------------------------------
dims = st.one_of(st.integers(0, 6), st.integers(-3, 2**64 - 1), st.booleans(), st.floats(0, 4), st.text(max_size=2))
dtypes = st.one_of(st.sampled_from(sorted(DTYPES)), st.sampled_from(["object", "O", "<U4", ">f4", "complex64", "bool",
                                                                     "bfloat16", ""]),
                   st.text(max_size=10), st.integers())
names = st.one_of(st.text(min_size=1, max_size=6), st.sampled_from(["w", "b", "", "x" * 257]), st.binary(max_size=4),
                  st.integers())


@st.composite
def entries(draw, honest: bool):
    """header.tensors: honest ones (allowed dtypes, small shapes, canonical offsets, unique names), or drawn from
    anything, often wrong in one way."""
    out, at, end, seen = [], 0, 0, set()
    for _ in range(draw(st.integers(0, 4))):
        if honest:
            name = draw(st.text(min_size=1, max_size=6).filter(lambda n: n not in seen))
            dtype, shape, offset = draw(st.sampled_from(sorted(DTYPES))), draw(st.lists(st.integers(0, 6), max_size=4)), at
        else:
            name, dtype = draw(names), draw(dtypes)
            shape = draw(st.one_of(st.lists(st.integers(0, 6), max_size=8), st.lists(dims, max_size=10), values,
                                   st.lists(st.sampled_from([0, 1, 7, 2**31, 2**39, 2**40, 2**63, 2**64 - 1]),
                                            min_size=1, max_size=8)))
            offset = at if draw(st.booleans()) else draw(st.one_of(st.integers(-1, 300), values))
        seen.add(name)
        consistent = isinstance(dtype, str) and dtype in DTYPES and isinstance(shape, list) and \
            all(type(d) is int and 0 <= d < frame.MAX_DIM for d in shape)
        entry = [name, dtype, shape, offset]
        if not honest and rarely(draw):
            entry = draw(st.one_of(st.just(entry[:3]), st.just(entry + [0]), values))
        out.append(entry)
        end = at + (math.prod(shape) * (DTYPES[dtype] or bfloat16()).itemsize if consistent else 0)
        at = frame.aligned(end)
    return out, end  # the entries and their data_bytes (when they are consistent)


@st.composite
def frames(draw) -> bytearray:
    """Frames: half of them honest but for at most one lie (in the prefix, the lengths or a header field),
    the others drawn from anything."""
    honest = draw(st.booleans())
    tensors, data_bytes = draw(entries(honest))
    metas = st.dictionaries(st.text(max_size=8), values, max_size=4)
    head = {"meta": draw(metas if honest else st.one_of(metas, values)), "tensors": tensors,
            "data_bytes": data_bytes if honest or draw(st.booleans()) else draw(values)}
    if not honest:
        for key in draw(st.lists(st.sampled_from(["meta", "tensors", "data_bytes"]), max_size=1)):
            del head[key]
        if rarely(draw):
            head["pickle"] = draw(values)
    size = data_bytes if (honest or draw(st.booleans())) and data_bytes <= 1 << 16 else draw(st.integers(0, 256))
    try:
        h = pack(head)
    except (ValueError, OverflowError, TypeError):
        h = draw(st.binary(max_size=64))  # not representable: bytes instead
    lie = draw(st.sampled_from([None, "magic", "hlen", "reserved", "tail", "cut"]))
    body = raw_frame(h, b"\x01" * size, magic=draw(st.binary(min_size=8, max_size=8)) if lie == "magic" else frame.MAGIC,
                     hlen=draw(st.integers(0, 2**32 - 1)) if lie == "hlen" else None,
                     reserved=draw(st.integers(1, 2**32 - 1)) if lie == "reserved" else 0,
                     tail=draw(st.binary(min_size=1, max_size=8)) if lie == "tail" else b"")
    return bytearray(body if lie != "cut" else body[:draw(st.integers(0, len(body)))])


def refused(fn, *args, **kw):
    """Call fn; a ProtocolError is fine (returned), anything else fails the test."""
    try:
        return fn(*args, **kw)
    except ProtocolError as exc:
        assert exc.status in (400, 413, 422) and exc.code and exc.detail
        return exc


def check_frame(out, buf) -> None:
    """A decoded frame: allowed dtypes, the canonical layout, exact length, views of ``buf`` (no copy)."""
    if isinstance(out, ProtocolError):
        return
    assert isinstance(out.meta, dict) and len(buf) == out.data_start + out.layout.data_bytes
    assert out.data_start % frame.ALIGN == 0 and out.data_start >= PREFIX.size
    landed = np.frombuffer(buf, np.uint8)
    at = 0
    for spec, (name, arr) in zip(out.layout.tensors, out.tensors.items(), strict=True):
        assert spec.name == name and isinstance(name, str) and 0 < len(name) <= frame.MAX_NAME_LEN
        assert spec.offset == at and arr.nbytes == spec.nbytes
        assert arr.dtype in [DTYPES[n] or bfloat16() for n in DTYPES]
        if arr.nbytes:
            assert np.shares_memory(arr, landed), "decode copied or allocated"
            assert arr.flags.writeable  # a view of the (writable) received buffer
        at = frame.aligned(at + arr.nbytes)
    assert len(set(out.tensors)) == len(out.layout.tensors)


# ---- frame.decode: only ProtocolError; results are views of the received bytes ---------------------------------
@FUZZ
@given(frames())
def test_decode_refuses_or_returns_views_of_the_bytes(buf):
    check_frame(refused(frame.decode, buf), buf)


@FUZZ
@given(st.binary(max_size=300), st.booleans())
def test_decode_random_bytes(tail, with_prefix):
    """Random bytes, alone or after a prefix that declares them the header."""
    buf = bytearray(PREFIX.pack(frame.MAGIC, len(tail), 0) + tail if with_prefix else tail)
    check_frame(refused(frame.decode, buf), buf)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, frame.MAX_DIM - 1), min_size=1, max_size=8), st.sampled_from(sorted(DTYPES)),
       st.integers(0, 64), st.integers(0, 2**64 - 1))
def test_a_declared_shape_never_allocates(shape, dtype, size, data_bytes):
    """However large the declared shape, decoding allocates nothing proportional to it."""
    body = raw_frame({"meta": {}, "tensors": [["x", dtype, shape, 0]], "data_bytes": data_bytes}, b"\1" * size)
    refused(frame.decode, body)  # untraced first: a dtype's first use loads its support once a process (bfloat16)
    tracemalloc.start()
    try:
        refused(frame.decode, body)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024


# ---- unpack: only ProtocolError(400), and it agrees with msgpack -------------------------------------------------
@FUZZ
@given(st.binary(max_size=200))
def test_unpack_random_bytes(body):
    out = refused(unpack, body)
    if isinstance(out, ProtocolError):
        assert out.status == 400 and out.code in ("bad_msgpack", "duplicate_key")


@FUZZ
@given(values)
def test_unpack_round_trips_what_msgpack_writes(value):
    body = msgpack.packb(value, use_bin_type=True)
    assert _plain(unpack(body)) == _plain(msgpack.unpackb(body, raw=False))


def _plain(v):
    """NaN-safe comparison."""
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v


# ---- parse_push_meta on metas, on frames, and on mutated real push frames ---------------------------------------
def check_push(out):
    if isinstance(out, ProtocolError):
        return
    push, seq = out
    assert isinstance(push, PushRequest)
    assert isinstance(push.worker_id, str) and type(push.step) is int and push.step >= 0
    assert push.loss is None or math.isfinite(push.loss)
    assert push.num_examples is None or 0 <= push.num_examples <= MAX_NUM_EXAMPLES
    assert all(0 <= getattr(push.timings, k) <= MAX_PHASE_SECONDS for k in ("fetch", "compute", "push"))
    assert seq is None or (type(seq) is int and seq >= 0)


@FUZZ
@given(push_metas())
def test_parse_push_meta_structured(meta):
    check_push(refused(parse_push_meta, meta))


@FUZZ
@given(push_metas(), st.sampled_from([{}, {"w": np.arange(6, dtype=np.float32)}, {"w": np.zeros(20_000, np.float64)}]))
def test_parse_push_meta_through_the_wire(meta, tensors):
    """The same metas in a frame with tensors, small or large, encoded and decoded."""
    try:
        body = frame.encode_bytes(tensors, meta)
    except (ValueError, OverflowError, TypeError):
        return  # not representable in msgpack
    decoded = refused(frame.decode, body)
    if not isinstance(decoded, ProtocolError):
        check_push(refused(parse_push_meta, decoded.meta))


VALID = push_frame("abc", 3, {"w": np.arange(6, dtype=np.float32).reshape(3, 2), "b": np.ones(2, np.float64)},
                   loss=0.25, num_examples=8, timings={"fetch": 0.01, "compute": 0.02, "push": 0.0})
VALID_LARGE = push_frame("abc", 3, {"w": np.arange(20000, dtype=np.float32), "b": np.ones(2, np.float64)})


@FUZZ
@given(st.sampled_from([VALID, VALID_LARGE]), st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), max_size=6),
       st.integers(0, 1 << 20), st.binary(max_size=8))
def test_mutated_real_push_frames(base, flips, cut, tail):
    """Bit flips (mostly in the prefix and header, where the rules are), truncation and trailing garbage."""
    body = bytearray(base)
    for pos, byte in flips:
        body[pos % (len(body) if pos & 1 else 160)] = byte
    body = bytearray(body[:max(1, cut % (len(body) + 1))] + tail)
    decoded = refused(frame.decode, body)
    check_frame(decoded, body)
    if not isinstance(decoded, ProtocolError):
        check_push(refused(parse_push_meta, decoded.meta))


# ---- allocation bounds ---------------------------------------------------------------------------------------
def peak_of(fn, *args) -> int:
    tracemalloc.start()
    try:
        refused(fn, *args)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_header_over_the_limit_is_refused_before_it_is_parsed():
    """A header longer than MAX_HEADER_BYTES (here 4 Mi empty maps, which would be ~300 MB of Python objects)
    is refused by its declared length, before a byte of it is parsed."""
    body = raw_frame(repeated(b"\x80", 4 << 20))
    assert isinstance(refused(frame.decode, body), ProtocolError)
    peak = peak_of(frame.decode, body)
    assert peak < 1 << 20, f"{peak} bytes allocated for a refused 4 MiB header"


def test_a_header_longer_than_the_body_is_refused_before_it_is_parsed():
    head = repeated(b"\x80", 1 << 20)
    body = raw_frame(head, hlen=len(head) + frame.ALIGN)  # past the padding too
    assert peak_of(frame.decode, body) < 1 << 20


def test_a_header_bomb_within_the_limit_stays_bounded():
    """A header within MAX_HEADER_BYTES made of tiny items: the parse allocates at most a small multiple of the
    header (the old codec's budget: 200 bytes per allowed item, 64 Ki items, plus twice the body)."""
    n = frame.MAX_HEADER_BYTES - 5
    body = raw_frame(repeated(b"\x80", n))  # empty maps: the most objects per byte
    peak = peak_of(frame.decode, body)
    assert peak < 200 * (1 << 16) + 2 * len(body), f"{peak} bytes allocated for a {len(body)}-byte frame"
