"""A listening address checked, or taken, before a server loads its model (a taken port found after minutes of
loading, or only in tritonserver's log, would waste them)."""

from __future__ import annotations

import socket


def bound(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port, not yet listening; OSError where it cannot be (the socket closed)."""
    # as uvicorn binds for its workers (Config.bind_socket): IPv6 for an address with a colon, else IPv4
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
