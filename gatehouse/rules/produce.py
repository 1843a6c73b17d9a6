"""``produce_policy``: what a client's Produce requests must be (pure).

Platform teams hold producers to settings the brokers cannot require of them: every
write acknowledged by all in-sync replicas (``acks: all``), batches compressed with the
codecs the cluster is sized for, producers that are idempotent (or transactional), so a
retry never writes a record twice.  Each is read from the request's own bytes: its
``acks`` and each record batch's header (compression, producer id), never a record.

A request that breaks the policy is refused whole (every partition answers
POLICY_VIOLATION, saying what to change): these are producer settings, so all of one
producer's requests break them alike.  An acks=0 request has no answer to carry the
error: its connection is closed, as a broker does when such a write fails.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

from gatehouse.codecs.records import COMPRESSION_NAMES, LegacyMessage, RecordBatch, iter_batches

POLICY_VIOLATION: Final = 44
ACKS_NAMES: Final = {"all": -1, "-1": -1, "1": 1, "0": 0}
_ACKS_TEXT: Final = {-1: "all", 1: "1", 0: "0"}


@dataclass(frozen=True)
class ProducePolicy:
    acks: frozenset[int] | None = None  # acks values allowed (-1 is all); None: any
    compression: frozenset[str] | None = None  # batch codecs allowed ("none"...); None: any
    idempotent: bool = False  # batches must carry a producer id

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


def produce_batches(body: Any) -> Iterable[tuple[str, RecordBatch | LegacyMessage]]:
    """Every batch of a Produce request's body, with where it goes ("topic t partition
    p", by id where the request names topics by id)."""
    for topic in body.topic_data:
        name = getattr(topic, "name", None)
        if not name:
            topic_id = getattr(topic, "topic_id", None)
            name = f"id {topic_id}" if topic_id is not None else "?"  # a UUID
        for partition in topic.partition_data:
            where = f"topic {name} partition {partition.index}"
            for batch in iter_batches(partition.records):
                yield where, batch


def produce_violation(policy: ProducePolicy, body: Any) -> str | None:
    """What a Produce request's ``body`` breaks of ``policy`` (None: nothing)."""
    return policy.violation(body.acks, produce_batches(body))


__all__ = [
    "ACKS_NAMES",
    "COMPRESSION_NAMES",
    "POLICY_VIOLATION",
    "ProducePolicy",
    "produce_batches",
    "produce_violation",
]
