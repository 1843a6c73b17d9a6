"""Real clients through the proxy to real brokers (Apache Kafka 4.4 and Tansu)."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from pathlib import Path
from typing import Any

import confluent_kafka as ck
import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from gatehouse import codecs
from gatehouse.codecs.records import encode_batch
from gatehouse.proxy.hooks import AGE_LIMIT, ConnectionInfo, Observer, Policy
from tests.integration.test_rules_topic_ids import call, topic_ids
from tests.integration.test_sni_routing import requests_by_listener
from tests.support.clients import (
    consume,
    kafka_python_produce,
    kafka_python_read,
    kafka_python_send_one,
    produce,
    recv_exact,
    unique,
    watermarks,
)
from tests.support.kafka import SCRAM_MECHANISM, SCRAM_PASSWORD, SCRAM_USER, KafkaCluster
from tests.support.proxythread import ProxyThread
from tests.support.tansu import TansuBroker


def stats_broker_ports(stats: list[dict[str, Any]]) -> set[int]:
    """Every broker port librdkafka knew or used, from its statistics."""
    ports = set()
    for snapshot in stats:
        for broker in snapshot.get("brokers", {}).values():
            name = broker.get("nodename") or broker["name"].split("/")[0]
            if ":" in name and broker.get("nodeid", -1) != -1:
                ports.add(int(name.rsplit(":", 1)[1]))
    return ports


def test_librdkafka_through_proxy_on_kafka(kafka: KafkaCluster) -> None:
    with ProxyThread(kafka.bootstrap) as proxy:
        conf = {"bootstrap.servers": proxy.bootstrap}
        admin = AdminClient(conf)
        topic = unique("t")
        futures = admin.create_topics([NewTopic(topic, num_partitions=3, replication_factor=1)])
        futures[topic].result(30)
        described = admin.list_topics(topic, timeout=10)
        assert len(described.topics[topic].partitions) == 3
        # Every broker the client is told about is the proxy.
        assert {b.port for b in described.brokers.values()} <= proxy.broker_ports
        sent = produce({**conf, "enable.idempotence": True}, topic, count=1000)
        assert sorted(consume(conf, topic, 1000)) == sorted(sent)
        assert proxy.sample("gatehouse_topic_records_total", topic=topic,
                            direction="produce") == 1000
        admin.delete_topics([topic])[topic].result(30)
        assert topic not in admin.list_topics(timeout=10).topics


def test_three_brokers_port_per_broker_and_no_bypass(kafka_cluster: KafkaCluster) -> None:
    with ProxyThread(kafka_cluster.bootstrap) as proxy:
        topic = unique("spread")
        kafka_cluster.create_topic(topic, partitions=6, replication=1)
        stats: list[dict[str, Any]] = []
        conf = {"bootstrap.servers": proxy.bootstrap, "statistics.interval.ms": 200,
                "stats_cb": lambda s: stats.append(json.loads(s))}
        sent = produce(conf, topic, count=600)
        assert sorted(consume(conf, topic, 600)) == sorted(sent)
        metadata = AdminClient({"bootstrap.servers": proxy.bootstrap}).list_topics(topic,
                                                                                   timeout=10)
        leaders = {p.leader for p in metadata.topics[topic].partitions.values()}
        assert len(leaders) >= 2  # partitions really are led by different brokers
        assert len(proxy.proxy.brokers) == 3
        real_ports = {n.port for n in kafka_cluster.nodes}
        if not stats_broker_ports(stats):
            # Produce and consume can both end before the first statistics interval:
            # ask a client that knows the brokers until its statistics arrive.
            watcher = ck.Producer(conf)
            watcher.list_topics(topic, timeout=10)
            deadline = time.monotonic() + 10
            while not stats_broker_ports(stats) and time.monotonic() < deadline:
                watcher.poll(0.1)  # serves stats_cb
        seen = stats_broker_ports(stats)
        assert seen and seen <= proxy.broker_ports
        assert not seen & real_ports  # the client never learned a real broker address


def test_a_brokers_advertised_listeners_name_its_proxy_port(kafka_cluster: KafkaCluster
                                                            ) -> None:
    """A broker's configs described through the proxy (librdkafka's admin client, and
    Kafka's own kafka-configs tool): advertised.listeners, where its clients connect,
    names the proxy's port for that broker, not the broker's."""
    from confluent_kafka.admin import ConfigResource, ResourceType

    with ProxyThread(kafka_cluster.bootstrap) as proxy:
        admin = AdminClient({"bootstrap.servers": proxy.bootstrap})
        admin.list_topics(timeout=10)  # the brokers learnt, their ports open
        ports = {b.node_id: b.port for b in proxy.proxy.brokers.values()}
        assert len(ports) == 3
        for node in kafka_cluster.nodes:
            [future] = admin.describe_configs(
                [ConfigResource(ResourceType.BROKER, str(node.node_id))]).values()
            configs = future.result(timeout=30)
            advertised = configs["advertised.listeners"].value
            assert advertised == f"PLAINTEXT://127.0.0.1:{ports[node.node_id]}", advertised
            assert str(node.port) not in advertised
        tool = kafka_cluster.run_java_tool(
            "org.apache.kafka.tools.ConfigCommand", "--bootstrap-server", proxy.bootstrap,
            "--describe", "--entity-type", "brokers", "--entity-name",
            str(kafka_cluster.nodes[0].node_id), "--all", timeout=120, check=True)
        said = [line for line in tool.stdout.splitlines()
                if line.strip().startswith("advertised.listeners=")]
        assert said and all(f"127.0.0.1:{ports[kafka_cluster.nodes[0].node_id]}" in line
                            and f":{kafka_cluster.nodes[0].port}" not in line for line in said), said


def test_a_broker_back_at_another_address_is_reached_at_its_proxy_port(
        kafka_cluster: KafkaCluster) -> None:
    """A broker restarted on another port (as a rescheduled pod comes back on a new IP):
    the first connection to its proxy port reaches it there (the old address refused, the
    proxy asks the cluster where its brokers are), the proxy port stays its own, and
    clients go on."""
    cluster = kafka_cluster
    with ProxyThread(cluster.bootstrap) as proxy:
        topic = unique("relocated")
        cluster.create_topic(topic, partitions=3, replication=3)
        conf = {"bootstrap.servers": proxy.bootstrap}
        sent = produce(conf, topic, 60, tag="before")
        port, old = proxy.proxy.brokers[2].port, cluster.nodes[2].port
        cluster.move_node(2)
        assert cluster.nodes[2].port != old
        assert proxy.proxy.brokers[2].real.port == old  # no answer has named the new one
        versions = call(f"127.0.0.1:{port}", 18, 3, {"client_software_name": "raw",
                                                     "client_software_version": "1"})
        assert versions.error_code == 0
        assert proxy.proxy.brokers[2].real.port == cluster.nodes[2].port
        sent += produce(conf, topic, 60, tag="after")
        assert sorted(consume(conf, topic, len(sent))) == sorted(sent)
        brokers = AdminClient(conf).list_topics(timeout=10).brokers
        assert {b.id: b.port for b in brokers.values()} == {
            node_id: broker.port for node_id, broker in proxy.proxy.brokers.items()}
        assert brokers[2].port == port


def test_a_broker_added_to_the_cluster_is_served_without_a_restart(kafka_libs: Path) -> None:
    """A cluster scaled out behind a running proxy: the new broker gets its listener from
    the first answer that names it, and a topic that lives only on it is produced and
    consumed through the proxy's port for it."""
    with KafkaCluster(1, libs=kafka_libs) as cluster, \
            ProxyThread(cluster.bootstrap) as proxy:
        assert set(proxy.proxy.brokers) == {0}
        new = cluster.add_broker()
        topic = unique("scaled")
        admin = AdminClient({"bootstrap.servers": cluster.bootstrap})
        admin.create_topics([NewTopic(topic, num_partitions=1,
                                      replica_assignment=[[new.node_id]])])[topic].result(30)
        conf = {"bootstrap.servers": proxy.bootstrap}
        sent = produce(conf, topic, 100)
        assert sorted(consume(conf, topic, len(sent))) == sorted(sent)
        assert set(proxy.proxy.brokers) == {0, new.node_id}
        listener = f"broker-{new.node_id}"
        assert listener in requests_by_listener(proxy, "Produce")
        assert listener in requests_by_listener(proxy, "Fetch")
        brokers = AdminClient(conf).list_topics(timeout=10).brokers
        assert brokers[new.node_id].port == proxy.proxy.brokers[new.node_id].port != new.port


