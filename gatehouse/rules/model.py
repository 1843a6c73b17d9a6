"""Rules and their decisions over one request (pure: no I/O, no clocks, no trio).

A ``RuleSet`` is immutable; hot reload swaps the whole set.  ``evaluate`` looks at every
rule top to bottom against the original request: the first enforced refusal wins, topic
maps of all matching rules compose in order, and observe-mode rules only report what
they would have done.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Literal

from gatehouse.codecs import APIS, Request
from gatehouse.rules.encryption import RecordEncryption
from gatehouse.rules.errors import (
    CLUSTER_AUTHORIZATION_FAILED,
    UNSUPPORTED_VERSION,
)
from gatehouse.rules.produce import ProducePolicy
from gatehouse.rules.records import RecordValidation
from gatehouse.rules.topicpolicy import POLICY_APIS, TopicPolicy
from gatehouse.rules.topics import (
    GROUP,
    TRANSACTION,
    Chain,
    Prefix,
    Rename,
    TopicMap,
    hiding_prefix,
)

Mode = Literal["enforce", "observe"]
# throttle: a quota held the client's next request back (observe mode: would have).
Effect = Literal["refuse", "rewrite", "pass", "throttle"]
API_VERSIONS = 18
PRODUCE, METADATA = 0, 3
FETCH, SHARE_FETCH = 1, 78
# The APIs whose records ``encrypt_records`` seals (requests) or opens (answers).
RECORD_APIS = frozenset((PRODUCE, FETCH, SHARE_FETCH))


@dataclass(frozen=True)
class ClientFacts:
    """What rules may match on: the connection and the request's client id."""

    client_id: str | None = None
    software_name: str | None = None  # KIP-511
    software_version: str | None = None
    address: str | None = None  # "host:port" of the client
    listener: str | None = None  # "bootstrap" or "broker-<node>"
    principal: str | None = None  # the SASL user the broker accepted (codecs.sasl)


@dataclass(frozen=True)
class Match:
    client_id: re.Pattern[str] | None = None
    software_name: re.Pattern[str] | None = None
    software_version: re.Pattern[str] | None = None
    sources: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()
    listeners: tuple[str, ...] = ()
    # Unlike the client id, chosen by the client, a principal needs the password: the
    # match to keep tenants apart at the edge.  None (unauthenticated) never matches.
    principal: re.Pattern[str] | None = None

    def matches(self, facts: ClientFacts) -> bool:
        if self.principal is not None and (
                facts.principal is None or not self.principal.search(facts.principal)):
            return False
        if self.client_id is not None and not self.client_id.search(facts.client_id or ""):
            return False
        if self.software_name is not None and not self.software_name.search(
                facts.software_name or ""):
            return False
        if self.software_version is not None and not self.software_version.search(
                facts.software_version or ""):
            return False
        if self.sources:
            ip = _ip_of(facts.address)
            if ip is None or not any(ip in net for net in self.sources):
                return False
        return not (self.listeners and facts.listener not in self.listeners)


def _ip_of(address: str | None) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    if not address:
        return None
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


@dataclass(frozen=True)
class VersionBound:
    version: int
    advertise: bool  # rewrite ApiVersions so clients pick an allowed version


QUOTA_KINDS = ("produce_bytes", "fetch_bytes", "requests")
# Who shares one quota's budget: the SASL user or certificate principal (the client id
# where a connection has none, as a broker's quotas fall back), the client id, the
# client's host, each connection, or everyone the rule matches.
QUOTA_SCOPES = ("principal", "client_id", "source", "connection", "rule")


@dataclass(frozen=True)
class Quota:
    """Rates a rule allows its clients (None: no limit on that kind).

    ``produce_bytes``: bytes of Produce requests a second; ``fetch_bytes``: bytes of
    Fetch and ShareFetch answers a second; ``requests``: requests of any kind a second;
    each shared per ``per`` (QUOTA_SCOPES)."""

    produce_bytes: float | None = None
    fetch_bytes: float | None = None
    requests: float | None = None
    per: str = "principal"

    def rates(self) -> tuple[tuple[str, float], ...]:
        return tuple((kind, rate) for kind, rate in (
            ("produce_bytes", self.produce_bytes), ("fetch_bytes", self.fetch_bytes),
            ("requests", self.requests)) if rate is not None)

    def scope_key(self, facts: ClientFacts, connection: int) -> str:
        """Whose budget a connection with these facts spends."""
        per = self.per
        if per == "principal":
            if facts.principal is not None:
                return "principal:" + facts.principal
            per = "client_id"
        if per == "client_id":
            return "client_id:" + (facts.client_id or "")
        if per == "source":
            ip = _ip_of(facts.address)
            return "source:" + (str(ip) if ip is not None else (facts.address or ""))
        if per == "connection":
            return f"connection:{connection}"
        return "rule"


