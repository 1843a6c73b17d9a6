"""The group census and the KIP-559 fallback counter, with real consumers on Kafka 4.4:
librdkafka (classic and KIP-848 groups), the Java consumer, a Java share consumer (KIP-932)
and a Kafka Streams application on the streams protocol (KIP-1071)."""

from __future__ import annotations

import queue
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import confluent_kafka as ck

from gatehouse.codecs import Request
from gatehouse.proxy.hooks import ConnectionInfo, Observer, Pending, decoded_response
from scripts.fetch_kafka import ensure_kafka_streams
from tests.support.clients import produce, unique
from tests.support.kafka import (
    JAVA_SOURCES,
    KafkaCluster,
    java_command,
    register_process,
    stop_process,
)
from tests.support.proxythread import ProxyThread


def wait_until(condition: Callable[[], bool], timeout: float = 20.0) -> bool:
    """Poll ``condition`` (the proxy thread updates metrics after it answers the client)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def first_message(consumer: ck.Consumer, timeout: float = 60.0) -> Any:
    """Poll until a message arrives: the consumer has joined and been assigned."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = consumer.poll(0.5)
        if msg is not None and msg.error() is None:
            return msg
    raise AssertionError("no message within the timeout")


def test_census_counts_classic_and_kip848_groups_while_members_live(
        kafka: KafkaCluster) -> None:
    with ProxyThread(kafka.bootstrap) as proxy:
        topic = unique("groups")
        kafka.create_topic(topic, partitions=2)
        conf = {"bootstrap.servers": proxy.bootstrap}
        produce(conf, topic, count=10)

        def groups(protocol_type: str, protocol: str) -> float:
            return proxy.sample("gatehouse_consumer_groups", protocol_type=protocol_type,
                                protocol=protocol)

        base = {**conf, "auto.offset.reset": "earliest", "log_level": 3}
        classic = [ck.Consumer({**base, "group.id": unique("classic"), "group.protocol":
                                "classic", "partition.assignment.strategy": "roundrobin",
                                "session.timeout.ms": 6000}) for _ in range(2)]
        modern = ck.Consumer({**base, "group.id": unique("kip848"),
                              "group.protocol": "consumer", "group.remote.assignor": "range"})
        try:
            for consumer in [*classic, modern]:
                consumer.subscribe([topic])
                first_message(consumer)
            # Two classic groups chose roundrobin; one KIP-848 group asked for range.
            assert wait_until(lambda: groups("consumer", "roundrobin") == 2)
            assert wait_until(lambda: groups("consumer", "range") == 1)
            classic[0].close()
            assert wait_until(lambda: groups("consumer", "roundrobin") == 1)
            modern.close()
            assert wait_until(lambda: groups("consumer", "range") == 0)
            assert groups("consumer", "roundrobin") == 1
        finally:
            for consumer in [*classic[1:]]:
                consumer.close()
        assert wait_until(lambda: groups("consumer", "roundrobin") == 0)
        # librdkafka's classic protocol uses JoinGroup v5 / SyncGroup v3 (before KIP-559).
        # Each group's one member is its leader: one JoinGroup response with member
        # metadata, one SyncGroup request with assignments and one SyncGroup response with
        # an assignment per group, each resolved from the JoinGroup on its connection.
        for api, direction in (("JoinGroup", "response"), ("SyncGroup", "request"),
                               ("SyncGroup", "response")):
            assert proxy.sample("gatehouse_group_protocol_fallbacks_total", api=api,
                                direction=direction, outcome="resolved") == 2, (api, direction)
        assert proxy.summed("gatehouse_group_protocol_fallbacks_total",
                           outcome="unresolved") == 0


