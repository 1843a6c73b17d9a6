"""The capture record, schema version 1: one source for the writer's tests, the docs
and the Spark pipeline's read schema (pure: no trio, no proxy)."""

from __future__ import annotations

import contextlib
import importlib
import json
from collections.abc import Callable
from typing import Any, Final

from gatehouse.codecs._native import speedups

SCHEMA_VERSION = 1

# One record as one compact JSON line (no line breaks: strings escape them).  One shared
# encoder: json.dumps with options builds an encoder per call, a third of the time of a
# record; records are plain trees, so the circular-reference check is skipped too.
encode_json: Final[Callable[[Any], str]] = json.JSONEncoder(
    separators=(",", ":"), check_circular=False).encode

# The same bytes from C (_records.c), where built: the writer's thread holds the GIL while
# it encodes, a fifth of the time.  GATEHOUSE_PURE_PYTHON, which turns off the C byte
# readers, turns this off too.
native: Any = None
if speedups is not None:
    with contextlib.suppress(ImportError):  # not built here
        native = importlib.import_module("gatehouse.capture._records")


def encode_lines(records: list[dict[str, Any]]) -> bytes:
    """``records`` as JSON lines (``encode_json`` each, a line feed after each)."""
    if native is not None:
        return native.encode_lines(records, encode_json)  # type: ignore[no-any-return]
    return "".join([encode_json(r) + "\n" for r in records]).encode()


def encode_record(record: dict[str, Any]) -> bytes:
    """``record`` as one compact JSON document (``encode_json``'s text, encoded)."""
    if native is not None:
        return native.encode_record(record, encode_json)  # type: ignore[no-any-return]
    return encode_json(record).encode()

# (field, type) with types: string, int (32 bit), long, double, array<...>, or a struct
# name below.  Every record has every field; absent values are null (or empty lists).
TOPIC_FIELDS: tuple[tuple[str, str], ...] = (
    ("name", "string"),  # client-side name (null: a topic id not yet seen in Metadata)
    ("broker", "string"),  # broker-side name (differs under rename/prefix rules)
    ("id", "string"),  # topic id (UUID) when the request used ids
    ("partitions", "array<int>"),
    ("records", "long"),  # Produce requests and Fetch responses: from batch headers
    ("bytes", "long"),
)
RULE_FIELDS: tuple[tuple[str, str], ...] = (
    ("rule", "string"),
    ("action", "string"),  # min_api_version, deny_apis, topics, match, quota, ...
    ("effect", "string"),  # refuse, rewrite, pass, throttle (a quota held the request)
    ("mode", "string"),  # enforce, observe
)
FIELDS: tuple[tuple[str, str], ...] = (
    ("v", "int"),
    ("time", "double"),  # request arrival, seconds since the epoch (UTC)
    ("proxy", "string"),  # capture.instance (default: host name)
    ("run", "string"),  # random per proxy process: connection ids restart with it
    ("conn", "long"),
    ("client", "string"),  # client address host:port
    ("listener", "string"),  # bootstrap or broker-<node>
    ("client_id", "string"),
    ("software_name", "string"),  # KIP-511 (ApiVersions v3+), null before/without it
    ("software_version", "string"),
    ("principal", "string"),  # the SASL user the broker accepted, if any (codecs.sasl)
    ("api", "string"),
    ("api_key", "int"),
    ("api_version", "int"),
    ("correlation_id", "int"),
    ("request_bytes", "long"),
    ("response_bytes", "long"),
    ("latency_ms", "double"),
    ("outcome", "string"),  # answered, refused, no_response, unanswered
    ("errors", "array<int>"),  # distinct non-zero error codes, every level
    ("error_count", "int"),  # non-zero error codes, every level
    ("topics", "array<topic>"),
    ("group_id", "string"),
    ("protocol_type", "string"),
    ("protocol_name", "string"),
    ("rules", "array<rule>"),
    ("sample", "double"),  # the share of this API's exchanges recorded (1.0: all)
)
OUTCOMES = frozenset({"answered", "refused", "no_response", "unanswered"})

_SPARK = {"string": "STRING", "int": "INT", "long": "BIGINT", "double": "DOUBLE"}
_STRUCTS = {"topic": TOPIC_FIELDS, "rule": RULE_FIELDS}


def _spark_type(kind: str) -> str:
    if kind.startswith("array<"):
        return f"ARRAY<{_spark_type(kind[6:-1])}>"
    if kind in _STRUCTS:
        inner = ", ".join(f"`{n}`: {_spark_type(t)}" for n, t in _STRUCTS[kind])
        return f"STRUCT<{inner}>"
    return _SPARK[kind]


def spark_ddl(fields: frozenset[str] | None = None,
              topic_fields: frozenset[str] | None = None) -> str:
    """The record schema as a Spark DDL string (``spark.read.schema(spark_ddl())``).

    ``fields`` / ``topic_fields`` keep only those: the JSON reader then skips the rest of
    each line without building it (much faster than reading everything).
    """
    def keep(pairs: tuple[tuple[str, str], ...], wanted: frozenset[str] | None
             ) -> tuple[tuple[str, str], ...]:
        return pairs if wanted is None else tuple(p for p in pairs if p[0] in wanted)

    topic = keep(TOPIC_FIELDS, topic_fields)
    inner = ", ".join(f"`{n}`: {_spark_type(t)}" for n, t in topic)
    return ", ".join(
        f"`{name}` " + (f"ARRAY<STRUCT<{inner}>>" if kind == "array<topic>"
                        else _spark_type(kind))
        for name, kind in keep(FIELDS, fields))
