"""syncps.torch, the in-loop API, against a real PS: an in-process uvicorn PS (tests/live_ps.py) with workers
as threads of this process, or a PS process (for the restart).

Covers: the first worker initialises the PS and the others pull; each step pushes numpy views of ``p.grad``
(no copy) and loads the round's weights into the very parameter tensors; rank, ranks, position and the
DataLoader batch sampler, re-sharding when a worker leaves; BatchNorm buffers averaged at each round; the
end of the job, leaving on close and on SIGTERM; a PS restart; refused gradients raising an exception
that names the parameter, with the 4xx any client gets and the PS unchanged.
"""
from __future__ import annotations

import signal
import threading
from collections import OrderedDict

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cluster.processes import LocalCluster
from shared.errors import ProtocolError
from syncps.tensors import ModelTensors
from syncps.torch import DistributedOptimizer, GradientRejected, ModelMismatch, connect
from tests.live_ps import live_ps, state_hash
from tests.torch_tasks import SEEDING, batchnorm
from tests.timing import allow
from worker_service.client import PSClient

X = torch.randn(256, 3, generator=torch.Generator().manual_seed(0))
Y = X @ torch.tensor([[0.1], [0.2], [0.3]]) + 0.4


def linear(seed: int) -> nn.Module:
    """The same weights for the same seed, also when worker threads build their models at once (seeding torch's
    one global generator is not thread-safe: without the lock a thread's layers could draw from another's seed)."""
    with SEEDING, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(OrderedDict(fc=nn.Linear(3, 2), out=nn.Linear(2, 1)))


def in_threads(*fns) -> list:
    """Run each function in its own thread (workers of one job); their results, or raise their error."""
    results, errors = [None] * len(fns), []

    def run(i, fn):
        try:
            results[i] = fn()
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(allow(120))
    assert not any(t.is_alive() for t in threads), "a worker thread hung"
    if errors:
        raise errors[0]
    return results


def pull(url: str) -> dict[str, np.ndarray]:
    client = PSClient(url, timeout=allow(10.0), attempts=1)
    try:
        return {k: v.copy() for k, v in client.pull(0, wait=allow(5.0)).tensors.items()}
    finally:
        client.close()


@pytest.mark.parametrize("shm_dir,transport", [(None, "shm"), ("", "http")])
def test_workers_connect_step_in_place_and_finish(shm_dir, transport):
    steps = 60  # enough for either worker's initial weights (whichever registers first initialises the PS)
    with live_ps(min_workers=2, max_steps=steps, startup_grace_seconds=0) as ps_:
        def worker(name: str, seed: int) -> dict:
            model = linear(seed)
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            with connect(model, torch.optim.SGD(model.parameters(), lr=0.2), url=ps_.url, name=name,
                         shm_dir=shm_dir, retry_timeout=allow(20)) as ps:
                out = {"before": before, "rank": ps.rank, "ranks": ps.ranks, "position": ps.position,
                       "transport": ps.client.transport, "ptrs": [p.data_ptr() for p in model.parameters()],
                       "statuses": [], "views": []}
                push = ps.client.push

                def spy(worker_id, step, grads, *args):  # what the bridge hands the client: views of p.grad?
                    out["views"].append(all(np.shares_memory(grads[n], p.grad.numpy())
                                            for n, p in model.named_parameters()))
                    return push(worker_id, step, grads, *args)

                ps.client.push = spy
                out["start"] = {n: p.detach().clone() for n, p in model.named_parameters()}
                for xb, yb in DataLoader(TensorDataset(X, Y), batch_sampler=ps.batch_sampler(len(X), 16)):
                    ps.zero_grad()
                    loss = nn.functional.mse_loss(model(xb), yb)
                    loss.backward()
                    out["statuses"].append(ps.step(loss, len(xb)))
                out.update(should_stop=ps.should_stop, done=ps.done, step=ps.step_count, after=ps.step(),
                           weights={n: p.detach().numpy().copy() for n, p in model.named_parameters()},
                           ptrs_after=[p.data_ptr() for p in model.parameters()])
            return out

        a, b = in_threads(lambda: worker("w-a", 1), lambda: worker("w-b", 2))
        final = pull(ps_.url)
        with ps_.http() as http:
            members = {m["name"]: m["state"] for m in http.get("/v1/workers").json()["workers"]}
    # both started from the weights of the one that initialised the PS, the other one's own were dropped
    same = lambda x, y: all(torch.equal(x[n], y[n]) for n in x)  # noqa: E731
    assert same(a["start"], b["start"])
    assert [same(w["before"], a["start"]) for w in (a, b)].count(True) == 1
    assert {a["rank"], b["rank"]} == {0, 1}
    for w in (a, b):
        assert w["transport"] == transport and w["ranks"] == (0, 1) and w["position"] == w["rank"]
        assert w["statuses"] == ["accepted"] * steps and all(w["views"])
        assert w["should_stop"] and w["done"] and w["step"] == steps and w["after"] == "done"
        assert w["ptrs_after"] == w["ptrs"]  # loaded in place: the same tensors, new values
        for n, arr in final.items():
            assert arr.tobytes() == w["weights"][n].tobytes()
    assert members == {"w-a": "left", "w-b": "left"}
    # it learned y = x @ [.1 .2 .3] + .4 through the two layers
    model = linear(0)
    ModelTensors(model).load(final)
    with torch.no_grad():
        assert nn.functional.mse_loss(model(X), Y).item() < 1e-3


