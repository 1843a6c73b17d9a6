"""Hypothesis strategies that build valid records of any message at any version, from
the same tables the codec compiles (so a new API version is covered automatically)."""

from __future__ import annotations

import uuid
from typing import Any

from hypothesis import strategies as st

from gatehouse.codecs.schema import FieldSpec, MessageSpec, StructSpec

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
    if f.nullable_in(version) or (f.type == "records" and not f.is_array):
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
