"""A request's topics a filter denies are answered one by one (``rules.withhold``): the
others go up, and the broker's answer and the proxy's are put together, in nested
arrays too; APIs Kafka answers whole are refused whole."""

from __future__ import annotations

from gatehouse.proxy.hooks import Forward, Respond
from gatehouse.proxy.policy import RulesPolicy
from tests.test_rules import req, rules
from tests.test_rules_topic_filter import FILTER, answered, conn

TOPIC_AUTHORIZATION_FAILED = 29


def test_a_groups_denied_topics_join_the_brokers_answer_for_that_group() -> None:
    policy = RulesPolicy(rules(FILTER))
    asked = req(9, 9, "app-1", groups=[
        {"group_id": "g1", "topics": [{"name": "orders", "partition_indexes": [0, 1]},
                                      {"name": "payroll", "partition_indexes": [0]}]},
        {"group_id": "g2", "topics": [{"name": "salaries", "partition_indexes": [3]}]}])
    decision = policy.on_request(conn(), asked)
    assert isinstance(decision, Forward)
    assert [(g.group_id, [t.name for t in g.topics])
            for g in decision.request.body.groups] == [("g1", ["orders"])]
    body = answered(policy, decision)
    assert [(g.group_id, g.error_code, [(t.name, [(p.partition_index, p.error_code)
                                                  for p in t.partitions]) for t in g.topics])
            for g in body.groups] == [
        ("g1", 0, [("orders", [(0, 0), (1, 0)]),
                   ("payroll", [(0, TOPIC_AUTHORIZATION_FAILED)])]),
        ("g2", 0, [("salaries", [(3, TOPIC_AUTHORIZATION_FAILED)])])]


def test_a_list_of_names_and_config_resources_are_answered_one_by_one() -> None:
    policy = RulesPolicy(rules(FILTER))
    deleting = req(20, 4, "app-1", topic_names=["orders", "payroll"], timeout_ms=1000)
    decision = policy.on_request(conn(), deleting)
    assert isinstance(decision, Forward)
    assert decision.request.body.topic_names == ("orders",)
    assert [(r.name, r.error_code) for r in answered(policy, decision).responses] == [
        ("orders", 0), ("payroll", TOPIC_AUTHORIZATION_FAILED)]

    describing = req(32, 4, "app-1", resources=[
        {"resource_type": 2, "resource_name": "payroll", "configuration_keys": None},
        {"resource_type": 4, "resource_name": "1", "configuration_keys": None},
        {"resource_type": 2, "resource_name": "orders", "configuration_keys": None}])
    decision = policy.on_request(conn(), describing)
    assert isinstance(decision, Forward)
    assert [r.resource_name for r in decision.request.body.resources] == ["1", "orders"]
    results = answered(policy, decision).results
    assert [(r.resource_name, r.error_code) for r in results] == [
        ("1", 0), ("orders", 0), ("payroll", TOPIC_AUTHORIZATION_FAILED)]
    assert "'payroll' is not allowed here (rule orders-only)" in results[-1].error_message


def test_an_acks_0_produce_writes_the_others_then_closes() -> None:
    policy = RulesPolicy(rules(FILTER))
    records = b"\x01" * 70
    mixed = req(0, 9, "app-1", acks=0, timeout_ms=1000, topic_data=[
        {"name": t, "partition_data": [{"index": 0, "records": records}]}
        for t in ("payroll", "orders")])
    decision = policy.on_request(conn(), mixed)
    assert isinstance(decision, Forward)
    assert [t.name for t in decision.request.body.topic_data] == ["orders"]
    assert decision.close_after is not None and "acks=0" in decision.close_after


