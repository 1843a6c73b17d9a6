"""The clients' own metrics (KIP-714) through the proxy, from real clients, real brokers.

Kafka 4.4 offers no telemetry APIs without a receiver plugin, so without the proxy its
clients push nothing.  With ``metrics.client_telemetry`` the proxy offers the APIs,
answers them, and exports what librdkafka and the Java clients push, labelled with who
pushed it as the proxy saw the connection.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import confluent_kafka as ck
import pytest

from tests.support.clients import (
    aiokafka_produce,
    consume,
    kafka_python_produce,
    kafka_python_read,
    produce,
    unique,
)
from tests.support.kafka import (
    BROKER_JVM_OPTS,
    JAVA_SOURCES,
    PERF,
    KafkaCluster,
    libs_with_plugin,
    start_java_process,
    stop_process,
)
from tests.support.proxythread import ProxyThread

CLIENT_METRICS = "org.apache.kafka.tools.ClientMetricsCommand"


@pytest.fixture(scope="module")
def kafka_receiver(kafka_libs: Path, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[tuple[KafkaCluster, Path]]:
    """A broker with a telemetry receiver of its own (tests/support/java/
    TelemetryRecorder.java, a metrics reporter that writes one line per push it gets to
    the file it yields) and a subscription asking every client for every metric each
    second."""
    where = tmp_path_factory.mktemp("telemetry-receiver")
    libs = libs_with_plugin(kafka_libs, JAVA_SOURCES / "TelemetryRecorder.java",
                            where / "plugin")
    received = where / "received.txt"
    with KafkaCluster(1, libs=libs, extra_config={"metric.reporters": "TelemetryRecorder"},
                      jvm_opts=(*BROKER_JVM_OPTS,
                                f"-Dgatehouse.telemetry.file={received}")) as cluster:
        subscribed = cluster.run_java_tool(
            CLIENT_METRICS, "--bootstrap-server", cluster.bootstrap, "--alter", "--name",
            "everything", "--metrics", "*", "--interval", "1000", timeout=120)
        assert subscribed.returncode == 0, subscribed.stderr[-2000:]
        yield cluster, received


def pushes_received(received: Path, client_id: str) -> int:
    """How many pushes of ``client_id`` the broker's receiver got."""
    if not received.exists():
        return 0
    return sum(1 for line in received.read_text().splitlines()
               if line.split(" ", 1)[0] == client_id)


def telemetry_config(push_interval: float) -> str:
    return f"metrics:\n  client_telemetry:\n    push_interval: {push_interval}\n"


def client_samples(proxy: ProxyThread, client_id: str) -> dict[str, dict[str, Any]]:
    """The kafka_client_* samples of the client with ``client_id``: name -> labels."""
    found = {}
    for family in proxy.metrics.registry.collect():
        for sample in family.samples:
            if (sample.name.startswith("kafka_client_")
                    and sample.labels.get("client_id") == client_id):
                found[sample.name] = {**sample.labels, "value": sample.value}
    return found


def pushes_taken(proxy: ProxyThread, outcome: str) -> float:
    """How many pushes the proxy took with ``outcome``, checked to be every push request
    it got, each answered with NONE (by it or the broker) but maybe the last, whose
    client may have gone.  Read once the proxy has stopped: clients push every second,
    and a push counted as a request may be a moment from its answer."""
    taken = proxy.sample("gatehouse_client_telemetry_pushes_total", outcome=outcome)
    assert proxy.summed("gatehouse_requests_total", api="PushTelemetry") == taken
    answered = proxy.sample("gatehouse_responses_total", api="PushTelemetry", error="NONE")
    assert taken - 1 <= answered <= taken
    return taken


def wait_for_samples(proxy: ProxyThread, client_id: str, wanted: str,
                     serve: Any, timeout: float = 30.0) -> dict[str, dict[str, Any]]:
    """The client's samples once one named ``wanted`` is among them; ``serve()`` runs the
    client's own loop meanwhile (its pushes are sent from it)."""
    deadline = time.monotonic() + timeout
    while True:
        found = client_samples(proxy, client_id)
        if wanted in found:
            return found
        assert time.monotonic() < deadline, sorted(found)
        serve()


