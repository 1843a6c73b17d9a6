"""No loss, no duplicates: Kafka's own VerifiableProducer (idempotent, acks=all) and
VerifiableConsumer run through the proxy against the 3-node cluster while the harness
(a) restarts a broker, (b) restarts the proxy, (c) kills client connections from the proxy
side and (d) pauses a broker (SIGSTOP) past the clients' request timeout.

The counts come from the tools' JSON output, never from the proxy: every acknowledged
message is in the log exactly once, and each consumer group receives every one of them.

The same faults (with the broker killed, SIGKILL, instead of stopped) also meet records of
300 KiB from librdkafka: every request and answer carrying one cuts through the proxy (sent
on as its bytes arrive), and each record must come back once, where it was acked, byte for
byte.
"""

from __future__ import annotations

import json
import random
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import confluent_kafka as ck
import pytest

from gatehouse.codecs import Request
from gatehouse.proxy.hooks import Close, ConnectionInfo, Decision, Forward, Policy
from tests.reliability.support import ProxyRunner, scaled, wait_until
from tests.support.clients import unique
from tests.support.kafka import KafkaCluster, java_command, register_process, stop_process
from tests.support.ports import free_port
from tests.support.proxythread import ProxyThread

REQUEST_TIMEOUT_MS = 5000
CLIENT_CONFIG = {
    "request.timeout.ms": REQUEST_TIMEOUT_MS,
    "reconnect.backoff.ms": 100,
    "reconnect.backoff.max.ms": 1000,
    "retry.backoff.ms": 100,
    "retry.backoff.max.ms": 1000,
    "metadata.max.age.ms": 5000,
    "socket.connection.setup.timeout.ms": 5000,
    "socket.connection.setup.timeout.max.ms": 10000,
}
PRODUCER_CONFIG = {
    **CLIENT_CONFIG,
    "enable.idempotence": "true",
    "acks": "all",
    "retries": 2147483647,
    "delivery.timeout.ms": 300000,
    "max.in.flight.requests.per.connection": 5,
    "linger.ms": 5,
}
# The same fault-minded settings for librdkafka (its names; request.timeout.ms is a
# producer property there).
LIBRDKAFKA_CONFIG = {
    "reconnect.backoff.ms": 100,
    "reconnect.backoff.max.ms": 1000,
    "retry.backoff.ms": 100,
    "retry.backoff.max.ms": 1000,
    "topic.metadata.refresh.interval.ms": 5000,
    "socket.connection.setup.timeout.ms": 5000,
}
CONSUMER_CONFIG = {
    **CLIENT_CONFIG,
    "session.timeout.ms": 20000,
    "heartbeat.interval.ms": 1000,
    "default.api.timeout.ms": 60000,
}


class KillSwitch(Policy):
    """Closes, from the proxy's side, every connection that existed when ``kill()`` ran
    (on its next request); connections opened afterwards live on."""

    def __init__(self) -> None:
        self.generation = 0
        self.killed = 0
        self.killed_on: list[str] = []  # listener and client id of each

    def kill(self) -> None:
        self.generation += 1

    def on_request(self, conn: ConnectionInfo, req: Request) -> Decision:
        born = conn.state.setdefault("killswitch", self.generation)
        if born < self.generation:
            self.killed += 1
            self.killed_on.append(f"{conn.listener}/{conn.client_id}")
            return Close("killed by the test harness")
        return Forward(req)


@dataclass
class Tool:
    """A Verifiable* tool: its JSON events, read as they come."""

    name: str
    process: subprocess.Popen[str]
    events: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("{"):
                event = json.loads(line)
                with self.lock:
                    self.events.append(event)

    def named(self, name: str) -> list[dict[str, Any]]:
        with self.lock:
            return [e for e in self.events if e.get("name") == name]


