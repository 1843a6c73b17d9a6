"""The clients' own metrics (KIP-714), received by the proxy and exported on /metrics.

Kafka clients (the Java clients from 3.7, librdkafka from 2.5) push their metrics to a
broker that asks for them: GetTelemetrySubscriptions says which metrics and how often,
PushTelemetry carries them (OTLP, maybe compressed).  A broker asks only when a plugin
receives them (a ``ClientTelemetry`` metrics reporter), which few clusters have.  With
``metrics.client_telemetry`` the proxy is that receiver for every client it serves, with
no broker change: it offers the two APIs in ApiVersions answers (``ADDED_APIS``), answers
them itself (``ClientTelemetry.answer``: they never reach a broker), and exports what the
clients push as ``kafka_client_*`` metrics labelled with who pushed them, as the proxy
knows the connection (client id, KIP-511 software, principal), not as the client says.
In front of brokers that have a receiver of their own, ``mode: observe`` leaves the two
APIs to them and reads each push on its way (``answer`` returns None: it goes on).

Bounded: at most ``max_series`` samples over all clients (the rest dropped and counted),
``max_bytes`` per push (compressed and decompressed), label values cut at
``_MAX_LABEL_VALUE`` characters, and a client instance's samples forgotten three push
intervals after its last push (one interval after a terminating push).  Scrapes read
from another thread: each instance's samples are replaced whole, never changed in place.
"""

from __future__ import annotations

import math
import re
import time
import uuid
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from gatehouse import compression
from gatehouse.codecs import API_KEYS_BY_NAME, ProtocolError, Request, Response, api
from gatehouse.codecs.otlp import ResourceMetrics, decode_metrics_data

GET_TELEMETRY_SUBSCRIPTIONS: Final = API_KEYS_BY_NAME["GetTelemetrySubscriptions"]
PUSH_TELEMETRY: Final = API_KEYS_BY_NAME["PushTelemetry"]
# What the proxy answers itself, offered in ApiVersions answers: (key, min, max).
ADDED_APIS: Final = ((GET_TELEMETRY_SUBSCRIPTIONS, 0, 0), (PUSH_TELEMETRY, 0, 0))

NONE: Final = 0
INVALID_REQUEST: Final = 42
UNSUPPORTED_COMPRESSION_TYPE: Final = 76
INVALID_RECORD: Final = 87
THROTTLING_QUOTA_EXCEEDED: Final = 89
UNKNOWN_SUBSCRIPTION_ID: Final = 117
TELEMETRY_TOO_LARGE: Final = 118

# Kafka's compression type ids; offered in this order of preference.
_CODECS: Final = {4: "zstd", 3: "lz4", 1: "gzip", 2: "snappy"}
_NO_COMPRESSION: Final = 0
_ZERO_ID: Final = uuid.UUID(int=0)
_KAFKA_PREFIX: Final = "org.apache.kafka."
METRIC_PREFIX: Final = "kafka_client_"
_MAX_LABEL_VALUE: Final = 200
READ_IN_THREAD: Final = 64 * 1024  # a push's bytes from which it is read in a thread
_LAST_PUSH: Final = "client_telemetry.last_push"  # in a connection's state
_PURGE_EVERY: Final = 1.0  # seconds between sweeps for forgotten client instances
# Labels the proxy sets from the connection (label, ConnectionInfo attribute), after the
# client instance id; a client's attribute of the same name loses.
_CONNECTION_LABELS: Final = (("client_id", "client_id"),
                             ("client_software_name", "software_name"),
                             ("client_software_version", "software_version"),
                             ("principal", "principal"))
IDENTITY_LABELS: Final = ("client_instance_id", *(label for label, _ in _CONNECTION_LABELS))
_NOT_NAME: Final = re.compile(r"[^a-zA-Z0-9_]")

