"""A TCP relay between a decode replica and a prefill replica's KV transfer server, which cuts the
connection part-way: the network failures of disaggregated serving, on real sockets.

``Relay(target, limit_bytes)`` listens on a free loopback port and, for each connection, forwards
everything the client sends and the first ``limit_bytes`` the server answers. Once that many bytes went
through it sets ``cut``, forwards nothing more and closes both connections: at once, or with
``hold=True`` only when ``release()`` is called, so a test can kill the server first (the client then
sees the peer vanish mid-transfer, as it would across a real network).
"""

from __future__ import annotations

import contextlib
import socket
import threading


class Relay:
    def __init__(self, target: tuple[str, int], limit_bytes: int, hold: bool = False) -> None:
        self.target = target
        self.limit_bytes = limit_bytes
        self.hold = hold
        self.cut = threading.Event()
        self._released = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def release(self) -> None:
        """Close the client's side of a held cut."""
        self._released.set()

    def close(self) -> None:
        self._released.set()
        self._listener.close()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            self._sockets += [client, server]
            threading.Thread(target=self._upstream, args=(client, server), daemon=True).start()
            threading.Thread(target=self._downstream, args=(server, client), daemon=True).start()

    @staticmethod
    def _upstream(client: socket.socket, server: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                server.sendall(data)

    def _downstream(self, server: socket.socket, client: socket.socket) -> None:
        sent = 0
        with contextlib.suppress(OSError):
            while sent < self.limit_bytes and (data := server.recv(min(65536, self.limit_bytes - sent))):
                client.sendall(data)
                sent += len(data)
        self.cut.set()
        if self.hold:
            self._released.wait()
        for sock in (server, client):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # (a close alone waits for the other thread's recv)
            with contextlib.suppress(OSError):
                sock.close()
