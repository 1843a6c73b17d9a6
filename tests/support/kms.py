"""A KMS for the tests of ``encrypt_records.kms``: moto's AWS KMS server (``moto[server]``,
a dev dependency), a real HTTP server on a real socket speaking AWS KMS' JSON API, with
its keys in memory.  Its process can be paused (SIGSTOP: connections open, nothing
answers, as a KMS that hangs) and resumed with its keys kept."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.kafka import stop_process
from tests.support.ports import LOCALHOST, free_port

REGION = "eu-west-1"
# moto takes any credentials; botocore must find some (never real ones here).
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "gatehouse-test", "AWS_SECRET_ACCESS_KEY": "not-a-secret",
               "AWS_DEFAULT_REGION": REGION}


@dataclass
class KmsServer:
    endpoint: str
    process: subprocess.Popen[bytes]

    def client(self) -> Any:
        import botocore.session

        return botocore.session.Session().create_client(
            "kms", region_name=REGION, endpoint_url=self.endpoint,
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"])

    def new_key(self, alias: str | None = None) -> str:
        """A new symmetric key's id (with ``alias``, e.g. alias/orders, pointing at it)."""
        client = self.client()
        key_id: str = client.create_key()["KeyMetadata"]["KeyId"]
        if alias is not None:
            client.create_alias(AliasName=alias, TargetKeyId=key_id)
        return key_id

    @contextmanager
    def paused(self) -> Iterator[None]:
        """The server stopped (SIGSTOP) for the block: calls hang until their timeout."""
        os.kill(self.process.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self.process.pid, signal.SIGCONT)


def _moto_server() -> Path:
    found = Path(sys.executable).parent / "moto_server"
    if not found.exists():
        pytest.fail(f"{found} is missing: moto[server] is a dev dependency "
                    "(pip install -e '.[dev]')")
    return found


@contextmanager
def kms_server(log: Path) -> Iterator[KmsServer]:
    """moto's KMS server on a free local port, until the block ends."""
    port = free_port()
    with log.open("wb") as out:
        process = subprocess.Popen([str(_moto_server()), "-H", LOCALHOST, "-p", str(port)],
                                   stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 60
        while True:  # up when it accepts connections (it says nothing before)
            if process.poll() is not None:
                pytest.fail(f"moto_server exited ({process.returncode}): {log.read_text()}")
            try:
                socket.create_connection((LOCALHOST, port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"moto_server did not listen in 60 s: {log.read_text()}")
                time.sleep(0.1)
        yield KmsServer(f"http://{LOCALHOST}:{port}", process)
    finally:
        stop_process(process, 10)  # woken first if a test left it paused
