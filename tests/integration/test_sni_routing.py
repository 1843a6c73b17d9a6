"""Every broker behind one port, told apart by the TLS server name (``brokers.sni``), on
a real Apache Kafka broker with the Java clients and kafka-python: clients bootstrap by
one name, are told a name per broker, and reach each broker through it."""

from __future__ import annotations

import json
import logging
import re
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme

from tests.support.clients import unique
from tests.support.kafka import PERF, KafkaCluster
from tests.support.netns import Netns, namespace_or_skip
from tests.support.proxythread import ProxyThread
from tests.support.tansu import tansu_binary

DOMAIN = "gatehouse.test"  # .test never resolves (RFC 2606): the clients are told, below


@pytest.fixture
def certificate(tmp_path: Path) -> trustme.CA:
    """A CA whose certificate for the bootstrap name and ``*.gatehouse.test`` the proxy
    serves (``tmp_path``/proxy.pem, .key); the CA itself in ``tmp_path``/ca.pem."""
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    issued = ca.issue_cert(f"bootstrap.{DOMAIN}", f"*.{DOMAIN}")
    issued.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "proxy.pem"))
    issued.private_key_pem.write_to_path(str(tmp_path / "proxy.key"))
    return ca


@pytest.fixture
def names_resolve(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``*.gatehouse.test`` resolves to 127.0.0.1 in this process (kafka-python's
    lookups), as a DNS wildcard record would."""
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(host, str) and host.endswith("." + DOMAIN):
            host = "127.0.0.1"
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield


def sni_proxy(kafka: KafkaCluster, tmp_path: Path) -> ProxyThread:
    return ProxyThread(config_text=(
        f"listen: 127.0.0.1:0\nupstream: [{kafka.bootstrap}]\n"
        f"brokers:\n  sni:\n    bootstrap: bootstrap.{DOMAIN}\n"
        f"    broker: broker-$(nodeId).{DOMAIN}\n"
        f"tls:\n  downstream: {{cert: {tmp_path}/proxy.pem, key: {tmp_path}/proxy.key}}\n"))


def requests_by_listener(proxy: ProxyThread, api: str) -> dict[str, float]:
    """``api``'s requests the proxy passed on, by the listener they came in on."""
    return proxy.summed_by("gatehouse_requests_total", "listener", api=api)


def test_java_clients_reach_each_broker_by_its_name(kafka: KafkaCluster, tmp_path: Path,
                                                      certificate: trustme.CA) -> None:
    hosts = tmp_path / "hosts"  # the JVM's resolver reads this instead of /etc/hosts
    hosts.write_text("127.0.0.1 " + " ".join(
        [f"bootstrap.{DOMAIN}"] + [f"broker-{n}.{DOMAIN}" for n in range(10)]) + "\n")
    client_tls = tmp_path / "client.properties"
    client_tls.write_text("security.protocol=SSL\nssl.truststore.type=PEM\n"
                          f"ssl.truststore.location={tmp_path}/ca.pem\n")
    jvm = ("-Xmx256m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
           f"-Djdk.net.hosts.file={hosts}")
    topic = unique("sni")
    kafka.create_topic(topic, partitions=2)
    with sni_proxy(kafka, tmp_path) as proxy:
        bootstrap = f"bootstrap.{DOMAIN}:{proxy.port}"
        produced = kafka.run_java_tool(
            PERF, "--topic", topic, "--num-records", "1000", "--record-size", "100",
            "--throughput", "-1", "--producer.config", str(client_tls), "--producer-props",
            f"bootstrap.servers={bootstrap}", "acks=all", timeout=120, jvm_opts=jvm)
        assert produced.returncode == 0, produced.stderr[-2000:]
        assert "1000 records sent" in produced.stdout
        kafka.consume_with_java(bootstrap, topic, 1000, "--command-config", str(client_tls),
                                jvm_opts=jvm)
        assert proxy.sample("gatehouse_topic_records_total", topic=topic,
                            direction="fetch") == 1000
        # The records went through the broker's name, not the bootstrap connection.
        [node] = [n.node_id for n in kafka.nodes]
        assert requests_by_listener(proxy, "Produce").keys() == {f"broker-{node}"}
        assert requests_by_listener(proxy, "Fetch").keys() == {f"broker-{node}"}
        assert requests_by_listener(proxy, "Metadata").keys() >= {"bootstrap"}


def test_kafka_python_and_names_that_lead_nowhere(kafka: KafkaCluster, tmp_path: Path,
                                                   certificate: trustme.CA,
                                                   names_resolve: None,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    from kafka import KafkaConsumer, KafkaProducer

    topic = unique("sni-kp")
    kafka.create_topic(topic)
    with sni_proxy(kafka, tmp_path) as proxy:
        tls = {"bootstrap_servers": f"bootstrap.{DOMAIN}:{proxy.port}",
               "security_protocol": "SSL", "ssl_cafile": str(tmp_path / "ca.pem")}
        producer = KafkaProducer(**tls)
        sent = [f"kp-{i}".encode() for i in range(20)]
        for value in sent:
            producer.send(topic, value)
        producer.flush(30)
        producer.close()
        consumer = KafkaConsumer(topic, auto_offset_reset="earliest",
                                 consumer_timeout_ms=15_000, **tls)
        got = [record.value for _, record in zip(range(20), consumer, strict=False)]
        consumer.close()
        assert got == sent
        [node] = [n.node_id for n in kafka.nodes]
        assert requests_by_listener(proxy, "Produce").keys() == {f"broker-{node}"}

        # A name that is neither the bootstrap nor a broker's, and a broker the cluster
        # does not have: the handshake completes (the certificate covers the names),
        # then the proxy closes the connection and says why.
        caplog.set_level(logging.WARNING, logger="gatehouse.proxy")
        context = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
        for name in (f"elsewhere.{DOMAIN}", f"broker-77.{DOMAIN}"):
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as raw, \
                    context.wrap_socket(raw, server_hostname=name) as conn:
                assert conn.recv(1) == b""  # closed by the proxy
        expected = [f"'elsewhere.{DOMAIN}' is neither a bootstrap name",
                    f"'broker-77.{DOMAIN}' names broker 77, which the cluster does not list"]

        def logged() -> list[str]:  # the log line follows the close the client sees
            reasons = [getattr(r, "gatehouse_fields", {}).get("reason", "")
                       for r in caplog.records if r.getMessage() == "connection closed"]
            return [e for e in expected if any(e in reason for reason in reasons)]

        deadline = time.monotonic() + 10
        while logged() != expected and time.monotonic() < deadline:
            time.sleep(0.05)
        assert logged() == expected


LIBRDKAFKA_CLIENT = r"""
import json, sys
import confluent_kafka as ck
from confluent_kafka.admin import AdminClient, NewTopic

bootstrap, ca, topic = sys.argv[1:4]
conf = {"bootstrap.servers": bootstrap, "security.protocol": "SSL", "ssl.ca.location": ca}
admin = AdminClient(conf)
admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)
brokers = sorted(f"{b.host}:{b.port}" for b in admin.list_topics(timeout=10).brokers.values())
producer = ck.Producer(conf)
for i in range(100):
    producer.produce(topic, f"r-{i}".encode())
left = producer.flush(30)
consumer = ck.Consumer({**conf, "group.id": "sni", "auto.offset.reset": "earliest"})
consumer.subscribe([topic])
got = []
for _ in range(300):
    message = consumer.poll(0.2)
    if message is not None and message.error() is None:
        got.append(message.value().decode())
    if len(got) == 100:
        break
consumer.close()
print(json.dumps({"brokers": brokers, "unsent": left, "got": got}))
"""


@pytest.fixture
def netns() -> Iterator[Netns]:
    yield from namespace_or_skip("ghsni")


def test_librdkafka_reaches_the_broker_by_its_name(netns: Netns, tmp_path: Path,
                                                    certificate: trustme.CA) -> None:
    """librdkafka resolves names with the system's resolver: here the names resolve in a
    network namespace of the test's own (its /etc/hosts), where a Tansu broker, the proxy
    and the client run."""
    netns.write_hosts({f"bootstrap.{DOMAIN}": "127.0.0.1",
                       **{f"broker-{n}.{DOMAIN}": "127.0.0.1" for n in range(256)}})
    broker_url = "tcp://127.0.0.1:19092"
    config = tmp_path / "gatehouse.yaml"
    config.write_text(
        "listen: 127.0.0.1:9093\nupstream: [127.0.0.1:19092]\n"
        f"brokers:\n  sni: {{bootstrap: bootstrap.{DOMAIN}, broker: broker-$(nodeId).{DOMAIN}}}\n"
        f"tls:\n  downstream: {{cert: {tmp_path}/proxy.pem, key: {tmp_path}/proxy.key}}\n")
    log = tmp_path / "gatehouse.log"
    processes = [
        netns.popen([str(tansu_binary()), "broker", "--listener-url", broker_url,
                     "--advertised-listener-url", broker_url, "--storage-engine",
                     "memory://tansu/"], cwd=tmp_path, stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL),
        netns.popen([sys.executable, "-m", "gatehouse.cli", "run", "--config", str(config)],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log.open("wb"))]
    try:
        deadline = time.monotonic() + 60
        # Listening is enough: if the broker was not up for the proxy's first look, the
        # client's bootstrap connection finds it (librdkafka retries until then).
        while "proxy listening" not in log.read_text():
            assert processes[1].poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.1)
        result = netns.run([sys.executable, "-c", LIBRDKAFKA_CLIENT, f"bootstrap.{DOMAIN}:9093",
                            str(tmp_path / "ca.pem"), "sni-rdkafka"], timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        outcome = json.loads(result.stdout)
    finally:
        for process in reversed(processes):
            process.terminate()
            process.wait(30)
    assert outcome["unsent"] == 0
    assert outcome["got"] == [f"r-{i}" for i in range(100)]
    [broker] = outcome["brokers"]  # told the broker's name, on the proxy's one port
    assert re.fullmatch(rf"broker-\d+\.{re.escape(DOMAIN)}:9093", broker)
