"""Access control lists in a rule (``acls``): which operations a client may perform on
which topics, groups and transactional ids, as Kafka's ACLs say it (pure).

Where the proxy authenticates clients itself (``sasl.downstream``) and the brokers see
the proxy's one identity, the brokers' ACLs cannot tell clients apart: the proxy's
can.  An entry allows or denies operations on names (regular expressions over whole
names)::

    acls:
      - {allow: [read], topics: ["billing\\..*"], groups: ["team-b\\..*"]}
      - {allow: [write], topics: ["team-b\\..*"]}
      - {deny: [delete, alter], topics: [".*"]}

Each API needs one operation on each kind of name it holds (``API_OPERATIONS``, after
Kafka's authorizer: Produce writes its topics, Fetch reads them, Metadata describes
them, JoinGroup reads its group...).  A name is allowed when an ``allow`` entry grants
the operation, or one implying it (Kafka's: read, write, delete and alter imply
describe; alter_configs implies describe_configs; all implies every one), and no
``deny`` entry names the operation (or all).  Kinds of names no entry mentions are not
restricted by the rule.  The ACLs compile, per API, into the same filters as
``allow_topics`` / ``allow_groups`` / ``allow_transactional_ids``: a request naming a
name it may not use is refused with Kafka's error for it (TOPIC_AUTHORIZATION_FAILED,
GROUP_AUTHORIZATION_FAILED, TRANSACTIONAL_ID_AUTHORIZATION_FAILED), and answers leave
out what the client may not see (a topic it may not describe is not in Metadata).
Cluster operations (creating any topic, quotas, ACLs themselves) are the rules'
``deny_apis`` / ``allow_apis``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import ClassVar, Final

from gatehouse.codecs import APIS
from gatehouse.rules.topics import (
    GROUP,
    ID_FILTER_KEYS,
    TOPIC,
    TRANSACTION,
    Chain,
    IdFilter,
    NameFilter,
    TopicFilter,
    TopicMap,
    names_ids,
    names_topics,
)

KINDS: Final = (TOPIC, GROUP, TRANSACTION)
# The rule keys of each kind of name in an entry (those of allow_ / deny_ lists).
KIND_KEYS: Final = {TOPIC: "topics", **ID_FILTER_KEYS}
OPERATIONS: Final = ("all", "read", "write", "create", "delete", "alter", "describe",
                     "describe_configs", "alter_configs")
# Kafka's implied operations: allowing the key allows these too.
IMPLIES: Final[Mapping[str, frozenset[str]]] = {
    "all": frozenset(OPERATIONS),
    "read": frozenset({"read", "describe"}),
    "write": frozenset({"write", "describe"}),
    "delete": frozenset({"delete", "describe"}),
    "alter": frozenset({"alter", "describe"}),
    "alter_configs": frozenset({"alter_configs", "describe_configs"}),
    **{op: frozenset({op}) for op in ("create", "describe", "describe_configs")},
}

_R, _W, _C, _D, _A, _DE = "read", "write", "create", "delete", "alter", "describe"
_DC, _AC = "describe_configs", "alter_configs"
# API -> kind -> the operation it needs on each name of that kind it holds, as Kafka's
# authorizer checks it (KafkaApis and the group and transaction coordinators).
API_OPERATIONS: Final[Mapping[str, Mapping[str, str]]] = {
    "Produce": {TOPIC: _W, TRANSACTION: _W},
    "Fetch": {TOPIC: _R},
    "ListOffsets": {TOPIC: _DE},
    "Metadata": {TOPIC: _DE},
    "OffsetCommit": {TOPIC: _R, GROUP: _R},
    "OffsetFetch": {TOPIC: _DE, GROUP: _DE},
    "FindCoordinator": {GROUP: _DE, TRANSACTION: _DE},
    "JoinGroup": {GROUP: _R},
    "Heartbeat": {GROUP: _R},
    "LeaveGroup": {GROUP: _R},
    "SyncGroup": {GROUP: _R},
    "DescribeGroups": {GROUP: _DE},
    "ListGroups": {GROUP: _DE},
    "CreateTopics": {TOPIC: _C},
    "DeleteTopics": {TOPIC: _D},
    "DeleteRecords": {TOPIC: _D},
    "InitProducerId": {TRANSACTION: _W},
    "OffsetForLeaderEpoch": {TOPIC: _DE},
    "AddPartitionsToTxn": {TOPIC: _W, TRANSACTION: _W},
    "AddOffsetsToTxn": {GROUP: _R, TRANSACTION: _W},
    "EndTxn": {TRANSACTION: _W},
    "TxnOffsetCommit": {TOPIC: _R, GROUP: _R, TRANSACTION: _W},
    "DescribeConfigs": {TOPIC: _DC, GROUP: _DC},
    "AlterConfigs": {TOPIC: _AC, GROUP: _AC},
    "IncrementalAlterConfigs": {TOPIC: _AC, GROUP: _AC},
    "AlterReplicaLogDirs": {TOPIC: _A},
    "DescribeLogDirs": {TOPIC: _DE},
    "CreatePartitions": {TOPIC: _A},
    "DeleteGroups": {GROUP: _D},
    "ElectLeaders": {TOPIC: _A},
    "AlterPartitionReassignments": {TOPIC: _A},
    "ListPartitionReassignments": {TOPIC: _DE},
    "OffsetDelete": {TOPIC: _R, GROUP: _D},
    "DescribeProducers": {TOPIC: _R},
    "DescribeTransactions": {TRANSACTION: _DE},
    "ListTransactions": {TRANSACTION: _DE},
    "ConsumerGroupHeartbeat": {TOPIC: _DE, GROUP: _R},
    "ConsumerGroupDescribe": {TOPIC: _DE, GROUP: _DE},
    "DescribeTopicPartitions": {TOPIC: _DE},
    "ShareGroupHeartbeat": {TOPIC: _DE, GROUP: _R},
    "ShareGroupDescribe": {TOPIC: _DE, GROUP: _DE},
    "ShareFetch": {TOPIC: _R, GROUP: _R},
    "ShareAcknowledge": {TOPIC: _R, GROUP: _R},
    "StreamsGroupHeartbeat": {TOPIC: _DE, GROUP: _R},
    "StreamsGroupDescribe": {TOPIC: _DE, GROUP: _DE},
    "DescribeShareGroupOffsets": {TOPIC: _DE, GROUP: _DE},
    "AlterShareGroupOffsets": {TOPIC: _R, GROUP: _R},
    "DeleteShareGroupOffsets": {TOPIC: _R, GROUP: _D},
}
# An API the table does not name that holds names (a newer one): the strictest
# operation of the usual ones, so that no new API opens what the ACLs close.
UNLISTED: Final = _A


@dataclass(frozen=True)
class AclEntry:
    allow: bool
    operations: frozenset[str]
    names: Mapping[str, tuple[re.Pattern[str], ...]]  # kind -> patterns


class AclTopicFilter(TopicFilter):
    """A topic filter an ACL made: its refusals are the rule's ``acls``."""

    action: ClassVar[str | None] = "acls"


