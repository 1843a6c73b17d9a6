"""``topic_policy`` on a real Apache Kafka broker, with real admin clients: librdkafka
creates topics (some break the policy: those get POLICY_VIOLATION with the reason, the
others are created), adds partitions and changes configs (IncrementalAlterConfigs);
kafka-python replaces configs (AlterConfigs); the Java TopicCommand is refused a topic
with too many partitions.  What the broker ends up holding is read directly."""

from __future__ import annotations

import logging

import confluent_kafka as ck
import pytest
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewPartitions,
    NewTopic,
)
from kafka import KafkaAdminClient
from kafka.admin import ConfigResource as PyConfigResource
from kafka.admin import ConfigResourceType

from tests.integration.test_sasl_proxy import logged
from tests.support.clients import unique
from tests.support.kafka import KafkaCluster
from tests.support.proxythread import ProxyThread

RULES = """\
- name: topic-standards
  topic_policy:
    names: ['team\\.[a-z0-9.-]+']
    partitions: {max: 12}
    configs:
      retention.ms: {min: 3600000, max: 604800000}
      cleanup.policy: {allow: [delete, compact], required: true}
"""


def errors_of(futures: dict[object, object]) -> dict[str, ck.KafkaError | None]:
    """Each future's error (None: it succeeded), by its topic (or resource) name."""
    out: dict[str, ck.KafkaError | None] = {}
    for key, future in futures.items():
        name = getattr(key, "name", key)
        try:
            future.result(30)  # type: ignore[attr-defined]
            out[str(name)] = None
        except ck.KafkaException as exc:
            out[str(name)] = exc.args[0]
    return out


def topic_config(admin: AdminClient, topic: str, name: str) -> str | None:
    resource = ConfigResource(ConfigResource.Type.TOPIC, topic)
    entries = admin.describe_configs([resource])[resource].result(30)
    return entries[name].value


