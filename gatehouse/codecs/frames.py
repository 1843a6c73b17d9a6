"""Requests and responses: headers decoded eagerly, bodies lazily, bytes reused.

A decoded ``Request``/``Response`` keeps the frame it came from.  Its body is decoded
on first access.  Encoding an unchanged message returns the original frame object; a
message changed with ``replace()`` is re-encoded by splicing: every top-level field that
is still the very object that was decoded is copied from the original bytes.
"""

from __future__ import annotations

import struct
from typing import Any, ClassVar, Final, NamedTuple

from gatehouse.codecs._compile import MessageCodec, message_codec, new_output
from gatehouse.codecs.errors import (
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
    UnknownApi,
)
from gatehouse.codecs.primitives import Buffer, read_uvarint, write_tag_section
from gatehouse.codecs.schema import API_VERSIONS_KEY, APIS, ApiSpec, MessageSpec

_HEAD: Final = struct.Struct(">hhih")  # api key, version, correlation id, client id length
_HEAD_NO_CLIENT: Final = struct.Struct(">hhi")
_I16: Final = struct.Struct(">h")
_I32: Final = struct.Struct(">i")

UNSUPPORTED_VERSION: Final = 35

# (api_key << 16 | version) -> request header version, for every version we know.
_REQUEST_HEADER_VERSION: Final[dict[int, int]] = {
    (a.key << 16) | v: a.request_header_version(v) for a in APIS.values() for v in a.versions
}
# ControlledShutdown v0 uses request header v0 (no ClientId).  Kafka 4 removed the API
# from its specs, but the header layout is still what such a frame has on the wire.
CONTROLLED_SHUTDOWN_KEY: Final = 7
_REQUEST_HEADER_VERSION[CONTROLLED_SHUTDOWN_KEY << 16] = 0
# api_key -> (lo, hi) of the versions whose responses have header v1 (tagged fields):
# the flexible range, open-ended, so versions newer than the tables still have a known
# header.  ApiVersions responses always use header v0 (KIP-511).
_RESPONSE_HEADER_V1: Final[dict[int, tuple[int, int]]] = {
    a.key: (a.response.flexible.lo, a.response.flexible.hi)
    for a in APIS.values() if a.key != API_VERSIONS_KEY
}
# Exceptions that values of the wrong type or range raise while a header is packed.
_BAD_VALUE: Final = (struct.error, TypeError, ValueError, AttributeError, OverflowError)


class RequestHeader(NamedTuple):
    """Request header v0-v2.  ``client_id`` is None in v0 (and when sent as null)."""

    api_key: int
    api_version: int
    correlation_id: int
    client_id: str | None
    unknown_tags: tuple[tuple[int, bytes], ...] = ()

    def replace(self, **changes: Any) -> RequestHeader:
        return self._replace(**changes)


class ResponseHeader(NamedTuple):
    """Response header v0/v1."""

    correlation_id: int
    unknown_tags: tuple[tuple[int, bytes], ...] = ()

    def replace(self, **changes: Any) -> ResponseHeader:
        return self._replace(**changes)


_UNSET: Final[Any] = object()


def _api_name(api_key: int) -> str | None:
    spec = APIS.get(api_key)
    return None if spec is None else spec.name


def _owned(frame: Buffer) -> Buffer:
    """The frame itself if nobody can change it (bytes, read-only views), else a copy.

    A message decodes its body lazily and encodes as its frame: both must see the bytes
    as they were when the message was decoded, not what a caller's reused buffer holds now.
    """
    if isinstance(frame, bytes):
        return frame
    if isinstance(frame, memoryview) and frame.readonly:
        return frame
    return bytes(frame)


def _readonly(frame: Buffer) -> memoryview:
    """A read-only view of the frame; records fields are slices of it (no copies)."""
    view = memoryview(frame)
    if not view.readonly:  # a caller's bytearray may change under us: take a copy
        view = memoryview(bytes(view))
    return view


