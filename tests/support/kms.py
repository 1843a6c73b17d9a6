"""The KMSs for the tests of ``encrypt_records.kms``, each a real HTTP server on a real
socket with its keys in memory:

- moto's AWS KMS server (``moto[server]``, a dev dependency), speaking AWS KMS' JSON API;
- Vault's transit secrets engine (Vault's own code, github.com/hashicorp/vault's
  builtin/logical/transit) behind Vault's HTTP API: tests/support/go/vaulttransit, built
  by scripts/build_test_clients.py.

Their processes can be paused (SIGSTOP: connections open, nothing answers, as a KMS
that hangs) and resumed with their keys kept."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from scripts.build_test_clients import ensure_vault_transit
from scripts.fetch_kafka import FetchError
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
    type = "aws"

    def key_name(self, name: str) -> str:
        """What a rule's ``kms.key`` holds for the key called ``name`` (its alias)."""
        return f"alias/{name}"

    def key_for(self, name: str) -> str:
        """A new key called ``name``: what a rule's ``kms.key`` holds for it."""
        self.new_key(self.key_name(name))
        return self.key_name(name)

    def rule_kms(self, key: str, timeout: float = 1.0) -> str:
        """A rule's ``kms`` (YAML) for ``key`` of this server."""
        return (f"{{type: aws, key: '{key}', region: {REGION}, endpoint: '{self.endpoint}', "
                f"timeout_seconds: {timeout:g}}}")

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

    def paused(self) -> contextlib.AbstractContextManager[None]:
        return paused(self.process)


@contextmanager
def paused(process: subprocess.Popen[bytes]) -> Iterator[None]:
    """A server stopped (SIGSTOP) for the block: calls hang until their timeout."""
    os.kill(process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(process.pid, signal.SIGCONT)


def _moto_server() -> Path:
    found = Path(sys.executable).parent / "moto_server"
    if not found.exists():
        pytest.fail(f"{found} is missing: moto[server] is a dev dependency "
                    "(pip install -e '.[dev]')")
    return found


@contextmanager
def _serving(command: list[str], port: int, log: Path, what: str
             ) -> Iterator[subprocess.Popen[bytes]]:
    """``command`` (a server of ``what`` on ``port``) until the block ends; up when it
    accepts connections."""
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                pytest.fail(f"{what} exited ({process.returncode}): {log.read_text()}")
            try:
                socket.create_connection((LOCALHOST, port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"{what} did not listen in 60 s: {log.read_text()}")
                time.sleep(0.1)
        yield process
    finally:
        stop_process(process, 10)  # woken first if a test left it paused


@contextmanager
def kms_server(log: Path) -> Iterator[KmsServer]:
    """moto's KMS server on a free local port, until the block ends."""
    port = free_port()
    with _serving([str(_moto_server()), "-H", LOCALHOST, "-p", str(port)], port, log,
                  "moto_server") as process:
        yield KmsServer(f"http://{LOCALHOST}:{port}", process)


VAULT_TOKEN = "gatehouse-test-token"


@dataclass
class VaultServer:
    address: str
    process: subprocess.Popen[bytes]
    mount: str = "transit"
    namespace: str | None = None
    context: ssl.SSLContext | None = None  # https: trusting its CA
    type = "vault"

    def key_name(self, name: str) -> str:
        return name

    def key_for(self, name: str) -> str:
        return self.new_key(name)

    def rule_kms(self, key: str, timeout: float = 1.0) -> str:
        """A rule's ``kms`` (YAML) for ``key`` of this server (the token: VAULT_TOKEN)."""
        return (f"{{type: vault, key: '{key}', address: '{self.address}', "
                + (f"namespace: {self.namespace}, " if self.namespace else "")
                + f"timeout_seconds: {timeout:g}}}")

    def call(self, method: str, path: str, body: dict[str, Any] | None = None,
             token: str = VAULT_TOKEN) -> dict[str, Any]:
        """One call of Vault's HTTP API (``path`` under /v1/); its JSON answer."""
        headers = {"X-Vault-Token": token}
        if self.namespace:
            headers["X-Vault-Namespace"] = self.namespace
        request = urllib.request.Request(
            f"{self.address}/v1/{path}", None if body is None else json.dumps(body).encode(),
            headers, method=method)
        with urllib.request.urlopen(request, timeout=10, context=self.context) as answer:
            text = answer.read()
        return json.loads(text) if text else {}

    def new_key(self, name: str) -> str:
        """A new transit key (aes256-gcm96) named ``name``."""
        self.call("POST", f"{self.mount}/keys/{name}", {})
        return name

    def paused(self) -> contextlib.AbstractContextManager[None]:
        return paused(self.process)


@contextmanager
def vault_server(log: Path, *, tls: tuple[Path, Path, Path] | None = None,
                 token: str = VAULT_TOKEN, namespace: str | None = None
                 ) -> Iterator[VaultServer]:
    """Vault's transit engine on a free local port (``tls``: its certificate, key and
    CA files, served over https; ``namespace``: the one its token is valid in), until
    the block ends."""
    try:
        binary = ensure_vault_transit()
    except FetchError as exc:
        pytest.fail(f"tests/support/go/vaulttransit could not be built: {exc}")
    port = free_port()
    command = [str(binary), "-listen", f"{LOCALHOST}:{port}", "-token", token]
    if tls is not None:
        command += ["-tls-cert", str(tls[0]), "-tls-key", str(tls[1])]
    if namespace:
        command += ["-namespace", namespace]
    with _serving(command, port, log, "vaulttransit") as process:
        server = VaultServer(f"{'https' if tls else 'http'}://{LOCALHOST}:{port}", process,
                             namespace=namespace)
        if tls is not None:
            server.context = ssl.create_default_context(cafile=str(tls[2]))
        yield server
