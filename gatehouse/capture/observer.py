"""One record per request/response exchange, built from what the proxy already decoded.

The record is started when the request arrives (client, API, topics, group), gets the
rules' decisions while the policy runs (``attach``: the policy decides synchronously
right after ``Observer.request``, so its outcomes belong to the record started last),
and is finished by the response (latency, size, error codes, fetched records) or by
the connection's end.  Only names, numbers and error codes go in: never record
payloads, SASL bytes, passwords or tokens (docs/capture.md, schema v1).
"""

from __future__ import annotations

import logging
import random
import secrets
import time
import uuid
from collections.abc import Iterable, Iterator
from functools import partial
from types import ModuleType
from typing import TYPE_CHECKING, Any

from gatehouse.capture.schema import FIELDS, SCHEMA_VERSION, native
from gatehouse.capture.settings import CaptureSettings
from gatehouse.capture.writer import CaptureStats, CaptureWriter
from gatehouse.codecs import APIS, ProtocolError, Request, Response, api_name, produce
from gatehouse.codecs.frames import _UNSET
from gatehouse.codecs.peek import produce_acks
from gatehouse.codecs.schema import FieldSpec, StructSpec
from gatehouse.codecs.walk import rewrite
from gatehouse.metrics import error_codes
from gatehouse.proxy.hooks import (
    FETCHES,
    SCANNED_RESPONSES,
    ConnectionInfo,
    Observer,
    Pending,
    decoded_response,
    scanned_response,
)
from gatehouse.rules import Chain, Outcome, RuleSet, TopicMap
from gatehouse.rules.topicids import is_topic_id_field
from gatehouse.rules.topics import is_every_topic_listing, is_topic_field

if TYPE_CHECKING:
    from gatehouse.capture.kafka_sink import KafkaSink

logger = logging.getLogger("gatehouse.capture")

PRODUCE, FETCH, METADATA, FIND_COORDINATOR, JOIN_GROUP = 0, 1, 3, 10, 11
_PARTITION_ARRAYS = ("partitions", "partition_indexes", "partition_data", "partition_responses")
_PARTITION_ATTRS = ("partition_index", "index", "partition")
_MAX_TOPIC_IDS = 10_000
# The versions of Produce and Fetch the codec reads (``Request.known``), for the C path.
_KNOWN_VERSIONS = tuple(range(APIS[key].versions.lo, APIS[key].versions.hi + 1)
                        for key in (PRODUCE, FETCH))




