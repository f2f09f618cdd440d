"""A loopback server whose answer never completes within a client's per-read timeout: it sends
a head, then a piece of body at a steady pace (httpx's read timeout restarts on each byte). For
the tests of bounded GETs (badinput23: such servers once held rt's probes forever)."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

DRIP_FOR_S = 20.0  # how long the server drips at most: a client bounded in all ends far sooner


@contextlib.contextmanager
def dripping_server(head: bytes, piece: bytes, every_s: float) -> Iterator[str]:
    """The URL (http://127.0.0.1:PORT) of a server that answers its first connection's request
    with `head`, then `piece` every `every_s` seconds for at most `DRIP_FOR_S`, then closes. At
    exit its thread is stopped and joined (bounded)."""
    stop = threading.Event()
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def drip() -> None:
        with contextlib.suppress(OSError):
            conn, _ = server.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(head)
                for _ in range(int(DRIP_FOR_S / every_s)):
                    if stop.wait(every_s):
                        return
                    conn.sendall(piece)

    thread = threading.Thread(target=drip, daemon=True)
    thread.start()
    try:
        with server:
            yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5.0)