class AclIdFilter(IdFilter):
    """A group / transactional id filter an ACL made."""

    action: ClassVar[str | None] = "acls"


@cache
def _names_kind(api_key: int, kind: str) -> bool:
    """Whether some version of the API's requests or responses holds names of ``kind``."""
    spec = APIS[api_key]
    for version in range(spec.versions.lo, spec.versions.hi + 1):
        for message in (spec.request, spec.response):
            if (names_topics(message, version) if kind == TOPIC
                    else names_ids(message, version, frozenset({kind}))):
                return True
    return False


def operation(api_key: int, kind: str) -> str | None:
    """The operation the API needs on each name of ``kind`` it holds; None when it holds
    none of that kind."""
    spec = APIS.get(api_key)
    if spec is None:
        return None
    listed = API_OPERATIONS.get(spec.name)
    if listed is not None:
        return listed.get(kind)
    return UNLISTED if _names_kind(api_key, kind) else None


def _filter(entries: Sequence[AclEntry], kind: str, op: str) -> NameFilter:
    allow: list[re.Pattern[str]] = []
    deny: list[re.Pattern[str]] = []
    for entry in entries:
        patterns = entry.names.get(kind, ())
        if not patterns:
            continue
        if entry.allow and any(op in IMPLIES[o] for o in entry.operations):
            allow.extend(patterns)
        elif not entry.allow and (op in entry.operations or "all" in entry.operations):
            deny.extend(patterns)
    if kind == TOPIC:
        return AclTopicFilter(tuple(allow), tuple(deny))
    return NameFilter(tuple(allow), tuple(deny))


def compile_acls(entries: Sequence[AclEntry], then: TopicMap | None
                 ) -> dict[int, TopicMap]:
    """API key -> the map a rule with these entries applies to that API's requests and
    answers: the ACL's filters, then ``then`` (the rule's rename or prefix: ACLs speak
    of the names the client uses).  APIs the ACLs do not restrict are left out (the
    rule's own map applies to them)."""
    kinds = [kind for kind in KINDS if any(kind in e.names for e in entries)]
    out: dict[int, TopicMap] = {}
    # One filter per kind and operation, shared by every API that needs it (so is what
    # each has learnt of which names pass).
    made: dict[tuple[str, str], NameFilter] = {}
    for api_key in APIS:
        parts: list[TopicMap] = []
        ids: dict[str, NameFilter] = {}
        for kind in kinds:
            op = operation(api_key, kind)
            if op is None:
                continue
            names = made.get((kind, op))
            if names is None:
                names = made[kind, op] = _filter(entries, kind, op)
            if isinstance(names, TopicFilter):
                parts.append(names)
            else:
                ids[kind] = names
        if ids:
            parts.append(AclIdFilter(ids))
        if not parts:
            continue
        if then is not None:
            parts.append(then)
        out[api_key] = parts[0] if len(parts) == 1 else Chain(tuple(parts))
    return out


__all__ = [
    "API_OPERATIONS",
    "IMPLIES",
    "KIND_KEYS",
    "OPERATIONS",
    "AclEntry",
    "AclIdFilter",
    "AclTopicFilter",
    "compile_acls",
    "operation",
]
