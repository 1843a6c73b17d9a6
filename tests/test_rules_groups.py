"""Group ids and transactional ids under a tenant prefix with ``groups: true`` and
``transactional_ids: true``: every field the specs mark as such, FindCoordinator's keys
of that kind, GROUP and TRANSACTIONAL_ID resources (ACLs, configs), both ways; other
tenants' hidden with ``hide_others``."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given

from gatehouse import codecs
from gatehouse.codecs import FieldSpec, StructSpec
from gatehouse.codecs.walk import rewrite
from gatehouse.configfile import ConfigError
from gatehouse.proxy.hooks import ConnectionInfo, Forward, Pending
from gatehouse.proxy.policy import RulesPolicy
from gatehouse.rules import Prefix, TopicMap
from gatehouse.rules.topics import (
    GROUP,
    TRANSACTION,
    IdKinds,
    RewriteStats,
    carries_ids,
    map_request,
    map_response,
    names_ids,
)
from tests.codec_strategies import ALL_VERSIONS, few_examples, message_body
from tests.test_rules import req, rules

TENANT = Prefix("tenant.", hide_others=False, groups=True, transactional_ids=True)
BOTH: IdKinds = frozenset({GROUP, TRANSACTION})
ID_REQUESTS = [(k, v) for k, v in ALL_VERSIONS if names_ids(codecs.api(k).request, v, BOTH)
               and k not in (0, 11, 14)]  # Produce and consumer bytes: own tests
ID_RESPONSES = [(k, v) for k, v in ALL_VERSIONS if carries_ids(codecs.api(k).response, BOTH)
                and k not in (11, 14, 15)]


def group_ids(message: Any, body: Any, version: int) -> list[str]:
    """Every group id and transactional id in ``body``, in order (the fields the specs
    mark so)."""
    found: list[str] = []

    def is_group(f: FieldSpec) -> bool:
        return f.entity in ("groupId", "transactionalId") and f.type == "string"

    def visit(struct: StructSpec, record: Any) -> Any:
        for f in struct.fields:
            value = getattr(record, f.attr, None)
            if is_group(f) and version in f.versions and value is not None:
                found.extend(value if f.is_array else [value])
        return record

    rewrite(message, version, body, is_group, visit)
    return found


def test_the_tables_find_the_group_and_transaction_apis() -> None:
    names = {codecs.api(k).name for k, _ in ID_REQUESTS}
    assert {"OffsetCommit", "OffsetFetch", "Heartbeat", "LeaveGroup", "DescribeGroups",
            "DeleteGroups", "OffsetDelete", "TxnOffsetCommit", "AddOffsetsToTxn",
            "ConsumerGroupHeartbeat", "ConsumerGroupDescribe", "ShareGroupHeartbeat",
            "ShareFetch", "StreamsGroupHeartbeat", "InitProducerId", "AddPartitionsToTxn",
            "EndTxn", "DescribeTransactions"} <= names
    assert {codecs.api(k).name for k, _ in ID_RESPONSES} >= {
        "ListGroups", "DeleteGroups", "OffsetFetch", "ConsumerGroupDescribe",
        "ListTransactions", "DescribeTransactions", "AddPartitionsToTxn"}


@pytest.mark.parametrize(("api_key", "version"), ID_REQUESTS)
def test_request_group_ids_prefixed(api_key: int, version: int) -> None:
    api = codecs.api(api_key)

    @few_examples(3)
    @given(message_body(api.request, version))
    def check(body: Any) -> None:
        request = codecs.decode_request(bytes(
            codecs.Request.build(api_key, version, 1, "c", body).encode()))
        before = group_ids(api.request, request.body, version)
        mapped = map_request(request, TENANT, {}, RewriteStats())
        again = codecs.decode_request(bytes(mapped.encode()))
        assert group_ids(api.request, again.body, version) == ["tenant." + g for g in before]
        plain = map_request(request, Prefix("tenant."), {}, RewriteStats())  # neither
        assert group_ids(api.request, plain.body, version) == before

    check()


class _GroupsToBroker(TopicMap):
    """Test helper: maps responses *towards* the broker to fabricate broker-side data."""

    broker_to_client: dict[str, str] = {}

    @property
    def id_kinds(self) -> IdKinds:
        return BOTH

    def to_client(self, name: str) -> str | None:
        return "tenant." + name

    def id_to_client(self, kind: str, name: str) -> str | None:
        return "tenant." + name


@pytest.mark.parametrize(("api_key", "version"), ID_RESPONSES)
def test_response_group_ids_unprefixed(api_key: int, version: int) -> None:
    api = codecs.api(api_key)

    @few_examples(3)
    @given(message_body(api.response, version))
    def check(body: Any) -> None:
        resp = codecs.Response.build(api_key, version, 1, body)
        prefixed = map_response(resp, _GroupsToBroker(), {}, RewriteStats())
        if group_ids(api.response, body, version):
            assert group_ids(api.response, prefixed.body, version) == [
                "tenant." + g for g in group_ids(api.response, body, version)]
        back = map_response(prefixed, TENANT, {}, RewriteStats())
        assert codecs.to_dict(back)["body"] == codecs.to_dict(resp)["body"]

    check()


@pytest.mark.parametrize("version", list(codecs.api(10).versions))
def test_find_coordinator_maps_group_keys_and_leaves_transactions_alone(version: int) -> None:
    policy = RulesPolicy(rules('- name: t\n  topic_prefix: {broker: "tenant.", groups: true}\n'))
    conn = ConnectionInfo(id=1, client="127.0.0.1:1", listener="bootstrap")
    keys = {"key": "g1"} if version < 4 else {"coordinator_keys": ["g1", "g2"]}
    group = req(10, version, **keys)
    decision = policy.on_request(conn, group)
    assert isinstance(decision, Forward)
    body = decision.request.body
    if version < 4:
        assert body.key == "tenant.g1" and not decision.wants_response  # no key answered
    else:
        assert body.coordinator_keys == ("tenant.g1", "tenant.g2") and decision.wants_response
        answer = codecs.response_from_dict({"header": {"correlation_id": 1}, "body": {
            "coordinators": [{"key": k, "node_id": 1, "host": "h", "port": 1}
                             for k in body.coordinator_keys]}}, api_key=10, api_version=version)
        shown = policy.on_response(conn, Pending(1, 10, version, 0.0, wants_response=True,
                                                 context=decision.context), answer)
        assert [c.key for c in shown.body.coordinators] == ["g1", "g2"]
    if version >= 1:
        txn = req(10, version, key_type=1, **keys)
        decision = policy.on_request(conn, txn)
        assert isinstance(decision, Forward) and not decision.wants_response
        assert codecs.to_dict(decision.request)["body"] == codecs.to_dict(txn)["body"]


def test_list_groups_hides_other_tenants_groups_only_with_hide_others() -> None:
    answer = codecs.response_from_dict({"header": {"correlation_id": 1}, "body": {"groups": [
        {"group_id": "tenant.orders", "protocol_type": "consumer"},
        {"group_id": "other.billing", "protocol_type": "consumer"}]}},
        api_key=16, api_version=5)
    hidden = map_response(answer, Prefix("tenant.", hide_others=True, groups=True), {},
                          RewriteStats())
    assert [g.group_id for g in hidden.body.groups] == ["orders"]
    shown = map_response(answer, TENANT, {}, RewriteStats())
    assert [g.group_id for g in shown.body.groups] == ["orders", "other.billing"]


def test_group_and_transaction_resources_of_acls_and_configs_are_prefixed_others_not() -> None:
    acls = req(30, 3, creations=[
        {"resource_type": t, "resource_name": n, "resource_pattern_type": 3,
         "principal": "User:a", "host": "*", "operation": 2, "permission_type": 3}
        for t, n in ((3, "g"), (2, "t"), (4, "kafka-cluster"), (5, "txn"))])
    mapped = map_request(acls, TENANT, {}, RewriteStats())
    assert [c.resource_name for c in mapped.body.creations] == [
        "tenant.g", "tenant.t", "kafka-cluster", "tenant.txn"]
    groups_only = map_request(acls, Prefix("tenant.", groups=True), {}, RewriteStats())
    assert [c.resource_name for c in groups_only.body.creations] == [
        "tenant.g", "tenant.t", "kafka-cluster", "txn"]
    configs = req(32, 4, resources=[
        {"resource_type": t, "resource_name": n, "configuration_keys": None}
        for t, n in ((32, "g"), (2, "t"), (4, "1"))])
    mapped = map_request(configs, TENANT, {}, RewriteStats())
    assert [r.resource_name for r in mapped.body.resources] == ["tenant.g", "tenant.t", "1"]


@pytest.mark.parametrize(("resource_type", "name", "pattern", "refused"), [
    (2, "orders", 3, False),  # LITERAL: tenant.orders only
    (2, "", 4, False),  # PREFIXED "": everything under tenant.
    (3, "g", 3, False),
    (2, None, 3, True),  # no name: every topic's ACLs
    (2, "orders", 2, True),  # MATCH: the wildcard's and covering prefixes' too
    (2, "orders", 1, True),  # ANY
    (1, "orders", 3, True),  # any resource type
    (3, None, 4, True),  # groups are the tenant's (groups: true)
    (4, None, 1, False),  # the cluster's: no tenant's names (the brokers decide)
])
def test_a_tenants_delete_acls_filter_stays_inside_its_prefix(
        resource_type: int, name: str | None, pattern: int, refused: bool) -> None:
    """Under a prefix that hides the others, a DeleteAcls filter that could match ACLs
    outside the prefix (another tenant's, the wildcard's) is refused with
    INVALID_REQUEST, whatever the brokers would let the proxy's user delete."""
    from gatehouse.proxy.hooks import Respond

    policy = RulesPolicy(rules("- name: t\n  topic_prefix: {broker: 'tenant.', hide_others: "
                               "true, groups: true}\n"))
    conn = ConnectionInfo(id=1, client="127.0.0.1:1", listener="bootstrap")
    decision = policy.on_request(conn, req(31, 3, filters=[{
        "resource_type_filter": resource_type, "resource_name_filter": name,
        "pattern_type_filter": pattern, "principal_filter": None, "host_filter": None,
        "operation": 1, "permission_type": 1}]))
    if refused:
        assert isinstance(decision, Respond)
        [result] = decision.response.body.filter_results
        assert result.error_code == 42 and "other tenants' ACLs" in result.error_message
    else:
        assert isinstance(decision, Forward)