def test_batchnorm_buffers_are_the_mean_of_the_workers_at_each_round():
    job = batchnorm()
    names = sorted(ModelTensors(job.model).all)
    assert names == ["0.bias", "0.weight", "1.bias", "1.weight", "buffer:0.running_mean", "buffer:0.running_var"]
    assert ModelTensors(job.model, buffers="local").buffers == {}
    with live_ps(min_workers=2, max_steps=3, startup_grace_seconds=0) as ps_:
        def worker(name: str) -> dict:
            job = batchnorm()
            pushed = []
            with connect(job.model, job.optimizer, url=ps_.url, name=name, retry_timeout=allow(20)) as ps:
                push = ps.client.push
                ps.client.push = lambda wid, step, grads, *a: (pushed.append(
                    {k: v.copy() for k, v in grads.items() if k.startswith("buffer:")}), push(wid, step, grads, *a))[1]
                for idx in ps.batch_sampler(job.dataset[0], 32):
                    ps.zero_grad()
                    job.loss_fn(job.model(job.dataset[0][idx]), job.dataset[1][idx]).backward()
                    ps.step()
                bn = job.model[0]
                return {"rank": ps.rank, "pushed": pushed, "tracked": int(bn.num_batches_tracked),
                        "local": {"buffer:0.running_mean": bn.running_mean.numpy().copy(),
                                  "buffer:0.running_var": bn.running_var.numpy().copy()}}

        a, b = sorted(in_threads(lambda: worker("bn-a"), lambda: worker("bn-b")), key=lambda w: w["rank"])
        final = pull(ps_.url)
    for name in ("buffer:0.running_mean", "buffer:0.running_var"):
        mean = (a["pushed"][-1][name] + b["pushed"][-1][name]) / np.float32(2)  # rank order, as the PS sums
        assert final[name].tobytes() == mean.tobytes()
        assert not np.array_equal(a["pushed"][-1][name], b["pushed"][-1][name])  # the shards' statistics differ
        assert a["local"][name].tobytes() == b["local"][name].tobytes() == final[name].tobytes()
    assert a["tracked"] == b["tracked"] == 3  # integer buffers stay on each worker


def test_refused_gradients_name_the_parameter_with_the_4xx_any_client_gets():
    with live_ps(min_workers=1, startup_grace_seconds=0) as ps_:
        model = linear(0)
        raw = PSClient(ps_.url, timeout=allow(10.0), attempts=1)
        with connect(model, torch.optim.SGD(model.parameters(), lr=0.1), url=ps_.url, name="w0",
                     shm_dir="", retry_timeout=allow(20)) as ps:
            def refused(prepare) -> GradientRejected:
                ps.zero_grad()
                prepare()
                grads = ps.tensors.grads()
                with pytest.raises(ProtocolError) as plain:  # what any client gets for the same push
                    raw.push(ps.worker_id, ps.step_count, grads)
                before = state_hash(ps_.rt)
                with pytest.raises(GradientRejected) as err:
                    ps.step()
                assert state_hash(ps_.rt) == before
                assert (err.value.status, err.value.code, err.value.detail) == \
                       (plain.value.status, plain.value.code, plain.value.detail)
                assert err.value.parameter in str(err.value)
                return err.value

            def nan():
                nn.functional.mse_loss(model(X), Y).backward()
                model.fc.bias.grad[1] = float("nan")

            err = refused(nan)
            assert (err.status, err.code, err.parameter) == (422, "nonfinite_gradient", "fc.bias")
            # nothing changed on the PS: the next good push is accepted
            ps.zero_grad()
            nn.functional.mse_loss(model(X), Y).backward()
            assert ps.step() == "accepted"

            err = refused(lambda: model.out(torch.ones(4, 2)).sum().backward())  # fc takes no part: no .grad
            assert (err.status, err.code, err.parameter) == (422, "tensor_mismatch", "fc.bias")
            assert "grad is None" in str(err)
            ps.allow_unused = True  # zeros for them instead
            ps.zero_grad()
            model.out(torch.ones(4, 2)).sum().backward()
            assert ps.step() == "accepted"
            ps.allow_unused = False

            model.double()  # the same Parameter objects, now float64: the PS holds float32
            err = refused(lambda: nn.functional.mse_loss(model(X.double()), Y.double()).backward())
            assert (err.status, err.code, err.parameter) == (422, "tensor_mismatch", "fc.bias")
            assert "float64" in str(err) and "float32" in str(err)
        raw.close()