@dataclass(frozen=True)
class Rule:
    name: str
    match: Match = Match()
    mode: Mode = "enforce"
    min_api_version: dict[int, VersionBound] = field(default_factory=dict)
    max_api_version: dict[int, VersionBound] = field(default_factory=dict)
    deny_apis: frozenset[int] = frozenset()
    allow_apis: frozenset[int] | None = None
    min_client_software: dict[str, tuple[int, ...]] = field(default_factory=dict)
    min_client_software_text: dict[str, str] = field(default_factory=dict)
    unknown_software: Literal["allow", "refuse"] = "allow"
    topic_map: TopicMap | None = None
    quota: Quota | None = None
    line: int | None = None  # where the rule starts in its file
    # ``acls`` (rules.acl), compiled per API: the filters of the operation each API
    # needs, then ``topic_map``; APIs not in it get ``topic_map`` alone.  None: no ACLs.
    api_maps: Mapping[int, TopicMap] | None = None
    # ``acls`` on the cluster: API key -> (the operation on the cluster its requests
    # need, from which version) for the APIs the entries refuse.
    cluster_refused: Mapping[int, tuple[str, int]] = field(default_factory=dict)
    # ... and config API key -> operation, for requests naming the cluster's configs.
    cluster_configs: Mapping[int, str] = field(default_factory=dict)
    acls_name_cluster: bool = False  # some ``acls`` entry names the cluster
    # ``produce_policy``: what the client's Produce requests must be (rules.produce).
    produce_policy: ProducePolicy | None = None
    # ``validate_records``: what the records the client produces must hold (rules.records).
    validate_records: RecordValidation | None = None
    # ``topic_policy``: what the topics the client creates or changes must be
    # (rules.topicpolicy).
    topic_policy: TopicPolicy | None = None
    # ``encrypt_records``: the topics whose values the client's Produce requests have
    # sealed and its Fetch answers opened (rules.encryption).
    encrypt_records: RecordEncryption | None = None

    def map_for(self, api_key: int) -> TopicMap | None:
        """The names map this rule applies to requests of ``api_key`` and their answers."""
        if self.api_maps is None:
            return self.topic_map
        return self.api_maps.get(api_key, self.topic_map)

    def maps(self) -> tuple[TopicMap, ...]:
        """Every names map the rule applies, to some API or all: its own, then its ACLs'."""
        own = () if self.topic_map is None else (self.topic_map,)
        return (*own, *(self.api_maps or {}).values())

    @property
    def maps_names(self) -> bool:
        """Whether the rule maps or filters names for some API (a map or ACLs)."""
        return self.topic_map is not None or self.api_maps is not None


@dataclass(frozen=True)
class Refusal:
    rule: str
    action: str  # min_api_version, deny_apis, ...
    code: int
    message: str


@dataclass(frozen=True)
class Outcome:
    """One rule's effect on one request, for the per-rule decision counters."""

    rule: str
    action: str
    effect: Effect
    mode: Mode


