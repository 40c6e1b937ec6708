"""A small CNN on scikit-learn's 8x8 digits, trained through torch: the stock worker's ``cnn`` task
(``WORKER_TASK=cnn``; needs the ``torch`` and ``mlp`` extras; docs/torch.md, "The ``cnn`` task").

conv 3x3 (1 -> 8) + ReLU, conv 3x3 (8 -> 16) + ReLU, 2x2 max-pool, fully connected 256 -> 10 (3,818 parameters);
cross-entropy, torch.optim.Adam lr 0.003, the initial weights from ``seed``. The data is ``mlp``'s seeded 80/20 split:
``evaluate`` reports the loss and the accuracy on the 360 held-out images.
"""
from __future__ import annotations

from collections import OrderedDict

from worker_service.tasks.mlp import digits_split

CHANNELS = (8, 16)
CLASSES = 10
LEARNING_RATE = 0.003
#: parameters of the model (without torch: bench.run reports it)
PARAMS = (9 * CHANNELS[0] + CHANNELS[0]) + (9 * CHANNELS[0] * CHANNELS[1] + CHANNELS[1]) \
    + (CHANNELS[1] * 16 * CLASSES + CLASSES)


def require_torch():
    """torch, or an ImportError that says which extra brings it."""
    try:
        import torch
    except ImportError:
        raise ImportError("the cnn task needs PyTorch: pip install -e '.[torch,mlp]'") from None
    return torch


def build_model(seed: int = 0, dtype: str = "float32"):
    torch = require_torch()
    from torch import nn

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = nn.Sequential(OrderedDict(
            conv1=nn.Conv2d(1, CHANNELS[0], 3, padding=1), relu1=nn.ReLU(),
            conv2=nn.Conv2d(CHANNELS[0], CHANNELS[1], 3, padding=1), relu2=nn.ReLU(),
            pool=nn.MaxPool2d(2), flatten=nn.Flatten(), fc=nn.Linear(CHANNELS[1] * 16, CLASSES)))
    return model.to(getattr(torch, dtype))


def cnn_job(seed: int = 0, dtype: str = "float32", optimizer=None):
    """The CNN's :class:`syncps.job.TorchJob` (``optimizer``: a PS spec instead of Adam lr 0.003)."""
    torch = require_torch()

    from syncps.job import TorchJob

    (x_train, y_train), (x_test, y_test) = digits_split(dtype)
    as_images = lambda x: torch.from_numpy(x).reshape(-1, 1, 8, 8)  # noqa: E731
    model = build_model(seed, dtype)
    return TorchJob(model=model, dataset=(as_images(x_train), torch.from_numpy(y_train)),
                    loss_fn=torch.nn.functional.cross_entropy,
                    optimizer=optimizer or torch.optim.Adam(model.parameters(), lr=LEARNING_RATE),
                    eval_dataset=(as_images(x_test), torch.from_numpy(y_test)))


def CNNTask(seed: int = 0, dtype: str = "float32"):
    return cnn_job(seed, dtype).task(dtype, name="cnn")