def test_java_classic_consumer_needs_no_fallback(kafka: KafkaCluster) -> None:
    """Kafka 4.4's Java consumer joins with JoinGroup v7+ and SyncGroup v5+: its group
    payloads say their protocol type, so none is counted as a fallback."""
    with ProxyThread(kafka.bootstrap) as proxy:
        topic = unique("java-groups")
        kafka.create_topic(topic, partitions=1)
        produce({"bootstrap.servers": proxy.bootstrap}, topic, count=100)
        result = kafka.run_java_tool(
            "org.apache.kafka.tools.ConsumerPerformance", "--bootstrap-server",
            proxy.bootstrap, "--topic", topic, "--messages", "100", "--group",
            unique("g"), "--timeout", "60000", timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        joins = [s for family in proxy.metrics.registry.collect() for s in family.samples
                 if s.name == "gatehouse_requests_total" and s.labels["api"] == "JoinGroup"
                 and s.value]
        assert joins and min(int(s.labels["version"]) for s in joins) >= 7
        assert proxy.summed("gatehouse_group_protocol_fallbacks_total") == 0
        # The group left when the tool exited.
        assert wait_until(lambda: proxy.summed("gatehouse_consumer_groups") == 0)


def test_rename_rule_decodes_pre_kip559_payloads_with_the_fallback(
        kafka: KafkaCluster) -> None:
    """Behind a rename, librdkafka's JoinGroup v5 / SyncGroup v3 payloads are decoded with
    the protocol type its JoinGroup declared (the rules count it; nothing undecodable)."""
    broker_name = unique("renamed.orders")
    rules = f"- name: orders-alias\n  rename_topics: {{orders: {broker_name}}}\n"
    with ProxyThread(kafka.bootstrap, rules_yaml=rules) as proxy:
        kafka.create_topic(broker_name, partitions=2)
        conf = {"bootstrap.servers": proxy.bootstrap}
        produce(conf, "orders", count=10)
        consumer = ck.Consumer({**conf, "group.id": unique("g"), "auto.offset.reset":
                                "earliest", "session.timeout.ms": 6000, "log_level": 3})
        try:
            consumer.subscribe(["orders"])
            assert first_message(consumer).topic() == "orders"
        finally:
            consumer.close()
        assert proxy.sample("gatehouse_rename_group_payloads_total", outcome="fallback") >= 2
        for outcome in ("undecodable", "unknown_protocol"):
            assert proxy.sample("gatehouse_rename_group_payloads_total", outcome=outcome) == 0
        assert proxy.sample("gatehouse_group_protocol_fallbacks_total", api="SyncGroup",
                            direction="response", outcome="resolved") == 1


# -- share and streams groups: Java members started from tests/support/java ------------------

SHARE_HEARTBEAT, STREAMS_HEARTBEAT = 76, 88


@dataclass(frozen=True)
class Answered:
    """One heartbeat the proxy answered, and the group gauge right after metrics counted it."""

    member_epoch: int
    error_code: int
    groups_after: float


class HeartbeatWatch(Observer):
    """Records one heartbeat API's exchanges through a proxy.  Observers run after the
    proxy's metrics, so ``groups_after`` shows what that very answer did to the census,
    before any connection close could."""

    def __init__(self, upstream: str, api_key: int, protocol_type: str) -> None:
        self.api_key = api_key
        self.protocol_type = protocol_type
        self.epochs: dict[tuple[int, int], int] = {}
        self.answered: list[Answered] = []
        self.proxy = ProxyThread(upstream, observers=[self])

    def groups(self) -> float:
        """The gauge of this protocol type's groups (their protocol is always "default")."""
        return self.proxy.sample("gatehouse_consumer_groups", protocol_type=self.protocol_type,
                                 protocol="default")

    def request(self, conn: ConnectionInfo, req: Request, size: int) -> None:
        if req.api_key == self.api_key:
            self.epochs[(conn.id, req.correlation_id)] = req.body.member_epoch

    def response(self, conn: ConnectionInfo, pending: Pending, size: int, elapsed: float,
                 frame: Any = None) -> None:
        epoch = self.epochs.pop((conn.id, pending.correlation_id), None)
        if epoch is not None and frame is not None:
            code = decoded_response(pending, frame).body.error_code
            self.answered.append(Answered(epoch, code, self.groups()))


class JavaMember:
    """A group member from tests/support/java (Java's single-file source launcher): its
    stdout lines as they come; closing its stdin makes it leave its group and exit."""

    def __init__(self, source: str, libs: Path, args: list[str], log: Path) -> None:
        cmd = java_command(libs, str(JAVA_SOURCES / source), args)
        self.log = log
        with open(log, "w") as stderr:
            self.process = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            stderr=stderr, text=True, start_new_session=True)
        register_process(self.process)  # type: ignore[arg-type]
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(self.process.stdout,), daemon=True).start()

    def _read(self, stdout: IO[str]) -> None:
        for line in stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)  # end of output

    def wait_for(self, prefix: str, timeout: float = 120.0) -> str:
        """The next output line starting with ``prefix`` (earlier ones are dropped)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {prefix!r} line within {timeout}s; stderr ends with:"
                                     f"\n{self.stderr_tail()}") from None
            if line is None:
                raise AssertionError(f"exited ({self.process.wait()}) before a {prefix!r} "
                                     f"line; stderr ends with:\n{self.stderr_tail()}")
            if line.startswith(prefix):
                return line

    def leave(self, timeout: float = 60.0) -> None:
        """Close stdin, wait for the member to say it closed and to exit with 0."""
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.wait_for("closed", timeout)
        assert self.process.wait(timeout) == 0, self.stderr_tail()

    def stderr_tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])

    def __enter__(self) -> JavaMember:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()
        stop_process(self.process, 10, kill=True)  # type: ignore[arg-type]


def assert_left_by_its_heartbeat(watch: HeartbeatWatch) -> None:
    """The member joined (epoch 0, answered, gauge 1) and left with one leave heartbeat
    (epoch -1) that itself took the gauge to 0, before the client's connection closed."""
    assert watch.answered, "no heartbeat went through the proxy"
    assert watch.answered[0] == Answered(0, 0, 1.0), watch.answered[:3]
    leaves = [a for a in watch.answered if a.member_epoch == -1]
    assert leaves == [Answered(-1, 0, 0.0)], watch.answered[-3:]