_tuple_new: Final = tuple.__new__
_CLIENT_ID_PATH: Final = ("header", "ClientId")


def _read_header_tags(view: memoryview, pos: int) -> tuple[tuple[tuple[int, bytes], ...], int]:
    try:
        return _read_header_tag_section(view, pos)
    except ProtocolError as exc:
        raise exc.within("_tagged_fields").within("header") from None


def _read_header_tag_section(view: memoryview, pos: int) -> tuple[tuple[tuple[int, bytes], ...], int]:
    count, pos = read_uvarint(view, pos)
    if not count:
        return (), pos
    tags = []
    last = -1
    for _ in range(count):
        tag, pos = read_uvarint(view, pos)
        if tag <= last:
            raise RemoteProtocolError(f"header tagged field {tag} repeated or out of order", offset=pos)
        last = tag
        size, pos = read_uvarint(view, pos)
        if pos + size > len(view):
            raise RemoteProtocolError("header tagged field runs past the end of the frame", offset=pos)
        tags.append((tag, bytes(view[pos : pos + size])))
        pos += size
    return tuple(tags), pos


def _write_header_tags(out: bytearray, tags: tuple[tuple[int, bytes], ...]) -> None:
    write_tag_section(out, list(tags), "header tagged field")


class _Message:
    """What requests and responses share: lazy body, splicing encoder."""

    __slots__ = (
        "_body", "_body_offset", "_frame", "_orig_body", "_orig_header", "_read", "_spans",
        "_trailing", "header",
    )

    header: Any
    _frame: Buffer | None
    _body_offset: int
    _body: Any
    _orig_header: Any
    _orig_body: Any
    _read: dict[str, Any] | None  # read_once: set on first use
    _spans: tuple[int, ...] | None

    api_key: int
    api_version: int

    # (api key, version) -> codec, one table per message kind (requests, responses).
    _codecs: ClassVar[dict[tuple[int, int], MessageCodec]]

    def _message_spec(self) -> MessageSpec:
        raise NotImplementedError

    @property
    def api(self) -> ApiSpec:
        """The API's table entry; raises ``UnknownApi`` for keys/versions we don't know."""
        spec = APIS.get(self.api_key)
        if spec is None or self.api_version not in spec.versions:
            raise UnknownApi(
                "API key or version not in the codec's tables",
                api_key=self.api_key,
                api_version=self.api_version,
                api_name=spec.name if spec else None,
            )
        return spec

    @property
    def known(self) -> bool:
        """Whether the codec can decode this message's body."""
        spec = APIS.get(self.api_key)
        return spec is not None and self.api_version in spec.versions

    @property
    def body(self) -> Any:
        """The body record, decoded from the frame on first access."""
        body = self._body
        if body is _UNSET:
            body = self._decode_body()
        return body

    @property
    def body_decoded(self) -> bool:
        return self._body is not _UNSET

    @property
    def frame(self) -> Buffer | None:
        """The bytes this message was decoded from (None if built in code)."""
        return self._frame

    def _codec(self) -> MessageCodec:
        """The compiled codec of this message's body (key and version checked once)."""
        key = (self.api_key, self.api_version)
        codec = self._codecs.get(key)
        if codec is None:
            codec = self._codecs[key] = message_codec(self._message_spec(), key[1])
        return codec

    def _decode_body(self) -> Any:
        assert self._frame is not None
        codec = self._codec()
        view = _readonly(self._frame)[self._body_offset :]
        try:
            body, end, spans = codec.read(view)
        except ProtocolError as exc:
            if exc.offset is not None:
                exc.offset += self._body_offset
            raise exc.at_api(self.api_key, self.api_version, self.api.name) from None
        if end != len(view) and isinstance(self, Request):
            # Kafka's broker ignores bytes after a request body, and real clients send
            # some (librdkafka 2.x's Metadata v13 carries 3 extra bytes): tolerate them
            # as the broker does, and keep them so they are forwarded as they came.
            self._trailing = bytes(view[end:])
        elif end != len(view):
            raise RemoteProtocolError(
                f"{len(view) - end} unexpected bytes after the body",
                api_key=self.api_key,
                api_version=self.api_version,
                api_name=self.api.name,
                offset=self._body_offset + end,
            )
        self._body = self._orig_body = body
        self._spans = spans
        return body

    def _encode_header(self, out: bytearray) -> None:
        raise NotImplementedError

    def encode(self) -> Buffer:
        """The wire bytes of this message (without the 4-byte size prefix)."""
        frame = self._frame
        if (frame is not None and self.header is self._orig_header
                and (self._body is _UNSET or self._body is self._orig_body)):
            return frame  # unchanged: the original bytes, not a copy
        out = new_output()
        view = None if frame is None else _readonly(frame)
        if view is not None and self.header is self._orig_header:
            out += view[: self._body_offset]
        else:
            self._encode_header(out)
        body = self.body
        codec = self._codec()
        try:
            if view is not None and self._spans is not None:
                codec.encode_spliced(out, body, self._orig_body, view[self._body_offset :], self._spans)
            else:
                codec.write(out, body)
        except ProtocolError as exc:
            raise exc.at_api(self.api_key, self.api_version, self.api.name) from None
        if view is not None:
            out += self.trailing
        return out.finish()

    def read_once(self, name: str, read: Any) -> Any:
        """``read(self)``, remembered under ``name`` for this message: what a fast reader
        took from the frame (codecs.produce), for every observer that asks."""
        # Set to None by every constructor (an unset slot would raise inside getattr: slow).
        found: dict[str, Any] | None = getattr(self, "_read", None)
        if found is None:
            found = self._read = {}
        elif name in found:
            return found[name]
        value = found[name] = read(self)
        return value

    @property
    def trailing(self) -> bytes:
        """Bytes after a request's body that the broker would ignore (kept verbatim)."""
        try:
            return self._trailing
        except AttributeError:
            return b""

    def __repr__(self) -> str:
        body = repr(self._body) if self._body is not _UNSET else "<not decoded>"
        return f"{type(self).__name__}({self.header!r}, body={body})"

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, _Message)
        return (
            self.header == other.header
            and self.api_key == other.api_key
            and self.api_version == other.api_version
            and self.body == other.body
        )

    __hash__ = None  # type: ignore[assignment]


