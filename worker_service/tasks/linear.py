"""The classic example: x ~ randn(1000, 3), y = x @ [0.1, 0.2, 0.3] + 0.4; w, b start at 0; SGD lr 0.5.

Loss mean((x @ w + b - y)^2); it converges to w = [0.1, 0.2, 0.3], b = 0.4.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from worker_service.tasks import shard_batch_indices

W_TRUE = np.array([[0.1], [0.2], [0.3]])
B_TRUE = 0.4


class LinearTask:
    name = "linear"

    def __init__(self, seed: int = 0, dtype: str = "float32", n: int = 1000) -> None:
        rng = np.random.default_rng(seed)
        self.dtype = np.dtype(dtype)
        x = rng.standard_normal((n, 3))
        self.x = x.astype(self.dtype)
        self.y = (x @ W_TRUE + B_TRUE).astype(self.dtype)

    def init_params(self) -> dict[str, np.ndarray]:
        return {"w": np.zeros((3, 1), self.dtype), "b": np.zeros((1,), self.dtype)}

    def optimizer(self, mode: str = "sync") -> dict:
        """SGD at 0.5 in sync rounds (one update per round's mean); 0.1 in async and SSP, which apply each worker's
        gradient on its own, computed on older weights: 0.5 diverged there (4 workers: 1e36 within 10 s)."""
        return {"name": "sgd", "learning_rate": 0.5 if mode == "sync" else 0.1}

    def batch(self, step: int, shard_index: int, shard_count: int, batch_size: int):
        idx = shard_batch_indices(len(self.x), step, shard_index, shard_count, batch_size)
        return self.x[idx], self.y[idx]

    def loss_and_grads(self, params: Mapping[str, np.ndarray], batch,
                       out: Mapping[str, np.ndarray] | None = None) -> tuple[float, dict[str, np.ndarray], int]:
        """``out``: arrays to write the gradients into (the same bits: the same operations)."""
        x, y = batch
        err = x @ params["w"] + params["b"] - y
        n = len(x)
        scale = self.dtype.type(2.0 / n)
        out = out or {"w": None, "b": None}
        return float(np.mean(err * err)), {"w": np.multiply(scale, x.T @ err, out=out["w"]),
                                           "b": np.multiply(scale, err.sum(axis=0), out=out["b"])}, n

    def evaluate(self, params: Mapping[str, np.ndarray]) -> dict[str, float]:
        err = self.x @ params["w"] + params["b"] - self.y
        return {"loss": float(np.mean(err * err)),
                "max_abs_error": float(max(np.abs(params["w"] - W_TRUE).max(), np.abs(params["b"] - B_TRUE).max()))}