class CaptureObserver(Observer):
    """Builds exchange records and hands them to a ``CaptureWriter`` (and to a
    ``KafkaSink`` when ``capture.kafka`` is configured: see ``kafka_sink.sink_for``)."""

    reads_scans = True  # a Fetch response's topics, partitions, records and bytes
    counts_request_records = True  # a Produce request's topics and records

    def __init__(self, settings: CaptureSettings, writer: CaptureWriter | None = None,
                 registry: Any = None, kafka: KafkaSink | None = None) -> None:
        self.settings = settings
        self.writer = writer or CaptureWriter(settings)
        self.kafka = kafka
        self.run = secrets.token_hex(4)  # connection ids restart with the process
        self.sampled_out = 0
        self._rates = dict(settings.sample)
        self._rate_default = settings.sample_default
        self._in_flight: dict[int, dict[int, dict[str, Any]]] = {}
        self._current: dict[str, Any] | None = None  # the record the policy is deciding
        self._held: dict[str, Any] | None = None  # no response coming: out after its outcomes
        self._policy: Any = None
        self._maps_of: tuple[RuleSet | None, dict[str, TopicMap]] = (None, {})
        self.topic_names: dict[uuid.UUID, str] = {}
        # The topic ids of Produce requests and Fetch answers read from their bytes, as
        # (id, its text): made once per topic, not per exchange.
        self._id_texts: dict[bytes, tuple[uuid.UUID, str]] = {}
        # Every field of schema v1 (capture.schema.FIELDS), in order, with what a record
        # holds until the request and its answer say otherwise.
        self._blank: dict[str, Any] = {name: None for name, _ in FIELDS}
        self._blank.update(v=SCHEMA_VERSION, proxy=settings.instance, run=self.run,
                           error_count=0)
        if registry is not None:
            registry.register(CaptureCollector(self))
        if native is not None:  # the usual exchange's record built in C (schema.py)
            self._build_in_c(native)

    def _build_in_c(self, native: ModuleType) -> None:
        """``request`` and ``response`` as the C functions over this object's state,
        which call the Python methods for whatever they do not take."""
        cls = type(self)
        offers = (self.writer.offer,) + ((self.kafka.offer,) if self.kafka is not None else ())
        self.request = partial(  # type: ignore[method-assign]
            native.request,
            (self, self._in_flight, self._blank, self._rates, self._rate_default,
             (api_name(PRODUCE), api_name(FETCH)), _KNOWN_VERSIONS, _UNSET,
             produce.request_topics_of, produce_acks, self._id_texts, self.topic_names,
             self._named_id, cls.request.__get__(self, cls)))
        self.response = partial(  # type: ignore[method-assign]
            native.response,
            (self, self._in_flight, scanned_response, self._id_texts, self.topic_names,
             self._named_id, offers, cls.response.__get__(self, cls)))

    # -- wiring ------------------------------------------------------------------------

    def attach(self, policy: Any) -> None:
        """Record the rules' decisions (a ``RulesPolicy``'s ``outcome_listeners``)."""
        if hasattr(policy, "outcome_listeners"):
            self._policy = policy
            policy.outcome_listeners.append(self._outcome)

    def close(self, timeout: float | None = 30.0) -> bool:
        """Write every record still held or in flight, then close the writer."""
        self._flush_held()
        for conn_id in list(self._in_flight):
            self._finish_connection(conn_id)
        if self.kafka is None:
            return self.writer.close(timeout)
        self.kafka.stop()  # both sinks finish at once
        written = self.writer.close(timeout)
        produced = self.kafka.close(timeout)
        return written and produced

    def statistics(self) -> CaptureStats:
        stats = self.writer.statistics()
        stats.sampled_out = self.sampled_out
        return stats

    def _outcome(self, outcome: Outcome) -> None:
        record = self._current
        if record is None:
            return
        record["rules"].append({"rule": outcome.rule, "action": outcome.action,
                                "effect": outcome.effect, "mode": outcome.mode})
        if outcome.effect == "rewrite" and outcome.mode == "enforce":
            topic_map = self._topic_map(outcome.rule)
            if topic_map is not None:
                record.setdefault("_maps", []).append(topic_map)

    def _topic_map(self, rule_name: str) -> TopicMap | None:
        ruleset = getattr(self._policy, "ruleset", None)
        if self._maps_of[0] is not ruleset:
            maps = {r.name: r.topic_map for r in (ruleset.rules if ruleset else ())
                    if r.topic_map is not None}
            self._maps_of = (ruleset, maps)
        return self._maps_of[1].get(rule_name)

    # -- observer ----------------------------------------------------------------------

    def request(self, conn: ConnectionInfo, req: Request, size: int) -> None:
        self._flush_held()
        self._current = None
        key = req.api_key
        rate = self._rates.get(key, self._rate_default)
        if rate < 1.0 and random.random() >= rate:
            self.sampled_out += 1
            return
        header = req.header
        # A copy of the fields every record shares, then this one's: half the time of
        # building all 27 (this runs on the event loop for every request).
        record = self._blank.copy()
        record["time"] = time.time()
        record["conn"] = conn.id
        record["client"] = conn.client
        record["listener"] = conn.listener
        record["client_id"] = header.client_id
        record["software_name"] = conn.software_name
        record["software_version"] = conn.software_version
        record["principal"] = conn.principal
        record["api"] = api_name(key)
        record["api_key"] = key
        record["api_version"] = header.api_version
        record["correlation_id"] = header.correlation_id
        record["request_bytes"] = size
        record["errors"] = []
        record["topics"] = []
        record["rules"] = []
        record["sample"] = rate
        no_response = False
        counted = (produce.request_topics_of(req)
                   if key == PRODUCE and req.known and not req.body_decoded else None)
        if counted is not None:  # read from the bytes: no decode of every record set
            record["topics"] = self._counted_topics(counted)
            no_response = produce_acks(req) == 0
        elif req.known and key != FETCH:  # Fetch: the response says what moved (no group)
            try:
                body = req.body
                record["topics"] = self._request_topics(req, body)
                self._group(record, key, body)
                no_response = key == PRODUCE and produce_acks(req) == 0
            except ProtocolError:
                pass  # the pumps report malformed frames; the record keeps the header
        self._current = record
        if no_response:
            record["outcome"] = "no_response"
            self._held = record
        else:
            self._in_flight.setdefault(conn.id, {})[header.correlation_id] = record

    def response(self, conn: ConnectionInfo, pending: Pending, size: int, elapsed: float,
                 frame: Any = None) -> None:
        self._flush_held()
        self._current = None
        waiting = self._in_flight.get(conn.id)
        record = waiting.pop(pending.correlation_id, None) if waiting else None
        if record is None:
            return
        record["response_bytes"] = size
        record["latency_ms"] = round(elapsed * 1000.0, 3)
        record["outcome"] = ("answered" if pending.local is None
                             else "by_proxy" if pending.by_proxy else "refused")
        key = pending.api_key
        scan = None
        if key in SCANNED_RESPONSES and pending.decoded is None:
            scan = scanned_response(pending, frame)  # with no frame: counted on the way
        if scan is not None:  # read from the bytes (the proxy did not decode it)
            codes = scan[0]
            errors = [code for code in codes if code]
            if errors:
                record["errors"] = sorted(errors)
                record["error_count"] = sum(codes[code] for code in errors)
            if key == FETCH:
                record["topics"] = self._counted_topics(scan[2])
        elif frame is not None and key in APIS:
            try:
                resp = decoded_response(pending, frame)
                if resp.known:
                    self._response_facts(record, resp)
            except ProtocolError:
                pass
        self._emit(record)

    def connection_closed(self, conn: ConnectionInfo, reason: str) -> None:
        self._flush_held()
        self._current = None
        self._finish_connection(conn.id)

    # -- records -----------------------------------------------------------------------

    def _finish_connection(self, conn_id: int) -> None:
        for record in (self._in_flight.pop(conn_id, None) or {}).values():
            record["outcome"] = "unanswered"
            self._emit(record)

    def _flush_held(self) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._emit(held)

    def _emit(self, record: dict[str, Any]) -> None:
        maps = record.pop("_maps", None)
        topic_map: TopicMap | None = None
        if maps:
            topic_map = maps[0] if len(maps) == 1 else Chain(tuple(maps))
        for topic in record["topics"]:
            name = topic["name"]
            topic["broker"] = topic_map.to_broker(name) if topic_map and name else name
        self.writer.offer(record)
        if self.kafka is not None:
            self.kafka.offer(record)

    def _topic_name(self, topic_id: Any) -> str | None:
        return self.topic_names.get(topic_id)

    def _request_topics(self, req: Request, body: Any) -> list[dict[str, Any]]:
        topics: list[dict[str, Any]] = []
        if req.api_key == PRODUCE:
            return [self._records_entry(getattr(topic, "name", None),
                                        getattr(topic, "topic_id", None),
                                        [p.index for p in topic.partition_data],
                                        topic.partition_data)
                    for topic in body.topic_data]
        if is_every_topic_listing(req):
            return topics  # its cursor is a place to start at (sealed under a filter)
        for name, topic_id, partitions in _walk_topics(req.api.request, req.api_version, body):
            entry = self._entry(name, topic_id)
            entry["partitions"] = partitions
            topics.append(entry)
        return topics

    def _counted_topics(self, counted: produce.TopicCounts) -> list[dict[str, Any]]:
        """The topics of a Produce request or Fetch response read from its bytes."""
        out = []
        for topic, indexes, records_total, bytes_total in counted:
            if isinstance(topic, str):
                name, id_text = topic or None, None
            else:
                name, id_text = self._named_id(topic)
            out.append({"name": name, "broker": None, "id": id_text, "partitions": indexes,
                        "records": records_total, "bytes": bytes_total})
        return out

    def _named_id(self, raw: bytes) -> tuple[str | None, str | None]:
        """(name, id text) of a topic id's 16 bytes; (None, None) for the zero id."""
        known = self._id_texts.get(raw)
        if known is None:
            topic_id = uuid.UUID(bytes=bytes(raw))
            if not topic_id.int:
                return None, None
            if len(self._id_texts) >= _MAX_TOPIC_IDS:
                self._id_texts.clear()  # bounded, like topic_names
            known = self._id_texts[bytes(raw)] = (topic_id, str(topic_id))
        return self.topic_names.get(known[0]), known[1]

    def _records_entry(self, name: str | None, topic_id: Any, indexes: list[int],
                       partitions: Iterable[Any]) -> dict[str, Any]:
        """A topic of a decoded Produce request or Fetch response, with record counts and
        bytes from its batch headers (no decompression)."""
        return self._topic_entry(name, topic_id, indexes, *produce.partitions_total(partitions))

    def _topic_entry(self, name: str | None, topic_id: Any, partitions: list[int],
                     records_total: int, bytes_total: int) -> dict[str, Any]:
        entry = self._entry(name, topic_id)
        entry["partitions"] = partitions
        entry["records"] = records_total
        entry["bytes"] = bytes_total
        return entry

    def _entry(self, name: str | None, topic_id: Any) -> dict[str, Any]:
        id_text = None
        if isinstance(topic_id, uuid.UUID) and topic_id.int:
            id_text = str(topic_id)
            if not name:
                name = self._topic_name(topic_id)
        return {"name": name or None, "broker": None, "id": id_text, "partitions": [],
                "records": None, "bytes": None}

    def _group(self, record: dict[str, Any], key: int, body: Any) -> None:
        group = getattr(body, "group_id", None)
        if key == FIND_COORDINATOR and not getattr(body, "key_type", 0):
            keys = getattr(body, "coordinator_keys", None)
            group = getattr(body, "key", None) or (keys[0] if keys and len(keys) == 1 else None)
        if group:
            record["group_id"] = group
        protocol_type = getattr(body, "protocol_type", None)
        if protocol_type:
            record["protocol_type"] = protocol_type
        protocol_name = getattr(body, "protocol_name", None)
        if protocol_name:
            record["protocol_name"] = protocol_name
        elif key == JOIN_GROUP:
            names = [p.name for p in getattr(body, "protocols", ())]
            if len(names) == 1:
                record["protocol_name"] = names[0]

    def _response_facts(self, record: dict[str, Any], resp: Response) -> None:
        codes = [c for c in error_codes(resp) if c]
        if codes:
            record["errors"] = sorted(set(codes))
            record["error_count"] = len(codes)
        key = resp.api_key
        body = resp.body
        if key in FETCHES:  # what moved, a share consumer's too
            record["topics"] = [
                self._records_entry(getattr(topic, "topic", None),
                                    getattr(topic, "topic_id", None),
                                    [p.partition_index for p in topic.partitions],
                                    topic.partitions)
                for topic in body.responses]
        elif key == METADATA:
            self._learn_topic_ids(body)
        elif key == JOIN_GROUP:
            protocol_name = getattr(body, "protocol_name", None)
            if protocol_name:
                record["protocol_name"] = protocol_name
            protocol_type = getattr(body, "protocol_type", None)
            if protocol_type:
                record["protocol_type"] = protocol_type

    def _learn_topic_ids(self, body: Any) -> None:
        for topic in body.topics:
            topic_id = getattr(topic, "topic_id", None)
            if topic_id is not None and topic.name and topic_id.int:
                if len(self.topic_names) >= _MAX_TOPIC_IDS and topic_id not in self.topic_names:
                    self.topic_names.clear()  # bounded: relearned from the next Metadata
                self.topic_names[topic_id] = topic.name