def test_consumers_fetch_from_the_replica_in_their_rack_through_its_proxy_port(
        kafka_libs: Path) -> None:
    """KIP-392 behind the proxy: brokers in three racks with the rack-aware replica
    selector; the leader names the replica in a consumer's rack (a node id, mapped to the
    proxy's port for that node), and the consumer reads there, through the proxy; a
    consumer with no rack reads from the leader."""
    with KafkaCluster(3, libs=kafka_libs, extra_config={
            "replica.selector.class": "org.apache.kafka.common.replica.RackAwareReplicaSelector"},
            node_config={i: {"broker.rack": f"rack-{i}"} for i in range(3)}) as cluster, \
            ProxyThread(cluster.bootstrap) as proxy:
        topic = unique("racks")
        admin = AdminClient({"bootstrap.servers": cluster.bootstrap})
        admin.create_topics([NewTopic(topic, num_partitions=1, replica_assignment=[[0, 1, 2]])]
                            )[topic].result(30)
        conf = {"bootstrap.servers": proxy.bootstrap}
        sent = produce(conf, topic, 200)  # acks=all: every replica has them
        for rack, reader in ((None, "broker-0"), ("rack-2", "broker-2"), ("rack-1", "broker-1")):
            before = requests_by_listener(proxy, "Fetch")
            got = consume({**conf, **({"client.rack": rack} if rack else {})}, topic, len(sent))
            assert sorted(got) == sorted(sent), rack
            fetched = {listener: n - before.get(listener, 0)
                       for listener, n in requests_by_listener(proxy, "Fetch").items()
                       if n > before.get(listener, 0)}
            # The leader (broker 0) answers the first Fetch with the preferred replica.
            assert set(fetched) == ({"broker-0"} if rack is None else {"broker-0", reader}), (
                rack, fetched)