@dataclass(frozen=True)
class Evaluation:
    refusal: Refusal | None = None  # enforced: answer with an error
    would_refuse: tuple[Refusal, ...] = ()  # observe mode
    topic_map: TopicMap | None = None  # enforced renames/prefixes, composed
    observed_map: TopicMap | None = None  # observe-mode maps (count, don't apply)
    outcomes: tuple[Outcome, ...] = ()
    # Refusals that hold only for a request naming the cluster's configs (a broker's,
    # say): its body decides (``rules.acl.names_cluster_configs``); enforced, observed.
    config_refusal: Refusal | None = None
    config_would_refuse: tuple[Refusal, ...] = ()
    # Produce requests: the policies their bytes are held to, by rule name; enforced,
    # observed (rules.produce).
    produce_policies: tuple[tuple[str, ProducePolicy], ...] = ()
    produce_observed: tuple[tuple[str, ProducePolicy], ...] = ()
    # ... and the record validations their records are held to (rules.records).
    record_validations: tuple[tuple[str, RecordValidation], ...] = ()
    records_observed: tuple[tuple[str, RecordValidation], ...] = ()
    # CreateTopics, CreatePartitions and the config APIs: the topic policies their
    # topics are held to, by rule name; enforced, observed (rules.topicpolicy).
    topic_policies: tuple[tuple[str, TopicPolicy], ...] = ()
    topic_policies_observed: tuple[tuple[str, TopicPolicy], ...] = ()
    # Produce requests and Fetch and ShareFetch answers: the record encryptions their
    # records go through, by rule name (enforced only: rules.encryption).
    encryptions: tuple[tuple[str, RecordEncryption], ...] = ()

    @property
    def reads_produce(self) -> bool:
        """Whether a Produce request's body decides (its acks, batches or records)."""
        return bool(self.produce_policies or self.produce_observed
                    or self.record_validations or self.records_observed
                    or self.encryptions)


