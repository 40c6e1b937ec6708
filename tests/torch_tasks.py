"""Task factories for ``WORKER_TASK=tests.torch_tasks:<name>``: torch jobs (syncps.job.TorchJob) the tests
train through the stock worker, which wraps them into tasks (syncps/job.py's TorchTask)."""
from __future__ import annotations

import threading

import torch

from syncps.cnn import cnn_job

#: held while a model is built from a seed: torch's global generator is one per process, and worker threads of one
#: test seeding it at once would draw each other's numbers (a model's weights would depend on the timing)
SEEDING = threading.Lock()


def cnn_sgd(seed: int = 0, dtype: str = "float32"):
    """The cnn task with torch.optim.SGD (Nesterov momentum, weight decay) instead of Adam."""
    job = cnn_job(seed, dtype)
    job.optimizer = torch.optim.SGD(job.model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4)
    return job


def cnn_plain_sgd(seed: int = 0, dtype: str = "float32"):
    """The cnn task with plain torch.optim.SGD."""
    job = cnn_job(seed, dtype)
    job.optimizer = torch.optim.SGD(job.model.parameters(), lr=0.05)
    return job


def cnn_momentum(seed: int = 0, dtype: str = "float32"):
    """The cnn task with torch.optim.SGD's momentum (not Nesterov)."""
    job = cnn_job(seed, dtype)
    job.optimizer = torch.optim.SGD(job.model.parameters(), lr=0.05, momentum=0.9)
    return job


def batchnorm(seed: int = 0, dtype: str = "float32"):
    """A linear layer behind a BatchNorm on random data: a model with buffers."""
    gen = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(512, 4, generator=gen) * 3 + 1
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [0.0]])
    with SEEDING, torch.random.fork_rng(devices=[]):  # threads of one test build models at once
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    from syncps.job import TorchJob

    return TorchJob(model=model, dataset=(x, y), loss_fn=torch.nn.functional.mse_loss,
                    optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def cnn_smooth(seed: int = 0, dtype: str = "float32"):
    """The cnn task's layers with tanh and average pooling: a model whose gradient is smooth in the weights."""
    job = cnn_job(seed, dtype)
    job.model.relu1, job.model.relu2, job.model.pool = torch.nn.Tanh(), torch.nn.Tanh(), torch.nn.AvgPool2d(2)
    job.optimizer = torch.optim.Adam(job.model.parameters(), lr=0.003)
    return job
