"""Free TCP ports on 127.0.0.1 for the brokers the tests start.

The kernel picks a free port (bind to port 0); a port handed out once is never handed out
again by this process, so two brokers started in one test session never race for it.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

LOCALHOST = "127.0.0.1"

_lock = threading.Lock()
_handed_out: set[int] = set()


def free_port(host: str = LOCALHOST) -> int:
    """A TCP port on ``host`` that is free now and not handed out before by this process."""
    with _lock:
        for _ in range(200):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((host, 0))
                port = int(sock.getsockname()[1])
            if port not in _handed_out:
                _handed_out.add(port)
                return port
    raise RuntimeError(f"no free TCP port on {host}")


def free_ports(count: int, host: str = LOCALHOST) -> list[int]:
    """``count`` distinct free ports (see :func:`free_port`)."""
    return [free_port(host) for _ in range(count)]


def port_is_listening(port: int, host: str = LOCALHOST, timeout: float = 0.5) -> bool:
    """Whether something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def wait_listening(port: int, proc: subprocess.Popen[Any], timeout: float = 30.0) -> None:
    """Until something accepts connections on 127.0.0.1:``port``; fails at once if ``proc``
    (the process that should be listening) exits, with its stderr when it was piped."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            stderr = proc.stderr.read() if proc.stderr else ""
            raise AssertionError(f"process exited with {proc.returncode}: {stderr!r}")
        try:
            socket.create_connection((LOCALHOST, port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"nothing listening on port {port}")


@contextlib.contextmanager
def held_connections(port: int, count: int, host: str = LOCALHOST
                     ) -> Iterator[list[socket.socket]]:
    """``count`` idle connections to ``host:port``, closed on leaving."""
    held = [socket.create_connection((host, port), timeout=10) for _ in range(count)]
    try:
        yield held
    finally:
        for sock in held:
            sock.close()
