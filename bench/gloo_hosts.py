"""One rank of the anchors' torch gloo all-reduce per process, so each rank can run on a host of its own.

``../shared/bench/torch_allreduce.py`` spawns its ranks itself on 127.0.0.1. This runs that script's own
``worker`` (the same workload: analytic gradient of the linear model of ``common.model_dims``, one flat
``all_reduce`` per step, SGD; the same warm-up and agreed step count) as rank ``--rank`` of ``--workers``,
meeting the others at ``tcp://--master:--port``. Rank 0 prints the anchor's JSON line. The interface gloo
uses is ``GLOO_SOCKET_IFNAME`` (``bench.hosts`` sets it). Run it with the anchors' torch venv::

    ~/.cache/syncps-anchors/torch/bin/python bench/gloo_hosts.py --rank 0 --master 10.88.0.2 --port 29500 \\
        --workers 2 --params 1000000 --seconds 5

Every other option is the anchor's (``--workers``, ``--params``, ``--seconds``, ``--warmup``, ...).
"""
import argparse
import json
import sys
from pathlib import Path

ANCHORS = Path(__file__).resolve().parents[2] / "shared" / "bench"


class PrintLine:
    """The anchor's result queue: rank 0 puts its line, we print it."""

    def put(self, line: dict) -> None:
        print(json.dumps(line), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python bench/gloo_hosts.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank", type=int, required=True, help="this process's rank (0 prints the line)")
    ap.add_argument("--master", required=True, help="rank 0's address")
    ap.add_argument("--port", type=int, required=True, help="rank 0's TCP port where the ranks meet")
    ap.add_argument("--anchors", default=str(ANCHORS), help="the folder of torch_allreduce.py")
    args, anchor_argv = ap.parse_known_args()
    sys.path.insert(0, args.anchors)
    sys.argv = [sys.argv[0], *anchor_argv]
    import torch.distributed as dist
    import torch_allreduce

    init = dist.init_process_group

    def init_at_master(backend, rank, world_size):  # the anchor's call, rendezvous at --master instead of 127.0.0.1
        return init(backend, init_method=f"tcp://{args.master}:{args.port}", rank=rank, world_size=world_size)

    dist.init_process_group = init_at_master
    torch_allreduce.worker(args.rank, torch_allreduce.parse(), args.port, PrintLine())


if __name__ == "__main__":
    main()