def parse_version(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    parts = re.findall(r"\d+", text)
    return tuple(int(p) for p in parts[:4]) if parts else None


def software_versions(facts: ClientFacts) -> Mapping[str, tuple[int, ...]]:
    """name -> version for the client's software, including librdkafka inside wrappers.

    confluent-kafka-python reports ``2.6.0-rdkafka-2.6.0``; other librdkafka wrappers
    do the same, so ``librdkafka`` rules apply to all of them.  Read-only, and shared:
    parsed once per name and version (rules ask on every request).
    """
    return _software_versions(facts.software_name, facts.software_version)


@functools.lru_cache(maxsize=4096)
def _software_versions(name: str | None, version: str | None
                       ) -> Mapping[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {}
    if name:
        parsed = parse_version((version or "").split("-rdkafka-")[0])
        if parsed is not None:
            out[name.lower()] = parsed
    if version and "rdkafka-" in version:
        parsed = parse_version(version.split("rdkafka-", 1)[1])
        if parsed is not None:
            out["librdkafka"] = parsed
    return MappingProxyType(out)


def _open_to_others(path: str) -> bool:
    """Whether users other than the file's owner and group may read it."""
    try:
        return bool(Path(path).stat().st_mode & 0o004)
    except OSError:
        return False


def _self_described(match: Match) -> bool:
    """Whether ``match`` tells clients apart only by what they say of themselves."""
    return match.principal is None and not match.sources and (
        match.client_id is not None or match.software_name is not None
        or match.software_version is not None)


@dataclass(frozen=True)
class RuleSet:
    rules: tuple[Rule, ...] = ()
    source: str = "<rules>"

    def __bool__(self) -> bool:
        return bool(self.rules)

    def facts_read(self) -> frozenset[str]:
        """The ``ClientFacts`` fields that ``evaluate`` reads under these rules: facts that
        differ only in the other fields get the same evaluation (so the report decides once
        per distinct combination of these, not once per connection)."""
        read: set[str] = set()
        for rule in self.rules:
            match = rule.match
            if match.client_id is not None:
                read.add("client_id")
            if match.software_name is not None:
                read.add("software_name")
            if match.software_version is not None:
                read.add("software_version")
            if rule.min_client_software:
                read.update(("software_name", "software_version"))
            if match.sources:
                read.add("address")
            if match.listeners:
                read.add("listener")
            if match.principal is not None:
                read.add("principal")
        return frozenset(read)

    def matching(self, facts: ClientFacts) -> list[Rule]:
        return [r for r in self.rules if r.match.matches(facts)]

    def enforced_map(self, facts: ClientFacts, api_key: int) -> TopicMap | None:
        """The enforced rules' names maps for ``api_key`` (composed), for a client with
        these facts: what its answers to that API show (Metadata's: which topics it may
        see)."""
        return _compose([m for r in self.matching(facts)
                         if r.mode == "enforce" and (m := r.map_for(api_key)) is not None])

    def quotas(self, facts: ClientFacts) -> tuple[Rule, ...]:
        """The rules with a quota that apply to a client with these facts, in order."""
        return tuple(r for r in self.rules if r.quota is not None and r.match.matches(facts))

    @functools.cached_property
    def has_quotas(self) -> bool:
        return any(r.quota is not None for r in self.rules)

    @functools.cached_property
    def files(self) -> tuple[Path, ...]:
        """The files these rules read besides their own (validate_records' JSON
        Schemas, .proto files and their imports): a change to one reloads the rules, as
        a change to theirs does."""
        found: dict[Path, None] = {}
        for rule in self.rules:
            validation = rule.validate_records
            if validation is not None:
                for check in (validation.key, validation.value):
                    if check.schema is not None and check.schema.path is not None:
                        found[check.schema.path] = None
                    if check.protobuf is not None:
                        found.update(dict.fromkeys(check.protobuf.files))
            if rule.encrypt_records is not None and rule.encrypt_records.ring is not None:
                found[Path(rule.encrypt_records.ring.path)] = None
        return tuple(found)

    @functools.cached_property
    def looks_up_schemas(self) -> bool:
        """Whether some rule's ``validate_records`` looks schema ids up in a registry."""
        return any(r.validate_records is not None and r.validate_records.looks_up_schemas
                   for r in self.rules)

    @functools.cached_property
    def asks_kms(self) -> bool:
        """Whether some rule's ``encrypt_records`` keeps its key in a KMS."""
        return any(r.encrypt_records is not None and r.encrypt_records.kms is not None
                   for r in self.rules)

    @functools.cached_property
    def scopes_produce_by_topic(self) -> bool:
        """Whether some rule's ``produce_policy`` or ``validate_records`` holds some
        topics only, or some rule encrypts records: Produce v13 (and Fetch v13,
        ShareFetch) names topics by id, so the proxy learns ids from the answers
        (rules.produce, rules.records, rules.encryption)."""
        return any((r.validate_records is not None and r.validate_records.topics is not None)
                   or (r.produce_policy is not None and r.produce_policy.topics is not None)
                   or r.encrypt_records is not None
                   for r in self.rules)

    def evaluate(self, facts: ClientFacts, req: Request) -> Evaluation:
        key, version = req.api_key, req.api_version
        api_name = APIS[key].name if key in APIS else f"api-{key}"
        refusal: Refusal | None = None
        would: list[Refusal] = []
        maps: list[TopicMap] = []
        observed: list[TopicMap] = []
        outcomes: list[Outcome] = []
        config_refusal: Refusal | None = None
        config_would: list[Refusal] = []
        policies: list[tuple[str, ProducePolicy]] = []
        policies_observed: list[tuple[str, ProducePolicy]] = []
        validations: list[tuple[str, RecordValidation]] = []
        validations_observed: list[tuple[str, RecordValidation]] = []
        topic_policies: list[tuple[str, TopicPolicy]] = []
        topic_policies_observed: list[tuple[str, TopicPolicy]] = []
        encryptions: list[tuple[str, RecordEncryption]] = []
        for rule in self.matching(facts):
            found: list[Refusal] = []
            bound = rule.min_api_version.get(key)
            if bound is not None and version < bound.version:
                found.append(Refusal(rule.name, "min_api_version", UNSUPPORTED_VERSION,
                                     f"{api_name} v{version} is below the minimum "
                                     f"v{bound.version} (rule {rule.name})"))
            bound = rule.max_api_version.get(key)
            if bound is not None and version > bound.version:
                found.append(Refusal(rule.name, "max_api_version", UNSUPPORTED_VERSION,
                                     f"{api_name} v{version} is above the maximum "
                                     f"v{bound.version} (rule {rule.name})"))
            if key in rule.deny_apis or (
                    rule.allow_apis is not None and key not in rule.allow_apis
                    and key != API_VERSIONS):
                found.append(Refusal(rule.name, "deny_apis" if key in rule.deny_apis
                                     else "allow_apis", CLUSTER_AUTHORIZATION_FAILED,
                                     f"{api_name} is not allowed here (rule {rule.name})"))
            cluster = rule.cluster_refused.get(key)
            if cluster is not None and version >= cluster[1]:
                found.append(Refusal(rule.name, "acls", CLUSTER_AUTHORIZATION_FAILED,
                                     f"{api_name} needs {cluster[0]} on the cluster "
                                     f"(rule {rule.name})"))
            if rule.min_client_software and key != API_VERSIONS:
                refusal_text = _software_refusal(rule, facts)
                if refusal_text is not None:
                    found.append(Refusal(rule.name, "min_client_software", UNSUPPORTED_VERSION,
                                         refusal_text))
            config_op = rule.cluster_configs.get(key)
            if config_op is not None:
                conditional = Refusal(rule.name, "acls", CLUSTER_AUTHORIZATION_FAILED,
                                      f"{api_name} of the cluster's configs needs "
                                      f"{config_op} on the cluster (rule {rule.name})")
                if rule.mode == "observe":
                    config_would.append(conditional)
                elif config_refusal is None:
                    config_refusal = conditional
            if key == PRODUCE and rule.produce_policy is not None:
                (policies if rule.mode == "enforce" else policies_observed).append(
                    (rule.name, rule.produce_policy))
            if key == PRODUCE and rule.validate_records is not None:
                (validations if rule.mode == "enforce" else validations_observed).append(
                    (rule.name, rule.validate_records))
            if key in RECORD_APIS and rule.encrypt_records is not None:
                encryptions.append((rule.name, rule.encrypt_records))
            # (Metadata: the topics the brokers create because it asks for them.)
            if rule.topic_policy is not None and (key in POLICY_APIS or (
                    key == METADATA and rule.topic_policy.judges_auto_creation)):
                (topic_policies if rule.mode == "enforce" else topic_policies_observed).append(
                    (rule.name, rule.topic_policy))
            for r in found:
                outcomes.append(_outcome(rule.name, r.action, "refuse", rule.mode))
            if rule.mode == "enforce":
                if found and refusal is None:
                    refusal = found[0]
            else:
                would.extend(found)
            topic_map = rule.map_for(key)
            if topic_map is not None:
                (maps if rule.mode == "enforce" else observed).append(topic_map)
                outcomes.append(_outcome(rule.name, "topics", "rewrite", rule.mode))
            if not found and topic_map is None:
                outcomes.append(_outcome(rule.name, "match", "pass", rule.mode))
        if (refusal is None and not would and not maps and not observed
                and config_refusal is None and not config_would and not policies
                and not policies_observed and not validations and not validations_observed
                and not topic_policies and not topic_policies_observed and not encryptions):
            return _passed(tuple(outcomes))  # nearly every request: one shared answer
        return Evaluation(
            refusal=refusal,
            would_refuse=tuple(would),
            topic_map=_compose(maps),
            observed_map=_compose(observed),
            outcomes=tuple(outcomes),
            config_refusal=config_refusal,
            config_would_refuse=tuple(config_would),
            produce_policies=tuple(policies),
            produce_observed=tuple(policies_observed),
            record_validations=tuple(validations),
            records_observed=tuple(validations_observed),
            topic_policies=tuple(topic_policies),
            topic_policies_observed=tuple(topic_policies_observed),
            encryptions=tuple(encryptions),
        )

    def version_ranges(self, facts: ClientFacts, api_key: int, lo: int,
                       hi: int) -> tuple[int, int] | None:
        """The ApiVersions range to advertise for one API (None: leave the API out)."""
        for rule in self.matching(facts):
            if rule.mode != "enforce":
                continue
            bound = rule.min_api_version.get(api_key)
            if bound is not None and bound.advertise and bound.version > lo:
                lo = bound.version
            bound = rule.max_api_version.get(api_key)
            if bound is not None and bound.advertise and bound.version < hi:
                hi = bound.version
        if lo > hi:
            # Nothing the broker offers is allowed: advertising an empty range is not
            # possible, so the API is left out and requests to it are refused.
            return None
        return lo, hi

    def advice(self, shared_identity: bool = False) -> list[str]:
        """Warnings about rules that do what they say but may not do what is meant
        (``file:line: rule NAME: ...``): a prefix that hides other tenants but trusts
        the client id to tell tenants apart, or leaves their groups and transactional
        ids shared; with ``shared_identity`` (the brokers see the proxy's one user for
        every client: ``sasl.upstream``), acls that say nothing of the cluster."""
        out = []
        for rule in self.rules:
            match = rule.match
            if (rule.mode == "enforce" and rule.topic_policy is not None
                    and _self_described(match)):
                out.append(f"{self._where(rule)}: rule {rule.name}: holds the topics its "
                           "clients create or change to a topic_policy, but tells clients "
                           "apart by what a client says of itself (client id, software), "
                           "which any client may claim: leave match out (every client), or "
                           "match on principal or source")
            ring = rule.encrypt_records.ring if rule.encrypt_records is not None else None
            if ring is not None and _open_to_others(ring.path):
                out.append(f"{self._where(rule)}: rule {rule.name}: its key file "
                           f"{ring.path} is readable by other users: "
                           "chmod 600 it (a Kubernetes Secret: defaultMode: 0400)")
            if rule.encrypt_records is not None and _self_described(match):
                out.append(f"{self._where(rule)}: rule {rule.name}: decrypts records for "
                           "the clients it matches, but tells clients apart by what a "
                           "client says of itself (client id, software), which any client "
                           "may claim: match on principal or source, or leave match out "
                           "(every client of the proxy)")
            topic_map = next(iter(rule.maps()), None)  # its own, else its ACLs'
            if rule.mode != "enforce" or topic_map is None or not (
                    topic_map.hides_others or topic_map.filters):
                continue
            where = self._where(rule)
            if _self_described(match):
                what = ("keeps tenants apart (hide_others)" if topic_map.hides_others
                        else "limits the groups or transactional ids a client may use")
                out.append(f"{where}: rule {rule.name}: {what}, but tells clients apart by "
                           "what a client says of itself (client id, software), which any "
                           "client may claim: match on principal (SASL or a client "
                           "certificate) or source instead")
            shared = [key for key, kind in (("groups", GROUP), ("transactional_ids", TRANSACTION))
                      if kind not in topic_map.id_kinds]
            if shared and hiding_prefix(topic_map):
                out.append(f"{where}: rule {rule.name}: hides other tenants' topics but "
                           f"their {' and '.join(shared).replace('_', ' ')} stay shared: "
                           f"add {', '.join(key + ': true' for key in shared)}")
        if shared_identity:
            out += self._shared_identity_advice()
        return out

    def _where(self, rule: Rule) -> str:
        return f"{self.source}:{rule.line}" if rule.line is not None else self.source

    def _shared_identity_advice(self) -> list[str]:
        """Enforced rules whose ``acls`` keep clients to some names, or whose prefix
        keeps tenants apart, but say nothing of the cluster, whose APIs (ACLs, SCRAM
        credentials, quotas, the brokers' configs) are then whatever the proxy's user
        may do."""
        out = []
        for rule in self.rules:
            if rule.mode != "enforce" or rule.acls_name_cluster:
                continue
            if rule.api_maps is not None:
                what = "its acls say nothing of the cluster"
            elif rule.topic_map is not None and hiding_prefix(rule.topic_map):
                what = "it keeps tenants apart (hide_others) but has no acls for the cluster"
            else:
                continue
            out.append(f"{self._where(rule)}: rule {rule.name}: {what}, and "
                       "with sasl.upstream the brokers see the proxy's user for every "
                       "client: the cluster's APIs (ACLs, SCRAM credentials, quotas, the "
                       "brokers' configs) are whatever that user may do; add an entry with "
                       "cluster: true (allow: [describe], say)")
        return out

    @property
    def has_topic_maps(self) -> bool:
        return any(r.maps_names for r in self.rules)


@functools.lru_cache(maxsize=4096)
def _outcome(rule: str, action: str, effect: Effect, mode: Mode) -> Outcome:
    """Outcomes are immutable: one object per rule and effect, not one per request."""
    return Outcome(rule, action, effect, mode)


@functools.lru_cache(maxsize=4096)
def _passed(outcomes: tuple[Outcome, ...]) -> Evaluation:
    return Evaluation(outcomes=outcomes)


def _software_refusal(rule: Rule, facts: ClientFacts) -> str | None:
    versions = software_versions(facts)
    if not versions:
        if rule.unknown_software == "refuse":
            return (f"client software not reported (KIP-511) and rule {rule.name} requires "
                    f"{_minimums(rule)}")
        return None
    for name, minimum in rule.min_client_software.items():
        have = versions.get(name)
        if have is not None and have < minimum:
            return (f"{name} {'.'.join(map(str, have))} is older than "
                    f"{rule.min_client_software_text[name]} (rule {rule.name})")
    return None


def _minimums(rule: Rule) -> str:
    return ", ".join(f"{n} >= {v}" for n, v in rule.min_client_software_text.items())


def _compose(maps: Sequence[TopicMap]) -> TopicMap | None:
    if not maps:
        return None
    return maps[0] if len(maps) == 1 else Chain(tuple(maps))


__all__ = [
    "ClientFacts",
    "Evaluation",
    "Match",
    "Outcome",
    "Prefix",
    "Quota",
    "Refusal",
    "Rename",
    "Rule",
    "RuleSet",
    "VersionBound",
]