class Request(_Message):
    """A Kafka request: ``header`` (always decoded) and ``body`` (decoded when read)."""

    __slots__ = ()
    header: RequestHeader
    _codecs = {}

    @property
    def api_key(self) -> int:  # type: ignore[override]
        return self.header.api_key

    @property
    def api_version(self) -> int:  # type: ignore[override]
        return self.header.api_version

    @property
    def correlation_id(self) -> int:
        return self.header.correlation_id

    @property
    def header_version(self) -> int | None:
        """1 or 2 by the flexible-version rule (0 for ControlledShutdown v0); None if unknown."""
        return _REQUEST_HEADER_VERSION.get((self.api_key << 16) | self.api_version)

    def _message_spec(self) -> MessageSpec:
        return self.api.request

    @classmethod
    def build(
        cls,
        api_key: int,
        api_version: int,
        correlation_id: int,
        client_id: str | None,
        body: Any,
    ) -> Request:
        """A request made in code (encoded in full by ``encode``)."""
        req = object.__new__(cls)
        req.header = RequestHeader(api_key, api_version, correlation_id, client_id)
        req._frame = None
        req._body_offset = 0
        req._body = body
        req._orig_header = req._orig_body = _UNSET
        req._spans = req._read = None
        req.api  # noqa: B018 - validates key and version
        return req

    def replace(self, *, header: RequestHeader | None = None, body: Any = _UNSET) -> Request:
        """A copy with a new header and/or body; unchanged parts are spliced on encode."""
        if body is not _UNSET and self._frame is not None:
            self.body  # noqa: B018 - the original must be decoded to splice against it
        new = object.__new__(Request)
        new.header = self.header if header is None else header
        new._frame = self._frame
        new._body_offset = self._body_offset
        new._body = self._body if body is _UNSET else body
        new._orig_header = self._orig_header
        new._orig_body = self._orig_body
        new._spans = self._spans
        new._read = None  # what was read once is of the original
        new._trailing = self.trailing
        if new._frame is not None and (
            new.header.api_key != self.api_key or new.header.api_version != self.api_version
        ):
            raise LocalProtocolError("replace() cannot change the API key or version of a decoded request")
        return new

    def _encode_header(self, out: bytearray) -> None:
        h = self.header
        version = self.header_version
        if version is None:
            raise LocalProtocolError(
                "cannot encode a request of an unknown API version", api_key=h.api_key,
                api_version=h.api_version,
            )
        try:
            out += _HEAD_NO_CLIENT.pack(h.api_key, h.api_version, h.correlation_id)
            if version >= 1:
                if h.client_id is None:
                    out += b"\xff\xff"
                else:
                    raw = h.client_id.encode()
                    out += _I16.pack(len(raw))
                    out += raw
            if version >= 2:
                _write_header_tags(out, h.unknown_tags)
            elif h.unknown_tags:
                raise LocalProtocolError("tagged fields in a request header below v2")
        except _BAD_VALUE as exc:
            raise LocalProtocolError(
                f"cannot encode request header: {exc}", api_key=h.api_key,
                api_version=h.api_version, api_name=_api_name(h.api_key),
            ) from None


