"""shared.codec: round trips for every allowed dtype, zero-copy decode, refusals before allocation."""
import msgpack
import numpy as np
import pytest

from shared.codec import DTYPES, decode_tensor, decode_tensors, encode_tensor, encode_tensors, pack, unpack
from shared.errors import ProtocolError


@pytest.mark.parametrize("name", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (5,), (3, 4), (2, 1, 3)])
def test_round_trip_every_dtype(name, shape):
    arr = (np.arange(int(np.prod(shape))) - 3).reshape(shape).astype(DTYPES[name])
    body = pack({"tensors": encode_tensors({"x": arr})})
    out = decode_tensors(unpack(body)["tensors"])["x"]
    assert out.dtype == DTYPES[name] and out.shape == shape
    np.testing.assert_array_equal(out, arr)


def test_wire_form_is_the_documented_map():
    arr = np.array([[1.0, 2.0]], dtype=np.float32)
    obj = msgpack.unpackb(pack(encode_tensor(arr)))
    assert obj == {"dtype": "float32", "shape": [1, 2], "data": arr.astype("<f4").tobytes()}


def test_big_endian_and_non_contiguous_input_is_normalised():
    arr = np.arange(12, dtype=">f8").reshape(3, 4)[:, ::2]
    out = decode_tensor(unpack(pack(encode_tensor(arr))))
    assert out.dtype == np.dtype("<f8")
    np.testing.assert_array_equal(out, arr)


def test_decode_is_zero_copy_and_read_only():
    data = np.arange(6, dtype="<f4").tobytes()
    out = decode_tensor({"dtype": "float32", "shape": [2, 3], "data": data})
    assert out.base is not None and np.shares_memory(out, np.frombuffer(data, dtype="<f4"))
    assert not out.flags.writeable


@pytest.mark.parametrize("obj,status,code", [
    ({"dtype": "object", "shape": [1], "data": b"x" * 8}, 422, "unsupported_dtype"),
    ({"dtype": "complex128", "shape": [1], "data": b"x" * 16}, 422, "unsupported_dtype"),
    ({"dtype": "float32", "shape": [2], "data": b"x" * 4}, 422, "bad_length"),
    ({"dtype": "float32", "shape": [-1], "data": b""}, 422, "bad_shape"),
    ({"dtype": "float32", "shape": [1.5], "data": b""}, 422, "bad_shape"),
    ({"dtype": "float32", "shape": [1] * 9, "data": b"xxxx"}, 422, "bad_shape"),
    ({"dtype": "float32", "shape": [1 << 40, 1 << 40], "data": b""}, 422, "bad_length"),
    ({"dtype": "float32", "shape": [1]}, 400, "bad_tensor"),
    ({"dtype": "float32", "shape": [1], "data": "text"}, 400, "bad_tensor"),
    ({"dtype": "float32", "shape": [1], "data": b"xxxx", "extra": 1}, 400, "bad_tensor"),
    ([1, 2], 400, "bad_tensor"),
])
def test_refusals(obj, status, code):
    with pytest.raises(ProtocolError) as err:
        decode_tensor(obj)
    assert (err.value.status, err.value.code) == (status, code)


def test_declared_size_limit_checked_before_length():
    with pytest.raises(ProtocolError) as err:
        decode_tensor({"dtype": "float64", "shape": [1 << 30], "data": b""}, max_bytes=1 << 20)
    assert err.value.code == "tensor_too_large"


@pytest.mark.parametrize("body", [b"", b"\xc1", b"\x92\x01", msgpack.packb(msgpack.ExtType(5, b"x"))])
def test_unpack_refuses_malformed_truncated_and_ext(body):
    with pytest.raises(ProtocolError) as err:
        unpack(body)
    assert err.value.status == 400 and err.value.code == "bad_msgpack"
