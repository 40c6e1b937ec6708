"""shared.frame: round trips for every allowed dtype, the documented bytes, zero-copy decode, and every
refusal made before an array exists; plus shared.codec's strict msgpack ``unpack``."""
import msgpack
import numpy as np
import pytest

from shared import frame
from shared.codec import DTYPES, bfloat16, pack, unpack
from shared.errors import ProtocolError
from tests.wire import PREFIX, entry, msgpack_map, one_tensor, parts, raw_frame, tampered

TWO = {"w": np.arange(6, dtype=np.float32).reshape(3, 2), "b": np.array([0.5, -0.5], np.float64)}


@pytest.mark.parametrize("name", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (5,), (3, 4), (2, 1, 3)])
def test_round_trip_every_dtype(name, shape):
    arr = (np.arange(int(np.prod(shape))) - 3).reshape(shape).astype(DTYPES[name] or bfloat16())
    f = frame.decode(frame.encode_bytes({"x": arr, "y": arr[..., None]}, {"step": 7}))
    assert f.meta == {"step": 7} and list(f.tensors) == ["x", "y"]
    out = f.tensors["x"]
    assert out.dtype == (DTYPES[name] or bfloat16()) and out.shape == shape
    np.testing.assert_array_equal(out, arr)
    np.testing.assert_array_equal(f.tensors["y"], arr[..., None])


def test_wire_form_is_the_documented_bytes():
    """docs/protocol.md's example: float32 ``w`` of shape [3], meta {"step": 0}."""
    w = np.array([1.0, 2.0, 3.0], np.float32)
    body = frame.encode_bytes({"w": w}, {"step": 0})
    head = msgpack.packb({"meta": {"step": 0}, "tensors": [["w", "float32", [3], 0]], "data_bytes": 12})
    assert 16 + len(head) <= 64
    assert body == PREFIX.pack(b"SYNCPSF1", len(head), 0) + head + bytes(64 - 16 - len(head)) + w.tobytes()
    assert len(body) == 64 + 12


def test_layout_is_canonical_and_aligned():
    tensors = {"a": np.zeros(3, np.float16), "b": np.zeros((0, 4), np.float32), "c": np.ones(17, np.float64),
               "d": np.zeros(1, np.int32)}
    body = frame.encode_bytes(tensors)
    f = frame.decode(body)
    assert f.layout.to_wire() == [["a", "float16", [3], 0], ["b", "float32", [0, 4], 64],
                                  ["c", "float64", [17], 64], ["d", "int32", [1], 256]]
    assert f.data_start % frame.ALIGN == 0 and f.layout.data_bytes == 256 + 4
    base = np.frombuffer(body, np.uint8).ctypes.data
    assert all((a.ctypes.data - base) % frame.ALIGN == 0 for a in f.tensors.values() if a.size)


def test_big_endian_and_non_contiguous_input_is_normalised():
    arr = np.arange(12, dtype=">f8").reshape(3, 4)[:, ::2]
    out = frame.decode(frame.encode_bytes({"x": arr})).tensors["x"]
    assert out.dtype == np.dtype("<f8")
    np.testing.assert_array_equal(out, arr)


def test_encode_references_the_arrays_without_copying():
    w = np.arange(1000, dtype=np.float32)
    parts = frame.encode({"w": w}, {"step": 1})
    assert any(isinstance(p, memoryview) and np.shares_memory(np.frombuffer(p, np.uint8), w) for p in parts)


@pytest.mark.parametrize("writable", [True, False])
def test_decode_is_zero_copy_and_writable_only_over_writable_memory(writable):
    body = frame.encode_bytes(TWO)
    buf = bytearray(body) if writable else body
    for name, out in frame.decode(buf).tensors.items():
        assert np.shares_memory(out, np.frombuffer(buf, np.uint8)), name
        assert out.flags.writeable == writable


def test_a_region_may_hold_more_than_its_frame():
    body = frame.encode_bytes(TWO)
    assert [t.name for t in frame.decode(body + bytes(100), exact=False).layout.tensors] == ["w", "b"]
    with pytest.raises(ProtocolError):
        frame.decode(body[:-1], exact=False)


def _set(key, value):
    return lambda head: head.__setitem__(key, value)


def _entry(i, value):
    return lambda head: head["tensors"][0].__setitem__(i, value)


