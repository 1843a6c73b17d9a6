"""Topic ids under a tenant prefix with hide_others, on a real Apache Kafka broker: the
tenant's own clients (the Java producer and consumer name topics by id, librdkafka's
consumer too) work, and a request naming another tenant's topic by its id gets
UNKNOWN_TOPIC_ID from the proxy, where the broker itself would have served it."""

from __future__ import annotations

import socket
import struct
import time
import uuid
from typing import Any

import confluent_kafka as ck
from confluent_kafka.admin import AdminClient

from gatehouse import codecs
from gatehouse.codecs.records import encode_batch
from tests.integration.test_metrics_topics import versions_seen
from tests.support.clients import consume, recv_exact, unique, watermarks
from tests.support.kafka import PERF, KafkaCluster
from tests.support.proxythread import ProxyThread

RULES = ("- name: tenant-a\n  match: {client_id: '^a-'}\n"
         "  topic_prefix: {broker: 'a.', hide_others: true}\n")
NONE, UNKNOWN_TOPIC_ID = 0, 100


def call(address: str, api_key: int, version: int, body: dict[str, Any],
         client_id: str = "a-raw") -> Any:
    """One request on a new connection to ``address``; the answer's body."""
    host, port = address.rsplit(":", 1)
    req = codecs.request_from_dict({"header": {
        "api_key": api_key, "api_version": version, "correlation_id": 11,
        "client_id": client_id}, "body": body})
    frame = bytes(req.encode())
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(struct.pack(">i", len(frame)) + frame)
        (size,) = struct.unpack(">i", recv_exact(sock, 4))
        resp = codecs.decode_response(recv_exact(sock, size), api_key, version)
    assert resp.correlation_id == 11
    return resp.body


def topic_ids(address: str, *names: str, client_id: str = "ops") -> dict[str, uuid.UUID]:
    body = call(address, 3, 12, {"topics": [{"name": n} for n in names]}, client_id)
    return {t.name: t.topic_id for t in body.topics if t.error_code == NONE}


def fetch_error(address: str, topic_id: uuid.UUID, client_id: str = "a-raw"
                ) -> tuple[int, int]:
    """(the Fetch's top-level error, its one partition's error) for partition 0."""
    body = call(address, 1, 17, {
        "max_wait_ms": 0, "min_bytes": 1, "max_bytes": 1 << 20, "session_epoch": -1,
        "topics": [{"topic_id": topic_id, "partitions": [
            {"partition": 0, "fetch_offset": 0, "partition_max_bytes": 1 << 20}]}]},
        client_id)
    [topic] = body.responses
    [partition] = topic.partitions
    assert topic.topic_id == topic_id
    return body.error_code, partition.error_code


def test_a_tenant_names_its_own_topics_by_id_and_no_one_elses(kafka: KafkaCluster) -> None:
    mine, theirs = unique("a.orders"), unique("b.secrets")
    kafka.create_topic(mine)
    kafka.create_topic(theirs)
    ids = topic_ids(kafka.bootstrap, mine, theirs)
    assert fetch_error(kafka.bootstrap, ids[theirs]) == (NONE, NONE)  # the broker serves it
    client_name = mine.removeprefix("a.")
    with ProxyThread(kafka.bootstrap, rules_yaml=RULES) as proxy:
        # An id the proxy has not seen in an answer yet: the client is told to refresh
        # its metadata; once it has, through the proxy, the id goes.
        assert fetch_error(proxy.bootstrap, ids[mine]) == (NONE, UNKNOWN_TOPIC_ID)
        seen = topic_ids(proxy.bootstrap, client_name, theirs, client_id="a-raw")
        assert seen == {client_name: ids[mine]}  # the other tenant's is not shown
        assert fetch_error(proxy.bootstrap, ids[mine]) == (NONE, NONE)

        # The tenant's own clients, naming the topic by id, are not disturbed.
        produced = kafka.run_java_tool(
            PERF, "--topic", client_name, "--num-records", "500", "--record-size", "100",
            "--throughput", "-1", "--producer-props", f"bootstrap.servers={proxy.bootstrap}",
            "client.id=a-perf", "acks=all", timeout=120)
        assert produced.returncode == 0, produced.stderr[-2000:]
        assert "500 records sent" in produced.stdout
        registry = proxy.metrics.registry
        assert max(versions_seen(registry, "Produce", "apache-kafka-java")) >= 13
        kafka.consume_with_java(proxy.bootstrap, client_name, 500,
                                "--command-property", "client.id=a-perf-consumer")
        assert min(versions_seen(registry, "Fetch", "apache-kafka-java")) >= 13
        conf = {"bootstrap.servers": proxy.bootstrap, "client.id": "a-librdkafka"}
        assert len(consume(conf, client_name, 500)) == 500
        assert min(versions_seen(registry, "Fetch", "confluent-kafka-python")) >= 13
        refusals = proxy.sample("gatehouse_rule_decisions_total", rule="tenant-a",
                                action="refuse")
        assert refusals == 1  # the one unseen id above, and nothing since

        # Another tenant's topic, named by its id: not readable, writable or deletable.
        assert fetch_error(proxy.bootstrap, ids[theirs]) == (NONE, UNKNOWN_TOPIC_ID)
        batch = encode_batch([(int(time.time() * 1000), None, b"planted")])
        produce = call(proxy.bootstrap, 0, 13, {"acks": -1, "timeout_ms": 5000, "topic_data": [
            {"topic_id": ids[theirs], "partition_data": [{"index": 0, "records": batch}]}]})
        assert [p.error_code for t in produce.responses for p in t.partition_responses] == [
            UNKNOWN_TOPIC_ID]
        delete = call(proxy.bootstrap, 20, 6, {"timeout_ms": 5000, "topics": [
            {"name": None, "topic_id": ids[theirs]}]})
        assert [(t.topic_id, t.error_code) for t in delete.responses] == [
            (ids[theirs], UNKNOWN_TOPIC_ID)]
        assert proxy.sample("gatehouse_rule_decisions_total", rule="tenant-a",
                            action="refuse") == refusals + 3

    # Nothing reached the other tenant's topic: it is there, and empty.
    assert topic_ids(kafka.bootstrap, theirs) == {theirs: ids[theirs]}
    assert theirs in AdminClient({"bootstrap.servers": kafka.bootstrap}).list_topics(
        timeout=10).topics
    assert watermarks(kafka.bootstrap, theirs) == (0, 0)