class Response(_Message):
    """A Kafka response.  Responses do not say which API they answer: the caller does."""

    __slots__ = ("_api_key", "_api_version")
    header: ResponseHeader
    _api_key: int
    _api_version: int
    _codecs = {}

    @property
    def api_key(self) -> int:  # type: ignore[override]
        return self._api_key

    @property
    def api_version(self) -> int:  # type: ignore[override]
        """The version the body is written in (0 for a v0-format ApiVersions fallback)."""
        return self._api_version

    @property
    def correlation_id(self) -> int:
        return self.header.correlation_id

    @property
    def header_version(self) -> int:
        spec = APIS.get(self._api_key)
        if spec is None:
            return 0
        return spec.response_header_version(self._api_version)

    def _message_spec(self) -> MessageSpec:
        return self.api.response

    @classmethod
    def build(cls, api_key: int, api_version: int, correlation_id: int, body: Any) -> Response:
        resp = object.__new__(cls)
        resp.header = ResponseHeader(correlation_id)
        resp._api_key = api_key
        resp._api_version = api_version
        resp._frame = None
        resp._body_offset = 0
        resp._body = body
        resp._orig_header = resp._orig_body = _UNSET
        resp._spans = resp._read = None
        resp.api  # noqa: B018 - validates key and version
        return resp

    def replace(self, *, header: ResponseHeader | None = None, body: Any = _UNSET) -> Response:
        if body is not _UNSET and self._frame is not None:
            self.body  # noqa: B018
        new = object.__new__(Response)
        new.header = self.header if header is None else header
        new._api_key = self._api_key
        new._api_version = self._api_version
        new._frame = self._frame
        new._body_offset = self._body_offset
        new._body = self._body if body is _UNSET else body
        new._orig_header = self._orig_header
        new._orig_body = self._orig_body
        new._spans = self._spans
        new._read = None  # what was read once is of the original
        return new

    def _encode_header(self, out: bytearray) -> None:
        h = self.header
        try:
            out += _I32.pack(h.correlation_id)
            if self.header_version >= 1:
                _write_header_tags(out, h.unknown_tags)
            elif h.unknown_tags:
                raise LocalProtocolError("tagged fields in a response header v0")
        except _BAD_VALUE as exc:
            raise LocalProtocolError(
                f"cannot encode response header: {exc}", api_key=self._api_key,
                api_version=self._api_version, api_name=_api_name(self._api_key),
            ) from None


