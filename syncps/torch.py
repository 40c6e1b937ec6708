"""Train a PyTorch model with a syncps PS, from the user's own loop (docs/torch.md).

    ps = syncps.torch.connect(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    loader = DataLoader(dataset, batch_sampler=ps.batch_sampler(dataset, batch_size=32))
    for x, y in loader:                    # ends when the PS says the job is done
        ps.zero_grad()
        loss_fn(model(x), y).backward()
        ps.step()                          # push every p.grad, wait for the round, load the new weights
    ps.close()                             # or `with connect(...) as ps:`; leaves the cluster

Contract: :class:`DistributedOptimizer` (Horovod's ``DistributedOptimizer`` and TF's ``SyncReplicasOptimizer`` in
one object; the PS runs the optimizer) does each call as docs/torch.md's API table says: it registers (the first
worker initialises the PS with :mod:`syncps.tensors`' tensors and :func:`syncps.spec.optimizer_spec`), keeps the
lease with a heartbeat thread, pushes and loads in ``step()`` (a refused push raises :class:`GradientRejected`
naming the parameter), registers again when the PS forgets it, and leaves in ``close()``. Defaults come from the
stock worker's ``WORKER_*`` settings, so a script runs under Compose like the stock worker.
"""
from __future__ import annotations

import logging
import re
import signal
import threading
import time
from typing import Any, Mapping

try:
    import torch
except ImportError as exc:  # pragma: no cover - exercised by tests/test_torch_free.py
    raise ImportError("syncps.torch needs PyTorch: pip install -e '.[torch]'") from exc

from shared.compression import BUFFER_PREFIX
from shared.errors import ProtocolError
from syncps.job import TorchJob
from syncps.sampling import RoundBatchSampler
from syncps.spec import optimizer_spec
from syncps.tensors import ModelMismatch, ModelTensors
from worker_service.threads import torch_threads
from worker_service.client import PSClient
from worker_service.loop import REJOIN_CODES, Heartbeat, pull_wait
from worker_service.settings import WorkerSettings
from worker_service.stopping import StopFlag

__all__ = ["DistributedOptimizer", "GradientRejected", "ModelMismatch", "TorchJob", "connect", "optimizer_spec"]
log = logging.getLogger("syncps.torch")
_NAMED = re.compile(r"tensor ('[^']*'|\"[^\"]*\")")
REJOIN_ATTEMPTS = 5


class GradientRejected(ProtocolError):
    """The PS refused a push (4xx); ``parameter`` is the module's name of the tensor it named (or None)."""

    def __init__(self, exc: ProtocolError, parameter: str | None, hint: str = "") -> None:
        super().__init__(exc.status, exc.code, exc.detail)
        self.parameter = parameter
        what = f"parameter {parameter!r}" if parameter else "the push"
        self.args = (f"the PS refused the gradient of {what}: {exc.status} {exc.code}: {exc.detail}"
                     + (f" ({hint})" if hint else ""),)


def _number(value: Any) -> float | None:
    return None if value is None else float(value.detach()) if isinstance(value, torch.Tensor) else float(value)


