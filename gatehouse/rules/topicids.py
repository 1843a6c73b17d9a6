"""Topic ids under a prefix that hides other tenants' topics (pure).

Since KIP-516 a request may name a topic by its id alone: Produce v13, Fetch v13+,
OffsetCommit and OffsetFetch v10, DeleteTopics v6+, ShareFetch, ShareAcknowledge...  A
prefix maps names and hides other tenants' topics from every answer, but an id carries
no prefix: a client that learned another tenant's topic id some other way (a log line,
a screenshot, a guess from an old cluster) could name that topic by it.

So under a map that hides (``TopicMap.hides_others``), an id goes through only if the
proxy has seen it, in an answer, belong to a topic whose broker-side name the map shows
the client.  The proxy learns ids from the answers that pair a name with an id (Metadata
v10+, CreateTopics v7+, DescribeTopicPartitions...: found from the tables), before they
are mapped, into one bounded memory shared by every connection: an id is the cluster's,
not a connection's, and a client learns ids on one connection (Metadata) and uses them
on another (Fetch to a partition's leader).

An id never seen is refused as a foreign one is, with UNKNOWN_TOPIC_ID on the topics of
the request and no other error: the client takes that as its metadata being out of
date, refreshes it (through the proxy, which then learns the id) and tries again.  The
answer is the same whether the topic is another tenant's or does not exist, so it tells
the client nothing.

Not checked: Metadata requests (asking by id is how a client learns a name, and the
answer hides what the map hides), forgotten topics of Fetch and ShareFetch (forgetting
is harmless, and a forgotten id may be stale) and ConsumerGroupHeartbeat (its owned
partitions echo the coordinator's assignment, itself made from the mapped subscription;
refusing them would fence the member).
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache
from typing import Any

from gatehouse.codecs import (
    FieldSpec,
    MessageSpec,
    Request,
    Response,
    StructSpec,
    fetch,
    produce,
)
from gatehouse.codecs.walk import reaches_in, rewrite
from gatehouse.rules.topics import TopicMap, is_topic_field

PRODUCE, FETCH, METADATA, CONSUMER_GROUP_HEARTBEAT = 0, 1, 3, 68
_NOT_CHECKED = frozenset({METADATA, CONSUMER_GROUP_HEARTBEAT})
_FORGOTTEN = "ForgottenTopic"
_ZERO = bytes(16)  # "no id": a topic named by its name (DeleteTopics v6+, ...)
DEFAULT_LIMIT = 100_000  # ids remembered; a cluster with more topics re-learns on a miss


def is_topic_id_field(f: FieldSpec) -> bool:
    """A field holding one topic's id (KIP-516)."""
    return f.attr == "topic_id" and f.type == "uuid" and not f.is_array


def _is_name_field(f: FieldSpec) -> bool:
    return is_topic_field(f) and not f.is_array


@cache
def checks_ids(message: MessageSpec, api_key: int, version: int) -> bool:
    """Whether ``version`` of the request ``message`` names topics by id, and those ids
    are checked under a map that hides other tenants' topics."""
    return api_key not in _NOT_CHECKED and reaches_in(message, is_topic_id_field, version)


@cache
def _pairs(struct: StructSpec, version: int) -> tuple[str, str] | None:
    """(name attribute, id attribute) when ``struct`` holds a topic's name and id."""
    fields = [f for f in struct.fields if version in f.versions]
    name = next((f.attr for f in fields if _is_name_field(f)), None)
    topic_id = next((f.attr for f in fields if is_topic_id_field(f)), None)
    return (name, topic_id) if name is not None and topic_id is not None else None


@cache
def teaches_ids(message: MessageSpec, version: int) -> bool:
    """Whether ``version`` of the response ``message`` pairs topic names with ids."""
    return reaches_in(message, is_topic_id_field, version) and reaches_in(
        message, _is_name_field, version)


def request_ids(req: Request) -> Iterator[bytes]:
    """The 16 bytes of every topic id a request names that ``checks_ids`` covers (the
    zero id, "no id", left out)."""
    if req.frame is not None and not req.body_decoded:
        # Read from the bytes, as the metrics do: Produce and Fetch are not decoded.
        keys: list[Any] | None = None
        if req.api_key == PRODUCE:
            topics = produce.request_topics(req.frame, req.api_version, count=False)
            keys = None if topics is None else [key for key, *_ in topics]
        elif req.api_key == FETCH:
            keys = fetch.request_topic_ids(req.frame, req.api_version)
        if keys is not None:
            yield from (key for key in keys if isinstance(key, bytes) and key != _ZERO)
            return
    found: list[bytes] = []

    def visit(struct: StructSpec, record: Any) -> Any:
        if struct.name != _FORGOTTEN:
            value = getattr(record, "topic_id", None)
            if value is not None and value.bytes != _ZERO:
                found.append(value.bytes)
        return record

    rewrite(req.api.request, req.api_version, req.body, is_topic_id_field, visit)
    yield from found


class TopicIds:
    """Topic id -> broker-side name, learned from answers; bounded (oldest out first)."""

    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        self.limit = limit
        self.names: dict[bytes, str] = {}

    def learn(self, resp: Response) -> None:
        """Every (id, name) pair in a decoded answer, names as the broker has them."""
        names = self.names

        def visit(struct: StructSpec, record: Any) -> Any:
            pair = _pairs(struct, resp.api_version)
            if pair is not None:
                name, topic_id = getattr(record, pair[0]), getattr(record, pair[1])
                if name and topic_id is not None and topic_id.int:
                    key = topic_id.bytes
                    if names.get(key) != name:
                        if key not in names and len(names) >= self.limit:
                            del names[next(iter(names))]
                        names[key] = name
            return record

        rewrite(resp.api.response, resp.api_version, resp.body, is_topic_id_field, visit)

    def shown(self, topic_id: bytes, mapping: TopicMap) -> bool | None:
        """Whether the client under ``mapping`` may name the topic ``topic_id``: None
        when the id has not been seen."""
        name = self.names.get(topic_id)
        if name is None:
            return None
        return mapping.to_client(name) is not None

    def refused(self, req: Request, mapping: TopicMap) -> tuple[int, int]:
        """(foreign ids, ids not seen yet) among those ``req`` names: (0, 0) lets it go."""
        foreign = unseen = 0
        for topic_id in request_ids(req):
            shown = self.shown(topic_id, mapping)
            if shown is None:
                unseen += 1
            elif not shown:
                foreign += 1
        return foreign, unseen

    def head_shown(self, req: Request, mapping: TopicMap) -> bool:
        """For a Produce request of which only the first bytes have arrived: whether it
        names one topic, by an id the client may name, in those bytes.  False sends the
        caller to the whole request, checked as any other."""
        if req.api_key != PRODUCE or req.frame is None:
            return False
        topic_id = produce.request_head_topic_id(req.frame, req.api_version)
        return topic_id is not None and self.shown(topic_id, mapping) is True