def test_in_observe_mode_a_java_producer_to_another_tenants_topic_is_counted(
        kafka: KafkaCluster) -> None:
    """An observe-mode prefix: the Java producer (Produce v13, by id) writes to another
    tenant's topic undisturbed, and each such request counts as the rule's would_refuse."""
    theirs = unique("b.ledger")
    kafka.create_topic(theirs)
    with ProxyThread(kafka.bootstrap,
                     rules_yaml=RULES.replace("match:", "mode: observe\n  match:")) as proxy:
        produced = kafka.run_java_tool(
            PERF, "--topic", theirs, "--num-records", "300", "--record-size", "100",
            "--throughput", "-1", "--producer-props", f"bootstrap.servers={proxy.bootstrap}",
            "client.id=a-perf", "acks=all", timeout=120)
        assert produced.returncode == 0, produced.stderr[-2000:]
        registry = proxy.metrics.registry
        assert max(versions_seen(registry, "Produce", "apache-kafka-java")) >= 13
        produce_requests = sum(
            s.value for family in registry.collect() for s in family.samples
            if s.name == "gatehouse_requests_total" and s.labels["api"] == "Produce")
        would = proxy.sample("gatehouse_rule_decisions_total", rule="tenant-a",
                             action="would_refuse")
        assert would == produce_requests >= 1
        assert proxy.sample("gatehouse_rule_decisions_total", rule="tenant-a",
                            action="refuse") == 0
    assert watermarks(kafka.bootstrap, theirs) == (0, 300)  # nothing was stopped