_OUTCOMES: Final = {NONE: "accepted", INVALID_REQUEST: "invalid_request",
                    UNSUPPORTED_COMPRESSION_TYPE: "unsupported_compression",
                    INVALID_RECORD: "invalid_metrics", THROTTLING_QUOTA_EXCEEDED: "throttled",
                    UNKNOWN_SUBSCRIPTION_ID: "unknown_subscription",
                    TELEMETRY_TOO_LARGE: "too_large"}


# A push's metrics as read, or the error code that refuses them.
Metrics = tuple[ResourceMetrics, ...] | int


@dataclass(frozen=True)
class TelemetrySettings:
    """``metrics.client_telemetry``: which metrics clients are asked for (name prefixes,
    KIP-714's subscription; ``("",)``: all), how often (seconds), the largest push
    (bytes), the most samples kept over all clients, and who receives the pushes."""

    metrics: tuple[str, ...] = ("",)
    push_interval: float = 30.0
    max_bytes: int = 1024 * 1024
    max_series: int = 10_000
    # "receive": the proxy is the clients' receiver (it offers and answers the two APIs);
    # "observe": the brokers are (a plugin of theirs), and the proxy reads the pushes on
    # their way to them (``metrics`` then only filters what it keeps).
    mode: str = "receive"

    @property
    def receives(self) -> bool:
        """Whether the proxy is the receiver (else it observes the brokers')."""
        return self.mode == "receive"

    @property
    def subscription_id(self) -> int:
        """The same for the same settings, in every worker and after a restart: a client
        whose push names another has an old subscription and must ask again."""
        text = "\n".join((*self.metrics, str(self.push_interval), str(self.max_bytes)))
        return zlib.crc32(text.encode()) & 0x7FFFFFFF


def prometheus_name(metric: str) -> str:
    """``org.apache.kafka.producer.record.queue.time.avg`` ->
    ``kafka_client_producer_record_queue_time_avg``: under the proxy's own prefix, so a
    client can never pose as one of the proxy's metrics."""
    if metric.startswith(_KAFKA_PREFIX):
        metric = metric[len(_KAFKA_PREFIX):]
    return METRIC_PREFIX + _NOT_NAME.sub("_", metric)


def label_name(key: str) -> str:
    name = _NOT_NAME.sub("_", key)
    return f"_{name}" if name[:1].isdigit() or not name else name


@dataclass(frozen=True, slots=True)
class Sample:
    family: str  # the Prometheus name
    counter: bool  # a monotonic sum
    labels: tuple[tuple[str, str], ...]
    value: float


@dataclass
class _Instance:
    """One client instance (its KIP-714 id): what it pushed last, and until when it is
    kept."""

    last_push: float
    expires: float
    samples: tuple[Sample, ...] = ()


@dataclass
class _Counts:
    pushes: dict[str, int] = field(default_factory=dict)
    dropped_samples: int = 0


