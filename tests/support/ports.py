"""Free TCP ports on localhost for tests that start processes which talk to each other."""

from __future__ import annotations

import socket
from contextlib import ExitStack


def free_ports(count: int = 1) -> list[int]:
    """``count`` distinct ports free now (the sockets are held together while asked, so no port comes twice)."""
    with ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
