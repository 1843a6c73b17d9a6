"""Clients in other languages through the proxy on a real Apache Kafka broker: the Go
clients franz-go (the newest
protocol versions, its own codec: flexible versions everywhere, Produce and Fetch by
topic id, a transactional producer, a KIP-848 consumer) and Sarama (held to Kafka 2.1's versions: none flexible), each creating a topic,
producing, consuming in a group with commits, and administering it, and KafkaJS (its
own codec in JavaScript, an idempotent producer) doing the same, each under a tenant
prefix: everything lands under the prefix on the broker, the client sees its own names
only; and all three logging in at the proxy (SASL ended there: PLAIN and SCRAM)
(tests/support/go/gokafka and tests/support/node/kafkajs, built by
scripts/build_test_clients.py)."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient

from scripts.build_test_clients import ensure_gokafka, ensure_kafkajs
from tests.integration.test_metrics_topics import versions_seen
from tests.integration.test_rules_groups import transactions
from tests.support.clients import unique
from tests.support.kafka import KafkaCluster
from tests.support.proxythread import ProxyThread

RULES = ("- name: tenant-a\n  match: {client_id: '^a-'}\n"
         "  topic_prefix: {broker: 'a.', hide_others: true, groups: true,"
         " transactional_ids: true}\n")
RECORDS = 20


@dataclass
class TenantRun:
    """What a client's run as tenant a printed (its steps), and what it left."""

    topic: str
    group: str
    steps: dict[str, list[str]]
    on_broker: set[str]
    versions: dict[str, set[int]]  # API -> the versions it sent
    offsets: list[tuple[str, int]]  # (topic, committed offset) per partition listed


def run_as_tenant(kafka: KafkaCluster, client: str, cmd: list[str],
                  cwd: Path | None = None) -> TenantRun:
    """``cmd`` (gokafka's or tenant.js' steps) through a proxy under RULES as tenant a,
    beside another tenant's topic; the steps every client goes through asserted: its
    topic created, RECORDS produced and read back by its own names, its offsets
    committed under its topic's name, only its own groups and topics listed (the
    broker's under the prefix), its group and topic deleted."""
    theirs = unique("b.ledger")
    kafka.create_topic(theirs)
    topic, group = unique(client), unique(f"{client}-readers")
    broker = AdminClient({"bootstrap.servers": kafka.bootstrap})
    with ProxyThread(kafka.bootstrap, rules_yaml=RULES) as proxy:
        run = subprocess.run([*cmd, proxy.bootstrap, f"a-{client}", topic, group,
                              str(RECORDS)], capture_output=True, text=True, timeout=180,
                             cwd=cwd)
        assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
        on_broker = set(broker.list_topics(timeout=10).topics)
        versions = {api: versions_seen(proxy.metrics.registry, api, "")
                    for api in ("Produce", "Fetch", "ConsumerGroupHeartbeat")}
    steps: dict[str, list[str]] = {}
    for line in run.stdout.splitlines():
        step, _, what = line.partition(" ")
        steps.setdefault(step, []).append(what)

    assert steps["create"] == [topic] and steps["produced"] == [str(RECORDS)]
    # Every record, under the tenant's name.
    assert sorted(steps["record"]) == sorted(f"{topic} {client}-{i}" for i in range(RECORDS))
    offsets = [(name, int(at)) for name, _, at in (what.split() for what in steps["offset"])]
    assert {name for name, _ in offsets} == {topic}
    # Only the tenant's own groups and topics (the broker's under the prefix).
    shown_groups = steps["groups"][0].split(",")
    assert group in shown_groups and not any(g.startswith("a.") for g in shown_groups)
    shown_topics = steps["topics"][0].split(",")
    assert topic in shown_topics and theirs not in shown_topics
    assert {"a." + t for t in shown_topics} <= on_broker | {"a." + topic}
    assert steps["delete-group"] == [group] and steps["delete"] == [topic]
    return TenantRun(topic, group, steps, on_broker, versions, offsets)


@pytest.mark.parametrize("client", ["franz", "sarama"])
def test_a_go_client_as_a_tenant(kafka: KafkaCluster, client: str) -> None:
    run = run_as_tenant(kafka, client, [str(ensure_gokafka()), client])
    topic, group, steps = run.topic, run.group, run.steps
    # Committed: every record, both partitions.
    assert sum(at for _, at in run.offsets) == RECORDS
    produced, fetched = run.versions["Produce"], run.versions["Fetch"]
    if client == "franz":
        assert steps["assigned"] == [topic]
        # And a commit marker in each partition the transaction wrote to.
        assert int(steps["end-offsets"][0]) - RECORDS in (1, 2), steps["end-offsets"]
        # Its transaction and its KIP-848 group were the tenant's, under the prefix.
        assert transactions(kafka.bootstrap, "ops", f"a.{group}-tx") == {
            f"a.{group}-tx": (0, "CompleteCommit")}
        assert run.versions["ConsumerGroupHeartbeat"]
        assert steps["configs"] == [topic] and steps["producers"] == [topic]
        in_dirs = steps["log-dirs"][0].split(",")
        shown_topics = steps["topics"][0].split(",")
        assert topic in in_dirs and set(in_dirs) <= set(shown_topics) | {topic}, in_dirs
        assert steps["transaction"] == [f"{group}-tx CompleteCommit"]
        listed = steps["transactions"][0].split(",")
        assert f"{group}-tx" in listed and not any(t.startswith("a.") for t in listed)
        # By topic id.
        assert min(produced) >= 13 and min(fetched) >= 13, (produced, fetched)
    else:
        assert steps["describe-group"] == [f"{group} Empty"]
        # Before flexible versions (Produce v9, Fetch v12).
        assert max(produced) < 9 and max(fetched) < 12, (produced, fetched)


