"""Sending a request on without some of its entries, and answering those (pure).

A broker's ACLs answer each topic of a request on its own: a Produce to two topics, one
the client may not write, writes the other; a Fetch of two, one it may not read, reads
the other; a DeleteTopics of two deletes the one it may delete; a DescribeGroups of two
groups describes the one it may describe.  The proxy's filters (``allow_topics``,
``allow_groups``..., ACL rules) and its check of topic ids do the same: ``split`` takes
out the entries that name what the client may not use (``denied_topics``,
``denied_ids``, ``unshown_ids``), the rest goes up, and ``merged`` puts the proxy's
answer for those (``answer``) into the broker's.

Which entries can be taken out, and how the answers are put together, follows the
response's mirroring of the request (``errors.answer_plan``): only arrays whose entries
the answer mirrors (a topic entry's answer is a topic entry of the same name), and a
Fetch's forgotten topics, which have no answer (the broker never had a hidden topic in
the session).  A name anywhere else (an OffsetCommit's group id, an array no answer
mirrors) is left in; the caller sees it still there and refuses the whole request, as
it does the APIs Kafka answers whole (``WHOLE``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from gatehouse.codecs import FieldSpec, Request, Response, StructSpec
from gatehouse.rules.errors import answer_plan, error_response
from gatehouse.rules.topics import (
    GROUP,
    TOPIC,
    TOPIC_RESOURCE,
    TRANSACTION,
    TopicMap,
    id_kind,
    id_resource_types,
    is_topic_field,
    resource_type,
)

# Whether an entry of the array ``field`` (a struct, or one name of a list of them) is
# to be taken out.
EntryTest = Callable[[FieldSpec, Any], bool]

# A Fetch's topics to drop from its session: they have no answer.
_FORGOTTEN = "ForgottenTopic"

# Kafka answers these as a whole (AddPartitionsToTxn: the partitions of a transaction
# are added all or none; the others answer by position, ``errors._by_position``).
_WHOLE = frozenset({"AddPartitionsToTxn", "CreateAcls", "DeleteAcls",
                    "DescribeUserScramCredentials", "AlterUserScramCredentials",
                    "AlterClientQuotas", "AlterReplicaLogDirs"})


class _Split:
    """What one walk over a request found: the entries' key fields (the one an answer's
    errors go below, ``error_response``'s ``within``) and whether an entry the answer
    mirrors was taken out (a forgotten topic alone needs no answer)."""

    def __init__(self) -> None:
        self.keys: set[str | None] = set()
        self.answered = False
        # An entry some of whose entries were taken out, whose key another entry shares
        # (two groups of one id): which of the broker's entries the proxy's answer for
        # it joins could not be told.
        self.ambiguous = False


class _Whole:
    def __repr__(self) -> str:
        return "WHOLE"


# ``split``'s word for a request whose picked entries cannot be answered on their own.
WHOLE: Final = _Whole()


def split(req: Request, withholds: EntryTest
          ) -> tuple[Request | None, Request | None, str | None] | _Whole | None:
    """``req`` without the entries ``withholds`` picks (None when nothing of what the
    answer mirrors is left to send), the request of those entries alone (with their
    parents' keys: the request to answer for them; None when the picked ones need no
    answer: forgotten topics), and the request field their answer's errors go below;
    None when none is picked (in an entry an answer mirrors); ``WHOLE`` when the API is
    answered as a whole, or which of the broker's entries an answer would join cannot
    be told."""
    api = req.api
    if req.body is None:
        return None
    found = _Split()
    version = req.api_version
    kept, mine, left = _split(api.response.root, api.request.root, req.body, version,
                              withholds, found)
    if mine is None:
        return None
    if api.name in _WHOLE or found.ambiguous:
        return WHOLE
    if not found.answered:
        return req.replace(body=kept), None, None
    rest = req.replace(body=kept) if left else None
    within = next(iter(found.keys)) if len(found.keys) == 1 else None
    return rest, req.replace(body=mine), within


def _split(resp_struct: StructSpec, req_struct: StructSpec, value: Any, version: int,
           withholds: EntryTest, found: _Split) -> tuple[Any, Any | None, bool]:
    """(``value`` without the picked entries, ``value`` with only them (None: none
    picked), whether any entry the answer mirrors is left in the first)."""
    kept: dict[str, Any] = {}
    mine: dict[str, Any] = {}
    left = False
    mirrored: set[str] = set()
    fields = {f.attr: f for f in req_struct.fields if version in f.versions}
    for step in answer_plan(resp_struct, req_struct, version):
        if step[0] not in ("mirror", "mirror_keys"):
            continue
        req_attr = step[2]
        mirrored.add(req_attr)
        items = getattr(value, req_attr, None)
        if not items:
            continue
        field = fields[req_attr]
        keep: list[Any] = []
        take: list[Any] = []
        for item in items:
            if withholds(field, item):
                take.append(item)
                # The request field that keys it (the plan's shared keys; None for a
                # name of a list of them).
                found.keys.add(None if step[0] == "mirror_keys" else next(
                    (g for _, g in step[3] if getattr(item, g) is not None), None))
                found.answered = True
                continue
            if step[0] == "mirror":
                sub_kept, sub_mine, sub_left = _split(step[4], step[5], item, version,
                                                      withholds, found)
                if sub_mine is not None:
                    take.append(sub_mine)
                    if sub_left:
                        keep.append(sub_kept)
                    key = tuple(getattr(item, g) for _, g in step[3])
                    found.ambiguous = found.ambiguous or sum(
                        tuple(getattr(other, g) for _, g in step[3]) == key
                        for other in items) > 1
                    continue
            keep.append(item)
        left = left or bool(keep)
        if take:
            kept[req_attr] = tuple(keep)
            mine[req_attr] = tuple(take)
    for attr, field in fields.items():
        # A Fetch's forgotten topics: dropped, with no answer.
        if attr in mirrored or field.struct is None or field.struct.name != _FORGOTTEN:
            continue
        items = getattr(value, attr, None) or ()
        keep = [item for item in items if not withholds(field, item)]
        if len(keep) < len(items):
            kept[attr] = tuple(keep)
            mine.setdefault(attr, ())
    if not mine:
        return value, None, True
    # The entries answered here alone: every other array the answer mirrors emptied.
    emptied = {attr: () for attr in mirrored - mine.keys()
               if getattr(value, attr, None)}
    return value.replace(**kept), value.replace(**emptied, **mine), left


def answer(mine: Request, within: str | None, code: int,
           message: Callable[[str | None], str | None],
           names: tuple[str, ...] = ()) -> Response:
    """The proxy's answer for the entries ``split`` took out (``mine``): ``code`` in
    each of them, the entries above them error-free, and where the answer has error
    text, ``message`` of the name the entry (or the nearest entry above it) has in one
    of the fields ``names`` (None for a topic named by id)."""
    resp = error_response(mine, code, None, within)
    return resp.replace(body=_texts(resp.api.response.root, resp.api_version, resp.body,
                                    code, message, names or NAME_ATTRS[TOPIC]))


def _texts(struct: StructSpec, version: int, value: Any, code: int,
           message: Callable[[str | None], str | None], names: tuple[str, ...],
           name: str | None = None) -> Any:
    """``value`` with each entry's error text set where it carries ``code`` (``name``:
    what its nearest named entry, maybe itself, names)."""
    changes: dict[str, Any] = {}
    attrs = {f.attr for f in struct.fields if version in f.versions}
    name = next((getattr(value, a) for a in names
                 if a in attrs and isinstance(getattr(value, a), str)), name)
    if "error_message" in attrs and getattr(value, "error_code", None) == code:
        changes["error_message"] = message(name)
    for f in struct.fields:
        if f.struct is None or version not in f.versions:
            continue
        inner = getattr(value, f.attr, None)
        if inner is None:
            continue
        changes[f.attr] = (
            tuple(_texts(f.struct, version, v, code, message, names, name) for v in inner)
            if f.is_array else _texts(f.struct, version, inner, code, message, names, name))
    return value.replace(**changes) if changes else value


# The answer's fields that name an entry, by kind of name: a topic's, a group's, a
# transactional id's (a resource's name, a FindCoordinator's key, of either).
NAME_ATTRS: Final = {TOPIC: ("name", "topic", "topic_name", "resource_name"),
                     GROUP: ("group_id", "resource_name", "key"),
                     TRANSACTION: ("transactional_id", "resource_name", "key")}


def merged(resp: Response, extra: Response) -> Response:
    """The broker's answer ``resp`` with the proxy's answer ``extra`` for the entries
    taken out put in: an entry under one of the same keys (a group's topics, say) joins
    it, the others are added at the end; the rest of ``resp`` (its top-level error, its
    throttle time, a Fetch's session) is the broker's."""
    api = resp.api
    body = _merged(api.response.root, api.request.root, resp.api_version, resp.body,
                   extra.body)
    return resp if body is resp.body else resp.replace(body=body)


def _merged(resp_struct: StructSpec, req_struct: StructSpec, version: int, value: Any,
            extra: Any) -> Any:
    changes: dict[str, Any] = {}
    for step in answer_plan(resp_struct, req_struct, version):
        if step[0] not in ("mirror", "mirror_keys"):
            continue
        attr = step[1]
        added = getattr(extra, attr, None)
        if not added:
            continue
        entries = list(getattr(value, attr, None) or ())
        if step[0] == "mirror_keys":
            changes[attr] = (*entries, *added)
            continue
        keys = tuple(r for r, _ in step[3])
        where = {tuple(getattr(e, k) for k in keys): i for i, e in enumerate(entries)}
        for entry in added:
            i = where.get(tuple(getattr(entry, k) for k in keys))
            if i is None:
                entries.append(entry)
            else:
                entries[i] = _merged(step[4], step[5], version, entries[i], entry)
        changes[attr] = tuple(entries)
    return value.replace(**changes) if changes else value


def denied_topics(topic_map: TopicMap) -> EntryTest:
    """Picks the entries naming (by name) a topic ``topic_map`` does not let the client
    use: a topic entry, a topic resource, a name in a list of them."""
    denies = topic_map.denies

    def test(field: FieldSpec, item: Any) -> bool:
        struct = field.struct
        if struct is None:
            return is_topic_field(field) and isinstance(item, str) and denies(item)
        resource = resource_type(item) == TOPIC_RESOURCE
        for f in struct.fields:
            if f.is_array or not (is_topic_field(f) or (resource and f.attr == "resource_name")):
                continue
            name = getattr(item, f.attr, None)
            if isinstance(name, str) and denies(name):
                return True
        return False

    return test


def denied_ids(topic_map: TopicMap, kind: str, keys_kind: str | None = None) -> EntryTest:
    """Picks the entries naming an id of ``kind`` (``GROUP``, ``TRANSACTION``) that
    ``topic_map`` does not let the client use: an entry keyed by one (a group of an
    OffsetFetch), a resource of that kind, one id in a list of them (DescribeGroups'
    groups; a FindCoordinator's keys, of the kind ``keys_kind``)."""
    types = id_resource_types(kind)

    def denies(name: Any) -> bool:
        return isinstance(name, str) and bool(name) and topic_map.denies_id(kind, name)

    def test(field: FieldSpec, item: Any) -> bool:
        struct = field.struct
        if struct is None:
            of = keys_kind if field.attr == "coordinator_keys" else id_kind(field)
            return of == kind and denies(item)
        resource = resource_type(item) in types
        return any(denies(getattr(item, f.attr, None)) for f in struct.fields
                   if not f.is_array and (id_kind(f) == kind
                                          or (resource and f.attr == "resource_name")))

    return test


def unshown_ids(shown: Callable[[bytes], bool | None]) -> EntryTest:
    """Picks the topic entries naming by id a topic the client may not name (``shown``
    False) or one not learned yet (None); not a Fetch's forgotten topics (the proxy
    never checked those: forgetting is harmless)."""

    def test(field: FieldSpec, item: Any) -> bool:
        struct = field.struct
        if struct is None or struct.name == _FORGOTTEN:
            return False
        topic_id = getattr(item, "topic_id", None)
        return (topic_id is not None and topic_id.bytes != _ZERO
                and shown(topic_id.bytes) is not True)

    return test


_ZERO = bytes(16)  # "no id": an entry named by its name (DeleteTopics v6+)

__all__ = ["NAME_ATTRS", "WHOLE", "EntryTest", "answer", "denied_ids", "denied_topics", "merged", "split",
           "unshown_ids"]
