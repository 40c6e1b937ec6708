"""A small classifier on scikit-learn's 8x8 digits (ships inside the package: no download).

64 -> 64 (ReLU) -> 10 (softmax), cross-entropy, Adam lr 0.001. A fixed, seeded
80/20 split: workers train on shards of the 1437 training images; ``evaluate``
reports accuracy on the 360 held-out ones.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from worker_service.tasks import shard_batch_indices

HIDDEN = 64


def digits_split(dtype: str = "float32") -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """((x_train, y_train), (x_test, y_test)): the digits scaled to [0, 1], 64 features per row, a fixed
    80/20 split (it does not depend on the seed)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(dtype)
    y = digits.target.astype(np.int64)
    perm = np.random.default_rng(1234).permutation(len(x))
    cut = int(0.8 * len(x))
    return (x[perm[:cut]], y[perm[:cut]]), (x[perm[cut:]], y[perm[cut:]])


class MLPTask:
    name = "mlp"

    def __init__(self, seed: int = 0, dtype: str = "float32") -> None:
        self.dtype = np.dtype(dtype)
        self.seed = seed
        (self.x_train, self.y_train), (self.x_test, self.y_test) = digits_split(dtype)

    def init_params(self) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(self.seed)
        he = lambda fan_in, shape: (rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)).astype(self.dtype)  # noqa: E731
        return {"w1": he(64, (64, HIDDEN)), "b1": np.zeros(HIDDEN, self.dtype),
                "w2": he(HIDDEN, (HIDDEN, 10)), "b2": np.zeros(10, self.dtype)}

    def optimizer(self) -> dict:
        return {"name": "adam", "learning_rate": 0.001}

    def batch(self, step: int, shard_index: int, shard_count: int, batch_size: int):
        idx = shard_batch_indices(len(self.x_train), step, shard_index, shard_count, batch_size)
        return self.x_train[idx], self.y_train[idx]

    def _forward(self, p: Mapping[str, np.ndarray], x: np.ndarray):
        h_pre = x @ p["w1"] + p["b1"]
        h = np.maximum(h_pre, 0)
        logits = h @ p["w2"] + p["b2"]
        z = logits - logits.max(axis=1, keepdims=True)
        probs = np.exp(z)
        probs /= probs.sum(axis=1, keepdims=True)
        return h_pre, h, probs

    def loss_and_grads(self, params: Mapping[str, np.ndarray], batch) -> tuple[float, dict[str, np.ndarray], int]:
        x, y = batch
        n = len(x)
        h_pre, h, probs = self._forward(params, x)
        loss = float(-np.mean(np.log(probs[np.arange(n), y] + 1e-12)))
        d_logits = probs.copy()
        d_logits[np.arange(n), y] -= 1
        d_logits /= self.dtype.type(n)
        d_h = (d_logits @ params["w2"].T) * (h_pre > 0)
        grads = {"w2": h.T @ d_logits, "b2": d_logits.sum(axis=0), "w1": x.T @ d_h, "b1": d_h.sum(axis=0)}
        return loss, {k: v.astype(self.dtype, copy=False) for k, v in grads.items()}, n

    def evaluate(self, params: Mapping[str, np.ndarray]) -> dict[str, float]:
        _, _, probs = self._forward(params, self.x_test)
        return {"accuracy": float(np.mean(probs.argmax(axis=1) == self.y_test)),
                "loss": float(-np.mean(np.log(probs[np.arange(len(self.y_test)), self.y_test] + 1e-12)))}