def test_after_a_proxy_restart_the_java_clients_of_a_tenant_lose_nothing(
        kafka: KafkaCluster, tmp_path: Any) -> None:
    """A new proxy has seen no ids. The Java clients refresh their metadata when they
    reconnect, so it learns the topic's id from them (and would answer a request by id
    that came first with UNKNOWN_TOPIC_ID, after which they refresh it anyway). Every
    acknowledged message is consumed, each at the offset it was acked at (the counts
    from the tools' own JSON output)."""
    from tests.reliability.support import wait_until
    from tests.reliability.test_no_loss import (
        CONSUMER_CONFIG,
        PRODUCER_CONFIG,
        consumed_records,
        start_tool,
    )
    from tests.support.kafka import stop_process
    from tests.support.ports import free_port

    def slow_metadata(config: dict[str, Any]) -> dict[str, Any]:
        # Metadata refreshed only when a client finds it stale (the default is 5 min).
        return {k: v for k, v in config.items() if k != "metadata.max.age.ms"}

    topic = unique("a.restart")
    kafka.create_topic(topic, partitions=2)
    client_name = topic.removeprefix("a.")
    port = free_port()
    node_ports = ", ".join(f"{node.node_id}: {free_port()}" for node in kafka.nodes)
    config = (f"listen: 127.0.0.1:{port}\nupstream: [{kafka.bootstrap}]\n"
              f"brokers: {{start_port: null, ports: {{{node_ports}}}}}\n"
              "limits: {shutdown_grace: 2}\nlog: {level: WARNING}\n")
    bootstrap = f"127.0.0.1:{port}"
    messages, throughput = 3000, 300
    proxies = [ProxyThread(config_text=config, rules_yaml=RULES).start()]
    producer = consumer = None
    try:
        producer = start_tool(
            "producer", "org.apache.kafka.tools.VerifiableProducer",
            ["--topic", client_name, "--bootstrap-server", bootstrap, "--max-messages",
             str(messages), "--throughput", str(throughput), "--acks", "-1"],
            {**slow_metadata(PRODUCER_CONFIG), "client.id": "a-producer"}, tmp_path,
            kafka.libs)
        consumer = start_tool(
            "consumer", "org.apache.kafka.tools.VerifiableConsumer",
            ["--topic", client_name, "--bootstrap-server", bootstrap, "--group-id",
             unique("g"), "--verbose", "--reset-policy", "earliest"],
            {**slow_metadata(CONSUMER_CONFIG), "client.id": "a-consumer"}, tmp_path,
            kafka.libs)
        acks = lambda: len(producer.named("producer_send_success"))  # noqa: E731
        read = lambda: len(consumed_records(consumer))  # noqa: E731
        wait_until(lambda: acks() > 300 and read() > 100, 90, "acks and records",
                   interval=0.2)
        proxies[-1].stop()
        proxies.append(ProxyThread(config_text=config, rules_yaml=RULES).start())
        before = acks(), read()
        wait_until(lambda: acks() > before[0] + 300 and read() > before[1] + 300, 90,
                   "acks and records through the new proxy", interval=0.2)
        assert producer.process.wait(messages / throughput + 60) == 0
        acked = {e["value"]: (e["partition"], e["offset"])
                 for e in producer.named("producer_send_success")}
        assert producer.named("producer_send_error") == []
        assert len(acked) == messages
        wait_until(lambda: {r[2] for r in consumed_records(consumer)} >= acked.keys(), 90,
                   "the consumer to read every acked message", interval=0.5)
        seen = {(p, o): value for p, o, value in consumed_records(consumer)}
        assert all(acked[value] == (p, o) for (p, o), value in seen.items())
        # The new proxy learned the topic's id from the clients' own metadata refreshes,
        # and refused nothing else.
        names = proxies[-1].policy.topic_ids.names  # type: ignore[attr-defined]
        assert topic in names.values()
        refused = proxies[-1].sample("gatehouse_rule_decisions_total", rule="tenant-a",
                                     action="refuse")
        print(f"\nrefused by the new proxy: {refused}")
    finally:
        for tool in (producer, consumer):
            if tool is not None:
                stop_process(tool.process, 30)  # type: ignore[arg-type]
        proxies[-1].stop()


def test_after_a_proxy_restart_a_librdkafka_tenant_consumer_goes_on(
        kafka: KafkaCluster) -> None:
    """librdkafka's consumer, in the middle of its group's assignment, through a proxy
    that restarts (same ports, nothing remembered): it reads on, each record once."""
    from tests.support.clients import produce
    from tests.support.ports import free_port

    topic = unique("a.rd-restart")
    kafka.create_topic(topic)
    port = free_port()
    node_ports = ", ".join(f"{node.node_id}: {free_port()}" for node in kafka.nodes)
    config = (f"listen: 127.0.0.1:{port}\nupstream: [{kafka.bootstrap}]\n"
              f"brokers: {{start_port: null, ports: {{{node_ports}}}}}\n"
              "limits: {shutdown_grace: 2}\n")
    direct = {"bootstrap.servers": kafka.bootstrap}
    sent = produce(direct, topic, count=50, tag="before")
    consumer = ck.Consumer({"bootstrap.servers": f"127.0.0.1:{port}", "client.id": "a-rd",
                            "group.id": unique("g"), "auto.offset.reset": "earliest",
                            "log_level": 0})
    got: list[bytes] = []

    def read_until(count: int) -> None:
        deadline = time.monotonic() + 60
        while len(got) < count:
            assert time.monotonic() < deadline, f"{len(got)} of {count} records"
            message = consumer.poll(0.5)
            if message is not None and message.error() is None:
                got.append(message.value())

    proxy = ProxyThread(config_text=config, rules_yaml=RULES).start()
    try:
        consumer.subscribe([topic.removeprefix("a.")])
        read_until(50)
        proxy.stop()
        proxy = ProxyThread(config_text=config, rules_yaml=RULES).start()
        sent += produce(direct, topic, count=50, tag="after")
        read_until(100)
        assert topic in proxy.policy.topic_ids.names.values()  # type: ignore[attr-defined]
    finally:
        consumer.close()
        proxy.stop()
    assert got == sent