def test_a_tenants_leader_election_names_its_partitions() -> None:
    """ElectLeaders of no partitions named is every partition's, other tenants' too:
    refused under a prefix that hides the others; one that names its own goes on,
    prefixed."""
    from gatehouse.proxy.hooks import Respond

    policy = RulesPolicy(rules("- name: t\n  topic_prefix: {broker: 'tenant.', hide_others: "
                               "true}\n"))
    conn = ConnectionInfo(id=1, client="127.0.0.1:1", listener="bootstrap")
    every = policy.on_request(conn, req(43, 2, election_type=0, topic_partitions=None,
                                        timeout_ms=1000))
    assert isinstance(every, Respond)
    assert every.response.body.error_code == 42
    named = policy.on_request(conn, req(43, 2, election_type=0, timeout_ms=1000,
                                        topic_partitions=[{"topic": "orders",
                                                           "partitions": [0]}]))
    assert isinstance(named, Forward)
    assert named.request.body.topic_partitions[0].topic == "tenant.orders"


def test_a_heartbeat_goes_up_with_the_brokers_group_and_its_answer_is_not_decoded() -> None:
    policy = RulesPolicy(rules('- name: t\n  topic_prefix: {broker: "tenant.", groups: true}\n'))
    conn = ConnectionInfo(id=1, client="127.0.0.1:1", listener="bootstrap")
    beat = req(12, 4, group_id="g", generation_id=3, member_id="m")
    decision = policy.on_request(conn, beat)
    assert isinstance(decision, Forward) and decision.request.body.group_id == "tenant.g"
    assert not decision.wants_response
    plain = RulesPolicy(rules('- name: t\n  topic_prefix: {broker: "tenant."}\n'))
    beat = req(12, 4, group_id="g", generation_id=3, member_id="m")
    decision = plain.on_request(conn, beat)
    assert isinstance(decision, Forward) and decision.request is beat
    assert not beat.body_decoded  # without `groups`, as before: not even decoded


