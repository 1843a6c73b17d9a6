"""The clients' own metrics (KIP-714) received by the proxy: the OTLP reader, the
receiver's answers and bounds, its exposition, ApiVersions, config, and the pumps.

OTLP messages are written by OpenTelemetry's own generated protobuf classes
(``opentelemetry-proto``), not by the reader under test.
"""

from __future__ import annotations

import uuid
from typing import Any

import cramjam
import pytest
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.metrics.v1 import metrics_pb2
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gatehouse import codecs
from gatehouse.codecs.otlp import DataPoint, decode_metrics_data
from gatehouse.configfile import ConfigError
from gatehouse.metrics import ProxyMetrics
from gatehouse.metrics.telemetry import (
    READ_IN_THREAD,
    ClientTelemetry,
    TelemetrySettings,
    prometheus_name,
)
from gatehouse.proxy.apiversions import adjust_api_versions
from gatehouse.proxy.config import config_from_text
from gatehouse.proxy.hooks import ConnectionInfo
from tests.support.fakebroker import request, response_body
from tests.support.otlp import counter, gauge, kv, metrics_data
from tests.support.protowire import nested

SUBSCRIBE, PUSH = 71, 72
CLIENT = uuid.UUID("6f2b3c1e-0d7a-4c55-9a4e-2b1c3d4e5f60")
NO_ID = uuid.UUID(int=0)  # a client's first request: the receiver assigns one


PRODUCER = metrics_data(
    gauge("org.apache.kafka.producer.node.request.latency.avg", 8.5, kv("node_id", int_value=2)),
    counter("org.apache.kafka.producer.connection.creation.total", 3),
    resource=(kv("client_rack", string_value="eu-1a"),),
)


# -- the OTLP reader ----------------------------------------------------------------------


def test_otlp_metrics_data_read_as_opentelemetry_wrote_it() -> None:
    histogram = metrics_pb2.Metric(name="org.apache.kafka.producer.batch.size")
    histogram.histogram.data_points.add(count=4, sum=10.0)
    data = metrics_data(
        gauge("g", 1.5, kv("topic", string_value="orders"), kv("ok", bool_value=True),
              kv("n", int_value=-7), kv("x", double_value=0.25),
              kv("list", array_value=common_pb2.ArrayValue(
                  values=[common_pb2.AnyValue(string_value="a")]))),
        counter("s", 2**40),
        counter("updown", -3, monotonic=False),
        histogram,
        resource=(kv("client_rack", string_value="eu-1a"), kv("pid", int_value=42)),
    )
    (resource,) = decode_metrics_data(data)
    assert resource.attributes == (("client_rack", "eu-1a"), ("pid", "42"))
    assert resource.points == (
        DataPoint("g", "gauge", 1.5, (("topic", "orders"), ("ok", "true"), ("n", "-7"),
                                      ("x", "0.25"))),
        DataPoint("s", "sum", float(2**40), (), True, "cumulative", 123),
        DataPoint("updown", "sum", -3.0, (), False, "cumulative", 123),
    )
    assert resource.skipped == 1  # the histogram
    # The same bytes as a memoryview (a request body's field) read alike.
    assert decode_metrics_data(memoryview(data)) == (resource,)


def test_otlp_fields_this_reader_does_not_know_are_skipped() -> None:
    # Field 15 (length-delimited) and field 14 (varint) of MetricsData: a newer OTLP's.
    data = PRODUCER + bytes([15 << 3 | 2, 3]) + b"new" + bytes([14 << 3, 0x96, 0x01])
    (resource,) = decode_metrics_data(data)
    assert [p.name for p in resource.points] == [
        "org.apache.kafka.producer.node.request.latency.avg",
        "org.apache.kafka.producer.connection.creation.total"]