def _is_topic_field(f: FieldSpec) -> bool:
    return is_topic_field(f) or is_topic_id_field(f)


def _walk_topics(message: Any, version: int, body: Any
                 ) -> Iterator[tuple[str | None, Any, list[int]]]:
    """(name, topic id, partitions) for every place a request names a topic."""
    found: list[tuple[str | None, Any, list[int]]] = []

    def visit(struct: StructSpec, record: Any) -> Any:
        name: str | None = None
        topic_id: Any = None
        for f in struct.fields:
            if not _is_topic_field(f) or version not in f.versions:
                continue
            value = getattr(record, f.attr, None)
            if value is None:
                continue
            if f.is_array:
                found.extend((str(v), None, []) for v in value if v)
            elif f.type == "uuid":
                topic_id = value
            else:
                name = value
        if name or (topic_id is not None and topic_id.int):
            found.append((name, topic_id, _partitions(record)))
        return record

    rewrite(message, version, body, _is_topic_field, visit)
    return iter(found)


def _partitions(record: Any) -> list[int]:
    for attr in _PARTITION_ARRAYS:
        value = getattr(record, attr, None)
        if not value:
            continue
        out = []
        for item in value:
            if isinstance(item, int):
                out.append(item)
                continue
            for name in _PARTITION_ATTRS:
                index = getattr(item, name, None)
                if isinstance(index, int):
                    out.append(index)
                    break
        return out
    return []


class CaptureCollector:
    """The capture's counters in the proxy's Prometheus registry (read at scrape time)."""

    def __init__(self, observer: CaptureObserver) -> None:
        self.observer = observer

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self.observer.statistics()
        family = CounterMetricFamily("gatehouse_capture_records", "Exchanges by what became "
                                     "of their capture record", labels=["outcome"])
        family.add_metric(["written"], stats.written)
        family.add_metric(["dropped"], stats.dropped)
        family.add_metric(["write_error"], stats.write_errors)
        family.add_metric(["sampled_out"], stats.sampled_out)
        yield family
        yield CounterMetricFamily("gatehouse_capture_bytes_written", "Bytes of capture "
                                  "files written (JSON Lines before gzip; Parquet as "
                                  "written)", value=stats.bytes_written)
        yield CounterMetricFamily("gatehouse_capture_files_deleted", "Capture files deleted "
                                  "to keep to the disk budget", value=stats.files_deleted)
        yield GaugeMetricFamily("gatehouse_capture_queue_depth", "Records waiting for the "
                                "disk", value=stats.queue_depth)
        if self.observer.kafka is not None:
            yield from self.observer.kafka.metric_families()