def decode_request_header(frame: Buffer) -> RequestHeader:
    """Only the header (api key, version, correlation id, client id) of a request frame."""
    return decode_request(frame).header


def _decoding_header_version(api_key: int, api_version: int) -> int:
    """The request header version to read: from the tables, else by the flexible rule.

    A client may send a version newer than the tables (a newer Kafka): its API's flexible
    range is open-ended ("9+"), so the header layout is known even though the body is not.
    Unknown API keys are read as header v1 (v2 shares its layout up to the tag section).
    """
    known = _REQUEST_HEADER_VERSION.get((api_key << 16) | api_version)
    if known is not None:
        return known
    spec = APIS.get(api_key)
    if spec is None or api_version < 0:
        return 1
    return spec.request_header_version(api_version)


def _header_error(reason: str, offset: int, api_key: int, api_version: int) -> RemoteProtocolError:
    return RemoteProtocolError(reason, api_key=api_key, api_version=api_version,
                               api_name=_api_name(api_key), path=_CLIENT_ID_PATH, offset=offset)


def decode_request(frame: Buffer) -> Request:
    """A request from the bytes after its 4-byte size prefix.  Decodes the header only.

    Unknown API keys and versions decode too (header v1 layout, which v2 shares up to
    its tag section); their body raises ``UnknownApi``.  A mutable buffer (bytearray)
    is copied first, so the message does not change when the caller reuses it.
    """
    if type(frame) is not bytes:
        frame = _owned(frame)
    try:
        api_key, api_version, correlation_id, n = _HEAD.unpack_from(frame, 0)
    except struct.error:
        if len(frame) >= 8:  # header v0 without a client id (ControlledShutdown v0)
            api_key, api_version, correlation_id = _HEAD_NO_CLIENT.unpack_from(frame, 0)
            n = None
        else:
            raise RemoteProtocolError(
                f"request frame of {len(frame)} bytes is shorter than a request header", offset=0
            ) from None
    header_version = _REQUEST_HEADER_VERSION.get((api_key << 16) | api_version)
    if header_version is None:
        header_version = _decoding_header_version(api_key, api_version)
    tags: tuple[tuple[int, bytes], ...] = ()
    client_id: str | None = None
    if header_version == 0:
        pos = 8
    elif n is None:
        raise _header_error("request header ends before its client id", 8, api_key, api_version)
    elif n >= 0:
        pos = 10 + n
        if pos > len(frame):
            raise _header_error("client id runs past the end of the frame", 8, api_key, api_version)
        try:
            client_id = str(frame[10:pos], "utf-8") if n else ""
        except UnicodeDecodeError:
            raise _header_error("client id is not valid UTF-8", 10, api_key, api_version) from None
    elif n == -1:
        pos = 10
    else:
        raise _header_error(f"negative client id length {n}", 8, api_key, api_version)
    if header_version == 2:
        if pos < len(frame) and frame[pos] == 0:  # the usual empty tag section
            pos += 1
        else:
            try:
                tags, pos = _read_header_tags(memoryview(frame), pos)
            except ProtocolError as exc:
                raise exc.at_api(api_key, api_version, _api_name(api_key)) from None
    req = object.__new__(Request)
    # tuple.__new__ skips the namedtuple's Python-level __new__: the hot path of a proxy
    req.header = req._orig_header = _tuple_new(
        RequestHeader, (api_key, api_version, correlation_id, client_id, tags))
    req._frame = frame
    req._body_offset = pos
    req._body = req._orig_body = _UNSET
    req._spans = req._read = None
    return req


