"""A free TCP port on this host, for a rendezvous this process starts itself: a one-process
selftest (rank 0 of a world of 1) and the lab's launcher (the job's MASTER_PORT).

The operating system picks the port (bind to port 0); the socket is closed before the port is
used, so another process could take it in between. Both callers accept that race, as
torch's own tests do: their jobs run one at a time on one host.
"""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