@pytest.mark.parametrize("data, reason", [
    (PRODUCER[:-3], "past the end"),
    (bytes([1 << 3 | 3]), "wire type 3"),
    (bytes([1 << 3 | 0, 1]), "not a message"),
    (bytes([0x80] * 11), "longer than 10 bytes"),
    (bytes([0]), "numbered 0"),
    (nested(b"\x0a\x02\xff\xfe", 1, 2, 2), "do not read"),  # a name not UTF-8
])
def test_otlp_bytes_that_are_not_metrics_data_are_the_clients_error(data: bytes,
                                                                     reason: str) -> None:
    with pytest.raises(codecs.RemoteProtocolError, match=reason):
        decode_metrics_data(data)


# -- the receiver --------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def connection(client_id: str = "orders-app") -> ConnectionInfo:
    return ConnectionInfo(id=1, client="10.0.0.5:40000", listener="broker-0",
                          client_id=client_id, software_name="apache-kafka-java",
                          software_version="4.1.0", principal="User:orders")


def subscribe(receiver: ClientTelemetry, instance: uuid.UUID = NO_ID) -> Any:
    req = request(SUBSCRIBE, 0, 5, client_instance_id=str(instance))
    answer = receiver.answer(req, connection())
    assert answer.correlation_id == 5
    return codecs.decode_response(answer.encode(), SUBSCRIBE, 0).body


def push(receiver: ClientTelemetry, data: bytes, *, compression: int = 0,
         subscription: int | None = None, terminating: bool = False,
         instance: uuid.UUID = CLIENT, conn: ConnectionInfo | None = None) -> int:
    req = request(PUSH, 0, 9, client_instance_id=str(instance),
                  subscription_id=(receiver.subscription_id if subscription is None
                                   else subscription),
                  terminating=terminating, compression_type=compression, metrics=data)
    answer = receiver.answer(req, conn or connection())
    body = codecs.decode_response(answer.encode(), PUSH, 0).body
    return int(body.error_code)


def exposition(receiver: ClientTelemetry) -> dict[str, Any]:
    """The receiver's families as Prometheus' own parser reads its text."""
    registry = CollectorRegistry()
    registry.register(receiver)
    text = generate_latest(registry).decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def samples(receiver: ClientTelemetry, name: str) -> list[tuple[dict[str, str], float]]:
    families = exposition(receiver)
    return [(s.labels, s.value) for family in families.values() for s in family.samples
            if s.name == name]


def test_a_subscription_asks_for_the_configured_metrics_and_names_the_client() -> None:
    settings = TelemetrySettings(metrics=("org.apache.kafka.producer.",
                                          "org.apache.kafka.consumer.fetch"),
                                 push_interval=15, max_bytes=65536)
    receiver = ClientTelemetry(settings)
    body = subscribe(receiver)
    assert body.error_code == 0
    assert body.client_instance_id != NO_ID  # assigned
    assert body.subscription_id == settings.subscription_id
    assert list(body.requested_metrics) == ["org.apache.kafka.producer.",
                                            "org.apache.kafka.consumer.fetch"]
    assert body.push_interval_ms == 15000
    assert body.telemetry_max_bytes == 65536
    assert not body.delta_temporality  # cumulative: counters stay counters
    assert list(body.accepted_compression_types) == [4, 3, 1, 2]  # zstd lz4 gzip snappy
    # A client that has its id keeps it; another subscription of the same settings
    # (another worker, the proxy restarted) has the same id.
    assert subscribe(receiver, CLIENT).client_instance_id == CLIENT
    assert ClientTelemetry(settings).subscription_id == receiver.subscription_id
    assert TelemetrySettings(push_interval=16).subscription_id != settings.subscription_id
    # Seconds become whole milliseconds (PushIntervalMs is an int32).
    assert subscribe(ClientTelemetry(TelemetrySettings(push_interval=0.25))
                     ).push_interval_ms == 250


