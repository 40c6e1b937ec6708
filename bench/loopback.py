"""``python -m bench.loopback [--bytes N]``: loopback TCP throughput, one JSON line (docs/scaling.md, B).

One receiver process, one sender (this one), ``--bytes`` sent in 4 MiB ``sendall`` chunks over 127.0.0.1,
timed from the first byte to the receiver's one-byte acknowledgement of the last: ``GB_per_s``, ``seconds``,
``load_avg``. On loopback both ends are CPU (a copy each), so this is the machine's TCP rate per stream.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import time

CHUNK = 4 << 20


def _sink(total: int, ports: mp.Queue) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        ports.put(server.getsockname()[1])
        conn, _ = server.accept()
        with conn:
            view, got = memoryview(bytearray(CHUNK)), 0
            while got < total:
                n = conn.recv_into(view)
                if not n:
                    break
                got += n
            conn.sendall(b"k")


def measure(total: int) -> dict:
    ports: mp.Queue = mp.Queue()
    sink = mp.Process(target=_sink, args=(total, ports))
    sink.start()
    try:
        with socket.create_connection(("127.0.0.1", ports.get(timeout=30)), timeout=60) as conn:
            data, sent, t0 = bytes(CHUNK), 0, time.perf_counter()
            while sent < total:
                conn.sendall(data)
                sent += CHUNK
            conn.recv(1)
            seconds = time.perf_counter() - t0
    finally:
        sink.join(10)
    return {"bytes": sent, "seconds": round(seconds, 3), "GB_per_s": round(sent / seconds / 1e9, 3),
            "load_avg": round(os.getloadavg()[0], 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.loopback", description=__doc__.split("\n\n")[0])
    ap.add_argument("--bytes", type=float, default=2e9)
    print(json.dumps(measure(int(ap.parse_args(argv).bytes))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
