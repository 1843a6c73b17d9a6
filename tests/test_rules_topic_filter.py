"""Topics a client may use (``allow_topics`` / ``deny_topics``): the others are hidden
from answers, ids included, and a request that names one is refused with
TOPIC_AUTHORIZATION_FAILED, as a broker refuses a client its ACLs do not allow."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from gatehouse import codecs
from gatehouse.configfile import ConfigError, load_yaml_text
from gatehouse.proxy.hooks import ConnectionInfo, Forward, Pending, Respond
from gatehouse.proxy.policy import RulesPolicy
from gatehouse.rules import Chain, Prefix, TopicFilter, parse_rules
from gatehouse.rules.errors import error_response
from tests.test_rules import req, rules

TOPIC_AUTHORIZATION_FAILED, UNKNOWN_TOPIC_ID = 29, 100
ORDERS, PAYROLL = uuid.uuid4(), uuid.uuid4()
FILTER = ('- name: orders-only\n  match: {client_id: "^app"}\n'
          '  allow_topics: ["orders.*", "audit"]\n  deny_topics: ["orders\\\\.secret.*"]\n')


def conn() -> ConnectionInfo:
    return ConnectionInfo(id=1, client="127.0.0.1:1", listener="bootstrap")


def metadata_answer(*names: tuple[str, uuid.UUID]) -> codecs.Response:
    body = {"brokers": [], "topics": [{"name": n, "topic_id": i, "partitions": []}
                                      for n, i in names]}
    frame = bytes(codecs.response_from_dict({"header": {"correlation_id": 1}, "body": body},
                                            api_key=3, api_version=12).encode())
    return codecs.decode_response(memoryview(frame), 3, 12)


def answered(policy: RulesPolicy, decision: Forward, broker_body: dict[str, Any] | None = None
             ) -> Any:
    """The client's answer (read back from bytes) when the broker answers what was sent
    (``broker_body``, or every entry sent without error)."""
    sent = decision.request
    key, version = sent.api_key, sent.api_version
    broker = (error_response(sent, 0) if broker_body is None else codecs.response_from_dict(
        {"header": {"correlation_id": 1}, "body": broker_body}, api_key=key,
        api_version=version))
    got = policy.on_response(conn(), Pending(1, key, version, 0.0, wants_response=True,
                                             context=decision.context),
                             codecs.decode_response(memoryview(bytes(broker.encode())), key,
                                                    version))
    return codecs.decode_response(memoryview(bytes(got.encode())), key, version).body


def listening(policy: RulesPolicy) -> tuple[list[Any], list[tuple[str, str]]]:
    counted: list[Any] = []
    refused: list[tuple[str, str]] = []
    policy.outcome_listeners.append(counted.append)
    policy.refusal_listeners.append(lambda c, r, rule, action: refused.append((rule, action)))
    return counted, refused


def produce(topic: str, version: int = 9) -> codecs.Request:
    return req(0, version, "app-1", acks=-1, timeout_ms=1000, topic_data=[
        {"name": topic, "partition_data": [{"index": 0, "records": b"\x01" * 70}]}])


def test_the_filter_says_which_names_a_client_may_use() -> None:
    [rule] = rules(FILTER).rules
    assert isinstance(rule.topic_map, TopicFilter)
    permits = rule.topic_map.permits
    assert permits("orders") and permits("orders.eu") and permits("audit")
    assert not permits("orders.secret.keys")  # denied, though allowed by pattern
    assert not permits("payroll") and not permits("audit-2")  # whole names only
    deny_only = rules("- name: d\n  deny_topics: payroll\n").rules[0].topic_map
    assert isinstance(deny_only, TopicFilter)
    assert deny_only.permits("anything") and not deny_only.permits("payroll")


def test_with_a_prefix_in_the_same_rule_the_filter_sees_the_clients_names() -> None:
    [rule] = rules('- name: t\n  topic_prefix: {broker: "a."}\n  allow_topics: [orders]\n'
                   ).rules
    topic_map = rule.topic_map
    assert isinstance(topic_map, Chain)
    assert isinstance(topic_map.maps[0], TopicFilter) and isinstance(topic_map.maps[1], Prefix)
    assert not topic_map.denies("orders") and topic_map.denies("payroll")
    assert topic_map.to_client("a.orders") == "orders"
    assert topic_map.to_client("a.payroll") is None and topic_map.to_client("b.x") is None


def test_answers_show_only_the_allowed_topics() -> None:
    policy = RulesPolicy(rules(FILTER))
    decision = policy.on_request(conn(), req(3, 12, "app-1", topics=None))
    assert isinstance(decision, Forward) and decision.wants_response
    shown = policy.on_response(conn(), Pending(1, 3, 12, 0.0, wants_response=True,
                                               context=decision.context),
                               metadata_answer(("orders", ORDERS), ("payroll", PAYROLL)))
    assert [t.name for t in shown.body.topics] == ["orders"]

    # The hidden topic's id is refused as another tenant's is (rules.topicids).
    fetch = req(1, 17, "app-1", max_wait_ms=1, min_bytes=1, max_bytes=1, session_id=0,
                session_epoch=-1, topics=[{"topic_id": PAYROLL, "partitions": [
                    {"partition": 0, "fetch_offset": 0}]}])
    refused = policy.on_request(conn(), fetch)
    assert isinstance(refused, Respond)
    body = codecs.decode_response(memoryview(bytes(refused.response.encode())), 1, 17).body
    assert {p.error_code for t in body.responses for p in t.partitions} == {UNKNOWN_TOPIC_ID}
    allowed = req(1, 17, "app-1", max_wait_ms=1, min_bytes=1, max_bytes=1, session_id=0,
                  session_epoch=-1, topics=[{"topic_id": ORDERS, "partitions": [
                      {"partition": 0, "fetch_offset": 0}]}])
    assert isinstance(policy.on_request(conn(), allowed), Forward)


@pytest.mark.parametrize(("topic", "action"), [("payroll", "allow_topics"),
                                               ("orders.secret.keys", "deny_topics")])
def test_a_request_naming_a_topic_not_allowed_is_refused(topic: str, action: str) -> None:
    policy = RulesPolicy(rules(FILTER))
    counted, refused = listening(policy)
    decision = policy.on_request(conn(), produce(topic))
    assert isinstance(decision, Respond)
    answer = codecs.decode_response(memoryview(bytes(decision.response.encode())), 0, 9)
    assert [t.name for t in answer.body.responses] == [topic]
    assert {p.error_code for t in answer.body.responses
            for p in t.partition_responses} == {TOPIC_AUTHORIZATION_FAILED}
    assert refused == [("orders-only", "refuse")]
    assert [(o.rule, o.action, o.effect, o.mode) for o in counted] == [
        ("orders-only", action, "refuse", "enforce")]

    # An allowed topic goes through untouched; so does any topic for another client.
    ok = codecs.decode_request(memoryview(bytes(produce("orders").encode())))
    decision = policy.on_request(conn(), ok)
    assert isinstance(decision, Forward) and decision.request is ok
    assert not ok.body_decoded  # its topics read from its bytes
    other = req(0, 9, "ops", acks=-1, timeout_ms=1000, topic_data=[
        {"name": topic, "partition_data": [{"index": 0, "records": b"\x01" * 70}]}])
    assert isinstance(policy.on_request(conn(), other), Forward)


def test_a_large_request_is_checked_whole_under_a_filter() -> None:
    policy = RulesPolicy(rules(FILTER))
    assert policy.forwards_unread(conn(), produce("orders")) is None


def observed(rules_text: str, request: codecs.Request, rule: str, action: str
             ) -> tuple[RulesPolicy, list[Any]]:
    """``rules_text`` in observe mode lets ``request`` through untouched, and logs and
    counts that ``rule`` would refuse it for ``action``; the policy and its counts."""
    policy = RulesPolicy(rules(rules_text.replace("match:", "mode: observe\n  match:")))
    counted, refused = listening(policy)
    decision = policy.on_request(conn(), request)
    assert isinstance(decision, Forward) and decision.request is request
    assert refused == [(rule, "would_refuse")]
    assert (rule, action, "refuse", "observe") in [
        (o.rule, o.action, o.effect, o.mode) for o in counted]
    return policy, counted


def test_in_observe_mode_nothing_is_refused_and_what_would_be_is_counted() -> None:
    policy, counted = observed(FILTER, produce("payroll"), "orders-only", "allow_topics")
    counted.clear()
    assert isinstance(policy.on_request(conn(), produce("orders")), Forward)
    assert all(o.effect != "refuse" for o in counted)
    # Metadata v0 naming a denied topic, which enforced it refuses: counted too (later
    # versions are answered without it, not refused: not counted).
    observed(FILTER, req(3, 0, "app-1", topics=[{"name": "payroll"}]), "orders-only",
             "allow_topics")
    policy, counted = observed(FILTER, produce("payroll"), "orders-only", "allow_topics")
    counted.clear()
    later = req(3, 12, "app-1", topics=[{"name": "payroll", "topic_id": uuid.UUID(int=0)}])
    assert policy.on_request(conn(), later).request is later  # type: ignore[union-attr]
    assert all(o.effect != "refuse" for o in counted)


@pytest.mark.parametrize(("text", "line", "message"), [
    ("- name: f\n  allow_topics: ['(unclosed']\n", 2, "not a regular expression"),
    ("- name: f\n  deny_topics:\n    - ok\n    - 7\n", 4, "not a regular expression"),
])
def test_bad_patterns_say_file_and_line(text: str, line: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        parse_rules(load_yaml_text(text, "rules.yaml"), "rules.yaml")
    assert str(info.value).startswith(f"rules.yaml:{line}: ")


def test_a_filter_matched_by_client_id_gets_the_advice_but_not_the_groups_one() -> None:
    advice = rules(FILTER).advice()
    assert len(advice) == 1 and "client id" in advice[0]


def test_the_impact_report_counts_what_a_filter_would_refuse() -> None:
    """The pipeline's "what would this rule block" runs the same decision over the
    observation log's rows (API, version, facts, topic names)."""
    from gatehouse.pipeline.impact import decide

    ruleset = rules(FILTER + '- name: rename\n  rename_topics: {audit: audit.v2}\n')

    def row(*topics: str) -> dict[str, Any]:
        return {"client_id": "app-1", "api_key": 0, "api_version": 9,
                "topic_names": list(topics)}

    refused = decide(ruleset, row("orders", "payroll", "orders.secret.x"))
    assert [(d[0], d[2], d[3], d[6]) for d in refused] == [
        ("orders-only", "allow_topics", "refuse", ["payroll", "orders.secret.x"])]
    assert decide(ruleset, row("orders")) == []
    assert [(d[0], d[3], d[6]) for d in decide(ruleset, row("audit"))] == [
        ("rename", "rewrite", ["audit -> audit.v2"])]


