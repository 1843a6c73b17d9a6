"""Gatehouse in front of Kafka's own SSL listener (a real broker's TLS, not another
proxy's): TLS on both sides for librdkafka and the Java producer, the broker's
certificate verified against the proxy's CA, and a broker whose certificate another CA
issued refused and reported, its client let go."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path

import confluent_kafka as ck
import pytest

from tests.integration.test_metrics_topics import PERF
from tests.integration.test_sasl_proxy import logged, wait_for
from tests.support.clients import consume, produce, unique, watermarks
from tests.support.kafka import KafkaCluster, tls_files_for_loopback
from tests.support.proxythread import ProxyThread


@pytest.fixture(scope="module")
def tls_broker(kafka_libs: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[tuple[KafkaCluster, dict[str, Path]]]:
    files = tls_files_for_loopback(tmp_path_factory.mktemp("tls-broker"))
    with KafkaCluster(1, libs=kafka_libs, tls_keystore=files["keystore"]) as cluster:
        yield cluster, files


def both_sides(files: dict[str, Path], upstream_ca: Path) -> str:
    return (f"tls:\n  downstream: {{cert: {files['cert']}, key: {files['key']}}}\n"
            f"  upstream: {{ca: {upstream_ca}}}\n")


def test_tls_on_both_sides_to_kafkas_own_ssl_listener(
        tls_broker: tuple[KafkaCluster, dict[str, Path]]) -> None:
    kafka, files = tls_broker
    topic = unique("tls-broker")
    kafka.create_topic(topic, partitions=2)
    with ProxyThread(kafka.ssl_bootstrap, extra_config=both_sides(files, files["ca"])) as proxy:
        conf = {"bootstrap.servers": proxy.bootstrap, "security.protocol": "SSL",
                "ssl.ca.location": str(files["ca"])}
        sent = produce(conf, topic, count=50)
        assert sorted(consume(conf, topic, 50)) == sorted(sent)
        # The Java producer, Java's TLS against the proxy's listener.
        result = kafka.run_java_tool(
            PERF, "--topic", topic, "--num-records", "2000", "--record-size", "1024",
            "--throughput", "-1", "--producer-props", f"bootstrap.servers={proxy.bootstrap}",
            "acks=all", "security.protocol=SSL", "ssl.truststore.type=PEM",
            f"ssl.truststore.location={files['ca']}", timeout=180)
        assert re.search(r"^2000 records sent", result.stdout, re.M), result.stderr[-2000:]
        produced = proxy.summed_by("gatehouse_requests_total", "client_software", api="Produce")
        assert any(who.startswith("apache-kafka-java/") for who in produced), produced
    assert sum(watermarks(kafka.bootstrap, topic, p)[1] for p in (0, 1)) == 50 + 2000


def test_a_broker_certificate_from_another_ca_is_refused_and_reported(
        tls_broker: tuple[KafkaCluster, dict[str, Path]], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gatehouse.proxy")
    kafka, files = tls_broker
    strangers = tls_files_for_loopback(tmp_path)  # another CA: not the broker's
    topic = unique("tls-stranger")
    kafka.create_topic(topic)
    with ProxyThread(kafka.ssl_bootstrap,
                     extra_config=both_sides(files, strangers["ca"])) as proxy:
        producer = ck.Producer({"bootstrap.servers": proxy.bootstrap, "log_level": 0,
                                "security.protocol": "SSL",
                                "ssl.ca.location": str(files["ca"]),
                                "message.timeout.ms": 3000})
        producer.produce(topic, b"never")
        assert producer.flush(10) == 0  # the message timed out: reported, not kept
        failures = wait_for(lambda: [f for f in logged(caplog, "connection closed")
                                     if "upstream unreachable" in str(f.get("reason"))])
        assert "certificate verify failed" in str(failures[0]["reason"]), failures[0]
        assert proxy.sample("gatehouse_upstream_failures_total",
                            broker=kafka.ssl_bootstrap) >= 1
    assert watermarks(kafka.bootstrap, topic) == (0, 0)
