"""Differential test: our codecs against kio, an independent implementation.

kio (PyPI ``kio``) is generated from Kafka's JSON specs by other people, with a
Rust-backed reader and a pure-Python writer.  Its field names and value types differ
from ours (``throttle_time`` is a ``timedelta``, error codes are an enum, ...), so the
comparison is made on the wire bytes, plus a value comparison after normalising both
sides to plain Python values.

For every (API key, version, direction) that both codecs know, with bodies generated
from our tables (``tests/codec_strategies.py``):

* forward: our encoder's body bytes are read by kio, which must consume exactly those
  bytes, see the same values, and write back byte-identical bytes;
* reverse: the same values are put into a kio entity *built from values* (not read from
  bytes) and written by kio; our decoder must read those bytes (through the public
  ``decode_request``/``decode_response``) into the original record, and a full
  re-encode (``Request.build``/``Response.build``: no cached frame, no splicing) must
  reproduce kio's bytes exactly.

Exclusions: every value the generator may produce but kio cannot represent is mapped
into kio's domain by ``_fit_to_kio`` below; each rule there says why.  Unknown tagged
fields are not compared at all (kio 0.6.5 raises on them, see ``_fit_to_kio``).

Caveat: kio's Rust reader trusts array lengths; if our encoder ever wrote a malformed
body, kio may abort the whole process ("memory allocation of N bytes failed") instead of
raising.  Run with ``-v`` to see which case was running.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import io
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

kio_index = pytest.importorskip("kio.index")
from kio.schema.errors import ErrorCode  # noqa: E402
from kio.schema.index import api_key_map, schema_name_map  # noqa: E402
from kio.serial import entity_reader, entity_writer  # noqa: E402
from kio.serial._introspect import classify_field, is_optional  # noqa: E402
from kio.serial.readers import tz_aware_from_i64  # noqa: E402

from gatehouse import codecs  # noqa: E402
from gatehouse.codecs._compile import message_codec  # noqa: E402
from gatehouse.codecs.schema import ZERO_UUID, ApiSpec, FieldSpec, MessageSpec, StructSpec  # noqa: E402
from tests.codec_strategies import examples, message_body  # noqa: E402

# -- which versions kio knows ------------------------------------------------------------


def _kio_knows(api_key: int, version: int) -> bool:
    name = api_key_map.get(api_key)
    return name is not None and version in schema_name_map.get(name, {})


ALL_VERSIONS = [(a.key, v) for a in codecs.APIS.values() for v in a.versions]
COVERED = [(k, v) for k, v in ALL_VERSIONS if _kio_knows(k, v)]
NOT_IN_KIO = sorted(set(ALL_VERSIONS) - set(COVERED))
CASES = [(k, v, d) for k, v in COVERED for d in ("request", "response")]

# Examples per (api, version, direction).  ~600 cases; keep the whole file under 60 s.
EXAMPLES = 8


def test_kio_covers_most_of_our_versions() -> None:
    """The comparison must not silently shrink to nothing when kio or our tables change."""
    assert len(COVERED) >= 0.8 * len(ALL_VERSIONS), (len(COVERED), len(ALL_VERSIONS), NOT_IN_KIO)
    # kio 0.6.5 predates some (Kafka 4.4.0) versions and, built from 4.x specs, has none
    # of those Kafka 4.0 removed (the tables take them from 3.9's); anything else
    # missing is news.
    kio_lowest = {k: min((v for k2, v in COVERED if k2 == k), default=0) for k, _ in ALL_VERSIONS}
    newer = [(k, v) for k, v in NOT_IN_KIO if v > kio_lowest[k]]
    assert len(newer) <= 10, newer
    removed = {(k, v) for k, v in NOT_IN_KIO if v < kio_lowest[k]}
    assert {(0, 0), (0, 1), (0, 2), (1, 3), (2, 0)} <= removed, removed


# -- pairing our structs with kio's dataclasses ------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Pair:
    """One field present in a version: ours, kio's, and how kio types it."""

    index: int  # position in our record
    ours: FieldSpec
    name: str  # kio attribute
    kafka_type: str | None  # kio's metadata type; None for structs
    optional: bool  # kio's annotation includes None
    nested: type | None  # kio dataclass of a struct field


@functools.cache
def _pairs(struct: StructSpec, cls: type, version: int) -> tuple[_Pair, ...]:
    """Both sides list the spec's fields in spec order; pair them by position."""
    ours = [(i, f) for i, f in enumerate(struct.fields) if version in f.versions]
    theirs = dataclasses.fields(cls)
    assert len(ours) == len(theirs), (
        struct.name,
        version,
        [f.attr for _, f in ours],
        [t.name for t in theirs],
    )
    pairs = []
    for (i, f), t in zip(ours, theirs, strict=True):
        kind = classify_field(t)
        assert kind.is_array == f.is_array, (struct.name, f.attr)
        nested = kind.type_ if f.struct is not None else None
        pairs.append(_Pair(i, f, t.name, t.metadata.get("kafka_type"), is_optional(t), nested))
    return tuple(pairs)


