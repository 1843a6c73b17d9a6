"""Hypothesis strategies that build valid records of any message at any version, from
the same tables the codec compiles (so a new API version is covered automatically)."""

from __future__ import annotations

import os
import random
import struct
import uuid
from typing import Any

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

from gatehouse.codecs._flat import FlatRecords
from gatehouse.codecs.frames import Request, Response, decode_request, decode_response
from gatehouse.codecs.plain import request_from_dict, response_from_dict
from gatehouse.codecs.schema import APIS, FieldSpec, MessageSpec, StructSpec

# `make soak` (GATEHOUSE_SOAK=1) runs every generated-message test this many times longer.
SOAK_FACTOR = 25 if os.environ.get("GATEHOUSE_SOAK") == "1" else 1


def examples(n: int) -> int:
    """``n`` generated examples, or ``SOAK_FACTOR`` times as many in a soak run."""
    return n * SOAK_FACTOR


def few_examples(n: int, *, derandomize: bool = False) -> Any:
    """Hypothesis settings for ``examples(n)`` generated messages, reported as found:
    no shrinking, as a big generated message can shrink for minutes."""
    return settings(max_examples=examples(n), deadline=None, database=None,
                    derandomize=derandomize, phases=(Phase.explicit, Phase.generate),
                    suppress_health_check=list(HealthCheck))


_INT_BOUNDS = {
    "int8": (-(2**7), 2**7 - 1),
    "int16": (-(2**15), 2**15 - 1),
    "uint16": (0, 2**16 - 1),
    "int32": (-(2**31), 2**31 - 1),
    "uint32": (0, 2**32 - 1),
    "int64": (-(2**63), 2**63 - 1),
}


def scalar(type_name: str) -> st.SearchStrategy[Any]:
    if type_name in _INT_BOUNDS:
        lo, hi = _INT_BOUNDS[type_name]
        return st.one_of(st.integers(max(lo, -3), 3), st.integers(lo, hi))
    if type_name == "bool":
        return st.booleans()
    if type_name == "float64":
        return st.floats(allow_nan=False)
    if type_name == "uuid":
        return st.one_of(st.just(uuid.UUID(int=0)), st.uuids())
    if type_name == "string":
        return st.text(max_size=12)
    if type_name in ("bytes", "records"):
        return st.binary(max_size=24)
    raise AssertionError(type_name)


def _unknown_tags(struct: StructSpec) -> st.SearchStrategy[tuple[tuple[int, bytes], ...]]:
    known = {f.tag for f in struct.fields if f.tag is not None}
    tags = st.integers(0, 40).filter(lambda t: t not in known)
    return st.dictionaries(tags, st.binary(max_size=6), max_size=2).map(
        lambda d: tuple(sorted(d.items()))
    )


def field_value(f: FieldSpec, version: int, flexible: bool, depth: int = 0) -> st.SearchStrategy[Any]:
    """A value of field ``f`` valid in ``version`` (None only where nullable)."""
    element: st.SearchStrategy[Any]
    if f.struct is not None:
        struct = f.struct
        element = st.deferred(lambda: struct_value(struct, version, flexible, depth + 1))
    else:
        element = scalar(f.type)
    value = (st.lists(element, max_size=3 if depth < 2 else 1).map(tuple) if f.is_array
             else element)
    if f.nullable_in(version):
        value = st.one_of(st.none(), value)
    return value


def struct_value(struct: StructSpec, version: int, flexible: bool, depth: int = 0) -> st.SearchStrategy[Any]:
    parts: list[st.SearchStrategy[Any]] = []
    for f in struct.fields:
        if version not in f.versions:
            parts.append(st.just(f.default))
        elif f.tagged_in(version):
            parts.append(st.one_of(st.just(f.default), field_value(f, version, flexible, depth)))
        else:
            parts.append(field_value(f, version, flexible, depth))
    parts.append(_unknown_tags(struct) if flexible else st.just(()))
    return st.tuples(*parts).map(lambda values: struct.cls(*values))


def message_body(message: MessageSpec, version: int) -> st.SearchStrategy[Any]:
    return struct_value(message.root, version, message.is_flexible(version))


# -- shared by the codec test modules ------------------------------------------------------

INT32 = st.integers(-(2**31), 2**31 - 1)

#: Every (API key, version) the tables know, in key order.
ALL_VERSIONS: list[tuple[int, int]] = [
    (key, version) for key, spec in sorted(APIS.items()) for version in spec.versions
]

#: Every (API key, version, direction): the parametrisation of the per-API tests.
ALL_CASES: list[tuple[int, int, str]] = [
    (key, version, direction)
    for key, version in ALL_VERSIONS
    for direction in ("request", "response")
]