class DistributedOptimizer:
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | Mapping[str, Any], *,
                 url: str | None = None, name: str | None = None, token: str | None = None,
                 shm_dir: str | None = None, timeout: float | None = None, retry_timeout: float | None = None,
                 buffers: str = "mean", allow_unused: bool = False, handle_sigterm: bool = True) -> None:
        s = WorkerSettings()
        self.model = model
        self.tensors = ModelTensors(model, buffers)
        self.spec = dict(optimizer) if isinstance(optimizer, Mapping) else self._spec_of(optimizer)
        self.allow_unused = allow_unused
        self.name = name or s.name
        self.client = PSClient(url or s.ps_url, timeout=timeout or s.request_timeout_seconds,
                               attempts=s.retry_attempts, retry_timeout=retry_timeout or s.retry_timeout_seconds,
                               token=token if token is not None else s.auth_token,
                               shm_dir=s.shm_dir if shm_dir is None else shm_dir)
        self.client.wait_ready(retry_timeout or s.retry_timeout_seconds)
        self._stop = StopFlag()  # set by SIGTERM's handler: must take no lock (worker_service/stopping.py)
        self._done = False
        self._step, self._ranks = 0, ()
        self._times = {"fetch": 0.0, "compute": 0.0, "push": 0.0}
        self._old_sigterm = None
        try:
            reg = self._join()
        except BaseException:
            self.client.close()
            raise
        self._wait = pull_wait(reg["lease_seconds"])
        self.heartbeat = Heartbeat.of(self.client, self.worker_id, reg["lease_seconds"])
        if handle_sigterm and threading.current_thread() is threading.main_thread():
            self._old_sigterm = signal.signal(signal.SIGTERM, lambda *_: self._stop.set())
        log.info("registered as %r: rank %d, tensors through %s; %s", self.name, self.rank, self.client.transport,
                 torch_threads(torch))
        try:
            self._advance(reg["start_step"])
        except BaseException:
            self.close()
            raise

    def _spec_of(self, opt: torch.optim.Optimizer) -> dict[str, Any]:
        covered = {id(p) for g in opt.param_groups for p in g["params"]}
        left = [n for n, p in self.tensors.params.items() if id(p) not in covered]
        if left:
            raise ValueError(f"the optimizer does not cover parameters {left[:4]} that require grad: "
                             "give it every parameter, or freeze those (requires_grad_(False))")
        return optimizer_spec(opt)

    # ---- state --------------------------------------------------------------------------------
    ranks = property(lambda self: self._ranks)
    position = property(lambda self: self._ranks.index(self.rank))
    step_count = property(lambda self: self._step)
    done = property(lambda self: self._done)
    should_stop = property(lambda self: self._done or self._stop.is_set())

    def stop(self) -> None:
        """Ask the loop to end (``should_stop`` turns True); what SIGTERM does."""
        self._stop.set()

    # ---- the loop -----------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=set_to_none)

    def step(self, loss: Any = None, num_examples: int | None = None) -> str:
        """Push the gradients of the current weights, wait for the round, load its weights."""
        if self.should_stop:
            return "done" if self._done else "stopped"
        t0 = time.monotonic()
        compute = t0 - self._loaded_at
        grads = self.tensors.grads(self.allow_unused)
        try:
            res = self.client.push(self.worker_id, self._step, grads, _number(loss), num_examples, self._times)
            t1 = time.monotonic()
            self._advance(self._step + 1)
        except ProtocolError as exc:
            if exc.code not in REJOIN_CODES:
                raise self._explain(exc, grads) from None
            self._rejoin(exc)
            return "rejoined"
        self._times = {"fetch": time.monotonic() - t1, "compute": compute, "push": t1 - t0}
        return res["status"]

    def batch_sampler(self, dataset: Any, batch_size: int, shuffle: bool = True, seed: int = 0) -> RoundBatchSampler:
        """A ``DataLoader(dataset, batch_sampler=...)`` sampler: this worker's shard of each round's batch."""
        n = dataset if isinstance(dataset, int) else len(dataset)
        return RoundBatchSampler(lambda: None if self.should_stop else (self._step, self.position, len(self._ranks)),
                                 n, batch_size, seed, shuffle)

    # ---- joining ------------------------------------------------------------------------------
    def _join(self) -> dict:
        reg = self.client.join(self.name, lambda mode: (self.tensors.init_tensors(), self.spec))
        self.worker_id, self.rank = reg["worker_id"], reg["rank"]
        return reg

    def _advance(self, min_step: int) -> None:
        """Pull until the weights of a round this worker takes part in (or the end), and load them."""
        while not self._stop.is_set():
            pulled = self.client.pull(min_step, self.worker_id, self._wait)
            if pulled is None:
                continue
            self.tensors.check(pulled.tensors)  # just registered: a PS restored for another model stops us here
            self._step, self._ranks, self._done = pulled.step, tuple(pulled.ranks), pulled.done
            if pulled.done or self.rank in self._ranks:
                self.tensors.load(pulled.tensors)
                break
            min_step = pulled.step + 1  # joined mid-round: not in this round
        self._loaded_at = time.monotonic()

    def _rejoin(self, exc: ProtocolError) -> None:
        for attempt in range(REJOIN_ATTEMPTS):
            log.warning("PS says %s (%s): registering again", exc.code, exc.detail)
            try:
                reg = self._join()
                self.heartbeat.worker_id = self.worker_id
                log.warning("registered again as rank %d: the PS is at step %d, this worker was at step %d",
                            self.rank, reg["global_step"], self._step)
                self._advance(reg["start_step"])
                return
            except ProtocolError as again:
                if again.code not in REJOIN_CODES or attempt == REJOIN_ATTEMPTS - 1:
                    raise
                exc = again

    def _explain(self, exc: ProtocolError, grads: Mapping[str, Any]) -> ProtocolError:
        """The PS's refusal of a push as a :class:`GradientRejected` naming the module's parameter."""
        if exc.status != 422:
            return exc
        found = _NAMED.search(exc.detail)
        ps_name = found.group(1)[1:-1] if found else None
        hint = ""
        if ps_name in self.tensors.params and ps_name not in grads:
            hint = "its .grad is None: it took no part in the loss; allow_unused=True pushes zeros for it"
        elif ps_name is not None and ps_name not in self.tensors.all:
            hint = "this model has no such tensor: every worker must build the same model"
        elif exc.code == "nonfinite_gradient":
            hint = "check the loss and the learning rate"
        elif "dtype" in exc.detail:
            hint = "build the model in the PS's dtype, e.g. model.float()"
        return GradientRejected(exc, ps_name.removeprefix(BUFFER_PREFIX) if ps_name else None, hint)

    # ---- leaving ------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the heartbeat and leave the cluster (idempotent)."""
        if self.client is None:
            return
        self._stop.set()  # should_stop from now on: step() does nothing
        self.heartbeat.halt.set()
        try:
            self.client.leave(self.worker_id)
        except Exception as exc:  # the PS may be gone: its lease runs out instead
            log.warning("could not leave the cluster: %s", exc)
        self.client.close()
        self.client = None
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)

    def __enter__(self) -> "DistributedOptimizer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def connect(model: torch.nn.Module, optimizer: torch.optim.Optimizer | Mapping[str, Any], **options: Any
            ) -> DistributedOptimizer:
    """Join the PS's job with ``model`` (see :class:`DistributedOptimizer` for the options)."""
    return DistributedOptimizer(model, optimizer, **options)
