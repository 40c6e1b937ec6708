"""Each PS optimizer against a reference written out here from the published update formulas
(TensorFlow 1.x: GradientDescent, Momentum (+Nesterov), Adam (Kingma & Ba with TF's epsilon hat), Adagrad);
TF1 Adam bit for bit against TF1's kernel in float32; the torch flavour's specs, buffers and restores
(torch's formulas against torch itself: tests/test_torch_optim.py)."""
import math

import numpy as np
import pytest

from ps_service.core.optimizers import SLOT_NAMES, Optimizer, normalize_spec
from shared.compression import SparseTensor
from ps_service.http import REFUSALS, status_of

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


@pytest.mark.parametrize("spec", [
    {"name": "rmsprop"}, {"name": "sgd", "learning_rate": -1}, {"name": "sgd", "learning_rate": float("nan")},
    {"name": "adam", "beta1": 1.0}, {"name": "sgd", "momentum": 0.9}, {"name": "momentum", "nesterov": 1},
    {"name": "adagrad", "initial_accumulator_value": 0.0},
])
def test_bad_specs_are_422(spec):
    with pytest.raises(REFUSALS) as err:
        normalize_spec(spec)
    assert status_of(err.value) == 422 and err.value.code == "bad_optimizer"


def test_consuming_the_gradient_is_bit_identical():
    w0 = np.random.default_rng(2).standard_normal((50,)).astype(np.float32)
    grads = grads_sequence(w0.shape, np.float32)
    plain, _ = run({"name": "sgd", "learning_rate": 0.5}, w0, grads)
    w = {"w": w0.copy()}
    opt = Optimizer({"name": "sgd", "learning_rate": 0.5}, w)
    for g in grads:
        opt.apply(w, {"w": g.copy()}, consume=True)
    assert w["w"].tobytes() == plain.tobytes()


def entries_of(dense: np.ndarray, rng) -> SparseTensor:
    """``dense`` as entries at a random strictly increasing set holding every nonzero of it (zeros, -0.0
    included, among the entries too): +0.0 off them."""
    flat = dense.reshape(-1)
    idx = np.flatnonzero((flat != 0) | np.signbit(flat) | (rng.random(flat.size) < 0.3))
    return SparseTensor(dense.shape, idx.astype(np.intp), flat[idx].copy())


@pytest.mark.parametrize("spec", [{"name": "sgd", "learning_rate": 0.37},
                                  {"name": "momentum", "learning_rate": 0.1, "momentum": 0.9},
                                  {"name": "sgd", "learning_rate": 0.2, "flavor": "torch"}])
@pytest.mark.parametrize("mean_of", [1, 3])
def test_a_gradient_given_as_entries_updates_the_weights_bit_for_bit_as_the_dense_one(spec, mean_of):
    """A round's sum of top-k pushes comes to the optimizer as its entries (SparseTensor, +0.0 elsewhere): TF1 SGD
    updates those entries only and says which bits changed (``touched``), every other rule takes it made dense; the weights (-0.0,
    +0.0 and the rest) end bit for bit where the dense gradient takes them, step after step."""
    rng = np.random.default_rng(5)
    w0 = rng.choice(np.array([0.0, -0.0, 1.5, -2.0, 1e-30, 3.25], np.float32), (6, 40))
    dense_w, sparse_w = {"w": w0.copy()}, {"w": w0.copy()}
    dense_opt, sparse_opt = Optimizer(spec, dense_w), Optimizer(spec, sparse_w)
    assert sparse_opt.touched.entries is None
    for step in range(4):
        g = rng.choice(np.array([0.0, -0.0, 0.5, -1.25, 7.0], np.float32), w0.shape) * (rng.random(w0.shape) < 0.2)
        g[0, :3] = [-0.0, 0.0, -0.0]
        before = dense_w["w"].reshape(-1).view(np.uint32).copy()
        dense_opt.apply(dense_w, {"w": g.copy()}, consume=True, mean_of=mean_of)
        entries = entries_of(g, rng)
        sparse_opt.apply(sparse_w, {"w": entries}, consume=True, mean_of=mean_of)
        assert sparse_w["w"].tobytes() == dense_w["w"].tobytes(), step
        touched = sparse_opt.touched
        assert touched.iterations == step + 1 and touched.serial == sparse_opt.serial
        if spec["name"] == "sgd" and "flavor" not in spec:
            changed = np.flatnonzero(before != dense_w["w"].reshape(-1).view(np.uint32))
            assert touched.entries["w"].tolist() == changed.tolist()  # exactly the entries whose bits changed
        else:
            assert touched.entries == {}  # changed anywhere
    for key in SLOT_NAMES[dense_opt.name]:
        assert sparse_opt.slots[key]["w"].tobytes() == dense_opt.slots[key]["w"].tobytes()