def start_tool(name: str, main: str, args: list[str], config: dict[str, Any], workdir: Path,
               libs: Path, config_option: str = "--command-config") -> Tool:
    """``main`` with ``config`` in a properties file given by ``config_option`` (Kafka
    3.x's tools: ``--producer.config``, ``--consumer.config``)."""
    props = workdir / f"{name}.properties"
    props.write_text("".join(f"{k}={v}\n" for k, v in config.items()))
    cmd = java_command(libs, main, [*args, config_option, str(props)])
    stderr = open(workdir / f"{name}.stderr", "w")  # noqa: SIM115 - the process owns it
    process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=stderr, text=True, start_new_session=True)
    register_process(process)  # type: ignore[arg-type]
    tool = Tool(name, process)
    threading.Thread(target=tool.read, daemon=True).start()
    return tool


def consumed_records(tool: Tool) -> list[tuple[int, int, str]]:
    return [(e["partition"], e["offset"], e["value"]) for e in tool.named("record_data")]


def run_faults(steps: list[tuple[str, Callable[[], None]]], progress: Callable[[], int],
               resumed_after: int = 50) -> None:
    """Each fault in turn, and between faults wait until the producer gets acks again."""
    for name, fault in steps:
        before = progress()
        fault()
        wait_until(lambda b=before: progress() > b + resumed_after, 120,  # type: ignore[misc]
                   f"acks to resume after: {name}", interval=0.2)


class Faults:
    """The harness's faults against one cluster and the proxies in front of it (fixed
    ports: a restarted proxy comes back where its clients left it)."""

    def __init__(self, cluster: KafkaCluster, killswitch: KillSwitch) -> None:
        self.cluster = cluster
        self.killswitch = killswitch
        self.port = free_port()
        node_ports = {node.node_id: free_port() for node in cluster.nodes}
        self.config = (
            f"listen: 127.0.0.1:{self.port}\nupstream: [{cluster.bootstrap}]\n"
            f"brokers: {{start_port: null, ports: {json.dumps(node_ports)}}}\n"
            "limits: {shutdown_grace: 2, connect_timeout: 3}\nlog: {level: WARNING}\n"
        ).replace('"', "")
        self.proxies: list[ProxyThread] = []

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start_proxy(self) -> None:
        self.proxies.append(ProxyRunner(self.config, policy=self.killswitch).start())

    def restart_proxy(self) -> None:
        self.proxies[-1].stop()
        self.start_proxy()

    def restart_broker(self, *, kill: bool = False) -> None:
        self.cluster.stop_node(1, kill=kill)
        self.cluster.start_node(1)

    def killed_clients(self, since: int = 0) -> set[str]:
        """The client ids (up to their first "-") of the connections killed so far."""
        return {entry.split("/")[1].split("-")[0] for entry in self.killswitch.killed_on[since:]}

    def kill_connections(self, clients: set[str], progress: Callable[[], int]) -> None:
        # Re-arm every 3 s until a connection of each client has gone in this step: a
        # client still reconnecting has no connection to kill yet, and a consumer waiting
        # on a rebalance sends nothing for a while.
        start = len(self.killswitch.killed_on)
        deadline = time.monotonic() + 120
        while not clients <= self.killed_clients(start):
            assert time.monotonic() < deadline, (
                f"connections not killed within 120 s; this step killed "
                f"{self.killswitch.killed_on[start:]}, acks so far {progress()}")
            self.killswitch.kill()
            time.sleep(3)  # every connection with a request in these seconds goes

    def pause_broker(self) -> None:
        self.cluster.pause_node(2)
        try:
            time.sleep(REQUEST_TIMEOUT_MS / 1000 * 1.6)
        finally:
            self.cluster.resume_node(2)

    def produce_errors(self) -> dict[str, float]:
        """The error codes of the Produce answers every proxy so far passed on, by name."""
        out: dict[str, float] = {}
        for proxy in self.proxies:
            for error, count in proxy.summed_by("gatehouse_responses_total", "error",
                                                api="Produce").items():
                out[error] = out.get(error, 0.0) + count
        return out

    def close(self) -> None:
        """Every node running again (the cluster is shared) and the last proxy stopped."""
        cluster = self.cluster
        for node in cluster.nodes:
            if node.paused:
                cluster.resume_node(node.node_id)
        for i, node in enumerate(cluster.nodes):
            if not node.running:
                cluster.start_node(i)
        if self.proxies:
            self.proxies[-1].stop()


