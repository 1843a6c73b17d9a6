"""Listings of every topic under a topic filter (DescribeTopicPartitions, KIP-966): the
proxy gives sealed cursors and takes back only those (gatehouse.rules.cursors), so the
listing goes on past topics the client may not see without naming them, and a cursor
of the client's own choosing cannot probe where hidden topics lie."""

from __future__ import annotations

import string
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gatehouse import codecs
from gatehouse.proxy.hooks import Forward, Pending, Respond
from gatehouse.proxy.policy import RulesPolicy
from gatehouse.rules import cursors
from tests.test_rules import req, rules
from tests.test_rules_topic_filter import conn, listening

INVALID_REQUEST = 42
FILTER = "- name: public\n  allow_topics: ['pub\\..*']\n"
TENANT = ("- name: tenant\n  topic_prefix: {broker: 'a.', hide_others: true}\n"
          "  deny_topics: ['secret.*']\n")
TOPIC_CHARS = string.ascii_letters + string.digits + "._-"


@pytest.fixture
def other_key() -> Iterator[None]:
    """Seal with another key for the test's length (a restarted proxy's)."""
    key = cursors.current_key()
    cursors.use_key(bytes(cursors.KEY_BYTES))
    try:
        yield
    finally:
        cursors.use_key(key)


@given(st.text(TOPIC_CHARS, max_size=249))
def test_a_sealed_name_opens_to_itself_and_its_length_tells_nothing(name: str) -> None:
    token = cursors.seal(name)
    assert cursors.unseal(token) == name
    assert len(token) == len(cursors.seal("x"))
    # (a short name may turn up in any random text by chance)
    assert len(name) < 8 or name not in token.removeprefix(cursors.SEALED_MARK)


@given(st.text(TOPIC_CHARS, min_size=1, max_size=40), st.integers(0, 200))
def test_a_token_changed_anywhere_opens_to_nothing(name: str, at: int) -> None:
    token = cursors.seal(name)
    body = token.removeprefix(cursors.SEALED_MARK)
    at %= len(body)
    changed = body[:at] + ("A" if body[at] != "A" else "B") + body[at + 1:]
    assert cursors.unseal(cursors.SEALED_MARK + changed) is None


def test_names_and_other_keys_tokens_open_to_nothing(other_key: None) -> None:
    mine = cursors.seal("pub.x")
    assert cursors.unseal(mine) == "pub.x"
    for token in ("pub.x", cursors.SEALED_MARK, cursors.SEALED_MARK + "!!!",
                  cursors.SEALED_MARK + "AAAA"):
        assert cursors.unseal(token) is None
    cursors.use_key(b"\x01" * cursors.KEY_BYTES)
    assert cursors.unseal(mine) is None
    with pytest.raises(ValueError, match="32 bytes"):
        cursors.use_key(b"short")


def listing(cursor: dict[str, Any] | None, client_id: str = "app") -> codecs.Request:
    return req(75, 0, client_id, topics=[], response_partition_limit=2, cursor=cursor)


def answered(policy: RulesPolicy, forward: Forward, names: list[str],
             next_cursor: tuple[str, int] | None) -> Any:
    """The client's view of a broker's answer holding ``names``."""
    topic = {"error_code": 0, "topic_id": "00000000-0000-0000-0000-000000000001",
             "is_internal": False, "partitions": [], "topic_authorized_operations": 0}
    cursor = (None if next_cursor is None
              else {"topic_name": next_cursor[0], "partition_index": next_cursor[1]})
    built = codecs.response_from_dict({"header": {"correlation_id": 1}, "body": {
        "throttle_time_ms": 0, "topics": [{**topic, "name": n} for n in names],
        "next_cursor": cursor}}, api_key=75, api_version=0)
    resp = codecs.decode_response(memoryview(bytes(built.encode())), 75, 0)
    mapped = policy.on_response(conn(), Pending(1, 75, 0, 0.0, context=forward.context), resp)
    return codecs.decode_response(memoryview(bytes(mapped.encode())), 75, 0).body