def test_transactional_producer_and_group_rebalance(kafka: KafkaCluster) -> None:
    with ProxyThread(kafka.bootstrap) as proxy:
        topic = unique("tx")
        kafka.create_topic(topic, partitions=3)
        conf = {"bootstrap.servers": proxy.bootstrap}
        producer = ck.Producer({**conf, "transactional.id": unique("txid")})
        producer.init_transactions(30)
        producer.begin_transaction()
        for i in range(30):
            producer.produce(topic, value=f"tx-{i}".encode())
        producer.commit_transaction(30)
        group = unique("g")
        consumers = [ck.Consumer({**conf, "group.id": group, "auto.offset.reset": "earliest",
                                  "isolation.level": "read_committed",
                                  "session.timeout.ms": 6000}) for _ in range(3)]
        got: list[bytes] = []
        try:
            for c in consumers:
                c.subscribe([topic])
            deadline = time.monotonic() + 60
            assigned: set[int] = set()
            while (len(got) < 30 or len(assigned) < 3) and time.monotonic() < deadline:
                for i, c in enumerate(consumers):
                    msg = c.poll(0.2)
                    if c.assignment():
                        assigned.add(i)
                    if msg is not None and msg.error() is None:
                        got.append(msg.value())
            assert len(assigned) == 3  # the group rebalanced to all three members
        finally:
            for c in consumers:
                c.close()
        assert sorted(got) == sorted(f"tx-{i}".encode() for i in range(30))


def test_kafka_python_and_aiokafka_through_proxy(kafka: KafkaCluster) -> None:
    with ProxyThread(kafka.bootstrap) as proxy:
        topic = unique("kp")
        kafka.create_topic(topic, partitions=2)
        args = {"bootstrap_servers": proxy.bootstrap}
        values = [f"kp-{i}".encode() for i in range(50)]
        kafka_python_produce(args, values, topic)
        assert sorted(kafka_python_read(args, topic, 50)) == sorted(values)

        async def with_aiokafka() -> list[bytes]:
            from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

            p = AIOKafkaProducer(bootstrap_servers=proxy.bootstrap)
            await p.start()
            try:
                for i in range(20):
                    await p.send_and_wait(topic, f"aio-{i}".encode())
            finally:
                await p.stop()
            c = AIOKafkaConsumer(topic, bootstrap_servers=proxy.bootstrap,
                                 auto_offset_reset="earliest", group_id=unique("g"))
            await c.start()
            out: list[bytes] = []
            try:
                while len(out) < 70:
                    batch = await asyncio.wait_for(c.getmany(timeout_ms=1000), 30)
                    for messages in batch.values():
                        out.extend(m.value for m in messages)
            finally:
                await c.stop()
            return out

        values = asyncio.run(with_aiokafka())
        assert {f"aio-{i}".encode() for i in range(20)} <= set(values)