def fetch_of(*topics: str) -> codecs.Request:
    return req(1, 12, "app-1", max_wait_ms=1, min_bytes=1, max_bytes=1, session_id=5,
               session_epoch=2, topics=[{"topic": t, "partitions": [
                   {"partition": 0, "fetch_offset": 0}]} for t in topics],
               forgotten_topics_data=[{"topic": "payroll", "partitions": [1]},
                                      {"topic": "orders", "partitions": [1]}])


def test_a_fetch_keeps_its_session_and_metadata_is_answered_without_the_topic() -> None:
    policy = RulesPolicy(rules(FILTER))
    # The allowed topic is fetched, the denied one answered by the proxy, as a broker's
    # ACLs answer it; the session is the broker's.  A forgotten denied topic is dropped
    # (the broker never had it in the session).
    decision = policy.on_request(conn(), fetch_of("orders", "payroll"))
    assert isinstance(decision, Forward) and decision.wants_response
    sent = decision.request.body
    assert [t.topic for t in sent.topics] == ["orders"]
    assert [t.topic for t in sent.forgotten_topics_data] == ["orders"]
    body = answered(policy, decision, {"error_code": 0, "session_id": 5, "responses": [
        {"topic": "orders", "partitions": [{"partition_index": 0, "high_watermark": 7,
                                             "records": b""}]}]})
    assert (body.error_code, body.session_id) == (0, 5)
    assert [(t.topic, [(p.partition_index, p.error_code, p.high_watermark)
                       for p in t.partitions]) for t in body.responses] == [
        ("orders", [(0, 0, 7)]), ("payroll", [(0, TOPIC_AUTHORIZATION_FAILED, -1)])]
    # Nothing allowed in it: answered whole, with no top-level error (it would end the
    # fetch session).
    decision = policy.on_request(conn(), fetch_of("payroll"))
    assert isinstance(decision, Respond)
    body = codecs.decode_response(memoryview(bytes(decision.response.encode())), 1, 12).body
    assert body.error_code == 0
    assert {p.error_code for t in body.responses for p in t.partitions} == {
        TOPIC_AUTHORIZATION_FAILED}

    # A Metadata request for an allowed and a denied topic goes on without the denied
    # one (a broker that creates the topics Metadata asks for would create it); an
    # answer that holds it anyway leaves it out, as it leaves out another tenant's.
    asked = req(3, 12, "app-1", topics=[{"name": "orders", "topic_id": uuid.UUID(int=0)},
                                        {"name": "payroll", "topic_id": uuid.UUID(int=0)}],
                allow_auto_topic_creation=True)
    decision = policy.on_request(conn(), asked)
    assert isinstance(decision, Forward)
    assert [t.name for t in decision.request.body.topics] == ["orders"]
    assert decision.request.body.allow_auto_topic_creation
    shown = policy.on_response(conn(), Pending(1, 3, 12, 0.0, wants_response=True,
                                               context=decision.context),
                               metadata_answer(("orders", ORDERS), ("payroll", PAYROLL)))
    assert [t.name for t in shown.body.topics] == ["orders"]
    # Asked for denied ones only: asked for none (not null: every topic).
    only = policy.on_request(conn(), req(3, 12, "app-1", topics=[
        {"name": "payroll", "topic_id": uuid.UUID(int=0)}]))
    assert isinstance(only, Forward) and only.request.body.topics == ()
    # v0 reads an empty list as every topic (and creates what it asks for): refused,
    # as other requests that name a topic the client may not use.
    old = policy.on_request(conn(), req(3, 0, "app-1", topics=[{"name": "payroll"}]))
    assert isinstance(old, Respond)
    assert [(t.name, t.error_code) for t in old.response.body.topics] == [
        ("payroll", TOPIC_AUTHORIZATION_FAILED)]


