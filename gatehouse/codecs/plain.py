"""Messages as plain data (dicts, lists, str, int, float, bool, bytes, None) and back.

Keys are the specs' field names in snake_case; only fields that exist in the message's
version appear.  Tagged fields the tables do not know are kept under ``_unknown_tags``
as ``[[tag, bytes], ...]`` so that the round trip stays byte-identical.  UUIDs become
their canonical strings; records become bytes.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any, Final

from gatehouse.codecs.errors import LocalProtocolError
from gatehouse.codecs.frames import Request, RequestHeader, Response, ResponseHeader
from gatehouse.codecs.schema import APIS, FieldSpec, MessageSpec, StructSpec

UNKNOWN_TAGS_KEY: Final = "_unknown_tags"


def _value_to_plain(f: FieldSpec, value: Any, version: int) -> Any:
    if value is None:
        return None
    if f.is_array:
        if f.struct is not None:
            return [struct_to_dict(f.struct, item, version) for item in value]
        return [_scalar_to_plain(f.type, item) for item in value]
    if f.struct is not None:
        return struct_to_dict(f.struct, value, version)
    return _scalar_to_plain(f.type, value)


def _scalar_to_plain(type_name: str, value: Any) -> Any:
    if type_name == "uuid":
        return str(value)
    if type_name in ("bytes", "records"):
        return bytes(value)
    return value


def struct_to_dict(struct: StructSpec, record: Any, version: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f, value in zip(struct.fields, record, strict=False):
        if version in f.versions:
            out[f.attr] = _value_to_plain(f, value, version)
    if record.unknown_tags:
        out[UNKNOWN_TAGS_KEY] = [[tag, bytes(raw)] for tag, raw in record.unknown_tags]
    return out


def _header_tags(tags: tuple[tuple[int, bytes], ...], out: dict[str, Any]) -> dict[str, Any]:
    if tags:
        out[UNKNOWN_TAGS_KEY] = [[tag, bytes(raw)] for tag, raw in tags]
    return out


def to_dict(message: Request | Response) -> dict[str, Any]:
    """``{"header": {...}, "body": {...}}`` for a request or response."""
    version = message.api_version
    if isinstance(message, Request):
        h = message.header
        header: dict[str, Any] = {
            "api_key": h.api_key,
            "api_version": h.api_version,
            "correlation_id": h.correlation_id,
        }
        if message.header_version != 0:
            header["client_id"] = h.client_id
        spec = message.api.request
    else:
        header = {"correlation_id": message.header.correlation_id}
        spec = message.api.response
    _header_tags(message.header.unknown_tags, header)
    return {"header": header, "body": struct_to_dict(spec.root, message.body, version)}


# -- back from plain data --------------------------------------------------------------


def _scalar_from_plain(f: FieldSpec, value: Any, path: str) -> Any:
    if value is None:
        return None
    t = f.type
    if t == "uuid":
        if isinstance(value, uuid.UUID):
            return value
        try:
            return uuid.UUID(value)
        except (TypeError, ValueError, AttributeError):
            raise LocalProtocolError(f"{path}: not a UUID: {value!r}") from None
    if t in ("bytes", "records"):
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise LocalProtocolError(f"{path}: expected bytes, got {type(value).__name__}")
        return bytes(value)
    if t == "string" and not isinstance(value, str):
        raise LocalProtocolError(f"{path}: expected a string, got {type(value).__name__}")
    if t == "bool" and not isinstance(value, bool):
        raise LocalProtocolError(f"{path}: expected a bool, got {type(value).__name__}")
    if t == "float64":
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise LocalProtocolError(f"{path}: expected a number, got {type(value).__name__}")
        return float(value)
    if t.startswith(("int", "uint")) and (not isinstance(value, int) or isinstance(value, bool)):
        raise LocalProtocolError(f"{path}: expected an integer, got {type(value).__name__}")
    return value


def _value_from_plain(f: FieldSpec, value: Any, version: int, path: str) -> Any:
    if value is None:
        return None
    if f.is_array:
        if not isinstance(value, (list, tuple)):
            raise LocalProtocolError(f"{path}: expected a list, got {type(value).__name__}")
        if f.struct is not None:
            return tuple(
                struct_from_dict(f.struct, item, version, f"{path}[{i}]") for i, item in enumerate(value)
            )
        return tuple(_scalar_from_plain(f, item, f"{path}[{i}]") for i, item in enumerate(value))
    if f.struct is not None:
        return struct_from_dict(f.struct, value, version, path)
    return _scalar_from_plain(f, value, path)


def _tags_from_plain(value: Any, path: str) -> tuple[tuple[int, bytes], ...]:
    try:
        tags = tuple((tag, raw) for tag, raw in value)
    except (TypeError, ValueError):
        tags = None
    if tags is None or not all(
        isinstance(tag, int) and not isinstance(tag, bool) and tag >= 0
        and isinstance(raw, (bytes, bytearray, memoryview))
        for tag, raw in tags
    ):
        raise LocalProtocolError(f"{path}.{UNKNOWN_TAGS_KEY}: expected [[tag, bytes], ...]")
    return tuple((tag, bytes(raw)) for tag, raw in tags)


def struct_from_dict(struct: StructSpec, plain: Any, version: int, path: str = "body") -> Any:
    if not isinstance(plain, Mapping):
        raise LocalProtocolError(f"{path}: expected a mapping, got {type(plain).__name__}")
    by_attr = {f.attr: f for f in struct.fields}
    for key in plain:
        if key != UNKNOWN_TAGS_KEY and key not in by_attr:
            raise LocalProtocolError(f"{path}: {struct.name} has no field {key!r}")
    values = []
    for f in struct.fields:
        if f.attr in plain:
            if version not in f.versions:
                raise LocalProtocolError(f"{path}.{f.attr}: not in version {version}")
            values.append(_value_from_plain(f, plain[f.attr], version, f"{path}.{f.attr}"))
        else:
            values.append(f.default)
    values.append(_tags_from_plain(plain.get(UNKNOWN_TAGS_KEY, ()), path))
    return struct.cls(*values)


def _split(plain: Any) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    if not isinstance(plain, Mapping) or "header" not in plain or "body" not in plain:
        raise LocalProtocolError('expected {"header": {...}, "body": {...}}')
    return plain["header"], plain["body"]


def body_from_dict(spec: MessageSpec, plain: Any, version: int) -> Any:
    return struct_from_dict(spec.root, plain, version)


def request_from_dict(plain: Mapping[str, Any]) -> Request:
    header, body = _split(plain)
    try:
        api_key, api_version = header["api_key"], header["api_version"]
        correlation_id = header["correlation_id"]
    except KeyError as exc:
        raise LocalProtocolError(f"header: missing {exc.args[0]!r}") from None
    if api_key not in APIS or api_version not in APIS[api_key].versions:
        raise LocalProtocolError(f"unknown API key {api_key} version {api_version}")
    spec = APIS[api_key].request
    req = Request.build(
        api_key, api_version, correlation_id, header.get("client_id"),
        body_from_dict(spec, body, api_version),
    )
    tags = _tags_from_plain(header.get(UNKNOWN_TAGS_KEY, ()), "header")
    if tags:
        req = req.replace(header=req.header._replace(unknown_tags=tags))
    return req


def response_from_dict(plain: Mapping[str, Any], *, api_key: int, api_version: int) -> Response:
    header, body = _split(plain)
    if api_key not in APIS or api_version not in APIS[api_key].versions:
        raise LocalProtocolError(f"unknown API key {api_key} version {api_version}")
    try:
        correlation_id = header["correlation_id"]
    except KeyError:
        raise LocalProtocolError("header: missing 'correlation_id'") from None
    spec = APIS[api_key].response
    resp = Response.build(api_key, api_version, correlation_id, body_from_dict(spec, body, api_version))
    tags = _tags_from_plain(header.get(UNKNOWN_TAGS_KEY, ()), "header")
    if tags:
        resp = resp.replace(header=ResponseHeader(correlation_id, tags))
    return resp


__all__ = [
    "RequestHeader",
    "request_from_dict",
    "response_from_dict",
    "struct_from_dict",
    "struct_to_dict",
    "to_dict",
]
