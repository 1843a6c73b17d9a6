"""Apicurio Registry, a real Schema Registry (Confluent's REST API under
``/apis/ccompat/v7``), for the tests: fetched from Maven Central by
scripts/fetch_apicurio.py, run on loopback ports with its in-memory storage.
``pause()``/``resume()`` stop and continue the process (a registry that hangs)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Any

from confluent_kafka.schema_registry import SchemaRegistryClient

from scripts.fetch_apicurio import ensure_apicurio, java21
from tests.support.kafka import (
    BrokerStartError,
    forget_process,
    log_tail,
    register_process,
    stop_process,
)
from tests.support.ports import LOCALHOST, free_ports

START_TIMEOUT = 120.0
CLIENT_TIMEOUT = 20.0
JVM_OPTS = ("-Xmx384m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-XX:-UsePerfData")


class ApicurioRegistry:
    """``url``: the Confluent-compatible API's base.  Use as a context manager."""

    def __init__(self) -> None:
        self.port, self.management_port = free_ports(2)
        self.url = f"http://{LOCALHOST}:{self.port}/apis/ccompat/v7"
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self.log_path: Path | None = None

    def start(self) -> ApicurioRegistry:
        app = ensure_apicurio()
        fd, name = tempfile.mkstemp(prefix="gatehouse-apicurio-", suffix=".log")
        os.close(fd)
        self.log_path = Path(name)
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [java21(), *JVM_OPTS, f"-Dquarkus.http.host={LOCALHOST}",
             f"-Dquarkus.http.port={self.port}", f"-Dquarkus.management.host={LOCALHOST}",
             f"-Dquarkus.management.port={self.management_port}",
             "-Dapicurio.storage.kind=sql", "-Dapicurio.storage.sql.kind=h2",
             "-jar", str(app / "quarkus-run.jar")],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT)
        register_process(self.process)
        try:
            self._wait_until_it_answers("did not start")
        except BrokerStartError:
            self.stop()
            raise
        return self

    def _wait_until_it_answers(self, failing: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while not self._answers():
            assert self.process is not None
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise BrokerStartError(f"Apicurio Registry {failing}:\n"
                                       f"{log_tail(self.log_path)}")
            time.sleep(0.2)

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/subjects", timeout=2) as answer:
                return bool(answer.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def register(self, subject: str, schema: str, schema_type: str = "JSON",
                 references: list[dict[str, Any]] | None = None) -> int:
        """``schema``'s id under ``subject`` (registered if new); ``references``:
        ``{name, subject, version}`` of the schemas it refers to."""
        body: dict[str, Any] = {"schema": schema, "schemaType": schema_type}
        if references:
            body["references"] = references
        request = urllib.request.Request(
            f"{self.url}/subjects/{subject}/versions", method="POST",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/vnd.schemaregistry.v1+json"})
        with urllib.request.urlopen(request, timeout=30) as answer:
            schema_id = json.load(answer)["id"]
        assert isinstance(schema_id, int)
        return schema_id

    def client(self) -> SchemaRegistryClient:
        """Confluent's client for this registry. Its requests time out (its default is
        never) and are retried, so a slow answer fails or recovers a test, never hangs it."""
        return SchemaRegistryClient({"url": self.url, "timeout": CLIENT_TIMEOUT})

    def pause(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """Continue the process and wait until it answers again (the tests share it)."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)
        self._wait_until_it_answers("did not answer after SIGCONT")

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process, 20)
            forget_process(self.process)
            self.process = None
        if self._log is not None:
            self._log.close()
            self._log = None
        if self.log_path is not None:
            self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> ApicurioRegistry:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
