"""Suite-wide plumbing: the "degraded checks" summary and where local clusters put their logs.

**Degraded checks.** A test that cannot do its full check on this machine (no promtool, no Chromium, no
Docker engine) says so with :func:`degraded`; ``make test``'s final summary lists every such check
under "degraded checks", or says that none was, so a green run without its real checks never passes
for a full one. (pytest's own ``-ra`` lines still list the skips.)

**Cluster logs.** Every :class:`cluster.processes.LocalCluster` a test starts (also those started by
subprocesses such as ``python -m cluster`` and the benchmarks) logs under one ``syncps-tests-*``
folder, and keeps its logs there until the session ends (``SYNCPS_LOG_ROOT``, ``SYNCPS_KEEP_LOGS``):
a failing test can still show them. The folder is removed when the session passes and kept, named
in the summary, when it fails.

**Fork server.** The session exports ``SYNCPS_FORK_SERVER=1``: local clusters (the tests', and those of
their ``python -m cluster`` / benchmark subprocesses) fork their PS and worker processes from a zygote that
imported the stack once (cluster/forkserver.py), instead of paying Python's start-up and imports for each;
whatever a zygote cannot start exactly as ``python -m`` would is exec'd as before. ``tests/test_install.py``
unsets it (the real exec path, as users get it); ``SYNCPS_FORK_SERVER=0 make test`` execs every process.

**Processes.** ``make test`` runs the suite over ``TEST_PROCESSES`` pytest-xdist processes (``--dist loadfile``):
the tests spend most of their time waiting on the real processes, sockets and containers they start (the suite's
own processes used 0.3 of a core on average). A test module runs whole in one process, in its order: the swarm
tests (tests/test_swarm.py: the engine's one swarm) one after another. What two processes may run at once is kept
apart by name: compose projects, the image tag (one per process), ports, emulated hosts' namespaces. Each process
has its own fork server and log folder; the "degraded checks" and kept log folders of every process reach the final
summary.

**Order.** ``make test`` hands the test files to its processes in the order :func:`pytest_collection_modifyitems`
leaves them (``--no-loadscope-reorder``: pytest-xdist's own order, by test count, put the one-test Docker files last,
and one process ran each of them alone at the end while the other idled): the files of :data:`SLOWEST` first, longest
first, then the others, most tests first, as xdist orders them. A process asks for its next file while 2 tests of
its last are left, so a long file handed out last would keep the other process idle for most of its length.

**Timeouts.** pytest-timeout's bound on each test (its ``timeout`` marker, else ``timeout`` in pyproject.toml, 300 s)
is an allowance like the waits inside the test (tests/timing.py): :func:`pytest_runtest_protocol` multiplies it by the
load's scale as the test starts, before pytest-timeout reads it. It also exports that scale as
``SYNCPS_CLUSTER_PATIENCE``, which scales the deadlines a local cluster sets itself (a PS's start, the workers' exit,
a stop's grace: :func:`cluster.processes.patience`), the test's own and those of the subprocesses it starts.

**SIGINT.** A suite started in the background of a non-interactive shell (``make test &``, ``( .ci/run & )``)
inherits SIGINT *ignored*, and so would every process it starts, since an ignored signal stays ignored across
``exec``: Python then installs no KeyboardInterrupt handler, a child's Ctrl-C does nothing, and the tests of what a
process does on SIGINT time out (seen: test_forkserver's ``sigint`` cases, then a zygote kept busy by their
children). The session gives itself Python's default handler instead, which ``exec`` resets to the default action in
every child.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import tempfile
from pathlib import Path

import pytest

from cluster import forkserver
from tests.timing import allow, scale

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # inherited from a background job: see the module's docstring
    signal.signal(signal.SIGINT, signal.default_int_handler)

#: check -> what ran instead (or why it did not run), in the order they were reported
DEGRADED: dict[str, str] = {}
_LOG_ROOT: Path | None = None
_SAVED_ENV: dict[str, str | None] = {}
#: log folders kept by the session's test processes (xdist's, reported at their end)
_KEPT: list[str] = []


#: The test files that take longest (over 20 s in one process in a CI run on the 2-core VM), longest first, as
#: ``tests/test_<name>.py``: :func:`pytest_collection_modifyitems` puts them at the head of the run. A name may be
#: missing (selected away, or gone) and a new file runs in xdist's order: the list orders, it never selects.
SLOWEST = tuple(f"tests/test_{name}.py" for name in (
    "swarm", "outage", "compose", "standby_live", "torch_exactness", "memory_flat", "pause", "compose_standby",
    "exactness", "standby_crash", "k8s", "shards", "compose_torch", "bench", "faults", "fuzz", "install", "docgen",
    "shard_follow", "cluster_cli", "shards_scale", "dashboard_widths", "heartbeat", "torch_accuracy"))


def degraded(check: str, reason: str) -> None:
    """Report that ``check`` ran degraded or was skipped for want of something on this machine."""
    DEGRADED.setdefault(check, reason)


def pytest_configure(config: pytest.Config) -> None:
    global _LOG_ROOT
    if _LOG_ROOT is not None:
        return
    # named now, made by the first LocalCluster that needs it: a session without one leaves nothing behind
    _LOG_ROOT = Path(tempfile.gettempdir()) / f"syncps-tests-{os.getpid()}-{secrets.token_hex(4)}"
    fork_server = os.environ.get("SYNCPS_FORK_SERVER") or "1"  # SYNCPS_FORK_SERVER=0: the whole suite exec'd
    for key, value in (("SYNCPS_LOG_ROOT", str(_LOG_ROOT)), ("SYNCPS_KEEP_LOGS", "1"),
                       ("SYNCPS_FORK_SERVER", fork_server), ("SYNCPS_CLUSTER_PATIENCE", str(scale()))):
        _SAVED_ENV[key] = os.environ.get(key)
        os.environ[key] = value


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    forkserver.shutdown()
    kept = _finish_logs(exitstatus)
    workeroutput = getattr(session.config, "workeroutput", None)  # an xdist process: its findings to the controller
    if workeroutput is not None:
        workeroutput["syncps_degraded"] = dict(DEGRADED)
        workeroutput["syncps_logs"] = [str(_LOG_ROOT)] if kept else []


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files in the order of the module's docstring (**Order**), each file's tests in their own order; the same in
    every xdist process (each collects, and xdist checks their collections match)."""
    files: dict[str, int] = {}  # file -> its number of tests, in collection order
    for item in items:
        f = item.nodeid.split("::", 1)[0]
        files[f] = files.get(f, 0) + 1
    slow = {f: i for i, f in enumerate(SLOWEST)}
    order = {f: rank for rank, f in enumerate(sorted(files, key=lambda f: (slow.get(f, len(slow)), -files[f])))}
    items.sort(key=lambda item: order[item.nodeid.split("::", 1)[0]])


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    """The test's timeout (**Timeouts**) scaled with the load now; outermost, so pytest-timeout's wrapper reads it.
    The local clusters' patience too (**Timeouts**)."""
    os.environ["SYNCPS_CLUSTER_PATIENCE"] = str(scale())
    marker = item.get_closest_marker("timeout")
    args, kwargs = (list(marker.args), dict(marker.kwargs)) if marker is not None else ([], {})
    base = args.pop(0) if args else kwargs.pop("timeout", getattr(item.config, "_env_timeout", None))
    if base:  # (0 or None: no timeout)
        item.add_marker(pytest.mark.timeout(allow(float(base)), *args, **kwargs), append=False)
    yield


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """(xdist controller) One test process is done: its degraded checks and kept logs join the summary's."""
    out = getattr(node, "workeroutput", {})
    for check, reason in out.get("syncps_degraded", {}).items():
        degraded(check, reason)
    _KEPT.extend(out.get("syncps_logs", []))


def _finish_logs(exitstatus: int) -> bool:
    """Restore the environment; remove this process's log folder unless the session failed. True: it is kept."""
    for key, value in _SAVED_ENV.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    if _LOG_ROOT is None or not _LOG_ROOT.exists():
        return False
    if exitstatus in (0, 5) or not any(_LOG_ROOT.iterdir()):  # passed (or nothing ran), or nothing to show
        shutil.rmtree(_LOG_ROOT, ignore_errors=True)
        return False
    return True


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    tr = terminalreporter
    tr.section("degraded checks")
    if DEGRADED:
        for check, reason in DEGRADED.items():
            tr.write_line(f"DEGRADED {check}: {reason}")
    else:
        tr.write_line("none: every environment-dependent check that was selected ran in full")
    kept = [*_KEPT, *([str(_LOG_ROOT)] if _LOG_ROOT is not None and _LOG_ROOT.exists() and any(_LOG_ROOT.iterdir())
                      else [])]
    for folder in kept:
        tr.write_line(f"local cluster logs of this session kept in {folder}")