def _first_field_throttles() -> dict[int, Any]:
    """api_key -> the versions whose response body begins with ``throttle_time_ms``."""
    out = {}
    for spec in APIS.values():
        fields = spec.response.root.fields
        if fields and fields[0].attr == "throttle_time_ms" and fields[0].tag is None:
            out[spec.key] = fields[0].versions
    return out


_THROTTLE_FIRST: Final = _first_field_throttles()


def throttle_time_at(frame: Buffer, api_key: int, api_version: int) -> int | None:
    """Where a response's ``throttle_time_ms`` (int32) is in ``frame`` (which starts at
    the correlation id) when it is the body's first field, as in most APIs, so that it
    can be changed in place without decoding the body; None when it is elsewhere or
    absent at this version (Produce, ApiVersions, v0 of most), or the header is cut off
    before it."""
    versions = _THROTTLE_FIRST.get(api_key)
    if versions is None or api_version not in versions:
        return None
    pos = 4
    flexible = _RESPONSE_HEADER_V1.get(api_key)
    if flexible is not None and flexible[0] <= api_version <= flexible[1]:
        try:
            _, pos = _read_header_tag_section(memoryview(frame), pos)
        except (ProtocolError, IndexError):
            return None
    return pos if pos + 4 <= len(frame) else None


def decode_response(frame: Buffer, api_key: int, api_version: int) -> Response:
    """A response to a request of ``api_key``/``api_version``.  Decodes the header only.

    ApiVersions is special (KIP-35): a broker that does not support the requested version
    answers UNSUPPORTED_VERSION in the v0 format.  Such a response decodes with
    ``api_version == 0``, which is what its bytes are.
    """
    if type(frame) is not bytes:
        frame = _owned(frame)
    if len(frame) < 4:
        raise RemoteProtocolError(
            f"response frame of {len(frame)} bytes is shorter than a response header", offset=0
        )
    (correlation_id,) = _I32.unpack_from(frame, 0)
    pos = 4
    tags: tuple[tuple[int, bytes], ...] = ()
    flexible = _RESPONSE_HEADER_V1.get(api_key)
    if flexible is not None and flexible[0] <= api_version <= flexible[1]:
        if pos < len(frame) and frame[pos] == 0:
            pos += 1
        else:
            try:
                tags, pos = _read_header_tags(memoryview(frame), pos)
            except ProtocolError as exc:
                raise exc.at_api(api_key, api_version, APIS[api_key].name) from None
    resp = object.__new__(Response)
    resp.header = resp._orig_header = _tuple_new(ResponseHeader, (correlation_id, tags))
    resp._api_key = api_key
    resp._api_version = api_version
    resp._frame = frame
    resp._body_offset = pos
    resp._body = resp._orig_body = _UNSET
    resp._spans = resp._read = None
    if api_key == API_VERSIONS_KEY and api_version != 0:
        _settle_api_versions_format(resp)
    return resp


def _settle_api_versions_format(resp: Response) -> None:
    """Pick the format an ApiVersions response is really in (see ``decode_response``)."""
    frame = resp._frame
    assert frame is not None
    error = _I16.unpack_from(frame, 4)[0] if len(frame) >= 6 else None
    requested = resp._api_version
    # A v0 fallback answer says UNSUPPORTED_VERSION; try that first, as clients do.
    order = [0, requested] if error == UNSUPPORTED_VERSION else [requested, 0]
    for version in order:
        if version not in APIS[API_VERSIONS_KEY].versions:
            continue
        resp._api_version = version
        try:
            resp._decode_body()
            return
        except ProtocolError:
            resp._body = resp._orig_body = _UNSET
    resp._api_version = requested  # neither fits: report the error on access


def encode_request(req: Request) -> Buffer:
    """The frame of a request (no size prefix): the original bytes if unchanged."""
    return req.encode()


def encode_response(resp: Response) -> Buffer:
    return resp.encode()


def size_prefixed(frame: Buffer) -> bytes:
    """The frame with its 4-byte size prefix, ready for the socket."""
    return _I32.pack(len(frame)) + bytes(frame)
