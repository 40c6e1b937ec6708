"""Wire codec: numpy tensors <-> msgpack, without pickle.

A tensor on the wire is the msgpack map ``{"dtype": str, "shape": [int, ...],
"data": bin}``: C order, little-endian. ``dtype`` comes from :data:`DTYPES`
(the allow-list); nothing else is ever decoded. Decoding checks the dtype,
the shape and the byte length *before* anything is allocated, and returns a
read-only ``np.frombuffer`` view over the received bytes (no copy). Encoding
hands msgpack a memoryview of the array (no intermediate ``tobytes``).

Every refusal is a :class:`shared.errors.ProtocolError` (400 for a body that is
not valid msgpack of the right form, 422 for a tensor that is well-formed but
not acceptable).
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import msgpack
import numpy as np

from shared.errors import ProtocolError, bad_request, unprocessable

#: wire name -> numpy dtype (always little-endian). bfloat16 is not offered:
#: numpy has no native type for it.
DTYPES: dict[str, np.dtype] = {
    "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
}
FLOAT_DTYPES = frozenset({"float16", "float32", "float64"})
MAX_NDIM = 8
MAX_TENSORS = 4096
MAX_NAME_LEN = 256


def dtype_name(dtype: np.dtype) -> str:
    """The wire name of a numpy dtype, or ProtocolError(422) if not allowed."""
    dt = np.dtype(dtype)
    for name, allowed in DTYPES.items():
        if dt.kind == allowed.kind and dt.itemsize == allowed.itemsize:
            return name
    raise unprocessable("unsupported_dtype", f"dtype {dt} is not in the allow-list {sorted(DTYPES)}")


def encode_tensor(array: np.ndarray) -> dict:
    """The wire map of one array (little-endian, C order; no copy when it already is)."""
    name = dtype_name(array.dtype)
    arr = np.asarray(array, dtype=DTYPES[name])
    if not arr.flags.c_contiguous:
        arr = arr.copy(order="C")
    data = memoryview(arr.reshape(-1)).cast("B") if arr.size else b""
    return {"dtype": name, "shape": list(arr.shape), "data": data}


def encode_tensors(tensors: Mapping[str, np.ndarray]) -> dict:
    return {name: encode_tensor(arr) for name, arr in tensors.items()}


def decode_tensor(obj: Any, name: str = "tensor", max_bytes: int | None = None) -> np.ndarray:
    """Check and view one wire map as a read-only array (no copy, no pickle)."""
    if not isinstance(obj, dict):
        raise bad_request("bad_tensor", f"tensor {name!r} must be a map with dtype, shape, data")
    unknown = set(obj) - {"dtype", "shape", "data"}
    if unknown:
        raise bad_request("bad_tensor", f"tensor {name!r} has unknown fields {sorted(map(str, unknown))}")
    dtype, shape, data = obj.get("dtype"), obj.get("shape"), obj.get("data")
    if not isinstance(dtype, str) or not isinstance(shape, list) or not isinstance(data, (bytes, bytearray, memoryview)):
        raise bad_request("bad_tensor", f"tensor {name!r} needs dtype (str), shape (list of int) and data (bin)")
    if dtype not in DTYPES:
        raise unprocessable("unsupported_dtype", f"tensor {name!r}: dtype {dtype[:32]!r} is not in the allow-list {sorted(DTYPES)}")
    if len(shape) > MAX_NDIM or not all(type(d) is int and d >= 0 for d in shape):
        raise unprocessable("bad_shape", f"tensor {name!r}: shape must be at most {MAX_NDIM} non-negative ints")
    dt = DTYPES[dtype]
    expected = math.prod(shape) * dt.itemsize
    if max_bytes is not None and expected > max_bytes:
        raise unprocessable("tensor_too_large", f"tensor {name!r} declares {expected} bytes, limit {max_bytes}")
    if len(data) != expected:
        raise unprocessable("bad_length", f"tensor {name!r}: shape {shape} of {dtype} needs {expected} bytes, got {len(data)}")
    arr = np.frombuffer(data, dtype=dt).reshape(shape)
    arr.flags.writeable = False
    return arr


def decode_tensors(obj: Any, max_bytes: int | None = None) -> dict[str, np.ndarray]:
    if not isinstance(obj, dict):
        raise bad_request("bad_tensors", "tensors must be a map of name -> tensor")
    if len(obj) > MAX_TENSORS:
        raise unprocessable("too_many_tensors", f"at most {MAX_TENSORS} tensors")
    out = {}
    for name, value in obj.items():
        if not isinstance(name, str) or not name or len(name) > MAX_NAME_LEN:
            raise bad_request("bad_tensor_name", f"tensor names are non-empty strings of at most {MAX_NAME_LEN} chars")
        out[name] = decode_tensor(value, name, max_bytes)
    return out


def pack(obj: Any) -> bytes:
    """msgpack bytes of a plain structure (bin for bytes/memoryview)."""
    return msgpack.packb(obj, use_bin_type=True)


def _no_ext(code: int, data: bytes) -> Any:
    raise bad_request("bad_msgpack", f"msgpack extension type {code} is not accepted")


def unpack(body: bytes) -> Any:
    """Parse a msgpack body; anything malformed or truncated is ProtocolError(400)."""
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True, ext_hook=_no_ext, use_list=True)
    except ProtocolError:
        raise
    except (ValueError, TypeError, msgpack.UnpackException, msgpack.ExtraData, RecursionError) as exc:
        raise bad_request("bad_msgpack", f"body is not valid msgpack: {type(exc).__name__}") from None
