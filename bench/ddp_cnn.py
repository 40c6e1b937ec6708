"""``python -m bench.ddp_cnn --workers N --steps S``: the ``cnn`` task under torch DistributedDataParallel,
what a PyTorch user runs instead of syncps: N processes on loopback (gloo), a table (``--json``: one JSON line).

Same model, initial weights, data and optimizer as syncps's ``cnn`` task (``syncps.cnn.py``):
at step ``s`` rank ``r`` takes :func:`syncps.sampling.round_batch` ``(s, r, N)``, the shard a syncps
worker at position ``r`` takes, so both systems see the same global batches; DDP averages the gradients
(all-reduce sum / N) and every rank steps ``torch.optim.Adam`` itself. One thread per process. Prints
``system`` ("torch_ddp_gloo"), ``workers``, ``params``, ``steps``, ``steps_per_s`` (steps after the first
``--warmup`` ones, timed between two barriers), ``accuracy`` and ``loss`` on the held-out digits after the
last step, ``batch``, ``load_avg``. The processes come from a forkserver that imports torch once.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time

from bench.output import Results, add_json_option
from cluster.processes import free_port


def _rank(rank: int, workers: int, port: int, steps: int, warmup: int, batch: int, seed: int, queue) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from syncps.sampling import round_batch
    from syncps.cnn import CNNTask
    from syncps.job import take

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=workers)
    try:
        task = CNNTask(seed, "float32")
        job = task.job
        model = DistributedDataParallel(job.model)
        n = len(job.dataset[0])
        t0 = time.perf_counter()
        for step in range(steps):
            if step == warmup:
                dist.barrier()
                t0 = time.perf_counter()
            x, y = take(job.dataset, round_batch(n, step, rank, workers, batch, job.seed, job.shuffle), torch.float32)
            job.optimizer.zero_grad()
            job.loss_fn(model(x), y).backward()
            job.optimizer.step()
        dist.barrier()
        elapsed = time.perf_counter() - t0
        if rank == 0:
            metrics = task.evaluate({k: v.copy() for k, v in task.tensors.init_tensors().items()})
            queue.put({"steps_per_s": round((steps - warmup) / elapsed, 3), **metrics})
    finally:
        dist.destroy_process_group()


def run(workers: int = 4, steps: int = 300, warmup: int = 20, batch: int = 32, seed: int = 0,
        timeout: float = 600.0) -> dict:
    """One DDP run; its result line as a dict (an ``error`` field when it failed)."""
    from syncps.cnn import PARAMS

    ctx = multiprocessing.get_context("forkserver")
    queue = ctx.Queue()
    port = free_port()
    warmup = min(warmup, steps - 1)
    procs = [ctx.Process(target=_rank, args=(r, workers, port, steps, warmup, batch, seed, queue), daemon=True)
             for r in range(workers)]
    for p in procs:
        p.start()
    out = {"system": "torch_ddp_gloo", "task": "cnn", "workers": workers, "params": PARAMS, "steps": steps,
           "batch": batch}
    try:
        out.update(queue.get(timeout=timeout))
    except Exception as exc:  # timeout, or a rank died
        out.update({"steps_per_s": None, "error": f"no result: {exc!r}, exit codes {[p.exitcode for p in procs]}"})
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    out["load_avg"] = round(os.getloadavg()[0], 2)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ddp_cnn", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=4, help="DDP processes (ranks)")
    ap.add_argument("--steps", type=int, default=300, help="training steps, warm-up included")
    ap.add_argument("--warmup", type=int, default=20, help="first steps left out of steps_per_s")
    ap.add_argument("--batch", type=int, default=32, help="examples per process per step")
    ap.add_argument("--seed", type=int, default=0,
                    help="the model's and the sampling's seed (WORKER_SEED of the cnn task)")
    add_json_option(ap)
    args = ap.parse_args(argv)
    multiprocessing.set_forkserver_preload(["torch", "torch._dynamo", "torch.distributed", "syncps.cnn"])
    line = run(args.workers, args.steps, args.warmup, args.batch, args.seed)
    with Results(args.json, prog=ap.prog) as out:
        out.add(line)
    return 0 if line.get("steps_per_s") is not None else 1


if __name__ == "__main__":
    sys.exit(main())
