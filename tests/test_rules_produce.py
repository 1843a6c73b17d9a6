"""``produce_policy`` without a broker: the rules file (errors with file:line), what a
Produce request's acks and batch headers break, the refusal as the client gets it,
observe mode, and that a policy keeps such requests off the streaming path."""

from __future__ import annotations

import uuid

import pytest

from gatehouse import codecs
from gatehouse.codecs.records import encode_batch
from gatehouse.configfile import ConfigError
from gatehouse.proxy.hooks import Close, Forward, Pending, Respond
from gatehouse.proxy.policy import RulesPolicy
from gatehouse.rules.errors import POLICY_VIOLATION, UNKNOWN_TOPIC_ID
from gatehouse.rules.produce import ProducePolicy, produce_violation
from tests.test_rules import req, rules
from tests.test_rules_topic_filter import conn, listening, metadata_answer

STRICT = ("- name: strict-producers\n  match: {client_id: '^app'}\n  produce_policy:\n"
          "    acks: all\n    compression: [gzip, zstd]\n    idempotent: true\n")
RECORDS = [(1_700_000_000_000, b"k", b"v")]


ORDERS_ID = uuid.UUID("6f1c2a4e-0d3b-4e8a-9a51-2b7c9d0e1f23")


def produce(acks: int = -1, compression: str = "gzip", producer_id: int = 7,
            version: int = 9, client_id: str = "app-1") -> codecs.Request:
    batch = encode_batch(RECORDS, compression=compression, producer_id=producer_id,
                         producer_epoch=0 if producer_id >= 0 else -1,
                         base_sequence=0 if producer_id >= 0 else -1)
    # v13 names topics by id (KIP-516), earlier versions by name.
    orders = {"topic_id": ORDERS_ID} if version >= 13 else {"name": "orders"}
    audit = {"topic_id": uuid.UUID(int=7)} if version >= 13 else {"name": "audit"}
    return req(0, version, client_id, acks=acks, timeout_ms=1000, topic_data=[
        {**orders, "partition_data": [{"index": 0, "records": batch},
                                      {"index": 1, "records": batch}]},
        {**audit, "partition_data": [{"index": 3, "records": batch}]}])


def test_the_policy_in_the_rules_file() -> None:
    [rule] = rules(STRICT).rules
    assert rule.produce_policy == ProducePolicy(frozenset({-1}), frozenset({"gzip", "zstd"}),
                                                True)
    [rule] = rules("- name: r\n  produce_policy: {acks: [all, 1]}\n").rules
    assert rule.produce_policy == ProducePolicy(frozenset({-1, 1}))


@pytest.mark.parametrize(("policy", "line", "error"), [
    ("{}", 2, "needs at least one of acks, compression, idempotent"),
    ("{acks: most}", 2, "'most' is not all, 1 or 0"),
    ("\n    acks: [all, 2]", 3, "2 is not all, 1 or 0"),
    ("{compression: brotli}", 2, "'brotli' is not one of none, gzip, snappy, lz4, zstd"),
    ("{compression: []}", 2, "at least one codec"),
    ("{idempotent: yes-please}", 2, "idempotent must be"),
    ("{acks: all, batch_size: 5}", 2, "unknown key 'batch_size'"),
])
def test_a_bad_policy_is_refused_with_its_line(policy: str, line: int, error: str) -> None:
    with pytest.raises(ConfigError, match=error) as caught:
        rules(f"- name: r\n  produce_policy: {policy}\n")
    assert caught.value.line == line


def broken(policy: ProducePolicy, body: object) -> str | None:
    """What ``body`` breaks of ``policy``: always a POLICY_VIOLATION here (no topics)."""
    found = produce_violation(policy, body)
    assert found is None or found[0] == POLICY_VIOLATION
    return None if found is None else found[1]


def test_what_a_request_breaks() -> None:
    strict = rules(STRICT).rules[0].produce_policy
    assert strict is not None
    assert broken(strict, produce().body) is None
    assert broken(strict, produce(acks=1).body) == (
        "acks=1 is not allowed (use acks=all)")
    assert broken(strict, produce(compression="none").body) == (
        "topic orders partition 0: batches compressed with none are not allowed "
        "(compression.type: gzip, zstd)")
    assert broken(strict, produce(producer_id=-1).body) == (
        "topic orders partition 0: the producer is not idempotent (enable.idempotence=true, "
        "or a transactional producer)")
    assert broken(strict, produce(producer_id=-1, version=13).body) == (
        f"topic id {ORDERS_ID} partition 0: the producer is not idempotent "
        "(enable.idempotence=true, or a transactional producer)")
    either = ProducePolicy(acks=frozenset({-1, 1}))
    assert broken(either, produce(acks=0).body) == (
        "acks=0 is not allowed (use acks=all or 1)")
    assert broken(either, produce(acks=1, compression="none").body) is None


