"""``python -m worker_service``: one worker (settings: WORKER_* env). Exits 0 when training is done
or when stopped with SIGTERM/SIGINT (after leaving the cluster); 3 when the PS holds another model than
the task's (:class:`worker_service.loop.WrongModel`: retrying cannot help)."""
from __future__ import annotations

import json
import logging
import os
import signal
import sys

from pydantic import ValidationError

from shared.settings_errors import settings_errors
from worker_service.client import PSClient, connect
from worker_service.transport import faults
from worker_service.loop import WrongModel, train
from worker_service.settings import WorkerSettings, cpu_list
from worker_service.stopping import StopFlag
from worker_service.tasks import load_task


def pin(cpus: frozenset[int]) -> None:
    """Run every thread of this process (and those it starts later) on ``cpus`` only (WORKER_CPUS)."""
    if not hasattr(os, "sched_setaffinity"):
        logging.warning("WORKER_CPUS is set but this OS cannot pin a process to CPUs: ignored")
        return
    try:
        for tid in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(tid), cpus)
    except OSError as exc:
        raise SystemExit(f"WORKER_CPUS={','.join(map(str, sorted(cpus)))}: cannot run on those CPUs "
                         f"(this process may use {sorted(os.sched_getaffinity(0))}): {exc}") from None
    logging.info("running on CPU %s (WORKER_CPUS)", ",".join(map(str, sorted(cpus))))


def main() -> int:
    try:
        s = WorkerSettings()
    except ValidationError as exc:
        sys.exit("".join(f"python -m worker_service: {line}\n" for line in settings_errors(exc, "WORKER_")))
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s worker {s.name} %(levelname)s %(message)s")
    if s.cpus:
        pin(cpu_list(s.cpus))
    logging.getLogger("httpx").setLevel(logging.WARNING)
    stop = StopFlag()  # not a threading.Event: its set() in a signal handler can deadlock (stopping.py)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    task = load_task(s.task, s.seed, s.dtype)
    conn = faults.from_settings(s, connect(s.ps_url))  # wrapped for a fault drill when WORKER_FAULT_* are set
    client = PSClient(s.ps_url, timeout=s.request_timeout_seconds, attempts=s.retry_attempts,
                      retry_timeout=s.retry_timeout_seconds, token=s.auth_token, shm_dir=s.shm_dir, connection=conn)
    client.wait_ready(s.retry_timeout_seconds)
    try:
        summary = train(client, task, s.name, s.batch_size, stop, s.log_every_seconds, s.compute_delay_seconds,
                        s.prefetch)
    except WrongModel as exc:
        logging.error("WORKER_TASK=%s: %s", s.task, exc)
        return 3
    client.close()
    if isinstance(conn, faults.FaultyConnection):
        logging.info("faults injected over %s: %s", type(conn.inner).__name__, conn.counts)
    print("SUMMARY " + json.dumps(summary.__dict__), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