def test_pushed_metrics_are_exported_with_who_pushed_them() -> None:
    receiver = ClientTelemetry(TelemetrySettings())
    assert push(receiver, PRODUCER) == 0
    identity = {"client_instance_id": str(CLIENT), "client_id": "orders-app",
                "client_software_name": "apache-kafka-java",
                "client_software_version": "4.1.0", "principal": "User:orders",
                "client_rack": "eu-1a"}
    assert samples(receiver, "kafka_client_producer_node_request_latency_avg") == [
        ({**identity, "node_id": "2"}, 8.5)]
    families = exposition(receiver)
    assert families["kafka_client_producer_node_request_latency_avg"].type == "gauge"
    assert families["kafka_client_producer_connection_creation"].type == "counter"
    assert samples(receiver, "kafka_client_producer_connection_creation_total") == [
        (identity, 3.0)]
    assert samples(receiver, "gatehouse_client_telemetry_pushes_total") == [
        ({"outcome": "accepted"}, 1.0)]
    assert samples(receiver, "gatehouse_client_telemetry_instances") == [({}, 1.0)]


def test_a_client_cannot_pose_as_another_or_as_the_proxy() -> None:
    """The connection says who pushed: a client's attributes of the same names are left
    out, and its metric names live under kafka_client_, never the proxy's own."""
    receiver = ClientTelemetry(TelemetrySettings())
    data = metrics_data(
        gauge("gatehouse_ready", 1.0, kv("client_id", string_value="payments"),
              kv("principal", string_value="User:admin"), kv("9lives", string_value="x"),
              kv("topic.name", string_value="t" * 500)),
        resource=(kv("client_software_name", string_value="fake"),))
    assert push(receiver, data) == 0
    ((labels, _),) = samples(receiver, "kafka_client_gatehouse_ready")
    assert labels["client_id"] == "orders-app"
    assert labels["principal"] == "User:orders"
    assert labels["client_software_name"] == "apache-kafka-java"
    assert labels["_9lives"] == "x"
    assert labels["topic_name"] == "t" * 200  # label values cut
    assert "gatehouse_ready" not in exposition(receiver)
    assert prometheus_name("org.apache.kafka.consumer.fetch-manager.fetch.latency.avg") == (
        "kafka_client_consumer_fetch_manager_fetch_latency_avg")


def test_a_client_cannot_name_a_principal_the_connection_has_not() -> None:
    receiver = ClientTelemetry(TelemetrySettings())
    anonymous = ConnectionInfo(id=2, client="10.0.0.6:40000", listener="broker-0",
                               client_id="app")
    data = metrics_data(gauge("g", 1.0, kv("principal", string_value="User:admin")),
                        resource=(kv("client_software_name", string_value="fake"),))
    assert push(receiver, data, conn=anonymous) == 0
    ((labels, _),) = samples(receiver, "kafka_client_g")
    assert "principal" not in labels and "client_software_name" not in labels


def test_only_the_metrics_asked_for_are_kept() -> None:
    receiver = ClientTelemetry(TelemetrySettings(metrics=("org.apache.kafka.producer.node",)))
    assert push(receiver, PRODUCER) == 0
    names = {n for n in exposition(receiver) if n.startswith("kafka_client_")}
    assert names == {"kafka_client_producer_node_request_latency_avg"}


@pytest.mark.parametrize("codec, compress", [
    (1, lambda data: bytes(cramjam.gzip.compress(data))),
    (2, lambda data: bytes(cramjam.snappy.compress_raw(data))),
    (3, lambda data: bytes(cramjam.lz4.compress(data))),
    (4, lambda data: bytes(cramjam.zstd.compress(data))),
])
def test_compressed_pushes_are_read(codec: int, compress: Any) -> None:
    receiver = ClientTelemetry(TelemetrySettings())
    assert push(receiver, compress(PRODUCER), compression=codec) == 0
    assert samples(receiver, "kafka_client_producer_connection_creation_total")[0][1] == 3.0


