"""``python -m bench.hosts``: syncps, torch gloo and TensorFlow between emulated hosts, each behind a link of its own.

On loopback bytes cost only CPU; between hosts each host has one NIC of bandwidth B: the PS's NIC carries
2*N*M bytes a round (uncompressed), a ring all-reduce 2*(N-1)/N*M on every host's NIC at once; S PS shards on
hosts of their own (``--shards``) carry 2*N*M/S each, over S links in parallel. This emulates
that on one machine (root, ``ip`` and ``tc``): host ``i`` is a network namespace ``<prefix>-h<i>`` at
``<subnet>.<i+1>``, joined to a bridge ``<prefix>br`` (``<subnet>.254``, in the root namespace) by a veth pair
whose two ends are shaped with ``tc ... tbf rate --rate`` (the host's end: its uplink; the bridge's end: its
downlink). The hosts (and their same-host directories) are always removed (``finally`` and ``atexit``), and so are
a crashed run's leftovers of the same prefix when a run starts. A first line measures one TCP stream between two
hosts (the shaping works).

Systems (``--systems``, a comma list): ``syncps`` and ``syncps-bf16``, ``syncps-topk``, ``syncps-2bit``
(``PS_COMPRESSION``) run :func:`bench.run.measure` (the anchors' workload of :mod:`bench.task`, every tensor over
TCP: ``--transport http``; the window starts and ends as a step completes: a slow link makes few steps) with the PS
in host 0 and worker k in host k+1. ``syncps-colocated`` runs uncompressed with one PS shard per worker, shard k in
worker k's host (BytePS's co-located servers: each host's link carries 2(N-1)/N*M a round, a ring's bytes, and the
piece a worker's own shard holds never leaves its host); worker k and shard k share host k's same-host directory
(``/dev/shm/<namespace>``, :meth:`Hosts.shm_dir`: each emulated host its own /dev/shm), so that piece moves by files,
not through a socket, and every other piece over the links (with ``--rate none``: all over loopback TCP).
``--shards`` (a comma list, default 1) runs each syncps system with S PS shards (``PS_SHARDS``), shard i in host i
and worker k in host S+k; the weights tensor is cut into S slices (``PS_SHARD_SPLIT_ELEMENTS``), so each shard's link
carries 1/S of the bytes. ``gloo`` runs
:mod:`bench.gloo_hosts` (the anchors' torch all-reduce) with rank r in host r+1, in the anchors' torch venv
(``~/.cache/syncps-anchors/torch``; a clear error line when it is missing). ``tf`` runs :mod:`bench.tf_hosts` (the
anchors' TensorFlow SyncReplicasOptimizer, gRPC) with its one ``ps`` task in host 0 (where syncps's one PS runs) and
worker t in host t+1; ``tf-colocated`` with a ps task beside each worker (ps task t and worker t in host t, as
``syncps-colocated``; the weights cut into one partition per ps task by ``fixed_size_partitioner``, TF1's way to spread a
large variable); both in the anchors' TensorFlow venv (``~/.cache/syncps-anchors/tf``, made by
``../shared/bench/compare.sh``; a clear error line when it is missing). ``--rate none``: no namespaces, everything on
loopback (to check a runner against its loopback figure).

Output: with ``--json``, one JSON line per run (bench.run's fields plus ``rate``, ``pass`` and
``wire_bytes_per_step``: the bytes the PS received and sent a step; ``shards``, ``shard_namespaces`` and
``worker_namespaces``, and with S > 1 bench.run's
``shard_urls`` and ``shard_wire_bytes_per_step``; gloo: ``ring_bytes_per_host_per_step``; tf, tf-colocated: the
anchor's fields plus ``ps_tasks``, ``ps_namespaces`` and ``worker_namespaces``); then, always, a Markdown table,
rows params x workers, a column per system (``syncps S=2``: two shards, when ``--shards`` is not just 1) and the
ratio of each syncps column to each anchor that ran (gloo, tf, tf-colocated). ``--repeat K`` runs K passes over each
cell, every system once a pass in turn: the table then gives each column's median steps/s and the median of the
per-pass ratios, with their range.
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import output
from bench.run import measure
from bench.table import machine
from bench.task import model_dims
from cluster.processes import free_port, patience

ROOT = Path(__file__).resolve().parent.parent
GLOO_RUNNER = ROOT / "bench" / "gloo_hosts.py"
TF_RUNNER = ROOT / "bench" / "tf_hosts.py"
ANCHOR_VENVS = Path.home() / ".cache" / "syncps-anchors"
TORCH_PYTHON = ANCHOR_VENVS / "torch" / "bin" / "python"
TF_PYTHON = ANCHOR_VENVS / "tf" / "bin" / "python"
TF_COLOCATED = "tf-colocated"
#: the anchors: each run by its own runner, compared with every syncps column
ANCHORS = ("gloo", "tf", TF_COLOCATED)
#: where each host's same-host directory is made (``<SHM_ROOT>/<namespace>``: one host's /dev/shm)
SHM_ROOT = Path("/dev/shm")
UNITS = {"tbit": 1e12, "gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=30)


def rate_bits(rate: str) -> float:
    """``1gbit`` -> 1e9 (tc's units of bits per second)."""
    unit = next(u for u in UNITS if rate.lower().endswith(u))
    return float(rate[: -len(unit)]) * UNITS[unit]


def namespaces(prefix: str) -> list[str]:
    """The hosts of ``prefix`` that exist."""
    return [name for line in sh("ip", "netns", "list").stdout.splitlines()
            if re.fullmatch(rf"{re.escape(prefix)}-h\d+", name := line.split()[0])]


def remove_hosts(prefix: str) -> None:
    """Delete the namespaces (killing what still runs there: a crashed run's PS and workers), links and forwarding
    rule of ``prefix`` (a namespace takes its veth pair along)."""
    for ns in namespaces(prefix):
        for pid in sh("ip", "netns", "pids", ns, check=False).stdout.split():
            with contextlib.suppress(OSError):
                os.kill(int(pid), signal.SIGKILL)
        sh("ip", "netns", "delete", ns, check=False)
    ours = re.compile(rf"{re.escape(prefix)}(br|v\d+|n\d+)")
    for line in sh("ip", "-o", "link", "show").stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if ours.fullmatch(name):
            sh("ip", "link", "delete", name, check=False)
    while shutil.which("iptables") and sh("iptables", "-D", *forward_rule(prefix), check=False).returncode == 0:
        pass
    for d in SHM_ROOT.glob(f"{prefix}-h*"):
        shutil.rmtree(d, ignore_errors=True)


def available(prefix: str) -> bool:
    """Can hosts be emulated here (root, ``ip``, ``tc``, network namespaces)? Tried with a namespace of ``prefix``."""
    if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")):
        return False
    probe = f"{prefix}-probe"
    ok = sh("ip", "netns", "add", probe, check=False).returncode == 0
    sh("ip", "netns", "delete", probe, check=False)
    return ok


def forward_rule(prefix: str) -> list[str]:
    """Bridged frames pass iptables' FORWARD chain when br_netfilter is loaded (Docker's policy: DROP)."""
    return ["FORWARD", "-i", f"{prefix}br", "-o", f"{prefix}br", "-j", "ACCEPT"]


class Hosts:
    """``count`` emulated hosts on a bridge, every link shaped at ``rate`` (a context manager)."""

    def __init__(self, count: int, rate: str, prefix: str = "sph", subnet: str = "10.88.0") -> None:
        self.count, self.rate, self.prefix, self.subnet = count, rate, prefix, subnet

    def ip(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def namespace(self, i: int) -> str:
        return f"{self.prefix}-h{i}"

    def device(self, i: int) -> str:
        """Host ``i``'s end of its veth pair (inside its namespace)."""
        return f"{self.prefix}n{i}"

    def exec_prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(i)]

    def shm_dir(self, i: int) -> Path:
        """Host ``i``'s same-host directory (its /dev/shm: the processes of other hosts do not look there)."""
        d = SHM_ROOT / self.namespace(i)
        d.mkdir(exist_ok=True)
        return d

    def shape(self, device: str, run_in: list[str] | None = None) -> None:
        """A token bucket on ``device``'s egress (``run_in``: the namespace's ``ip netns exec`` prefix)."""
        burst = max(64 * 1024, int(rate_bits(self.rate) / 8 / 1000))  # 1 ms of traffic, at least one GSO packet
        sh(*(run_in or []), "tc", "qdisc", "add", "dev", device, "root", "tbf", "rate", self.rate,
           "burst", str(burst), "latency", "20ms")

    @contextlib.contextmanager
    def cut_off(self, i: int):
        """Host ``i``'s traffic silently dropped both ways while inside (a cable pulled further along: no reset, no
        error, the packets are gone; ``iptables`` in the host's namespace)."""
        rules = [["INPUT", "-i", self.device(i), "-j", "DROP"], ["OUTPUT", "-o", self.device(i), "-j", "DROP"]]
        for rule in rules:
            sh(*self.exec_prefix(i), "iptables", "-w", "-I", *rule)
        try:
            yield
        finally:
            for rule in rules:
                sh(*self.exec_prefix(i), "iptables", "-w", "-D", *rule, check=False)

    def __enter__(self) -> Hosts:
        remove_hosts(self.prefix)
        atexit.register(remove_hosts, self.prefix)
        try:
            bridge = f"{self.prefix}br"
            sh("ip", "link", "add", bridge, "type", "bridge")
            sh("ip", "addr", "add", f"{self.subnet}.254/24", "dev", bridge)
            sh("ip", "link", "set", bridge, "up")
            if shutil.which("iptables"):
                sh("iptables", "-I", *forward_rule(self.prefix))
            for i in range(self.count):
                ns, outer, inner = self.namespace(i), f"{self.prefix}v{i}", self.device(i)
                sh("ip", "netns", "add", ns)
                sh("ip", "link", "add", outer, "type", "veth", "peer", "name", inner, "netns", ns)
                sh("ip", "-n", ns, "addr", "add", f"{self.ip(i)}/24", "dev", inner)
                sh("ip", "-n", ns, "link", "set", inner, "up")
                sh("ip", "-n", ns, "link", "set", "lo", "up")
                sh("ip", "link", "set", outer, "master", bridge)
                sh("ip", "link", "set", outer, "up")
                self.shape(outer)
                self.shape(inner, self.exec_prefix(i))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        remove_hosts(self.prefix)
        atexit.unregister(remove_hosts)


def sink(ip: str, port: int) -> None:
    """Accept one TCP stream and print its rate (bytes from the first to the last, over that time)."""
    import socket
    with socket.create_server((ip, port)) as server:
        # the source connects within 10 s (times patience), then sends without pause: never a wait without end
        server.settimeout(60 * patience())
        conn, _ = server.accept()
        with conn:
            conn.settimeout(60 * patience())
            buf, total, first = bytearray(1 << 20), 0, None
            while n := conn.recv_into(buf):
                first = first or time.perf_counter()
                total += n
            seconds = time.perf_counter() - (first or time.perf_counter())
    print(json.dumps({"bytes": total, "seconds": round(seconds, 4)}), flush=True)


def source(ip: str, port: int, seconds: float) -> None:
    """Send zeros to ``ip:port`` for ``seconds`` (connecting with retries while the sink starts)."""
    import socket
    end = time.monotonic() + 10 * patience()
    while True:
        try:
            conn = socket.create_connection((ip, port), timeout=10 * patience())
            break
        except OSError:
            if time.monotonic() > end:
                raise
            time.sleep(0.05)
    with conn:
        chunk, stop = bytes(1 << 20), time.monotonic() + seconds
        while time.monotonic() < stop:
            conn.sendall(chunk)


def stream_check(hosts: Hosts, seconds: float = 1.0) -> dict:
    """One TCP stream from host 1 to host 0: the JSON line showing the links are shaped."""
    port = free_port()
    call = "from bench.hosts import {}; {}"
    sink_proc = subprocess.Popen([*hosts.exec_prefix(0), sys.executable, "-c",
                                  call.format("sink", f"sink({hosts.ip(0)!r}, {port})")],
                                 cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        subprocess.run([*hosts.exec_prefix(1), sys.executable, "-c",
                        call.format("source", f"source({hosts.ip(0)!r}, {port}, {seconds})")],
                       cwd=ROOT, check=True, timeout=seconds + 30 * patience())
        got = json.loads(sink_proc.communicate(timeout=30 * patience())[0])
    finally:
        sink_proc.kill()
        sink_proc.wait()
    return {"check": "tcp_stream", "rate": hosts.rate, "from": hosts.ip(1), "to": hosts.ip(0),
            "mbit_per_s": round(got["bytes"] * 8 / 1e6 / max(got["seconds"], 1e-9), 1), **got}


COLOCATED = "syncps-colocated"


def host_of(name: str, shards: int, colocated: bool = False) -> int:
    """The host of the process whose log is ``name``: shard i (``ps``, ``ps-<i>``) in host i, worker k in host S+k
    (``colocated``: in host k, beside shard k)."""
    index = int(name.rsplit("-", 1)[1]) if "-" in name else 0
    return index if name.startswith("ps") or colocated else shards + index


def placement(hosts: Hosts, shards: int, colocated: bool) -> dict:
    """:class:`LocalCluster` options that run shard i in host i and worker k in host S+k (``colocated``: in host k,
    beside shard k, both with that host's same-host directory: a worker's own shard by files)."""
    def prefix(name: str) -> list[str]:
        h = host_of(name, shards, colocated)
        shm = [f"PS_SHM_DIR={hosts.shm_dir(h)}", f"WORKER_SHM_DIR={hosts.shm_dir(h)}"] if colocated else []
        return [*hosts.exec_prefix(h), *(["env", *shm] if shm else [])]
    return {"hosts": [hosts.ip(i) for i in range(shards)], "prefix": prefix}


def syncps(hosts: Hosts | None, system: str, workers: int, params: int, seconds: float, warmup: float,
           shards: int = 1) -> dict:
    """bench.run's line for ``syncps[-compression]`` with ``shards`` PS shards: shard i in host i, worker k in host
    S+k, tensors over TCP; the weights cut into S slices. ``syncps-colocated``: uncompressed, S = ``workers`` shards,
    worker k in host k beside shard k."""
    colocated = system == COLOCATED
    shards = workers if colocated else shards
    options = {} if hosts is None else placement(hosts, shards, colocated)
    d, k = model_dims(params)
    ps_env = {"PS_SHARD_SPLIT_ELEMENTS": -(-d * k // shards)} if shards > 1 else {}
    compression = "none" if colocated else system.partition("-")[2] or "none"
    transport = "auto" if colocated and hosts is not None else "http"
    line = {**measure(workers, params, seconds, warmup, transport=transport, compression=compression, ps_env=ps_env,
                      shards=shards, cluster_options=options, step_aligned=True), "system": system, "shards": shards}
    if hosts is not None:
        line["shard_namespaces"] = [hosts.namespace(i) for i in range(shards)]
        line["worker_namespaces"] = [hosts.namespace(host_of(f"worker-{k}", shards, colocated)) for k in range(workers)]
    if line.get("steps_per_s"):
        line["wire_bytes_per_step"] = round(line["wire_MB_per_s"] * 1e6 / line["steps_per_s"])
    return line


def anchor_line(base: dict, commands: list[tuple[list[str], dict]], reporter: int, timeout: float) -> dict:
    """Start an anchor's processes (each command with its environment), read the JSON line the ``reporter``-th prints,
    then kill them all: that line, or ``base`` with the error (and ``steps_per_s`` None)."""
    procs = []
    with tempfile.TemporaryFile("w+") as errors:
        try:
            for i, (cmd, env) in enumerate(commands):
                procs.append(subprocess.Popen(cmd, env=env, stderr=errors, text=True,
                                              stdout=subprocess.PIPE if i == reporter else subprocess.DEVNULL))
            out = procs[reporter].communicate(timeout=timeout)[0]
            lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            if not lines:
                errors.seek(0)
                return {**base, "steps_per_s": None, "error": "no result line: " + errors.read()[-1000:]}
        except subprocess.TimeoutExpired:
            return {**base, "steps_per_s": None, "error": "timed out"}
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
    return {**lines[-1], **base}


def gloo(hosts: Hosts | None, workers: int, params: int, seconds: float, warmup: float) -> dict:
    """The anchors' gloo all-reduce, rank r in host r+1 (:mod:`bench.gloo_hosts`): rank 0's line."""
    base = {"system": "gloo", "workers": workers, "params_requested": params}
    if not TORCH_PYTHON.exists():
        return {**base, "steps_per_s": None, "error": f"skipped: no torch venv at {TORCH_PYTHON}"}
    port, master = free_port(), "127.0.0.1" if hosts is None else hosts.ip(1)
    args = ["--master", master, "--port", str(port), "--workers", str(workers), "--params", str(params),
            "--seconds", str(seconds), "--warmup", str(warmup)]
    line = anchor_line(base, [([*([] if hosts is None else hosts.exec_prefix(rank + 1)), str(TORCH_PYTHON),
                                 str(GLOO_RUNNER), "--rank", str(rank), *args],
                                {**os.environ, "GLOO_SOCKET_IFNAME": "lo" if hosts is None else hosts.device(rank + 1)})
                               for rank in range(workers)], 0, 120 + warmup + 3 * seconds)
    if line.get("steps_per_s"):
        line["ring_bytes_per_host_per_step"] = round(2 * (workers - 1) / workers * line["params"] * 4)
    return line


def tf(hosts: Hosts | None, system: str, workers: int, params: int, seconds: float, warmup: float) -> dict:
    """The anchors' TensorFlow SyncReplicasOptimizer (:mod:`bench.tf_hosts`), the chief's line. ``tf``: its one
    ``ps`` task in host 0 (where syncps's one PS runs), worker t in host t+1 (gloo's rank t's host). ``tf-colocated``:
    a ps task per worker, ps task t beside worker t in host t (as ``syncps-colocated``), the weights cut into one
    partition per ps task."""
    base = {"system": system, "workers": workers, "params_requested": params}
    if not TF_PYTHON.exists():
        return {**base, "steps_per_s": None, "error": f"skipped: no TensorFlow venv at {TF_PYTHON}"}
    ps_hosts = list(range(workers)) if system == TF_COLOCATED else [0]
    tasks = [("ps", t, h) for t, h in enumerate(ps_hosts)]
    tasks += [("worker", t, t if system == TF_COLOCATED else t + 1) for t in range(workers)]
    ports = [free_port() for _ in tasks]
    at = [("127.0.0.1" if hosts is None else hosts.ip(h)) + f":{port}" for (_, _, h), port in zip(tasks, ports)]
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}  # gRPC would honour a proxy
    env.update(TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    with tempfile.TemporaryDirectory() as logdir:  # the tasks meet through its files (the anchor's progress, "go")
        args = ["--ps-addresses", ",".join(at[:len(ps_hosts)]), "--worker-addresses", ",".join(at[len(ps_hosts):]),
                "--ports", ",".join(map(str, ports)), "--logdir", logdir, "--workers", str(workers),
                "--params", str(params), "--seconds", str(seconds), "--warmup", str(warmup)]
        line = anchor_line(base, [([*([] if hosts is None else hosts.exec_prefix(host)), str(TF_PYTHON), str(TF_RUNNER),
                                    "--role", role, "--task", str(task), *args], env) for role, task, host in tasks],
                           len(ps_hosts), 180 + warmup + 3 * seconds)  # the chief: worker 0
    line["ps_tasks"] = len(ps_hosts)
    if hosts is not None:
        line["ps_namespaces"] = [hosts.namespace(h) for h in ps_hosts]
        line["worker_namespaces"] = [hosts.namespace(h) for _, _, h in tasks[len(ps_hosts):]]
    return line


def column(line: dict, label_shards: bool) -> str:
    """A line's table column: its system, with ``S=<shards>`` when the table compares shard counts (not an anchor's,
    nor ``syncps-colocated``'s: one shard per worker)."""
    labelled = label_shards and line["system"] not in (*ANCHORS, COLOCATED)
    return f"{line['system']} S={line.get('shards', 1)}" if labelled else line["system"]


def table(lines: list[dict], systems: list[str]) -> str:
    """Rows params x workers, a column per system (steps/s; ``systems``: the lines' :func:`column` names), then each
    syncps column over gloo. With repeated passes (lines' ``pass``): the median steps/s of a column, and the median of
    the ratios of each pass (a syncps run over the gloo run of the same pass) with their range in brackets."""
    labelled = any(" S=" in s for s in systems)
    rate = {(x["params_requested"], x["workers"], column(x, labelled), x.get("pass", 0)): x.get("steps_per_s")
            for x in lines}
    ratios = [(s, a) for a in ANCHORS if a in systems for s in systems if s not in ANCHORS]
    head = ["params", "workers", *systems, *(f"{s} / {a}" for s, a in ratios)]
    rows = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for p, n in sorted({(p, n) for p, n, _, _ in rate}):
        passes = sorted({i for q, m, _, i in rate if (q, m) == (p, n)})
        cells = [f"{p:,}", str(n)]
        for s in systems:
            got = [v for i in passes if (v := rate.get((p, n, s, i)))]
            cells.append(f"{statistics.median(got):.3g}" if got else "-")
        for s, anchor in ratios:
            each = [a / b for i in passes if (a := rate.get((p, n, s, i))) and (b := rate.get((p, n, anchor, i)))]
            spread = f" [{min(each):.2f}-{max(each):.2f}]" if len(each) > 1 else ""
            cells.append(f"{statistics.median(each):.2f}x{spread}" if each else "-")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.hosts", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="1gbit", help="every host's link, up and down (tc units: 1gbit, 100mbit); "
                                                    "none: no namespaces, all on loopback")
    ap.add_argument("--workers", default="2", help="comma list")
    ap.add_argument("--params", default="1000000", help="comma list")
    ap.add_argument("--seconds", type=float, default=5.0, help="measured seconds of each run")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds of training before each run's window")
    ap.add_argument("--systems", default="syncps,gloo",
                    help="comma list of syncps, syncps-bf16, syncps-fp16, syncps-topk, syncps-2bit, "
                         f"{COLOCATED} (one shard per worker, in its host), gloo, tf, {TF_COLOCATED} (a TensorFlow "
                         "ps task per worker, in its host)")
    ap.add_argument("--shards", default="1", help="comma list of PS shard counts S for each syncps system: shard i "
                                                  "in host i, the workers in the hosts after them")
    ap.add_argument("--repeat", type=int, default=1, help="passes over each params x workers cell, every system "
                                                          "run once a pass, in turn (a VM's speed can swing)")
    ap.add_argument("--prefix", default="sph", help="of the namespaces and links (a crashed run's are removed)")
    ap.add_argument("--subnet", default="10.88.0", help="the hosts' /24 (host i at .i+1, the bridge at .254)")
    output.add_json_option(ap)
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the hosts are removed on the way out
    workers = [int(w) for w in args.workers.split(",")]
    systems = [s for s in args.systems.split(",") if s]
    shard_counts = [int(s) for s in args.shards.split(",")]
    runs = [(system, s) for system in systems for s in ([1] if system in (*ANCHORS, COLOCATED) else shard_counts)]
    columns = [column({"system": system, "shards": s}, shard_counts != [1]) for system, s in runs]
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines: list[dict] = []
    with (Hosts(max(shard_counts) + max(workers), args.rate, args.prefix, args.subnet) if args.rate != "none"
          else contextlib.nullcontext()) as hosts:
        if hosts is not None:
            check = stream_check(hosts)
            print(json.dumps(check) if args.json else "link check:\n" + output.table([check]), flush=True)
        for params in (int(float(p)) for p in args.params.split(",")):
            for n in workers:
                for i in range(max(1, args.repeat)):
                    for system, shards in runs:
                        line = (gloo(hosts, n, params, args.seconds, args.warmup) if system == "gloo" else
                                tf(hosts, system, n, params, args.seconds, args.warmup) if system in ANCHORS else
                                syncps(hosts, system, n, params, args.seconds, args.warmup, shards))
                        line["rate"], line["pass"] = args.rate, i
                        lines.append(line)
                        if args.json:
                            print(json.dumps(line), flush=True)
    print(f"\nsteps/s between emulated hosts, link {args.rate} per host; {started}; {machine()}; "
          f"load {os.getloadavg()[0]:.2f}\n")
    print(table(lines, columns))
    return 0 if all(x.get("steps_per_s") for x in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
