"""A Kafka Connect worker (distributed mode) through the proxy as a tenant, on a real
Apache Kafka broker: its config, offset and status topics, its worker group (the
"connect" group protocol, whose bytes the proxy passes on untouched), a file source
connector writing a topic and a file sink connector reading it in a group of its own,
all under the tenant's prefix on the broker; every line of the source file reaches the
sink file."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from confluent_kafka.admin import AdminClient

from scripts.fetch_kafka import ensure_kafka_connect
from tests.integration.test_rules_groups import group_types
from tests.support.clients import unique, watermarks
from tests.support.kafka import KafkaCluster, start_java_process, stop_process
from tests.support.ports import free_port
from tests.support.proxythread import ProxyThread

RULES = "- name: tenant-a\n  topic_prefix: {broker: 'a.', hide_others: true, groups: true}\n"
LINES = 200


def rest(port: int, path: str, body: dict[str, Any] | None = None) -> Any:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", method="GET" if body is None else "POST",
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.loads(answer.read() or b"null")


def wait_until(condition: Any, timeout: float, what: str, log: Path) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            found = condition()
        except (urllib.error.URLError, ConnectionError, OSError, KeyError):
            found = None
        if found:
            return found
        if time.monotonic() > deadline:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
            raise AssertionError(f"{what}: not within {timeout}s; the worker's log ends:\n{tail}")
        time.sleep(0.5)


def test_a_connect_worker_as_a_tenant(kafka: KafkaCluster, tmp_path: Path) -> None:
    libs = ensure_kafka_connect()
    topic, group = unique("lines"), unique("connect-cluster")
    internal = {kind: unique(f"connect-{kind}") for kind in ("configs", "offsets", "status")}
    source, sink = tmp_path / "source.txt", tmp_path / "sink.txt"
    source.write_text("".join(f"line-{i}\n" for i in range(LINES)))
    port = free_port()
    with ProxyThread(kafka.bootstrap, rules_yaml=RULES) as proxy:
        worker = tmp_path / "worker.properties"
        worker.write_text("\n".join([
            f"bootstrap.servers={proxy.bootstrap}", f"group.id={group}",
            "key.converter=org.apache.kafka.connect.storage.StringConverter",
            "value.converter=org.apache.kafka.connect.storage.StringConverter",
            f"config.storage.topic={internal['configs']}",
            f"offset.storage.topic={internal['offsets']}",
            f"status.storage.topic={internal['status']}",
            "config.storage.replication.factor=1", "offset.storage.replication.factor=1",
            "status.storage.replication.factor=1", "offset.flush.interval.ms=1000",
            f"listeners=http://127.0.0.1:{port}", ""]))
        log = tmp_path / "worker.log"
        process = start_java_process(libs, "org.apache.kafka.connect.cli.ConnectDistributed",
                                     str(worker), log=log)
        try:
            wait_until(lambda: rest(port, "/connectors") == [], 120, "the worker's REST API",
                       log)
            rest(port, "/connectors", {"name": "lines-in", "config": {
                "connector.class": "org.apache.kafka.connect.file.FileStreamSourceConnector",
                "tasks.max": "1", "file": str(source), "topic": topic}})
            rest(port, "/connectors", {"name": "lines-out", "config": {
                "connector.class": "org.apache.kafka.connect.file.FileStreamSinkConnector",
                "tasks.max": "1", "file": str(sink), "topics": topic}})
            wait_until(lambda: sink.exists() and len(sink.read_text().splitlines()) >= LINES,
                       120, "every line in the sink file", log)
            for name in ("lines-in", "lines-out"):
                status = rest(port, f"/connectors/{name}/status")
                assert status["connector"]["state"] == "RUNNING", status
                assert [t["state"] for t in status["tasks"]] == ["RUNNING"], status
            # The sink connector's group committed what it read (offset.flush.interval.ms).
            wait_until(lambda: "a.connect-lines-out" in group_types(kafka.bootstrap), 60,
                       "the sink connector's group on the broker", log)
            groups = group_types(kafka.bootstrap)
            shown = group_types(proxy.bootstrap, "a-admin")
        finally:
            stop_process(process, 30, kill=True)
    assert sink.read_text() == source.read_text()  # every line, in order, once

    # On the broker: all of it the tenant's, under the prefix.
    on_broker = set(AdminClient({"bootstrap.servers": kafka.bootstrap})
                    .list_topics(timeout=10).topics)
    assert {"a." + t for t in (topic, *internal.values())} <= on_broker, on_broker
    assert not {topic, *internal.values()} & on_broker
    assert watermarks(kafka.bootstrap, "a." + topic) == (0, LINES)
    assert groups.get("a." + group) == "classic"  # the workers' group ("connect" protocol)
    assert groups.get("a.connect-lines-out") in ("classic", "consumer")
    assert group in shown and "connect-lines-out" in shown
    assert not any(g.startswith("a.") for g in shown)
