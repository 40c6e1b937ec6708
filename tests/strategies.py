"""hypothesis strategies of wire data shared by the fuzz tests (tests/test_fuzz.py) and the schemathesis run
(tests/test_schemathesis.py): plain msgpack values, push metas, and the hostile tests' model's gradients."""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=True),
                    st.text(max_size=12), st.binary(max_size=24))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=5)),
                      max_leaves=20)


def rarely(draw) -> bool:
    """True about one time in ten (``not draw(st.integers(0, 9))`` would be true far more often: hypothesis
    favours boundary values)."""
    return draw(st.sampled_from([False] * 9 + [True]))


@st.composite
def push_metas(draw, worker_ids=st.one_of(st.text(max_size=20), values),
               steps=st.one_of(st.integers(-5, 2**64 - 1), values)):
    """A push's meta: every field sometimes missing or mistyped, sometimes an unknown field."""
    obj = {"worker_id": draw(worker_ids), "step": draw(steps),
           "loss": draw(st.one_of(st.none(), st.floats(), values)),
           "num_examples": draw(st.one_of(st.none(), st.integers(-5, 2**64 - 1), values)),
           "timings": draw(st.one_of(st.none(), st.dictionaries(st.sampled_from(["fetch", "compute", "push", "x"]),
                                                               st.one_of(st.floats(), values), max_size=4), values)),
           "shm_seq": draw(st.one_of(st.none(), st.integers(-5, 2**64 - 1), values))}
    for key in draw(st.lists(st.sampled_from(sorted(obj)), max_size=3)):
        obj.pop(key, None)
    if rarely(draw):
        obj[draw(st.text(max_size=8))] = draw(values)
    return obj


@st.composite
def gradients(draw, shapes: dict[str, tuple[int, ...]]):
    """Tensors for a model of ``shapes``: mostly its names, shapes and float32, any values (NaN and Inf too);
    sometimes another dtype or shape, a tensor missing or one too many."""
    out = {}
    for name, shape in shapes.items():
        dtype = draw(st.sampled_from([np.float64, np.float16, np.int32])) if rarely(draw) else np.float32
        if rarely(draw):
            shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, max_side=4))
        out[name] = draw(hnp.arrays(dtype, shape))
    if rarely(draw):
        del out[draw(st.sampled_from(sorted(shapes)))]
    if rarely(draw):
        out[draw(st.text(min_size=1, max_size=8))] = np.zeros(2, np.float32)
    return out