def test_kafkajs_as_a_tenant(kafka: KafkaCluster) -> None:
    app = ensure_kafkajs()
    run = run_as_tenant(kafka, "kafkajs", ["node", str(app / "tenant.js")], cwd=app)
    topic, group, steps = run.topic, run.group, run.steps
    # Committed: every record (a partition it read nothing of: no offset, -1).
    assert sum(max(at, 0) for _, at in run.offsets) == RECORDS
    assert steps["assigned"] == [topic]  # its member assignment, by the tenant's name
    assert steps["describe-group"] == [f"{group} consumer 1"]
    assert steps["metadata"] == [f"{topic}:2"]
    produced = run.versions["Produce"]
    assert max(produced) < 9, produced  # KafkaJS's versions: none flexible


def test_they_log_in_at_the_proxy(kafka: KafkaCluster, tmp_path: Path) -> None:
    """SASL ended at the proxy (the broker's listener has none): franz-go with
    SCRAM-SHA-512, Sarama with PLAIN, KafkaJS with SCRAM-SHA-256 log in as alice and go
    through all of their steps as the tenant; a wrong password gets nothing done."""
    (tmp_path / "alice.secret").write_text("alice-pw-3c1d\n")
    users = tmp_path / "users.yaml"
    users.write_text("users:\n  alice: {password_file: alice.secret}\n")
    sasl = f"sasl:\n  downstream: {{users_file: {users}}}\n"
    app = ensure_kafkajs()
    with ProxyThread(kafka.bootstrap, extra_config=sasl, rules_yaml=RULES) as proxy:
        for name, mechanism, cmd in (
                ("franz", "SCRAM-SHA-512", [str(ensure_gokafka()), "franz"]),
                ("sarama", "PLAIN", [str(ensure_gokafka()), "sarama"]),
                ("kafkajs", "SCRAM-SHA-256", ["node", str(app / "tenant.js")])):
            topic, group = unique(f"login-{name}"), unique(f"login-{name}-readers")
            env = {**os.environ, "SASL_MECHANISM": mechanism, "SASL_USER": "alice",
                   "SASL_PASSWORD": "alice-pw-3c1d"}
            run = subprocess.run([*cmd, proxy.bootstrap, f"a-{name}", topic, group,
                                  str(RECORDS)], capture_output=True, text=True,
                                 timeout=180, cwd=app, env=env)
            assert run.returncode == 0, (name, run.stdout[-3000:], run.stderr[-3000:])
            got = [line for line in run.stdout.splitlines() if line.startswith("record ")]
            assert len(got) == RECORDS, (name, run.stdout[-2000:])
        assert proxy.sample("gatehouse_responses_total", api="SaslAuthenticate",
                            error="SASL_AUTHENTICATION_FAILED") == 0
        wrong = subprocess.run([str(ensure_gokafka()), "franz", proxy.bootstrap, "a-franz",
                                unique("never"), unique("never"), "1"],
                               capture_output=True, text=True, timeout=180,
                               env={**os.environ, "SASL_MECHANISM": "SCRAM-SHA-512",
                                    "SASL_USER": "alice", "SASL_PASSWORD": "not-hers"})
        assert wrong.returncode == 1 and wrong.stdout.startswith("failed create"), wrong.stdout
        assert proxy.sample("gatehouse_responses_total", api="SaslAuthenticate",
                            error="SASL_AUTHENTICATION_FAILED") >= 1


def test_a_floor_on_produce_versions_keeps_old_sarama_out_and_lets_franz_go_in(
        kafka: KafkaCluster) -> None:
    """``min_api_version: {Produce: 9}``: Sarama held to Kafka 2.1's versions (Produce v7)
    is answered UNSUPPORTED_VERSION and reports it; franz-go (v13) goes through."""
    floor = "- name: no-ancient-producers\n  min_api_version: {Produce: 9}\n"
    with ProxyThread(kafka.bootstrap, rules_yaml=floor) as proxy:
        runs = {client: subprocess.run(
            [str(ensure_gokafka()), client, proxy.bootstrap, f"a-{client}",
             unique(f"floor-{client}"), unique("floor"), "3"],
            capture_output=True, text=True, timeout=180) for client in ("sarama", "franz")}
        refused = proxy.sample("gatehouse_rule_decisions_total",
                               rule="no-ancient-producers", action="refuse")
    old = runs["sarama"]
    assert old.returncode == 1, old.stdout
    # Kafka's UNSUPPORTED_VERSION, as Sarama words it.
    assert "failed produce: kafka server: The version of API is not supported" in old.stdout
    assert runs["franz"].returncode == 0, runs["franz"].stdout[-2000:]
    assert refused >= 1
