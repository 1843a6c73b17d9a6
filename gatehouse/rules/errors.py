"""Building an API's own error response to a request, from the tables (pure).

Kafka answers a refused request with that API's response at the request's version,
the error code in every place the response carries one, and the per-topic and
per-partition entries mirroring the request (31 responses have no top-level error
code: Produce, Metadata, CreateTopics...).  Kafka writes this per request class
(``AbstractRequest.getErrorResponse``); we derive it from the specs instead, so every
API and version is covered, new ones included:

* ``error_code`` fields get the code, ``error_message`` fields the message;
* an array of structs in the response is matched to the request array it answers
  (same key fields: ``name``/``topic_id``/``partition_index``..., the same
  ``entityType``, or a plain list of keys such as FindCoordinator's
  ``CoordinatorKeys``), and gets one entry per request entry with the keys copied;
* the few answers whose entries answer the request's by position or under another
  name, which the specs cannot tell (CreateAcls, DeleteAcls, AlterClientQuotas,
  Describe/AlterUserScramCredentials, AlterReplicaLogDirs), are filled as Kafka's
  ``getErrorResponse`` fills them (``_by_position``): a client counts on one result
  per ACL, filter, quota entry, user or partition it asked about.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from gatehouse.codecs import FieldSpec, Request, Response, StructSpec

UNSUPPORTED_VERSION = 35
UNKNOWN_TOPIC_ID = 100
UNKNOWN_TOPIC_OR_PARTITION = 3
TOPIC_AUTHORIZATION_FAILED = 29
GROUP_AUTHORIZATION_FAILED = 30
TRANSACTIONAL_ID_AUTHORIZATION_FAILED = 53
CLUSTER_AUTHORIZATION_FAILED = 31
POLICY_VIOLATION = 44
INVALID_RECORD = 87
CORRUPT_MESSAGE = 2
UNSUPPORTED_FOR_MESSAGE_FORMAT = 43
INVALID_REQUEST = 42
REQUEST_TIMED_OUT = 7
UNKNOWN_SERVER_ERROR = -1

_PARTITION_KEYS = frozenset({"partition", "partition_index", "index", "partition_id"})
_KEY_ATTRS = frozenset({
    "name", "topic", "topic_name", "topic_id", "key", "group_id", "transactional_id",
    "resource_type", "resource_name", "member_id", "group_instance_id", "producer_id",
    "broker_id", "node_id", "principal", "client_id",
}) | _PARTITION_KEYS


def _is_key(f: FieldSpec) -> bool:
    return f.map_key or f.attr in _KEY_ATTRS or f.entity in ("topicName", "groupId",
                                                               "transactionalId")


def _same_key(a: FieldSpec, b: FieldSpec) -> bool:
    if a.type != b.type or a.is_array or b.is_array:
        return False
    if a.attr == b.attr:
        return True
    return a.attr in _PARTITION_KEYS and b.attr in _PARTITION_KEYS


def _singular(attr: str) -> str:
    for plural, single in (("indexes", "index"), ("ies", "y"), ("es", "e"), ("s", "")):
        if attr.endswith(plural):
            return attr[: -len(plural)] + single
    return attr


def _scalar_key_field(g: FieldSpec, struct: StructSpec, version: int) -> FieldSpec | None:
    """The field of ``struct`` that one element of the scalar array ``g`` fills."""
    fields = [f for f in struct.fields if version in f.versions and not f.is_array
              and f.struct is None and f.type == g.type]
    single = _singular(g.attr)
    for f in fields:
        if g.entity is not None and f.entity == g.entity:
            return f
    for f in fields:
        if f.attr == single or single.endswith("_" + f.attr) or (
            f.attr in _PARTITION_KEYS and (single in _PARTITION_KEYS or g.attr == "partitions")
        ):
            return f
    return None


@cache
def answer_plan(resp_struct: StructSpec, req_struct: StructSpec, version: int) -> tuple[Any, ...]:
    """For each response field: how to fill it (cached per struct pair and version)."""
    steps: list[Any] = []
    req_fields = [g for g in req_struct.fields if version in g.versions]
    # The error code of an entry that has no plain error_code (AddPartitionsToTxn v0-3's
    # partitions: PartitionErrorCode); beside one, another code is something else's (a
    # CreateTopics topic's TopicConfigErrorCode).
    plain = has_field(resp_struct, "error_code", version)
    for f in resp_struct.fields:
        if version not in f.versions:
            continue
        if f.type == "int16" and (f.attr == "error_code" or (
                not plain and f.attr.endswith("_error_code"))):
            steps.append(("error", f.attr))
        elif f.attr == "error_message" and f.type == "string":
            steps.append(("message", f.attr))
        elif f.attr == "high_watermark" and f.type == "int64":
            # Kafka's (FetchResponse.partitionResponse): none known (the spec has no
            # default, so it would read 0, "the partition is empty").
            steps.append(("unknown", f.attr))
        elif f.is_array and f.struct is not None:
            match: tuple[Any, ...] | None = None
            for g in req_fields:
                if not g.is_array:
                    continue
                if g.struct is not None:
                    shared = [(rf.attr, gf.attr) for rf in f.struct.fields
                              for gf in g.struct.fields
                              if version in rf.versions and version in gf.versions
                              and _is_key(rf) and _same_key(rf, gf)]
                    if shared:
                        match = ("mirror", f.attr, g.attr, tuple(shared), f.struct, g.struct)
                        break
                else:
                    key = _scalar_key_field(g, f.struct, version)
                    if key is not None:
                        match = ("mirror_keys", f.attr, g.attr, key.attr, f.struct)
                        break
            if match is not None:
                steps.append(match)
        elif f.struct is not None and not f.is_array and not f.nullable_in(version):
            # (A nullable one stays null, as a broker's error answers leave it: a
            # DescribeTopicPartitions cursor of ('', 0) would start the listing again,
            # a heartbeat's empty assignment would take every partition away.)
            steps.append(("struct", f.attr, f.struct))
        elif not f.is_array and f.struct is None and _is_key(f):
            for g in req_fields:
                if _same_key(f, g):
                    steps.append(("copy", f.attr, g.attr))
                    break
    return tuple(steps)


def _fill(resp_struct: StructSpec, req_struct: StructSpec, req_value: Any, version: int,
          code: int, message: str | None, within: str | None = None,
          active: bool = True) -> Any:
    """The response struct answering ``req_value``; errors (and messages) only where
    ``active``: below the request entries that hold ``within``, if it is given."""
    changes: dict[str, Any] = {}
    for step in answer_plan(resp_struct, req_struct, version):
        kind = step[0]
        if kind == "error":
            if active:
                changes[step[1]] = code
        elif kind == "message":
            if active:
                changes[step[1]] = message
        elif kind == "unknown":
            if active:
                changes[step[1]] = -1
        elif kind == "copy":
            value = getattr(req_value, step[2], None) if req_value is not None else None
            if value is not None:
                changes[step[1]] = value
        elif kind == "mirror":
            _, attr, req_attr, shared, sub_resp, sub_req = step
            items = getattr(req_value, req_attr, None) if req_value is not None else None
            out = []
            for item in items or ():
                entry = _fill(sub_resp, sub_req, item, version, code, message, within,
                              active or (within is not None
                                        and getattr(item, within, None) is not None))
                keys = {r: getattr(item, g) for r, g in shared if getattr(item, g) is not None}
                out.append(entry.replace(**keys) if keys else entry)
            changes[attr] = tuple(out)
        elif kind == "mirror_keys":
            _, attr, req_attr, key_attr, sub_resp = step
            items = getattr(req_value, req_attr, None) if req_value is not None else None
            out = []
            for key in items or ():
                entry = _fill(sub_resp, _EMPTY, None, version, code, message, within, active)
                out.append(entry.replace(**{key_attr: key}))
            changes[attr] = tuple(out)
        elif kind == "struct":
            _, attr, sub_resp = step
            changes[attr] = _fill(sub_resp, _EMPTY, None, version, code, message, within,
                                  active)
    return resp_struct.default.replace(**changes) if changes else resp_struct.default


_EMPTY = StructSpec(name="<none>", message="<none>")


def has_field(struct: StructSpec, attr: str, version: int) -> bool:
    """Whether ``struct`` has the field ``attr`` at ``version``."""
    return any(f.attr == attr and version in f.versions for f in struct.fields)


def array_entry(struct: StructSpec, attr: str, version: int) -> StructSpec:
    """The struct of the entries of ``struct``'s array ``attr``."""
    for f in struct.fields:
        if f.attr == attr and f.struct is not None and version in f.versions:
            return f.struct
    raise KeyError(attr)


