"""cluster/forkserver.py: a child forked by a zygote starts as ``python -m`` would start it (argv, sys.path,
cwd, environment, fds, signal handlers, exit codes, signals), what it cannot start so is exec'd instead, and a
local training job forked ends bit-identical to the same job exec'd."""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from cluster import forkserver
from cluster.processes import LocalCluster, wait_for
from tests.timing import allow
from tests.clusters import run_job

ROOT = Path(__file__).resolve().parent.parent
CHILD = "tests.forkserver_child"


@pytest.fixture(scope="module")
def child_cwd(tmp_path_factory):
    """The test zygote's working directory (not the checkout: ``tests`` is found through PYTHONPATH)."""
    forkserver.shutdown(CHILD)
    yield str(tmp_path_factory.mktemp("cwd"))
    forkserver.shutdown(CHILD)


@pytest.fixture(autouse=True)
def child_zygote(monkeypatch):
    monkeypatch.setitem(forkserver.ZYGOTES, CHILD, ("json", "threading"))


def child_env(action: str, **extra) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "SYNCPS_TEST_ACTION": action, **extra}


def start(action: str, forked: bool, cwd: str, log: Path, **extra):
    env = child_env(action, **extra)
    if forked:
        proc = forkserver.spawn(CHILD, env, str(log), cwd=cwd)
        assert isinstance(proc, forkserver.ForkedProcess)
        return proc
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", CHILD], env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT)


@pytest.mark.parametrize("forked", [True, False], ids=["forked", "exec"])
@pytest.mark.parametrize("action,code,text", [("report", 0, "to stderr"), ("exit3", 3, ""),
                                              ("exit-msg", 1, "a message\n"), ("raise", 1, "ValueError: boom\n")])
def test_exit_codes_and_output_as_python_m(child_cwd, tmp_path, forked, action, code, text):
    log = tmp_path / "child.log"
    proc = start(action, forked, child_cwd, log)
    assert proc.wait(allow(30)) == code and proc.poll() == code and proc.returncode == code
    out = log.read_text()
    assert text in out
    if action == "raise":
        assert out.startswith("Traceback (most recent call last):")


def test_child_starts_exactly_as_exec(child_cwd, tmp_path):
    """Everything the child can see of how it was started (but its pid) is what an exec'd ``python -m`` sees."""
    seen = {}
    for forked in (True, False):
        log = tmp_path / f"{forked}.log"
        assert start("report", forked, child_cwd, log, SYNCPS_TEST_MARKER=f"m{forked}").wait(allow(30)) == 0
        seen[forked] = json.loads(log.read_text().splitlines()[0])
    assert seen[True].pop("marker") == "mTrue" and seen[False].pop("marker") == "mFalse"  # env reaches the child
    assert seen[True].pop("ppid") != seen[False].pop("ppid") == os.getpid()  # forked by the zygote
    assert seen[True] == seen[False]
    assert seen[True]["cwd"] == seen[True]["path0"] == child_cwd and seen[True]["name"] == "__main__"
    assert seen[True]["fds"] == [0, 1, 2, 3]  # 3: listdir's own; none of the zygote's pipes
    assert seen[True]["argv"] == [str(ROOT / "tests" / "forkserver_child.py")] and seen[True]["threads"] == 1


@pytest.mark.parametrize("forked", [True, False], ids=["forked", "exec"])
@pytest.mark.parametrize("how,code", [("kill", -9), ("terminate", -15), ("sigint", -2)])
def test_signals(child_cwd, tmp_path, forked, how, code):
    log = tmp_path / "child.log"
    proc = start("wait", forked, child_cwd, log)
    wait_for(lambda: "waiting" in log.read_text(), allow(30), "the child to start")
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.05)
    assert proc.poll() is None
    if how == "sigint":
        proc.send_signal(signal.SIGINT)  # Python's own handler: KeyboardInterrupt, a traceback, then SIGINT
    else:
        getattr(proc, how)()
    assert proc.wait(allow(10)) == code
    proc.kill()  # after its exit: nothing (as Popen)
    assert proc.returncode == code


def zygote_of(proc) -> int:
    proc.wait(allow(30))
    return json.loads(Path(proc.log).read_text().splitlines()[-2])["ppid"]


