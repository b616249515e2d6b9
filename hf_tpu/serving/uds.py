"""A standard-library HTTP client connection for ``hf-tpu serve --uds PATH`` (a unix domain socket instead of TCP: a
host that opens no TCP socket, as the lent TPU machine, or a server reached by local processes only).

Example:
    >>> conn = UnixHTTPConnection("/tmp/hf-tpu.sock", timeout=seconds)  # doctest: +SKIP
    >>> conn.request("GET", "/v1/models"); conn.getresponse().status   # doctest: +SKIP
    200
"""

from __future__ import annotations

import http.client
import socket

__all__ = ["UnixHTTPConnection"]


class UnixHTTPConnection(http.client.HTTPConnection):
    """``http.client.HTTPConnection`` over the unix domain socket at ``path`` (the Host header says ``localhost``).

    Args:
        path: the socket's path (``hf-tpu serve --uds``'s).
        timeout: seconds for the connection and each read.
    """

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = path

    def connect(self) -> None:
        """Open the unix socket (``http.client`` calls this before the first request)."""
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.socket_path)