def open_faults(cluster: KafkaCluster, killswitch: KillSwitch, topic_prefix: str
                ) -> tuple[Faults, str]:
    """A topic of three partitions, three replicas, two of them in sync for an ack, and
    a proxy in front of the cluster to meet the faults."""
    topic = unique(topic_prefix)
    cluster.create_topic(topic, partitions=3, replication=3,
                         config={"min.insync.replicas": "2"})
    faults = Faults(cluster, killswitch)
    faults.start_proxy()
    return faults, topic


@pytest.mark.timeout(scaled(600, 3600))
def test_verifiable_producer_and_consumer_through_faults(kafka_cluster: KafkaCluster,
                                                         tmp_path: Path) -> None:
    cluster = kafka_cluster
    killswitch = KillSwitch()
    faults, topic = open_faults(cluster, killswitch, "verifiable")
    bootstrap = faults.bootstrap
    rounds = scaled(1, 4)
    throughput = 300
    messages = throughput * scaled(70, 300)
    producer = consumer = None
    try:
        producer = start_tool(
            "producer", "org.apache.kafka.tools.VerifiableProducer",
            ["--topic", topic, "--bootstrap-server", bootstrap, "--max-messages", str(messages),
             "--throughput", str(throughput), "--acks", "-1"],
            PRODUCER_CONFIG, tmp_path, cluster.libs)
        group = unique("during")
        consumer = start_tool(
            "consumer", "org.apache.kafka.tools.VerifiableConsumer",
            ["--topic", topic, "--bootstrap-server", bootstrap, "--group-id", group,
             "--verbose", "--reset-policy", "earliest", "--session-timeout", "20000"],
            CONSUMER_CONFIG, tmp_path, cluster.libs)
        acks = lambda: len(producer.named("producer_send_success"))  # noqa: E731
        wait_until(lambda: acks() > 100, 90, "the producer's first acks", interval=0.2)
        for _ in range(rounds):
            run_faults([("broker restart", faults.restart_broker),
                        ("proxy restart", faults.restart_proxy),
                        ("connections killed",
                         lambda: faults.kill_connections({"producer", "consumer"}, acks)),
                        ("broker paused", faults.pause_broker)], acks)
        assert {"producer", "consumer"} <= faults.killed_clients(), killswitch.killed_on
        assert producer.process.wait(messages / throughput + 300) == 0
        acked = {e["value"]: (e["partition"], e["offset"])
                 for e in producer.named("producer_send_success")}
        errors = producer.named("producer_send_error")
        summary = producer.named("tool_data")
        # (Said by the exception's class and message: the events' other fields are the
        # record's, which a failure report would cut before these.)
        assert errors == [], [(e.get("exception"), e.get("message")) for e in errors[:5]]
        assert len(acked) == messages, f"{messages} sent, {len(acked)} acked"
        assert summary and summary[-1]["acked"] == messages

        # The group that lived through the faults got every acked message.
        wait_until(lambda: {r[2] for r in consumed_records(consumer)} >= acked.keys(), 120,
                   "the consumer that lived through the faults to catch up", interval=0.5)
        during = consumed_records(consumer)
        # A fresh group afterwards, through the (restarted) proxy: the log itself.
        after = start_tool(
            "consumer-after", "org.apache.kafka.tools.VerifiableConsumer",
            ["--topic", topic, "--bootstrap-server", bootstrap, "--group-id", unique("after"),
             "--verbose", "--reset-policy", "earliest", "--max-messages", str(messages)],
            CONSUMER_CONFIG, tmp_path, cluster.libs)
        assert after.process.wait(180) == 0
        log = consumed_records(after)
    finally:
        for tool in (producer, consumer):
            if tool is not None:
                stop_process(tool.process, 30)  # type: ignore[arg-type]
        faults.close()

    # Exactly once in the log: each acked value once, at the offset the producer was told.
    values = [value for _, _, value in log]
    assert len(values) == len(set(values)) == messages, (
        f"{len(values)} records, {len(set(values))} distinct, {messages} acked")
    assert {value: (p, o) for p, o, value in log} == acked
    # The group that lived through the faults: every acked message, each at its offset;
    # a record seen twice is a redelivery of the same offset (a commit lost to a fault),
    # never a second copy of the message.
    seen = {(p, o): value for p, o, value in during}
    assert {value for value in seen.values()} >= acked.keys()
    assert all(acked[value] == (p, o) for (p, o), value in seen.items() if value in acked)
    assert len(set(seen.values())) == len(seen), "one value at two offsets: a duplicate write"
    redelivered = len(during) - len(seen)
    print(f"\n{messages} acked through {rounds} round(s) of faults; "
          f"{killswitch.killed} connections killed ({', '.join(killswitch.killed_on)}); "
          "consumer during faults: "
          f"{len(during)} records, {redelivered} redelivered")


