"""TensorFlow's own ``tf.compat.v1.train`` optimizer applying gradients it is sent, one step per message: the other side
of tests/test_outside_exactness.py, run with a Python that has ``tensorflow`` (not the project's venv).

Messages on stdin and stdout are ``.npz`` archives, each preceded by its length (8 bytes, little endian). The first
holds the weights (by name) and ``spec`` (the PS's normalised optimizer spec, as JSON text); each next one a step's
gradients, answered with the weights after TensorFlow applied them (hyper-parameters as tensors of the weights' dtype:
TF1 makes Python floats float32 tensors). Only numpy and tensorflow are imported.
"""
from __future__ import annotations

import io
import json
import struct
import sys

import numpy as np


def read(stream) -> dict[str, np.ndarray] | None:
    head = stream.read(8)
    if len(head) < 8:
        return None
    with np.load(io.BytesIO(stream.read(struct.unpack("<Q", head)[0]))) as z:
        return {k: z[k] for k in z.files}


def write(stream, arrays: dict[str, np.ndarray]) -> None:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    stream.write(struct.pack("<Q", buf.tell()) + buf.getvalue())
    stream.flush()


def optimizer(tf, s: dict, dtype):
    train = tf.compat.v1.train

    def c(key):
        return tf.constant(s[key], dtype=dtype)
    return {
        "sgd": lambda: train.GradientDescentOptimizer(c("learning_rate")),
        "momentum": lambda: train.MomentumOptimizer(c("learning_rate"), c("momentum"), use_nesterov=s["nesterov"]),
        "adam": lambda: train.AdamOptimizer(c("learning_rate"), c("beta1"), c("beta2"), c("epsilon")),
        "adagrad": lambda: train.AdagradOptimizer(c("learning_rate"), s.get("initial_accumulator_value")),
    }[s["name"]]()


def main() -> None:
    import tensorflow as tf

    src, dst = sys.stdin.buffer, sys.stdout.buffer
    first = read(src)
    spec = json.loads(str(first.pop("spec")))
    names = sorted(first)
    variables = {k: tf.Variable(first[k]) for k in names}
    opt = optimizer(tf, spec, first[names[0]].dtype)
    write(dst, {"tensorflow": np.array(tf.__version__)})
    while (grads := read(src)) is not None:
        opt.apply_gradients([(tf.constant(grads[k]), variables[k]) for k in names])
        write(dst, {k: v.numpy() for k, v in variables.items()})


if __name__ == "__main__":
    main()