def test_java_share_consumer_is_a_share_group_until_it_leaves(
        kafka: KafkaCluster, tmp_path: Path) -> None:
    watch = HeartbeatWatch(kafka.bootstrap, SHARE_HEARTBEAT, "share")
    with watch.proxy as proxy:
        topic = unique("share")
        kafka.create_topic(topic, partitions=1)
        values = produce({"bootstrap.servers": proxy.bootstrap}, topic, count=5)
        args = [proxy.bootstrap, topic, unique("share-group")]
        with JavaMember("ShareMember.java", kafka.libs, args, tmp_path / "share.log") as member:
            got = [member.wait_for("record ") for _ in values]
            assert sorted(got) == sorted(f"record {v.decode()}" for v in values)
            # Consuming: the member joined and holds an assignment.
            assert watch.groups() == 1
            assert proxy.summed("gatehouse_consumer_groups", protocol_type="consumer") == 0
            # Its records counted as fetched (ShareFetch answers), as they were produced.
            for direction in ("produce", "fetch"):
                assert proxy.sample("gatehouse_topic_records_total", topic=topic,
                                    direction=direction) == len(values)
            member.leave()
        assert watch.groups() == 0
        assert_left_by_its_heartbeat(watch)


def test_kafka_streams_app_is_a_streams_group_until_it_leaves(
        kafka: KafkaCluster, tmp_path: Path) -> None:
    """A Kafka Streams application with group.protocol=streams.  Kafka Streams 4.4.0 is not
    on Maven Central: the newest 4.x release is used with its own kafka-clients (see
    scripts.fetch_kafka.ensure_kafka_streams), a real mixed-version pairing."""
    streams_libs = ensure_kafka_streams()
    watch = HeartbeatWatch(kafka.bootstrap, STREAMS_HEARTBEAT, "streams")
    with watch.proxy as proxy:
        topic = unique("streams")
        kafka.create_topic(topic, partitions=1)
        values = produce({"bootstrap.servers": proxy.bootstrap}, topic, count=5)
        args = [proxy.bootstrap, topic, unique("streams-app"), str(tmp_path / "state")]
        with JavaMember("StreamsMember.java", streams_libs, args,
                        tmp_path / "streams.log") as member:
            member.wait_for("state RUNNING")
            got = [member.wait_for("record ") for _ in values]
            assert sorted(got) == sorted(f"record {v.decode()}" for v in values)
            assert watch.groups() == 1
            assert proxy.summed("gatehouse_consumer_groups", protocol_type="consumer") == 0
            member.leave()
        assert watch.groups() == 0
        assert_left_by_its_heartbeat(watch)
