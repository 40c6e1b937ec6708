"""``python -m bench.loopback [--bytes N]``: loopback TCP throughput, one JSON line (docs/scaling.md, B).

One receiver process, one sender (this one), ``--bytes`` sent in 4 MiB ``sendall`` chunks over 127.0.0.1,
timed from the first byte to the receiver's one-byte acknowledgement of the last: ``GB_per_s``, ``seconds``,
``load_avg``. On loopback both ends are CPU (a copy each), so this is the machine's TCP rate per stream.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import socket
import time

from bench.output import Results, add_json_option
from cluster.processes import patience

CHUNK = 4 << 20


def _cpu() -> float:
    """This process's CPU seconds (user + system)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def sink(total: int, ports: mp.Queue, chunk: int = CHUNK, cpu: mp.Queue | None = None) -> None:
    """Receive ``total`` bytes on a fresh listening socket (its port put on ``ports``) into a ``chunk``-byte buffer,
    then acknowledge with one byte; the CPU seconds that took go on ``cpu`` when given."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(120)  # the sender connects at once (the bench's other end): never a wait without end
        ports.put(server.getsockname()[1])
        conn, _ = server.accept()
        with conn:
            conn.settimeout(120)
            view, got, start = memoryview(bytearray(chunk)), 0, _cpu()
            while got < total:
                n = conn.recv_into(view[:min(chunk, total - got)])
                if not n:
                    break
                got += n
            if cpu is not None:
                cpu.put(_cpu() - start)
            conn.sendall(b"k")


def stream(total: int, chunk: int = CHUNK) -> dict:
    """``total`` bytes to a :func:`sink` process in ``chunk``-byte ``sendall`` calls: the bytes, the seconds from the
    first byte to the acknowledgement of the last, and each end's CPU seconds."""
    ports: mp.Queue = mp.Queue()
    cpu: mp.Queue = mp.Queue()
    receiver = mp.Process(target=sink, args=(total, ports, chunk, cpu))
    receiver.start()
    try:
        data = memoryview(bytes(chunk))
        with socket.create_connection(("127.0.0.1", ports.get(timeout=30 * patience())), timeout=120) as conn:
            sent, t0, start = 0, time.perf_counter(), _cpu()
            while sent < total:
                n = min(chunk, total - sent)
                conn.sendall(data[:n])
                sent += n
            sender_cpu = _cpu() - start
            conn.recv(1)
            seconds = time.perf_counter() - t0
        receiver_cpu = cpu.get(timeout=60 * patience())
    finally:
        receiver.join(10)
        if receiver.is_alive():
            receiver.kill()
    return {"bytes": sent, "seconds": seconds, "sender_cpu_s": sender_cpu, "receiver_cpu_s": receiver_cpu}


def measure(total: int) -> dict:
    s = stream(total)
    return {"bytes": s["bytes"], "seconds": round(s["seconds"], 3), "GB_per_s": round(s["bytes"] / s["seconds"] / 1e9, 3),
            "load_avg": round(os.getloadavg()[0], 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.loopback", description=__doc__.split("\n\n")[0])
    ap.add_argument("--bytes", type=float, default=2e9, help="bytes streamed through loopback TCP")
    add_json_option(ap)
    args = ap.parse_args(argv)
    with Results(args.json, prog=ap.prog) as out:
        out.add(measure(int(args.bytes)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
