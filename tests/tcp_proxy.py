"""A TCP proxy a test can cut and heal: a network partition between local processes, without namespaces.

:class:`Proxy` listens on a free port of 127.0.0.1 and relays each connection to ``target_port``. :meth:`Proxy.cut`
closes every relayed connection and, until :meth:`Proxy.heal`, closes each new one at once (the client sees its
connection lost, as across a partition whose far side answers nothing).
"""
from __future__ import annotations

import socket
import threading

from cluster.processes import free_port


class Proxy:
    def __init__(self, target_port: int) -> None:
        self.target = target_port
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.up = True
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", self.port), reuse_port=False)
        self._listener.settimeout(0.1)
        self._stopped = False
        threading.Thread(target=self._serve, daemon=True, name=f"proxy-{self.port}").start()

    def _serve(self) -> None:
        while not self._stopped:
            try:
                conn, _ = self._listener.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            if not self.up:
                conn.close()
                continue
            try:
                far = socket.create_connection(("127.0.0.1", self.target), timeout=2.0)
            except OSError:
                conn.close()
                continue
            far.settimeout(None)
            with self._lock:
                self._open.update((conn, far))
            for a, b in ((conn, far), (far, conn)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                self._close(s)

    def _close(self, s: socket.socket) -> None:
        with self._lock:
            self._open.discard(s)
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()

    def cut(self) -> None:
        self.up = False
        with self._lock:
            conns = list(self._open)
        for s in conns:
            self._close(s)

    def heal(self) -> None:
        self.up = True

    def close(self) -> None:
        self._stopped = True
        self.cut()
        self._listener.close()
