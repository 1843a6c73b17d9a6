"""The capture's Kafka sink without a real broker: config, partitioning, SASL, retries, drops.

The real-broker tests (records through the proxy, SCRAM, TLS, a broker restart, a
paused broker) are in tests/integration/test_capture_kafka.py.
"""

from __future__ import annotations

import base64
import logging
import random
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gatehouse import codecs
from gatehouse.capture.kafka_sink import (
    OUR_VERSIONS,
    KafkaSink,
    KafkaSinkSettings,
    ScramClient,
    murmur2,
    partition_for,
    plain_token,
)
from gatehouse.capture.observer import CaptureObserver
from gatehouse.capture.settings import CaptureSettings
from gatehouse.codecs import records
from gatehouse.configfile import ConfigError
from gatehouse.metrics import ProxyMetrics
from gatehouse.proxy.config import Address, config_from_text
from gatehouse.proxy.oauth import OAuthClient
from tests.reliability.support import FakeBrokerServer
from tests.support.fakebroker import response_body
from tests.support.ports import LOCALHOST

TOPIC = "observations"
NOT_LEADER_OR_FOLLOWER = 6


def parse(text: str, base: Path) -> Any:
    config = config_from_text("listen: 1\nupstream: [a:1]\ncapture:\n  dir: c\n" + text,
                              "g.yaml", base=base)
    return config.capture.kafka


# -- config ---------------------------------------------------------------------------------


def test_kafka_sink_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse("  kafka: {}\n", tmp_path) == KafkaSinkSettings()
    (tmp_path / "capture.secret").write_text("s3cret-pass\n")
    settings = parse(
        "  kafka:\n    topic: obs.edge\n"
        "    create: {partitions: 6, replication: 3, config: {retention.ms: 86400000,"
        " cleanup.policy: delete}}\n"
        "    acks: 1\n    compression: none\n    batch_bytes: 65536\n    linger_seconds: 0\n"
        "    queue: 500\n    retries: 0\n    timeout: 2.5\n    key: client_id\n"
        "    sasl: {mechanism: scram-sha-512, username: cap, password_file: capture.secret}\n",
        tmp_path)
    assert settings == KafkaSinkSettings(
        topic="obs.edge", create=True, partitions=6, replication=3,
        topic_config={"retention.ms": "86400000", "cleanup.policy": "delete"}, acks=1,
        compression="none", batch_bytes=65536, linger_seconds=0.0, queue=500, retries=0,
        timeout=2.5, key="client_id", sasl=settings.sasl)
    assert (settings.sasl.mechanism, settings.sasl.username, settings.sasl.password) == (
        "SCRAM-SHA-512", "cap", "s3cret-pass")
    assert "s3cret" not in repr(settings)  # configs get logged and printed
    assert parse("  kafka: {create: false}\n", tmp_path).create is False
    monkeypatch.setenv("CAPTURE_PASSWORD", "from-env")
    sasl = parse("  kafka: {sasl: {mechanism: PLAIN, username: u, password_env: "
                 "CAPTURE_PASSWORD}}\n", tmp_path).sasl
    assert (sasl.mechanism, sasl.password) == ("PLAIN", "from-env")
    (tmp_path / "idp.secret").write_text("idp-s3cret\n")
    sasl = parse("  kafka:\n    sasl: {mechanism: OAUTHBEARER, token_endpoint_url: "
                 "'https://idp/token', client_id: cap, client_secret_file: idp.secret}\n",
                 tmp_path).sasl
    assert sasl == OAuthClient("https://idp/token", "cap", "idp-s3cret")
    assert "idp-s3cret" not in repr(sasl)