def test_pushes_refused_as_a_broker_refuses_them() -> None:
    clock = Clock()
    receiver = ClientTelemetry(TelemetrySettings(push_interval=10, max_bytes=4096),
                               clock=clock)
    assert push(receiver, PRODUCER, instance=NO_ID) == 42  # INVALID_REQUEST
    assert push(receiver, PRODUCER, subscription=receiver.subscription_id ^ 1) == 117
    assert push(receiver, b"\0" * 4097) == 118  # TELEMETRY_TOO_LARGE
    bomb = bytes(cramjam.zstd.compress(b"\0" * 100_000))
    assert len(bomb) < 4096
    assert push(receiver, bomb, compression=4) == 118  # decompresses past max_bytes
    assert push(receiver, PRODUCER, compression=9) == 76  # UNSUPPORTED_COMPRESSION_TYPE
    assert push(receiver, b"\x07garbage") == 87  # INVALID_RECORD
    assert push(receiver, b"not zstd", compression=4) == 87
    assert samples(receiver, "gatehouse_client_telemetry_instances") == [({}, 0.0)]
    assert push(receiver, PRODUCER) == 0
    clock.now += 4.9  # sooner than half the interval: throttled, as a broker does
    assert push(receiver, PRODUCER) == 89
    assert push(receiver, PRODUCER, terminating=True) == 0  # the last one always goes
    outcomes = {labels["outcome"]: value for labels, value in
                samples(receiver, "gatehouse_client_telemetry_pushes_total")}
    assert outcomes == {"invalid_request": 1, "unknown_subscription": 1, "too_large": 2,
                        "unsupported_compression": 1, "invalid_metrics": 2,
                        "accepted": 2, "throttled": 1}


LARGE = metrics_data(*(gauge(f"org.apache.kafka.producer.part.{i}", float(i),
                             kv("topic", string_value="orders")) for i in range(2000)))


def test_a_large_push_is_read_by_work_for_a_thread() -> None:
    """Pushes of READ_IN_THREAD bytes and more are read (decompressed, decoded) by work
    the connection runs in a thread; smaller ones, and ones refused before their
    metrics are read, are answered as they are."""
    assert len(LARGE) >= READ_IN_THREAD > len(PRODUCER)
    receiver = ClientTelemetry(TelemetrySettings(push_interval=10))
    conn = connection()

    def push_request(data: bytes, instance: uuid.UUID = CLIENT) -> codecs.Request:
        return request(PUSH, 0, 9, client_instance_id=str(instance),
                       subscription_id=receiver.subscription_id, terminating=False,
                       compression_type=0, metrics=data)

    assert receiver.offload(push_request(PRODUCER), conn) is None
    assert receiver.offload(request(SUBSCRIBE, 0, 5, client_instance_id=str(NO_ID)),
                            conn) is None
    large = push_request(LARGE)
    work = receiver.offload(large, conn)
    assert work is not None
    read = work()
    assert not isinstance(read, int) and len(read[0].points) == 2000
    assert receiver.kept_samples == 0  # the work changed nothing
    answer = receiver.answer(large, conn, read)
    assert codecs.decode_response(answer.encode(), PUSH, 0).body.error_code == 0
    assert receiver.kept_samples == 2000
    # Throttled now: refused without reading, so no work.
    assert receiver.offload(push_request(LARGE, uuid.UUID(int=5)), conn) is None
    bad = push_request(b"\x07" * READ_IN_THREAD, uuid.UUID(int=6))
    other = connection()
    work = receiver.offload(bad, other)
    assert work is not None and work() == 87


def test_made_up_instance_ids_do_not_let_a_connection_push_more_often() -> None:
    clock = Clock()
    receiver = ClientTelemetry(TelemetrySettings(push_interval=10), clock=clock)
    conn = connection()
    assert push(receiver, PRODUCER, instance=uuid.UUID(int=1), conn=conn) == 0
    assert push(receiver, PRODUCER, instance=uuid.UUID(int=2), conn=conn) == 89
    assert push(receiver, PRODUCER, instance=uuid.UUID(int=3)) == 0  # another connection
    clock.now += 5
    assert push(receiver, PRODUCER, instance=uuid.UUID(int=2), conn=conn) == 0