def test_a_group_member_subscribes_only_to_the_topics_it_may_use() -> None:
    """In a group whose members are filtered differently, a leader that may use every
    topic assigns by the subscriptions it is sent: a member's subscription must not name
    a topic its answers leave out, or that topic's partitions go to a member that never
    reads them."""
    policy = RulesPolicy(rules(FILTER))
    owned = codecs.consumer.SUBSCRIPTION.structs["TopicPartition"].cls
    subscription = codecs.consumer.subscription(
        1, topics=("orders", "payroll"), user_data=None,
        owned_partitions=(owned(topic="orders", partitions=(0,)),
                          owned(topic="payroll", partitions=(1,))))
    join = req(11, 9, "app-1", group_id="g", session_timeout_ms=10000,
               rebalance_timeout_ms=10000, member_id="", group_instance_id=None,
               protocol_type="consumer", reason=None,
               protocols=[{"name": "range", "metadata": subscription.encode()}])
    decision = policy.on_request(conn(), join)
    assert isinstance(decision, Forward)
    sent = codecs.consumer.decode_subscription(decision.request.body.protocols[0].metadata)
    assert sent.body.topics == ("orders",)
    assert [(p.topic, p.partitions) for p in sent.body.owned_partitions] == [("orders", (0,))]

    # Another client's subscription goes up as it is.
    other = req(11, 9, "ops", group_id="g", session_timeout_ms=10000,
                rebalance_timeout_ms=10000, member_id="", group_instance_id=None,
                protocol_type="consumer", reason=None,
                protocols=[{"name": "range", "metadata": subscription.encode()}])
    decision = policy.on_request(conn(), other)
    assert isinstance(decision, Forward) and decision.request is other
