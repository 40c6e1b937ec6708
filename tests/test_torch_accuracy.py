"""The ``cnn`` task trained by syncps (4 workers) and by torch DistributedDataParallel (gloo, 4 processes on
loopback, bench/ddp_cnn.py) with the same global batch (4 x 32), initial weights, data order and
torch.optim.Adam, for the same number of global steps: the held-out accuracy is within 0.5 percentage
points (one image of the 360 is 0.28 points)."""
from tests.torch_util import context, run_forked_job

STEPS = 200


def test_cnn_on_syncps_is_as_accurate_as_ddp():
    from bench.ddp_cnn import run
    from worker_service.tasks import load_task

    context()  # the forkserver that imported torch, for both systems' processes
    job = run_forked_job(4, {"max_steps": STEPS}, {"WORKER_TASK": "cnn", "WORKER_BATCH_SIZE": 32})
    ours = load_task("cnn").evaluate(job.tensors)
    ddp = run(workers=4, steps=STEPS, batch=32)
    assert ddp.get("error") is None, ddp
    assert ours["accuracy"] >= 0.95, ours
    assert abs(ours["accuracy"] - ddp["accuracy"]) <= 0.005, (ours, ddp)


def test_the_bench_counts_the_cnns_parameters():
    from bench.task import task_workload
    from syncps.cnn import build_model

    assert task_workload("cnn", 10**6) == (sum(p.numel() for p in build_model().parameters()), (None, None), "cnn")
