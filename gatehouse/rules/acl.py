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

The cluster is a resource too (``cluster: true`` in an entry), as in Kafka: the APIs
Kafka's authorizer checks on the cluster (``CLUSTER_OPERATIONS``: ACLs, quotas, SCRAM
credentials, reassignments, log dirs, features, leader elections, the quorum; and the
brokers' own APIs, ``cluster_action``) need that operation there::

    acls:
      - {allow: [describe, describe_configs], cluster: true}
      - {allow: [create], cluster: true}      # creating any topic, as in Kafka

Once an entry names the cluster, a request to such an API that no entry allows (or one
denies) is refused whole with CLUSTER_AUTHORIZATION_FAILED; rules whose entries never
name the cluster leave those APIs to the brokers (or ``deny_apis`` / ``allow_apis``).
The configs of brokers, broker loggers and client-metrics subscriptions are the
cluster's too (``CLUSTER_CONFIG_OPERATIONS``): a DescribeConfigs, AlterConfigs or
IncrementalAlterConfigs request naming one needs describe_configs / alter_configs
there, and is refused whole without it.  ``create`` on the cluster lets CreateTopics
create any topic, whatever the topic entries say (Kafka's own rule).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, ClassVar, Final

from gatehouse.codecs import API_KEYS_BY_NAME, APIS
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
    names_resources,
    names_topics,
)

KINDS: Final = (TOPIC, GROUP, TRANSACTION)
# The rule keys of each kind of name in an entry (those of allow_ / deny_ lists).
KIND_KEYS: Final = {TOPIC: "topics", **ID_FILTER_KEYS}
OPERATIONS: Final = ("all", "read", "write", "create", "delete", "alter", "describe",
                     "describe_configs", "alter_configs")
# The operations Kafka has on its cluster resource.  ``idempotent_write`` is taken but
# checks nothing here: Kafka lets an idempotent producer in with write on any topic,
# and the proxy checks its writes topic by topic.
CLUSTER_OPS: Final = ("all", "create", "alter", "describe", "describe_configs",
                      "alter_configs", "cluster_action", "idempotent_write")
# Kafka's implied operations: allowing the key allows these too.
IMPLIES: Final[Mapping[str, frozenset[str]]] = {
    "all": frozenset(OPERATIONS + CLUSTER_OPS),
    "read": frozenset({"read", "describe"}),
    "write": frozenset({"write", "describe"}),
    "delete": frozenset({"delete", "describe"}),
    "alter": frozenset({"alter", "describe"}),
    "alter_configs": frozenset({"alter_configs", "describe_configs"}),
    **{op: frozenset({op}) for op in ("create", "describe", "describe_configs",
                                       "cluster_action", "idempotent_write")},
}

_R, _W, _C, _D, _A, _DE = "read", "write", "create", "delete", "alter", "describe"
METADATA: Final = API_KEYS_BY_NAME["Metadata"]
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

_CA = "cluster_action"
# API -> the operation it needs on the cluster and from which version, as Kafka's
# authorizer checks it (KafkaApis, ControllerApis, AclApis): a request without it is
# refused whole with CLUSTER_AUTHORIZATION_FAILED.
CLUSTER_OPERATIONS: Final[Mapping[str, tuple[str, int]]] = {
    "DescribeAcls": (_DE, 0),
    "CreateAcls": (_A, 0),
    "DeleteAcls": (_A, 0),
    "ElectLeaders": (_A, 0),
    "AlterPartitionReassignments": (_A, 0),
    "ListPartitionReassignments": (_DE, 0),
    "AlterReplicaLogDirs": (_A, 0),
    "DescribeLogDirs": (_DE, 0),
    "UpdateFeatures": (_A, 0),
    "DescribeClientQuotas": (_DC, 0),
    "AlterClientQuotas": (_AC, 0),
    "DescribeUserScramCredentials": (_DE, 0),
    "AlterUserScramCredentials": (_A, 0),
    "DescribeQuorum": (_DE, 0),
    "UnregisterBroker": (_A, 0),
    "AddRaftVoter": (_A, 0),
    "RemoveRaftVoter": (_A, 0),
    "ListConfigResources": (_DC, 0),
    # Versions 4+ are the brokers' own (transaction verification), not a client's.
    "AddPartitionsToTxn": (_CA, 4),
    # What brokers and controllers send each other.
    **{name: (_CA, 0) for name in (
        "WriteTxnMarkers", "Vote", "BeginQuorumEpoch", "EndQuorumEpoch", "AlterPartition",
        "Envelope", "FetchSnapshot", "BrokerRegistration", "BrokerHeartbeat",
        "AllocateProducerIds", "ControllerRegistration", "AssignReplicasToDirs",
        "UpdateRaftVoter", "InitializeShareGroupState", "ReadShareGroupState",
        "WriteShareGroupState", "DeleteShareGroupState", "ReadShareGroupStateSummary")},
}
# The configs of brokers, their loggers and client-metrics subscriptions are the
# cluster's: a config API's request that names one of those resources needs this
# operation on the cluster (its topics' and groups' configs are API_OPERATIONS').
CLUSTER_CONFIG_OPERATIONS: Final[Mapping[str, str]] = {
    "DescribeConfigs": _DC, "AlterConfigs": _AC, "IncrementalAlterConfigs": _AC}
CLUSTER_CONFIG_RESOURCES: Final = frozenset({4, 8, 16})  # BROKER, BROKER_LOGGER, CLIENT_METRICS
# APIs Kafka checks nothing on the cluster for, beyond the names in API_OPERATIONS:
# a connection's first steps, DescribeCluster (its answer says what the client may do),
# telemetry, and delegation tokens (checked on the tokens and their owners).
NO_CLUSTER_CHECK: Final = frozenset({
    "ApiVersions", "SaslHandshake", "SaslAuthenticate", "DescribeCluster",
    "GetTelemetrySubscriptions", "PushTelemetry", "CreateDelegationToken",
    "RenewDelegationToken", "ExpireDelegationToken", "DescribeDelegationToken"})