def test_a_client_that_stops_pushing_is_forgotten() -> None:
    clock = Clock()
    receiver = ClientTelemetry(TelemetrySettings(push_interval=10), clock=clock)
    other = uuid.UUID(int=7)
    assert push(receiver, PRODUCER) == 0
    assert push(receiver, PRODUCER, instance=other, terminating=True) == 0
    assert receiver.kept_samples == 4
    clock.now += 10  # the terminated one is gone after one interval
    assert [labels["client_instance_id"] for labels, _ in
            samples(receiver, "kafka_client_producer_connection_creation_total")] == [str(CLIENT)]
    clock.now += 20  # the silent one after three
    assert samples(receiver, "kafka_client_producer_connection_creation_total") == []
    assert push(receiver, PRODUCER, instance=uuid.UUID(int=8)) == 0  # forgotten on a push
    assert set(receiver.instances) == {uuid.UUID(int=8)}
    assert receiver.kept_samples == 2


def test_samples_past_max_series_are_dropped_and_counted() -> None:
    clock = Clock()
    receiver = ClientTelemetry(TelemetrySettings(push_interval=1, max_series=3), clock=clock)
    assert push(receiver, PRODUCER, instance=uuid.UUID(int=1)) == 0
    assert push(receiver, PRODUCER, instance=uuid.UUID(int=2)) == 0  # one of its two kept
    assert receiver.kept_samples == 3
    assert samples(receiver, "gatehouse_client_telemetry_dropped_samples_total") == [({}, 1.0)]
    clock.now += 1
    # The first instance's next push replaces its own samples: no more room taken.
    assert push(receiver, PRODUCER, instance=uuid.UUID(int=1)) == 0
    assert receiver.kept_samples == 3
    assert len(samples(receiver, "kafka_client_producer_connection_creation_total")) == 1
    assert len(samples(receiver, "kafka_client_producer_node_request_latency_avg")) == 2


def test_clashing_names_still_make_an_exposition_prometheus_reads() -> None:
    """A gauge named as another's counter total or as a counter, a series sent twice:
    the exposition keeps the first family of a name and the last value of a series,
    rather than make one a scraper refuses."""
    receiver = ClientTelemetry(TelemetrySettings())
    assert push(receiver, metrics_data(
        counter("requests", 5), gauge("requests.total", 1.0),
        gauge("requests", 2.0, kv("node_id", int_value=1)),
        gauge("twice", 1.0), gauge("twice", 2.0)), instance=uuid.UUID(int=1)) == 0
    assert push(receiver, metrics_data(gauge("requests.total", 3.0)),
                instance=uuid.UUID(int=2)) == 0
    families = exposition(receiver)  # parsed by prometheus_client's parser
    assert families["kafka_client_requests"].type == "counter"
    assert [s.value for s in families["kafka_client_requests"].samples] == [5.0]
    assert "kafka_client_requests_total" not in families
    assert [s.value for s in families["kafka_client_twice"].samples] == [2.0]


def test_the_proxy_metrics_export_the_clients_metrics() -> None:
    metrics = ProxyMetrics(client_telemetry=TelemetrySettings())
    assert metrics.client_telemetry is not None
    assert push(metrics.client_telemetry, PRODUCER) == 0
    value = metrics.registry.get_sample_value(
        "kafka_client_producer_connection_creation_total",
        {"client_instance_id": str(CLIENT), "client_id": "orders-app",
         "client_software_name": "apache-kafka-java", "client_software_version": "4.1.0",
         "principal": "User:orders", "client_rack": "eu-1a"})
    assert value == 3.0
    assert ProxyMetrics().client_telemetry is None


# -- ApiVersions ------------------------------------------------------------------------


def api_versions(*keys: tuple[int, int, int], error_code: int = 0) -> codecs.Response:
    body = response_body(18, 3, error_code=error_code, api_keys=[
        {"api_key": k, "min_version": lo, "max_version": hi} for k, lo, hi in keys])
    return codecs.Response.build(18, 3, 1, body)


