"""The listening socket of `rt serve` and `rt route`: bound by the command before anything
starts (the engine process, the router's backend checks), so an address that cannot be had
is the command's one-line error, and port 0's real port is known before it is printed."""

from __future__ import annotations

import socket


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) and listening: an address that cannot be had (a bad
    host, a port in use or out of range) is a ValueError naming --host and --port (the
    command's one-line error), not a server's log lines. Port 0: a free port
    (`getsockname()` says which; `socket_url` too)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
    except (OSError, OverflowError) as err:
        raise ValueError(f"--host {host!r} --port {port}: cannot listen there ({err})") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        sock.bind(address)
        sock.listen(2048)  # uvicorn's default backlog
    except OSError as err:
        sock.close()
        raise ValueError(f"--host {host!r} --port {port}: cannot listen there "
                         f"({err.strerror or err})") from None
    return sock  # not inheritable: a child process (engine, replica) does not hold the port


def socket_url(sock: socket.socket) -> str:
    """The base URL a listening socket answers on, e.g. http://127.0.0.1:8000 (IPv6 in
    brackets)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