@dataclass(frozen=True)
class AclEntry:
    allow: bool
    operations: frozenset[str]
    names: Mapping[str, tuple[re.Pattern[str], ...]]  # kind -> patterns
    cluster: bool = False  # the entry is about the cluster too


class AclTopicFilter(TopicFilter):
    """A topic filter an ACL made: its refusals are the rule's ``acls``."""

    action: ClassVar[str | None] = "acls"


@dataclass(frozen=True, eq=False)
class AclMetadataFilter(AclTopicFilter):
    """Metadata's topic filter an ACL made: the topics it may describe, and of those
    the ones it may have the broker create (``creates``; None: every one, create on the
    cluster), as Kafka's authorizer checks a Metadata request's auto-creation."""

    creates: NameFilter | None = None

    def may_create(self, name: str) -> bool:
        return self.permits(name) and (self.creates is None or self.creates.permits(name))


class AclIdFilter(IdFilter):
    """A group / transactional id filter an ACL made."""

    action: ClassVar[str | None] = "acls"


@cache
def _names_kind(api_key: int, kind: str) -> bool:
    """Whether some version of the API's requests or responses holds names of ``kind``."""
    spec = APIS[api_key]
    for version in range(spec.versions.lo, spec.versions.hi + 1):
        for message in (spec.request, spec.response):
            # (Resources name groups and transactional ids too: ACLs', configs'.)
            if (names_topics(message, version) if kind == TOPIC
                    else names_ids(message, version, frozenset({kind}))
                    or names_resources(message, version)):
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


def cluster_operation(api_key: int, version: int) -> str | None:
    """The operation a request of this API and version needs on the cluster; None when
    it needs none.  An API no table names (a newer one) that holds no names needs
    ``alter``, so that no new API opens what the ACLs close."""
    spec = APIS.get(api_key)
    if spec is None:
        return None
    listed = CLUSTER_OPERATIONS.get(spec.name)
    if listed is not None:
        return listed[0] if version >= listed[1] else None
    if spec.name in NO_CLUSTER_CHECK or spec.name in API_OPERATIONS:
        return None
    return None if any(_names_kind(api_key, kind) for kind in KINDS) else UNLISTED


def cluster_allows(entries: Sequence[AclEntry], op: str) -> bool:
    """Whether the entries grant ``op`` on the cluster (an ``allow`` of it or of one
    implying it, and no ``deny`` of it or of ``all``)."""
    cluster = [e for e in entries if e.cluster]
    return (any(e.allow and any(op in IMPLIES[o] for o in e.operations) for e in cluster)
            and not any(not e.allow and (op in e.operations or "all" in e.operations)
                        for e in cluster))


def cluster_config_refusals(entries: Sequence[AclEntry]) -> dict[int, str]:
    """API key -> operation for each config API whose requests naming a resource of the
    cluster's (``CLUSTER_CONFIG_RESOURCES``) the entries refuse; none when no entry
    names the cluster."""
    if not any(e.cluster for e in entries):
        return {}
    return {api_key: op for api_key, spec in APIS.items()
            if (op := CLUSTER_CONFIG_OPERATIONS.get(spec.name)) is not None
            and not cluster_allows(entries, op)}


def names_cluster_configs(req: Any) -> bool:
    """Whether a config API's request names a resource of the cluster's."""
    return any(r.resource_type in CLUSTER_CONFIG_RESOURCES
               for r in getattr(req.body, "resources", None) or ())


def cluster_refusals(entries: Sequence[AclEntry]) -> dict[int, tuple[str, int]]:
    """API key -> (operation, from version) for each API whose requests the entries
    refuse for want of that operation on the cluster; none when no entry names it."""
    if not any(e.cluster for e in entries):
        return {}
    out = {}
    for api_key, spec in APIS.items():
        listed = CLUSTER_OPERATIONS.get(spec.name)
        if listed is None:
            op = cluster_operation(api_key, spec.versions.hi)
            listed = None if op is None else (op, 0)
        if listed is not None and not cluster_allows(entries, listed[0]):
            out[api_key] = listed
    return out


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
    # Kafka: create on the cluster creates any topic, whatever the topic's ACLs say.
    creates_any = cluster_allows(entries, "create")
    out: dict[int, TopicMap] = {}
    # One filter per kind and operation, shared by every API that needs it (so is what
    # each has learnt of which names pass).
    made: dict[tuple[str, str], NameFilter] = {}
    for api_key in APIS:
        parts: list[TopicMap] = []
        ids: dict[str, NameFilter] = {}
        for kind in kinds:
            op = operation(api_key, kind)
            if op is None or (creates_any and kind == TOPIC and op == _C):
                continue
            names = made.get((kind, op))
            if names is None:
                names = made[kind, op] = _filter(entries, kind, op)
            if api_key == METADATA and kind == TOPIC:
                names = AclMetadataFilter(names.allow, names.deny,
                                          None if creates_any else _filter(entries, TOPIC, _C))
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
    "CLUSTER_CONFIG_OPERATIONS",
    "CLUSTER_CONFIG_RESOURCES",
    "CLUSTER_OPERATIONS",
    "CLUSTER_OPS",
    "IMPLIES",
    "KIND_KEYS",
    "OPERATIONS",
    "AclEntry",
    "AclIdFilter",
    "AclTopicFilter",
    "cluster_allows",
    "cluster_config_refusals",
    "cluster_operation",
    "cluster_refusals",
    "compile_acls",
    "names_cluster_configs",
    "operation",
]
