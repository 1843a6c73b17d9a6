"""No loss, no duplicates: Kafka's own VerifiableProducer (idempotent, acks=all) and
VerifiableConsumer run through the proxy against the 3-node cluster while the harness
(a) restarts a broker, (b) restarts the proxy, (c) kills client connections from the proxy
side and (d) pauses a broker (SIGSTOP) past the clients' request timeout.

The counts come from the tools' JSON output, never from the proxy: every acknowledged
message is in the log exactly once, and each consumer group receives every one of them.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gatehouse.codecs import Request
from gatehouse.proxy.hooks import Close, ConnectionInfo, Decision, Forward, Policy
from scripts.fetch_kafka import classpath, java_binary, log4j2_config
from tests.reliability.support import ProxyRunner, scaled, wait_until
from tests.support.clients import unique
from tests.support.kafka import TOOL_JVM_OPTS, KafkaCluster, register_process, stop_process
from tests.support.ports import free_port

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
               libs: Path) -> Tool:
    props = workdir / f"{name}.properties"
    props.write_text("".join(f"{k}={v}\n" for k, v in config.items()))
    cmd = [java_binary(), *TOOL_JVM_OPTS, f"-Dlog4j2.configurationFile={log4j2_config()}",
           "-Dgatehouse.kafka.log.level=WARN", "-cp", classpath(libs), main, *args,
           "--command-config", str(props)]
    stderr = open(workdir / f"{name}.stderr", "w")  # noqa: SIM115 - the process owns it
    process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=stderr, text=True, start_new_session=True)
    register_process(process)  # type: ignore[arg-type]
    tool = Tool(name, process)
    threading.Thread(target=tool.read, daemon=True).start()
    return tool


def consumed_records(tool: Tool) -> list[tuple[int, int, str]]:
    return [(e["partition"], e["offset"], e["value"]) for e in tool.named("record_data")]


def run_faults(steps: list[tuple[str, Callable[[], None]]], progress: Callable[[], int]) -> None:
    """Each fault in turn, and between faults wait until the producer gets acks again."""
    for name, fault in steps:
        before = progress()
        fault()
        wait_until(lambda b=before: progress() > b + 50, 120,  # type: ignore[misc]
                   f"acks to resume after: {name}", interval=0.2)


@pytest.mark.timeout(scaled(600, 3600))
def test_verifiable_producer_and_consumer_through_faults(kafka_cluster: KafkaCluster,
                                                         tmp_path: Path) -> None:
    cluster = kafka_cluster
    topic = unique("verifiable")
    cluster.create_topic(topic, partitions=3, replication=3,
                         config={"min.insync.replicas": "2"})
    port = free_port()
    node_ports = {node.node_id: free_port() for node in cluster.nodes}
    config = (f"listen: 127.0.0.1:{port}\nupstream: [{cluster.bootstrap}]\n"
              f"brokers: {{start_port: null, ports: {json.dumps(node_ports)}}}\n"
              "limits: {shutdown_grace: 2, connect_timeout: 3}\nlog: {level: WARNING}\n")
    config = config.replace('"', "")
    killswitch = KillSwitch()
    proxies = [ProxyRunner(config, policy=killswitch).start()]
    bootstrap = f"127.0.0.1:{port}"
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

        def restart_broker() -> None:
            cluster.stop_node(1)
            cluster.start_node(1)

        def restart_proxy() -> None:
            proxies[-1].stop()
            proxies.append(ProxyRunner(config, policy=killswitch).start())

        def killed_clients(since: int = 0) -> set[str]:
            return {entry.split("/")[1].split("-")[0] for entry in killswitch.killed_on[since:]}

        def kill_connections() -> None:
            # Re-arm every 3 s until both the producer's and the consumer's connections have
            # gone in this step: a client still reconnecting has no connection to kill yet,
            # and a consumer waiting on a rebalance sends nothing for a while.
            start = len(killswitch.killed_on)
            deadline = time.monotonic() + 120
            while not {"producer", "consumer"} <= killed_clients(start):
                assert time.monotonic() < deadline, (
                    f"connections not killed within 120 s; this step killed "
                    f"{killswitch.killed_on[start:]}, acks so far {acks()}")
                killswitch.kill()
                time.sleep(3)  # every connection with a request in these seconds goes

        def pause_broker() -> None:
            cluster.pause_node(2)
            try:
                time.sleep(REQUEST_TIMEOUT_MS / 1000 * 1.6)
            finally:
                cluster.resume_node(2)

        for _ in range(rounds):
            run_faults([("broker restart", restart_broker), ("proxy restart", restart_proxy),
                        ("connections killed", kill_connections),
                        ("broker paused", pause_broker)], acks)
        assert {"producer", "consumer"} <= killed_clients(), killswitch.killed_on
        assert producer.process.wait(messages / throughput + 300) == 0
        acked = {e["value"]: (e["partition"], e["offset"])
                 for e in producer.named("producer_send_success")}
        errors = producer.named("producer_send_error")
        summary = producer.named("tool_data")
        assert errors == [], errors[:5]
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
        for node in cluster.nodes:  # a shared cluster: leave every node running
            if node.paused:
                cluster.resume_node(node.node_id)
        for i, node in enumerate(cluster.nodes):
            if not node.running:
                cluster.start_node(i)
        proxies[-1].stop()

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
