"""Topics a client may use (``allow_topics`` / ``deny_topics``), on a real Apache Kafka
broker with real clients: the others are not listed, cannot be written, read, deleted
or fetched by id, and the clients go on with the topics they may use."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import confluent_kafka as ck
import pytest
from confluent_kafka.admin import AdminClient

from tests.integration.test_metrics_groups import wait_until
from tests.integration.test_rules_topic_ids import call, fetch_error, topic_ids
from tests.support.clients import consume, produce, unique, watermarks
from tests.support.kafka import KafkaCluster
from tests.support.proxythread import ProxyThread

TOPIC_AUTHORIZATION_FAILED, UNKNOWN_TOPIC_ID = 29, 100
RULES = ("- name: orders-only\n  match: {client_id: '^app'}\n"
         "  allow_topics: ['orders-.*']\n")


def test_a_client_sees_and_uses_only_the_topics_it_may(kafka: KafkaCluster) -> None:
    from kafka import KafkaConsumer

    orders, payroll = unique("orders"), unique("payroll")
    for topic in (orders, payroll):
        kafka.create_topic(topic)
    ids = topic_ids(kafka.bootstrap, orders, payroll)
    with ProxyThread(kafka.bootstrap, rules_yaml=RULES) as proxy:
        conf = {"bootstrap.servers": proxy.bootstrap, "client.id": "app-1"}
        admin = AdminClient(conf)
        listed = admin.list_topics(timeout=10).topics
        assert orders in listed and payroll not in listed
        sent = produce(conf, orders, count=10)
        assert sorted(consume(conf, orders, 10)) == sorted(sent)

        # librdkafka cannot find the topic: the message fails, nothing reaches the broker.
        producer = ck.Producer({**conf, "topic.metadata.propagation.max.ms": 1000,
                                "message.timeout.ms": 5000, "log_level": 0})
        failed: list[ck.KafkaError] = []
        producer.produce(payroll, b"x", on_delivery=lambda err, _: failed.append(err))
        producer.flush(20)
        assert len(failed) == 1 and failed[0] is not None
        assert failed[0].code() in (ck.KafkaError.UNKNOWN_TOPIC_OR_PART,
                                    ck.KafkaError._UNKNOWN_TOPIC,
                                    ck.KafkaError._MSG_TIMED_OUT)  # while unknown

        # A client that learned the name elsewhere and names it is refused as a broker's
        # ACLs refuse it: Produce by name, DeleteTopics, Fetch by id.
        answer = call(proxy.bootstrap, 0, 9, {"acks": -1, "timeout_ms": 1000, "topic_data": [
            {"name": payroll, "partition_data": [{"index": 0, "records": None}]}]},
            client_id="app-raw")
        assert [p.error_code for t in answer.responses for p in t.partition_responses] == [
            TOPIC_AUTHORIZATION_FAILED]
        with pytest.raises(ck.KafkaException) as deleted:
            admin.delete_topics([payroll], operation_timeout=10)[payroll].result(20)
        assert deleted.value.args[0].code() == ck.KafkaError.TOPIC_AUTHORIZATION_FAILED
        proxied_ids = topic_ids(proxy.bootstrap, orders, client_id="app-ids")
        assert proxied_ids == {orders: ids[orders]}  # and the proxy learned the ids
        assert fetch_error(proxy.bootstrap, ids[payroll], "app-raw") == (0, UNKNOWN_TOPIC_ID)
        assert fetch_error(proxy.bootstrap, ids[orders], "app-raw") == (0, 0)

        # kafka-python subscribed to both reads the one it may and carries on.
        reader = KafkaConsumer(bootstrap_servers=proxy.bootstrap, client_id="app-kp",
                               group_id=unique("g"), auto_offset_reset="earliest",
                               consumer_timeout_ms=10_000)
        reader.subscribe([orders, payroll])
        got = [record.value for _, record in zip(range(10), reader, strict=False)]
        reader.close()
        assert sorted(got) == sorted(sent)

        assert proxy.sample("gatehouse_rule_decisions_total", rule="orders-only",
                            action="refuse") >= 2
        # Another client (not matched) sees both topics.
        ops = AdminClient({"bootstrap.servers": proxy.bootstrap, "client.id": "ops"})
        assert {orders, payroll} <= set(ops.list_topics(timeout=10).topics)
    assert watermarks(kafka.bootstrap, orders) == (0, 10)
    assert watermarks(kafka.bootstrap, payroll) == (0, 0)
    assert payroll in AdminClient({"bootstrap.servers": kafka.bootstrap}).list_topics(
        timeout=10).topics  # not deleted


def test_a_filtered_client_cannot_create_a_topic_by_asking_for_it(
        kafka: KafkaCluster) -> None:
    """The broker creates the topics a Metadata request asks for
    (auto.create.topics.enable, Kafka's default, as here): a filtered client asking for
    a name it may not use creates nothing, by a raw request or by librdkafka producing
    to it; an allowed name is still created on request."""
    denied, allowed = unique("payroll"), unique("orders-new")
    none = "00000000-0000-0000-0000-000000000000"
    body = {"topics": [{"name": denied, "topic_id": none}, {"name": allowed,
                                                           "topic_id": none}],
            "allow_auto_topic_creation": True,
            "include_topic_authorized_operations": False}
    with ProxyThread(kafka.bootstrap, rules_yaml=RULES) as proxy:
        answer = call(proxy.bootstrap, 3, 12, body, client_id="app-raw")
        producer = ck.Producer({"bootstrap.servers": proxy.bootstrap, "client.id": "app-1",
                                "message.timeout.ms": 3000, "log_level": 0})
        failed: list[Any] = []
        producer.produce(f"{denied}-2", b"x", on_delivery=lambda err, _: failed.append(err))
        producer.flush(20)
    assert [t.name for t in answer.topics] == [allowed]
    assert len(failed) == 1 and failed[0] is not None
    direct = AdminClient({"bootstrap.servers": kafka.bootstrap})
    assert wait_until(lambda: allowed in direct.list_topics(timeout=10).topics)
    assert not {denied, f"{denied}-2"} & set(direct.list_topics(timeout=10).topics)


class Member(threading.Thread):
    """A group member (a kafka-python consumer) polled in a thread of its own until
    ``finish``: ``held`` is its assignment after its last poll, ``got`` what it read."""

    def __init__(self, consumer: Any) -> None:
        super().__init__(daemon=True)
        self.consumer = consumer
        self.held: frozenset[Any] = frozenset()
        self.got: list[tuple[str, bytes]] = []
        self.error: BaseException | None = None
        self._finishing = threading.Event()
        self.start()

    def run(self) -> None:
        try:
            while not self._finishing.is_set():
                for tp, records in self.consumer.poll(timeout_ms=200).items():
                    self.got.extend((tp.topic, r.value) for r in records)
                self.held = frozenset(self.consumer.assignment())
        except Exception as exc:  # reported by the test
            self.error = exc
        finally:
            self.consumer.close()

    def finish(self) -> None:
        self._finishing.set()
        self.join(30)


def test_in_a_group_of_differently_filtered_members_every_partition_is_read(
        kafka: KafkaCluster) -> None:
    """A member that may use only some of the group's topics subscribes only to those
    (the proxy leaves the others out of its JoinGroup), so a leader that may use them
    all assigns their partitions to members that read them."""
    from kafka import KafkaConsumer, TopicPartition

    orders, payroll = unique("orders"), unique("payroll")
    for topic in (orders, payroll):
        kafka.create_topic(topic, partitions=2)
    group = unique("g")
    with ProxyThread(kafka.bootstrap, rules_yaml=RULES) as proxy:
        def member(client_id: str) -> KafkaConsumer:
            consumer = KafkaConsumer(bootstrap_servers=proxy.bootstrap, client_id=client_id,
                                     group_id=group, auto_offset_reset="earliest",
                                     enable_auto_commit=False)
            consumer.subscribe([orders, payroll])
            return consumer

        # The unfiltered member joins first and leads; the range assignor then gives the
        # filtered one ("app-..." sorts first) the first partition of each topic it
        # subscribes to.  Each member polls in a thread of its own: polled one after the
        # other in one thread, a member whose JoinGroup the coordinator holds until the
        # other rejoins held up the other's poll (seen twice under load: the leader kept
        # its old assignment past 90 s).
        with contextlib.ExitStack() as members:
            ops = Member(member("ops-1"))
            members.callback(ops.finish)
            # Alone, it holds all four partitions before the other joins: kafka-python's
            # first assignment can miss topics its metadata has not listed yet, and the
            # rebalance that mends it must not overlap the one the second member starts.
            assert wait_until(lambda: len(ops.held) == 4, 60), f"ops alone holds {ops.held}"
            app = Member(member("app-1"))
            members.callback(app.finish)  # finished first, also after a failed assertion

            def settled() -> bool:
                """Both members hold partitions, and none twice: the rebalance is over."""
                mine, theirs = app.held, ops.held
                return bool(mine and theirs) and not mine & theirs and len(mine | theirs) >= 3

            wait_until(settled, 90)
            seen = f"app holds {set(app.held)}, ops holds {set(ops.held)}"
            assert app.held == {TopicPartition(orders, 0)}, seen
            assert ops.held == {TopicPartition(orders, 1), TopicPartition(payroll, 0),
                                TopicPartition(payroll, 1)}, seen

            producer = ck.Producer({"bootstrap.servers": kafka.bootstrap})
            for topic in (orders, payroll):
                for i in range(10):
                    producer.produce(topic, f"{topic}-{i}".encode(), partition=i % 2)
            assert producer.flush(20) == 0
            wait_until(lambda: len(ops.got) + len(app.got) >= 20, 60)
    got = {"ops": ops.got, "app": app.got}
    assert ops.error is None and app.error is None, (ops.error, app.error)
    assert sorted(v for t, v in got["ops"] if t == payroll) == sorted(
        f"{payroll}-{i}".encode() for i in range(10))
    assert {t for t, _ in got["app"]} == {orders}
    assert len(got["ops"]) + len(got["app"]) == 20