def test_topics_are_created_and_changed_only_as_the_policy_says(
        kafka: KafkaCluster, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gatehouse.rules")
    ok, wide, bare, forever = (unique(f"team.{n}") for n in ("ok", "wide", "bare", "forever"))
    misnamed = unique("scratch")
    direct = AdminClient({"bootstrap.servers": kafka.bootstrap})
    with ProxyThread(kafka.bootstrap, rules_yaml=RULES) as proxy:
        admin = AdminClient({"bootstrap.servers": proxy.bootstrap})
        # validate_only: the answers the real request would get, nothing created.
        checked = errors_of(admin.create_topics(
            [NewTopic(ok, 3, 1, config={"cleanup.policy": "delete"}),
             NewTopic(wide, 48, 1, config={"cleanup.policy": "delete"})],
            validate_only=True))
        assert checked[ok] is None
        assert checked[wide] is not None and checked[wide].code() == ck.KafkaError.POLICY_VIOLATION
        created = errors_of(admin.create_topics([
            NewTopic(ok, 3, 1, config={"cleanup.policy": "compact,delete"}),
            NewTopic(wide, 48, 1, config={"cleanup.policy": "delete"}),
            NewTopic(bare, 1, 1),
            NewTopic(forever, 1, 1, config={"cleanup.policy": "delete", "retention.ms": "-1"}),
            NewTopic(misnamed, 1, 1, config={"cleanup.policy": "delete"})]))
        assert created[ok] is None
        refused = {name: err for name, err in created.items() if err is not None}
        assert {name: err.code() for name, err in refused.items()} == {
            wide: ck.KafkaError.POLICY_VIOLATION, bare: ck.KafkaError.POLICY_VIOLATION,
            forever: ck.KafkaError.POLICY_VIOLATION, misnamed: ck.KafkaError.POLICY_VIOLATION}
        assert refused[wide].str() == (f"topic {wide}: partition count 48 is above the "
                                       "maximum 12 (rule topic-standards)")
        assert refused[bare].str() == (f"topic {bare}: config cleanup.policy is required "
                                       "(rule topic-standards)")
        assert "retention.ms=-1 (-1: unlimited) is above the maximum" in refused[forever].str()
        assert "does not match the naming rule" in refused[misnamed].str()

        # New partitions: 20 in all is too many, 6 is not.
        grown = errors_of(admin.create_partitions([NewPartitions(ok, 20)]))
        assert grown[ok] is not None and grown[ok].code() == ck.KafkaError.POLICY_VIOLATION
        assert errors_of(admin.create_partitions([NewPartitions(ok, 6)])) == {ok: None}

        # Configs changed one by one (IncrementalAlterConfigs).
        def set_retention(value: str) -> ck.KafkaError | None:
            resource = ConfigResource(ConfigResource.Type.TOPIC, ok, incremental_configs=[
                ConfigEntry("retention.ms", value,
                            incremental_operation=AlterConfigOpType.SET)])
            [error] = errors_of(admin.incremental_alter_configs([resource])).values()
            return error

        too_long = set_retention("999999999999")
        assert too_long is not None and too_long.code() == ck.KafkaError.POLICY_VIOLATION
        assert set_retention("86400000") is None

        # Configs replaced whole (AlterConfigs, kafka-python): a retention too short.
        legacy = KafkaAdminClient(bootstrap_servers=proxy.bootstrap, client_id="legacy-admin")
        try:
            answer = legacy.alter_configs([PyConfigResource(
                ConfigResourceType.TOPIC, ok, configs={"retention.ms": "1000"})],
                incremental=False)
        finally:
            legacy.close()
        assert str(answer["topic"][ok]) == (
            f"[Error 44] PolicyViolationError: topic {ok}: config retention.ms=1000 is below "
            "the minimum 3600000 (rule topic-standards)")
        assert proxy.summed("gatehouse_requests_total", api="AlterConfigs") == 1

        # The Java admin tool: its error names the reason.
        java = kafka.run_java_tool(
            "org.apache.kafka.tools.TopicCommand", "--bootstrap-server", proxy.bootstrap,
            "--create", "--topic", unique("team.java"), "--partitions", "24",
            "--config", "cleanup.policy=delete", timeout=120)
        assert java.returncode != 0
        assert "PolicyViolationException" in java.stdout + java.stderr
        assert "partition count 24 is above the maximum 12" in java.stdout + java.stderr
        # A request some of whose topics it refused: one refuse (validate_only's, the
        # create, the partitions, the config change, AlterConfigs, the Java tool's).
        assert proxy.summed("gatehouse_rule_decisions_total", rule="topic-standards",
                            action="refuse") == 6
    # What the broker holds: only what passed.
    names = set(direct.list_topics(timeout=30).topics)
    assert ok in names and not names & {wide, bare, forever, misnamed}
    assert len(direct.list_topics(ok, timeout=30).topics[ok].partitions) == 6
    assert topic_config(direct, ok, "retention.ms") == "86400000"
    assert topic_config(direct, ok, "cleanup.policy") == "compact,delete"
    reasons = [f["reason"] for f in logged(caplog, "refused") if f.get("rule") == "topic-standards"]
    assert any("partition count 48" in r for r in reasons)


def test_topics_created_on_request_follow_the_naming_rule(kafka: KafkaCluster) -> None:
    """The broker creates a topic a producer asks Metadata for
    (auto.create.topics.enable, Kafka's default, as here): through the proxy, one
    whose name breaks the naming rule is not created (librdkafka's record to it
    fails), one that follows it is; with a config the policy requires, none is (a
    topic created on request has none)."""
    names_only = "- name: names\n  topic_policy: {names: ['team\\.[a-z0-9.-]+']}\n"
    tag = unique("x").replace("-", "")
    bad, good, required = f"Team_{tag}", f"team.{tag}", f"team.req{tag}"

    def produce_to(rules: str, topic: str) -> ck.KafkaError | None:
        errors: list[ck.KafkaError | None] = []
        with ProxyThread(kafka.bootstrap, rules_yaml=rules) as proxy:
            producer = ck.Producer({"bootstrap.servers": proxy.bootstrap, "log_level": 0,
                                    "message.timeout.ms": 4000})
            producer.produce(topic, b"x", on_delivery=lambda err, _m: errors.append(err))
            producer.flush(20)
        assert len(errors) == 1
        return errors[0]

    assert produce_to(names_only, bad) is not None
    assert produce_to(names_only, good) is None
    assert produce_to(RULES, required) is not None
    topics = AdminClient({"bootstrap.servers": kafka.bootstrap}).list_topics(timeout=10).topics
    assert good in topics and bad not in topics and required not in topics
