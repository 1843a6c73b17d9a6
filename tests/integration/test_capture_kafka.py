"""capture.kafka with real brokers: what real clients do through the proxy arrives on the
observations topic (read back with librdkafka), over SCRAM and over TLS; a broker restart
is an outage logged once and recovered from; a paused cluster costs records, never
traffic speed."""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import confluent_kafka as ck
import pytest

from gatehouse.capture.kafka_sink import (
    CLIENT_ID,
    KafkaSink,
    KafkaSinkSettings,
    SaslCredentials,
    partition_for,
)
from gatehouse.capture.observer import CaptureCollector, CaptureObserver
from gatehouse.capture.settings import CaptureSettings
from gatehouse.capture.writer import CaptureWriter
from gatehouse.proxy.config import Address, config_from_text
from gatehouse.proxy.hooks import Observer, Policy
from gatehouse.proxy.setup import build_observers, close_observers
from tests.integration.test_capture_proxy import _produce_one_by_one
from tests.support.clients import unique
from tests.support.kafka import SCRAM_MECHANISM, SCRAM_PASSWORD, SCRAM_USER, KafkaCluster
from tests.support.ports import LOCALHOST
from tests.support.proxythread import ProxyThread
from tests.test_capture import check_schema, read_records

SECRET = b"card-4111-1111-1111-1111"


def proxy_config(upstream: str, captures: Path, kafka: str, extra: str = "") -> str:
    return (f"listen: 127.0.0.1:0\nupstream: [{upstream}]\nbrokers: {{start_port: 0}}\n"
            f"capture:\n  dir: {captures}\n  instance: edge-k\n  kafka: {kafka}\n{extra}")


def kafka_sink_of(observers: list[Observer]) -> KafkaSink:
    """The Kafka sink that ``build_observers`` made for the config."""
    (capture,) = [o for o in observers if isinstance(o, CaptureObserver)]
    assert capture.kafka is not None
    return capture.kafka


def observations(conf: dict[str, Any], topic: str, count: int, timeout: float = 60.0
                 ) -> list[Any]:
    """Every message of ``topic`` (at least ``count``, then a quiet second for extras)."""
    consumer = ck.Consumer({**conf, "group.id": unique("g"), "auto.offset.reset": "earliest",
                            "enable.auto.commit": False, "log_level": 3})
    got: list[Any] = []
    try:
        consumer.subscribe([topic])
        deadline = time.monotonic() + timeout
        quiet_until = None
        while time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is not None:
                assert msg.error() is None, msg.error()
                got.append(msg)
            if len(got) >= count:
                quiet_until = quiet_until or time.monotonic() + 1.0
                if time.monotonic() >= quiet_until:
                    break
    finally:
        consumer.close()
    return got


def produce_each(conf: dict[str, Any], topic: str, count: int, client_id: str) -> None:
    """``count`` Produce requests of one message each (flushed one by one)."""
    producer = ck.Producer({**conf, "client.id": client_id, "acks": "all", "linger.ms": 0,
                            "log_level": 3})
    for i in range(count):
        producer.produce(topic, value=SECRET + b"-%d" % i, key=b"k%d" % i)
        assert producer.flush(30) == 0


def test_observations_reach_a_topic_on_the_upstream_cluster(kafka: KafkaCluster,
                                                            tmp_path: Path) -> None:
    data, obs = unique("orders"), unique("gatehouse.observations")
    kafka.create_topic(data, partitions=2)
    text = proxy_config(kafka.bootstrap, tmp_path, f"{{topic: {obs}, create: {{partitions: 3}},"
                        " linger_seconds: 0.01}")
    observers = build_observers(config_from_text(text), Policy(), None)  # as `gatehouse run`
    sink = kafka_sink_of(observers)
    try:
        with ProxyThread(config_text=text, observers=observers) as proxy:
            produce_each({"bootstrap.servers": proxy.bootstrap}, data, 20, "obs-producer")
    finally:
        close_observers(observers)  # both sinks flushed, as at SIGTERM
    files = read_records(tmp_path)
    stats = sink.statistics()
    assert (stats.written, stats.dropped, stats.write_errors) == (len(files), 0, 0)

    messages = observations(kafka.client_config(), obs, len(files))
    values = [json.loads(m.value()) for m in messages]
    # The same records as the files, every one once.
    assert sorted(map(json.dumps, values)) == sorted(map(json.dumps, files))
    for value in values:
        check_schema(value)
    assert all(SECRET not in m.value() for m in messages)  # names and numbers, no payloads
    produce_records = [v for v in values if v["api"] == "Produce"
                       and v["client_id"] == "obs-producer"]
    assert len(produce_records) == 20
    assert sum(t["records"] for v in produce_records for t in v["topics"]
               if t["name"] == data) == 20
    # The sink's own requests bypass the proxy: it never observes itself.
    assert not [v for v in values if v["client_id"] == CLIENT_ID
                or any(t["name"] == obs for t in v["topics"])]
    # Keyed by connection: one connection's records on one partition, in the order of
    # its exchanges.
    by_connection: dict[int, list[int]] = {}
    for m in sorted(messages, key=lambda m: (m.partition(), m.offset())):
        value = json.loads(m.value())
        assert m.key() == f"edge-k/{value['run']}/{value['conn']}".encode()
        assert m.partition() == partition_for(m.key(), 3)
        assert m.timestamp()[1] == int(value["time"] * 1000)
        by_connection.setdefault(value["conn"], []).append(value["correlation_id"])
    for correlation_ids in by_connection.values():
        assert correlation_ids == sorted(correlation_ids)