def case_id(case: tuple[int, int, str]) -> str:
    key, version, direction = case
    return f"{APIS[key].name}-v{version}-{direction}"


def message_spec(api_key: int, direction: str) -> MessageSpec:
    spec = APIS[api_key]
    return spec.request if direction == "request" else spec.response


def header_tags(flexible: bool) -> st.SearchStrategy[tuple[tuple[int, bytes], ...]]:
    """Unknown tagged fields for a request header v2 / response header v1 (none below)."""
    if not flexible:
        return st.just(())
    return st.dictionaries(st.integers(0, 300), st.binary(max_size=4), max_size=2).map(
        lambda d: tuple(sorted(d.items()))
    )


def build_message(
    api_key: int,
    version: int,
    direction: str,
    body: Any,
    correlation_id: int = 1,
    client_id: str | None = "client-1",
    tags: tuple[tuple[int, bytes], ...] = (),
) -> Request | Response:
    """A request or response made in code (no frame behind it: encoded in full)."""
    if direction == "request":
        req = Request.build(api_key, version, correlation_id, client_id, body)
        return req.replace(header=req.header.replace(unknown_tags=tags)) if tags else req
    resp = Response.build(api_key, version, correlation_id, body)
    return resp.replace(header=resp.header.replace(unknown_tags=tags)) if tags else resp


def decode_frame(frame: Any, api_key: int, version: int, direction: str) -> Request | Response:
    if direction == "request":
        return decode_request(frame)
    return decode_response(frame, api_key, version)


def from_plain(plain: Any, api_key: int, version: int, direction: str) -> Request | Response:
    if direction == "request":
        return request_from_dict(plain)
    return response_from_dict(plain, api_key=api_key, api_version=version)


# -- plain random bodies (no hypothesis: cheap enough for fuzzing every API) -------------

_SCALAR_EDGES: dict[str, tuple[Any, ...]] = {
    "bool": (False, True),
    "float64": (0.0, -1.5, 1e300, float("inf")),
    "string": ("", "t", "topic-ä", "x" * 40),
    "bytes": (b"", b"\x00", bytes(range(20))),
    "records": (b"", b"\x00" * 30),
}


def random_scalar(type_name: str, rng: random.Random) -> Any:
    if type_name in _INT_BOUNDS:
        lo, hi = _INT_BOUNDS[type_name]
        return rng.choice((lo, hi, max(lo, -1), 0, 1, rng.randint(lo, hi)))
    if type_name == "uuid":
        return rng.choice((uuid.UUID(int=0), uuid.UUID(int=rng.getrandbits(128))))
    return rng.choice(_SCALAR_EDGES[type_name])


def random_struct(struct: StructSpec, version: int, flexible: bool, rng: random.Random,
                  depth: int = 0) -> Any:
    """A valid record of ``struct`` at ``version``, every present field filled in."""
    values: list[Any] = []
    for f in struct.fields:
        if version not in f.versions or (f.tagged_in(version) and rng.random() < 0.3):
            values.append(f.default)
            continue
        if f.nullable_in(version) and rng.random() < 0.2:
            values.append(None)
            continue

        def element(f: FieldSpec = f) -> Any:
            if f.struct is not None:
                return random_struct(f.struct, version, flexible, rng, depth + 1)
            return random_scalar(f.type, rng)

        if f.is_array:
            values.append(tuple(element() for _ in range(rng.randint(0, 3 if depth < 2 else 1))))
        else:
            values.append(element())
    tags: tuple[tuple[int, bytes], ...] = ()
    if flexible and rng.random() < 0.3:
        known = {f.tag for f in struct.fields if f.tag is not None}
        tags = tuple((t, bytes(rng.randrange(4))) for t in sorted({rng.randrange(60)} - known))
    return struct.cls(*values, tags)


def random_body(message: MessageSpec, version: int, rng: random.Random) -> Any:
    return random_struct(message.root, version, message.is_flexible(version), rng)


def exact(value: Any) -> Any:
    """``value`` with the type of every part spelled out (True is not 1), floats by their
    bits (a NaN is not equal to another NaN) and views by their bytes: two decoders'
    results compare equal exactly when they are the same."""
    if isinstance(value, float):
        return ("float", struct.pack(">d", value))
    if isinstance(value, FlatRecords):  # an array, maybe built when read
        return ("tuple", tuple(exact(v) for v in value.records()))
    if isinstance(value, tuple):
        return (type(value).__name__, tuple(exact(v) for v in value))
    if isinstance(value, memoryview):
        return ("memoryview", value.tobytes())
    return (type(value).__name__, value)
