"""Rewriting decoded messages by walking their structs, guided by the tables.

A rewrite (broker addresses, topic names) touches a few structs deep in a message.
``rewrite`` rebuilds only the path from the root to what changed and returns the very
same objects elsewhere, so an untouched message stays ``is``-identical and the frame
encoder can splice the unchanged fields from the original bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

from gatehouse.codecs.schema import FieldSpec, MessageSpec, StructSpec

FieldPredicate = Callable[[FieldSpec], bool]
StructVisitor = Callable[[StructSpec, Any], Any]


@cache
def _reaching(root: StructSpec, predicate: FieldPredicate) -> frozenset[int]:
    """ids of the structs under ``root`` whose subtree has a field matching ``predicate``."""
    memo: dict[int, bool] = {}

    def reaches(struct: StructSpec) -> bool:
        key = id(struct)
        if key in memo:
            return memo[key]
        memo[key] = False  # cycles cannot occur in specs, but be safe
        found = False
        for f in struct.fields:
            if predicate(f):
                found = True
            if f.struct is not None and reaches(f.struct):
                found = True
        memo[key] = found
        return found

    reaches(root)
    return frozenset(k for k, v in memo.items() if v)


def reaches(message: MessageSpec, predicate: FieldPredicate) -> bool:
    """Whether any field of ``message`` matches ``predicate`` (in any version)."""
    return id(message.root) in _reaching(message.root, predicate)


# Per struct (by id) where a version's matches live: the struct fields to descend into
# (attribute, struct, is an array) and whether the struct itself holds a match.
Plan = dict[int, tuple[tuple[tuple[str, StructSpec, bool], ...], bool]]


@cache
def _plan(root: StructSpec, predicate: FieldPredicate, version: int) -> Plan:
    """The structs of ``version`` under ``root`` with a matching field of ``version`` in
    their subtree, worked out once per message version: a rewrite then visits only them
    and asks the predicate nothing."""
    plan: Plan = {}
    seen: set[int] = set()

    def live(struct: StructSpec) -> bool:
        key = id(struct)
        if key in seen:
            return key in plan
        seen.add(key)
        here = any(predicate(f) and version in f.versions for f in struct.fields)
        children = tuple((f.attr, f.struct, f.is_array) for f in struct.fields
                         if f.struct is not None and version in f.versions and live(f.struct))
        if here or children:
            plan[key] = (children, here)
            return True
        return False

    live(root)
    return plan


def reaches_in(message: MessageSpec, predicate: FieldPredicate, version: int) -> bool:
    """Whether ``version`` of ``message`` has a field matching ``predicate``."""
    return id(message.root) in _plan(message.root, predicate, version)


def rewrite(
    message: MessageSpec,
    version: int,
    body: Any,
    predicate: FieldPredicate,
    visit: StructVisitor,
) -> Any:
    """Rebuild ``body`` with ``visit`` applied to every struct holding a matching field.

    ``visit(struct_spec, record)`` returns the record, changed or not.  Structs are
    visited bottom-up (children first) and only where ``predicate`` says a matching
    field lives below; everything else is returned as the same object.
    """
    plan = _plan(message.root, predicate, version)
    if id(message.root) not in plan:
        return body

    def walk(struct: StructSpec, record: Any) -> Any:
        if record is None:
            return None
        children, here = plan[id(struct)]
        changes: dict[str, Any] | None = None
        for attr, sub, is_array in children:
            value = getattr(record, attr)
            if value is None:
                continue
            if is_array:
                items = [walk(sub, item) for item in value]
                if any(new is not old for new, old in zip(items, value, strict=True)):
                    changes = changes or {}
                    changes[attr] = tuple(items)
            else:
                new = walk(sub, value)
                if new is not value:
                    changes = changes or {}
                    changes[attr] = new
        if changes:
            record = record.replace(**changes)
        if here:
            record = visit(struct, record)
        return record

    return walk(message.root, body)