def test_groups_must_be_a_boolean_with_its_line() -> None:
    assert rules('- name: t\n  topic_prefix: {broker: "a.", groups: true}\n'
                 ).rules[0].topic_map == Prefix("a.", False, True)
    with pytest.raises(ConfigError) as failure:
        rules('- name: t\n  topic_prefix:\n    broker: "a."\n    groups: "yes"\n')
    assert "rules.yaml:4" in str(failure.value)


def test_acls_on_other_tenants_topics_and_groups_are_hidden_with_hide_others() -> None:
    def acl(resource_type: int, name: str) -> dict[str, Any]:
        return {"resource_type": resource_type, "resource_name": name, "pattern_type": 3,
                "acls": [{"principal": "User:x", "host": "*", "operation": 3,
                          "permission_type": 3}]}

    answer = codecs.response_from_dict({"header": {"correlation_id": 1}, "body": {
        "resources": [acl(2, "tenant.orders"), acl(2, "other.secrets"), acl(3, "tenant.g"),
                      acl(3, "other.g"), acl(4, "kafka-cluster")]}},
        api_key=29, api_version=3)
    hidden = map_response(answer, Prefix("tenant.", hide_others=True, groups=True), {},
                          RewriteStats())
    assert [(r.resource_type, r.resource_name) for r in hidden.body.resources] == [
        (2, "orders"), (3, "g"), (4, "kafka-cluster")]
    shown = map_response(answer, TENANT, {}, RewriteStats())
    assert [r.resource_name for r in shown.body.resources] == [
        "orders", "other.secrets", "g", "other.g", "kafka-cluster"]