def test_librdkafka_producers_and_consumers_push_their_metrics_to_the_proxy(
        kafka: KafkaCluster) -> None:
    topic = unique("telemetry")
    kafka.create_topic(topic, partitions=2)
    with ProxyThread(kafka.bootstrap, extra_config=telemetry_config(1)) as proxy:
        producer = ck.Producer({"bootstrap.servers": proxy.bootstrap,
                                "client.id": "telemetry-producer", "log_level": 3})
        for i in range(200):
            producer.produce(topic, f"m{i}".encode())
        assert producer.flush(30) == 0
        found = wait_for_samples(proxy, "telemetry-producer",
                                 "kafka_client_producer_record_queue_time_avg",
                                 lambda: producer.poll(0.2))
        labels = found["kafka_client_producer_connection_creation_total"]
        assert labels["client_software_name"] == "confluent-kafka-python"
        assert labels["client_software_version"].endswith(ck.libversion()[0])
        assert labels["value"] >= 1  # a counter: it made its connections
        latency = found["kafka_client_producer_node_request_latency_avg"]
        assert latency["node_id"] == "0"  # a data point's own attribute
        instance = latency["client_instance_id"]

        consumer = ck.Consumer({"bootstrap.servers": proxy.bootstrap,
                                "client.id": "telemetry-consumer", "group.id": unique("g"),
                                "auto.offset.reset": "earliest", "log_level": 3})
        consumer.subscribe([topic])
        seen = 0
        deadline = time.monotonic() + 60
        while seen < 200:
            assert time.monotonic() < deadline, seen
            message = consumer.poll(0.5)
            if message is not None and message.error() is None:
                seen += 1
        found = wait_for_samples(proxy, "telemetry-consumer",
                                 "kafka_client_consumer_fetch_manager_fetch_latency_avg",
                                 lambda: consumer.poll(0.2))
        assert found["kafka_client_consumer_fetch_manager_fetch_latency_avg"][
            "client_instance_id"] != instance
        consumer.close()  # its last push, terminating
        producer.close()

    # Every telemetry request was the proxy's to answer, and it took every push.
    assert pushes_taken(proxy, "accepted") >= 2
    assert proxy.summed("gatehouse_requests_total", api="GetTelemetrySubscriptions") >= 2


def test_java_clients_push_their_metrics_to_the_proxy(kafka: KafkaCluster,
                                                       tmp_path: Path) -> None:
    topic = unique("telemetry-java")
    kafka.create_topic(topic, partitions=1)
    # The producer's pushes are looked for while it runs (eight seconds, at 1,000 records a
    # second): a Java client pushes its last metrics as it closes only if its sender still
    # has records to send then (Sender.run polls no more once it has none), which a quick
    # run on a busy host may not have, so a push on the interval is what is waited for.
    with ProxyThread(kafka.bootstrap, extra_config=telemetry_config(1)) as proxy:
        producer = start_java_process(
            kafka.libs, PERF, "--topic", topic, "--num-records", "8000", "--record-size",
            "100", "--throughput", "1000", "--producer-props",
            f"bootstrap.servers={proxy.bootstrap}", "client.id=telemetry-java", "acks=all",
            log=tmp_path / "producer.log")
        try:
            deadline = time.monotonic() + 60
            while not (found := client_samples(proxy, "telemetry-java")):
                assert producer.poll() is None, (
                    "the Java producer pushed nothing while it ran: "
                    + (tmp_path / "producer.log").read_text()[-2000:])
                assert time.monotonic() < deadline, "the Java producer pushed nothing"
                time.sleep(0.05)
            assert producer.wait(timeout=120) == 0, (tmp_path / "producer.log").read_text()[-2000:]
        finally:
            stop_process(producer, timeout=10, kill=True)
        some = next(iter(found.values()))
        assert some["client_software_name"] == "apache-kafka-java"
        assert any(name.startswith("kafka_client_producer_") for name in found), sorted(found)
        assert proxy.sample("gatehouse_client_telemetry_pushes_total",
                            outcome="accepted") >= 1


def test_clients_without_kip_714_are_not_troubled_by_the_apis_offered(
        kafka: KafkaCluster) -> None:
    """kafka-python and aiokafka know neither API the proxy adds to ApiVersions: they
    produce and consume as before, and push nothing."""
    topic = unique("telemetry-old")
    kafka.create_topic(topic, partitions=1)
    with ProxyThread(kafka.bootstrap, extra_config=telemetry_config(1)) as proxy:
        args = {"bootstrap_servers": proxy.bootstrap}
        kafka_python_produce(args, [b"kp-1", b"kp-2"], topic)
        aiokafka_produce([b"aio-1"], topic, bootstrap_servers=proxy.bootstrap)
        assert sorted(kafka_python_read(args, topic, 3)) == [b"aio-1", b"kp-1", b"kp-2"]
        assert proxy.summed("gatehouse_requests_total", api="PushTelemetry") == 0
        assert proxy.summed("gatehouse_requests_total", api="Produce") >= 2