def _by_position(api: Any, version: int, body: Any, code: int, message: str | None
                 ) -> dict[str, Any]:
    """The answers' arrays that ``_fill`` cannot match to the request's (see the module's
    docstring), as Kafka's error responses have them; none for the other APIs."""
    root = api.response.root
    name = api.name
    if name in ("CreateAcls", "DeleteAcls"):
        attr, asked = (("results", body.creations) if name == "CreateAcls"
                       else ("filter_results", body.filters))
        entry = array_entry(root, attr, version).default.replace(
            error_code=code, error_message=message)
        return {attr: (entry,) * len(asked)}
    if name == "DescribeUserScramCredentials":  # Kafka names no user in them
        entry = array_entry(root, "results", version).default.replace(
            error_code=code, error_message=message)
        return {"results": (entry,) * len(body.users or ())}
    if name == "AlterUserScramCredentials":
        users = sorted({u.name for u in (*body.deletions, *body.upsertions)})
        entry = array_entry(root, "results", version).default
        return {"results": tuple(entry.replace(user=user, error_code=code,
                                               error_message=message) for user in users)}
    if name == "AlterClientQuotas":
        entry = array_entry(root, "entries", version)
        entity = array_entry(entry, "entity", version).default
        return {"entries": tuple(entry.default.replace(
            entity=tuple(entity.replace(entity_type=e.entity_type, entity_name=e.entity_name)
                         for e in asked.entity),
            error_code=code, error_message=message) for asked in body.entries)}
    if name == "AlterReplicaLogDirs":
        topic = array_entry(root, "results", version)
        partition = array_entry(topic, "partitions", version).default
        return {"results": tuple(topic.default.replace(
            topic_name=t.name,
            partitions=tuple(partition.replace(partition_index=p, error_code=code)
                             for p in t.partitions))
            for d in body.dirs for t in d.topics)}
    return {}


def error_response(req: Request, code: int, message: str | None = None,
                   within: str | None = None) -> Response:
    """``req``'s API's response at ``req``'s version with ``code`` everywhere it fits;
    with ``within`` (a request field such as ``topic_id``), only in the entries that
    answer request entries holding that field, and what they hold: an error of those
    topics, not of the whole request (a Fetch's top-level error ends its session)."""
    api = req.api
    version = req.api_version
    body = _fill(api.response.root, api.request.root, req.body, version, code, message,
                 within, within is None)
    if req.body is not None:
        by_position = _by_position(api, version, req.body, code, message)
        if by_position:
            body = body.replace(**by_position)
    return Response.build(req.api_key, version, req.correlation_id, body)


def carries_error(api_key_spec: Any, version: int) -> bool:
    """Whether the response at ``version`` has any error_code field at all."""
    from gatehouse.codecs.schema import iter_fields

    return any(f.attr == "error_code" for _, f in iter_fields(api_key_spec.response.root, version))
