"""``produce_policy``: what a client's Produce requests must be (pure).

Platform teams hold producers to settings the brokers cannot require of them: every
write acknowledged by all in-sync replicas (``acks: all``), batches compressed with the
codecs the cluster is sized for, producers that are idempotent (or transactional), so a
retry never writes a record twice.  Each is read from the request's own bytes: its
``acks`` and each record batch's header (compression, producer id), never a record.

With ``topics`` (regular expressions over whole names, as the client names them), only
the batches of those topics are held to it, and only a request writing to one of them
to its ``acks``.  A request naming topics by id (Produce v13) is matched through the
names the caller learned for those ids; an id not learned yet refuses the request with
UNKNOWN_TOPIC_ID (the client refreshes its metadata, through the proxy, and retries).

A request that breaks the policy is refused whole (every partition answers
POLICY_VIOLATION, saying what to change): these are producer settings, so all of one
producer's requests break them alike.  An acks=0 request has no answer to carry the
error: its connection is closed, as a broker does when such a write fails.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Final

from gatehouse.codecs.records import COMPRESSION_NAMES, LegacyMessage, RecordBatch, iter_batches
from gatehouse.rules.errors import POLICY_VIOLATION, UNKNOWN_TOPIC_ID

ACKS_NAMES: Final = {"all": -1, "-1": -1, "1": 1, "0": 0}
_ACKS_TEXT: Final = {-1: "all", 1: "1", 0: "0"}


UNSEEN_ID: Final = ("names by id a topic not yet seen in a Metadata answer (the client "
                    "refreshes its metadata, through the proxy, and retries)")
IdNames = Callable[[bytes], "str | None"]  # a topic id's bytes -> its client-side name


@dataclass(frozen=True)
class ProducePolicy:
    acks: frozenset[int] | None = None  # acks values allowed (-1 is all); None: any
    compression: frozenset[str] | None = None  # batch codecs allowed ("none"...); None: any
    idempotent: bool = False  # batches must carry a producer id
    topics: tuple[re.Pattern[str], ...] | None = None  # client-side names; None: all

    def violation(self, acks: int, batches: Iterable[tuple[str, RecordBatch | LegacyMessage]]
                  ) -> str | None:
        """What the request breaks (None: nothing), from its ``acks`` and its batches
        (each with the partition it is for, to name it)."""
        if self.acks is not None and acks not in self.acks:
            allowed = " or ".join(_ACKS_TEXT.get(a, str(a)) for a in sorted(self.acks))
            return f"acks={_ACKS_TEXT.get(acks, acks)} is not allowed (use acks={allowed})"
        for where, batch in batches:
            if self.compression is not None and batch.compression not in self.compression:
                allowed = ", ".join(sorted(self.compression))
                return (f"{where}: batches compressed with {batch.compression} are not "
                        f"allowed (compression.type: {allowed})")
            if self.idempotent and (isinstance(batch, LegacyMessage) or batch.producer_id < 0):
                return (f"{where}: the producer is not idempotent (enable.idempotence=true, "
                        "or a transactional producer)")
        return None


def topic_key(topic: Any) -> Any:
    """How a Produce request or response names a topic entry: its name, or its id's
    bytes (v13)."""
    name = getattr(topic, "name", None)
    if name:
        return name
    topic_id = getattr(topic, "topic_id", None)
    return None if topic_id is None else topic_id.bytes


def partition_place(topic: str | bytes | None, partition: int) -> str:
    """"topic t partition p" for errors and logs; a topic known by its id alone (the
    bytes of ``topic_key``) is named by that id."""
    named = (f"id {uuid.UUID(bytes=topic)}" if isinstance(topic, bytes)
             else topic if topic else "?")
    return f"topic {named} partition {partition}"


def client_topic_names(body: Any, id_names: IdNames) -> Iterator[tuple[Any, str | None]]:
    """Each topic entry of a Produce request's body with the name the client knows it
    by: its ``name``, or for a topic named by id (v13) ``id_names(id bytes)``, None when
    not known."""
    for topic in body.topic_data:
        key = topic_key(topic)
        yield topic, id_names(key) if isinstance(key, bytes) else key


def in_scope(topics: tuple[re.Pattern[str], ...] | None, name: str) -> bool:
    """Whether a rule part limited to ``topics`` (None: all) applies to ``name``."""
    return topics is None or any(p.fullmatch(name) for p in topics)


def _unknown(_: bytes) -> None:
    return None


def produce_batches(body: Any, topics: tuple[re.Pattern[str], ...] | None = None,
                    id_names: IdNames = _unknown
                    ) -> Iterable[tuple[str, RecordBatch | LegacyMessage]]:
    """Every batch of a Produce request's body (of ``topics`` only, if given), with
    where it goes ("topic t partition p", by id where the request names topics by id
    and the name is not known)."""
    for topic, name in client_topic_names(body, id_names):
        if topics is not None and (name is None or not in_scope(topics, name)):
            continue
        for partition in topic.partition_data:
            where = partition_place(name or topic_key(topic), partition.index)
            for batch in iter_batches(partition.records):
                yield where, batch


def produce_violation(policy: ProducePolicy, body: Any, id_names: IdNames = _unknown
                      ) -> tuple[int, str] | None:
    """What a Produce request's ``body`` breaks of ``policy``, as (error code, message)
    (None: nothing): POLICY_VIOLATION, or UNKNOWN_TOPIC_ID for a policy limited to some
    topics and a request naming one by an id ``id_names`` does not know."""
    if policy.topics is not None:
        named = list(client_topic_names(body, id_names))
        if any(name is None for _, name in named):
            return UNKNOWN_TOPIC_ID, UNSEEN_ID
        if not any(in_scope(policy.topics, name) for _, name in named if name is not None):
            return None
    broken = policy.violation(body.acks, produce_batches(body, policy.topics, id_names))
    return None if broken is None else (POLICY_VIOLATION, broken)


__all__ = [
    "ACKS_NAMES",
    "COMPRESSION_NAMES",
    "UNSEEN_ID",
    "IdNames",
    "ProducePolicy",
    "client_topic_names",
    "in_scope",
    "partition_place",
    "produce_batches",
    "produce_violation",
    "topic_key",
]