# Above the proxy's 256 KiB read: every Produce request carrying one of these goes up
# as its bytes arrive, and every Fetch answer carrying one comes down the same way.
LARGE_VALUE = 300 * 1024


def large_value(i: int) -> bytes:
    """Record ``i``'s value: its number, then bytes that differ for every record."""
    return b"%08d:" % i + random.Random(i).randbytes(LARGE_VALUE)


def checked(msg: Any) -> tuple[int, int, int, bool]:
    """A consumed ``large_value`` record: (partition, offset, record, value intact)."""
    value = msg.value()
    record = int(value[:8])
    return msg.partition(), msg.offset(), record, value == large_value(record)


class StreamingKillSwitch(KillSwitch):
    """A KillSwitch that lets the large requests of live connections cut through the
    proxy (admitted unread, as with no rules), so the faults land on the streamed paths;
    a condemned connection's request is read whole and closed by ``on_request``."""

    def forwards_unread(self, conn: ConnectionInfo, req: Request) -> Forward | None:
        born: int = conn.state.setdefault("killswitch", self.generation)
        return Forward(req) if born == self.generation else None


class LargeRecords:
    """A librdkafka producer (idempotent, acks=all) of ``large_value`` records at a steady
    pace in a thread, and a consumer group reading them in another, checking each value."""

    def __init__(self, bootstrap: str, topic: str, per_second: float) -> None:
        self.topic = topic
        self.acked: dict[int, tuple[int, int | None]] = {}  # record -> (partition, offset)
        self.errors: list[str] = []
        self.sent = 0
        self.consumed: list[tuple[int, int, int, bool]] = []  # partition, offset, record, intact
        self._stop_producing = threading.Event()
        self._stop_consuming = threading.Event()
        common = {**LIBRDKAFKA_CONFIG, "bootstrap.servers": bootstrap, "log_level": 3}
        self._producer = ck.Producer({
            **common, "client.id": "producer-large", "enable.idempotence": True,
            "acks": "all", "linger.ms": 5, "batch.size": 700_000,
            "request.timeout.ms": REQUEST_TIMEOUT_MS, "message.timeout.ms": 300_000})
        self._consumer = ck.Consumer({
            **common, "client.id": "consumer-large", "group.id": unique("large"),
            "auto.offset.reset": "earliest", "session.timeout.ms": 20_000,
            "heartbeat.interval.ms": 1000})
        self._threads = [threading.Thread(target=self._produce, args=(per_second,), daemon=True),
                         threading.Thread(target=self._consume, daemon=True)]

    def start(self) -> LargeRecords:
        for thread in self._threads:
            thread.start()
        return self

    def _delivered(self, err: Any, msg: Any) -> None:
        # A record of a batch that librdkafka retried after a fault and the broker had
        # already stored is reported delivered without its offset (None): seen with the
        # clients connected straight to the brokers too.
        if err is not None:
            self.errors.append(str(err))
        else:
            self.acked[int(msg.value()[:8])] = (msg.partition(), msg.offset())

    def _produce(self, per_second: float) -> None:
        start = time.monotonic()
        while not self._stop_producing.is_set():
            self._producer.produce(self.topic, value=large_value(self.sent),
                                   on_delivery=self._delivered)
            self.sent += 1
            # A steady pace, as VerifiableProducer's --throughput keeps.
            self._stop_producing.wait(max(0.0, start + self.sent / per_second
                                          - time.monotonic()))
            self._producer.poll(0)

    def _consume(self) -> None:
        self._consumer.subscribe([self.topic])
        while not self._stop_consuming.is_set():
            msg = self._consumer.poll(0.5)
            if msg is None or msg.error() is not None:
                continue  # librdkafka reports faults it recovers from as events
            self.consumed.append(checked(msg))
        self._consumer.close()

    def stop_producing(self, timeout: float) -> None:
        """No more records; wait for every delivery report."""
        self._stop_producing.set()
        self._threads[0].join(timeout)
        assert self._producer.flush(timeout) == 0, "records left without a delivery report"

    def stop_consuming(self) -> None:
        self._stop_consuming.set()
        self._threads[1].join(60)

    def close(self) -> None:
        """Both threads stopped, whatever happened (the test's own asserts say what)."""
        self._stop_producing.set()
        self._stop_consuming.set()
        for thread in self._threads:
            thread.join(60)
        self._producer.flush(10)
        self._producer = None  # type: ignore[assignment]  # gone now, not retrying at exit