def test_entries_not_consumed_are_made_dense_and_the_caller_s_values_kept():
    w = {"w": np.ones(10, np.float32)}
    opt = Optimizer({"name": "sgd", "learning_rate": 0.5}, w)
    g = SparseTensor((10,), np.array([2, 7], np.intp), np.array([1.0, -2.0], np.float32))
    opt.apply(w, {"w": g})
    assert w["w"].tolist() == [1, 1, 0.5, 1, 1, 1, 1, 2, 1, 1] and g.values.tolist() == [1.0, -2.0]
    assert opt.touched.entries == {}
    opt.load_state(9, {})
    assert opt.touched.iterations == 9 and opt.touched.entries is None


# ---- TF1 Adam, bit for bit (training_ops.cc, ApplyAdamNonCuda) -----------------------------------

def tf1_adam_float32(w0, grads, lr, b1=0.9, b2=0.999, eps=1e-8):
    """TF1's Adam kernel element by element in float32 (numpy scalars round every operation): beta powers
    are float32 variables multiplied by beta once per step; alpha = lr * sqrt(1 - p2) / (1 - p1);
    m += (g - m) * (1 - b1); v += (g * g - v) * (1 - b2); w -= m * alpha / (sqrt(v) + eps)."""
    f = np.float32
    out, ms, vs = [], [], []
    for i, w in enumerate(w0.ravel()):
        m = v = f(0)
        p1, p2 = f(b1), f(b2)
        for t, garr in enumerate(grads):
            if t:
                p1, p2 = p1 * f(b1), p2 * f(b2)
            g = garr.ravel()[i]
            alpha = f(lr) * np.sqrt(f(1) - p2) / (f(1) - p1)
            m = m + (g - m) * (f(1) - f(b1))
            v = v + (g * g - v) * (f(1) - f(b2))
            w = w - m * alpha / (np.sqrt(v) + f(eps))
        out.append(w)
        ms.append(m)
        vs.append(v)
    return [np.array(x, np.float32).reshape(w0.shape) for x in (out, ms, vs)]


def test_tf1_adam_first_step_is_tf1s_in_float32():
    """The issue's example: one float32 element at 0, gradient 1e-3, Adam lr 0.01: TF1's v is 9.999872e-10
    (computing 1 - beta2 in float64 and v = b2 * v + (1 - b2) * g^2 gave 1.0000002e-9)."""
    w = {"w": np.zeros(1, np.float32)}
    opt = Optimizer({"name": "adam", "learning_rate": 0.01}, w)
    opt.apply(w, {"w": np.full(1, 1e-3, np.float32)})
    assert opt.slots["v"]["w"][0] == np.float32(9.999872e-10)
    assert opt.slots["m"]["w"][0] == np.float32(1e-3) * (np.float32(1) - np.float32(0.9))


@pytest.mark.parametrize("lr,b1,b2,eps", [(0.001, 0.9, 0.999, 1e-8), (0.01, 0.8, 0.99, 1e-6)])
def test_tf1_adam_is_bit_identical_to_the_kernel_in_float32(lr, b1, b2, eps):
    w0 = np.random.default_rng(5).standard_normal((17,)).astype(np.float32)
    grads = [g * np.float32(1e-2) for g in grads_sequence(w0.shape, np.float32, seed=8)] * 4  # 28 steps
    w = {"w": w0.copy()}
    opt = Optimizer({"name": "adam", "learning_rate": lr, "beta1": b1, "beta2": b2, "epsilon": eps}, w)
    for g in grads:
        opt.apply(w, {"w": g})
    want_w, want_m, want_v = tf1_adam_float32(w0, grads, lr, b1, b2, eps)
    assert w["w"].tobytes() == want_w.tobytes()
    assert opt.slots["m"]["w"].tobytes() == want_m.tobytes()
    assert opt.slots["v"]["w"].tobytes() == want_v.tobytes()


def test_tf1_adam_restored_mid_run_continues_bit_identically_in_float32():
    """The beta powers are running float32 products: a restored optimizer rebuilds them from iterations."""
    w0 = np.random.default_rng(6).standard_normal((9,)).astype(np.float32)
    grads = grads_sequence(w0.shape, np.float32) * 3
    full, _ = run({"name": "adam", "learning_rate": 0.01}, w0, grads)
    w = {"w": w0.copy()}
    first = Optimizer({"name": "adam", "learning_rate": 0.01}, w)
    for g in grads[:11]:
        first.apply(w, {"w": g})
    second = Optimizer(first.state()["spec"], w)
    second.load_state(first.iterations, first.slots)
    for g in grads[11:]:
        second.apply(w, {"w": g})
    assert w["w"].tobytes() == full.tobytes()