def test_a_request_that_breaks_it_is_refused_whole() -> None:
    policy = RulesPolicy(rules(STRICT))
    counted, refused = listening(policy)
    assert isinstance(policy.on_request(conn(), produce()), Forward)
    decision = policy.on_request(conn(), produce(compression="none"))
    assert isinstance(decision, Respond)
    answer = codecs.decode_response(memoryview(bytes(decision.response.encode())), 0, 9)
    partitions = [p for t in answer.body.responses for p in t.partition_responses]
    assert {p.error_code for p in partitions} == {POLICY_VIOLATION}
    assert len(partitions) == 3  # every partition asked about
    assert {p.error_message for p in partitions} == {
        "topic orders partition 0: batches compressed with none are not allowed "
        "(compression.type: gzip, zstd) (rule strict-producers)"}
    assert refused == [("strict-producers", "refuse")]
    assert [(o.rule, o.action, o.effect) for o in counted][-1] == (
        "strict-producers", "produce_policy", "refuse")
    # acks=0: no answer to carry the error; the connection closes, saying why.
    closed = policy.on_request(conn(), produce(acks=0))
    assert isinstance(closed, Close) and "acks=0 is not allowed" in closed.reason
    # Clients the rule does not match, and other APIs, are not held to it.
    other = produce(compression="none", client_id="batch-job")
    assert isinstance(policy.on_request(conn(), other), Forward)


def test_in_observe_mode_the_policy_only_counts() -> None:
    policy = RulesPolicy(rules(STRICT.replace("  match:", "  mode: observe\n  match:")))
    counted, refused = listening(policy)
    request = produce(acks=1)
    decision = policy.on_request(conn(), request)
    assert isinstance(decision, Forward) and decision.request is request
    assert refused == [("strict-producers", "would_refuse")]
    assert ("strict-producers", "produce_policy", "refuse", "observe") in [
        (o.rule, o.action, o.effect, o.mode) for o in counted]
    assert isinstance(policy.on_request(conn(), produce()), Forward)
    assert refused == [("strict-producers", "would_refuse")]  # a good request: nothing


def test_a_policy_keeps_its_clients_produce_requests_off_the_streaming_path() -> None:
    """Their batch headers are read in the whole request, not forwarded as they come."""
    policy = RulesPolicy(rules(STRICT))
    assert policy.forwards_unread(conn(), produce()) is None
    assert policy.forwards_unread(conn(), produce(client_id="batch-job")) is not None


SCOPED = ("- name: orders-compressed\n  produce_policy:\n    topics: ['ord.*']\n"
          "    compression: gzip\n    acks: all\n")


def only_audit(acks: int = 1, version: int = 9) -> codecs.Request:
    audit = {"topic_id": uuid.UUID(int=7)} if version >= 13 else {"name": "audit"}
    return req(0, version, "app-1", acks=acks, timeout_ms=1000, topic_data=[
        {**audit, "partition_data": [{"index": 0, "records": encode_batch(RECORDS)}]}])


def test_a_policy_for_some_topics() -> None:
    """Only the batches of the topics it names are held to it, and only a request
    writing to one of them to its acks; topics named by id are matched through the ids
    learned from Metadata answers, an id not learned yet answered UNKNOWN_TOPIC_ID."""
    [rule] = rules(SCOPED).rules
    assert rule.produce_policy is not None
    assert [p.pattern for p in rule.produce_policy.topics or ()] == ["ord.*"]
    with pytest.raises(ConfigError, match=r"produce_policy\.topics must name at least one"):
        rules("- name: r\n  produce_policy: {acks: all, topics: []}\n")
    policy = RulesPolicy(rules(SCOPED))
    assert isinstance(policy.on_request(conn(), only_audit()), Forward)  # acks=1, none
    decision = policy.on_request(conn(), produce(compression="none"))
    assert isinstance(decision, Respond)
    [message] = {p.error_message for t in decision.response.body.responses
                 for p in t.partition_responses}
    assert message == ("topic orders partition 0: batches compressed with none are not "
                       "allowed (compression.type: gzip) (rule orders-compressed)")
    assert isinstance(policy.on_request(conn(), produce(compression="gzip")), Forward)
    # Produce v13: ids.  Not learned yet, every topic is answered UNKNOWN_TOPIC_ID...
    unseen = policy.on_request(conn(), only_audit(version=13))
    assert isinstance(unseen, Respond)
    assert {p.error_code for t in unseen.response.body.responses
            for p in t.partition_responses} == {UNKNOWN_TOPIC_ID}
    # ... and once the Metadata answer that pairs them with names went by, matched.
    metadata = req(3, 12, "app-1", topics=None, allow_auto_topic_creation=False,
                   include_topic_authorized_operations=False)
    learning = policy.on_request(conn(), metadata)
    assert isinstance(learning, Forward) and learning.wants_response
    policy.on_response(conn(), Pending(1, 3, 12, 0.0, context=learning.context),
                       metadata_answer(("orders", ORDERS_ID), ("audit", uuid.UUID(int=7))))
    assert isinstance(policy.on_request(conn(), only_audit(version=13)), Forward)
    refused = policy.on_request(conn(), produce(compression="none", version=13))
    assert isinstance(refused, Respond)
    assert {p.error_code for t in refused.response.body.responses
            for p in t.partition_responses} == {POLICY_VIOLATION}
    assert isinstance(policy.on_request(conn(), produce(compression="gzip", version=13)),
                      Forward)
