"""Prometheus metrics for the proxy, and the /metrics, /healthz, /readyz endpoints.

Every metric lives in the proxy's own registry (tests run several proxies in one
process).  Label values that come from clients (topics, client software) are capped;
what does not fit folds into ``other`` and the fold is counted.  See docs/metrics.md.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from types import ModuleType
from typing import Any

import trio
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from gatehouse import __version__
from gatehouse.codecs import APIS, FlatRecords, ProtocolError, Request, Response, api_name, produce
from gatehouse.codecs._error_codes import ERROR_NAMES
from gatehouse.codecs._native import BYTE_READERS, speedups
from gatehouse.codecs.frames import _UNSET
from gatehouse.logs import log_event
from gatehouse.metrics.groups import GROUP_APIS, GROUP_RESPONSES, GroupCensus
from gatehouse.metrics.tally import CounterFamily, HistogramFamily, Tally, counting
from gatehouse.metrics.telemetry import ClientTelemetry, TelemetrySettings
from gatehouse.proxy.config import Address
from gatehouse.proxy.hooks import (
    CLEAN_CLOSES,
    FETCHES,
    SCANNED_RESPONSES,
    ConnectionInfo,
    Observer,
    Pending,
    decoded_response,
    scanned_response,
    tally_error,
    tally_topic,
)

logger = logging.getLogger("gatehouse.metrics")

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                   0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Requests the broker may hold on purpose (long polls): labelled so they don't drown
# the latency of everything else.
LONG_POLL_APIS = frozenset({1, 11, 68, 76, 78, 88})  # Fetch, JoinGroup, group heartbeats, ShareFetch
PRODUCE, FETCH, METADATA, API_VERSIONS, SASL_AUTHENTICATE = 0, 1, 3, 18, 36
# Topic name -> its counters, including names folded into "other": past this many, a
# folded name is looked up (and counted as a fold) again each time.
MAX_CACHED_TOPICS = 100_000
# What the codec reads (a range: ``in`` is cheaper than the table's own Versions).
_PRODUCE_VERSIONS = range(APIS[PRODUCE].versions.lo, APIS[PRODUCE].versions.hi + 1)
# Requests whose bodies the census reads (client software, groups): always in Python.
_PYTHON_REQUESTS = frozenset({API_VERSIONS, *GROUP_APIS})
MAX_REMEMBERED_FOLDS = 100_000  # past this, a folded value counts each time it is seen


class CappedLabel:
    """At most ``cap`` distinct values; the rest become ``other`` (and are counted)."""

    def __init__(self, cap: int, folded: Counter, name: str) -> None:
        self.cap = cap
        self.values: set[str] = set()
        self.folded = folded.labels(label=name)
        # Folded values remembered (bounded) so each is counted once.
        self.folded_values: set[str] = set()

    def __call__(self, value: str) -> str:
        if value in self.values:
            return value
        if len(self.values) < self.cap:
            self.values.add(value)
            return value
        if value not in self.folded_values:
            if len(self.folded_values) < MAX_REMEMBERED_FOLDS:
                self.folded_values.add(value)
            self.folded.inc()
        return "other"


def _error_predicate(f: Any) -> bool:
    return bool(f.attr == "error_code" and f.type == "int16")


Extractor = Callable[[Any, list[int]], None]


def _error_fields(struct: Any, version: int) -> tuple[str, ...]:
    return tuple(f.attr for f in struct.fields if _error_predicate(f) and version in f.versions)


_EXTRACTORS: dict[tuple[int, int], Extractor | None] = {}


def _build_extractor(struct: Any, version: int) -> Extractor | None:
    """A function appending every error code under ``struct`` (None: there are none).

    Built once per API version from the tables: the hot path is then attribute reads
    and loops, no per-field predicate calls."""
    codes = _error_fields(struct, version)
    subs = []
    for f in struct.fields:
        if f.struct is not None and version in f.versions:
            sub = _build_extractor(f.struct, version)
            if sub is not None:
                subs.append((f.attr, f.is_array, sub, _error_fields(f.struct, version)))
    if not codes and not subs:
        return None
    nested = tuple(subs)

    def extract(record: Any, out: list[int]) -> None:
        for attr in codes:
            value = getattr(record, attr)
            if value is not None:
                out.append(value)
        for attr, is_array, sub, sub_codes in nested:
            value = getattr(record, attr)
            if value is None:
                continue
            if is_array:
                if type(value) is FlatRecords:
                    # Number-only elements (Metadata's partitions): their error codes
                    # are read from the bytes, no records built.
                    for code_attr in sub_codes:
                        out.extend(value.column(code_attr))
                    continue
                for item in value:
                    sub(item, out)
            else:
                sub(value, out)

    return extract


def error_codes(resp: Response) -> list[int]:
    """Every error code in a response, partition-level included."""
    key = (resp.api_key, resp.api_version)
    try:
        extract = _EXTRACTORS[key]
    except KeyError:
        extract = _EXTRACTORS[key] = _build_extractor(resp.api.response.root,
                                                      resp.api_version)
    codes: list[int] = []
    if extract is not None:
        extract(resp.body, codes)
    return codes




# Requests pass through whatever their key and version: labels for what no broker speaks
# fold, or a client making up keys and versions would make up series without end.
MAX_API_KEY_LABEL = 256
VERSIONS_PAST_THE_CODEC = 16  # newer versions than the tables know still get their own


def request_labels(key: int, version: int) -> tuple[str, str]:
    """The ``api`` and ``version`` labels of a request: ``other`` for API keys outside
    0..255 and for versions below 0 or far past what the codec knows."""
    spec = APIS.get(key)
    if spec is None and not 0 <= key < MAX_API_KEY_LABEL:
        return "other", "other"
    newest = (spec.versions.hi if spec is not None else 0) + VERSIONS_PAST_THE_CODEC
    return api_name(key), str(version) if 0 <= version <= newest else "other"


class ProxyMetrics(Observer):
    reads_scans = True  # Fetch records and bytes per topic, every response's codes
    counts_request_records = True  # a Produce request's topics and records

    def __init__(self, label_cap: int = 500, registry: CollectorRegistry | None = None,
                 client_telemetry: TelemetrySettings | None = None) -> None:
        # auto_describe off: the connections gauge and the connections_total counter share
        # a base name, which the text format allows but the registry's check does not.
        self.registry = registry or CollectorRegistry(auto_describe=False)
        r = self.registry
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        # Updated for every request and response: lock-free families (see tally.py).
        self.requests = CounterFamily("gatehouse_requests", "Requests from clients",
                                      ["api", "version", "client_software", "listener"])
        self.responses = CounterFamily("gatehouse_responses", "Error codes in responses "
                                       "(every level)", ["api", "error"])
        self.duration = HistogramFamily("gatehouse_request_duration_seconds",
                                        "Forwarded request to its response", ["api", "kind"],
                                        buckets=LATENCY_BUCKETS)
        self.bytes = CounterFamily("gatehouse_bytes", "Bytes through the proxy", ["direction"])
        self.open_connections = {"client": 0, "broker": 0}
        r.register(_ConnectionsGauge(self.open_connections))
        self.connections_total = Counter("gatehouse_connections", "Connections by outcome",
                                         ["side", "outcome"], registry=r)
        self.clients = Gauge("gatehouse_clients", "Live connections per client software "
                             "(KIP-511)", ["software_name", "software_version"], registry=r)
        # What runs: which proxy release, and whether its byte readers are the C ones.
        Gauge("gatehouse_info", "The proxy's version and byte readers (c or python)",
              ["version", "byte_readers"], registry=r).labels(__version__, BYTE_READERS).set(1)
        self.principals = Gauge("gatehouse_principals", "Live connections per "
                                "principal: the SASL user the brokers accepted, or the "
                                "verified client certificate's subject", ["principal"], registry=r)
        self.topic_records = CounterFamily("gatehouse_topic_records", "Records by client-side "
                                           "topic", ["topic", "direction"])
        self.topic_bytes = CounterFamily("gatehouse_topic_bytes", "Record bytes by client-side "
                                         "topic", ["topic", "direction"])
        self.decisions = CounterFamily("gatehouse_rule_decisions", "Rule decisions",
                                       ["rule", "action"])
        for family in (self.requests, self.responses, self.duration, self.bytes,
                       self.topic_records, self.topic_bytes, self.decisions):
            r.register(family)
        self.reloads = Counter("gatehouse_rules_reloads", "Rules reloads", ["outcome"],
                               registry=r)
        self.throttle_seconds = Counter("gatehouse_throttle_seconds", "Time client requests "
                                        "were held back by rules' quotas", ["rule"],
                                        registry=r)
        self.invalid_records = Counter("gatehouse_invalid_records", "Records a rule's "
                                       "validate_records found invalid (enforced: refused "
                                       "with their batch; observe mode: written)",
                                       ["rule", "topic", "mode"], registry=r)
        self.encrypted_records = Counter("gatehouse_encrypted_records", "Records a rule's "
                                         "encrypt_records encrypted (Produce), decrypted "
                                         "(Fetch) or could not decrypt (passed on "
                                         "encrypted)", ["rule", "topic", "outcome"],
                                         registry=r)
        self.schema_lookups = Counter("gatehouse_schema_registry_lookups", "Schema ids "
                                      "validate_records looked up in a Schema Registry "
                                      "(found, not_found, error)", ["registry", "outcome"],
                                      registry=r)
        self.last_reload_ok = Gauge("gatehouse_rules_last_reload_success", "1 unless the "
                                    "last rules reload failed (the old rules stay in force)",
                                    registry=r)
        self.last_reload_ok.set(1)
        self.tls_reloads = Counter("gatehouse_tls_reloads", "TLS certificate reloads",
                                   ["outcome"], registry=r)
        self.tls_last_reload_ok = Gauge("gatehouse_tls_last_reload_success", "1 unless the "
                                        "last TLS certificate reload failed (the old "
                                        "certificates stay in force)", registry=r)
        self.tls_last_reload_ok.set(1)
        self.jwks_loads = Counter("gatehouse_jwks_loads", "Loads of the keys OAUTHBEARER "
                                  "tokens are checked against (a JWKS file reloaded, a JWKS "
                                  "URL fetched)", ["outcome"], registry=r)
        self.jwks_last_load_ok = Gauge("gatehouse_jwks_last_load_success", "1 unless the "
                                       "last load of the JWKS failed (the keys before it "
                                       "stay in force)", registry=r)
        self.jwks_last_load_ok.set(1)
        self.upstream_failures = Counter("gatehouse_upstream_failures", "Failed connections "
                                         "to brokers", ["broker"], registry=r)
        self.malformed_frames = Counter("gatehouse_malformed_frames", "Frames that could not be "
                                 "decoded", ["direction"], registry=r)
        self.internal_errors = Counter("gatehouse_internal_errors", "Connections a bug of the "
                                       "proxy's ended (each logged with its traceback)",
                                       registry=r)
        self.folded = Counter("gatehouse_label_values_folded", "Label values folded into "
                              "'other' by the cardinality cap", ["label"], registry=r)
        self.consumer_groups = Gauge("gatehouse_consumer_groups", "Groups with a live member "
                                     "connection through this proxy",
                                     ["protocol_type", "protocol"], registry=r)
        self.group_fallbacks = Counter(
            "gatehouse_group_protocol_fallbacks", "Frames with group payloads that do not "
            "say their protocol type (before KIP-559)", ["api", "direction", "outcome"],
            registry=r)
        self.group_label = CappedLabel(label_cap, self.folded, "group_protocol")
        self.groups = GroupCensus(self.consumer_groups, self.group_fallbacks, self.group_label)
        self.topic_label = CappedLabel(label_cap, self.folded, "topic")
        self.software_label = CappedLabel(label_cap, self.folded, "client_software")
        self.broker_label = CappedLabel(label_cap, self.folded, "broker")
        self.principal_label = CappedLabel(label_cap, self.folded, "principal")
        self.upstream_ok = False
        # What /readyz answers; serve_metrics installs the proxy's own check.
        self.ready_check: Callable[[], bool] = lambda: self.upstream_ok
        # metrics.client_telemetry: the clients' own metrics (KIP-714), received by the
        # proxy (its connections hand it their telemetry requests), exported here.
        self.client_telemetry: ClientTelemetry | None = None
        if client_telemetry is not None:
            self.client_telemetry = ClientTelemetry(client_telemetry)
            r.register(self.client_telemetry)
        r.register(_ReadyGauge(self))
        # Produce v13 and Fetch v13+ name topics by id: names come from the Metadata
        # responses this proxy has seen (bounded; "unknown" until then).
        self.topic_names: dict[bytes, str] = {}  # topic id (16 bytes) -> name
        self._software_of: dict[int, tuple[str, str]] = {}
        self._principal_of: dict[int, str] = {}  # per live connection: its principal label
        # Per live connection: (api key << 16 | version) -> its requests counter.
        self._conn_requests: dict[int, dict[int, Tally]] = {}
        # Produce request topics as the byte reader names them (a name, or the 16 bytes
        # of a topic id while its name is known) -> the records and bytes counters.
        self._produced: dict[str | bytes, tuple[Tally, Tally, str]] = {}  # and its name
        self._fetched: dict[str | bytes, tuple[Tally, Tally, str]] = {}  # the same, of Fetch answers
        # Label children resolved once: labels() costs more than the increment itself.
        self._bytes_in, self._bytes_up, self._bytes_down, self._bytes_out = (
            self.bytes.labels(direction=d) for d in (
                "client_to_proxy", "proxy_to_broker", "broker_to_proxy", "proxy_to_client"))
        self._request_counters: dict[tuple[int, int, str | None, str | None, str], Any] = {}
        self._response_counters: dict[int, Tally] = {}  # api key << 16 | error code
        self._durations: dict[int, Any] = {}
        self._decision_counters: dict[tuple[str, str, str], Any] = {}
        self._topic_counters: dict[tuple[str, str], tuple[Any, Any]] = {}
        for outcome in ("ok", "failed"):
            self.reloads.labels(outcome=outcome)
            self.tls_reloads.labels(outcome=outcome)
            self.jwks_loads.labels(outcome=outcome)
        # From 0, so the first refusal is an increase Prometheus sees.
        self._refused = self.connections_total.labels(side="client", outcome="refused")
        if counting is not None:  # the usual exchange counted in C (tally.py)
            self._count_in_c(counting)

    def _count_in_c(self, counting: ModuleType) -> None:
        """``request`` and ``response`` as the C functions over this object's tables,
        which call the Python methods for whatever they do not take."""
        assert speedups is not None  # counting is only loaded with the C readers
        cls = type(self)
        self.request = partial(  # type: ignore[method-assign]
            counting.request,
            (self._conn_requests, self._bytes_up, self._produced, speedups.produce_request_topics,
             _PRODUCE_VERSIONS, _PYTHON_REQUESTS, _UNSET, cls.request.__get__(self, cls),
             produce.TOPICS_READ_KEY))
        self.response = partial(  # type: ignore[method-assign]
            counting.response,
            (self._bytes_out, self._bytes_down, self._durations, self._response_counters,
             self._fetched, cls.response.__get__(self, cls)))

    # -- wiring ---------------------------------------------------------------------

    def watch_buffers(self, requests: Any, responses: Any) -> None:
        """Export the proxy's shared byte budgets (gatehouse.proxy.budget.ByteBudget)."""
        self.registry.register(_BufferCollector({"request": requests, "response": responses}))

    def watch_tls(self, contexts: Any) -> None:
        """Count the reloads of the proxy's certificates (gatehouse.proxy.tls.TlsContexts)."""
        contexts.listeners.append(self._tls_reloaded)

    def _tls_reloaded(self, ok: bool) -> None:
        self.tls_reloads.labels(outcome="ok" if ok else "failed").inc()
        self.tls_last_reload_ok.set(1 if ok else 0)

    def watch_jwks(self, tokens: Any) -> None:
        """Count the loads of the OAUTHBEARER keys (gatehouse.proxy.oauth.TokenValidator)."""
        tokens.listeners.append(self._jwks_loaded)

    def _jwks_loaded(self, ok: bool) -> None:
        self.jwks_loads.labels(outcome="ok" if ok else "failed").inc()
        self.jwks_last_load_ok.set(1 if ok else 0)

    def attach(self, policy: Any, reloader: Any) -> None:
        """Subscribe to the rules' decisions and reloads."""
        if hasattr(policy, "outcome_listeners"):
            policy.outcome_listeners.append(self._outcome)
        if hasattr(policy, "throttle_listeners"):
            policy.throttle_listeners.append(self._throttled)
        if hasattr(policy, "invalid_records_listeners"):
            policy.invalid_records_listeners.append(self._invalid_records)
        if hasattr(policy, "encryption_listeners"):
            policy.encryption_listeners.append(self._encrypted_records)
        schemas = getattr(policy, "schemas", None)
        if schemas is not None and hasattr(schemas, "listeners"):
            schemas.listeners.append(self._schema_lookup)
        stats = getattr(policy, "stats", None)
        if stats is not None and hasattr(stats, "protocol_fallbacks"):
            self.registry.register(_RewriteStatsCollector(stats))
        if reloader is not None:
            reloader.listeners.append(self._reloaded)

    def _reloaded(self, ok: bool) -> None:
        self.reloads.labels(outcome="ok" if ok else "failed").inc()
        self.last_reload_ok.set(1 if ok else 0)

    def _invalid_records(self, rule: str, topic: str, mode: str, count: int) -> None:
        self.invalid_records.labels(rule=rule, topic=self.topic_label(topic),
                                    mode=mode).inc(count)

    def _encrypted_records(self, rule: str, topic: str, outcome: str, count: int) -> None:
        self.encrypted_records.labels(rule=rule, topic=self.topic_label(topic),
                                      outcome=outcome).inc(count)

    def _schema_lookup(self, registry: str, outcome: str) -> None:
        self.schema_lookups.labels(registry=registry, outcome=outcome).inc()

    def _throttled(self, rule: str, seconds: float) -> None:
        self.throttle_seconds.labels(rule=rule).inc(seconds)

    def _outcome(self, outcome: Any) -> None:
        key = (outcome.rule, outcome.mode, outcome.effect)
        counter = self._decision_counters.get(key)
        if counter is None:
            if outcome.mode == "observe":
                actions = {"refuse": "would_refuse", "rewrite": "would_rename",
                           "throttle": "would_throttle"}
            else:
                actions = {"refuse": "refuse", "rewrite": "rename", "throttle": "throttle"}
            counter = self.decisions.labels(rule=outcome.rule,
                                            action=actions.get(outcome.effect, "allow"))
            if len(self._decision_counters) < 10_000:  # rule names come from the config
                self._decision_counters[key] = counter
        counter.inc()

    # -- observer -------------------------------------------------------------------

    def connection_opened(self, conn: ConnectionInfo) -> None:
        self.upstream_ok = True
        for side in ("client", "broker"):
            self.open_connections[side] += 1
            self.connections_total.labels(side=side, outcome="opened").inc()
        if conn.principal is not None:  # a verified client certificate's
            self._authenticated(conn)

    def connection_refused(self, client: str, reason: str) -> None:
        self._refused.inc()

    def connection_closed(self, conn: ConnectionInfo, reason: str) -> None:
        outcome = "clean" if reason in CLEAN_CLOSES else "error"
        for side in ("client", "broker"):
            self.open_connections[side] -= 1
            self.connections_total.labels(side=side, outcome=outcome).inc()
        self.groups.connection_closed(conn.id)
        self._conn_requests.pop(conn.id, None)
        software = self._software_of.pop(conn.id, None)
        if software is not None:
            self.clients.labels(*software).dec()
        principal = self._principal_of.pop(conn.id, None)
        if principal is not None:
            self.principals.labels(principal).dec()
        self._bytes_in.inc(conn.bytes_from_client)

    def _authenticated(self, conn: ConnectionInfo) -> None:
        """The census of principals: a connection counts under the one it last
        authenticated as (its certificate's, then SASL's; KIP-368 re-authentication may
        change it)."""
        label = self.principal_label(str(conn.principal))
        before = self._principal_of.get(conn.id)
        if before == label:
            return
        if before is not None:
            self.principals.labels(before).dec()
        self._principal_of[conn.id] = label
        self.principals.labels(label).inc()

    def request(self, conn: ConnectionInfo, req: Request, size: int) -> None:
        # The hot path (every request): counters found through small per-connection and
        # per-topic dicts with int and str keys, numbers added without method calls, the
        # header's fields read once (the message's properties cost more than the adds).
        header = req.header
        key = header.api_key
        version = header.api_version
        self._bytes_up.value += size + 4
        counters = self._conn_requests.get(conn.id)
        if counters is None or key == API_VERSIONS:  # the client software may change
            counters = self._conn_requests[conn.id] = {}
            if key == API_VERSIONS and conn.software_name and conn.id not in self._software_of:
                software = (self.software_label(conn.software_name),
                            self.software_label(conn.software_version or ""))
                self._software_of[conn.id] = software
                self.clients.labels(*software).inc()
        slot = (key << 16) | (version & 0xFFFF)
        counter = counters.get(slot)
        if counter is None:
            if len(counters) >= 1024:  # bounded: a client uses a few dozen versions
                counters.clear()
            counter = counters[slot] = self._request_counter(conn, key, version)
        counter.value += 1
        try:  # a malformed body is the pumps' to report, not ours
            if key == PRODUCE:
                if version in _PRODUCE_VERSIONS:  # a version from the future: not read
                    topics = None if req.body_decoded else produce.request_topics_of(req)
                    if topics is not None:
                        self._count_scanned(topics, self._produced, "produce", conn.produced)
                    else:
                        self._count_produce(req, conn)
            elif key in GROUP_APIS and req.known:
                self.groups.request(conn.id, req)
        except ProtocolError:
            pass

    def _request_counter(self, conn: ConnectionInfo, key: int, version: int) -> Any:
        cache_key = (key, version, conn.software_name, conn.software_version, conn.listener)
        counter = self._request_counters.get(cache_key)
        if counter is None:
            software_text = (f"{conn.software_name}/{conn.software_version}"
                             if conn.software_name else "unknown")
            api, version_label = request_labels(key, version)
            counter = self.requests.labels(
                api=api, version=version_label,
                client_software=self.software_label(software_text), listener=conn.listener)
            if len(self._request_counters) < 100_000:  # bounded, like the labels
                self._request_counters[cache_key] = counter
        return counter

    def _count_produce(self, req: Request, conn: ConnectionInfo) -> None:
        for topic in req.body.topic_data:
            name = self._topic_name(topic, "name")
            records_total, bytes_total = produce.partitions_total(topic.partition_data)
            if records_total <= 0:  # nothing (or a nonsense count from a bad header)
                continue
            counted, sized = self._topic(name, "produce")
            counted.inc(records_total)
            sized.inc(bytes_total)
            tally_topic(conn.produced, name, records_total, bytes_total)

    def _count_scanned(self, topics: produce.TopicCounts,
                       cache: dict[str | bytes, tuple[Tally, Tally, str]], direction: str,
                       mine: dict[str, list[int]]) -> None:
        """Records and bytes per topic as a byte reader gives them (Produce requests,
        Fetch answers), in the proxy's counters and the connection's tally ``mine``;
        each topic's counters and name remembered in ``cache`` once its name is known
        (an id not yet named counts as "unknown" until it is)."""
        for topic, _, records_total, bytes_total in topics:
            if records_total <= 0:  # nothing (or a nonsense count from a bad header)
                continue
            found = cache.get(topic)
            if found is None:
                name = self._scanned_topic_name(topic)
                found = (*self._topic(name, direction), name)
                if len(cache) < MAX_CACHED_TOPICS and (name != "unknown"
                                                       or isinstance(topic, str)):
                    cache[topic] = found
            found[0].value += records_total
            found[1].value += bytes_total
            counts = mine.get(found[2])
            if counts is None:
                tally_topic(mine, found[2], records_total, bytes_total)
            else:
                counts[0] += records_total
                counts[1] += bytes_total

    def _topic(self, name: str, direction: str) -> tuple[Any, Any]:
        """The records and bytes counters of a topic (its label capped)."""
        counters = self._topic_counters.get((name, direction))
        if counters is None:
            label = self.topic_label(name)
            counters = (self.topic_records.labels(topic=label, direction=direction),
                        self.topic_bytes.labels(topic=label, direction=direction))
            if len(self._topic_counters) < MAX_CACHED_TOPICS:  # each fold counted once
                self._topic_counters[(name, direction)] = counters
        return counters

    def response(self, conn: ConnectionInfo, pending: Pending, size: int, elapsed: float,
                 frame: Any = None) -> None:
        key = pending.api_key
        size += 4
        self._bytes_out.value += size
        if pending.local is None:  # not the proxy's own answer
            self._bytes_down.value += size
            histogram = self._durations.get(key)
            if histogram is None:
                kind = "long_poll" if key in LONG_POLL_APIS else "request"
                histogram = self._durations[key] = self.duration.labels(api=api_name(key),
                                                                        kind=kind)
            histogram.observe(elapsed)
        if key == SASL_AUTHENTICATE and conn.principal is not None:
            self._authenticated(conn)
        if pending.raw or key not in APIS:  # raw: a SASL v0 token
            return
        if key in SCANNED_RESPONSES and pending.decoded is None:
            scan = scanned_response(pending, frame)  # with no frame: counted on the way
            if scan is not None:  # read from the bytes: no decode
                counts = scan[0]
                if counts:
                    responses = self._response_counters
                    for code, n in counts.items():
                        counter = responses.get((key << 16) | (code & 0xFFFF))
                        if counter is None:
                            counter = self._response_counter(key, code)
                        counter.value += n
                        if code:
                            self._connection_error(conn, key, code, n)
                else:
                    self._response_counter(key, 0).value += 1
                if key == FETCH:
                    self._count_scanned(scan[2], self._fetched, "fetch", conn.fetched)
                return
        if frame is None:  # its bytes went by unread, uncounted
            return
        try:
            resp = decoded_response(pending, frame)  # once for every observer
            if not resp.known:
                return
            codes = error_codes(resp) or [0]
            first = codes[0]
            if all(code == first for code in codes):  # the usual case: all NONE
                self._response_counter(key, first).inc(len(codes))
                if first:
                    self._connection_error(conn, key, first, len(codes))
            else:
                for code in codes:
                    self._response_counter(key, code).inc()
                    if code:
                        self._connection_error(conn, key, code, 1)
            if key == METADATA:
                self._learn_topic_ids(resp)
            elif key in GROUP_RESPONSES:
                self.groups.response(conn.id, pending.correlation_id, resp)
            if key in FETCHES:  # a share consumer's records too
                for topic in resp.body.responses:
                    records_total, bytes_total = produce.partitions_total(topic.partitions)
                    if records_total > 0:
                        name = self._topic_name(topic, "topic")
                        counted, sized = self._topic(name, "fetch")
                        counted.inc(records_total)
                        sized.inc(bytes_total)
                        tally_topic(conn.fetched, name, records_total, bytes_total)
        except ProtocolError:
            pass

    @staticmethod
    def _connection_error(conn: ConnectionInfo, key: int, code: int, count: int) -> None:
        """The connection's own tally of errors (/connections), as the counters'."""
        tally_error(conn, api_name(key), ERROR_NAMES.get(code, str(code)), count)

    def _response_counter(self, key: int, code: int) -> Any:
        slot = (key << 16) | (code & 0xFFFF)
        counter = self._response_counters.get(slot)
        if counter is None:
            # Error codes are int16: at most 65,536 per API, and brokers use a few dozen.
            counter = self._response_counters[slot] = self.responses.labels(
                api=api_name(key), error=ERROR_NAMES.get(code, str(code)))
        return counter

    def _scanned_topic_name(self, key: str | bytes) -> str:
        """A topic as the byte readers give it: its name, or its id's 16 bytes."""
        if isinstance(key, str):
            return key or "unknown"
        return self.topic_names.get(key, "unknown")

    def _topic_name(self, topic: Any, attr: str) -> str:
        name = getattr(topic, attr, None)
        if name:
            return str(name)
        topic_id = getattr(topic, "topic_id", None)
        if topic_id is None:
            return "unknown"
        return self.topic_names.get(topic_id.bytes, "unknown")

    def _learn_topic_ids(self, resp: Response) -> None:
        for topic in resp.body.topics:
            topic_id = getattr(topic, "topic_id", None)
            if topic_id is not None and topic.name and topic_id.int:
                key = topic_id.bytes  # as the Produce fast path reads it from the frame
                if len(self.topic_names) >= 10_000 and key not in self.topic_names:
                    self.topic_names.clear()  # bounded: relearned from the next Metadata
                self.topic_names[key] = topic.name

    def upstream_failure(self, target: str, error: str) -> None:
        self.upstream_ok = False
        self.connections_total.labels(side="broker", outcome="failed").inc()
        self.upstream_failures.labels(broker=self.broker_label(target)).inc()

    def malformed(self, conn: ConnectionInfo, direction: str, error: str) -> None:
        self.malformed_frames.labels(direction=direction).inc()

    def internal_error(self, conn: ConnectionInfo, error: str) -> None:
        self.internal_errors.inc()


