"""Which examples a worker takes at a step: a shard of the round's global batch (numpy only, no torch).

The data is one endless stream of example indices: epoch ``e`` is ``range(n)`` permuted by a generator seeded with
``(seed, e)`` (in order without ``shuffle``). At global step ``s`` with the round's ranks ``R`` (batch ``B`` each),
the global batch is stream positions ``[s * len(R) * B, (s + 1) * len(R) * B)`` and the worker at position ``k`` in
``R`` takes the ``k``-th block of ``B``: concatenated in rank order, exactly what one process with batch
``len(R) * B`` reads (docs/torch.md, "Sharding").
"""
from __future__ import annotations

from functools import lru_cache
from typing import Callable, Iterator

import numpy as np


@lru_cache(maxsize=4)
def _epoch(n: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    order = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
    order.flags.writeable = False
    return order


def stream(n: int, start: int, count: int, seed: int = 0, shuffle: bool = True) -> np.ndarray:
    """Stream positions ``[start, start + count)`` of a dataset of ``n`` examples: their indices."""
    if n < 1 or start < 0 or count < 0:
        raise ValueError(f"need n >= 1, start >= 0, count >= 0 (got n={n}, start={start}, count={count})")
    pos = np.arange(start, start + count)
    out = np.empty(count, np.int64)
    for epoch in np.unique(pos // n):
        sel = pos // n == epoch
        out[sel] = _epoch(n, seed, int(epoch), shuffle)[pos[sel] % n]
    return out


def round_batch(n: int, step: int, position: int, workers: int, batch_size: int, seed: int = 0,
                shuffle: bool = True) -> np.ndarray:
    """The indices of the worker at ``position`` of ``workers`` at global step ``step``."""
    if not 0 <= position < workers:
        raise ValueError(f"position {position} is not in [0, {workers})")
    return stream(n, (step * workers + position) * batch_size, batch_size, seed, shuffle)


class RoundBatchSampler:
    """A ``batch_sampler`` for ``torch.utils.data.DataLoader``: this worker's indices for each step until ``round()``
    (``(step, position, workers)`` of the round whose weights the model holds) says None. A loader that asks ahead
    (``num_workers > 0``) gets the steps after it, sharded as known when it asked; a step that goes back (the PS
    restarted from a checkpoint) is followed."""

    def __init__(self, round: Callable[[], tuple[int, int, int] | None], n: int, batch_size: int,
                 seed: int = 0, shuffle: bool = True) -> None:
        if n < 1 or batch_size < 1:
            raise ValueError("the dataset and the batch must hold at least one example")
        self.round, self.n, self.batch_size, self.seed, self.shuffle = round, n, batch_size, seed, shuffle
        self._next = 0
        self._seen = -1

    def __iter__(self) -> Iterator[list[int]]:
        while (now := self.round()) is not None:
            step, position, workers = now
            if step < self._seen:  # the PS went back (restarted from a checkpoint): follow it
                self._next = step
            self._seen = step
            step = max(step, self._next)
            self._next = step + 1
            yield round_batch(self.n, step, position, workers, self.batch_size, self.seed, self.shuffle).tolist()