def test_java_perf_tool_through_proxy(kafka: KafkaCluster) -> None:
    with ProxyThread(kafka.bootstrap) as proxy:
        topic = unique("perf")
        kafka.create_topic(topic, partitions=1)
        result = kafka.run_java_tool(
            "org.apache.kafka.tools.ProducerPerformance", "--topic", topic,
            "--num-records", "2000", "--record-size", "100", "--throughput", "-1",
            "--producer-props", f"bootstrap.servers={proxy.bootstrap}", "acks=all",
            timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        assert "2000 records sent" in result.stdout
        assert proxy.sample("gatehouse_topic_records_total", topic=topic,
                            direction="produce") == 2000


def produce_all(bootstrap: str, topic: str, values: list[bytes], linger_ms: int) -> None:
    """Every value produced (librdkafka, acks=all) and acknowledged, in order."""
    producer = ck.Producer({"bootstrap.servers": bootstrap, "acks": "all",
                            "linger.ms": linger_ms, "log_level": 3})
    for value in values:
        producer.produce(topic, value=value)
    assert producer.flush(30) == 0


def test_megabyte_fetch_answers_reach_every_client_intact(kafka: KafkaCluster) -> None:
    """3 MB in one partition: each Fetch answer is about the 1 MiB a partition may send,
    so the proxy sends it on as it arrives (see ProxyConnection._stream_response)."""

    count = 3000
    values = [f"{i:05d}-".encode() + bytes((i + j) % 251 for j in range(1024))
              for i in range(count)]
    with ProxyThread(kafka.bootstrap) as proxy:
        topic = unique("big")
        kafka.create_topic(topic, partitions=1)
        produce_all(kafka.bootstrap, topic, values, linger_ms=20)

        conf = {"bootstrap.servers": proxy.bootstrap, "fetch.wait.max.ms": 100}
        assert consume(conf, topic, count) == values  # librdkafka, in order, byte for byte
        assert kafka_python_read({"bootstrap_servers": proxy.bootstrap}, topic, count) == values

        result = kafka.run_java_tool(
            "org.apache.kafka.tools.ConsumerPerformance", "--bootstrap-server",
            proxy.bootstrap, "--topic", topic, "--messages", str(count), "--timeout", "30000",
            timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        rows = [ln for ln in result.stdout.splitlines() if ln[:1].isdigit()]
        assert rows and int(rows[-1].split(",")[4]) >= count  # the Java consumer: data.consumed.in.nMsg

        # The metrics saw every streamed answer whole: each consumer's records counted.
        assert proxy.sample("gatehouse_topic_records_total", topic=topic,
                            direction="fetch") >= 3 * count


def test_large_produce_requests_go_up_as_they_arrive_and_land_intact(
        kafka: KafkaCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """Records of 300 KiB make Produce requests bigger than one of the proxy's reads, so
    it sends each up as its bytes arrive (ProxyConnection._stream_request), their
    records socket to socket; the broker stores every record byte for byte and the
    metrics still count them all, from the batch headers read on the way."""
    from kafka import KafkaProducer

    from gatehouse.proxy.connection import ProxyConnection

    streamed: list[int] = []
    original = ProxyConnection._stream_request

    async def spy(self: ProxyConnection, reader: Any, size: int) -> Any:
        out = await original(self, reader, size)
        if out is not None:
            streamed.append(size)
        return out

    monkeypatch.setattr(ProxyConnection, "_stream_request", spy)
    count = 12
    values = [f"{i:03d}-".encode() + bytes((i * 7 + j) % 253 for j in range(300 * 1024))
              for i in range(count)]
    with ProxyThread(kafka.bootstrap) as proxy:
        topic = unique("bigp")
        kafka.create_topic(topic, partitions=1)
        producer = ck.Producer({"bootstrap.servers": proxy.bootstrap, "acks": "all",
                                "linger.ms": 20, "log_level": 3})
        for value in values[: count // 2]:
            producer.produce(topic, value=value)
        assert producer.flush(30) == 0  # librdkafka
        java_style = KafkaProducer(bootstrap_servers=proxy.bootstrap, acks="all",
                                   max_request_size=2 << 20)
        for value in values[count // 2:]:
            java_style.send(topic, value)
        java_style.flush(30)
        java_style.close()  # kafka-python
        assert proxy.sample("gatehouse_topic_records_total", topic=topic,
                            direction="produce") == count
        # Counted from their batch headers on the way: the records went socket to socket.
        pipes = proxy.proxy.ctx.pipes
        assert pipes is not None and pipes.spliced >= count * 300 * 1024 // 2
    assert streamed and min(streamed) > 256 * 1024
    assert consume({"bootstrap.servers": kafka.bootstrap}, topic, count) == values


@pytest.mark.parametrize("metrics", [False, True], ids=["plain", "metered"])
def test_large_frames_are_spliced_and_every_record_arrives_intact(
        kafka: KafkaCluster, metrics: bool) -> None:
    """Large Produce requests and Fetch answers go socket to socket through pipes
    (splice(2)): the pool counts the bytes it moved, and every record still lands and
    comes back byte for byte for librdkafka and kafka-python.  With the metrics on, the
    batch headers are read on the way: every record and byte is counted, per topic, in
    both directions."""

    count = 2000
    values = [f"{i:05d}-".encode() + bytes((i * 3 + j) % 241 for j in range(1024))
              for i in range(count)]
    with ProxyThread(kafka.bootstrap, metrics=metrics) as proxy:
        pipes = proxy.proxy.ctx.pipes
        assert pipes is not None and pipes.spliced == 0
        topic = unique("spliced")
        kafka.create_topic(topic, partitions=1)
        # A long linger: requests of hundreds of KiB, past the size that is streamed.
        produce_all(proxy.bootstrap, topic, values, linger_ms=200)
        after_produce = pipes.spliced
        assert after_produce > 0  # request bodies went up through a pipe

        assert consume({"bootstrap.servers": proxy.bootstrap}, topic, count) == values
        after_librdkafka = pipes.spliced
        assert after_librdkafka - after_produce >= count * 1024 // 2  # answers' records
        if metrics:
            produced = proxy.sample("gatehouse_topic_bytes_total", topic=topic,
                                    direction="produce")
            assert proxy.sample("gatehouse_topic_records_total", topic=topic,
                                direction="produce") == count
            assert proxy.sample("gatehouse_topic_records_total", topic=topic,
                                direction="fetch") == count
            # The same batches the broker stored, each counted once, whole.
            assert proxy.sample("gatehouse_topic_bytes_total", topic=topic,
                                direction="fetch") == produced > count * 1024

        assert kafka_python_read({"bootstrap_servers": proxy.bootstrap}, topic, count) == values
        assert pipes.spliced - after_librdkafka >= count * 1024 // 2
        if metrics:  # kafka-python fetches some offsets again: what crossed is counted
            assert proxy.sample("gatehouse_topic_records_total", topic=topic,
                                direction="fetch") >= 2 * count
            assert proxy.sample("gatehouse_responses_total", api="Fetch", error="NONE") > 0
    # What went up through the proxy is what the broker stored, read directly.
    assert consume({"bootstrap.servers": kafka.bootstrap}, topic, count) == values


@pytest.mark.parametrize("metrics", [False, True], ids=["plain", "metered"])
def test_large_requests_under_a_tenant_prefix_go_up_renamed_as_they_arrive(
        kafka: KafkaCluster, metrics: bool) -> None:
    """A tenant prefix renames the one topic of librdkafka's large Produce requests in
    their first bytes; the rest goes up as it arrives, socket to socket (with the
    metrics on, their batch headers read on the way).  Every record lands under the
    broker's name, comes back under the client's, and the metrics count it under the
    client's."""

    count = 1500
    values = [f"{i:05d}-".encode() + bytes((i * 7 + j) % 239 for j in range(1024))
              for i in range(count)]
    rules = "- name: tenant-a\n  topic_prefix: {broker: 'tenant-a.'}\n"
    topic = unique("orders")
    kafka.create_topic(f"tenant-a.{topic}", partitions=1)
    with ProxyThread(kafka.bootstrap, rules_yaml=rules, metrics=metrics) as proxy:
        produce_all(proxy.bootstrap, topic, values, linger_ms=200)  # 100s of KiB each
        pipes = proxy.proxy.ctx.pipes
        assert pipes is not None
        assert pipes.spliced >= count * 1024 // 2  # the records went up through a pipe
        if metrics:
            assert proxy.sample("gatehouse_topic_records_total", topic=topic,
                                direction="produce") == count
            assert proxy.sample("gatehouse_rule_decisions_total", rule="tenant-a",
                                action="rename") >= 1
        assert consume({"bootstrap.servers": proxy.bootstrap}, topic, count) == values
    assert consume({"bootstrap.servers": kafka.bootstrap}, f"tenant-a.{topic}", count) == values


def test_sasl_scram_passes_through(kafka_scram: KafkaCluster) -> None:
    with ProxyThread(kafka_scram.sasl_bootstrap) as proxy:
        topic = unique("sasl")
        kafka_scram.create_topic(topic)
        conf = {"bootstrap.servers": proxy.bootstrap, "security.protocol": "SASL_PLAINTEXT",
                "sasl.mechanism": SCRAM_MECHANISM, "sasl.username": SCRAM_USER,
                "sasl.password": SCRAM_PASSWORD}
        sent = produce(conf, topic, count=20)
        assert sorted(consume(conf, topic, 20)) == sorted(sent)


def test_tansu_through_proxy(tansu: TansuBroker) -> None:
    with ProxyThread(tansu.bootstrap) as proxy:
        topic = unique("tansu")
        conf = {"bootstrap.servers": proxy.bootstrap}
        admin = AdminClient(conf)  # kept alive until the result is in
        admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)
        sent = produce(conf, topic, count=100)
        assert sorted(consume(conf, topic, 100)) == sorted(sent)


def test_unreachable_upstream_closes_client_promptly() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]  # bound, never listening: connection refused
        with ProxyThread(f"127.0.0.1:{dead_port}") as proxy:
            client = socket.create_connection(("127.0.0.1", proxy.proxy.bootstrap_ports[0]))
            client.settimeout(10)
            assert client.recv(10) == b""  # closed without a byte
            client.close()
            assert proxy.sample("gatehouse_upstream_failures_total",
                                broker=f"127.0.0.1:{dead_port}") >= 1


def test_garbage_and_huge_frames_close_only_that_connection(kafka: KafkaCluster) -> None:
    with ProxyThread(kafka.bootstrap) as proxy:
        port = proxy.proxy.bootstrap_ports[0]
        good = socket.create_connection(("127.0.0.1", port))
        bad = socket.create_connection(("127.0.0.1", port))
        huge = socket.create_connection(("127.0.0.1", port))
        for s in (good, bad, huge):
            s.settimeout(20)
        bad.sendall(struct.pack(">i", 6) + b"\xff" * 6)
        huge.sendall(struct.pack(">i", 2**31 - 1))
        assert bad.recv(10) == b""
        assert huge.recv(10) == b""
        req = codecs.Request.build(3, 12, 5, "good", codecs.api(3).request.root.cls(topics=()))
        frame = bytes(req.encode())
        good.sendall(struct.pack(">i", len(frame)) + frame)
        size = struct.unpack(">i", recv_exact(good, 4))[0]
        resp = codecs.decode_response(recv_exact(good, size), 3, 12)
        assert resp.correlation_id == 5 and resp.body.brokers
        for s in (good, bad, huge):
            s.close()
        assert proxy.sample("gatehouse_malformed_frames_total", direction="request") == 2


def test_broker_stopped_mid_stream_clients_recover(kafka_cluster: KafkaCluster) -> None:
    with ProxyThread(kafka_cluster.bootstrap) as proxy:
        topic = unique("failover")
        kafka_cluster.create_topic(topic, partitions=3, replication=3)
        conf = {"bootstrap.servers": proxy.bootstrap}
        produce(conf, topic, count=30, tag="before")
        victim = 2
        kafka_cluster.stop_node(victim)
        try:
            # Leaders move; the client learns of it through the proxy and carries on.
            produce({**conf, "message.timeout.ms": 60000}, topic, count=30, tag="during")
        finally:
            kafka_cluster.start_node(victim)
        produce(conf, topic, count=30, tag="after")
        got = consume(conf, topic, 90, timeout=60)
        assert len(got) == 90


NOT_LEADER_OR_FOLLOWER = 6


def leaders_seen(cluster: KafkaCluster, topic: str) -> set[int]:
    """The leader of ``topic``'s partition 0 as each broker's own metadata has it."""
    seen = set()
    for node in cluster.nodes:
        body = call(f"127.0.0.1:{node.port}", 3, 12, {
            "topics": [{"name": topic}], "allow_auto_topic_creation": False,
            "include_topic_authorized_operations": False})
        [described] = body.topics
        seen.add(described.partitions[0].leader_id if described.partitions else -1)
    return seen


def test_a_moved_leader_is_named_at_the_proxy_in_kip951_answers(
        kafka_cluster: KafkaCluster) -> None:
    """KIP-951: a broker that does not lead a partition answers Produce (v10+) and Fetch
    (v16+) with the leader and its address (NodeEndpoints), which clients connect to
    without asking for Metadata.  The leader is moved on a live cluster (the replicas
    reordered, a preferred election); the old leader's Produce answer and a non-replica's
    Fetch answer through the proxy name the proxy's port for the new leader, and
    librdkafka, producing across the move, never learns a real broker address."""
    topic = unique("moved")
    direct = AdminClient({"bootstrap.servers": kafka_cluster.bootstrap})
    any_broker = f"127.0.0.1:{kafka_cluster.nodes[0].port}"
    old, new, third = (n.node_id for n in kafka_cluster.nodes)
    [created] = direct.create_topics(
        [NewTopic(topic, num_partitions=1, replica_assignment=[[old, new]])]).values()
    created.result(30)
    deadline = time.monotonic() + 30
    while leaders_seen(kafka_cluster, topic) != {old}:
        assert time.monotonic() < deadline, "the topic has no leader"
        time.sleep(0.1)
    with ProxyThread(kafka_cluster.bootstrap) as proxy:
        stats: list[dict[str, Any]] = []
        conf = {"bootstrap.servers": proxy.bootstrap, "statistics.interval.ms": 100,
                "stats_cb": lambda s: stats.append(json.loads(s))}
        producer = ck.Producer({**conf, "acks": "all", "linger.ms": 5, "log_level": 0})
        failed: list[Any] = []

        def send(tag: str) -> None:
            for i in range(20):
                producer.produce(topic, f"{tag}-{i}".encode(),
                                 on_delivery=lambda err, _m: err and failed.append(err))
            assert producer.flush(60) == 0

        send("before")
        # The new leader first among the replicas, then a preferred election.
        moved = call(any_broker, 45, 0, {"timeout_ms": 30000, "topics": [
            {"name": topic, "partitions": [{"partition_index": 0,
                                            "replicas": [new, old]}]}]})
        assert moved.error_code == 0, moved
        elected = call(any_broker, 43, 2, {"election_type": 0, "timeout_ms": 30000,
                                                        "topic_partitions": [
                                                            {"topic": topic, "partitions": [0]}]})
        assert elected.error_code == 0, elected
        while leaders_seen(kafka_cluster, topic) != {new}:  # every broker knows
            assert time.monotonic() < deadline + 30, "the leader did not move"
            time.sleep(0.1)

        # The old leader, asked through the proxy's port for it.
        at_old = f"127.0.0.1:{proxy.proxy.brokers[old].port}"
        new_port = proxy.proxy.brokers[new].port
        batch = encode_batch([(0, None, b"to-the-old-leader")])
        produced = call(at_old, 0, 12, {"acks": -1, "timeout_ms": 10000, "topic_data": [
            {"name": topic, "partition_data": [{"index": 0, "records": batch}]}]})
        [[partition]] = [t.partition_responses for t in produced.responses]
        assert partition.error_code == NOT_LEADER_OR_FOLLOWER
        assert partition.current_leader.leader_id == new
        assert [(e.node_id, e.host, e.port) for e in produced.node_endpoints] == [
            (new, "127.0.0.1", new_port)]
        topic_id = topic_ids(any_broker, topic)[topic]
        # A Fetch is answered by a follower too (KIP-392): asked of a broker that holds
        # no replica of it.
        at_third = f"127.0.0.1:{proxy.proxy.brokers[third].port}"
        fetched = call(at_third, 1, 17, {
            "max_wait_ms": 0, "min_bytes": 1, "max_bytes": 1 << 20, "session_epoch": -1,
            "topics": [{"topic_id": topic_id, "partitions": [
                {"partition": 0, "fetch_offset": 0, "partition_max_bytes": 1 << 20}]}]})
        [[fetch_partition]] = [t.partitions for t in fetched.responses]
        assert fetch_partition.error_code == NOT_LEADER_OR_FOLLOWER
        assert fetch_partition.current_leader.leader_id == new
        assert [(e.node_id, e.host, e.port) for e in fetched.node_endpoints] == [
            (new, "127.0.0.1", new_port)]

        # librdkafka across the move: every record delivered, only the proxy's ports known.
        send("after")
        assert failed == []
        producer.poll(0.5)  # serves stats_cb
        seen = stats_broker_ports(stats)
        assert seen and seen <= proxy.broker_ports
        assert not seen & {n.port for n in kafka_cluster.nodes}
    got = consume({"bootstrap.servers": kafka_cluster.bootstrap}, topic, 40)
    assert sorted(got) == sorted([f"before-{i}".encode() for i in range(20)]
                                 + [f"after-{i}".encode() for i in range(20)])


def test_min_api_version_refuses_old_kafka_python_but_not_librdkafka(kafka: KafkaCluster) -> None:
    from kafka.errors import KafkaError

    rules = "- name: modern-metadata\n  min_api_version: {Metadata: 4}\n"
    with ProxyThread(kafka.bootstrap, rules_yaml=rules) as proxy:
        topic = unique("rules")
        kafka.create_topic(topic)
        refused = kafka_python_send_one(proxy.bootstrap, (0, 10, 1), topic)
        assert isinstance(refused, KafkaError)
        assert proxy.sample("gatehouse_rule_decisions_total", rule="modern-metadata",
                            action="refuse") >= 1
        assert proxy.sample("gatehouse_responses_total", api="Metadata",
                            error="UNSUPPORTED_VERSION") >= 1
        sent = produce({"bootstrap.servers": proxy.bootstrap}, topic, count=10)
        assert len(sent) == 10


def test_rename_topic_group_commits_under_broker_name(kafka: KafkaCluster) -> None:
    broker_name = unique("prod.orders")
    rules = f"- name: orders-alias\n  rename_topics: {{orders: {broker_name}}}\n"
    with ProxyThread(kafka.bootstrap, rules_yaml=rules) as proxy:
        kafka.create_topic(broker_name, partitions=2)
        conf = {"bootstrap.servers": proxy.bootstrap}
        sent = produce(conf, "orders", count=40)
        group = unique("g")
        consumers = [ck.Consumer({**conf, "group.id": group, "auto.offset.reset": "earliest",
                                  "session.timeout.ms": 6000, "enable.auto.commit": False})
                     for _ in range(2)]
        got: list[bytes] = []
        try:
            for c in consumers:
                c.subscribe(["orders"])
            deadline = time.monotonic() + 60
            while len(got) < 40 and time.monotonic() < deadline:
                for c in consumers:
                    msg = c.poll(0.2)
                    if msg is not None and msg.error() is None:
                        assert msg.topic() == "orders"
                        got.append(msg.value())
                        c.commit(msg, asynchronous=False)
        finally:
            for c in consumers:
                c.close()
        assert sorted(got) == sorted(sent)
        # Straight to the broker: the data and the offsets live under the broker-side name.
        direct = AdminClient({"bootstrap.servers": kafka.bootstrap})
        assert "orders" not in direct.list_topics(timeout=10).topics
        offsets = direct.list_consumer_group_offsets(
            [ck.ConsumerGroupTopicPartitions(group)])[group].result(30)
        assert {tp.topic for tp in offsets.topic_partitions} == {broker_name}
        assert sum(tp.offset for tp in offsets.topic_partitions) == 40


def test_tenant_prefix_hides_other_tenants(kafka: KafkaCluster) -> None:
    mine, theirs = unique("tenant-a.orders"), unique("tenant-b.secrets")
    kafka.create_topic(mine)
    kafka.create_topic(theirs)
    rules = ("- name: tenant-a\n  match: {client_id: '^tenant-a-'}\n"
             "  topic_prefix: {broker: 'tenant-a.', hide_others: true}\n")
    with ProxyThread(kafka.bootstrap, rules_yaml=rules) as proxy:
        conf = {"bootstrap.servers": proxy.bootstrap, "client.id": "tenant-a-app"}
        topics = AdminClient(conf).list_topics(timeout=10).topics
        assert mine.removeprefix("tenant-a.") in topics
        assert theirs not in topics and not any(t.startswith("tenant-") for t in topics)
        other = AdminClient({"bootstrap.servers": proxy.bootstrap, "client.id": "ops"})
        assert theirs in other.list_topics(timeout=10).topics  # the rule matched by client id


def test_observe_mode_changes_no_bytes(kafka: KafkaCluster) -> None:
    rules = ("- name: watch\n  mode: observe\n  min_api_version: {Metadata: 13, Produce: 13}\n"
             "- name: watch-rename\n  mode: observe\n  rename_topics: {a: b}\n")
    with ProxyThread(kafka.bootstrap, rules_yaml=rules) as proxy:
        topic = unique("obs")
        kafka.create_topic(topic)
        conf = {"bootstrap.servers": proxy.bootstrap}
        sent = produce(conf, topic, count=10)
        assert sorted(consume(conf, topic, 10)) == sorted(sent)
        assert proxy.sample("gatehouse_rule_decisions_total", rule="watch",
                            action="would_refuse") >= 1
        assert proxy.sample("gatehouse_rule_decisions_total", rule="watch",
                            action="refuse") == 0


def test_tls_on_both_sides(kafka: KafkaCluster, tls_files: dict[str, str]) -> None:
    # client --TLS--> edge proxy --TLS--> inner proxy (TLS listener) --> Kafka
    inner_cfg = f"tls:\n  downstream: {{cert: {tls_files['cert']}, key: {tls_files['key']}}}\n"
    with ProxyThread(kafka.bootstrap, extra_config=inner_cfg) as inner:
        edge_cfg = (f"tls:\n  downstream: {{cert: {tls_files['cert']}, key: {tls_files['key']}}}"
                    f"\n  upstream: {{ca: {tls_files['ca']}, server_hostname: localhost}}\n")
        with ProxyThread(inner.bootstrap, extra_config=edge_cfg) as edge:
            topic = unique("tls")
            kafka.create_topic(topic)
            conf = {"bootstrap.servers": edge.bootstrap, "security.protocol": "SSL",
                    "ssl.ca.location": tls_files["ca"]}
            sent = produce(conf, topic, count=20)
            assert sorted(consume(conf, topic, 20)) == sorted(sent)
            plain = socket.create_connection(("127.0.0.1", edge.proxy.bootstrap_ports[0]))
            plain.settimeout(10)
            plain.sendall(struct.pack(">i", 10) + b"0123456789")  # not a TLS handshake
            assert plain.recv(10) == b""
            plain.close()


class CloseReasons(Observer):
    """Why each connection closed, as the proxy says (not read from the log, which
    another test's logging set-up may route elsewhere)."""

    def __init__(self) -> None:
        self.reasons: list[str] = []

    def connection_closed(self, conn: ConnectionInfo, reason: str) -> None:
        self.reasons.append(reason)


def test_connections_past_their_age_reconnect_and_nothing_is_lost(
        kafka: KafkaCluster) -> None:
    """``limits.max_connection_age``: an idempotent librdkafka producer and a consumer
    whose connections are closed every ~1 s carry on; every record arrives once."""
    topic = unique("aged")
    kafka.create_topic(topic, partitions=2)
    closes = CloseReasons()
    with ProxyThread(kafka.bootstrap, extra_config="limits: {max_connection_age: 1}\n",
                     observers=[closes]) as proxy:
        conf = {"bootstrap.servers": proxy.bootstrap, "log_level": 0}
        producer = ck.Producer({**conf, "enable.idempotence": True, "linger.ms": 5})
        failed: list[Any] = []
        sent: list[bytes] = []

        def aged_out() -> int:
            return closes.reasons.count(AGE_LIMIT)

        # Records every 20 ms until the producer's connections have been aged out three
        # times (librdkafka's reconnect backoff decides how soon it comes back).
        deadline = time.monotonic() + 60
        while (aged_out() < 3 or len(sent) < 300) and time.monotonic() < deadline:
            value = f"aged-{len(sent)}".encode()
            producer.produce(topic, value, on_delivery=lambda err, _: err and failed.append(err))
            sent.append(value)
            producer.poll(0)
            time.sleep(0.02)
        assert producer.flush(30) == 0 and not failed
        assert aged_out() >= 3, (
            f"the producer's connections were not aged out: closed {closes.reasons}, "
            f"opened {proxy.sample('gatehouse_connections_total', side='client', outcome='opened')}"
            f", {len(sent)} records")
        assert sorted(consume(conf, topic, len(sent), timeout=60)) == sorted(sent)
    assert sum(watermarks(kafka.bootstrap, topic, p)[1] for p in (0, 1)) == len(sent)


class _BuggyPolicy(Policy):
    """A policy with a bug that a client named ``trips-the-bug`` finds."""

    def on_request(self, conn: ConnectionInfo, req: codecs.Request) -> Any:
        if req.header.client_id == "trips-the-bug":
            raise KeyError("a bug in a policy")
        return super().on_request(conn, req)


def test_an_internal_error_ends_only_its_own_connection(
        kafka: KafkaCluster, caplog: pytest.LogCaptureFixture) -> None:
    """A bug met while serving one connection (here a policy's) closes that connection,
    logged at ERROR with its traceback and the client; every other connection, open or
    new, is served on."""
    topic = unique("contained")
    kafka.create_topic(topic)
    proxy = ProxyThread(kafka.bootstrap, policy=_BuggyPolicy()).start()
    try:
        conf = {"bootstrap.servers": proxy.bootstrap}
        steady = ck.Producer({**conf, "acks": "all", "linger.ms": 0})
        steady.produce(topic, b"before")
        assert steady.flush(30) == 0
        port = proxy.proxy.bootstrap_ports[0]
        buggy = socket.create_connection(("127.0.0.1", port), timeout=20)
        req = codecs.Request.build(3, 12, 9, "trips-the-bug",
                                   codecs.api(3).request.root.cls(topics=()))
        frame = bytes(req.encode())
        buggy.sendall(struct.pack(">i", len(frame)) + frame)
        assert buggy.recv(10) == b""  # closed, unanswered
        buggy.close()
        steady.produce(topic, b"after")  # the open connection goes on
        assert steady.flush(30) == 0
        assert produce(conf, topic, count=5)  # and new ones are served
        assert proxy.sample("gatehouse_internal_errors_total") == 1
    finally:
        with pytest.raises(RuntimeError, match="internal error"):  # the tests still fail on it
            proxy.stop()
    [record] = [r for r in caplog.records if r.getMessage().startswith("internal error")]
    assert record.levelname == "ERROR" and record.exc_info is not None
    assert record.gatehouse_fields["client_id"] == "trips-the-bug"  # type: ignore[attr-defined]
    [closed] = [r.gatehouse_fields for r in caplog.records  # type: ignore[attr-defined]
                if r.getMessage() == "connection closed"
                and r.gatehouse_fields.get("client_id") == "trips-the-bug"]
    assert closed["reason"] == "internal error: KeyError('a bug in a policy')"
    assert watermarks(kafka.bootstrap, topic) == (0, 2 + 5)