def ranges(resp: codecs.Response) -> dict[int, tuple[int, int]]:
    return {k.api_key: (k.min_version, k.max_version) for k in resp.body.api_keys}


def test_api_versions_offer_the_telemetry_apis_the_proxy_answers() -> None:
    added = ((71, 0, 0), (72, 0, 0))
    plain = api_versions((0, 0, 11), (18, 0, 4))
    assert ranges(adjust_api_versions(plain, added=added)) == {
        0: (0, 11), 18: (0, 4), 71: (0, 0), 72: (0, 0)}
    # A broker that offers them itself: its entries stay as they are.
    both = api_versions((0, 0, 11), (71, 0, 0), (72, 0, 0))
    assert adjust_api_versions(both, added=added) is both
    # An error answer (the v0 fallback) lists what ApiVersions the broker takes: no more.
    refused = api_versions((18, 0, 3), error_code=35)
    assert adjust_api_versions(refused, added=added) is refused
    # Rules' adjusters see them too (a rule that takes an API away).
    dropped = adjust_api_versions(plain, lambda key, lo, hi: None if key == 72 else (lo, hi),
                                  added=added)
    assert set(ranges(dropped)) == {0, 18, 71}


# -- config ------------------------------------------------------------------------------


def test_client_telemetry_config() -> None:
    base = "listen: 127.0.0.1:9192\nupstream: [127.0.0.1:9092]\n"
    assert config_from_text(base).client_telemetry is None
    assert config_from_text(base + "metrics:\n  client_telemetry: {}\n"
                            ).client_telemetry == TelemetrySettings()
    config = config_from_text(base + "metrics:\n  client_telemetry:\n    metrics:\n"
                              "      - org.apache.kafka.producer.\n"
                              "    push_interval: 10\n    max_bytes: 2048\n"
                              "    max_series: 50\n")
    assert config.client_telemetry == TelemetrySettings(
        metrics=("org.apache.kafka.producer.",), push_interval=10.0, max_bytes=2048,
        max_series=50)


@pytest.mark.parametrize("section, line, message", [
    ("    metrics: []\n", 5, "asks for no metric"),
    ("    metrics:\n      - a\n      - 7\n", 7, "metric name prefix"),
    ("    push_interval: 0\n", 5, "must be positive"),
    ("    max_series: 1.5\n", 5, "must be an integer"),
    ("    interval: 5\n", 5, "unknown key 'interval'"),
])
def test_client_telemetry_config_errors_say_where(section: str, line: int,
                                                  message: str) -> None:
    text = ("listen: 127.0.0.1:9192\nupstream: [127.0.0.1:9092]\nmetrics:\n"
            "  client_telemetry:\n" + section)
    with pytest.raises(ConfigError) as info:
        config_from_text(text, "proxy.yaml")
    assert str(info.value).startswith(f"proxy.yaml:{line}: "), str(info.value)
    assert message in str(info.value)



def test_the_clients_metrics_of_several_workers_are_served_as_one() -> None:
    """workers: N: each worker's clients' metrics keep their kind, labels and values
    under its worker label in the supervisor's exposition."""
    from gatehouse.metrics.merge import merge_by_worker

    texts = []
    for worker in range(2):
        receiver = ClientTelemetry(TelemetrySettings())
        assert push(receiver, PRODUCER, instance=uuid.UUID(int=worker + 1)) == 0
        registry = CollectorRegistry()
        registry.register(receiver)
        texts.append((str(worker), generate_latest(registry).decode()))
    families = {f.name: f for f in text_string_to_metric_families(
        merge_by_worker(texts).decode())}
    creation = families["kafka_client_producer_connection_creation"]
    assert creation.type == "counter"
    assert sorted((s.labels["worker"], s.labels["client_instance_id"][-1], s.value)
                  for s in creation.samples) == [("0", "1", 3.0), ("1", "2", 3.0)]