@pytest.mark.parametrize("version", list(codecs.api(10).versions)[1:])
def test_find_coordinator_maps_transaction_keys_when_asked_and_never_share_keys(
        version: int) -> None:
    policy = RulesPolicy(rules('- name: t\n  topic_prefix: {broker: "tenant.", groups: true,'
                               ' transactional_ids: true}\n'))
    conn = ConnectionInfo(id=1, client="127.0.0.1:1", listener="bootstrap")
    keys = {"key": "tx"} if version < 4 else {"coordinator_keys": ["tx"]}
    decision = policy.on_request(conn, req(10, version, key_type=1, **keys))
    assert isinstance(decision, Forward)
    body = decision.request.body
    assert (body.key if version < 4 else body.coordinator_keys) in ("tenant.tx", ("tenant.tx",))
    if version >= 4:
        answer = codecs.response_from_dict({"header": {"correlation_id": 1}, "body": {
            "coordinators": [{"key": "tenant.tx", "node_id": 1, "host": "h", "port": 1}]}},
            api_key=10, api_version=version)
        shown = policy.on_response(conn, Pending(1, 10, version, 0.0, wants_response=True,
                                                 context=decision.context), answer)
        assert [c.key for c in shown.body.coordinators] == ["tx"]
        share = req(10, version, key_type=2, coordinator_keys=["g:AAAAAAAAAAAAAAAAAAAAAA:0"])
        decision = policy.on_request(conn, share)
        assert isinstance(decision, Forward) and not decision.wants_response
        assert decision.request.body.coordinator_keys == ("g:AAAAAAAAAAAAAAAAAAAAAA:0",)


PRODUCE_VERSIONS = [v for k, v in ALL_VERSIONS if k == 0 and v >= 3]


@pytest.mark.parametrize("version", PRODUCE_VERSIONS)
def test_a_produce_requests_transactional_id_is_changed_in_its_bytes_as_the_decoder_would(
        version: int) -> None:
    api = codecs.api(0)
    mapping = Prefix("tenant.", transactional_ids=True)

    @few_examples(25)
    @given(message_body(api.request, version))
    def check(request: Any) -> None:
        wire = bytes(codecs.Request.build(0, version, 1, "c", request).encode())
        fast = map_request(codecs.decode_request(wire), mapping, {}, RewriteStats())
        slow = map_request(codecs.Request.build(0, version, 1, "c", request), mapping, {},
                           RewriteStats())
        assert bytes(fast.encode()) == bytes(slow.encode())
        expected = (None if request.transactional_id is None
                    else "tenant." + request.transactional_id)
        assert codecs.decode_request(bytes(fast.encode())).body.transactional_id == expected

    check()


def test_a_large_transactional_produce_request_goes_up_with_the_brokers_transactional_id(
) -> None:
    import uuid

    policy = RulesPolicy(rules('- name: t\n  topic_prefix: {broker: "tenant.",'
                               ' transactional_ids: true}\n'))
    conn = ConnectionInfo(id=1, client="127.0.0.1:1", listener="bootstrap")
    records = b"\x07" * 300
    for version, topic in ((9, {"name": "orders"}), (13, {"topic_id": uuid.uuid4()})):
        wire = bytes(req(0, version, transactional_id="tx-1", acks=-1, timeout_ms=1000,
                         topic_data=[{**topic, "partition_data": [
                             {"index": 0, "records": records}]}]).encode())
        head = codecs.decode_request(memoryview(wire)[:80])
        decision = policy.forwards_unread(conn, head)
        assert decision is not None and decision.new_head is not None
        new, end = decision.new_head
        renamed = codecs.decode_request(new + wire[end:]).body
        assert renamed.transactional_id == "tenant.tx-1"
        assert renamed.topic_data[0].partition_data[0].records == records
        if version < 13:
            assert renamed.topic_data[0].name == "tenant.orders"


def test_a_transactional_id_pattern_is_matched_after_the_prefix() -> None:
    """ListTransactions v2 (KIP-1152) filters by a regex over the broker's ids, which
    hold the prefix: the tenant's pattern goes up after the prefix, quoted as Java's
    regexes quote (\\Q...\\E); without transactional_ids in the prefix it is left as is."""
    def asked(text: str) -> Any:
        decision = RulesPolicy(rules(text)).on_request(
            ConnectionInfo(id=1, client="127.0.0.1:1", listener="bootstrap"),
            req(66, 2, state_filters=[], producer_id_filters=[], duration_filter=-1,
                transactional_id_pattern="pay.*"))
        assert isinstance(decision, Forward)
        return decision.request.body.transactional_id_pattern

    assert asked("- name: t\n  topic_prefix: {broker: 't.', transactional_ids: true}\n") == (
        "\\Qt.\\E(?:pay.*)")
    assert asked("- name: t\n  topic_prefix: {broker: 't.', groups: true}\n") == "pay.*"
