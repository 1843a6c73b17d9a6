"""``topic_policy``: the rule's parsing (file:line errors), each API's topics judged one
by one, the request split into what goes on and the proxy's POLICY_VIOLATION answer,
the two answers merged, observe mode, and names judged as the client gives them under
a prefix.  Real clients against a real broker: tests/integration/test_rules_topic_policy.py."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gatehouse import codecs
from gatehouse.configfile import ConfigError
from gatehouse.proxy.hooks import Forward, Pending, Respond
from gatehouse.proxy.policy import RulesPolicy
from gatehouse.rules.errors import POLICY_VIOLATION, error_response
from tests.codec_strategies import build_message, examples, message_body
from tests.test_rules import req, rules
from tests.test_rules_topic_filter import conn, listening

CREATE_TOPICS, ALTER_CONFIGS, CREATE_PARTITIONS, INCREMENTAL = 19, 33, 37, 44

POLICY = """\
- name: topic-standards
  topic_policy:
    names: ['[a-z]+\\.[a-z0-9.-]+']
    partitions: {min: 1, max: 12}
    replication_factor: {max: 3}
    configs:
      retention.ms: {min: 3600000, max: 604800000}
      cleanup.policy: {allow: [delete, compact], required: true}
      min.cleanable.dirty.ratio: {max: 0.9}
