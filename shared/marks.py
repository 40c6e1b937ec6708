"""Opt-in timeline marks: where a partitioned step waits (``python -m bench.timeline`` reads them).

Contract: ``SYNCPS_MARKS_DIR`` (:class:`shared.settings.ProcessSettings`, read once, at import) names a directory;
unset or empty, marks are off: :data:`ON` is False and callers test it before calling (``if marks.ON:
marks.mark(...)``), so an untraced process makes no call and builds no fields. On, :func:`mark` appends one JSON line
``{"t": ns, "pid", "ev", ...}`` to ``<dir>/<pid>.jsonl`` with one ``write`` (an ``O_APPEND`` file: nothing is lost when the process is killed),
``t`` from :func:`time.perf_counter_ns`: CLOCK_MONOTONIC, one clock for every process of one machine, network
namespaces included (bench.hosts' emulated hosts). A mark that cannot be written (the directory not writable, the
disk full) turns marks off with one warning: a timeline aid never fails what it traces.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time

from shared.settings import ProcessSettings

DIR = ProcessSettings().marks_dir or ""
#: marks are recorded (tested by callers before :func:`mark`)
ON = bool(DIR)
_fd: tuple[int, int] | None = None  # (the pid that opened it, the file): a forked child opens its own
_lock = threading.Lock()
log = logging.getLogger(__name__)


def _file() -> int:
    global _fd
    with _lock:
        pid = os.getpid()
        if _fd is None or _fd[0] != pid:
            os.makedirs(DIR, exist_ok=True)
            _fd = (pid, os.open(os.path.join(DIR, f"{pid}.jsonl"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644))
    return _fd[1]


def mark(ev: str, **fields) -> None:
    """Record event ``ev`` now, with ``fields`` (JSON values)."""
    global ON
    t = time.perf_counter_ns()
    try:
        os.write(_file(), (json.dumps({"t": t, "pid": os.getpid(), "ev": ev, **fields}) + "\n").encode())
    except OSError as exc:
        ON = False
        log.warning("timeline marks off: %s (SYNCPS_MARKS_DIR=%s)", exc, DIR)
