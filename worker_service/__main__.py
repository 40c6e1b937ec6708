"""``python -m worker_service``: one worker (settings: WORKER_* env). Exits 0 when training is done;
WORKER_STOPPED_EXIT_CODE (0 unless set) when stopped with SIGTERM/SIGINT before (after leaving the
cluster); 3 when the PS holds another model than the task's (:class:`worker_service.loop.WrongModel`:
retrying cannot help); 1 with one line when it cannot go on (a setting or task that is wrong, no PS
answering within WORKER_RETRY_TIMEOUT_SECONDS, a refusal the PS repeats: a wrong token, say). ``--help``
lists the settings."""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys

from worker_service.threads import describe, one_thread_unless_set

THREADS_DEFAULTED = one_thread_unless_set()  # before numpy or torch is imported: they read these once

from pydantic import ValidationError  # noqa: E402

from shared.errors import ProtocolError
from shared.settings_errors import settings_errors
from shared.rawhttp import ConnectionLost
from worker_service.client import PSClient
from worker_service.transport import faults
from worker_service.transport.endpoint import ServerError, connect, split_urls
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


def usage() -> str:
    """``--help``: what the worker does and its settings (environment variables, docs/reference/configuration.md)."""
    text = re.sub(r":\w+:`([^`]*)`", r"\1", __doc__).replace("``", "").strip()
    lines = [text, "", "settings (environment variables):"]
    for name, field in WorkerSettings.model_fields.items():
        default = ("<computed>" if field.default_factory is not None else  # see its meaning
                   "unset" if field.default is None else repr(field.default))
        lines.append(f"  WORKER_{name.upper():<28} {default:<24} {(field.description or '').strip()}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``argv``: the command line's arguments (``python -m worker_service`` passes them; a caller, none)."""
    argv = argv or []
    if argv:
        if argv[0] in ("-h", "--help"):
            print(usage())
            return 0
        sys.exit(f"python -m worker_service takes no arguments (settings are WORKER_* variables: --help); got {argv}")
    try:
        s = WorkerSettings()
    except ValidationError as exc:
        sys.exit("".join(f"python -m worker_service: {line}\n" for line in settings_errors(exc, "WORKER_")))
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s worker {s.name} %(levelname)s %(message)s")
    if s.cpus:
        pin(cpu_list(s.cpus))
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.info(describe(THREADS_DEFAULTED))
    stop = StopFlag()  # not a threading.Event: its set() in a signal handler can deadlock (stopping.py)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        task = load_task(s.task, s.seed, s.dtype)
    except ValueError as exc:  # an unknown task name
        sys.exit(f"python -m worker_service: WORKER_TASK={s.task}: {exc}")
    # wrapped for a fault drill when WORKER_FAULT_* are set (a pair: the first PS's connection)
    conn = faults.from_settings(s, connect(split_urls(s.ps_url)[0]))
    client = PSClient(s.ps_url, timeout=s.request_timeout_seconds, attempts=s.retry_attempts,
                      retry_timeout=s.retry_timeout_seconds, token=s.auth_token, shm_dir=s.shm_dir, connection=conn)
    try:
        client.wait_ready(s.retry_timeout_seconds)
        summary = train(client, task, s.name, s.batch_size, stop, s.log_every_seconds, s.compute_delay_seconds,
                        s.prefetch)
    except WrongModel as exc:
        logging.error("WORKER_TASK=%s: %s", s.task, exc)
        return 3
    except (TimeoutError, ConnectionLost, ServerError) as exc:  # no PS answered for WORKER_RETRY_TIMEOUT_SECONDS
        logging.error("giving up: %s (WORKER_PS_URL=%s, WORKER_RETRY_TIMEOUT_SECONDS=%g)", exc or type(exc).__name__,
                      s.ps_url, s.retry_timeout_seconds)
        return 1
    except ProtocolError as exc:  # a refusal that retrying cannot change
        hint = {401: " (WORKER_AUTH_TOKEN must be the PS's PS_AUTH_TOKEN)",
                "nonfinite_gradient": " (the model diverged: a lower PS_LEARNING_RATE, in async/ssp above all; or "
                                      "PS_NONFINITE_POLICY=skip to skip such gradients)"}
        hint = hint.get(exc.status) or hint.get(exc.code, "")
        logging.error("the PS refused: %s %s: %s%s", exc.status, exc.code, exc.detail, hint)
        return 1
    client.close()
    if isinstance(conn, faults.FaultyConnection):
        logging.info("faults injected over %s: %s", type(conn.inner).__name__, conn.counts)
    print("SUMMARY " + json.dumps(summary.__dict__), flush=True)
    return 0 if summary.done else s.stopped_exit_code  # train() returns when the job is done or when stopped


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