class _ConnectionsGauge:
    """``gatehouse_connections{side}``: open connections to clients and to brokers."""

    def __init__(self, counts: dict[str, int]) -> None:
        self.counts = counts

    def collect(self) -> Any:
        family = GaugeMetricFamily("gatehouse_connections", "Open connections",
                                   labels=["side"])
        for side, value in self.counts.items():
            family.add_metric([side], value)
        yield family


class _BufferCollector:
    """``gatehouse_buffered_bytes{direction}`` and the waits for a spent budget."""

    def __init__(self, budgets: dict[str, Any]) -> None:
        self.budgets = budgets

    def collect(self) -> Any:
        held = GaugeMetricFamily("gatehouse_buffered_bytes", "Frame bytes the proxy holds "
                                 "(reserved) across all connections", labels=["direction"])
        limit = GaugeMetricFamily("gatehouse_buffered_bytes_limit", "limits.max_buffered_"
                                  "{request,response}_bytes", labels=["direction"])
        waits = CounterMetricFamily("gatehouse_buffer_waits", "Frames whose reading waited "
                                    "for the shared budget (it was spent)",
                                    labels=["direction"])
        for direction, budget in self.budgets.items():
            held.add_metric([direction], budget.held)
            limit.add_metric([direction], budget.total)
            waits.add_metric([direction], budget.waits)
        yield held
        yield limit
        yield waits