BAD_FRAMES = {
    # prefix
    "empty": b"",
    "shorter-than-the-prefix": b"SYNCPSF1\0\0",
    "bad-magic": tampered(TWO, magic=b"SYNCPSF2"),
    "reserved-not-zero": tampered(TWO, reserved=1),
    "header-length-past-the-body": tampered(TWO, hlen=10_000),
    "header-length-over-the-limit": raw_frame(b"", hlen=frame.MAX_HEADER_BYTES + 1),
    "old-msgpack-body": pack({"worker_id": "a", "step": 0, "tensors": {}}),
    # header form
    "header-not-a-map": raw_frame([1, 2, 3]),
    "header-missing-data-bytes": tampered(TWO, edit=lambda h: h.pop("data_bytes")),
    "header-extra-key": tampered(TWO, edit=_set("pickle", b"x")),
    "meta-not-a-map": tampered(TWO, edit=_set("meta", [1])),
    "tensors-not-a-list": tampered(TWO, edit=_set("tensors", {"w": 1})),
    "entry-not-a-list": tampered(TWO, edit=lambda h: h["tensors"].__setitem__(0, "w")),
    "entry-three-fields": tampered(TWO, edit=lambda h: h["tensors"][0].pop()),
    "entry-five-fields": tampered(TWO, edit=lambda h: h["tensors"][0].append(b"pickle")),
    "name-bytes": tampered(TWO, edit=_entry(0, b"w")),
    "name-empty": tampered(TWO, edit=_entry(0, "")),
    "name-too-long": tampered(TWO, edit=_entry(0, "x" * (frame.MAX_NAME_LEN + 1))),
    "duplicate-name": tampered(TWO, edit=lambda h: h["tensors"][1].__setitem__(0, "w")),
    # canonical layout and exact lengths
    "offset-not-canonical": one_tensor("x", "float32", [2], 8, data=bytes(16)),
    "offset-gap": tampered(TWO, edit=lambda h: h["tensors"][1].__setitem__(3, 128)),
    "offsets-overlap": tampered(TWO, edit=lambda h: h["tensors"][1].__setitem__(3, 0)),
    "offset-float": one_tensor("x", "float32", [2], 0.0, data=bytes(8)),
    "offset-bool": one_tensor("x", "float32", [0], False),
    "data-bytes-wrong": tampered(TWO, edit=_set("data_bytes", 88)),
    "data-bytes-float": one_tensor("x", "float32", [2], data=bytes(8), data_bytes=8.0),
    "data-bytes-bool": one_tensor("x", "float32", [0], data_bytes=False),
    "data-shorter": tampered(TWO, data=parts(TWO)[1][:-8]),
    "trailing-bytes": tampered(TWO, tail=b"\0"),
    "truncated": tampered(TWO)[:-1],
}


@pytest.mark.parametrize("body", [raw_frame(b"\xc1"), raw_frame(msgpack_map((b"meta", {}), ("tensors", []), ("data_bytes", 0)))],
                         ids=["header-not-msgpack", "header-bytes-key"])
def test_a_header_that_is_not_plain_msgpack_is_400_bad_msgpack(body):
    with pytest.raises(ProtocolError) as err:
        frame.decode(body)
    assert (err.value.status, err.value.code) == (400, "bad_msgpack"), err.value


@pytest.mark.parametrize("body", BAD_FRAMES.values(), ids=BAD_FRAMES.keys())
def test_malformed_frames_are_400_bad_frame(body):
    with pytest.raises(ProtocolError) as err:
        frame.decode(body)
    assert (err.value.status, err.value.code) == (400, "bad_frame"), err.value


UNACCEPTABLE = {
    "dtype-object": (one_tensor("x", "object", data=bytes(16)), "unsupported_dtype"),
    "dtype-O": (one_tensor("x", "O", data=bytes(16)), "unsupported_dtype"),
    "dtype-big-endian": (one_tensor("x", ">f4", data=bytes(8)), "unsupported_dtype"),
    "dtype-complex": (one_tensor("x", "complex128", data=bytes(32)), "unsupported_dtype"),
    "dtype-uint8": (one_tensor("x", "uint8", data=bytes(4)), "unsupported_dtype"),  # bfloat16, uint32: compression
    "dtype-int": (one_tensor("x", 5, data=bytes(8)), "unsupported_dtype"),
    "shape-negative": (one_tensor("x", "float32", [-1]), "bad_shape"),
    "shape-float": (one_tensor("x", "float32", [1.5]), "bad_shape"),
    "shape-bool": (one_tensor("x", "float32", [True], data=bytes(4)), "bad_shape"),
    "shape-nine-dims": (one_tensor("x", "float32", [1] * 9, data=bytes(4)), "bad_shape"),
    "shape-dim-2^40": (one_tensor("x", "float32", [0, 1 << 40]), "bad_shape"),
    "shape-not-a-list": (one_tensor("x", "float32", 2, data=bytes(8)), "bad_shape"),
    "too-many-tensors": (raw_frame({"meta": {}, "data_bytes": 0, "tensors": [
        entry(f"t{i}", "float32", [0], 0) for i in range(frame.MAX_TENSORS + 1)]}), "too_many_tensors"),
}


