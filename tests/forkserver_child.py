"""``python -m tests.forkserver_child``: a child for tests/test_forkserver.py. ``SYNCPS_TEST_ACTION`` says what
it does: ``report`` (print how it was started as one JSON line), ``exit3``, ``exit-msg``, ``raise``, ``wait``
(print ``waiting`` and sleep until a signal ends it)."""
from __future__ import annotations

import json
import os
import signal
import sys
import threading

action = os.environ.get("SYNCPS_TEST_ACTION", "report")
if action == "report":
    handlers = {name: repr(signal.getsignal(getattr(signal, name))) for name in ("SIGCHLD", "SIGINT", "SIGTERM", "SIGPIPE")}
    print(json.dumps({"name": __name__, "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(),
                      "marker": os.environ.get("SYNCPS_TEST_MARKER"), "env_keys": sorted(os.environ),
                      "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")), "handlers": handlers,
                      "stdin": sys.stdin.read(), "write_through": [sys.stdout.write_through, sys.stderr.write_through],
                      "threads": threading.active_count(), "ppid": os.getppid()}))
    print("to stderr", file=sys.stderr)
elif action == "exit3":
    sys.exit(3)
elif action == "exit-msg":
    sys.exit("a message")
elif action == "raise":
    raise ValueError("boom")
elif action == "wait":
    print("waiting", flush=True)
    threading.Event().wait()
