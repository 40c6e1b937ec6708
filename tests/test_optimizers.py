"""Each PS optimizer against a reference written out here from the published update formulas
(TensorFlow 1.x: GradientDescent, Momentum (+Nesterov), Adam (Kingma & Ba with TF's epsilon hat), Adagrad)."""
import math

import numpy as np
import pytest

from ps_service.optimizers import Optimizer, normalize_spec
from shared.errors import ProtocolError

STEPS = 7


def grads_sequence(shape, dtype, seed=3):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(dtype) for _ in range(STEPS)]


def run(spec, w0, grads):
    w = {"w": w0.copy()}
    opt = Optimizer(spec, w)
    for g in grads:
        opt.apply(w, {"w": g})
    return w["w"], opt


def reference(spec, w0, grads):
    """Scalar-by-scalar formulas in float64 Python, independent of the implementation."""
    s = normalize_spec(spec)
    lr = s["learning_rate"]
    out = []
    for i, w in enumerate(w0.astype(np.float64).ravel().tolist()):
        a, m, v = (s.get("initial_accumulator_value", 0.0) if s["name"] == "adagrad" else 0.0), 0.0, 0.0
        for t, garr in enumerate(grads, start=1):
            g = float(garr.ravel()[i])
            if s["name"] == "sgd":
                w = w - lr * g
            elif s["name"] == "momentum":
                a = s["momentum"] * a + g
                w = w - (lr * g + lr * s["momentum"] * a if s["nesterov"] else lr * a)
            elif s["name"] == "adam":
                b1, b2 = s["beta1"], s["beta2"]
                m = b1 * m + (1 - b1) * g
                v = b2 * v + (1 - b2) * g * g
                lr_t = lr * math.sqrt(1 - b2**t) / (1 - b1**t)
                w = w - lr_t * m / (math.sqrt(v) + s["epsilon"])
            elif s["name"] == "adagrad":
                a = a + g * g
                w = w - lr * g / math.sqrt(a)
        out.append(w)
    return np.array(out).reshape(w0.shape)


SPECS = [
    {"name": "sgd", "learning_rate": 0.5},
    {"name": "momentum", "learning_rate": 0.1, "momentum": 0.9},
    {"name": "momentum", "learning_rate": 0.1, "momentum": 0.8, "nesterov": True},
    {"name": "adam", "learning_rate": 0.001},
    {"name": "adam", "learning_rate": 0.01, "beta1": 0.8, "beta2": 0.99, "epsilon": 1e-6},
    {"name": "adagrad", "learning_rate": 0.1},
    {"name": "adagrad", "learning_rate": 0.3, "initial_accumulator_value": 0.5},
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: "-".join(f"{v}" for v in s.values()))
@pytest.mark.parametrize("dtype,rtol", [("float64", 1e-12), ("float32", 2e-5)])
def test_matches_published_formula(spec, dtype, rtol):
    w0 = np.random.default_rng(1).standard_normal((4, 3)).astype(dtype)
    grads = grads_sequence(w0.shape, dtype)
    got, opt = run(spec, w0, grads)
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_allclose(got, reference(spec, w0, grads), rtol=rtol, atol=rtol * 1e-3)
    assert opt.iterations == STEPS


def test_state_round_trip_continues_identically():
    spec = {"name": "adam", "learning_rate": 0.01}
    w0 = np.ones((5,), np.float64)
    grads = grads_sequence(w0.shape, np.float64)
    full, _ = run(spec, w0, grads)
    w = {"w": w0.copy()}
    first = Optimizer(spec, w)
    for g in grads[:3]:
        first.apply(w, {"w": g})
    state = first.state()
    second = Optimizer(state["spec"], w)
    second.load_state(state["iterations"], state["slots"])
    for g in grads[3:]:
        second.apply(w, {"w": g})
    np.testing.assert_array_equal(w["w"], full)


@pytest.mark.parametrize("spec", [
    {"name": "rmsprop"}, {"name": "sgd", "learning_rate": -1}, {"name": "sgd", "learning_rate": float("nan")},
    {"name": "adam", "beta1": 1.0}, {"name": "sgd", "momentum": 0.9}, {"name": "momentum", "nesterov": 1},
    {"name": "adagrad", "initial_accumulator_value": 0.0},
])
def test_bad_specs_are_422(spec):
    with pytest.raises(ProtocolError) as err:
        normalize_spec(spec)
    assert err.value.status == 422 and err.value.code == "bad_optimizer"


def test_consuming_the_gradient_is_bit_identical():
    w0 = np.random.default_rng(2).standard_normal((50,)).astype(np.float32)
    grads = grads_sequence(w0.shape, np.float32)
    plain, _ = run({"name": "sgd", "learning_rate": 0.5}, w0, grads)
    w = {"w": w0.copy()}
    opt = Optimizer({"name": "sgd", "learning_rate": 0.5}, w)
    for g in grads:
        opt.apply(w, {"w": g.copy()}, consume=True)
    assert w["w"].tobytes() == plain.tobytes()