class ClientTelemetry:
    """The proxy as the clients' telemetry receiver: ``answer`` a GetTelemetrySubscriptions
    or PushTelemetry request, ``collect`` what was pushed (a Prometheus collector)."""

    def __init__(self, settings: TelemetrySettings,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.subscription_id = settings.subscription_id
        self.clock = clock
        self.instances: dict[uuid.UUID, _Instance] = {}
        self.kept_samples = 0  # over all instances: at most settings.max_series
        self.counts = _Counts()
        self._next_purge = 0.0
        self.receives = settings.receives
        # What the connections hand over (``answer``), and offer to their clients.
        self.intercepts = frozenset((GET_TELEMETRY_SUBSCRIPTIONS, PUSH_TELEMETRY)
                                    if self.receives else (PUSH_TELEMETRY,))
        self.added_apis = ADDED_APIS if self.receives else ()
        # Observing: the brokers' answers to GetTelemetrySubscriptions, which say how
        # often each client instance pushes (``subscribed``), and what they taught:
        # instance -> seconds between its pushes (the oldest forgotten past the bound).
        self.reads_answers = (frozenset() if self.receives
                              else frozenset((GET_TELEMETRY_SUBSCRIPTIONS,)))
        self.intervals: dict[uuid.UUID, float] = {}

    # -- the two requests ------------------------------------------------------------

    def answer(self, req: Request, conn: Any, read: Metrics | None = None
               ) -> Response | None:
        """The answer to a GetTelemetrySubscriptions or PushTelemetry request of a
        connection (a ``proxy.hooks.ConnectionInfo``: who pushes, as the proxy knows);
        ``read``: what ``offload``'s work found in the push.  Observing, a push is read
        and None returned: it goes on to the broker, which answers it."""
        now = self.clock()
        self._purge(now)
        if req.api_key == GET_TELEMETRY_SUBSCRIPTIONS and self.receives:
            return self._subscription(req)
        if req.api_key != PUSH_TELEMETRY:
            raise ValueError(f"not a telemetry request the proxy takes: API key "
                             f"{req.api_key}")
        code = self._push(req, conn, now, read) if self.receives else self._observe(
            req, conn, now, read)
        outcome = "observed" if code == NONE and not self.receives else _OUTCOMES[code]
        self.counts.pushes[outcome] = self.counts.pushes.get(outcome, 0) + 1
        if not self.receives:
            return None
        body = api(PUSH_TELEMETRY).response.root.cls(error_code=code)
        return Response.build(PUSH_TELEMETRY, req.api_version, req.correlation_id, body)

    def subscribed(self, resp: Response) -> None:
        """Observing: a broker's answer to a client's GetTelemetrySubscriptions, read for
        the interval it gives that client instance, so its series outlive the gaps
        between its pushes whatever the brokers' subscription says."""
        body = resp.body
        instance_id = body.client_instance_id
        if body.error_code != NONE or instance_id == _ZERO_ID or body.push_interval_ms <= 0:
            return
        self.intervals.pop(instance_id, None)  # re-inserted: the newest, last forgotten
        self.intervals[instance_id] = body.push_interval_ms / 1000
        while len(self.intervals) > self.settings.max_series:
            del self.intervals[next(iter(self.intervals))]
        known = self.instances.get(instance_id)
        if known is not None:  # pushes from now on come at the new interval
            self.instances[instance_id] = replace(
                known, expires=known.last_push + 3 * self.intervals[instance_id])

    def _subscription(self, req: Request) -> Response:
        instance_id = req.body.client_instance_id
        if instance_id == _ZERO_ID:
            instance_id = uuid.uuid4()
        s = self.settings
        body = api(GET_TELEMETRY_SUBSCRIPTIONS).response.root.cls(
            client_instance_id=instance_id,
            subscription_id=self.subscription_id,
            accepted_compression_types=tuple(_CODECS),
            push_interval_ms=round(s.push_interval * 1000),
            telemetry_max_bytes=s.max_bytes,
            delta_temporality=False,  # cumulative: Prometheus counters as they are
            requested_metrics=s.metrics,
        )
        return Response.build(GET_TELEMETRY_SUBSCRIPTIONS, req.api_version,
                              req.correlation_id, body)

    def offload(self, req: Request, conn: Any) -> Callable[[], Metrics] | None:
        """For a push of more than ``READ_IN_THREAD`` bytes that the cheap checks let
        through: the reading of its metrics (decompressed, decoded: pure, no state of
        the receiver's), for the caller to run in a thread and give to ``answer``, so a
        large push does not hold the event loop.  None: ``answer`` reads it itself."""
        size = len(req.body.metrics or b"") if req.api_key == PUSH_TELEMETRY else 0
        if size < READ_IN_THREAD:
            return None
        refused = (self._refusal(req, conn, self.clock()) is not None if self.receives
                   else size > self.settings.max_bytes)
        return None if refused else partial(self._read, req.body)

    def _refusal(self, req: Request, conn: Any, now: float) -> int | None:
        """What the push is refused with before its metrics are read; None: nothing."""
        body = req.body
        s = self.settings
        instance_id = body.client_instance_id
        if instance_id == _ZERO_ID:
            return INVALID_REQUEST
        if body.subscription_id != self.subscription_id:
            return UNKNOWN_SUBSCRIPTION_ID
        if len(body.metrics or b"") > s.max_bytes:
            return TELEMETRY_TOO_LARGE
        known = self.instances.get(instance_id)
        # As a broker: not more often than asked, by the client instance, and (so that
        # made-up instance ids do not make a connection's pushes free) by the connection.
        last = max(known.last_push if known is not None else -math.inf,
                   conn.state.get(_LAST_PUSH, -math.inf))
        if not body.terminating and now - last < s.push_interval / 2:
            return THROTTLING_QUOTA_EXCEEDED
        return None

    def _read(self, body: Any) -> Metrics:
        """A push's metrics, or the error code that refuses them."""
        data = body.metrics or b""
        codec = body.compression_type
        if codec != _NO_COMPRESSION:
            name = _CODECS.get(codec)
            if name is None:
                return UNSUPPORTED_COMPRESSION_TYPE
            try:
                data = compression.decompress(name, data, self.settings.max_bytes)
            except compression.DecompressionLimit:
                return TELEMETRY_TOO_LARGE
            except compression.DecompressionError:
                return INVALID_RECORD
        try:
            return decode_metrics_data(data)
        except ProtocolError:
            return INVALID_RECORD

    def _push(self, req: Request, conn: Any, now: float, read: Metrics | None) -> int:
        refusal = self._refusal(req, conn, now)
        if refusal is not None:
            return refusal
        body = req.body
        resources = read if read is not None else self._read(body)
        if isinstance(resources, int):
            return resources
        conn.state[_LAST_PUSH] = now
        self._keep(body, conn, now, resources)
        return NONE

    def _observe(self, req: Request, conn: Any, now: float, read: Metrics | None) -> int:
        """A push on its way to the broker's receiver, read (what the broker answers is
        its own business); the code says why it was not."""
        body = req.body
        if len(body.metrics or b"") > self.settings.max_bytes:
            return TELEMETRY_TOO_LARGE
        resources = read if read is not None else self._read(body)
        if isinstance(resources, int):
            return resources
        self._keep(body, conn, now, resources)
        return NONE

    def _keep(self, body: Any, conn: Any, now: float,
              resources: Sequence[ResourceMetrics]) -> None:
        """A client instance's samples are now what it pushed."""
        s = self.settings
        instance_id = body.client_instance_id
        labels = (("client_instance_id", str(instance_id)),
                  *((key, value[:_MAX_LABEL_VALUE]) for key, value in identity_of(conn)
                    if value))
        # A client pushes at the interval its subscription gives: the broker's, when the
        # proxy observes (as its answer said; the setting stands in for one not seen).
        interval = self.intervals.get(instance_id, s.push_interval)
        keep_for = interval * (1 if body.terminating else 3)
        known = self.instances.get(instance_id)
        if known is not None:
            self.kept_samples -= len(known.samples)
        samples = self._samples(resources, labels, s.max_series - self.kept_samples,
                                known.samples if known is not None else ())
        self.kept_samples += len(samples)
        self.instances[instance_id] = _Instance(now, now + keep_for, samples)

    def _samples(self, resources: Sequence[ResourceMetrics],
                 identity: tuple[tuple[str, str], ...], room: int,
                 before: Sequence[Sample]) -> tuple[Sample, ...]:
        """The samples of a push, at most ``room`` of them; a delta sum's value is added to
        the one it had ``before`` (a counter stays a counter, as Prometheus wants)."""
        previous = {(b.family, tuple(sorted(b.labels))): b.value for b in before}
        taken = set(IDENTITY_LABELS)  # also those this connection has no value for
        wanted = self.settings.metrics
        # One sample per name and labels (the last sent): a series twice over in one
        # exposition is one Prometheus refuses.
        samples: dict[tuple[str, tuple[tuple[str, str], ...]], Sample] = {}
        for resource in resources:
            base = [*identity, *_labels(resource.attributes, taken)]
            own = taken | {key for key, _ in base}
            for point in resource.points:
                if not point.name.startswith(wanted):
                    continue  # not asked for: a client's error, not kept
                name = prometheus_name(point.name)
                labels = (*base, *_labels(point.attributes, own))
                key = (name, tuple(sorted(labels)))
                if key not in samples and len(samples) >= room:
                    self.counts.dropped_samples += 1
                    continue
                counter = point.kind == "sum" and point.monotonic
                value = point.value
                if point.temporality == "delta":
                    value += samples[key].value if key in samples else previous.get(key, 0.0)
                samples[key] = Sample(name, counter, labels, value)
        return tuple(samples.values())

    def _purge(self, now: float) -> None:
        if now < self._next_purge:
            return
        self._next_purge = now + _PURGE_EVERY
        gone = [key for key, instance in self.instances.items() if instance.expires <= now]
        for key in gone:
            self.kept_samples -= len(self.instances.pop(key).samples)
            self.intervals.pop(key, None)

    # -- the collector (a scrape's thread) ---------------------------------------------

    def collect(self) -> Iterator[Metric]:
        now = self.clock()
        families: dict[str, Metric] = {}
        # Every name a family's samples take (a counter's ``x`` and ``x_total``): a
        # client's gauge named as another's counter total would make the exposition
        # one Prometheus refuses, so the first family to take a name keeps it.
        names: dict[str, Metric] = {}
        live = 0
        for instance in list(self.instances.values()):
            if instance.expires <= now:
                continue
            live += 1
            for sample in instance.samples:
                family = families.get(sample.family)
                if family is None:
                    family = _family(sample)
                    taken = {family.name, f"{family.name}_total"} if sample.counter else {
                        family.name}
                    if any(name in names for name in taken):
                        continue
                    families[sample.family] = family
                    names.update(dict.fromkeys(taken, family))
                elif (family.type == "counter") != sample.counter:
                    continue  # the same name as a counter and a gauge: the first kept
                name = family.name + "_total" if sample.counter else family.name
                family.add_sample(name, dict(sample.labels), sample.value)
        yield from families.values()
        pushes = CounterMetricFamily(
            "gatehouse_client_telemetry_pushes", "Clients' telemetry pushes (KIP-714) the "
            "proxy answered, by outcome", labels=["outcome"])
        for outcome, count in list(self.counts.pushes.items()):
            pushes.add_metric([outcome], count)
        yield pushes
        instances = GaugeMetricFamily("gatehouse_client_telemetry_instances",
                                      "Client instances whose pushed metrics are exported")
        instances.add_metric([], live)
        yield instances
        dropped = CounterMetricFamily(
            "gatehouse_client_telemetry_dropped_samples", "Pushed samples not exported: "
            "metrics.client_telemetry.max_series was reached")
        dropped.add_metric([], self.counts.dropped_samples)
        yield dropped


def _family(sample: Sample) -> Metric:
    help_text = "A client's own metric (KIP-714), as it pushed it"
    if sample.counter:
        return CounterMetricFamily(sample.family, help_text)
    return GaugeMetricFamily(sample.family, help_text)


def _labels(pairs: Sequence[tuple[str, str]], taken: set[str]) -> list[tuple[str, str]]:
    """A client's attributes as labels: names made valid, values cut, none that would
    replace one already set (the proxy's identity labels above all)."""
    out = []
    seen = set(taken)
    for key, value in pairs:
        name = label_name(key)
        if name in seen or name.startswith("__"):
            continue
        seen.add(name)
        out.append((name, value[:_MAX_LABEL_VALUE]))
    return out


def identity_of(conn: Any) -> tuple[tuple[str, str | None], ...]:
    """The identity labels of a connection (a ``proxy.hooks.ConnectionInfo``)."""
    return tuple((label, getattr(conn, attr)) for label, attr in _CONNECTION_LABELS)
