"""Rules that match the SASL principal, on a real Apache Kafka broker with SCRAM: the
tenant prefix follows the user the broker accepted, not the client id a client picks."""

from __future__ import annotations

from confluent_kafka.admin import AdminClient

from tests.support.clients import consume, produce, unique, watermarks
from tests.support.kafka import SCRAM_USER, KafkaCluster
from tests.support.proxythread import ProxyThread

RULES = (f"- name: by-user\n  match: {{principal: '^{SCRAM_USER}$'}}\n"
         f"  topic_prefix: {{broker: '{SCRAM_USER}.', hide_others: true, groups: true}}\n")


def test_the_tenant_prefix_follows_the_authenticated_user_not_the_client_id(
        kafka_scram: KafkaCluster) -> None:
    name = unique("orders")
    tenant_topic = f"{SCRAM_USER}.{name}"
    kafka_scram.create_topic(tenant_topic)
    kafka_scram.create_topic(name)
    with ProxyThread(kafka_scram.sasl_bootstrap, rules_yaml=RULES) as proxy:
        conf = {**kafka_scram.client_config(sasl=True), "bootstrap.servers": proxy.bootstrap,
                "client.id": "whatever"}
        sent = produce(conf, name, count=20)
        assert sorted(consume(conf, name, 20)) == sorted(sent)
        admin = AdminClient(conf)
        topics = admin.list_topics(timeout=10).topics
        assert name in topics and tenant_topic not in topics  # its own names only
        assert proxy.sample("gatehouse_principals", principal=SCRAM_USER) >= 1  # admin's
    assert watermarks(kafka_scram.bootstrap, tenant_topic) == (0, 20)
    assert watermarks(kafka_scram.bootstrap, name) == (0, 0)

    # No SASL: naming itself after the user in its client id does not make it the user.
    with ProxyThread(kafka_scram.bootstrap, rules_yaml=RULES) as proxy:
        conf = {"bootstrap.servers": proxy.bootstrap, "client.id": SCRAM_USER}
        produce(conf, name, count=5)
        assert proxy.sample("gatehouse_principals", principal=SCRAM_USER) == 0
    assert watermarks(kafka_scram.bootstrap, name) == (0, 5)
    assert watermarks(kafka_scram.bootstrap, tenant_topic) == (0, 20)


def test_an_oauthbearer_principal_is_the_tokens_subject(kafka_scram: KafkaCluster) -> None:
    """librdkafka's unsecured JWT (the broker's test validator accepts it): the principal
    the broker derives is the token's subject, and so is the proxy's."""
    name = unique("events")
    kafka_scram.create_topic(f"{SCRAM_USER}.{name}")
    with ProxyThread(kafka_scram.sasl_bootstrap, rules_yaml=RULES) as proxy:
        conf = {"bootstrap.servers": proxy.bootstrap, "security.protocol": "SASL_PLAINTEXT",
                "sasl.mechanism": "OAUTHBEARER", "enable.sasl.oauthbearer.unsecure.jwt": True,
                "sasl.oauthbearer.config": f"principal={SCRAM_USER}"}
        sent = produce(conf, name, count=10)
        assert sorted(consume(conf, name, 10)) == sorted(sent)
    assert watermarks(kafka_scram.bootstrap, f"{SCRAM_USER}.{name}") == (0, 10)