class _ReadyGauge:
    """``gatehouse_ready``: 1 while /readyz answers 200."""

    def __init__(self, metrics: ProxyMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Any:
        family = GaugeMetricFamily("gatehouse_ready", "1 while /readyz answers 200: "
                                   "listening, and the last connection attempt to a broker "
                                   "succeeded")
        family.add_metric([], 1.0 if self.metrics.ready_check() else 0.0)
        yield family


class _RewriteStatsCollector:
    """``gatehouse_rename_group_payloads_total{outcome}``: what topic renames met inside
    group payloads (the rules' own counts, read at scrape time)."""

    def __init__(self, stats: Any) -> None:
        self.stats = stats

    def collect(self) -> Any:
        family = CounterMetricFamily(
            "gatehouse_rename_group_payloads", "Group payloads met by topic rename/prefix "
            "rules: decoded with the connection's JoinGroup (fallback), of a protocol type "
            "other than consumer, or undecodable (both passed through unchanged)",
            labels=["outcome"])
        family.add_metric(["fallback"], self.stats.protocol_fallbacks)
        family.add_metric(["unknown_protocol"], self.stats.unknown_protocol_bytes)
        family.add_metric(["undecodable"], self.stats.undecodable_protocol_bytes)
        yield family


# -- endpoints ------------------------------------------------------------------------

Readiness = Callable[[], bool | Awaitable[tuple[bool, str]]]
# /connections: the document (gatehouse.proxy.live), made when asked.
Connections = Callable[[], Awaitable[bytes]]


@dataclass(frozen=True)
class ConnectionsEndpoint:
    """/connections: what it serves and to whom (``metrics.connections``: "local",
    loopback clients of a loopback address only; "any"; "off", not served)."""

    document: Connections | None
    readers: str = "local"


def is_loopback(host: str) -> bool:
    """Whether an address (a socket's peer name) is this host's loopback (IPv4-mapped
    IPv6 included)."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return bool((mapped or address).is_loopback)


def _from_this_host(stream: trio.SocketStream) -> bool:
    """Whether a connection is a loopback client's to a loopback address: a shell on the
    host, ``kubectl exec`` or ``port-forward``.  Both ends, not just the peer: a mesh
    sidecar that hands the network's connections to the pod's own address from a
    loopback one (Istio's 127.0.0.6) must not make them local."""
    try:
        ends = (stream.socket.getpeername()[0], stream.socket.getsockname()[0])
    except (OSError, AttributeError, IndexError):
        return False
    return all(is_loopback(str(end)) for end in ends)


async def _connections_answer(stream: trio.SocketStream, endpoint: ConnectionsEndpoint | None
                              ) -> tuple[bytes, str, str]:
    """/connections' body, status and content type."""
    if endpoint is None or endpoint.document is None or endpoint.readers == "off":
        return b"not served here (metrics.connections: off)\n", "404 Not Found", "text/plain"
    if endpoint.readers != "any" and not _from_this_host(stream):
        return (b"/connections names every client: served to loopback clients only "
                b"(metrics.connections: local)\n", "403 Forbidden", "text/plain")
    return await endpoint.document(), "200 OK", "application/json"


async def _http(stream: trio.SocketStream, render: Callable[[], bytes],
                ready: Readiness, connections: ConnectionsEndpoint | None = None) -> None:
    async with stream:
        data = b""
        with trio.move_on_after(5):
            while b"\r\n\r\n" not in data and len(data) < 8192:
                chunk = await stream.receive_some(4096)
                if not chunk:
                    return
                data += chunk
        line = data.split(b"\r\n", 1)[0].decode("latin-1")
        parts = line.split()
        path = parts[1].split("?", 1)[0] if len(parts) >= 2 else ""
        if path == "/metrics":
            body = await trio.to_thread.run_sync(render)
            status, ctype = "200 OK", CONTENT_TYPE_LATEST
        elif path == "/healthz":
            body, status, ctype = b"ok\n", "200 OK", "text/plain"
        elif path == "/readyz":
            answer = ready()
            ok, why = (await answer if not isinstance(answer, bool)
                       else (answer, "no upstream broker reachable"))
            body = b"ready\n" if ok else f"not ready: {why}\n".encode()
            status = "200 OK" if ok else "503 Service Unavailable"
            ctype = "text/plain"
        elif path == "/connections":
            body, status, ctype = await _connections_answer(stream, connections)
        else:
            body, status, ctype = b"not found\n", "404 Not Found", "text/plain"
        head = (f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}"
                f"\r\nConnection: close\r\n\r\n").encode()
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await stream.send_all(head + body)


async def serve_endpoints(listen: Address, render: Callable[[], bytes], ready: Readiness, *,
                          connections: ConnectionsEndpoint | None = None,
                          task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
                          ) -> None:
    """Serve /metrics (``render()``, in a thread: a scrape never stalls the event loop),
    /healthz, /readyz (``ready()``: a bool, or awaitable (ok, why not)) and
    /connections (``connections``); ``task_status`` gets the bound port."""
    try:
        listeners = await trio.open_tcp_listeners(listen.port, host=listen.host)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot serve metrics on {listen}: "
                      f"{exc.strerror or exc}") from exc
    port = listeners[0].socket.getsockname()[1]
    log_event(logger, logging.INFO, "metrics listening", listen=f"{listen.host}:{port}")
    task_status.started(port)

    async def handler(stream: trio.SocketStream) -> None:
        await _http(stream, render, ready, connections)

    await trio.serve_listeners(handler, listeners)


async def serve_metrics(listen: Address, metrics: ProxyMetrics,
                        ready: Callable[[], bool] | None = None, *,
                        connections: ConnectionsEndpoint | None = None,
                        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve /metrics, /healthz, /readyz and /connections; ``task_status`` gets the
    bound port."""
    if ready is not None:
        metrics.ready_check = ready
    await serve_endpoints(listen, partial(generate_latest, metrics.registry),
                          metrics.ready_check, connections=connections,
                          task_status=task_status)