@pytest.mark.parametrize("body,code", UNACCEPTABLE.values(), ids=UNACCEPTABLE.keys())
def test_well_formed_but_unacceptable_tensors_are_422(body, code):
    with pytest.raises(ProtocolError) as err:
        frame.decode(body)
    assert (err.value.status, err.value.code) == (422, code), err.value


def test_max_tensors_is_accepted():
    body = raw_frame({"meta": {}, "data_bytes": 0,
                      "tensors": [entry(f"t{i}", "float32", [0], 0) for i in range(frame.MAX_TENSORS)]})
    assert len(frame.decode(body).tensors) == frame.MAX_TENSORS


def test_zero_size_tensor_with_large_dimensions():
    out = frame.decode(one_tensor("x", "float32", [0, (1 << 40) - 1])).tensors["x"]
    assert out.shape == (0, (1 << 40) - 1) and out.size == 0


@pytest.mark.parametrize("shape", [[0] + [(1 << 40) - 1] * 3, [(1 << 40) - 1] * 8], ids=["zero-size", "absurd"])
def test_a_shape_that_overflows_numpy_is_refused(shape):
    with pytest.raises(ProtocolError) as err:
        frame.decode(one_tensor("x", "float32", shape, data=bytes(8)))
    assert (err.value.status, err.value.code) == (422, "bad_shape")


def _nonzero_padding(where: str) -> bytes:
    body = bytearray(frame.encode_bytes(TWO))
    f = frame.decode(bytes(body))
    end_of_w = f.data_start + f.layout.tensors[0].nbytes
    body[f.data_start - 1 if where == "before-data" else end_of_w] = 7
    return bytes(body)


@pytest.mark.parametrize("where", ["before-data", "between-tensors"])
def test_padding_must_be_zero(where):
    with pytest.raises(ProtocolError) as err:
        frame.decode(_nonzero_padding(where))
    assert (err.value.status, err.value.code) == (400, "bad_frame")


# ---- shared.codec.unpack: strict msgpack ----------------------------------------------------------------------
def test_unpack_round_trips_plain_data():
    obj = {"a": [1, -2, 2**64 - 1, 1.5, None, True, "€"], "b": {"c": b"\0\1"}}
    assert unpack(pack(obj)) == obj


@pytest.mark.parametrize("body", [b"", b"\xc1", b"\x92\x01", b"\x01\x02", msgpack.packb(msgpack.ExtType(5, b"x")),
                                  b"\x81\x01\x02", b"\x91" * 100_000 + b"\xc0", b"\xdd\xff\xff\xff\xff\xc0"],
                         ids=["empty", "reserved-byte", "truncated", "trailing", "ext", "int-key", "deep", "long-array"])
def test_unpack_refuses_malformed_truncated_trailing_and_ext(body):
    with pytest.raises(ProtocolError) as err:
        unpack(body)
    assert (err.value.status, err.value.code) == (400, "bad_msgpack")


@pytest.mark.parametrize("body", [msgpack_map(("step", 1), ("step", 2)),
                                  msgpack_map(("meta", msgpack_map(("a", 1), ("b", 2), ("a", 1))))],
                         ids=["top-level", "nested"])
def test_unpack_refuses_a_key_twice_in_one_map(body):
    with pytest.raises(ProtocolError) as err:
        unpack(body)
    assert (err.value.status, err.value.code) == (400, "duplicate_key")


@pytest.mark.parametrize("body", [msgpack.packb({"step": msgpack.Timestamp(5)}), msgpack.packb({b"step": 1})],
                         ids=["timestamp-ext", "bytes-key"])
def test_unpack_refuses_every_extension_type_and_non_string_keys(body):
    with pytest.raises(ProtocolError) as err:
        unpack(body)
    assert (err.value.status, err.value.code) == (400, "bad_msgpack")


def test_sizes_in_the_header_limit_are_what_the_docs_say():
    """4096 tensors with 256-character names and 8 dimensions of 2^40 - 1 fit in MAX_HEADER_BYTES."""
    big = [entry(f"{i:0{frame.MAX_NAME_LEN}d}", "float64", [(1 << 40) - 1] * 8, 2**64 - 1) for i in range(frame.MAX_TENSORS)]
    head = pack({"meta": {}, "tensors": big, "data_bytes": 2**64 - 1})
    assert len(head) <= frame.MAX_HEADER_BYTES == 2 << 20