def test_under_a_filter_the_listing_goes_on_past_hidden_topics_by_sealed_cursors() -> None:
    policy = RulesPolicy(rules(FILTER))
    first = policy.on_request(conn(), listing(None))
    assert isinstance(first, Forward) and first.request.body.cursor is None
    # A page of hidden topics only, its cursor at another hidden one: no topics, and a
    # cursor that does not name it (the old answer: no cursor, the listing's end).
    page = answered(policy, first, ["priv.a", "priv.b"], ("priv.c", 1))
    assert page.topics == () and page.next_cursor is not None
    token = page.next_cursor.topic_name
    assert "priv" not in token and cursors.unseal(token) == "priv.c"
    assert page.next_cursor.partition_index == 1
    # Back to the broker as the broker gave it.
    second = policy.on_request(conn(), listing({"topic_name": token, "partition_index": 1}))
    assert isinstance(second, Forward)
    assert (second.request.body.cursor.topic_name,
            second.request.body.cursor.partition_index) == ("priv.c", 1)
    # A cursor at a topic the client sees is sealed too: every cursor is the proxy's.
    page = answered(policy, second, ["priv.c", "pub.x"], ("pub.y", 0))
    assert [t.name for t in page.topics] == ["pub.x"]
    assert cursors.unseal(page.next_cursor.topic_name) == "pub.y"
    assert answered(policy, second, ["pub.z"], None).next_cursor is None


def test_under_a_filter_a_cursor_the_proxy_did_not_give_is_refused(other_key: None) -> None:
    """A client's own cursor (even at a topic it may use) would tell, page by page,
    whether hidden topics lie after it; one of an earlier proxy process's cannot be
    opened.  Both are refused as a broker refuses a cursor it cannot take: no topics,
    no cursor, INVALID_REQUEST; counted as the filter's refusal."""
    policy = RulesPolicy(rules(FILTER))
    counted, refused = listening(policy)
    old = cursors.seal("pub.x")
    cursors.use_key(b"\x02" * cursors.KEY_BYTES)
    for cursor in ("pub.x", "priv.a", old):
        decision = policy.on_request(conn(), listing({"topic_name": cursor,
                                                      "partition_index": 0}))
        assert isinstance(decision, Respond), cursor
        body = decision.response.body
        assert body.topics == () and body.next_cursor is None
    assert refused == [("public", "refuse")] * 3
    assert [(o.rule, o.action, o.effect) for o in counted] == [
        ("public", "listing_cursor", "refuse")] * 3
    # A listing by name goes on with its cursor as it is (one of the names it lists).
    named = policy.on_request(conn(), req(75, 0, "app", topics=[{"name": "pub.x"}],
                                          response_partition_limit=2,
                                          cursor={"topic_name": "pub.x", "partition_index": 1}))
    assert isinstance(named, Forward) and named.request.body.cursor.topic_name == "pub.x"
    page = answered(policy, named, ["pub.x"], ("pub.x", 3))
    assert page.next_cursor.topic_name == "pub.x"


def test_in_observe_mode_cursors_are_neither_sealed_nor_refused() -> None:
    policy = RulesPolicy(rules(FILTER + "  mode: observe\n"))
    counted, refused = listening(policy)
    decision = policy.on_request(conn(), listing({"topic_name": "priv.a",
                                                  "partition_index": 0}))
    assert isinstance(decision, Forward)
    assert decision.request.body.cursor.topic_name == "priv.a"
    assert refused == [] and all(o.effect != "refuse" for o in counted)


def test_under_a_prefix_and_a_filter_the_listing_ends_past_the_prefix() -> None:
    """The tenant's topics lie together: the listing starts at its prefix, a cursor past
    them ends it, and one at a topic of its own it may not see is sealed."""
    policy = RulesPolicy(rules(TENANT))
    first = policy.on_request(conn(), listing(None))
    assert isinstance(first, Forward)
    assert first.request.body.cursor.topic_name == "a."
    page = answered(policy, first, ["a.one", "a.secret.x"], ("a.secret.y", 0))
    assert [t.name for t in page.topics] == ["one"]
    assert cursors.unseal(page.next_cursor.topic_name) == "a.secret.y"
    second = policy.on_request(conn(), listing({"topic_name": page.next_cursor.topic_name,
                                                "partition_index": 0}))
    assert isinstance(second, Forward)
    assert second.request.body.cursor.topic_name == "a.secret.y"  # not prefixed again
    assert answered(policy, second, ["a.two"], ("b.other", 0)).next_cursor is None


def test_under_a_prefix_that_shows_the_others_the_listing_is_the_whole_clusters() -> None:
    """Without hide_others a tenant sees every topic (its own without the prefix): the
    listing starts at the beginning and goes on past the prefix's topics."""
    policy = RulesPolicy(rules("- name: tenant\n  topic_prefix: {broker: 'a.'}\n"
                               "  deny_topics: ['secret.*']\n"))
    first = policy.on_request(conn(), listing(None))
    assert isinstance(first, Forward) and first.request.body.cursor is None
    page = answered(policy, first, ["a.one", "0.other"], ("b.other", 0))
    assert sorted(t.name for t in page.topics) == ["0.other", "one"]
    assert cursors.unseal(page.next_cursor.topic_name) == "b.other"