@functools.cache
def _kio_class(api_key: int, version: int, direction: str) -> type:
    if direction == "request":
        return kio_index.load_request_schema(api_key, version)
    return kio_index.load_response_schema(api_key, version)


def _spec(api_key: int, direction: str) -> MessageSpec:
    api: ApiSpec = codecs.APIS[api_key]
    return api.request if direction == "request" else api.response


# -- fitting generated values into kio's domain -------------------------------------------

_ERROR_CODES = sorted(int(e) for e in ErrorCode)
_ERROR_CODE_SET = frozenset(_ERROR_CODES)
# kio keeps int64 durations as ``timedelta`` and writes them back with
# ``round(total_seconds() * 1000)``: a float, exact only below ~2**53 microseconds.
_TIMEDELTA_I64_LIMIT = 2**42
# kio keeps int64 timestamps as tz-aware ``datetime``: no negative values (kio reads -1
# as None where its schema makes the field optional) and nothing past 9999-12-31; and
# its float conversion is only exact in ms well below that.
_DATETIME_LIMIT = 2**42  # ms, ~ year 2109


def _fit_scalar(p: _Pair, value: Any) -> Any:
    kt = p.kafka_type
    if kt == "error_code":
        # kio decodes error codes into its ``ErrorCode`` enum, which raises on codes it
        # does not list (e.g. codes newer than kio); pick a listed one instead.
        return value if value in _ERROR_CODE_SET else _ERROR_CODES[value % len(_ERROR_CODES)]
    if kt == "timedelta_i64":
        return (
            value
            if -_TIMEDELTA_I64_LIMIT <= value <= _TIMEDELTA_I64_LIMIT
            else value % _TIMEDELTA_I64_LIMIT
        )
    if kt == "datetime_i64":
        if value == -1 and p.optional:
            return value
        return value % _DATETIME_LIMIT
    return value


def _fit_to_kio(struct: StructSpec, cls: type, version: int, record: Any) -> Any:
    """``record`` with every value kio cannot hold replaced by one it can.

    Unknown tagged fields are dropped: kio's entities have no place for them, and kio
    0.6.5's reader rejects them outright (``KeyError: 'Unknown tagged field tag: 0'``)
    instead of skipping them as Kafka does.  Our handling of
    unknown tags is therefore not checked against kio (only by our own round trips).
    """
    values = list(record)
    for p in _pairs(struct, cls, version):
        value = values[p.index]
        f = p.ours
        if value is None:
            continue
        if f.struct is not None:
            assert p.nested is not None and f.struct is not None
            sub = f.struct

            def fit(item: Any, sub: StructSpec = sub, nested: type = p.nested) -> Any:
                return _fit_to_kio(sub, nested, version, item)

            values[p.index] = tuple(fit(x) for x in value) if f.is_array else fit(value)
        elif f.is_array:
            values[p.index] = tuple(_fit_scalar(p, x) for x in value)
        else:
            values[p.index] = _fit_scalar(p, value)
    values[-1] = ()
    return struct.cls(*values)


# -- values of both sides as plain data ----------------------------------------------------

_MS = datetime.timedelta(milliseconds=1)


def _plain_kio_scalar(p: _Pair, value: Any) -> Any:
    kt = p.kafka_type
    if value is None:
        if kt == "uuid":
            return ZERO_UUID  # kio reads the zero UUID as None (and writes None as zero)
        if kt == "datetime_i64":
            return -1  # kio's optional timestamps: -1 on the wire
        return None
    if kt in ("timedelta_i32", "timedelta_i64"):
        return value // _MS
    if kt == "datetime_i64":
        return round(value.timestamp() * 1000)  # what kio's writer puts on the wire
    if kt == "error_code":
        return int(value)
    if kt in ("bytes", "records"):
        return bytes(value)
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str(value)
    return value


def _plain_kio(struct: StructSpec, cls: type, version: int, entity: Any) -> tuple[Any, ...]:
    out = []
    for p in _pairs(struct, cls, version):
        value = getattr(entity, p.name)
        f = p.ours
        if value is None and f.is_array:
            out.append(None)
        elif value is not None and f.struct is not None:
            assert p.nested is not None and f.struct is not None
            sub, nested = f.struct, p.nested
            if f.is_array:
                out.append(tuple(_plain_kio(sub, nested, version, x) for x in value))
            else:
                out.append(_plain_kio(sub, nested, version, value))
        elif value is not None and f.is_array:
            out.append(tuple(_plain_kio_scalar(p, x) for x in value))
        else:
            out.append(_plain_kio_scalar(p, value))
    return tuple(out)


def _plain_ours(struct: StructSpec, cls: type, version: int, record: Any) -> tuple[Any, ...]:
    out = []
    for p in _pairs(struct, cls, version):
        value = record[p.index]
        f = p.ours
        if value is not None and f.struct is not None:
            assert p.nested is not None and f.struct is not None
            sub, nested = f.struct, p.nested
            if f.is_array:
                out.append(tuple(_plain_ours(sub, nested, version, x) for x in value))
            else:
                out.append(_plain_ours(sub, nested, version, value))
        elif isinstance(value, memoryview):
            out.append(bytes(value))
        else:
            out.append(value)
    return tuple(out)


