"""Task factories for ``WORKER_TASK=tests.numpy_tasks:<name>`` that import numpy and nothing else.

A worker exec'd in a network namespace (bench.hosts: ``ip netns exec``) cannot be forked from the session's zygote
(cluster/forkserver.py), so it pays its task's imports itself: the mlp's scikit-learn took ~13 s before a worker
registered when three started at once on a loaded 2-core machine, more than the rest of an outage test's job.
"""
from __future__ import annotations

import numpy as np

from worker_service.tasks.mlp import MLPTask

ROWS, FEATURES, CLASSES = 1797, 64, 10  # the digits' shape: the mlp's layers unchanged


class SyntheticMLP(MLPTask):
    """The mlp task (64 -> 64 -> 10, Adam: its weights move at every step, so a lost gradient shows in the bits) on
    seeded random rows in [0, 1) and random labels instead of the digits; the same 80/20 split of them."""
    name = "mlp-synthetic"

    def __init__(self, seed: int = 0, dtype: str = "float32") -> None:
        self.dtype = np.dtype(dtype)
        self.seed = seed
        rng = np.random.default_rng(1234)  # the data does not depend on the seed, as the digits do not
        x, y = rng.random((ROWS, FEATURES)).astype(self.dtype), rng.integers(0, CLASSES, ROWS)
        cut = int(0.8 * ROWS)
        (self.x_train, self.y_train), (self.x_test, self.y_test) = (x[:cut], y[:cut]), (x[cut:], y[cut:])