def test_without_client_telemetry_clients_push_nothing(kafka: KafkaCluster) -> None:
    """The broker offers no telemetry APIs: what the test above saw is the proxy's."""
    topic = unique("no-telemetry")
    kafka.create_topic(topic, partitions=1)
    with ProxyThread(kafka.bootstrap) as proxy:
        conf = {"bootstrap.servers": proxy.bootstrap, "client.id": "quiet"}
        produce(conf, topic, 50)
        assert len(consume(conf, topic, 50)) == 50
        assert proxy.summed("gatehouse_requests_total", api="GetTelemetrySubscriptions") == 0
        assert proxy.summed("gatehouse_requests_total", api="PushTelemetry") == 0
        assert proxy.summed("gatehouse_requests_total", api="ApiVersions") >= 2


def test_observing_leaves_the_pushes_to_the_brokers_receiver_and_reads_them_too(
        kafka_receiver: tuple[KafkaCluster, Path]) -> None:
    """mode: observe, in front of a cluster whose plugin receives the clients' metrics:
    the plugin gets every push, and the proxy exports what they carry."""
    kafka, received = kafka_receiver
    topic = unique("telemetry-observed")
    kafka.create_topic(topic, partitions=1)
    config = "metrics:\n  client_telemetry: {mode: observe}\n"
    with ProxyThread(kafka.bootstrap, extra_config=config) as proxy:
        producer = ck.Producer({"bootstrap.servers": proxy.bootstrap,
                                "client.id": "observed-producer", "log_level": 3})
        for i in range(100):
            producer.produce(topic, f"m{i}".encode())
        assert producer.flush(30) == 0
        wait_for_samples(proxy, "observed-producer",
                         "kafka_client_producer_record_queue_time_avg",
                         lambda: producer.poll(0.2))
        deadline = time.monotonic() + 30
        while pushes_received(received, "observed-producer") < 2:
            assert time.monotonic() < deadline, "the broker's receiver got no pushes"
            producer.poll(0.2)
        # A delta sum (librdkafka's connections made since the last push, 0 here: it
        # connected before its subscription) exported as a counter all the same.
        assert "kafka_client_producer_connection_creation_total" in client_samples(
            proxy, "observed-producer")
        producer.close()
    # The proxy read every push, and the broker answered each (the proxy none).
    assert pushes_taken(proxy, "observed") >= 2
    # And read the brokers' subscription on its way: the interval they gave the client
    # (--interval 1000) is how long its series stay, not the setting's 300 s.
    telemetry = proxy.metrics.client_telemetry
    assert telemetry is not None and set(telemetry.intervals.values()) == {1.0}


def test_receiving_keeps_the_pushes_from_the_brokers_receiver(
        kafka_receiver: tuple[KafkaCluster, Path], tmp_path: Path) -> None:
    """mode: receive (the default) in front of the same cluster: the proxy answers the
    pushes and the broker's plugin gets none of them, which `check --probe` says."""
    kafka, received = kafka_receiver
    topic = unique("telemetry-kept")
    kafka.create_topic(topic, partitions=1)
    with ProxyThread(kafka.bootstrap, extra_config=telemetry_config(1)) as proxy:
        producer = ck.Producer({"bootstrap.servers": proxy.bootstrap,
                                "client.id": "kept-producer", "log_level": 3})
        producer.produce(topic, b"x")
        assert producer.flush(30) == 0
        wait_for_samples(proxy, "kept-producer", "kafka_client_producer_record_queue_time_avg",
                         lambda: producer.poll(0.2))
        assert proxy.sample("gatehouse_client_telemetry_pushes_total", outcome="accepted") >= 1
    assert pushes_received(received, "kept-producer") == 0
    config = tmp_path / "proxy.yaml"
    config.write_text(f"listen: 127.0.0.1:9192\nupstream: [{kafka.bootstrap}]\n"
                      "metrics: {client_telemetry: {}}\n")
    result = subprocess.run([sys.executable, "-m", "gatehouse.cli", "check", "--config",
                             str(config), "--probe"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert ("client telemetry: the brokers have a receiver of their own, which gets none "
            "of these clients' metrics") in result.stdout, result.stdout