def test_each_environment_gets_its_zygote(child_cwd, tmp_path):
    """Variables read at start-up or import must match the zygote's: another value, another zygote."""
    def spawn(**extra):
        proc = forkserver.spawn(CHILD, child_env("report", **extra), str(log), cwd=child_cwd)
        assert isinstance(proc, forkserver.ForkedProcess)
        proc.log = log
        return proc

    log = tmp_path / "child.log"
    first = zygote_of(spawn())
    assert zygote_of(spawn(PS_X="1", WORKER_X="2", SYNCPS_X="3", PYTEST_CURRENT_TEST="t")) == first
    others = {name: zygote_of(spawn(**{name: "7"})) for name in ("OPENBLAS_NUM_THREADS", "KMP_INIT_AT_FORK")}
    assert first not in others.values() and len(set(others.values())) == 2
    assert zygote_of(spawn(OPENBLAS_NUM_THREADS="7")) == others["OPENBLAS_NUM_THREADS"]  # the 2 last used: kept
    assert zygote_of(spawn()) != first  # the first was ended (idle, least recently used)
    assert len([k for k in forkserver._SERVERS if k[0] == CHILD]) == forkserver.KEEP_IDLE


def test_a_zygote_that_does_not_exit_when_closed_is_killed_not_waited_for():
    """A loaded machine's slow exit fails no caller (a spawn retires old zygotes): SIGKILL after 10 s."""
    calls = []

    class Slow:  # the zygote's Popen: never exits of itself
        stdin = io.BytesIO()

        def wait(self, timeout=None):
            calls.append(("wait", timeout))
            if timeout is not None:
                raise subprocess.TimeoutExpired("zygote", timeout)

        def kill(self):
            calls.append(("kill",))

    srv = object.__new__(forkserver.ForkServer)
    srv.proc, srv._reader = Slow(), threading.Thread(target=lambda: None)
    srv._reader.start()
    srv.close()
    assert calls == [("wait", 10), ("kill",), ("wait", None)]


def test_falls_back_to_exec(child_cwd, tmp_path, monkeypatch):
    log = str(tmp_path / "child.log")
    assert forkserver.spawn("tests.no_such_zygote", child_env("report"), log, cwd=child_cwd) is None
    assert forkserver.spawn(CHILD, child_env("report", PYTHONHOME="/nonexistent"), log, cwd=child_cwd) is None
    # LocalCluster: a prefix (bench.hosts' ``ip netns exec``) always execs
    c = LocalCluster(1, log_dir=tmp_path, prefix=lambda name: [])
    monkeypatch.setenv("SYNCPS_FORK_SERVER", "1")
    monkeypatch.chdir(child_cwd)
    assert isinstance(c._spawn(CHILD, child_env("report"), "a.log"), subprocess.Popen)
    c.prefix = None
    assert isinstance(c._spawn(CHILD, child_env("report"), "b.log"), forkserver.ForkedProcess)
    c.stop()
    # a zygote that died: exec'd from then on
    zygote = forkserver.server(CHILD, child_env("report"), child_cwd)
    zygote.proc.kill()
    wait_for(lambda: not zygote.alive, allow(10), "the zygote's end to be seen")
    assert forkserver.spawn(CHILD, child_env("report"), log, cwd=child_cwd) is None


def test_job_bit_identical_forked_and_exec(monkeypatch):
    forked = []
    real_spawn = forkserver.spawn

    def counting_spawn(*args, **kw):
        proc = real_spawn(*args, **kw)
        forked.append(proc is not None)
        return proc

    monkeypatch.setattr(forkserver, "spawn", counting_spawn)
    ps_env = {"PS_MAX_STEPS": "8"}
    worker_env = {"WORKER_TASK": "linear", "WORKER_SEED": "3", "WORKER_BATCH_SIZE": "16"}
    jobs = {}
    for on in ("1", "0"):
        monkeypatch.setenv("SYNCPS_FORK_SERVER", on)
        jobs[on] = run_job(2, ps_env, worker_env)
        assert jobs[on].exit_codes == [0, 0] and jobs[on].status["global_step"] == 8
    assert forked == [True, True, True]  # the PS and both workers forked; none exec'd when on
    a, b = jobs["1"].tensors, jobs["0"].tensors
    assert a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)
    assert not all(np.all(v == 0) for v in a.values())