# ---- torch flavour: the spec (its formulas against torch itself: tests/test_torch_optim.py) ---------

@pytest.mark.parametrize("spec,name", [
    ({"name": "sgd", "flavor": "torch"}, "sgd"),
    ({"name": "sgd", "flavor": "torch", "momentum": 0.9}, "momentum"),
    ({"name": "momentum", "flavor": "torch", "momentum": 0.0}, "sgd"),
    ({"name": "adam", "flavor": "torch"}, "adam"),
    ({"name": "adamw", "flavor": "torch"}, "adamw"),
    ({"name": "adagrad", "flavor": "torch"}, "adagrad"),
])
def test_torch_specs_take_torchs_defaults_and_are_named_by_their_slots(spec, name):
    from ps_service.core.torch_rules import HYPERPARAMS as TORCH

    out = normalize_spec(spec)
    assert out["name"] == name and out["flavor"] == "torch"
    assert normalize_spec(out) == out  # idempotent: what a checkpoint stores restores as it is
    assert out["learning_rate"] == TORCH[name]["learning_rate"]
    assert set(out) == {"name", "flavor", *TORCH[name]}


def test_tf1_specs_are_unchanged_by_the_flavours():
    assert normalize_spec({"name": "adam", "learning_rate": 0.1}) == normalize_spec(
        {"name": "adam", "learning_rate": 0.1, "flavor": "tf1"}) == {
        "name": "adam", "learning_rate": 0.1, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8}


@pytest.mark.parametrize("spec", [
    {"name": "adamw"}, {"name": "adam", "flavor": "jax"}, {"name": "adam", "flavor": "torch", "amsgrad": True},
    {"name": "sgd", "flavor": "torch", "nesterov": True},
    {"name": "sgd", "flavor": "torch", "momentum": 0.9, "dampening": 0.1, "nesterov": True},
    {"name": "adam", "flavor": "torch", "beta2": 1.0}, {"name": "adagrad", "flavor": "torch", "lr_decay": -1},
    {"name": "sgd", "flavor": "torch", "weight_decay": float("inf")},
])
def test_bad_torch_specs_are_422(spec):
    with pytest.raises(REFUSALS) as err:
        normalize_spec(spec)
    assert status_of(err.value) == 422 and err.value.code == "bad_optimizer"


@pytest.mark.parametrize("spec", [{"name": "adam", "learning_rate": 0.01},
                                  {"name": "adam", "flavor": "torch", "weight_decay": 0.1}])
def test_buffers_take_the_round_aggregate_and_no_optimizer_step(spec):
    w = {"buffer:bn.running_mean": np.ones(3, np.float32), "w": np.ones(3, np.float32)}
    opt = Optimizer(spec, w)
    mean = np.array([0.5, -2.0, 7.0], np.float32)
    opt.apply(w, {"buffer:bn.running_mean": mean.copy(), "w": np.ones(3, np.float32)})
    assert w["buffer:bn.running_mean"].tobytes() == mean.tobytes()
    assert not np.array_equal(w["w"], np.ones(3, np.float32))


@pytest.mark.parametrize("spec", [
    {"name": "adam", "learning_rate": 0.01}, {"name": "momentum", "learning_rate": 0.1, "nesterov": True},
    {"name": "sgd", "flavor": "torch", "learning_rate": 0.1, "momentum": 0.9, "dampening": 0.2},
    {"name": "adamw", "flavor": "torch", "learning_rate": 0.01},
    {"name": "adagrad", "flavor": "torch", "learning_rate": 0.1, "lr_decay": 0.1},
], ids=lambda s: f"{s.get('flavor', 'tf1')}-{s['name']}")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_restored_optimizer_continues_bit_identically(spec, dtype):
    """What a checkpoint keeps (spec, iterations, slots named by SLOT_NAMES) is all an optimizer needs."""
    w0 = np.random.default_rng(4).standard_normal((33,)).astype(dtype)
    grads = grads_sequence(w0.shape, dtype) * 2
    full, _ = run(spec, w0, grads)
    w = {"w": w0.copy()}
    first = Optimizer(spec, w)
    for g in grads[:5]:
        first.apply(w, {"w": g})
    state = first.state()
    assert set(state["slots"]) == set(SLOT_NAMES[state["spec"]["name"]])
    second = Optimizer(normalize_spec(state["spec"]), w)
    second.load_state(state["iterations"], state["slots"])
    for g in grads[5:]:
        second.apply(w, {"w": g})
    assert w["w"].tobytes() == full.tobytes()


def test_the_torch_flavour_refuses_float16_weights():
    with pytest.raises(REFUSALS) as err:
        Optimizer({"name": "adam", "flavor": "torch"}, {"w": np.zeros(3, np.float16)})
    assert status_of(err.value) == 422 and "float16" in err.value.detail