def test_what_kafka_answers_whole_or_nothing_left_is_refused_whole() -> None:
    policy = RulesPolicy(rules(FILTER))
    # AddPartitionsToTxn: a transaction's partitions are added all or none (its v0-3
    # partitions' error is PartitionErrorCode: it used to be left 0, "added").
    adding = req(24, 3, "app-1", v3_and_below_transactional_id="app-tx",
                 v3_and_below_producer_id=1, v3_and_below_producer_epoch=0,
                 v3_and_below_topics=[{"name": t, "partitions": [0]}
                                      for t in ("orders", "payroll")])
    decision = policy.on_request(conn(), adding)
    assert isinstance(decision, Respond)
    assert {p.partition_error_code for t in decision.response.body.results_by_topic_v3_and_below
            for p in t.results_by_partition} == {TOPIC_AUTHORIZATION_FAILED}
    # Only denied topics: the proxy's answer alone, nothing sent.
    only = req(20, 4, "app-1", topic_names=["payroll", "salaries"], timeout_ms=1000)
    decision = policy.on_request(conn(), only)
    assert isinstance(decision, Respond)
    assert [(r.name, r.error_code) for r in decision.response.body.responses] == [
        ("payroll", TOPIC_AUTHORIZATION_FAILED), ("salaries", TOPIC_AUTHORIZATION_FAILED)]


def test_two_entries_of_one_key_split_are_refused_whole() -> None:
    """Two groups of one id, one with a denied topic: which of the broker's two answers
    the proxy's would join cannot be told, so the request is answered whole."""
    policy = RulesPolicy(rules(FILTER))
    twice = req(9, 9, "app-1", groups=[
        {"group_id": "g1", "topics": [{"name": "orders", "partition_indexes": [0]},
                                      {"name": "payroll", "partition_indexes": [0]}]},
        {"group_id": "g1", "topics": [{"name": "orders", "partition_indexes": [1]}]}])
    decision = policy.on_request(conn(), twice)
    assert isinstance(decision, Respond)
    assert {p.error_code for g in decision.response.body.groups for t in g.topics
            for p in t.partitions} == {TOPIC_AUTHORIZATION_FAILED}


def test_groups_and_transactional_ids_are_answered_one_by_one_too() -> None:
    from tests.test_rules_id_filter import IDS

    policy = RulesPolicy(rules(IDS))
    group_denied, txn_denied = 30, 53
    describing = req(15, 5, "app-1", groups=["team-a.orders", "team-b.orders"],
                     include_authorized_operations=False)
    decision = policy.on_request(conn(), describing)
    assert isinstance(decision, Forward)
    assert decision.request.body.groups == ("team-a.orders",)
    assert [(g.group_id, g.error_code) for g in answered(policy, decision).groups] == [
        ("team-a.orders", 0), ("team-b.orders", group_denied)]

    # One group of an OffsetFetch denied: that group's error, at the group.
    fetching = req(9, 9, "app-1", groups=[
        {"group_id": g, "topics": [{"name": "orders", "partition_indexes": [0]}]}
        for g in ("team-b.x", "team-a.y")])
    decision = policy.on_request(conn(), fetching)
    assert isinstance(decision, Forward)
    assert [g.group_id for g in decision.request.body.groups] == ["team-a.y"]
    assert [(g.group_id, g.error_code) for g in answered(policy, decision).groups] == [
        ("team-a.y", 0), ("team-b.x", group_denied)]

    described = req(65, 0, "app-1", transactional_ids=["team-a-1", "payments-1"])
    decision = policy.on_request(conn(), described)
    assert isinstance(decision, Forward)
    assert decision.request.body.transactional_ids == ("team-a-1",)
    assert [(t.transactional_id, t.error_code)
            for t in answered(policy, decision).transaction_states] == [
        ("team-a-1", 0), ("payments-1", txn_denied)]

    # A group's config resource beside a topic's (KIP-848's group configs).
    configs = req(32, 4, "app-1", resources=[
        {"resource_type": 32, "resource_name": "team-b.orders", "configuration_keys": None},
        {"resource_type": 2, "resource_name": "any-topic", "configuration_keys": None}])
    decision = policy.on_request(conn(), configs)
    assert isinstance(decision, Forward)
    assert [r.resource_name for r in decision.request.body.resources] == ["any-topic"]
    assert [(r.resource_name, r.error_code) for r in answered(policy, decision).results] == [
        ("any-topic", 0), ("team-b.orders", group_denied)]

    # A group id of the request's own (not an entry): refused whole.
    commit = req(8, 9, "app-1", group_id="team-b.g", generation_id_or_member_epoch=1,
                 member_id="m", group_instance_id=None, topics=[
                     {"name": "orders", "partitions": [
                         {"partition_index": 0, "committed_offset": 1,
                          "committed_leader_epoch": -1, "committed_metadata": None}]}])
    decision = policy.on_request(conn(), commit)
    assert isinstance(decision, Respond)
