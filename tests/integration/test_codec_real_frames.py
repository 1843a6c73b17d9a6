"""Frames exchanged by real clients with a real broker decode to the right values and
re-encode byte for byte (also through the plain-dict path)."""

from __future__ import annotations

from typing import Any

import pytest

from gatehouse import codecs
from gatehouse.proxy.hooks import ConnectionInfo, Observer, Pending
from tests.support.clients import (
    aiokafka_produce,
    consume,
    kafka_python_send_one,
    produce,
    unique,
)
from tests.support.kafka import KafkaCluster
from tests.support.proxythread import ProxyThread


class FrameTap(Observer):
    """Keeps every request and response frame that passes through the proxy."""

    def __init__(self) -> None:
        self.requests: list[bytes] = []
        self.responses: list[tuple[int, int, bytes]] = []

    def request(self, conn: ConnectionInfo, req: codecs.Request, size: int) -> None:
        assert req.frame is not None
        self.requests.append(bytes(req.frame))

    def response(self, conn: ConnectionInfo, pending: Pending, size: int, elapsed: float,
                 frame: Any = None) -> None:
        if frame is not None and pending.local is None:
            self.responses.append((pending.api_key, pending.api_version, bytes(frame)))


def check_frames(tap: FrameTap) -> set[str]:
    apis = set()
    for frame in tap.requests:
        req = codecs.decode_request(frame)
        if not req.known:
            continue
        apis.add(req.api.name)
        req.body  # noqa: B018 - full decode
        again = codecs.request_from_dict(codecs.to_dict(req))
        expected = frame[: len(frame) - len(req.trailing)] if req.trailing else frame
        assert bytes(codecs.encode_request(again)) == expected, req.header
    for key, version, frame in tap.responses:
        resp = codecs.decode_response(frame, key, version)
        if not resp.known:
            continue
        again = codecs.response_from_dict(codecs.to_dict(resp), api_key=key,
                                          api_version=resp.api_version)
        assert bytes(codecs.encode_response(again)) == frame, (key, version)
    return apis


def test_librdkafka_java_kafka_python_aiokafka_frames(kafka: KafkaCluster) -> None:
    from kafka import KafkaConsumer, KafkaProducer

    tap = FrameTap()
    with ProxyThread(kafka.bootstrap, observers=[tap]) as proxy:
        topic = unique("frames")
        kafka.create_topic(topic, partitions=2)
        conf = {"bootstrap.servers": proxy.bootstrap, "client.id": "rdkafka-tap",
                "compression.type": "gzip"}
        sent = produce(conf, topic, count=20)
        assert sorted(consume(conf, topic, 20)) == sorted(sent)
        producer = KafkaProducer(bootstrap_servers=proxy.bootstrap, client_id="kp-tap")
        producer.send(topic, b"from kafka-python").get(timeout=30)
        producer.close()
        consumer = KafkaConsumer(topic, bootstrap_servers=proxy.bootstrap,
                                 auto_offset_reset="earliest", consumer_timeout_ms=10000)
        assert any(m.value == b"from kafka-python" for m in consumer)
        consumer.close()

        aiokafka_produce([b"from aiokafka"], topic, bootstrap_servers=proxy.bootstrap,
                         client_id="aio-tap")
        result = kafka.run_java_tool(
            "org.apache.kafka.tools.ProducerPerformance", "--topic", topic, "--num-records",
            "50", "--record-size", "64", "--throughput", "-1", "--producer-props",
            f"bootstrap.servers={proxy.bootstrap}", "client.id=java-tap", timeout=120)
        assert result.returncode == 0
    apis = check_frames(tap)
    assert {"ApiVersions", "Metadata", "Produce", "Fetch", "FindCoordinator", "JoinGroup",
            "SyncGroup", "OffsetFetch", "Heartbeat"} <= apis
    # Values, not only bytes: the client ids and software (KIP-511) the clients sent.
    headers = [codecs.decode_request(f).header for f in tap.requests]
    assert {"rdkafka-tap", "kp-tap", "aio-tap", "java-tap"} <= {h.client_id for h in headers}
    software = {codecs.decode_request(f).body.client_software_name for f in tap.requests
                if codecs.decode_request(f).api_key == 18
                and codecs.decode_request(f).api_version >= 3}
    assert "apache-kafka-java" in software and "confluent-kafka-python" in software
    # The records inside Produce requests: batch headers read without decompressing.
    gzip_seen = False
    for f in tap.requests:
        req = codecs.decode_request(f)
        if req.api_key == 0 and req.known:
            for t in req.body.topic_data:
                for p in t.partition_data:
                    summary = codecs.records.summarize(p.records)
                    gzip_seen |= "gzip" in summary.compressions
    assert gzip_seen


@pytest.mark.parametrize("api_version", [(0, 10, 1), (1, 0, 0), (2, 0, 0)])
def test_old_protocol_levels_of_kafka_python(kafka: KafkaCluster,
                                             api_version: tuple[int, ...]) -> None:
    tap = FrameTap()
    with ProxyThread(kafka.bootstrap, observers=[tap]) as proxy:
        # Kafka 4 refuses the oldest levels (an error, or none): here only the frames matter.
        kafka_python_send_one(proxy.bootstrap, api_version, unique("old"))
    assert tap.requests
    check_frames(tap)