def test_scram_credentials_of_its_own(kafka_scram: KafkaCluster, tmp_path: Path,
                                      caplog: pytest.LogCaptureFixture) -> None:
    obs = unique("observations")
    sasl = f"{{mechanism: {SCRAM_MECHANISM}, username: {SCRAM_USER}, password: {SCRAM_PASSWORD}}}"
    text = proxy_config(kafka_scram.sasl_bootstrap, tmp_path,
                        f"{{topic: {obs}, linger_seconds: 0.01, sasl: {sasl}}}")
    observers = build_observers(config_from_text(text), Policy(), None)
    sink = kafka_sink_of(observers)
    try:
        with ProxyThread(config_text=text, observers=observers) as proxy:
            client = kafka_scram.client_config(sasl=True, **{"bootstrap.servers": proxy.bootstrap})
            data = unique("scram-data")
            kafka_scram.create_topic(data)
            produce_each(client, data, 5, "scram-producer")
    finally:
        close_observers(observers)
    files = read_records(tmp_path)
    assert sink.statistics().written == len(files)
    values = [json.loads(m.value()) for m in observations(kafka_scram.client_config(), obs,
                                                          len(files))]
    assert len(values) == len(files)
    assert sum(1 for v in values if v["api"] == "Produce"
               and v["client_id"] == "scram-producer") == 5
    assert any(v["api"] == "SaslAuthenticate" for v in values)  # the client's, observed

    # A wrong password, and none at all, on the SASL listener: counted and explained.
    address = Address(LOCALHOST, kafka_scram.nodes[0].sasl_port or 0)
    for settings, explanation in [
        (KafkaSinkSettings(topic=obs, retries=0, linger_seconds=0, sasl=SaslCredentials(
            SCRAM_MECHANISM, SCRAM_USER, "wrong-secret")), "SASL authentication failed"),
        (KafkaSinkSettings(topic=obs, retries=0, linger_seconds=0), "capture.kafka.sasl"),
    ]:
        caplog.clear()
        refused = KafkaSink(settings, [address])
        refused.offer({"v": 1, "time": time.time(), "conn": 1})
        assert refused.close(30)
        assert (refused.statistics().written, refused.statistics().write_errors) == (0, 1)
        text = "\n".join(str(r.__dict__.get("gatehouse_fields")) for r in caplog.records)
        assert explanation in text and "wrong-secret" not in text


def test_over_tls_upstream(kafka: KafkaCluster, tls_files: dict[str, str],
                           tmp_path: Path) -> None:
    # edge proxy (capture.kafka) --TLS--> inner proxy (a TLS listener) --> Kafka; the sink
    # connects to the edge's upstream with the edge's tls.upstream settings.
    inner_tls = f"tls:\n  downstream: {{cert: {tls_files['cert']}, key: {tls_files['key']}}}\n"
    obs = unique("tls-observations")
    captures = tmp_path / "captures"  # tmp_path also holds the certificates
    with ProxyThread(kafka.bootstrap, extra_config=inner_tls) as inner:
        text = proxy_config(inner.bootstrap, captures, f"{{topic: {obs}, linger_seconds: 0.01}}",
                            f"tls:\n  upstream: {{ca: {tls_files['ca']}, "
                            "server_hostname: localhost}\n")
        observers = build_observers(config_from_text(text), Policy(), None)
        sink = kafka_sink_of(observers)
        try:
            with ProxyThread(config_text=text, observers=observers) as edge:
                data = unique("tls-data")
                kafka.create_topic(data)
                produce_each({"bootstrap.servers": edge.bootstrap}, data, 3, "tls-producer")
        finally:
            close_observers(observers)
    files = read_records(captures)
    assert sink.statistics().written == len(files) > 0
    values = [json.loads(m.value()) for m in observations(kafka.client_config(), obs,
                                                          len(files))]
    assert sum(1 for v in values if v["client_id"] == "tls-producer"
               and v["api"] == "Produce") == 3


