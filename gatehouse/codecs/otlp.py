"""The metrics a client pushes (KIP-714 PushTelemetry): OpenTelemetry MetricsData, read.

A PushTelemetry request's ``Metrics`` bytes are an OTLP ``MetricsData`` protobuf message
(after decompression).  Kafka clients send sums and gauges, each data point with
attributes (``node_id``, ``topic``...) under a resource whose attributes name the client.
This reads exactly that much, from the wire format, with no protobuf library:

- ``MetricsData.resource_metrics`` (1) -> ``ResourceMetrics``: ``resource`` (1, its
  ``attributes`` 1) and ``scope_metrics`` (2) -> ``ScopeMetrics.metrics`` (2) -> ``Metric``:
  ``name`` (1), ``gauge`` (5) or ``sum`` (7: ``data_points`` 1, ``aggregation_temporality``
  2, ``is_monotonic`` 3) -> ``NumberDataPoint``: ``as_double`` (4), ``as_int`` (6),
  ``attributes`` (7), ``time_unix_nano`` (3).
- Attributes are ``KeyValue`` (``key`` 1, ``value`` 2: ``AnyValue`` with ``string_value``
  1, ``bool_value`` 2, ``int_value`` 3, ``double_value`` 4); arrays, maps and bytes values
  have no single label value and are left out.
- Histograms, exponential histograms and summaries are counted in ``skipped``, not read.

Unknown fields are skipped as protobuf says, so newer OTLP versions still read.  Bytes that
are not a protobuf message of this shape raise ``RemoteProtocolError`` (the client's).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final, Literal

from gatehouse.codecs.errors import RemoteProtocolError
from gatehouse.codecs.primitives import read_uvarlong

_DOUBLE: Final = struct.Struct("<d")
_INT64: Final = struct.Struct("<q")
_UINT64: Final = struct.Struct("<Q")

_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5
_TEMPORALITY: Final = {1: "delta", 2: "cumulative"}

Kind = Literal["gauge", "sum"]


@dataclass(frozen=True, slots=True)
class DataPoint:
    """One value of one metric: ``name`` as the client names it, ``kind`` gauge or sum
    (``monotonic`` sums are counters; ``temporality`` delta or cumulative, None for a
    gauge), and its attributes as (key, value) text pairs in the order sent."""

    name: str
    kind: Kind
    value: float
    attributes: tuple[tuple[str, str], ...] = ()
    monotonic: bool = False
    temporality: str | None = None
    time_unix_nano: int = 0


@dataclass(frozen=True, slots=True)
class ResourceMetrics:
    """The data points of one resource (the client instance) and its attributes."""

    attributes: tuple[tuple[str, str], ...]
    points: tuple[DataPoint, ...]
    skipped: int = 0  # metrics of a kind not read (histograms, summaries)


def decode_metrics_data(data: bytes | memoryview) -> tuple[ResourceMetrics, ...]:
    """The resources and data points of an OTLP ``MetricsData`` message."""
    view = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
    try:
        return tuple(_resource_metrics(view[start:end])
                     for number, wire, start, end in _fields(view) if number == 1
                     and _is_message(wire, "MetricsData.resource_metrics"))
    except (IndexError, struct.error, UnicodeDecodeError) as exc:
        raise RemoteProtocolError(f"telemetry metrics do not read as OTLP MetricsData: "
                                  f"{exc}") from None


def _is_message(wire: int, what: str) -> bool:
    if wire != _LENGTH:
        raise RemoteProtocolError(f"telemetry metrics: {what} is not a message "
                                  f"(wire type {wire})")
    return True


def _fields(view: memoryview) -> list[tuple[int, int, int, int]]:
    """Each field of a message: (number, wire type, start, end); a varint's value is its
    ``start`` (and ``end`` is 0), other fields' bytes are ``view[start:end]``."""
    fields = []
    pos = 0
    end_of_message = len(view)
    while pos < end_of_message:
        key, pos = read_uvarlong(view, pos)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise RemoteProtocolError("telemetry metrics: a field numbered 0")
        if wire == _VARINT:
            value, pos = read_uvarlong(view, pos)
            fields.append((number, wire, value, 0))
            continue
        if wire == _FIXED64:
            size = 8
        elif wire == _FIXED32:
            size = 4
        elif wire == _LENGTH:
            size, pos = read_uvarlong(view, pos)
        else:
            raise RemoteProtocolError(f"telemetry metrics: wire type {wire} "
                                      f"(field {number}) is not one protobuf has")
        if pos + size > end_of_message:
            raise RemoteProtocolError(f"telemetry metrics: field {number} runs past the "
                                      "end of its message")
        fields.append((number, wire, pos, pos + size))
        pos += size
    return fields


