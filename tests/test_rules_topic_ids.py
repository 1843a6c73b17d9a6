"""Topic ids under a tenant prefix that hides other tenants (gatehouse.rules.topicids):
an id goes through only when the proxy has seen, in an answer, that it is the client's."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gatehouse import codecs
from gatehouse.codecs import fetch as fetch_codec
from gatehouse.codecs import produce
from gatehouse.proxy.hooks import Close, ConnectionInfo, Forward, Pending, Respond
from gatehouse.proxy.policy import RulesPolicy
from gatehouse.rules import Prefix
from gatehouse.rules.topicids import TopicIds, checks_ids, teaches_ids
from tests.codec_strategies import build_message, examples, header_tags, message_body
from tests.test_rules import req, rules
from tests.test_rules_topic_filter import answered

TENANT = ('- name: tenant-a\n  match: {client_id: "^a-"}\n'
          '  topic_prefix: {broker: "a.", hide_others: true}\n')
MINE, THEIRS, UNSEEN = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
UNKNOWN_TOPIC_ID = 100


def conn() -> ConnectionInfo:
    return ConnectionInfo(id=1, client="127.0.0.1:1", listener="bootstrap")


def metadata_answer(version: int = 12) -> codecs.Response:
    body = {"brokers": [], "topics": [
        {"name": "a.orders", "topic_id": MINE, "partitions": []},
        {"name": "b.secrets", "topic_id": THEIRS, "partitions": []}]}
    frame = bytes(codecs.response_from_dict({"header": {"correlation_id": 1}, "body": body},
                                            api_key=3, api_version=version).encode())
    return codecs.decode_response(memoryview(frame), 3, version)


def taught(text: str = TENANT) -> RulesPolicy:
    """A policy that has mapped one Metadata answer for tenant a (as the broker names
    topics: a.orders is the client's, b.secrets another tenant's)."""
    policy = RulesPolicy(rules(text))
    decision = policy.on_request(conn(), req(3, 12, "a-app", topics=None))
    assert isinstance(decision, Forward)
    shown = policy.on_response(conn(), Pending(1, 3, 12, 0.0, wants_response=True,
                                               context=decision.context), metadata_answer())
    assert shown.body.topics[0].name == "orders"
    return policy


def fetch(*ids: uuid.UUID, forgotten: tuple[uuid.UUID, ...] = ()) -> codecs.Request:
    return req(1, 17, "a-app", max_wait_ms=1, min_bytes=1, max_bytes=1, session_id=7,
               session_epoch=3,
               topics=[{"topic_id": i, "partitions": [{"partition": p, "fetch_offset": 0}
                                                        for p in (0, 1)]} for i in ids],
               forgotten_topics_data=[{"topic_id": i, "partitions": [0]} for i in forgotten])


def produce_v13(topic_id: uuid.UUID, acks: int = -1) -> codecs.Request:
    return req(0, 13, "a-app", acks=acks, timeout_ms=1000, topic_data=[
        {"topic_id": topic_id, "partition_data": [{"index": 0, "records": b"\x01" * 70}]}])


def test_the_tables_say_which_requests_name_topics_by_id_and_which_answers_teach_them(
) -> None:
    checked = {(k, v) for k, spec in codecs.APIS.items()
               for v in spec.versions
               if checks_ids(spec.request, k, v)}
    for key, first in ((0, 13), (1, 13), (8, 10), (9, 10), (20, 6), (28, 6), (78, 0), (79, 0)):
        if first in codecs.APIS[key].versions:
            assert (key, first) in checked and (key, first - 1) not in checked
    assert not any(k in (3, 68) for k, _ in checked)  # Metadata, ConsumerGroupHeartbeat
    taught_by = {k for k, spec in codecs.APIS.items()
                 if teaches_ids(spec.response, spec.versions.hi)}
    assert {3, 19, 75} <= taught_by  # Metadata, CreateTopics, DescribeTopicPartitions
    assert 1 not in taught_by  # a Fetch answer names topics by id only


def test_ids_of_the_clients_topics_pass_and_others_get_unknown_topic_id() -> None:
    policy = taught()
    assert len(policy.topic_ids.names) == 2  # learned before the other tenant's is hidden
    refused: list[tuple[str, str]] = []
    policy.refusal_listeners.append(lambda c, r, rule, action: refused.append((rule, action)))
    counted: list[Any] = []
    policy.outcome_listeners.append(counted.append)
    mine = fetch(MINE)
    decision = policy.on_request(conn(), mine)
    assert isinstance(decision, Forward) and decision.request is mine
    assert not mine.body_decoded  # its ids read from its bytes
    assert refused == []

    # Another tenant's topic beside the client's own: the own one is fetched, the
    # other answered by the proxy, after the broker's, the broker's session kept.
    decision = policy.on_request(conn(), fetch(MINE, THEIRS, UNSEEN))
    assert isinstance(decision, Forward) and decision.wants_response
    assert [t.topic_id for t in decision.request.body.topics] == [MINE]
    body = answered(policy, decision, {"session_id": 7, "responses": [
        {"topic_id": MINE, "partitions": [{"partition_index": p, "high_watermark": 3}
                                          for p in (0, 1)]}]})
    assert (body.error_code, body.session_id) == (0, 7)
    assert [(t.topic_id, [p.error_code for p in t.partitions]) for t in body.responses] == [
        (MINE, [0, 0]), (THEIRS, [UNKNOWN_TOPIC_ID] * 2), (UNSEEN, [UNKNOWN_TOPIC_ID] * 2)]

    # Nothing of its own in it: answered whole.
    for ids in ((THEIRS,), (THEIRS, UNSEEN), (UNSEEN,)):
        decision = policy.on_request(conn(), fetch(*ids))
        assert isinstance(decision, Respond)
        answer = codecs.decode_response(memoryview(bytes(decision.response.encode())), 1, 17)
        body = answer.body
        # The topics' error, not the request's: a top-level error would end the session.
        assert body.error_code == 0 and body.session_id == 0
        assert [t.topic_id for t in body.responses] == list(ids)
        assert {p.error_code for t in body.responses for p in t.partitions} == {
            UNKNOWN_TOPIC_ID}
    assert refused == [("tenant-a", "refuse")] * 4
    # Counted as refused by the prefix's rule, not as renamed.
    assert [(o.rule, o.action, o.effect) for o in counted] == [
        ("tenant-a", "topics", "rewrite")] + [("tenant-a", "topic_id", "refuse")] * 4

    # Forgetting another tenant's topic is harmless: not checked.
    assert isinstance(policy.on_request(conn(), fetch(MINE, forgotten=(THEIRS,))), Forward)


def test_without_hide_others_or_for_other_clients_ids_are_not_checked() -> None:
    open_prefix = taught('- name: tenant-a\n  topic_prefix: {broker: "a."}\n')
    theirs = fetch(THEIRS)
    decision = open_prefix.on_request(conn(), theirs)
    assert isinstance(decision, Forward) and not theirs.body_decoded
    policy = taught()
    other = req(1, 17, "ops", max_wait_ms=1, min_bytes=1, max_bytes=1,
                topics=[{"topic_id": THEIRS, "partitions": []}])
    assert isinstance(policy.on_request(conn(), other), Forward)


def test_every_api_that_names_topics_by_id_is_checked() -> None:
    policy = taught()
    delete = req(20, 6, "a-app", timeout_ms=1000, topics=[{"name": None, "topic_id": THEIRS}])
    decision = policy.on_request(conn(), delete)
    assert isinstance(decision, Respond)
    assert [(t.topic_id, t.error_code) for t in decision.response.body.responses] == [
        (THEIRS, UNKNOWN_TOPIC_ID)]
    by_name = req(20, 6, "a-app", timeout_ms=1000, topics=[{"name": "orders"}])
    decision = policy.on_request(conn(), by_name)  # the zero id: named by name, mapped
    assert isinstance(decision, Forward)
    assert decision.request.body.topics[0].name == "a.orders"

    offsets = req(9, 10, "a-app", groups=[{"group_id": "g", "topics": [
        {"topic_id": THEIRS, "partition_indexes": [0, 1]}]}])
    decision = policy.on_request(conn(), offsets)
    assert isinstance(decision, Respond)
    group = decision.response.body.groups[0]
    assert group.group_id == "g" and group.error_code == 0  # the group is not in error
    assert [p.error_code for p in group.topics[0].partitions] == [UNKNOWN_TOPIC_ID] * 2

    commit = req(8, 10, "a-app", group_id="g", topics=[
        {"topic_id": MINE, "partitions": [{"partition_index": 0, "committed_offset": 5}]}])
    assert isinstance(policy.on_request(conn(), commit), Forward)

    assert isinstance(policy.on_request(conn(), produce_v13(MINE)), Forward)
    decision = policy.on_request(conn(), produce_v13(THEIRS))
    assert isinstance(decision, Respond)
    [topic] = decision.response.body.responses
    assert topic.topic_id == THEIRS
    assert [p.error_code for p in topic.partition_responses] == [UNKNOWN_TOPIC_ID]
    assert isinstance(policy.on_request(conn(), produce_v13(THEIRS, acks=0)), Close)

    # Asking Metadata by id is how a client learns names: the answer hides the foreign.
    ask = req(3, 12, "a-app", topics=[{"topic_id": THEIRS, "name": None}])
    assert isinstance(policy.on_request(conn(), ask), Forward)
    heartbeat = req(68, 0, "a-app", group_id="g", member_id="m", member_epoch=1,
                    topic_partitions=[{"topic_id": UNSEEN, "partitions": [0]}])
    assert isinstance(policy.on_request(conn(), heartbeat), Forward)


def test_a_streamed_produce_request_goes_on_only_with_an_id_the_client_may_name() -> None:
    policy = taught()

    def head(topic_id: uuid.UUID) -> codecs.Request:
        wire = bytes(produce_v13(topic_id).encode())
        return codecs.decode_request(memoryview(wire)[:60])

    decision = policy.forwards_unread(conn(), head(MINE))
    assert isinstance(decision, Forward) and decision.new_head is None
    assert policy.forwards_unread(conn(), head(THEIRS)) is None  # refused, once whole
    assert policy.forwards_unread(conn(), head(UNSEEN)) is None


def test_the_head_reader_finds_the_one_id_only_once_it_has_all_arrived() -> None:
    wire = bytes(produce_v13(MINE).encode())
    start = wire.index(MINE.bytes)
    for cut in range(len(wire) + 1):
        found = produce.request_head_topic_id(memoryview(wire)[:cut], 13)
        assert found == (MINE.bytes if cut >= start + 16 else None)
    two = bytes(req(0, 13, acks=-1, timeout_ms=1, topic_data=[
        {"topic_id": i, "partition_data": []} for i in (MINE, THEIRS)]).encode())
    assert produce.request_head_topic_id(two, 13) is None
    named = bytes(req(0, 12, acks=-1, timeout_ms=1, topic_data=[
        {"name": "x", "partition_data": []}]).encode())
    assert produce.request_head_topic_id(named, 12) is None


@pytest.mark.parametrize("version", [10, 12, 13])
def test_ids_are_learned_as_the_broker_names_them_and_the_memory_is_bounded(
        version: int) -> None:
    ids = TopicIds(limit=2)
    ids.learn(metadata_answer(version))
    mapping = Prefix("a.", hide_others=True)
    assert ids.shown(MINE.bytes, mapping) is True
    assert ids.shown(THEIRS.bytes, mapping) is False
    assert ids.shown(UNSEEN.bytes, mapping) is None
    third: Any = codecs.response_from_dict({"header": {"correlation_id": 1}, "body": {
        "topics": [{"name": "a.new", "topic_id": UNSEEN, "partitions": []}]}},
        api_key=3, api_version=version)
    ids.learn(codecs.decode_response(memoryview(bytes(third.encode())), 3, version))
    assert len(ids.names) == 2 and ids.shown(MINE.bytes, mapping) is None  # oldest out
    assert ids.shown(UNSEEN.bytes, mapping) is True


async def test_a_large_produce_request_streams_with_the_clients_id_and_is_refused_with_another(
) -> None:
    """Over the pumps: a Produce v13 request of 1 MiB naming another tenant's topic by id
    is held (nothing goes up) and answered UNKNOWN_TOPIC_ID; one naming the client's
    own topic goes up as it arrives, byte for byte."""
    import struct

    import trio

    from tests.support.fakebroker import frame_bytes, request, response_body
    from tests.test_proxy_pumps import proxied
    from tests.test_proxy_stream import RECORDS, Counting, held_whole, stream_up

    def wire(correlation_id: int, topic_id: uuid.UUID) -> bytes:
        return frame_bytes(request(0, 13, correlation_id, client_id="a-app",
                                   transactional_id=None, acks=-1, timeout_ms=1000,
                                   topic_data=[{"topic_id": topic_id, "partition_data": [
                                       {"index": 0, "records": RECORDS}]}]).encode())

    def answer(req: codecs.Request) -> Any:
        return response_body(0, 13, responses=[
            {"topic_id": t.topic_id, "partition_responses": [{"index": 0}]}
            for t in req.body.topic_data])

    counted = Counting()
    async with proxied(answer, policy=taught(), upstream=counted) as h:
        refused = codecs.decode_response(await held_whole(h, counted.stream, wire(5, THEIRS)),
                                         0, 13)
        [topic] = refused.body.responses
        assert topic.topic_id == THEIRS
        assert [p.error_code for p in topic.partition_responses] == [UNKNOWN_TOPIC_ID]
        assert h.broker.received == []

        mine = wire(6, MINE)
        await stream_up(h, counted.stream, mine)
        with trio.fail_after(5):
            got = await h.client.receive()
        assert got is not None and struct.unpack_from(">i", got)[0] == 6
        assert h.broker.received == [mine[4:]]


FETCH_ID_VERSIONS = [v for v in codecs.api(1).versions if v >= 13]


@pytest.mark.parametrize("version", FETCH_ID_VERSIONS)
@settings(max_examples=examples(60), deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_a_fetch_requests_topic_ids_are_read_from_its_bytes_as_the_decoder_reads_them(
        version: int, data: st.DataObject) -> None:
    """The ids a Fetch request fetches, read from its bytes (what the check reads, not
    decoding the request), are the decoder's, whatever the body and header tags; cut
    short, the reader gives up (the check then decodes, which reports the error)."""
    body = data.draw(message_body(codecs.api(1).request, version))
    tags = data.draw(header_tags(True))
    frame = bytes(build_message(1, version, "request", body, tags=tags).encode())
    decoded = codecs.decode_request(memoryview(frame)).body
    expected = [t.topic_id.bytes for t in decoded.topics or ()]
    assert fetch_codec.request_topic_ids(frame, version) == expected
    cut = data.draw(st.integers(0, len(frame) - 1))
    found = fetch_codec.request_topic_ids(frame[:cut], version)
    assert found is None or found == expected[:len(found)]


def test_in_observe_mode_another_tenants_id_is_counted_not_refused() -> None:
    """An observe-mode tenant prefix learns ids from the answers it leaves alone, and
    counts and logs a request naming another tenant's topic by id, as enforced it would
    refuse it; ids not seen yet are not counted (enforced, the client learns them
    through the proxy first)."""
    policy = RulesPolicy(rules(TENANT.replace("match:", "mode: observe\n  match:")))
    counted: list[Any] = []
    refused: list[tuple[str, str]] = []
    policy.outcome_listeners.append(counted.append)
    policy.refusal_listeners.append(lambda c, r, rule, action: refused.append((rule, action)))
    decision = policy.on_request(conn(), req(3, 12, "a-app", topics=None))
    assert isinstance(decision, Forward) and decision.wants_response
    answer = metadata_answer()
    shown = policy.on_response(conn(), Pending(1, 3, 12, 0.0, wants_response=True,
                                               context=decision.context), answer)
    assert shown is answer  # observed: nothing changes

    for request, expected in ((fetch(THEIRS), [("tenant-a", "would_refuse")]),
                              (fetch(MINE), []), (fetch(UNSEEN), []),
                              (produce_v13(THEIRS), [("tenant-a", "would_refuse")])):
        counted.clear()
        refused.clear()
        decision = policy.on_request(conn(), request)
        assert isinstance(decision, Forward) and decision.request is request
        assert refused == expected
        assert (("tenant-a", "topic_id", "refuse", "observe") in [
            (o.rule, o.action, o.effect, o.mode) for o in counted]) == bool(expected)