# -- kio entities built from our values (the reverse direction) -----------------------------


def _kio_scalar(p: _Pair, value: Any) -> Any:
    kt = p.kafka_type
    if value is None:
        return None
    if kt in ("timedelta_i32", "timedelta_i64"):
        return datetime.timedelta(milliseconds=value)
    if kt == "datetime_i64":
        return None if value == -1 and p.optional else tz_aware_from_i64(value)
    if kt == "error_code":
        return ErrorCode(value)
    if kt == "uuid" and p.optional and value == ZERO_UUID:
        return None  # kio's own reading of the zero UUID in these fields
    if kt in ("bytes", "records"):
        return bytes(value)
    return value


def _to_kio(struct: StructSpec, cls: type, version: int, record: Any) -> Any:
    kwargs = {}
    for p in _pairs(struct, cls, version):
        value = record[p.index]
        f = p.ours
        if value is not None and f.struct is not None:
            assert p.nested is not None and f.struct is not None
            sub, nested = f.struct, p.nested
            if f.is_array:
                kwargs[p.name] = tuple(_to_kio(sub, nested, version, x) for x in value)
            else:
                kwargs[p.name] = _to_kio(sub, nested, version, value)
        elif value is not None and f.is_array:
            kwargs[p.name] = tuple(_kio_scalar(p, x) for x in value)
        else:
            kwargs[p.name] = _kio_scalar(p, value)
    return cls(**kwargs)


# -- the oracle -------------------------------------------------------------------------------


def _kio_write(cls: type, entity: Any) -> bytes:
    buf = io.BytesIO()
    entity_writer(cls)(buf, entity)
    return buf.getvalue()


def _ours_write(spec: MessageSpec, version: int, body: Any) -> bytes:
    out = bytearray()
    message_codec(spec, version).encode(out, body)
    return bytes(out)


def _build(api_key: int, version: int, direction: str, body: Any) -> Any:
    if direction == "request":
        return codecs.Request.build(api_key, version, 0x1234_5678, "oracle", body)
    return codecs.Response.build(api_key, version, 0x1234_5678, body)


def _decode(api_key: int, version: int, direction: str, frame: bytes) -> Any:
    if direction == "request":
        return codecs.decode_request(frame)
    return codecs.decode_response(frame, api_key=api_key, api_version=version)


def _check(api_key: int, version: int, direction: str, generated: Any) -> None:
    spec = _spec(api_key, direction)
    cls = _kio_class(api_key, version, direction)
    root = spec.root
    body = _fit_to_kio(root, cls, version, generated)
    read = entity_reader(cls)
    expected = _plain_ours(root, cls, version, body)

    # Forward: our bytes -> kio reads -> same values -> kio writes the same bytes.
    ours = _ours_write(spec, version, body)
    entity, size = read(ours, 0)
    assert size == len(ours), f"kio consumed {size} of our {len(ours)} body bytes"
    assert _plain_kio(root, cls, version, entity) == expected
    assert _kio_write(cls, entity) == ours, "kio re-encodes our bytes differently"

    # Reverse: a kio entity built from the values; kio's bytes -> our public decoder ->
    # the same record -> a full re-encode gives kio's bytes.
    theirs = _kio_write(cls, _to_kio(root, cls, version, body))
    frame = bytes(_build(api_key, version, direction, body).encode())
    header = frame[: len(frame) - len(ours)]
    assert frame[len(header) :] == ours  # the public encoder writes header + this body
    decoded = _decode(api_key, version, direction, header + theirs)
    assert decoded.api_key == api_key and decoded.api_version == version
    assert _plain_ours(root, cls, version, decoded.body) == expected
    again = _build(api_key, version, direction, decoded.body)
    assert bytes(again.encode()) == header + theirs, "our full re-encode differs from kio's bytes"
    assert theirs == ours


_SETTINGS = settings(
    max_examples=examples(EXAMPLES),
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


@functools.cache
def _strategy(api_key: int, version: int, direction: str) -> st.SearchStrategy[Any]:
    return message_body(_spec(api_key, direction), version)


def _run(api_key: int, version: int, direction: str) -> None:
    @_SETTINGS
    @given(_strategy(api_key, version, direction))
    def check(body: Any) -> None:
        _check(api_key, version, direction, body)

    check()


def _case_id(case: tuple[int, int, str]) -> str:
    key, version, direction = case
    return f"{codecs.APIS[key].name}-v{version}-{direction}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_matches_kio(case: tuple[int, int, str]) -> None:
    _run(*case)


def test_defaults_match_kio() -> None:
    """A body of all defaults (the usual case for tagged fields) agrees too."""
    checked = 0
    for key, version in COVERED:
        for direction in ("request", "response"):
            spec = _spec(key, direction)
            default = spec.root.default
            try:
                _ours_write(spec, version, default)
            except codecs.ProtocolError:
                continue  # a non-nullable field defaults to null: no valid default body
            _check(key, version, direction, default)
            checked += 1
    assert checked >= len(COVERED)
