"""One task of the anchors' TensorFlow SyncReplicasOptimizer cluster per process, so each can run on a host of its own.

``../shared/bench/tf_sync_replicas.py`` starts its one ``ps`` task and its workers itself, all on 127.0.0.1. This
runs that script's own ``run_worker`` (the same graph: variables on the ps tasks by ``replica_device_setter``,
``SyncReplicasOptimizer(replicas_to_aggregate=N)``, gRPC; the same warm-up, window and progress files), or a ps
task's server as ``run_ps`` makes it, as task ``--task`` of role ``--role``, in a cluster whose addresses are
``--ps-addresses`` and ``--worker-addresses`` (``host:port``, comma lists) instead. Worker 0, the chief, prints the
anchor's JSON line; the tasks meet through the files of ``--logdir`` (one file system: the emulated hosts are network
namespaces). Run it with the anchors' TensorFlow venv::

    ~/.cache/syncps-anchors/tf/bin/python bench/tf_hosts.py --role worker --task 0 --ps-addresses 10.88.0.1:2222 \\
        --worker-addresses 10.88.0.2:2223,10.88.0.3:2224 --ports 2222,2223,2224 --logdir /tmp/x \\
        --workers 2 --params 1000000 --seconds 5

Every other option is the anchor's (``--workers``, ``--params``, ``--seconds``, ``--warmup``, ``--ports``, ...).
"""
import argparse
import sys
from pathlib import Path

ANCHORS = Path(__file__).resolve().parents[2] / "shared" / "bench"


def partition(v1, parts: int) -> None:
    """The anchor's ``w`` made by ``get_variable`` in ``parts`` partitions along its first axis (TF1's way to spread
    one large variable over several ps tasks); every other variable as the anchor makes it. The anchor gets the
    concatenation of the parts (a tensor, on the worker: ``matmul`` reads it, the gradient flows back to each part, and
    the chief can fetch it, which it cannot a ``PartitionedVariable``)."""
    get_variable = v1.get_variable

    def partitioned(name, *args, **kwargs):
        if name != "w":
            return get_variable(name, *args, **kwargs)
        kwargs.setdefault("partitioner", v1.fixed_size_partitioner(parts))
        return get_variable(name, *args, **kwargs).as_tensor()

    v1.get_variable = partitioned


def main() -> None:
    ap = argparse.ArgumentParser(prog="python bench/tf_hosts.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ps-addresses", required=True, help="ps task t's host:port, in task order (comma list); with "
                    "more than one, the weights ``w`` are cut into as many partitions along their first axis "
                    "(``fixed_size_partitioner``), which ``replica_device_setter`` puts one on each ps task")
    ap.add_argument("--worker-addresses", required=True, help="worker t's host:port, in task order (comma list)")
    ap.add_argument("--anchors", default=str(ANCHORS), help="the folder of tf_sync_replicas.py")
    args, anchor_argv = ap.parse_known_args()
    sys.path.insert(0, args.anchors)
    sys.argv = [sys.argv[0], *anchor_argv]
    import tf_sync_replicas

    ps, workers = args.ps_addresses.split(","), args.worker_addresses.split(",")

    def cluster_at_hosts(ports, n):  # the anchor's cluster, at the hosts' addresses instead of 127.0.0.1
        assert n == len(workers), f"--workers {n} but {len(workers)} worker addresses"
        return {"ps": ps, "worker": workers}

    tf_sync_replicas.cluster_dict = cluster_at_hosts
    anchor = tf_sync_replicas.parse()
    tf = tf_sync_replicas.tf_import()
    if len(ps) > 1:
        partition(tf.compat.v1, len(ps))
    if anchor.role == "ps":  # the anchor's run_ps, as task --task (it has one ps task: 0)
        cluster = tf.train.ClusterSpec(cluster_at_hosts(None, anchor.workers))
        tf.distribute.Server(cluster, job_name="ps", task_index=anchor.task, protocol="grpc").join()
    elif anchor.role == "worker":
        tf_sync_replicas.run_worker(anchor)
    else:
        sys.exit("--role ps or --role worker: bench.hosts starts the tasks")


if __name__ == "__main__":
    main()