@pytest.mark.timeout(scaled(600, 3600))
def test_large_records_cut_through_faults_without_loss(
        kafka_cluster: KafkaCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """Records of 300 KiB, so that requests and answers cut through the proxy (sent on as
    their bytes arrive), through a broker killed (SIGKILL) and restarted, a proxy restart,
    connections killed from the proxy's side and a paused broker: every acked record is in
    the log once, at its acked offset, byte for byte."""
    from gatehouse.proxy.connection import ProxyConnection

    streamed = {"requests": 0, "answers": 0}

    def counting(method: str, kind: str) -> Any:
        original = getattr(ProxyConnection, method)

        async def spy(self: ProxyConnection, reader: Any, size: int) -> Any:
            out = await original(self, reader, size)
            if out is not None:
                streamed[kind] += 1
            return out

        return spy

    monkeypatch.setattr(ProxyConnection, "_stream_request", counting("_stream_request", "requests"))
    monkeypatch.setattr(ProxyConnection, "_stream_response", counting("_stream_response", "answers"))
    killswitch = StreamingKillSwitch()
    faults, topic = open_faults(kafka_cluster, killswitch, "large")
    records = None
    try:
        records = LargeRecords(faults.bootstrap, topic, per_second=8).start()
        acks = lambda: len(records.acked)  # noqa: E731
        wait_until(lambda: acks() > 10, 90, "the producer's first acks", interval=0.2)
        for _ in range(scaled(1, 3)):
            run_faults([("broker killed", lambda: faults.restart_broker(kill=True)),
                        ("proxy restart", faults.restart_proxy),
                        ("connections killed",
                         lambda: faults.kill_connections({"producer", "consumer"}, acks)),
                        ("broker paused", faults.pause_broker)], acks, resumed_after=10)
        records.stop_producing(120)
        assert records.errors == [], records.errors[:5]
        acked = records.acked
        assert len(acked) == records.sent, f"{records.sent} sent, {len(acked)} acked"
        wait_until(lambda: {r[2] for r in records.consumed} >= acked.keys(), 120,
                   "the consumer that lived through the faults to catch up", interval=0.5)
        records.stop_consuming()
        during = records.consumed
        log = consume_log(faults.bootstrap, topic, len(acked))
    finally:
        if records is not None:
            records.close()
        faults.close()

    assert {"producer", "consumer"} <= faults.killed_clients(), killswitch.killed_on
    assert streamed["requests"] > 0 and streamed["answers"] > 0, streamed
    # Exactly once in the log, at the acked partition and offset, every byte as sent.
    assert all(intact for *_, intact in log), [r[:3] for r in log if not r[3]][:5]
    assert len(log) == len({r[2] for r in log}) == len(acked)
    assert all(at_acked(acked[record], p, o) for p, o, record, _ in log), (log, acked)
    # The group that lived through the faults: every record intact, each where acked.
    assert all(intact for *_, intact in during)
    assert all(at_acked(acked[record], p, o) for p, o, record, _ in during)
    print(f"\n{len(acked)} records of {LARGE_VALUE // 1024} KiB acked through the faults "
          f"({sum(o is None for _, o in acked.values())} without an offset); Produce answers "
          f"by error {faults.produce_errors()}; "
          f"{streamed['requests']} requests and {streamed['answers']} answers streamed; "
          f"{killswitch.killed} connections killed; consumer during faults: {len(during)} "
          f"records, {len(during) - len({r[:2] for r in during})} redelivered")


def at_acked(acked: tuple[int, int | None], partition: int, offset: int) -> bool:
    """Whether a record read at ``partition`` and ``offset`` is where its ack said."""
    return acked[0] == partition and acked[1] in (offset, None)


def consume_log(bootstrap: str, topic: str, count: int) -> list[tuple[int, int, int, bool]]:
    """Every record of ``topic`` from the beginning, a fresh group: (partition, offset,
    record, value intact)."""
    consumer = ck.Consumer({**LIBRDKAFKA_CONFIG, "bootstrap.servers": bootstrap,
                            "group.id": unique("after"), "auto.offset.reset": "earliest",
                            "enable.auto.commit": False, "log_level": 3})
    out: list[tuple[int, int, int, bool]] = []
    try:
        consumer.subscribe([topic])
        deadline = time.monotonic() + 180
        while len(out) < count and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and msg.error() is None:
                out.append(checked(msg))
        # Nothing past them: the partitions hold exactly as many records (no transactions,
        # so offsets are contiguous), a duplicate would be one more.
        held = 0
        for partition in {p for p, *_ in out}:
            low, high = watermarks_after_faults(consumer, ck.TopicPartition(topic, partition))
            held += high - low
        assert held == len(out), f"the log holds {held} records, {len(out)} read"
    finally:
        consumer.close()
    return out


_SETTLING = frozenset({ck.KafkaError.NOT_LEADER_FOR_PARTITION, ck.KafkaError.LEADER_NOT_AVAILABLE,
                       ck.KafkaError._TIMED_OUT, ck.KafkaError._TRANSPORT})


def watermarks_after_faults(consumer: ck.Consumer, partition: ck.TopicPartition,
                            timeout: float = 60.0) -> tuple[int, int]:
    """The partition's low and high watermarks, asked again while the cluster still
    settles from the faults (a leader moving answers NOT_LEADER_FOR_PARTITION and the
    like: retriable errors, as the clients treat them)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            low, high = consumer.get_watermark_offsets(partition, 10)
            return int(low), int(high)
        except ck.KafkaException as exc:
            error = exc.args[0]
            settling = error.retriable() or error.code() in _SETTLING
            if not settling or time.monotonic() > deadline:
                raise
            time.sleep(0.5)