def test_check_says_what_the_clients_are_asked_to_push(tmp_path: Any,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    from gatehouse.cli import main

    config = tmp_path / "gatehouse.yaml"
    config.write_text("listen: 127.0.0.1:9192\nupstream: [127.0.0.1:9092]\nmetrics:\n"
                      "  client_telemetry: {metrics: [org.apache.kafka.producer.], "
                      "push_interval: 60}\n")
    assert main(["check", "--config", str(config)]) == 0
    assert ("metrics.client_telemetry: clients push metrics named "
            "org.apache.kafka.producer.* to the proxy every 60 s (KIP-714), exported as "
            "kafka_client_*, at most 10,000 samples") in capsys.readouterr().out
    config.write_text("listen: 127.0.0.1:9192\nupstream: [127.0.0.1:9092]\nmetrics:\n"
                      "  client_telemetry: {mode: observe}\n")
    assert main(["check", "--config", str(config)]) == 0
    assert ("the proxy reads what clients push to the brokers' own receiver (KIP-714), "
            "keeps all their metrics") in capsys.readouterr().out


def test_the_probe_says_who_receives_the_clients_metrics() -> None:
    """A broker with a receiver of its own offers PushTelemetry: with client_telemetry
    the proxy's answers keep the clients' metrics from it, which the probe says."""
    from gatehouse.proxy.probe import telemetry_line

    with_receiver = {18: (0, 4), 71: (0, 0), 72: (0, 0)}
    without = {18: (0, 4)}
    assert "none of these clients' metrics" in (telemetry_line(True, with_receiver) or "")
    assert "the brokers have no receiver" in (telemetry_line(True, without) or "")
    assert "through the proxy" in (telemetry_line(False, with_receiver) or "")
    assert telemetry_line(False, without) is None


# -- observing the pushes on their way to the brokers' receiver -----------------------------


def test_observing_reads_pushes_and_leaves_them_to_the_broker() -> None:
    receiver = ClientTelemetry(TelemetrySettings(mode="observe", push_interval=10))
    assert receiver.intercepts == {PUSH} and receiver.added_apis == ()
    conn = connection()
    for instance in (CLIENT, CLIENT, uuid.UUID(int=3)):  # no throttling: the broker's call
        req = request(PUSH, 0, 9, client_instance_id=str(instance), subscription_id=4242,
                      terminating=False, compression_type=4,
                      metrics=bytes(cramjam.zstd.compress(PRODUCER)))
        assert receiver.answer(req, conn) is None  # it goes on to the broker
    assert receiver.answer(request(PUSH, 0, 9, client_instance_id=str(CLIENT),
                                   subscription_id=1, terminating=False,
                                   compression_type=0, metrics=b"\x07bad"), conn) is None
    assert len(samples(receiver, "kafka_client_producer_connection_creation_total")) == 2
    outcomes = {labels["outcome"]: value for labels, value in
                samples(receiver, "gatehouse_client_telemetry_pushes_total")}
    assert outcomes == {"observed": 3, "invalid_metrics": 1}
    with pytest.raises(ValueError, match="not a telemetry request the proxy takes"):
        receiver.answer(request(SUBSCRIBE, 0, 5, client_instance_id=str(NO_ID)), conn)


def test_delta_sums_add_up_to_a_counter() -> None:
    """A broker's subscription asks for deltas (Kafka's default): each push's increase is
    added to what the series had, so Prometheus sees a counter either way."""
    clock = Clock()
    receiver = ClientTelemetry(TelemetrySettings(mode="observe"), clock=clock)

    def delta(value: int) -> bytes:
        metric = counter("org.apache.kafka.producer.record.send.total", value)
        metric.sum.aggregation_temporality = metrics_pb2.AGGREGATION_TEMPORALITY_DELTA
        return metrics_data(metric, gauge("org.apache.kafka.producer.queue", float(value)))

    for value in (3, 4, 0):
        req = request(PUSH, 0, 9, client_instance_id=str(CLIENT), subscription_id=1,
                      terminating=False, compression_type=0, metrics=delta(value))
        assert receiver.answer(req, connection()) is None
        clock.now += 30
    assert samples(receiver, "kafka_client_producer_record_send_total")[0][1] == 7.0
    assert samples(receiver, "kafka_client_producer_queue")[0][1] == 0.0  # gauges: the last


def subscription_answer(instance: uuid.UUID, interval_ms: int, error_code: int = 0
                        ) -> codecs.Response:
    body = response_body(SUBSCRIBE, 0, error_code=error_code,
                         client_instance_id=str(instance), subscription_id=5,
                         push_interval_ms=interval_ms, telemetry_max_bytes=1 << 20,
                         requested_metrics=["org.apache.kafka."])
    return codecs.Response.build(SUBSCRIBE, 0, 1, body)


def test_observing_keeps_series_as_long_as_the_brokers_interval_says() -> None:
    """The brokers' answer to GetTelemetrySubscriptions gives each client its interval:
    a client told to push every 20 minutes keeps its series between pushes, where the
    setting (300 s: 15 minutes kept) would drop them; an error answer teaches nothing."""
    clock = Clock()
    receiver = ClientTelemetry(TelemetrySettings(mode="observe", push_interval=300),
                               clock=clock)
    assert receiver.reads_answers == {SUBSCRIBE}
    slow, usual = CLIENT, uuid.UUID(int=3)
    receiver.subscribed(subscription_answer(slow, 1_200_000))
    receiver.subscribed(subscription_answer(usual, 1_200_000, error_code=117))
    assert receiver.intervals == {slow: 1200.0}
    for instance in (slow, usual):
        req = request(PUSH, 0, 9, client_instance_id=str(instance), subscription_id=5,
                      terminating=False, compression_type=0, metrics=PRODUCER)
        assert receiver.answer(req, connection()) is None
    clock.now += 3 * 300  # past three of the setting's intervals: only the slow one kept
    name = "kafka_client_producer_connection_creation_total"
    assert [labels["client_instance_id"] for labels, _ in samples(receiver, name)] == [str(slow)]
    # The brokers shorten its interval: its series now go three of those after its push.
    receiver.subscribed(subscription_answer(slow, 60_000))
    clock.now += 1
    assert samples(receiver, name) == []
    # Forgotten with its series, at the next request's sweep.
    assert receiver.answer(request(PUSH, 0, 9, client_instance_id=str(usual),
                                   subscription_id=5, terminating=False,
                                   compression_type=0, metrics=PRODUCER),
                           connection()) is None
    assert receiver.intervals == {}
    # Receiving, the proxy's own interval is the one clients get: no answers to read.
    assert ClientTelemetry(TelemetrySettings()).reads_answers == frozenset()


def test_what_observing_learns_of_intervals_is_bounded() -> None:
    receiver = ClientTelemetry(TelemetrySettings(mode="observe", max_series=2))
    for n in range(1, 5):
        receiver.subscribed(subscription_answer(uuid.UUID(int=n), n * 1000))
    receiver.subscribed(subscription_answer(uuid.UUID(int=0), 1000))  # no instance id
    assert receiver.intervals == {uuid.UUID(int=3): 3.0, uuid.UUID(int=4): 4.0}


def test_client_telemetry_mode_config() -> None:
    base = "listen: 127.0.0.1:9192\nupstream: [127.0.0.1:9092]\nmetrics:\n  client_telemetry:"
    observed = config_from_text(base + " {mode: observe}\n").client_telemetry
    assert observed.mode == "observe"
    # The brokers' interval, as Kafka's default, keeps a client's series between pushes.
    assert observed.push_interval == 300.0
    assert config_from_text(base + " {mode: observe, push_interval: 60}\n"
                            ).client_telemetry.push_interval == 60.0
    with pytest.raises(ConfigError) as info:
        config_from_text(base + "\n    mode: steal\n", "proxy.yaml")
    assert str(info.value).startswith("proxy.yaml:5: ")
    assert "'receive'" in str(info.value) and "'observe'" in str(info.value)