"""


NAMES_ONLY = "- name: names\n  topic_policy: {names: ['[a-z]+\\.[a-z0-9.-]+']}\n"


def topic(name: str, partitions: int = 3, replicas: int = 1, **configs: str) -> dict[str, Any]:
    return {"name": name, "num_partitions": partitions, "replication_factor": replicas,
            "assignments": [], "configs": [{"name": k.replace("_", "."), "value": v}
                                           for k, v in configs.items()]}


def create(*topics: dict[str, Any], version: int = 7) -> codecs.Request:
    return req(CREATE_TOPICS, version, "admin", topics=list(topics), timeout_ms=30000,
               validate_only=False)


def answer_of(request: codecs.Request, **codes: int) -> codecs.Response:
    """The broker's answer to ``request``: each topic's code (default NONE)."""
    since_v5 = request.api_version >= 5  # the answer says what was created
    entries = [{"name": t.name, "error_code": codes.get(t.name, 0), "error_message": None,
                **({"num_partitions": t.num_partitions,
                    "replication_factor": t.replication_factor} if since_v5 else {})}
               for t in request.body.topics]
    built = codecs.response_from_dict({"header": {"correlation_id": 1},
                                       "body": {"topics": entries}},
                                      api_key=CREATE_TOPICS, api_version=request.api_version)
    return codecs.decode_response(memoryview(bytes(built.encode())), CREATE_TOPICS,
                                  request.api_version)


def test_the_policy_parses() -> None:
    [rule] = rules(POLICY).rules
    policy = rule.topic_policy
    assert policy is not None and [p.pattern for p in policy.names or ()] == [
        "[a-z]+\\.[a-z0-9.-]+"]
    assert (policy.partitions.min, policy.partitions.max) == (1, 12)  # type: ignore[union-attr]
    assert policy.replication_factor is not None and policy.replication_factor.min is None
    assert policy.configs["cleanup.policy"].allow == {"delete", "compact"}
    assert policy.configs["cleanup.policy"].required
    assert policy.configs["min.cleanable.dirty.ratio"].max == 0.9


@pytest.mark.parametrize(("text", "line", "message"), [
    ("  topic_policy: {}\n", 2, "needs at least one of names, partitions"),
    ("  topic_policy: {partitions: {min: 0}}\n", 2, "partitions.min must be a whole number "
     "of at least 1, not 0"),
    ("  topic_policy:\n    partitions: {min: 5, max: 2}\n", 3, "max 2 is below min 5"),
    ("  topic_policy:\n    partitions: {}\n", 3, "partitions needs min, max or both"),
    ("  topic_policy:\n    replication_factor: {most: 3}\n", 3, "unknown key 'most'"),
    ("  topic_policy:\n    names: ['(unclosed']\n", 3, "is not a regular expression"),
    ("  topic_policy:\n    configs:\n      retention.ms: 5\n", 4, "expected a mapping"),
    ("  topic_policy:\n    configs:\n      retention.ms: {}\n", 4,
     "configs.retention.ms needs min, max, allow or required"),
    ("  topic_policy:\n    configs:\n      cleanup.policy: {allow: [delete], max: 3}\n", 4,
     "allow a list of values, or bound a number"),
    ("  topic_policy:\n    configs:\n      retention.ms:\n        min: true\n", 5,
     "retention.ms.min must be an integer or a number, not a boolean"),
    ("  topic_policy:\n    size: 3\n", 3, "unknown key 'size'"),
])
def test_a_bad_policy_is_refused_with_its_line(text: str, line: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        rules("- name: r\n" + text)
    assert caught.value.line == line, caught.value


@pytest.mark.parametrize("version", [2, 4, 5, 7])
def test_the_topics_that_break_it_are_answered_and_the_others_go_on(version: int) -> None:
    policy = RulesPolicy(rules(POLICY))
    counted, refused = listening(policy)
    request = create(topic("team.ok", cleanup_policy="compact,delete"),
                     topic("Team_Bad", cleanup_policy="delete"),
                     topic("team.wide", 48, cleanup_policy="delete"),
                     topic("team.forever", -1, -1, cleanup_policy="delete", retention_ms="-1"),
                     topic("team.bare"),
                     topic("team.defaults", -1, -1, cleanup_policy="delete"),
                     version=version)
    decision = policy.on_request(conn(), request)
    assert isinstance(decision, Forward) and decision.wants_response
    # Sent on: only what passes (the brokers' defaults, -1, pass).
    sent = codecs.decode_request(bytes(decision.request.encode()))
    assert [t.name for t in sent.body.topics] == ["team.ok", "team.defaults"]
    assert sent.body.timeout_ms == 30000
    broker = answer_of(sent, **{"team.defaults": 36})  # TOPIC_ALREADY_EXISTS
    answer = policy.on_response(conn(), Pending(1, CREATE_TOPICS, version, 0.0,
                                                context=decision.context), broker)
    back = codecs.decode_response(memoryview(bytes(answer.encode())), CREATE_TOPICS, version)
    codes = {t.name: t.error_code for t in back.body.topics}
    assert codes == {"team.ok": 0, "team.defaults": 36, "Team_Bad": POLICY_VIOLATION,
                     "team.wide": POLICY_VIOLATION, "team.forever": POLICY_VIOLATION,
                     "team.bare": POLICY_VIOLATION}
    messages = {t.name: t.error_message for t in back.body.topics}
    assert messages["Team_Bad"] == ("topic name 'Team_Bad' does not match the naming rule "
                                    "([a-z]+\\.[a-z0-9.-]+) (rule topic-standards)")
    assert messages["team.wide"] == ("topic team.wide: partition count 48 is above the "
                                     "maximum 12 (rule topic-standards)")
    assert messages["team.forever"] == ("topic team.forever: config retention.ms=-1 "
                                        "(-1: unlimited) is above the maximum 604800000 "
                                        "(rule topic-standards)")
    assert messages["team.bare"] == ("topic team.bare: config cleanup.policy is required "
                                     "(rule topic-standards)")
    assert ("topic-standards", "topic_policy", "refuse", "enforce") in [
        (o.rule, o.action, o.effect, o.mode) for o in counted]
    assert set(refused) == {("topic-standards", "refuse")}


def test_when_every_topic_breaks_it_the_proxy_answers_alone() -> None:
    policy = RulesPolicy(rules(POLICY))
    request = create(topic("team.x", 1, 5, cleanup_policy="delete"),
                     topic("team.y", cleanup_policy="delete", retention_ms="60000"))
    decision = policy.on_request(conn(), request)
    assert isinstance(decision, Respond)
    back = codecs.decode_response(memoryview(bytes(decision.response.encode())),
                                  CREATE_TOPICS, 7)
    assert [(t.name, t.error_code, t.error_message) for t in back.body.topics] == [
        ("team.x", POLICY_VIOLATION, "topic team.x: replication factor 5 is above the "
         "maximum 3 (rule topic-standards)"),
        ("team.y", POLICY_VIOLATION, "topic team.y: config retention.ms=60000 is below the "
         "minimum 3600000 (rule topic-standards)")]
    assert back.header.correlation_id == request.correlation_id


def test_replica_assignments_say_the_partitions_and_the_replicas() -> None:
    policy = RulesPolicy(rules(POLICY))
    assigned = topic("team.manual", -1, -1, cleanup_policy="delete")
    assigned["assignments"] = [{"partition_index": i, "broker_ids": [1, 2, 3, 4]}
                               for i in range(2)]
    decision = policy.on_request(conn(), create(assigned))
    assert isinstance(decision, Respond)
    [entry] = decision.response.body.topics
    assert entry.error_message == ("topic team.manual: replication factor 4 is above the "
                                   "maximum 3 (rule topic-standards)")


def test_observe_mode_counts_and_changes_nothing() -> None:
    policy = RulesPolicy(rules(POLICY.replace("  topic_policy:", "  mode: observe\n"
                                              "  topic_policy:")))
    counted, refused = listening(policy)
    request = create(topic("team.ok", cleanup_policy="delete"), topic("BAD"))
    decision = policy.on_request(conn(), request)
    assert isinstance(decision, Forward) and decision.request is request
    assert refused == [("topic-standards", "would_refuse")]
    assert ("topic-standards", "topic_policy", "refuse", "observe") in [
        (o.rule, o.action, o.effect, o.mode) for o in counted]


def test_new_partition_counts_are_held_to_it() -> None:
    policy = RulesPolicy(rules(POLICY))
    request = req(CREATE_PARTITIONS, 3, "admin", topics=[
        {"name": "team.a", "count": 20, "assignments": None},
        {"name": "team.b", "count": 6, "assignments": None}], timeout_ms=1000,
        validate_only=True)
    decision = policy.on_request(conn(), request)
    assert isinstance(decision, Forward)
    assert [t.name for t in decision.request.body.topics] == ["team.b"]
    assert decision.request.body.validate_only  # as asked: the real request's answer
    built = codecs.response_from_dict({"header": {"correlation_id": 1}, "body": {"results": [
        {"name": "team.b", "error_code": 0, "error_message": None}]}},
        api_key=CREATE_PARTITIONS, api_version=3)
    answer = policy.on_response(conn(), Pending(1, CREATE_PARTITIONS, 3, 0.0,
                                                context=decision.context), built)
    assert [(r.name, r.error_code, r.error_message) for r in answer.body.results] == [
        ("team.b", 0, None),
        ("team.a", POLICY_VIOLATION, "topic team.a: partition count 20 is above the "
         "maximum 12 (rule topic-standards)")]
    # New partitions placed by hand: their replicas counted.
    placed = req(CREATE_PARTITIONS, 3, "admin", topics=[
        {"name": "team.c", "count": 4, "assignments": [{"broker_ids": [1, 2, 3, 4]}]}],
        timeout_ms=1000, validate_only=False)
    refused = policy.on_request(conn(), placed)
    assert isinstance(refused, Respond)
    assert [r.error_message for r in refused.response.body.results] == [
        "topic team.c: a new partition's replication factor 4 is above the maximum 3 "
        "(rule topic-standards)"]


def test_topic_configs_changed_are_held_to_it_and_other_resources_are_not() -> None:
    policy = RulesPolicy(rules(POLICY))
    incremental = req(INCREMENTAL, 1, "admin", resources=[
        {"resource_type": 2, "resource_name": "team.a", "configs": [
            {"name": "retention.ms", "config_operation": 0, "value": "86400000"},
            {"name": "cleanup.policy", "config_operation": 2, "value": "compact"}]},
        {"resource_type": 2, "resource_name": "team.b", "configs": [
            {"name": "cleanup.policy", "config_operation": 1, "value": None}]},
        {"resource_type": 2, "resource_name": "team.c", "configs": [
            {"name": "cleanup.policy", "config_operation": 2, "value": "archive"}]},
        {"resource_type": 2, "resource_name": "team.d", "configs": [
            {"name": "min.cleanable.dirty.ratio", "config_operation": 0, "value": "lots"}]},
        {"resource_type": 4, "resource_name": "1", "configs": [  # a broker's
            {"name": "retention.ms", "config_operation": 0, "value": "1"}]}],
        validate_only=False)
    decision = policy.on_request(conn(), incremental)
    assert isinstance(decision, Forward)
    assert [r.resource_name for r in decision.request.body.resources] == ["team.a", "1"]
    built = codecs.response_from_dict({"header": {"correlation_id": 1}, "body": {"responses": [
        {"error_code": 0, "error_message": None, "resource_type": r.resource_type,
         "resource_name": r.resource_name} for r in decision.request.body.resources]}},
        api_key=INCREMENTAL, api_version=1)
    answer = policy.on_response(conn(), Pending(1, INCREMENTAL, 1, 0.0,
                                                context=decision.context), built)
    assert {r.resource_name: r.error_message for r in answer.body.responses} == {
        "team.a": None, "1": None,
        "team.b": "topic team.b: config cleanup.policy is required (rule topic-standards)",
        "team.c": "topic team.c: config cleanup.policy=archive is not allowed (allowed: "
                  "compact, delete) (rule topic-standards)",
        "team.d": "topic team.d: config min.cleanable.dirty.ratio=lots is not a number "
                  "(rule topic-standards)"}
    # AlterConfigs replaces a topic's configs: the required one must be among them.
    legacy = req(ALTER_CONFIGS, 2, "admin", resources=[
        {"resource_type": 2, "resource_name": "team.a", "configs": [
            {"name": "retention.ms", "value": "86400000"}]}], validate_only=False)
    refused = policy.on_request(conn(), legacy)
    assert isinstance(refused, Respond)
    [entry] = refused.response.body.responses
    assert (entry.error_code, entry.resource_name) == (POLICY_VIOLATION, "team.a")
    assert entry.error_message == ("topic team.a: config cleanup.policy is required "
                                   "(rule topic-standards)")


def test_names_are_judged_as_the_client_gives_them_under_a_prefix() -> None:
    """The tenant names its topics; the broker holds them prefixed: the convention is
    the client's (the prefix would break it), the answer in the client's names."""
    policy = RulesPolicy(rules(POLICY + "- name: tenant\n  topic_prefix: 'tenant-a_'\n"))
    request = create(topic("team.ok", cleanup_policy="delete"), topic("Bad", 1))
    decision = policy.on_request(conn(), request)
    assert isinstance(decision, Forward)
    sent = codecs.decode_request(bytes(decision.request.encode()))
    assert [t.name for t in sent.body.topics] == ["tenant-a_team.ok"]
    answer = policy.on_response(conn(), Pending(1, CREATE_TOPICS, 7, 0.0,
                                                context=decision.context), answer_of(sent))
    assert {t.name: t.error_code for t in answer.body.topics} == {
        "team.ok": 0, "Bad": POLICY_VIOLATION}


POLICY_CASES = [(key, version) for key in (CREATE_TOPICS, ALTER_CONFIGS, CREATE_PARTITIONS,
                                           INCREMENTAL)
                for version in codecs.APIS[key].versions]


@pytest.mark.parametrize(("api_key", "version"), POLICY_CASES,
                         ids=[f"{codecs.APIS[k].name}-v{v}" for k, v in POLICY_CASES])
@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_request_is_judged_and_every_answer_can_be_written(
        api_key: int, version: int, data: st.DataObject) -> None:
    """Whatever a request of these APIs holds (random bodies from the tables: numbers,
    names, nulls), the policy judges it without failing, and the answers it makes, alone
    or merged with the broker's, encode and decode."""
    spec = codecs.APIS[api_key]
    body = data.draw(message_body(spec.request, version))
    request = codecs.decode_request(bytes(build_message(api_key, version, "request",
                                                        body).encode()))
    policy = RulesPolicy(rules(POLICY))
    decision = policy.on_request(conn(), request)
    if isinstance(decision, Respond):
        answer = decision.response
    else:
        assert isinstance(decision, Forward)
        if not decision.wants_response:
            return
        broker = error_response(decision.request, 0)
        answer = policy.on_response(conn(), Pending(1, api_key, version, 0.0,
                                                    context=decision.context), broker)
    back = codecs.decode_response(memoryview(bytes(answer.encode())), api_key, version)
    assert back.header.correlation_id == request.correlation_id


