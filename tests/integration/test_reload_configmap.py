"""Rules reload when Kubernetes updates a mounted ConfigMap, at the process level.

`gatehouse run` reads its config and rules from a directory laid out like a mounted
ConfigMap (files are symlinks through ``..data``); the test swaps ``..data`` to new rules
as the kubelet does and a real client (librdkafka's admin API) sees CreateTopics refused,
then allowed again. The second swap keeps the old file's mtime and size, so only the
file's identity says it changed.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import confluent_kafka as ck
import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from tests.support.configmap import ConfigMapVolume
from tests.support.ports import free_port
from tests.support.tansu import TansuBroker

DENY_CREATE = "rules:\n  - name: no-create\n    deny_apis: [CreateTopics]\n"
ALLOW_ALL = "rules:\n  - name: no-create\n    deny_apis: []            \n"  # same size


def http_get(port: int, path: str) -> tuple[int, str]:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(f"GET {path} HTTP/1.0\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.decode().partition("\r\n\r\n")
    return int(head.split()[1]), body


def reloads_ok(metrics_port: int) -> int:
    _, text = http_get(metrics_port, "/metrics")
    found = re.search(r'^gatehouse_rules_reloads_total\{outcome="ok"\} (\S+)$', text, re.M)
    assert found is not None, text[-2000:]
    return int(float(found.group(1)))


def wait_for(predicate: object, what: str, proc: subprocess.Popen[str],
             timeout: float = 20.0) -> None:
    assert callable(predicate)
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"gatehouse exited with {proc.returncode}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


def create_topic(bootstrap: str, name: str) -> ck.KafkaError | None:
    """CreateTopics through ``bootstrap``; the error a real client got, or None."""
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 3})
    future = admin.create_topics([NewTopic(name, num_partitions=1, replication_factor=1)],
                                 request_timeout=15)[name]
    try:
        future.result(timeout=30)
    except ck.KafkaException as exc:
        error: ck.KafkaError = exc.args[0]
        return error
    return None


@pytest.fixture
def proxy_on_configmap(tansu: TansuBroker, tmp_path: Path
                       ) -> Iterator[tuple[ConfigMapVolume, str, int, subprocess.Popen[str]]]:
    port, metrics_port = free_port(), free_port()
    volume = ConfigMapVolume(tmp_path / "etc-gatehouse")
    config = (f"listen: 127.0.0.1:{port}\nupstream: [{tansu.bootstrap}]\n"
              f"brokers: {{start_port: 0}}\nmetrics: {{listen: 127.0.0.1:{metrics_port}}}\n"
              "log: {json: true}\nrules_file: rules.yaml\n")
    volume.publish({"gatehouse.yaml": config, "rules.yaml": ALLOW_ALL})
    proc = subprocess.Popen(
        [sys.executable, "-m", "gatehouse.cli", "run", "--config",
         str(volume.root / "gatehouse.yaml")],
        text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_for(lambda: listening(port) and listening(metrics_port), "the listeners", proc)
        yield volume, f"127.0.0.1:{port}", metrics_port, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)
        assert proc.stderr is not None
        proc.stderr.close()


def test_configmap_update_swaps_rules_for_a_real_client(
        proxy_on_configmap: tuple[ConfigMapVolume, str, int, subprocess.Popen[str]]) -> None:
    volume, bootstrap, metrics_port, proc = proxy_on_configmap
    config = (volume.root / "gatehouse.yaml").read_text()
    stamp = f"{os.getpid()}-{time.monotonic_ns()}"

    assert create_topic(bootstrap, f"reload-a-{stamp}") is None
    assert reloads_ok(metrics_port) == 0

    volume.publish({"gatehouse.yaml": config, "rules.yaml": DENY_CREATE})
    wait_for(lambda: reloads_ok(metrics_port) == 1, "the first reload", proc)
    error = create_topic(bootstrap, f"reload-b-{stamp}")
    assert error is not None and error.code() == ck.KafkaError.CLUSTER_AUTHORIZATION_FAILED

    # The old file's mtime and size: only the symlink swap (a new inode) says it changed.
    volume.publish({"gatehouse.yaml": config, "rules.yaml": ALLOW_ALL}, keep_mtime=True)
    wait_for(lambda: reloads_ok(metrics_port) == 2, "the second reload", proc)
    assert create_topic(bootstrap, f"reload-b-{stamp}") is None

    proc.terminate()
    assert proc.wait(30) == 0
    assert proc.stderr is not None
    log = proc.stderr.read()
    assert log.count('"event": "rules reloaded"') == 2, log[-3000:]
