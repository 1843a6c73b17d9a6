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

from tests.integration.test_sasl_proxy import logged, wait_for
from tests.support.clients import consume, produce, unique, watermarks
from tests.support.kafka import PERF, TOOL_JVM_OPTS, KafkaCluster, tls_files_for_loopback
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


def test_tls_key_updates_mid_connection_both_ways_through_the_proxy(
        tls_broker: tuple[KafkaCluster, dict[str, Path]], tmp_path: Path) -> None:
    """TLS 1.3 key updates in the middle of a connection, which the proxy's own TLS
    reads must take and its sends answer: Java's clients with a key limit of 64 KiB
    (`jdk.tls.keyLimits`) send a KeyUpdate asking for one back every 64 KiB they send or
    receive (OpenSSL seals its answer before the proxy's next record).  Every record
    produced through the proxy is consumed through it."""
    kafka, files = tls_broker
    topic = unique("tls-rekey")
    kafka.create_topic(topic, partitions=1)
    client_tls = tmp_path / "client-tls.properties"
    client_tls.write_text("security.protocol=SSL\nssl.truststore.type=PEM\n"
                          f"ssl.truststore.location={files['ca']}\n")
    # A security property (java.security), not a system one: a file added to them.
    limits = tmp_path / "key-limits.security"
    limits.write_text("jdk.tls.keyLimits=AES/GCM/NoPadding KeyUpdate 2^16, "
                      "ChaCha20-Poly1305 KeyUpdate 2^16\n")
    rekeying = (*TOOL_JVM_OPTS, f"-Djava.security.properties={limits}",
                "-Djavax.net.debug=ssl:handshake")
    downstream = f"tls:\n  downstream: {{cert: {files['cert']}, key: {files['key']}}}\n"
    with ProxyThread(kafka.bootstrap, extra_config=downstream) as proxy:
        produced = kafka.run_java_tool(
            PERF, "--topic", topic, "--num-records", "3000", "--record-size", "1024",
            "--throughput", "-1", "--producer-props", f"bootstrap.servers={proxy.bootstrap}",
            "acks=all", "--producer.config", str(client_tls), timeout=180, jvm_opts=rekeying)
        assert re.search(r"^3000 records sent", produced.stdout, re.M), produced.stderr[-2000:]
        consumed = kafka.consume_with_java(proxy.bootstrap, topic, 3000, "--command-config",
                                           str(client_tls), timeout=180, jvm_opts=rekeying)
        assert proxy.sample("gatehouse_topic_records_total", topic=topic,
                            direction="fetch") >= 3000
    assert watermarks(kafka.bootstrap, topic, 0)[1] == 3000
    for tool in (produced, consumed):
        debug = tool.stdout + tool.stderr  # Java's TLS debug lines
        # Many key updates each way: the client's, and the proxy's, each taken by the
        # other side (a record sealed with a stale key would have failed the connection).
        assert debug.count("Produced KeyUpdate post-handshake message") >= 10, debug[-2000:]
        assert debug.count("Consuming KeyUpdate post-handshake message") >= 10, debug[-2000:]
