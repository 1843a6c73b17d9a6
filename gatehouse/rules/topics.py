"""Topic renames and prefixes, in every place a topic name appears (pure).

Where names live, found from the tables rather than a hand list:

* every field the specs mark ``entityType: topicName`` (strings and string arrays), in
  requests and responses of every API but DescribeQuorum (whose topic is the cluster's
  metadata log, ``_CLUSTER_LOG_MESSAGES``);
* resource names whose resource type is TOPIC (2): DescribeConfigs, AlterConfigs,
  IncrementalAlterConfigs, ListConfigResources, CreateAcls, DescribeAcls, DeleteAcls;
* the consumer protocol bytes inside JoinGroup, SyncGroup and DescribeGroups
  (subscriptions and assignments; decoded statelessly from ProtocolType, KIP-559, with
  the connection's JoinGroup as the fallback for older versions);
* error messages that quote a broker-side name.

The client sees its names, the broker holds the others.  Broker-side names the client
must not see (other tenants, with ``hide_others``) are removed from responses.

A prefix with ``groups`` (``transactional_ids``) maps group ids (transactional ids)
the same way: every field the specs mark ``entityType: groupId`` (``transactionalId``),
FindCoordinator's keys of that type, and resources of that type (ACL bindings, config
resources).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache, partial
from typing import Any, ClassVar

from gatehouse.codecs import (
    FieldSpec,
    MessageSpec,
    Request,
    Response,
    StructSpec,
    consumer,
    decode_request,
    decode_response,
    produce,
)
from gatehouse.codecs.errors import ProtocolError
from gatehouse.codecs.walk import reaches, reaches_in, rewrite
from gatehouse.rules import cursors
from gatehouse.rules.errors import has_field

TOPIC_RESOURCE = 2
PRODUCE, METADATA, FIND_COORDINATOR, JOIN_GROUP, SYNC_GROUP, DESCRIBE_GROUPS = (
    0, 3, 10, 11, 14, 15)
DESCRIBE_TOPIC_PARTITIONS = 75
CONSUMER_GROUP_HEARTBEAT, STREAMS_GROUP_HEARTBEAT = 68, 88
LIST_TRANSACTIONS = 66
CONSUMER = consumer.CONSUMER_PROTOCOL_TYPE

# The other kinds of names a prefix may map besides topics (and topics themselves, where
# a kind of name is asked for: a name a filter refuses, an ACL's names).
GROUP, TRANSACTION = "group", "transactional_id"
TOPIC = "topic"
IdKinds = frozenset[str]


@dataclass(frozen=True)
class _Kind:
    entity: str  # the specs' entityType
    # Its resource types: in ACL bindings (GROUP 3, TRANSACTIONAL_ID 5) and in config
    # resources (GROUP 32, KIP-848); none of these numbers means another kind in the other.
    resource_types: frozenset[int]
    key_type: int  # FindCoordinator's KeyType


_KINDS = {GROUP: _Kind("groupId", frozenset({3, 32}), 0),
          TRANSACTION: _Kind("transactionalId", frozenset({5}), 1)}
_KIND_OF_ENTITY = {k.entity: name for name, k in _KINDS.items()}
_KIND_OF_KEY_TYPE = {k.key_type: name for name, k in _KINDS.items()}


class TopicMap:
    """A client-name <-> broker-name mapping; ``to_client`` returns None to hide a name."""

    broker_to_client: dict[str, str]

    def to_broker(self, name: str) -> str:
        raise NotImplementedError

    def to_client(self, name: str) -> str | None:
        raise NotImplementedError

    def message_to_client(self, text: str) -> str:
        return text

    @property
    def hides_others(self) -> bool:
        """Whether it keeps other tenants' topics from the client, ids included
        (``rules.topicids``): a prefix with ``hide_others``.  A rename's shadowed names
        are hidden from answers but are no boundary between tenants."""
        return False

    @property
    def id_kinds(self) -> IdKinds:
        """The kinds of names mapped besides topics (``GROUP``, ``TRANSACTION``)."""
        return frozenset()

    def id_to_broker(self, kind: str, name: str) -> str:
        return name

    def id_to_client(self, kind: str, name: str) -> str | None:
        return name

    @property
    def filters(self) -> bool:
        """Whether some names may not be used at all (``TopicFilter``, ``IdFilter``): a
        request naming one is refused (``denies``, ``denies_id``) rather than mapped."""
        return False

    def denies(self, name: str) -> bool:
        """Whether a request that names ``name`` (a client-side name) is refused."""
        return False

    def denies_id(self, kind: str, name: str) -> bool:
        """Whether a request that names the id ``name`` of ``kind`` (``GROUP``,
        ``TRANSACTION``; the client's) is refused."""
        return False


_PERMITS_KEPT = 10_000  # names remembered per filter (a cluster's topics, a few hundred)


@dataclass(frozen=True, eq=False)
class NameFilter:
    """Names a client may use: those ``allow`` matches (all when None) but ``deny`` does
    not (regular expressions over the whole name)."""

    allow: tuple[re.Pattern[str], ...] | None
    deny: tuple[re.Pattern[str], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "_permitted", {})

    def permits(self, name: str) -> bool:
        known: dict[str, bool] = self._permitted  # type: ignore[attr-defined]
        found = known.get(name)
        if found is None:
            found = self.refused_by(name) is None
            if len(known) >= _PERMITS_KEPT:
                known.clear()
            known[name] = found
        return found

    def refused_by(self, name: str) -> str | None:
        """``"deny"`` when a deny pattern matches ``name``, ``"allow"`` when no allow
        pattern does, else None (permitted)."""
        if any(p.fullmatch(name) for p in self.deny):
            return "deny"
        if self.allow is not None and not any(p.fullmatch(name) for p in self.allow):
            return "allow"
        return None


@dataclass(frozen=True, eq=False)
class TopicFilter(NameFilter, TopicMap):
    """The topics a client may use, by the names it uses (``allow_topics``,
    ``deny_topics``).  The others are hidden from every answer, their ids included
    (``hides_others``), and a request that names one is refused (``denies``)."""

    # The rule key its refusals are counted under; None: ``allow_`` or ``deny_topics``.
    action: ClassVar[str | None] = None

    def to_broker(self, name: str) -> str:
        return name

    def to_client(self, name: str) -> str | None:
        return name if self.permits(name) else None

    @property
    def hides_others(self) -> bool:
        return True

    @property
    def filters(self) -> bool:
        return True

    def denies(self, name: str) -> bool:
        return not self.permits(name)

    def may_create(self, name: str) -> bool:
        """Whether a Metadata request may have the broker create ``name`` (a topic the
        client may use, here; an ACL's needs ``create`` too)."""
        return self.permits(name)


def creation_denied(topic_map: TopicMap, name: str) -> bool:
    """Whether a filter in ``topic_map`` keeps a Metadata request from having the
    broker create ``name`` (a client-side name)."""
    for m in map_parts(topic_map):
        if isinstance(m, TopicFilter) and not m.may_create(name):
            return True
        name = m.to_broker(name)
    return False


# The rule keys of an id filter, per kind: allow_groups / deny_groups, ...
ID_FILTER_KEYS = {GROUP: "groups", TRANSACTION: "transactional_ids"}
_ID_WORDS = {GROUP: "group", TRANSACTION: "transactional id"}


@dataclass(frozen=True, eq=False)
class IdFilter(TopicMap):
    """The group ids and transactional ids a client may use, per kind (``allow_groups``
    / ``deny_groups``, ``allow_transactional_ids`` / ``deny_transactional_ids``).  The
    others are left out of every answer (ListGroups, DescribeGroups, ListTransactions,
    ACL listings...), and a request that names one is refused (``denies_id``).  Topics
    pass as they are."""

    by_kind: dict[str, NameFilter]
    action: ClassVar[str | None] = None  # as TopicFilter's

    def to_broker(self, name: str) -> str:
        return name

    def to_client(self, name: str) -> str | None:
        return name

    @property
    def id_kinds(self) -> IdKinds:
        return frozenset(self.by_kind)

    def id_to_client(self, kind: str, name: str) -> str | None:
        names = self.by_kind.get(kind)
        return name if names is None or names.permits(name) else None

    @property
    def filters(self) -> bool:
        return True

    def denies_id(self, kind: str, name: str) -> bool:
        names = self.by_kind.get(kind)
        return names is not None and not names.permits(name)


def map_parts(topic_map: TopicMap) -> tuple[TopicMap, ...]:
    """The maps a composed map applies in order (a single map: itself)."""
    return topic_map.maps if isinstance(topic_map, Chain) else (topic_map,)


def denied_message(name: str, rule: str) -> str:
    """What a refusal for naming a topic a filter does not allow says (the error text
    the client gets, the log line, the impact report's reason)."""
    return f"topic {name!r} is not allowed here (rule {rule})"


def denial(topic_map: TopicMap, name: str) -> str | None:
    """Why ``topic_map`` refuses a request naming ``name`` (a client-side name): the
    filter's key, ``deny_topics`` when a deny pattern matches the name as that filter
    sees it, else ``allow_topics`` (``acls`` for a filter a rule's ACLs made); None when
    it lets the name through."""
    for m in map_parts(topic_map):
        if isinstance(m, TopicFilter) and m.denies(name):
            return m.action or f"{m.refused_by(name)}_topics"
        name = m.to_broker(name)
    return None


def filtered_id_kinds(topic_map: TopicMap) -> IdKinds:
    """The kinds of ids an ``IdFilter`` in ``topic_map`` restricts."""
    return frozenset().union(*(m.by_kind for m in map_parts(topic_map)
                               if isinstance(m, IdFilter)))


def id_denial(topic_map: TopicMap, kind: str, name: str) -> str | None:
    """``denial`` for the id ``name`` of ``kind``: ``deny_groups``, ``allow_groups``,
    ``deny_transactional_ids`` or ``allow_transactional_ids``; None when it passes."""
    for m in map_parts(topic_map):
        if isinstance(m, IdFilter) and m.denies_id(kind, name):
            return m.action or f"{m.by_kind[kind].refused_by(name)}_{ID_FILTER_KEYS[kind]}"
        name = m.id_to_broker(kind, name)
    return None


def denied_id_message(kind: str, name: str, rule: str) -> str:
    """``denied_message`` for an id an id filter does not allow."""
    return f"{_ID_WORDS[kind]} {name!r} is not allowed here (rule {rule})"


@dataclass(frozen=True, eq=False)
class Rename(TopicMap):
    client_to_broker: dict[str, str]

    def __post_init__(self) -> None:
        inverse = {b: c for c, b in self.client_to_broker.items()}
        object.__setattr__(self, "broker_to_client", inverse)
        object.__setattr__(self, "_pattern",
                           _word_pattern(tuple(sorted(inverse, key=len, reverse=True))))

    def to_broker(self, name: str) -> str:
        return self.client_to_broker.get(name, name)

    def to_client(self, name: str) -> str | None:
        client = self.broker_to_client.get(name)
        if client is not None:
            return client
        if name in self.client_to_broker:
            return None  # a broker topic shadowed by a client alias: the alias wins
        return name

    def message_to_client(self, text: str) -> str:
        pattern: re.Pattern[str] | None = self._pattern  # type: ignore[attr-defined]
        if pattern is None:
            return text
        inverse = self.broker_to_client
        return pattern.sub(lambda m: inverse[m.group(0)], text)


@dataclass(frozen=True)
class Prefix(TopicMap):
    prefix: str
    hide_others: bool = False
    groups: bool = False  # group ids get the prefix too
    transactional_ids: bool = False  # and transactional ids

    def to_broker(self, name: str) -> str:
        return self.prefix + name

    def to_client(self, name: str) -> str | None:
        if name.startswith(self.prefix):
            return name[len(self.prefix):]
        return None if self.hide_others else name

    def message_to_client(self, text: str) -> str:
        return re.sub(re.escape(self.prefix) + r"(?=[A-Za-z0-9._-])", "", text)

    @property
    def hides_others(self) -> bool:
        return self.hide_others

    @property
    def id_kinds(self) -> IdKinds:
        return _id_kinds(self.groups, self.transactional_ids)

    def id_to_broker(self, kind: str, name: str) -> str:
        return self.prefix + name if kind in self.id_kinds else name

    def id_to_client(self, kind: str, name: str) -> str | None:
        return self.to_client(name) if kind in self.id_kinds else name


@cache
def _id_kinds(groups: bool, transactional_ids: bool) -> IdKinds:
    return frozenset((GROUP,) * groups + (TRANSACTION,) * transactional_ids)


@dataclass(frozen=True)
class Chain(TopicMap):
    """Maps applied in rule order towards the broker, in reverse towards the client."""

    maps: tuple[TopicMap, ...]

    def to_broker(self, name: str) -> str:
        for m in self.maps:
            name = m.to_broker(name)
        return name

    def to_client(self, name: str) -> str | None:
        result: str | None = name
        for m in reversed(self.maps):
            if result is None:
                return None
            result = m.to_client(result)
        return result

    def message_to_client(self, text: str) -> str:
        for m in reversed(self.maps):
            text = m.message_to_client(text)
        return text

    @property
    def hides_others(self) -> bool:
        return any(m.hides_others for m in self.maps)

    @property
    def id_kinds(self) -> IdKinds:
        return frozenset().union(*(m.id_kinds for m in self.maps))

    def id_to_broker(self, kind: str, name: str) -> str:
        for m in self.maps:
            name = m.id_to_broker(kind, name)
        return name

    def id_to_client(self, kind: str, name: str) -> str | None:
        result: str | None = name
        for m in reversed(self.maps):
            if result is None:
                return None
            result = m.id_to_client(kind, result)
        return result

    @property
    def filters(self) -> bool:
        return any(m.filters for m in self.maps)

    def denies(self, name: str) -> bool:
        for m in self.maps:  # each sees the name as the maps before it leave it
            if m.denies(name):
                return True
            name = m.to_broker(name)
        return False

    def denies_id(self, kind: str, name: str) -> bool:
        for m in self.maps:
            if m.denies_id(kind, name):
                return True
            name = m.id_to_broker(kind, name)
        return False


@cache
def _word_pattern(names: tuple[str, ...]) -> re.Pattern[str] | None:
    if not names:
        return None
    return re.compile(r"(?<![A-Za-z0-9._-])(" + "|".join(map(re.escape, names)) +
                      r")(?![A-Za-z0-9._-])")


# -- where names are ------------------------------------------------------------------


def is_topic_field(f: FieldSpec) -> bool:
    """A field the specs mark as a topic name (a string, or an array of them)."""
    return f.entity == "topicName" and f.type == "string"


def _is_resource_field(f: FieldSpec) -> bool:
    return f.attr in ("resource_name", "resource_name_filter") and f.type == "string"


def _has_direct(struct: StructSpec | None, is_name: Callable[[FieldSpec], bool]) -> bool:
    """Whether ``struct`` holds a single name ``is_name`` picks (its entries' key)."""
    return struct is not None and any(is_name(g) and not g.is_array for g in struct.fields)


def _request_predicate(f: FieldSpec) -> bool:
    return is_topic_field(f) or _is_resource_field(f)


def _response_predicate(f: FieldSpec) -> bool:
    # A struct (an array's entries, or one alone) that holds a topic's (or a resource's)
    # name: its holder is visited too, to drop the entries of names the client may not
    # see (ListConfigResources lists every topic resource on the cluster) and to null a
    # lone one (DescribeTopicPartitions' cursor at another tenant's topic).
    return (is_topic_field(f) or _is_resource_field(f)
            or (f.attr == "error_message" and f.type == "string")
            or _has_direct(f.struct, _request_predicate))


def id_kind(f: FieldSpec) -> str | None:
    """The kind of name (``GROUP``, ``TRANSACTION``) a string field holds, if any."""
    return _KIND_OF_ENTITY.get(f.entity) if f.entity and f.type == "string" else None


def id_resource_types(kind: str) -> frozenset[int]:
    """The resource types (ACLs', configs') whose names are ids of ``kind``."""
    return _KINDS[kind].resource_types


@cache
def _predicates(kinds: IdKinds) -> tuple[Callable[[FieldSpec], bool],
                                         Callable[[FieldSpec], bool],
                                         Callable[[FieldSpec], bool]]:
    """(request, response, id field) predicates with ``kinds`` of ids mapped too: the
    same objects for the same kinds, as the walker's plans are cached per predicate."""
    if not kinds:
        return _request_predicate, _response_predicate, lambda f: False

    def is_id(f: FieldSpec) -> bool:
        return id_kind(f) in kinds

    def request(f: FieldSpec) -> bool:
        return _request_predicate(f) or is_id(f)

    def response(f: FieldSpec) -> bool:
        return (_response_predicate(f) or is_id(f)
                or (f.is_array and _has_direct(f.struct, is_id)))

    return request, response, is_id


def _message_predicate(f: FieldSpec) -> bool:
    return f.attr == "error_message" and f.type == "string"


# Messages whose consumer-protocol bytes hold topic names.
_GROUP_MESSAGES = frozenset({"JoinGroupRequest", "JoinGroupResponse", "SyncGroupRequest",
                             "SyncGroupResponse", "DescribeGroupsResponse"})


# Messages whose topic is the cluster's metadata log (KRaft's __cluster_metadata), which
# every client names alike: the quorum they describe is no tenant's topic (and Kafka
# authorizes them on the cluster, not on a topic).  Mapped, a tenant's would name a
# topic there is not, and its answer would hide the quorum.
_CLUSTER_LOG_MESSAGES = frozenset({"DescribeQuorumRequest", "DescribeQuorumResponse"})


@cache
def carries_topics(message: MessageSpec) -> bool:
    """Whether any version of ``message`` has a topic name (or topic resource) in it."""
    if message.name in _CLUSTER_LOG_MESSAGES:
        return False
    return reaches(message, _request_predicate) or message.name in _GROUP_MESSAGES


@cache
def names_topics(message: MessageSpec, version: int) -> bool:
    """Whether ``version`` of ``message`` has a topic name (or topic resource) in it:
    Produce v13 and Fetch v13+ name topics by id only, and need no mapping."""
    if message.name in _CLUSTER_LOG_MESSAGES:
        return False
    return reaches_in(message, _request_predicate, version) or message.name in _GROUP_MESSAGES


@cache
def names_ids(message: MessageSpec, version: int, kinds: IdKinds) -> bool:
    """Whether ``version`` of ``message`` has an id of ``kinds`` in it (group ids,
    transactional ids).  Not FindCoordinator's keys: their key type says what they are
    (``lookup_kind``)."""
    return bool(kinds) and reaches_in(message, _predicates(kinds)[2], version)


@cache
def names_resources(message: MessageSpec, version: int) -> bool:
    """Whether ``version`` of ``message`` names resources (ACLs, configs): of groups and
    transactional ids too, which their types say."""
    return reaches_in(message, _is_resource_field, version)


@cache
def carries_ids(message: MessageSpec, kinds: IdKinds) -> bool:
    """Whether any version of ``message`` has an id of ``kinds`` in it."""
    return bool(kinds) and reaches(message, _predicates(kinds)[2])


@cache
def has_error_text(message: MessageSpec, version: int) -> bool:
    """Whether ``version`` of ``message`` has error messages, which may quote broker-side
    topic names (mapped back on the way to the client)."""
    return reaches_in(message, _message_predicate, version)


_HIDDEN = object()


def resource_type(record: Any) -> int | None:
    value = getattr(record, "resource_type", None)
    if value is None:
        value = getattr(record, "resource_type_filter", None)
    return value


# What ``visit`` does with a field (see ``_visit_plan``); _OPTIONAL: a name that is no
# key of its entry and may be null, nulled when hidden (a Streams topology node's sink
# topic: the node stays, the other tenant's topic is not named).
_NAME, _NAMES, _MESSAGE, _ENTRIES, _ENTRY, _OPTIONAL = range(6)
# Whose name a field holds besides an id kind's: a topic's, or a resource's (its type
# says which).
_TOPIC, _RESOURCE = "topic", "resource"


@cache
def _visit_plan(struct: StructSpec, to_client: bool, kinds: IdKinds
                ) -> tuple[tuple[str, int, bool, str], ...]:
    """A struct's fields that a mapper looks at, in order, worked out once per struct:
    (attribute, what it holds, whether a hidden name hides the whole entry, whose name
    it is: a topic's, an id kind's, or a resource's, which its entry's resource type
    tells)."""
    plan = []
    for f in struct.fields:
        kind = id_kind(f)
        if kind not in kinds:
            kind = None
        if is_topic_field(f) or kind or _is_resource_field(f):
            key = bool(f.map_key) or _has_key_role(f)
            optional = not (f.is_array or key) and f.versions.intersect(f.nullable) == f.versions
            plan.append((f.attr, _NAMES if f.is_array else _OPTIONAL if optional else _NAME,
                         key, _TOPIC if is_topic_field(f) else kind or _RESOURCE))
        elif to_client and f.attr == "error_message" and f.type == "string":
            plan.append((f.attr, _MESSAGE, False, _TOPIC))
        elif f.is_array and f.struct is not None:
            plan.append((f.attr, _ENTRIES, False, _TOPIC))
        elif f.struct is not None:
            plan.append((f.attr, _ENTRY, False, _TOPIC))
    return tuple(plan)


def _struct_mapper(mapping: TopicMap, to_client: bool,
                   kinds: IdKinds) -> Callable[[StructSpec, Any], Any]:
    fns: dict[str, Callable[[str], str | None]] = {
        _TOPIC: mapping.to_client if to_client else mapping.to_broker}
    for kind in kinds:
        fns[kind] = partial(mapping.id_to_client if to_client else mapping.id_to_broker, kind)
    by_resource_type = {t: fns[k] for k in kinds for t in _KINDS[k].resource_types}
    by_resource_type[TOPIC_RESOURCE] = fns[_TOPIC]

    def visit(struct: StructSpec, record: Any) -> Any:
        changes: dict[str, Any] = {}
        resource_fn: Callable[[str], str | None] | None = None
        resource_read = False
        for attr, kind, hides_entry, whose in _visit_plan(struct, to_client, kinds):
            value = getattr(record, attr, None)
            if value is None:
                continue
            fn: Callable[[str], str | None]
            if whose != _RESOURCE:
                fn = fns[whose]
            else:
                if not resource_read:
                    resource_read = True
                    resource_fn = by_resource_type.get(resource_type(record))  # type: ignore[arg-type]
                if resource_fn is None:
                    continue
                fn = resource_fn
            if kind == _NAME:
                new = fn(value)
                if new is None:
                    if not hides_entry:
                        continue
                    return _HIDDEN
                if new != value:
                    changes[attr] = new
            elif kind == _OPTIONAL:
                new = fn(value)
                if new != value:
                    changes[attr] = new
            elif kind == _NAMES:
                mapped = [fn(v) if v is not None else None for v in value]
                kept = tuple(m for m, v in zip(mapped, value, strict=True)
                             if m is not None or v is None)
                if kept != tuple(value):
                    changes[attr] = kept
            elif kind == _MESSAGE:
                text = mapping.message_to_client(value)
                if text != value:
                    changes[attr] = text
            elif kind == _ENTRY:
                if value is _HIDDEN:  # a struct alone (nullable: a cursor), a hidden name
                    changes[attr] = None
            elif any(v is _HIDDEN for v in value):  # _ENTRIES
                changes[attr] = tuple(v for v in value if v is not _HIDDEN)
        return record.replace(**changes) if changes else record

    return visit


def _has_key_role(f: FieldSpec) -> bool:
    # A name that identifies its entry (not e.g. a free-standing reference): a hidden
    # name hides the entry (another tenant's topic, group, transaction, or ACL).
    return f.attr in ("name", "topic", "topic_name", "group_id", "transactional_id",
                      "resource_name")


# -- requests and responses -----------------------------------------------------------


@dataclass
class RewriteStats:
    """Counts the proxy exports as metrics."""

    protocol_fallbacks: int = 0  # consumer bytes decoded from the connection's JoinGroup
    unknown_protocol_bytes: int = 0  # group bytes of a protocol type we don't decode
    undecodable_protocol_bytes: int = 0


def map_request(req: Request, mapping: TopicMap, state: dict[str, Any],
                stats: RewriteStats) -> Request:
    """``req`` with client names turned into broker names (same object if none)."""
    api = req.api
    kinds = mapping.id_kinds
    if not (names_topics(api.request, req.api_version) or (kinds and (
            names_ids(api.request, req.api_version, kinds)
            or req.api_key in (FIND_COORDINATOR, LIST_TRANSACTIONS)))):
        return req  # not even decoded
    if req.api_key == PRODUCE and not req.body_decoded and req.frame is not None:
        # The names changed in the bytes: the records are copied, not decoded and encoded.
        frame = produce.rename_request_topics(req.frame, req.api_version, mapping.to_broker,
                                              _transaction_renamer(mapping))
        if frame is not None:
            return req if frame is req.frame else decode_request(frame)
    body = req.body
    new = rewrite(api.request, req.api_version, body, _predicates(kinds)[0],
                  _struct_mapper(mapping, False, kinds))
    if req.api_key == FIND_COORDINATOR:
        kind = lookup_kind(req)
        if kind in kinds:
            if req.api_version < 4:
                new = new.replace(key=mapping.id_to_broker(kind, new.key))
            else:
                new = new.replace(coordinator_keys=tuple(
                    mapping.id_to_broker(kind, k) for k in new.coordinator_keys))
    elif req.api_key == JOIN_GROUP:
        protocol_type = new.protocol_type
        groups = state.setdefault("protocol_type", {})
        if len(groups) > 64:  # bounded: a connection joins few groups
            groups.clear()
        groups[new.group_id] = protocol_type
        if protocol_type == CONSUMER:
            # A member subscribes only to topics it may use: else a leader that may use
            # them (a group of differently filtered members) assigns it partitions its
            # answers leave out, and nobody reads them.
            new = _map_items(new, "protocols", "metadata", consumer.decode_subscription,
                             _usable_to_broker(mapping), stats)
    elif req.api_key == SYNC_GROUP:
        protocol_type = _protocol_type(new, state, stats)
        if protocol_type == CONSUMER:
            new = _map_items(new, "assignments", "assignment", consumer.decode_assignment,
                             mapping.to_broker, stats)
        elif protocol_type is not None:
            stats.unknown_protocol_bytes += 1
    elif (req.api_key == LIST_TRANSACTIONS and req.api_version >= 2
          and body.transactional_id_pattern
          and (prefix := mapping.id_to_broker(TRANSACTION, ""))):
        # KIP-1152: a regex over the broker's transactional ids, which hold the prefix
        # (Java's \Q...\E quotes it: the tenant's pattern is matched after it).
        new = new.replace(transactional_id_pattern=(
            f"\\Q{prefix}\\E(?:{body.transactional_id_pattern})"))
    elif req.api_key == METADATA and body.topics and mapping.filters:
        # A name the client may not use goes no further: the answer would leave it out
        # anyway, and a broker that creates the topics Metadata asks for
        # (auto.create.topics.enable, Kafka's default) would create it.
        usable = [(t, mapped) for t, mapped in zip(body.topics, new.topics, strict=True)
                  if t.name is None or not mapping.denies(t.name)]
        if len(usable) != len(new.topics):  # (v0, which reads none as every topic, is
            new = new.replace(topics=tuple(mapped for _, mapped in usable))  # refused)
        if asks_auto_creation(req) and any(
                t.name is not None and creation_denied(mapping, t.name) for t, _ in usable):
            # Kafka's ACLs: a topic a Metadata request would create needs create on it.
            new = new.replace(allow_auto_topic_creation=False)
    elif is_every_topic_listing(req):
        if body.cursor is not None and seals_cursors(mapping):
            # The proxy's own cursor (``map_response``): the broker's name, unsealed
            # (a cursor that is not one is refused before, ``cursor_refusal``).
            name = cursors.unseal(body.cursor.topic_name)
            if name is not None:
                new = new.replace(cursor=new.cursor.replace(topic_name=name))
        elif new.cursor is None and (start := hiding_prefix(mapping)):
            # Every topic, a page at a time in name order: a prefix's topics are
            # together, so the listing starts at the prefix (the broker takes a cursor
            # at a name that is no topic); the answer's cursor at another tenant's
            # topic, after them, ends it.
            cursor = api.request.root.field("cursor").struct
            assert cursor is not None
            new = new.replace(cursor=cursor.default.replace(topic_name=start,
                                                            partition_index=0))
    return req if new is body else req.replace(body=new)


def asks_auto_creation(req: Request) -> bool:
    """Whether a Metadata request asks the brokers to create the topics it names that
    do not exist, and may be told not to (``allow_auto_topic_creation``, v4+: before,
    brokers create them unasked)."""
    return (has_field(req.api.request.root, "allow_auto_topic_creation", req.api_version)
            and bool(req.body.allow_auto_topic_creation))


# ``map_response``'s hint for the answer to a DescribeTopicPartitions of every topic
# (``answer_hint``).
EVERY_TOPIC = "every topic"


def is_every_topic_listing(req: Request) -> bool:
    """Whether ``req`` is a DescribeTopicPartitions of every topic (KIP-966: no topics
    named, a page at a time in name order from its cursor)."""
    return req.api_key == DESCRIBE_TOPIC_PARTITIONS and not req.body.topics


def seals_cursors(mapping: TopicMap) -> bool:
    """Whether listings of every topic under ``mapping`` take and give sealed cursors
    only (``rules.cursors``): under a topic filter, whose hidden topics lie anywhere in
    name order (a prefix's lie together, before or after the tenant's)."""
    return any(isinstance(m, TopicFilter) for m in map_parts(mapping))


def cursor_refusal(req: Request, mapping: TopicMap) -> str | None:
    """Why ``req``, a listing of every topic under ``mapping``, is refused: its cursor
    is not one the proxy gave (``seals_cursors``); None when it goes on."""
    cursor = req.body.cursor if is_every_topic_listing(req) else None
    if cursor is None or not seals_cursors(mapping) or cursors.unseal(cursor.topic_name):
        return None
    return ("a listing of every topic under a topic filter goes on only from the cursors "
            "of the proxy's answers (an earlier proxy process's are not taken: start the "
            "listing again)")


def answer_hint(req: Request) -> str | None:
    """What mapping ``req``'s answer needs to know of ``req`` that the answer does not
    say: the kind of keys a FindCoordinator looked up (``lookup_kind``), or
    ``EVERY_TOPIC`` for a DescribeTopicPartitions of every topic."""
    if req.api_key == DESCRIBE_TOPIC_PARTITIONS:
        return EVERY_TOPIC if is_every_topic_listing(req) else None
    return lookup_kind(req)


def map_request_head(req: Request, mapping: TopicMap) -> tuple[bytes, int] | None:
    """For a Produce request of which only the first bytes have arrived (``req.frame``):
    its beginning with its one topic name turned into the broker's, as
    ``produce.rename_request_head`` gives it, so the rest can follow as it arrives.  None
    when that cannot be told from those bytes (the whole request is mapped instead)."""
    if req.api_key != PRODUCE or req.frame is None:
        return None
    return produce.rename_request_head(req.frame, req.api_version, mapping.to_broker,
                                       _transaction_renamer(mapping))


def _usable_to_broker(mapping: TopicMap) -> Callable[[str], str | None]:
    """``mapping.to_broker``, with None (left out) for the names it denies."""
    if not mapping.filters:
        return mapping.to_broker

    def to_broker(name: str) -> str | None:
        return None if mapping.denies(name) else mapping.to_broker(name)

    return to_broker


def _transaction_renamer(mapping: TopicMap) -> Callable[[str], str] | None:
    if TRANSACTION not in mapping.id_kinds:
        return None
    return partial(mapping.id_to_broker, TRANSACTION)


def map_response(resp: Response, mapping: TopicMap, state: dict[str, Any],
                 stats: RewriteStats, lookup: str | None = None) -> Response:
    """``resp`` with broker names turned into client names; hidden names removed.
    ``lookup``: what the answer does not say of its request (the request's
    ``answer_hint``): for a FindCoordinator answer, the kind of keys it answers; for a
    DescribeTopicPartitions answer, ``EVERY_TOPIC`` when it lists every topic."""
    api = resp.api
    if api.response.name in _CLUSTER_LOG_MESSAGES:
        return resp
    if resp.api_key == PRODUCE and not resp.body_decoded and resp.frame is not None:
        frame = produce.rename_response_topics(resp.frame, resp.api_version, mapping.to_client)
        if frame is not None:
            return (resp if frame is resp.frame
                    else decode_response(frame, PRODUCE, resp.api_version))
    body = resp.body
    kinds = mapping.id_kinds
    visit = _struct_mapper(mapping, True, kinds)
    new = rewrite(api.response, resp.api_version, body, _predicates(kinds)[1], visit)
    key = resp.api_key
    if key == FIND_COORDINATOR:
        if lookup in kinds and resp.api_version >= 4:
            assert lookup is not None
            new = new.replace(coordinators=tuple(
                c.replace(key=_or_same(mapping.id_to_client(lookup, c.key), c.key))
                for c in new.coordinators))
    elif key == JOIN_GROUP:
        protocol_type = _protocol_type(new, state, stats)
        if protocol_type == CONSUMER:
            new = _map_items(new, "members", "metadata", consumer.decode_subscription,
                             mapping.to_client, stats)
    elif key == SYNC_GROUP:
        protocol_type = _protocol_type(new, state, stats)
        if protocol_type == CONSUMER and new.assignment:
            data = _map_bytes(new.assignment, consumer.decode_assignment, mapping.to_client,
                              stats)
            if data is not None:
                new = new.replace(assignment=data)
    elif key == DESCRIBE_GROUPS:
        groups = []
        for group in new.groups:
            if group.protocol_type == CONSUMER:
                group = _map_items(group, "members", "member_metadata",
                                   consumer.decode_subscription, mapping.to_client, stats)
                group = _map_items(group, "members", "member_assignment",
                                   consumer.decode_assignment, mapping.to_client, stats)
            elif group.protocol_type:
                stats.unknown_protocol_bytes += 1
            groups.append(group)
        if any(a is not b for a, b in zip(groups, new.groups, strict=True)):
            new = new.replace(groups=tuple(groups))
    elif key == DESCRIBE_TOPIC_PARTITIONS and lookup == EVERY_TOPIC and seals_cursors(mapping):
        new = new.replace(next_cursor=_sealed_cursor(body.next_cursor, mapping))
    return resp if new is body else resp.replace(body=new)


def _sealed_cursor(cursor: Any, mapping: TopicMap) -> Any:
    """The broker's next cursor of a listing of every topic, as the client gets it: the
    topic sealed, whether the client may see it or not (``seals_cursors``); None, the
    listing's end, at a topic past a prefix's (the tenant's topics are all listed)."""
    if cursor is None:
        return None
    prefix = hiding_prefix(mapping)
    if prefix and not cursor.topic_name.startswith(prefix):
        return None
    return cursor.replace(topic_name=cursors.seal(cursor.topic_name))


def hiding_prefix(mapping: TopicMap) -> str:
    """The broker-side prefix of every topic ``mapping`` shows: a tenant's, with
    ``hide_others``; else '' (a topic filter hides too, but keeps no tenants apart by
    name)."""
    if any(isinstance(m, Prefix) and m.hide_others for m in map_parts(mapping)):
        return mapping.to_broker("")
    return ""


def lookup_kind(req: Request) -> str | None:
    """The kind of keys (``GROUP``, ``TRANSACTION``) a FindCoordinator request looks up
    the coordinators of (v0 knows only groups); None for other keys (share partitions)
    and other requests."""
    if req.api_key != FIND_COORDINATOR:
        return None
    return GROUP if req.api_version == 0 else _KIND_OF_KEY_TYPE.get(req.body.key_type)


def _or_same(mapped: str | None, name: str) -> str:
    return name if mapped is None else mapped


def _protocol_type(body: Any, state: dict[str, Any], stats: RewriteStats) -> str | None:
    declared = getattr(body, "protocol_type", None)
    if declared is not None and declared != "":
        return str(declared)
    # Before KIP-559 (JoinGroup response < v7, SyncGroup < v5) the bytes do not say what
    # they are: use what this connection's JoinGroup declared for the group.
    groups: dict[str, str] = state.get("protocol_type", {})
    group_id = getattr(body, "group_id", None)
    fallback = groups.get(group_id) if group_id is not None else None
    if fallback is None and len(set(groups.values())) == 1:
        fallback = next(iter(groups.values()))
    if fallback is not None:
        stats.protocol_fallbacks += 1
    return fallback


def _map_items(record: Any, array: str, field: str, decode: Callable[[Any], Any],
               fn: Callable[[str], str | None], stats: RewriteStats) -> Any:
    items = getattr(record, array)
    out = []
    changed = False
    for item in items:
        data = getattr(item, field)
        if data:
            mapped = _map_bytes(data, decode, fn, stats)
            if mapped is not None:
                item = item.replace(**{field: mapped})
                changed = True
        out.append(item)
    return record.replace(**{array: tuple(out)}) if changed else record


_SUB_FIELDS = ("topic", "topics", "topic_name")


# The walker keeps a plan per predicate (``codecs.walk``): predicates are module-level
# functions (or cached per argument), never closures made per call, which would each
# add a plan that is never used again.
def _is_protocol_topic(f: FieldSpec) -> bool:
    """A topic name in the consumer protocol's payloads (subscriptions, assignments)."""
    return f.attr in _SUB_FIELDS and f.type == "string"


def _holds_protocol_topics(f: FieldSpec) -> bool:
    return _is_protocol_topic(f) or (f.is_array and f.struct is not None and any(
        _is_protocol_topic(g) for g in f.struct.fields))


def _map_bytes(data: Any, decode: Callable[[Any], Any], fn: Callable[[str], str | None],
               stats: RewriteStats) -> bytes | None:
    try:
        parsed = decode(data)
    except ProtocolError:
        stats.undecodable_protocol_bytes += 1
        return None
    body = parsed.body
    version = min(parsed.version, parsed.spec.valid.hi)

    def visit(struct: StructSpec, record: Any) -> Any:
        changes: dict[str, Any] = {}
        for f in struct.fields:
            if not _is_protocol_topic(f) or version not in f.versions:
                continue
            value = getattr(record, f.attr)
            if value is None:
                continue
            if f.is_array:
                mapped = tuple(m for m in (fn(v) for v in value) if m is not None)
                if mapped != tuple(value):
                    changes[f.attr] = mapped
            else:
                new = fn(value)
                if new is None:
                    return _HIDDEN
                if new != value:
                    changes[f.attr] = new
        for f in struct.fields:
            value = getattr(record, f.attr)
            if f.is_array and f.struct is not None and value and any(v is _HIDDEN for v in value):
                changes[f.attr] = tuple(v for v in value if v is not _HIDDEN)
        return record.replace(**changes) if changes else record

    new = rewrite(parsed.spec, version, body, _holds_protocol_topics, visit)
    if new is body:
        return None
    return bytes(parsed.replace(body=new).encode())


def regex_subscription(req: Request) -> str | None:
    """A regex a group subscribes with, matched by the broker against every topic: a
    ConsumerGroupHeartbeat's (KIP-848), or the first of a StreamsGroupHeartbeat's
    topology's source topic regexes (KIP-1071); None when there is none."""
    if req.api_key == CONSUMER_GROUP_HEARTBEAT:
        return getattr(req.body, "subscribed_topic_regex", None) or None
    if req.api_key == STREAMS_GROUP_HEARTBEAT and req.body.topology is not None:
        for subtopology in req.body.topology.subtopologies:
            for regex in subtopology.source_topic_regex or ():
                if regex:
                    return str(regex)
    return None


DELETE_ACLS, ELECT_LEADERS = 31, 43
_ANY, _MATCH = 1, 2  # ACL filters: resource type ANY; pattern types ANY and MATCH


def reach_outside(req: Request, mapping: TopicMap) -> str | None:
    """Why a request that changes things under a prefix that hides the others is
    refused: it may reach outside the prefix (another tenant's), which no mapping of
    names can keep it from.  A DeleteAcls filter of any resource type, of no name, or
    of pattern type ANY or MATCH (MATCH takes the wildcard's and the covering prefixed
    ACLs too); an ElectLeaders of no partitions named (every partition's).  None when
    it stays inside."""
    if req.api_key not in (DELETE_ACLS, ELECT_LEADERS) or not hiding_prefix(mapping):
        return None
    if req.api_key == ELECT_LEADERS:
        if req.body.topic_partitions is None:
            return ("an ElectLeaders of every partition reaches other tenants' topics: "
                    "name the topics and partitions")
        return None
    mapped = {TOPIC_RESOURCE} | set(_resource_kinds(mapping.id_kinds))
    for f in req.body.filters:
        if f.resource_type_filter == _ANY or (
                f.resource_type_filter in mapped
                and (f.resource_name_filter is None or f.pattern_type_filter in (_ANY, _MATCH))):
            return ("a DeleteAcls filter of any resource type, of no name, or of pattern "
                    "type ANY or MATCH may delete other tenants' ACLs: name the resource "
                    "type and name, with pattern type LITERAL or PREFIXED")
    return None


def id_names(req: Request, kinds: IdKinds) -> list[tuple[str, str]]:
    """Every (kind, id) of ``kinds`` a request names: the fields the specs mark as group
    ids or transactional ids, resources of those types (ACLs, configs), and a
    FindCoordinator's keys."""
    if not kinds:
        return []
    found: list[tuple[str, str]] = []
    if req.api_key == FIND_COORDINATOR:
        kind = lookup_kind(req)
        if kind in kinds:
            body = req.body
            keys = (body.key,) if req.api_version < 4 else body.coordinator_keys
            found.extend((kind, key) for key in keys if key)
        return found
    is_id = _predicates(kinds)[2]
    resource_kinds = _resource_kinds(kinds)

    def visit(struct: StructSpec, record: Any) -> Any:
        resource_kind = resource_kinds.get(resource_type(record))  # type: ignore[arg-type]
        for f in struct.fields:
            value = getattr(record, f.attr, None)
            if value is None:
                continue
            kind = id_kind(f) if is_id(f) else (
                resource_kind if resource_kind and _is_resource_field(f) else None)
            if kind is not None:
                found.extend((kind, v) for v in (value if f.is_array else (value,)) if v)
        return record

    rewrite(req.api.request, req.api_version, req.body, _names_ids(kinds), visit)
    return found


@cache
def _resource_kinds(kinds: IdKinds) -> dict[int, str]:
    """Resource type -> the kind of id a resource of that type names."""
    return {t: k for k in kinds for t in _KINDS[k].resource_types}


@cache
def _names_ids(kinds: IdKinds) -> Callable[[FieldSpec], bool]:
    """The walker's predicate for ``id_names``: one per kinds (see ``_is_protocol_topic``)."""
    is_id = _predicates(kinds)[2]

    def names_id(f: FieldSpec) -> bool:
        return is_id(f) or _is_resource_field(f)

    return names_id


def topic_names(req: Request) -> Sequence[str]:
    """Every topic name a request mentions (for allow/deny by topic and for logs).  Not
    the cursor of a listing of every topic: a place to start at, not a topic it uses
    (a sealed one under a filter, ``cursor_refusal``)."""
    names: list[str] = []
    if is_every_topic_listing(req) or not names_topics(req.api.request, req.api_version):
        return names

    def visit(struct: StructSpec, record: Any) -> Any:
        is_resource = resource_type(record) == TOPIC_RESOURCE
        for f in struct.fields:
            value = getattr(record, f.attr, None)
            if value is None:
                continue
            if is_topic_field(f) or (is_resource and _is_resource_field(f)):
                names.extend(value if f.is_array else [value])
        return record

    rewrite(req.api.request, req.api_version, req.body, _request_predicate, visit)
    return names
