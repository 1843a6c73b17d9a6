"""The observation log with real clients and a real broker: `gatehouse run` writes it and
flushes it on SIGTERM; a stalled disk costs records (counted), never traffic speed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import confluent_kafka as ck

from gatehouse.capture.observer import CaptureCollector, CaptureObserver
from gatehouse.capture.settings import CaptureSettings
from gatehouse.capture.writer import CaptureWriter
from tests.support.clients import produce, unique
from tests.support.kafka import KafkaCluster
from tests.support.ports import free_port, wait_listening
from tests.support.proxythread import ProxyThread
from tests.test_capture import StalledDisk, check_schema, read_records

GATEHOUSE = [sys.executable, "-m", "gatehouse.cli"]


def test_gatehouse_run_captures_and_flushes_on_sigterm(kafka: KafkaCluster,
                                                       tmp_path: Path) -> None:
    port, metrics_port = free_port(), free_port()
    captures = tmp_path / "captures"
    config = tmp_path / "gatehouse.yaml"
    config.write_text(f"listen: 127.0.0.1:{port}\nupstream: [{kafka.bootstrap}]\n"
                      f"brokers: {{start_port: 0}}\nmetrics: {{listen: 127.0.0.1:{metrics_port}}}\n"
                      f"capture: {{dir: {captures}, gzip: true, instance: edge-7}}\n"
                      "rules:\n  - name: watch-old-produce\n    mode: observe\n"
                      "    min_api_version: {Produce: 11}\n")
    proc = subprocess.Popen([*GATEHOUSE, "run", "--config", str(config)], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_listening(port, proc)
        wait_listening(metrics_port, proc)
        topic = unique("captured")
        kafka.create_topic(topic, partitions=3)
        sent = produce({"bootstrap.servers": f"127.0.0.1:{port}"}, topic, count=300)
        scrape = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                        timeout=10).read().decode()
        assert 'gatehouse_capture_records_total{outcome="dropped"} 0.0' in scrape
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    files = list(captures.iterdir())
    assert files and all(p.name.startswith("gatehouse-edge-7-") and p.name.endswith(
        ".jsonl.gz") for p in files)
    records = read_records(captures)
    for record in records:
        check_schema(record)
    produced = [t for r in records if r["api"] == "Produce" for t in r["topics"]
                if t["name"] == topic]
    assert sum(t["records"] for t in produced) == len(sent)  # nothing lost on shutdown
    assert {p for t in produced for p in t["partitions"]} == {0, 1, 2}
    produce_records = [r for r in records if r["api"] == "Produce"]
    assert all(r["software_name"] == "confluent-kafka-python" for r in produce_records)
    # librdkafka's Produce version is below 11: the observe-mode rule says so every time.
    assert all({"rule": "watch-old-produce", "action": "min_api_version", "effect": "refuse",
                "mode": "observe"} in r["rules"] for r in produce_records)


def _produce_one_by_one(bootstrap: str, topic: str, count: int) -> float:
    """Seconds for ``count`` Produce requests (one message each, waited for)."""
    producer = ck.Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 0,
                            "log_level": 3})
    producer.produce(topic, b"warm-up")
    assert producer.flush(30) == 0
    began = time.perf_counter()
    for i in range(count):
        producer.produce(topic, b"m-%d" % i)
        producer.flush(30)
    elapsed = time.perf_counter() - began
    assert len(producer) == 0
    return elapsed


def test_a_stalled_disk_keeps_traffic_speed_and_counts_drops(kafka: KafkaCluster,
                                                             tmp_path: Path) -> None:
    topic = unique("stall")
    kafka.create_topic(topic)
    count = 600
    disk = StalledDisk()
    timings: dict[str, list[float]] = {"off": [], "stalled": []}
    captures: list[Any] = []
    try:
        for round_ in range(2):  # alternate, so drift on the shared machine hits both alike
            # One instance name per proxy: two writers of one name would share files.
            settings = CaptureSettings(dir=tmp_path, queue=50, instance=f"stall-{round_}")
            with ProxyThread(kafka.bootstrap) as plain:
                timings["off"].append(_produce_one_by_one(plain.bootstrap, topic, count))
            capture = CaptureObserver(settings, CaptureWriter(settings, opener=disk.open))
            captures.append(capture)
            with ProxyThread(kafka.bootstrap, observers=[capture]) as proxy:
                proxy.metrics.registry.register(CaptureCollector(capture))
                timings["stalled"].append(_produce_one_by_one(proxy.bootstrap, topic, count))
                assert disk.entered.is_set()  # the writer was stuck the whole time
                dropped = proxy.metrics.registry.get_sample_value(
                    "gatehouse_capture_records_total", {"outcome": "dropped"})
                assert dropped is not None and dropped >= count - 60
    finally:
        disk.release.set()
    for capture in captures:
        assert capture.close(10)
    off, stalled = min(timings["off"]), min(timings["stalled"])
    print(f"\n{count} produce requests: capture off {off:.2f}s, stalled disk {stalled:.2f}s")
    assert stalled < off * 1.5, timings
    records = read_records(tmp_path)
    stats = [c.statistics() for c in captures]
    assert len(records) == sum(s.written for s in stats)
    assert sum(s.offered for s in stats) == sum(s.written + s.dropped for s in stats)
