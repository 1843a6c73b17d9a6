"""Group ids under a tenant prefix with ``groups: true``: every field the specs mark as a
group id, FindCoordinator's group keys, GROUP resources (ACLs, configs), both ways;
other tenants' groups hidden with ``hide_others``."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from gatehouse import codecs
from gatehouse.codecs import FieldSpec, StructSpec
from gatehouse.codecs.walk import rewrite
from gatehouse.configfile import ConfigError
from gatehouse.proxy.hooks import ConnectionInfo, Forward, Pending
from gatehouse.proxy.policy import RulesPolicy
from gatehouse.rules import Prefix, TopicMap
from gatehouse.rules.topics import (
    RewriteStats,
    carries_groups,
    map_request,
    map_response,
    names_groups,
)
from tests.codec_strategies import ALL_VERSIONS, message_body
from tests.test_rules import FAST, req, rules

TENANT = Prefix("tenant.", hide_others=False, groups=True)
GROUP_REQUESTS = [(k, v) for k, v in ALL_VERSIONS if names_groups(codecs.api(k).request, v)
                  and k not in (11, 14)]  # consumer bytes: tests/test_rules.py
GROUP_RESPONSES = [(k, v) for k, v in ALL_VERSIONS if carries_groups(codecs.api(k).response)
                   and k not in (11, 14, 15)]


def group_ids(message: Any, body: Any, version: int) -> list[str]:
    """Every group id in ``body``, in order (the fields the specs mark as group ids)."""
    found: list[str] = []

    def is_group(f: FieldSpec) -> bool:
        return f.entity == "groupId" and f.type == "string"

    def visit(struct: StructSpec, record: Any) -> Any:
        for f in struct.fields:
            value = getattr(record, f.attr, None)
            if is_group(f) and version in f.versions and value is not None:
                found.extend(value if f.is_array else [value])
        return record

    rewrite(message, version, body, is_group, visit)
    return found


def test_the_tables_find_the_group_apis() -> None:
    names = {codecs.api(k).name for k, _ in GROUP_REQUESTS}
    assert {"OffsetCommit", "OffsetFetch", "Heartbeat", "LeaveGroup", "DescribeGroups",
            "DeleteGroups", "OffsetDelete", "TxnOffsetCommit", "AddOffsetsToTxn",
            "ConsumerGroupHeartbeat", "ConsumerGroupDescribe", "ShareGroupHeartbeat",
            "ShareFetch", "StreamsGroupHeartbeat"} <= names
    assert {codecs.api(k).name for k, _ in GROUP_RESPONSES} >= {
        "ListGroups", "DeleteGroups", "OffsetFetch", "ConsumerGroupDescribe"}


@pytest.mark.parametrize(("api_key", "version"), GROUP_REQUESTS)
def test_request_group_ids_prefixed(api_key: int, version: int) -> None:
    api = codecs.api(api_key)

    @settings(max_examples=3, deadline=None, database=None, phases=FAST,
              suppress_health_check=list(HealthCheck))
    @given(message_body(api.request, version))
    def check(body: Any) -> None:
        request = codecs.decode_request(bytes(
            codecs.Request.build(api_key, version, 1, "c", body).encode()))
        before = group_ids(api.request, request.body, version)
        mapped = map_request(request, TENANT, {}, RewriteStats())
        again = codecs.decode_request(bytes(mapped.encode()))
        assert group_ids(api.request, again.body, version) == ["tenant." + g for g in before]
        plain = map_request(request, Prefix("tenant."), {}, RewriteStats())  # no `groups`
        assert group_ids(api.request, plain.body, version) == before

    check()


class _GroupsToBroker(TopicMap):
    """Test helper: maps responses *towards* the broker to fabricate broker-side data."""

    broker_to_client: dict[str, str] = {}

    @property
    def maps_groups(self) -> bool:
        return True

    def to_client(self, name: str) -> str | None:
        return "tenant." + name

    def group_to_client(self, name: str) -> str | None:
        return "tenant." + name


@pytest.mark.parametrize(("api_key", "version"), GROUP_RESPONSES)
def test_response_group_ids_unprefixed(api_key: int, version: int) -> None:
    api = codecs.api(api_key)

    @settings(max_examples=3, deadline=None, database=None, phases=FAST,
              suppress_health_check=list(HealthCheck))
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


def test_group_resources_of_acls_and_configs_are_prefixed_others_not() -> None:
    acls = req(30, 3, creations=[
        {"resource_type": t, "resource_name": n, "resource_pattern_type": 3,
         "principal": "User:a", "host": "*", "operation": 2, "permission_type": 3}
        for t, n in ((3, "g"), (2, "t"), (4, "kafka-cluster"), (5, "txn"))])
    mapped = map_request(acls, TENANT, {}, RewriteStats())
    assert [c.resource_name for c in mapped.body.creations] == [
        "tenant.g", "tenant.t", "kafka-cluster", "txn"]
    configs = req(32, 4, resources=[
        {"resource_type": t, "resource_name": n, "configuration_keys": None}
        for t, n in ((32, "g"), (2, "t"), (4, "1"))])
    mapped = map_request(configs, TENANT, {}, RewriteStats())
    assert [r.resource_name for r in mapped.body.resources] == ["tenant.g", "tenant.t", "1"]


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