def asking(*names: str, version: int = 12) -> codecs.Request:
    if version < 4:
        return req(3, version, "app", topics=[{"name": n} for n in names])
    return req(3, version, "app", topics=[
        {"name": n, "topic_id": "00000000-0000-0000-0000-000000000000"} for n in names],
        allow_auto_topic_creation=True)


@pytest.mark.parametrize(("policy", "names", "creates"), [
    (POLICY, ["orders.eu"], False),  # cleanup.policy is required: none on request
    (NAMES_ONLY, ["orders.eu"], True),
    (NAMES_ONLY, ["orders.eu", "Orders_EU"], False),  # one name off the convention
    (NAMES_ONLY.replace("- name", "- mode: observe\n  name"), ["Orders_EU"], True),
])
def test_metadata_creates_only_topics_the_policy_allows(policy: str, names: list[str],
                                                        creates: bool) -> None:
    """A broker creates the topics a Metadata request asks for
    (auto.create.topics.enable), with its defaults: where the policy would refuse such
    a topic (its name, a config it requires), the request goes up without
    allow_auto_topic_creation, the topics that exist described as ever."""
    decision = RulesPolicy(rules(policy)).on_request(conn(), asking(*names))
    assert isinstance(decision, Forward)
    assert [t.name for t in decision.request.body.topics] == names
    assert decision.request.body.allow_auto_topic_creation is creates


def test_metadata_before_v4_cannot_be_held() -> None:
    """v1-v3 have no allow_auto_topic_creation (the broker creates what they ask for):
    they go up as they are (their clients are from before Kafka 0.11)."""
    request = asking("Orders_EU", version=3)
    decision = RulesPolicy(rules(NAMES_ONLY)).on_request(conn(), request)
    assert isinstance(decision, Forward)
    assert bytes(decision.request.encode()) == bytes(request.encode())


def test_a_policy_for_clients_named_by_their_client_id_gets_the_advice() -> None:
    scoped = POLICY.replace("  topic_policy:", "  match: {client_id: '^ops-'}\n  topic_policy:")
    [advice] = rules(scoped).advice()
    assert advice.startswith("rules.yaml:1: rule topic-standards: holds the topics its "
                             "clients create or change to a topic_policy, but tells clients "
                             "apart by what a client says of itself")
    assert rules(POLICY).advice() == []  # every client
    assert rules(scoped.replace("client_id: '^ops-'", "principal: '^ops$'")).advice() == []
    assert rules(scoped.replace("  match:", "  mode: observe\n  match:")).advice() == []