def test_a_broker_restart_is_one_outage_then_recovery(kafka: KafkaCluster,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    obs = unique("restart-observations")
    sink = KafkaSink(KafkaSinkSettings(topic=obs, retries=8, timeout=3, linger_seconds=0),
                     [Address(LOCALHOST, kafka.nodes[0].port)])

    def offer(first: int, count: int) -> None:
        for n in range(first, first + count):
            sink.offer({"v": 1, "time": time.time(), "proxy": "p", "run": "r", "conn": n % 3,
                        "correlation_id": n})

    def wait_for(condition: Any, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, sink.statistics()
            time.sleep(0.05)

    try:
        offer(0, 50)
        wait_for(lambda: sink.statistics().written == 50)
        kafka.stop_node(0)
        try:
            offer(50, 50)
            wait_for(lambda: sink.statistics().write_errors == 50)
            assert not sink.up
        finally:
            kafka.start_node(0)
        offer(100, 50)
        wait_for(lambda: sink.statistics().written == 100)
        assert sink.up
    finally:
        assert sink.close(30)
    messages = [m for m in caplog.records if m.name == "gatehouse.capture"]
    assert [m.getMessage() for m in messages if m.levelno >= logging.WARNING] == [
        m.getMessage() for m in messages if "cannot produce" in m.getMessage()
        or "producing again" in m.getMessage()]
    assert sum("cannot produce" in m.getMessage() for m in messages) == 1
    assert sum("producing again" in m.getMessage() for m in messages) == 1
    got = {json.loads(m.value())["correlation_id"]
           for m in observations(kafka.client_config(), obs, 100)}
    assert got == set(range(50)) | set(range(100, 150))  # lost ones counted, none doubled


@pytest.fixture
def paused_broker() -> Iterator[Address]:
    """A broker that accepts connections and never answers (a SIGSTOPped JVM does that:
    the kernel completes the handshake, nothing reads)."""
    with socket.socket() as listener:
        listener.bind((LOCALHOST, 0))
        listener.listen(64)
        yield Address(LOCALHOST, listener.getsockname()[1])


def test_a_paused_cluster_costs_records_never_traffic_speed(kafka: KafkaCluster,
                                                            tmp_path: Path,
                                                            paused_broker: Address) -> None:
    topic = unique("paused")
    kafka.create_topic(topic)
    count = 600
    timings: dict[str, list[float]] = {"files only": [], "files + paused sink": []}
    captures: list[CaptureObserver] = []
    for round_ in range(3):  # alternate, so drift on the shared machine hits both alike
        for case in timings:
            # One instance name per proxy: two writers of one name would share files.
            settings = CaptureSettings(dir=tmp_path, instance=f"paused-{round_}-{len(case)}")
            sink = None
            if case == "files + paused sink":
                sink = KafkaSink(KafkaSinkSettings(queue=50, timeout=2, retries=1,
                                                   linger_seconds=0), [paused_broker])
            capture = CaptureObserver(settings, CaptureWriter(settings), kafka=sink)
            captures.append(capture)
            with ProxyThread(kafka.bootstrap, observers=[capture]) as proxy:
                proxy.metrics.registry.register(CaptureCollector(capture))
                timings[case].append(_produce_one_by_one(proxy.bootstrap, topic, count))
                if sink is None:
                    continue
                sample = proxy.metrics.registry.get_sample_value
                dropped = sample("gatehouse_capture_kafka_records_total", {"outcome": "dropped"})
                # Not dropped: at most a full queue and the one batch the sink's thread
                # is trying (taken from that queue), unless a try gave up meanwhile (its
                # records lost, counted): it gives up after 2 x 2 s, which a slow run of
                # the producer outlasts.
                lost = sample("gatehouse_capture_kafka_records_total",
                              {"outcome": "write_error"})
                offered = sink.statistics().offered  # the warm-up's requests too
                assert dropped is not None and lost is not None and offered > count
                assert 0 <= offered - dropped - lost <= 2 * 50, (offered, dropped, lost)
                assert sample("gatehouse_capture_kafka_records_total",
                              {"outcome": "written"}) == 0
                assert sample("gatehouse_capture_records_total", {"outcome": "dropped"}) == 0
                deadline = time.monotonic() + 30  # the first request times out after 2 s
                while sample("gatehouse_capture_kafka_up") != 0.0:
                    assert time.monotonic() < deadline, "the outage never showed"
                    time.sleep(0.05)
    for capture in captures:
        assert capture.close(10)
    files_only, paused = (min(t) for t in timings.values())
    print(f"\n{count} produce requests: capture to files {files_only:.2f}s, "
          f"files + paused Kafka sink {paused:.2f}s")
    assert paused < files_only * 1.5, timings
    sinks = [c.kafka for c in captures if c.kafka is not None]
    for sink in sinks:
        stats = sink.statistics()
        assert stats.written == 0 and stats.offered == stats.dropped + stats.write_errors
    # The files kept every record the paused sink lost.
    assert len(read_records(tmp_path)) == sum(c.writer.statistics().written for c in captures)
    assert sum(c.writer.statistics().written for c in captures if c.kafka is not None) == \
        sum(sink.statistics().offered for sink in sinks)
