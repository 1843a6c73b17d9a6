"""Group ids and transactional ids a client may use (``allow_groups``,
``allow_transactional_ids``...), on a real Apache Kafka broker with real clients: a
group or transactional id outside the rule is refused as a broker's ACLs refuse it,
listings leave such groups out, and the clients go on with the ids they may use."""

from __future__ import annotations

import confluent_kafka as ck
import pytest
from confluent_kafka.admin import AdminClient

from tests.integration.test_rules_topic_ids import call
from tests.support.clients import produce, unique
from tests.support.kafka import KafkaCluster
from tests.support.proxythread import ProxyThread

GROUP_AUTHORIZATION_FAILED = 30
RULES = ("- name: team-a\n  match: {client_id: '^app'}\n"
         "  allow_groups: ['team-a\\..*']\n  allow_transactional_ids: ['team-a-.*']\n")


def first_error(consumer: ck.Consumer, polls: int = 100) -> ck.KafkaError | None:
    for _ in range(polls):
        message = consumer.poll(0.2)
        if message is not None and message.error() is not None:
            return message.error()
    return None


def test_clients_use_only_the_groups_and_transactional_ids_they_may(
        kafka: KafkaCluster) -> None:
    from kafka import KafkaConsumer
    from kafka.errors import GroupAuthorizationFailedError

    topic = unique("ids")
    kafka.create_topic(topic)
    mine, theirs = unique("team-a.g"), unique("team-b.g")
    with ProxyThread(kafka.bootstrap, rules_yaml=RULES) as proxy:
        conf = {"bootstrap.servers": proxy.bootstrap, "client.id": "app-1"}
        sent = produce(conf, topic, count=10)
        # The allowed group consumes and commits.
        reader = ck.Consumer({**conf, "group.id": mine, "auto.offset.reset": "earliest",
                              "enable.auto.commit": False})
        reader.subscribe([topic])
        got: list[bytes] = []
        for _ in range(150):
            message = reader.poll(0.2)
            if message is not None and message.error() is None:
                got.append(message.value())
            if len(got) == 10:
                break
        reader.commit(asynchronous=False)
        reader.close()
        assert sorted(got) == sorted(sent)

        # Another team's group: librdkafka reports the authorization error.
        outsider = ck.Consumer({**conf, "group.id": theirs, "auto.offset.reset": "earliest",
                                "log_level": 0})
        outsider.subscribe([topic])
        error = first_error(outsider)
        outsider.close()
        assert error is not None and error.code() == ck.KafkaError.GROUP_AUTHORIZATION_FAILED
        # So does kafka-python.
        kp = KafkaConsumer(topic, bootstrap_servers=proxy.bootstrap, client_id="app-kp",
                           group_id=theirs, consumer_timeout_ms=5000)
        with pytest.raises(GroupAuthorizationFailedError):
            kp.poll(timeout_ms=10_000)
            kp.poll(timeout_ms=10_000)
        kp.close()

        # A transactional id outside the rule cannot start a transaction; its own can.
        denied = ck.Producer({**conf, "transactional.id": "payments-1", "log_level": 0})
        with pytest.raises(ck.KafkaException) as refused:
            denied.init_transactions(20)
        assert refused.value.args[0].code() == \
            ck.KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED
        allowed = ck.Producer({**conf, "transactional.id": unique("team-a-tx")})
        allowed.init_transactions(30)
        allowed.begin_transaction()
        allowed.produce(topic, b"in-a-transaction")
        allowed.commit_transaction(30)

        # Listings: the team sees its own group only; a client the rule does not match
        # (here one that gives the other team's group offsets) sees every group.
        ops_conf = {"bootstrap.servers": proxy.bootstrap, "client.id": "ops"}
        ops_reader = ck.Consumer({**ops_conf, "group.id": theirs,
                                  "auto.offset.reset": "earliest"})
        ops_reader.subscribe([topic])
        message = next((m for m in (ops_reader.poll(0.5) for _ in range(60))
                        if m is not None and m.error() is None), None)
        assert message is not None
        ops_reader.commit(message, asynchronous=False)
        ops_reader.close()
        ops = AdminClient(ops_conf)
        ops_seen = {g.group_id for g in ops.list_consumer_groups().result(20).valid}
        assert {mine, theirs} <= ops_seen
        admin = AdminClient(conf)
        listed = {g.group_id for g in admin.list_consumer_groups().result(20).valid}
        assert mine in listed and theirs not in listed
        described = admin.describe_consumer_groups([mine])[mine].result(20)
        assert described.group_id == mine
        # Both groups in one request: each answered on its own, as a broker's ACLs
        # answer them (the proxy used to refuse the whole request).
        both = call(proxy.bootstrap, 15, 5, {"groups": [mine, theirs],
                                             "include_authorized_operations": False},
                    client_id="app-raw")
        assert [(g.group_id, g.error_code, g.group_state) for g in both.groups] == [
            (mine, 0, "Empty"), (theirs, GROUP_AUTHORIZATION_FAILED, "")]
        found = call(proxy.bootstrap, 10, 4, {"key_type": 0,
                                              "coordinator_keys": [theirs, mine]},
                     client_id="app-raw")
        assert [(c.key, c.error_code) for c in found.coordinators] == [
            (mine, 0), (theirs, GROUP_AUTHORIZATION_FAILED)]
        assert found.coordinators[0].port in proxy.ports  # the broker's, rewritten
        futures = admin.describe_consumer_groups([mine, theirs])
        assert futures[mine].result(20).group_id == mine
        with pytest.raises(ck.KafkaException) as caught:
            futures[theirs].result(20)
        assert caught.value.args[0].code() == ck.KafkaError.GROUP_AUTHORIZATION_FAILED
        assert proxy.sample("gatehouse_rule_decisions_total", rule="team-a",
                            action="refuse") >= 3