def _text(view: memoryview, start: int, end: int) -> str:
    return bytes(view[start:end]).decode("utf-8")


def _resource_metrics(view: memoryview) -> ResourceMetrics:
    attributes: tuple[tuple[str, str], ...] = ()
    points: list[DataPoint] = []
    skipped = 0
    for number, wire, start, end in _fields(view):
        if number == 1 and _is_message(wire, "ResourceMetrics.resource"):
            attributes = _attributes(view[start:end], 1)
        elif number == 2 and _is_message(wire, "ResourceMetrics.scope_metrics"):
            for inner, inner_wire, s, e in _fields(view[start:end]):
                if inner == 2 and _is_message(inner_wire, "ScopeMetrics.metrics"):
                    skipped += _metric(view[start:end][s:e], points)
    return ResourceMetrics(attributes, tuple(points), skipped)


def _metric(view: memoryview, points: list[DataPoint]) -> int:
    """The data points of one ``Metric`` added to ``points``; 1 when it is of a kind not
    read, else 0."""
    name = ""
    data: tuple[Kind, memoryview] | None = None
    other = False
    for number, wire, start, end in _fields(view):
        if number == 1 and wire == _LENGTH:
            name = _text(view, start, end)
        elif number == 5 and _is_message(wire, "Metric.gauge"):
            data = ("gauge", view[start:end])
        elif number == 7 and _is_message(wire, "Metric.sum"):
            data = ("sum", view[start:end])
        elif number in (9, 10, 11):
            other = True
    if data is None:
        return 1 if other else 0
    kind, body = data
    monotonic = False
    temporality = None
    found = []
    for number, wire, start, end in _fields(body):
        if number == 1 and _is_message(wire, f"{name}: data_points"):
            found.append(body[start:end])
        elif number == 2 and wire == _VARINT and kind == "sum":
            temporality = _TEMPORALITY.get(start)
        elif number == 3 and wire == _VARINT and kind == "sum":
            monotonic = bool(start)
    for point in found:
        points.append(_data_point(point, name, kind, monotonic, temporality))
    return 0


def _data_point(view: memoryview, name: str, kind: Kind, monotonic: bool,
                temporality: str | None) -> DataPoint:
    value = 0.0
    when = 0
    attributes: list[tuple[str, str]] = []
    for number, wire, start, end in _fields(view):
        if number == 4 and wire == _FIXED64:
            (value,) = _DOUBLE.unpack_from(view, start)
        elif number == 6 and wire == _FIXED64:
            value = float(_INT64.unpack_from(view, start)[0])
        elif number == 3 and wire == _FIXED64:
            (when,) = _UINT64.unpack_from(view, start)
        elif number == 7 and _is_message(wire, f"{name}: attributes"):
            pair = _key_value(view[start:end])
            if pair is not None:
                attributes.append(pair)
    return DataPoint(name, kind, value, tuple(attributes), monotonic,
                     temporality if kind == "sum" else None, when)


def _attributes(view: memoryview, field: int) -> tuple[tuple[str, str], ...]:
    pairs = []
    for number, wire, start, end in _fields(view):
        if number == field and _is_message(wire, "attributes"):
            pair = _key_value(view[start:end])
            if pair is not None:
                pairs.append(pair)
    return tuple(pairs)


def _key_value(view: memoryview) -> tuple[str, str] | None:
    key = None
    value = None
    for number, wire, start, end in _fields(view):
        if number == 1 and wire == _LENGTH:
            key = _text(view, start, end)
        elif number == 2 and _is_message(wire, "KeyValue.value"):
            value = _any_value(view[start:end])
    if key is None or value is None:
        return None
    return key, value


def _any_value(view: memoryview) -> str | None:
    value = None
    for number, wire, start, end in _fields(view):
        if number == 1 and wire == _LENGTH:
            value = _text(view, start, end)
        elif number == 2 and wire == _VARINT:
            value = "true" if start else "false"
        elif number == 3 and wire == _VARINT:
            value = str(start - (1 << 64) if start >= 1 << 63 else start)
        elif number == 4 and wire == _FIXED64:
            value = repr(_DOUBLE.unpack_from(view, start)[0])
        else:
            value = None  # an array, a map, bytes: no single label value
    return value
