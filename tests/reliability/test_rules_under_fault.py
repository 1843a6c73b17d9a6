"""Rules under fault, against `gatehouse run`: a rules file replaced with garbage during load
keeps the old rules and loses no request; a storm of SIGHUPs is harmless.

The rules rename a topic, so whether they held is visible in the broker: every message
produced to the alias must be in the real topic, once, and no alias topic may appear.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import confluent_kafka as ck
import pytest
from confluent_kafka.admin import AdminClient

from tests.reliability.support import (
    GatehouseProcess,
    metric_value,
    scaled,
    scrape,
    wait_until,
)
from tests.support.clients import unique
from tests.support.kafka import KafkaCluster
from tests.support.ports import free_port

FAILED = 'gatehouse_rules_reloads_total{outcome="failed"}'
SUCCEEDED = 'gatehouse_rules_reloads_total{outcome="ok"}'

GARBAGE: dict[str, bytes] = {
    "random bytes": random.Random(8).randbytes(4096),
    "not UTF-8": "rules: [ \u00e9 ]".encode("latin-1"),
    "broken YAML": b"rules:\n  - name: x\n   rename_topics: {",
    "nested 100,000 deep": b"rules: " + b"[" * 100_000,
    "NUL bytes": b"\x00" * 100,
    "half written": b"rules:\n  - name: alias\n    rename_",
    "empty": b"",
    "wrong shape": b"rules: {rename_topics: 1}",
    "unknown API": b"rules:\n  - name: x\n    deny_apis: [NoSuchApi]\n",
}


@dataclass
class Rig:
    proc: GatehouseProcess
    rules: Path
    metrics_port: int
    kafka: KafkaCluster

    def metric(self, name: str) -> float:
        return metric_value(scrape(self.metrics_port), name)

    def write_rules(self, alias: str, real: str) -> None:
        self.rules.write_text(f"rules:\n  - name: alias\n    rename_topics: {{{alias}: {real}}}\n")


@pytest.fixture(scope="module")
def rig(kafka: KafkaCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    d = tmp_path_factory.mktemp("rules-fault")
    port, metrics_port = free_port(), free_port()
    rules = d / "rules.yaml"
    rules.write_text("rules: []\n")
    config = d / "gatehouse.yaml"
    config.write_text(f"listen: 127.0.0.1:{port}\nupstream: [{kafka.bootstrap}]\n"
                      f"brokers: {{start_port: 0}}\nmetrics: {{listen: 127.0.0.1:{metrics_port}}}\n"
                      f"rules_file: {rules}\n")
    with GatehouseProcess(config, port, d / "gatehouse.log") as proc:
        yield Rig(proc, rules, metrics_port, kafka)
        proc.check_alive()
        assert proc.stop() == 0


@dataclass
class Load:
    """A librdkafka producer (idempotent, acks=all) sending numbered values until stopped."""

    bootstrap: str
    topic: str
    produced: int = 0
    acked: list[bytes] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def run(self, stop: threading.Event) -> None:
        producer = ck.Producer({"bootstrap.servers": self.bootstrap, "acks": "all",
                                "enable.idempotence": True, "linger.ms": 2, "log_level": 3})

        def on_delivery(err: Any, msg: Any) -> None:
            if err is not None:
                self.errors.append(str(err))
            else:
                self.acked.append(msg.value())

        while not stop.is_set():
            producer.produce(self.topic, value=f"n-{self.produced}".encode(),
                             on_delivery=on_delivery)
            self.produced += 1
            producer.poll(0.002)
        assert producer.flush(60) == 0


def _start(load: Load) -> tuple[threading.Thread, threading.Event]:
    stop = threading.Event()
    thread = threading.Thread(target=load.run, args=(stop,), daemon=True)
    thread.start()
    return thread, stop


def _consume_all(kafka: KafkaCluster, topic: str, expected: int) -> list[bytes]:
    """Straight from the broker (not through the proxy), until ``expected`` or quiet."""
    consumer = ck.Consumer({"bootstrap.servers": kafka.bootstrap, "group.id": unique("check"),
                            "auto.offset.reset": "earliest", "enable.auto.commit": False,
                            "isolation.level": "read_committed", "log_level": 3})
    consumer.subscribe([topic])
    got: list[bytes] = []
    deadline = time.monotonic() + 60
    quiet_since = time.monotonic()
    try:
        while time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                if len(got) >= expected and time.monotonic() - quiet_since > 2:
                    break
                continue
            assert msg.error() is None, msg.error()
            got.append(msg.value())
            quiet_since = time.monotonic()
    finally:
        consumer.close()
    return got


def _check_delivery(rig: Rig, load: Load, real: str, alias: str) -> None:
    assert load.errors == []
    assert len(load.acked) == load.produced > 0
    consumed = _consume_all(rig.kafka, real, len(load.acked))
    assert len(consumed) == len(set(consumed)), "duplicates in the real topic"
    assert sorted(consumed) == sorted(load.acked), (
        f"produced {load.produced}, acked {len(load.acked)}, consumed {len(consumed)}")
    topics = AdminClient({"bootstrap.servers": rig.kafka.bootstrap}).list_topics(timeout=30).topics
    assert alias not in topics, "a request went through without the rename"


def test_garbage_rules_file_keeps_the_old_rules(rig: Rig) -> None:
    alias, real = unique("alias"), unique("real")
    rig.kafka.create_topic(real)
    before = rig.metric(SUCCEEDED)
    rig.write_rules(alias, real)
    wait_until(lambda: rig.metric(SUCCEEDED) > before, 15, "the good rules to load")
    load = Load(f"127.0.0.1:{rig.proc.port}", alias)
    thread, stop = _start(load)
    try:
        for _round in range(scaled(1, 5)):
            for name, garbage in GARBAGE.items():
                failed = rig.metric(FAILED)
                rig.rules.write_bytes(garbage)
                wait_until(lambda f=failed: rig.metric(FAILED) > f, 15,  # type: ignore[misc]
                           f"the proxy to reject the {name} file")
                rig.proc.check_alive()
    finally:
        stop.set()
        thread.join(120)
    text = rig.proc.log_text()
    assert "nested too deeply" in text and "keeping the old rules" in text
    _check_delivery(rig, load, real, alias)


def test_sighup_storm(rig: Rig) -> None:
    alias, real = unique("alias"), unique("real")
    rig.kafka.create_topic(real)
    before = rig.metric(SUCCEEDED)
    rig.write_rules(alias, real)
    wait_until(lambda: rig.metric(SUCCEEDED) > before, 15, "the new rules to load")
    before = rig.metric(SUCCEEDED)
    load = Load(f"127.0.0.1:{rig.proc.port}", alias)
    thread, stop = _start(load)
    signals = scaled(500, 5000)
    try:
        wait_until(lambda: len(load.acked) > 10, 30, "the load to start")
        for i in range(signals):
            rig.proc.signal(signal.SIGHUP)
            if i % 50 == 0:
                time.sleep(0.01)
                rig.proc.check_alive()
        wait_until(lambda: rig.metric(SUCCEEDED) > before, 15, "a reload")
        acked = len(load.acked)
        wait_until(lambda: len(load.acked) > acked + 100, 30, "the load to go on")
    finally:
        stop.set()
        thread.join(120)
    rig.proc.check_alive()
    _check_delivery(rig, load, real, alias)
