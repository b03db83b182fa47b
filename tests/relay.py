"""A second peer host on one machine: a TCP relay whose outgoing connections come from another
loopback address (127.0.0.2, ...), so that a server sees its clients as another host
(context.peer()). What per-caller limits count by."""

from __future__ import annotations

import contextlib
import socket
import threading


class Relay:
    """A TCP relay to `target` (host:port) whose outgoing connections come from `source`: dial
    `addr` to reach `target` as that host."""

    def __init__(self, target: str, source: str = "127.0.0.2"):
        host, port = target.rsplit(":", 1)
        self.target, self.source = (host, int(port)), source
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.addr = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                inbound, _ = self.listener.accept()
                outbound = socket.create_connection(self.target, source_address=(self.source, 0))
                for a, b in ((inbound, outbound), (outbound, inbound)):
                    threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := a.recv(1 << 16):
                b.sendall(data)
        with contextlib.suppress(OSError):
            b.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.listener.close()