def test_an_optimizer_that_misses_parameters_is_refused_before_connecting():
    model = linear(0)
    with pytest.raises(ValueError, match="does not cover"):
        DistributedOptimizer(model, torch.optim.SGD(model.out.parameters(), lr=0.1), url="http://127.0.0.1:9")


def test_connecting_to_a_ps_that_holds_another_model_fails_at_once_saying_so():
    """It connected, and the first push was refused (a README walk: a PS restored for the linear task)."""
    with live_ps(min_workers=1, startup_grace_seconds=0) as ps:
        c = ps.client()
        assert c.init_model({"w": np.zeros((3, 1), np.float32), "b": np.zeros(1, np.float32)}, {"name": "sgd"})
        c.close()
        model = linear(0)
        weights = {k: v.copy() for k, v in ps.rt.core.weights.items()}
        with pytest.raises(ModelMismatch, match=r"the PS holds another model than this module \(it lacks "
                                                r"\['fc.bias', 'fc.weight', 'out.bias', 'out.weight'\]; it holds "
                                                r"\['b', 'w'\]"):
            connect(model, torch.optim.SGD(model.parameters(), lr=0.1), url=ps.url, name="w0")
        assert all(ps.rt.core.weights[k].tobytes() == v.tobytes() for k, v in weights.items())
        assert [m.state for m in ps.rt.core.members.by_id.values()] == ["left"]  # it left: no one waits for it


def test_a_worker_rejoins_after_the_ps_restarts_and_leaves_on_sigterm():
    steps = 12
    with LocalCluster(0, ps_env={"PS_MIN_WORKERS": 1, "PS_MAX_STEPS": steps}) as c:
        model = linear(0)
        original = signal.getsignal(signal.SIGTERM)
        ps = connect(model, torch.optim.SGD(model.parameters(), lr=0.1), url=c.url, name="restart",
                     retry_timeout=allow(30))

        def one_step() -> str:
            ps.zero_grad()
            nn.functional.mse_loss(model(X), Y).backward()
            return ps.step()

        assert [one_step() for _ in range(3)] == ["accepted"] * 3
        trained = {n: p.detach().clone() for n, p in model.named_parameters()}
        c.kill()
        c.start_ps()  # empty: no checkpoint directory
        assert one_step() == "rejoined"  # registered again and re-initialised the PS from its current weights
        assert ps.step_count == 0 and ps.client.transport == "shm"
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), trained[n], rtol=0, atol=0)
        assert one_step() == "accepted"
        signal.raise_signal(signal.SIGTERM)  # what `docker compose stop` sends: the loop ends, the worker leaves
        assert ps.should_stop and not ps.done and one_step() == "stopped"
        ps.close()
        assert signal.getsignal(signal.SIGTERM) is original
        members = c.get("/v1/workers").json()["workers"]
        assert [(m["name"], m["state"]) for m in members] == [("restart", "left")]


def test_the_batch_sampler_reshards_when_a_worker_leaves():
    from syncps.sampling import round_batch

    with live_ps(min_workers=2, max_steps=12, startup_grace_seconds=0) as ps_:
        def worker(name: str, leave_after: int | None) -> list:
            model = linear(0)
            seen = []
            with connect(model, torch.optim.SGD(model.parameters(), lr=0.1), url=ps_.url, name=name,
                         retry_timeout=allow(20)) as ps:
                for idx in ps.batch_sampler(len(X), 8, seed=5):
                    seen.append((ps.step_count, ps.ranks, ps.position, idx))
                    ps.zero_grad()
                    nn.functional.mse_loss(model(X[idx]), Y[idx]).backward()
                    ps.step()
                    if leave_after is not None and len(seen) == leave_after:
                        break  # close() leaves: the barrier stops waiting for this worker
            return seen

        stays, leaves = in_threads(lambda: worker("stays", None), lambda: worker("leaves", 4))
    assert len(leaves) == 4 and {ranks for _, ranks, _, _ in leaves} == {(0, 1)}
    assert [ranks for _, ranks, _, _ in stays][:4] == [(0, 1)] * 4 and stays[-1][1] == (stays[-1][1][0],)
    for step, ranks, position, idx in stays + leaves:
        assert idx == round_batch(len(X), step, position, len(ranks), 8, seed=5).tolist()
    assert stays[-1][0] == 11