@pytest.mark.parametrize(("text", "line", "message"), [
    ("  kafka: {topic: 'a/b'}\n", 5, "not a legal Kafka topic name"),
    ("  kafka: {acks: 0}\n", 5, "must be 'all' or 1, not 0 (it would hide every failure)"),
    ("  kafka: {compression: snappy}\n", 5, "compression must be 'gzip' or 'none'"),
    ("  kafka:\n    create: {partitions: 0}\n", 6, "partitions must be at least 1"),
    ("  kafka:\n    create: {config: {retention.ms: [1]}}\n", 6, "must be a single value"),
    ("  kafka:\n    create: {colour: red}\n", 6, "unknown key 'colour' in config.capture.kafka.create"),
    ("  kafka: {queue: 0}\n", 5, "queue must be positive"),
    ("  kafka: {retries: -1}\n", 5, "retries must be 0 or more"),
    ("  kafka: {linger_seconds: true}\n", 5, "must be an integer or a number, not a boolean"),
    ("  kafka: {key: topic}\n", 5, "key must be 'connection' or 'client_id'"),
    ("  kafka:\n    topic: t\n    brokers: [x]\n", 7, "unknown key 'brokers' in config.capture.kafka "),
    ("  kafka:\n    sasl: {mechanism: GSSAPI, username: u, password: p}\n", 6,
     "capture.kafka.sasl needs 'principal'"),
    ("  kafka:\n    sasl: {mechanism: KERBEROS, username: u, password: p}\n", 6,
     "mechanism must be one of PLAIN, SCRAM-SHA-256, SCRAM-SHA-512, OAUTHBEARER, GSSAPI"),
    ("  kafka:\n    sasl: {mechanism: PLAIN, username: u}\n", 6,
     "needs exactly one of password, password_file, password_env"),
    ("  kafka:\n    sasl:\n      mechanism: PLAIN\n      username: u\n      password: p\n"
     "      password_env: X\n", 10, "needs exactly one of"),
    ("  kafka:\n    sasl: {mechanism: PLAIN, username: u, password_env: GATEHOUSE_NO_SUCH}\n",
     6, "'GATEHOUSE_NO_SUCH' is not set"),
    ("  kafka:\n    sasl: {mechanism: PLAIN, username: u, password_file: missing}\n", 6,
     "cannot read"),
    ("  kafka:\n    sasl: {mechanism: PLAIN, password: p}\n", 6, "needs 'username'"),
    ("  kafka:\n    sasl: {mechanism: OAUTHBEARER, token_endpoint_url: 'https://x'}\n", 6,
     "config.capture.kafka.sasl.token_endpoint_url needs client_id"),
])
def test_kafka_sink_config_errors_point_at_the_line(tmp_path: Path, text: str, line: int,
                                                    message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse(text, tmp_path)
    assert str(info.value).startswith(f"g.yaml:{line}: "), str(info.value)
    assert message in str(info.value)


# -- partitioning and SASL --------------------------------------------------------------------


def test_murmur2_is_kafkas() -> None:
    # Kafka's own UtilsTest values, then an independent implementation (kafka-python).
    assert murmur2(b"21") == -973932308
    assert murmur2(b"foobar") == -790332482
    assert murmur2(b"a-little-bit-long-string") == -985981536
    assert murmur2(b"a-little-bit-longer-string") == -1486304829
    assert murmur2(b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8") == -58897971
    assert murmur2(b"abc") == 479470107
    theirs = pytest.importorskip("kafka.partitioner.default").murmur2
    rng = random.Random(7)
    for _ in range(300):
        key = rng.randbytes(rng.randrange(0, 40))
        assert murmur2(key) & 0xFFFFFFFF == theirs(key) & 0xFFFFFFFF
        assert partition_for(key, 12) == (theirs(key) & 0x7FFFFFFF) % 12


def test_scram_sha_256_rfc7677_exchange() -> None:
    scram = ScramClient("SCRAM-SHA-256", "user", "pencil", nonce="rOprNGfwEbeRWgbNEkqO")
    assert scram.first_message() == b"n,,n=user,r=rOprNGfwEbeRWgbNEkqO"
    server_first = (b"r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,"
                    b"s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096")
    assert scram.final_message(server_first) == (
        b"c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,"
        b"p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ=")
    scram.check_final(b"v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4=")
    with pytest.raises(Exception, match="does not match"):
        scram.check_final(b"v=" + base64.b64encode(b"\0" * 32))
    with pytest.raises(Exception, match="authentication failed: invalid-proof"):
        scram.check_final(b"e=invalid-proof")
    other = ScramClient("SCRAM-SHA-512", "a=b,c", "p")
    assert other.first_message().startswith(b"n,,n=a=3Db=2Cc,r=")  # names escaped
    with pytest.raises(Exception, match="not valid"):
        other.final_message(b"r=someone-elses-nonce,s=AAAA,i=4096")
    assert plain_token("u", "p") == b"\0u\0p"


# -- the sink against a fake broker -----------------------------------------------------------


class FakeCluster(FakeBrokerServer):
    """One fake broker (node 1) leading every partition of TOPIC; Produce answers with
    ``produce_errors`` first, then success.  It keeps every request it got."""

    def __init__(self, partitions: int = 3, produce_errors: tuple[int, ...] = ()) -> None:
        super().__init__(self._handle)
        self.partitions = partitions
        self.produce_errors = list(produce_errors)
        self.requests: list[codecs.Request] = []
        self.batches: dict[int, list[bytes]] = {}  # partition -> record batches accepted

    def _answer(self, req: codecs.Request) -> Any:  # ApiVersions too (the base answers none)
        return self.handler(req)

    def _handle(self, req: codecs.Request) -> Any:
        self.requests.append(req)
        key, version = req.api_key, req.api_version
        if key == 18:
            return response_body(18, version, api_keys=[
                {"api_key": k, "min_version": 0, "max_version": high}
                for k, (_, high) in OUR_VERSIONS.items()])
        if key == 3:
            return response_body(3, version, brokers=[
                {"node_id": 1, "host": LOCALHOST, "port": self.port}], topics=[
                {"name": TOPIC, "partitions": [{"partition_index": p, "leader_id": 1}
                                               for p in range(self.partitions)]}])
        assert key == 0, req
        code = self.produce_errors.pop(0) if self.produce_errors else 0
        answers = []
        for topic in req.body.topic_data:
            assert topic.name == TOPIC
            for part in topic.partition_data:
                if code == 0:
                    self.batches.setdefault(part.index, []).append(bytes(part.records))
                answers.append({"index": part.index, "error_code": code})
        return response_body(0, version, responses=[{"name": TOPIC,
                                                     "partition_responses": answers}])

    def apis(self) -> list[int]:
        return [r.api_key for r in self.requests]


def record(conn: int, n: int) -> dict[str, Any]:
    return {"v": 1, "time": 1_700_000_000 + n / 1000, "proxy": "edge", "run": "r1",
            "conn": conn, "client_id": f"client-{conn % 2}", "correlation_id": n}


def wait_for(condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def decoded(batches: list[bytes]) -> list[tuple[bytes, dict[str, Any]]]:
    import json

    kafka_records = pytest.importorskip("kafka.record.default_records")
    out = []
    for data in batches:
        (header,) = records.iter_batches(data)
        assert header.crc_ok(data) and header.compression == "gzip"
        out += [(r.key, json.loads(r.value)) for r in kafka_records.DefaultRecordBatch(data)]
    return out


def test_not_leader_refreshes_metadata_and_retries_in_order(
        caplog: pytest.LogCaptureFixture) -> None:
    with FakeCluster(produce_errors=(NOT_LEADER_OR_FOLLOWER,)) as broker:
        settings = KafkaSinkSettings(topic=TOPIC, linger_seconds=0.2)
        sink = KafkaSink(settings, [Address(LOCALHOST, broker.port)])
        sent = [record(conn, n) for n in range(40) for conn in (1, 2, 3)]
        assert all(sink.offer(r) for r in sent)
        wait_for(lambda: sink.statistics().written == len(sent))
        assert sink.close(10)
    stats = sink.statistics()
    assert (stats.written, stats.dropped, stats.write_errors) == (len(sent), 0, 0)
    apis = [key for key in broker.apis() if key != 18]  # ApiVersions: once per connection
    assert apis[:4] == [3, 0, 3, 0]  # NOT_LEADER: metadata read again, then the retry
    assert apis.count(3) == 2
    # Each connection's records on one partition (murmur2 of "proxy/run/conn"), in order.
    for partition, batches in broker.batches.items():
        got = decoded(batches)
        for key, value in got:
            assert key == f"edge/r1/{value['conn']}".encode()
            assert partition_for(key, 3) == partition
        for conn in (1, 2, 3):
            mine = [v["correlation_id"] for _, v in got if v["conn"] == conn]
            assert mine == sorted(mine)
    assert sorted((v["conn"], v["correlation_id"]) for batches in broker.batches.values()
                  for _, v in decoded(batches)) == sorted((r["conn"], r["correlation_id"])
                                                          for r in sent)
    # A leader moving and coming back within the retries is no outage.  (Gatehouse's own
    # loggers: a kafka-python client of another test may still be logging in this process.)
    assert not [r for r in caplog.records
                if r.levelno >= logging.WARNING and r.name.startswith("gatehouse")]


def test_refused_records_are_counted_not_retried() -> None:
    message_too_large = 10
    with FakeCluster(produce_errors=(message_too_large,)) as broker:
        sink = KafkaSink(KafkaSinkSettings(topic=TOPIC, linger_seconds=0.2, key="client_id"),
                         [Address(LOCALHOST, broker.port)])
        for n in range(10):
            sink.offer(record(1, n))
        wait_for(lambda: sink.statistics().write_errors == 10)
        sink.offer(record(1, 10))
        wait_for(lambda: sink.statistics().written == 1)
        assert sink.close(10)
    assert broker.apis().count(0) == 2  # the refused batch was not sent again
    (only,) = decoded(broker.batches[partition_for(b"client-1", 3)])
    assert only[0] == b"client-1" and only[1]["correlation_id"] == 10


def test_an_unreachable_cluster_costs_records_never_time(
        caplog: pytest.LogCaptureFixture) -> None:
    # A port nobody listens on: every connect is refused at once.
    with socket.socket() as probe:
        probe.bind((LOCALHOST, 0))
        port = probe.getsockname()[1]
    sink = KafkaSink(KafkaSinkSettings(queue=100, retries=2, linger_seconds=0),
                     [Address(LOCALHOST, port)])
    metrics = ProxyMetrics()
    metrics.registry.register(SinkCollector(sink))
    began = time.perf_counter()
    accepted = sum(sink.offer(record(1, n)) for n in range(20_000))
    elapsed = time.perf_counter() - began
    assert elapsed < 1.0 and 100 <= accepted < 20_000  # µs each, whatever the cluster does
    wait_for(lambda: not sink.up)
    assert sink.close(10)
    stats = sink.statistics()
    assert stats.written == 0 and stats.dropped == 20_000 - accepted
    assert stats.write_errors == accepted  # tried, then counted; none silently gone
    sample = metrics.registry.get_sample_value
    assert sample("gatehouse_capture_kafka_records_total", {"outcome": "dropped"}) == \
        stats.dropped
    assert sample("gatehouse_capture_kafka_records_total", {"outcome": "write_error"}) == \
        accepted
    assert sample("gatehouse_capture_kafka_up") == 0.0
    outage = [r for r in caplog.records if "cannot produce to the cluster" in r.getMessage()]
    assert len(outage) == 1  # once per outage, not once per batch or per try
    assert "Connection refused" in str(outage[0].__dict__.get("gatehouse_fields"))


class SinkCollector:
    """The sink's metric families alone (the observer's collector adds them to its own)."""

    def __init__(self, sink: KafkaSink) -> None:
        self.sink = sink

    def collect(self) -> Any:
        return self.sink.metric_families()


def test_the_observer_feeds_both_sinks(tmp_path: Path) -> None:
    from tests.test_capture import read_records

    with FakeCluster() as broker:
        settings = CaptureSettings(dir=tmp_path, instance="edge-2")
        sink = KafkaSink(KafkaSinkSettings(topic=TOPIC, linger_seconds=0),
                         [Address(LOCALHOST, broker.port)])
        metrics = ProxyMetrics()
        capture = CaptureObserver(settings, registry=metrics.registry, kafka=sink)
        for n in range(25):
            capture._emit({**record(n % 4, n), "topics": []})
        assert capture.close(10)
    files = read_records(tmp_path)
    produced = [v for batches in broker.batches.values() for _, v in decoded(batches)]
    assert sorted(map(repr, files)) == sorted(map(repr, produced)) and len(files) == 25
    sample = metrics.registry.get_sample_value
    assert sample("gatehouse_capture_records_total", {"outcome": "written"}) == 25
    assert sample("gatehouse_capture_kafka_records_total", {"outcome": "written"}) == 25
    assert sample("gatehouse_capture_kafka_up") == 1.0


def test_close_does_not_wait_for_a_dead_cluster() -> None:
    with socket.socket() as probe:
        probe.bind((LOCALHOST, 0))
        port = probe.getsockname()[1]
    sink = KafkaSink(KafkaSinkSettings(retries=50, linger_seconds=0),
                     [Address(LOCALHOST, port)])
    for n in range(500):
        sink.offer(record(1, n))
    began = time.perf_counter()
    assert sink.close(10)
    assert time.perf_counter() - began < 3.0  # retries end at once on shutdown
    stats = sink.statistics()
    assert stats.written == 0 and stats.write_errors == 500
    assert not threading.enumerate().count(sink._thread)
