"""The consumer protocol payloads carried as bytes inside group APIs.

JoinGroup's protocol metadata and SyncGroup's assignments are opaque bytes to the
broker.  For ``protocol_type == "consumer"`` they hold ConsumerProtocolSubscription /
ConsumerProtocolAssignment, each prefixed with its own int16 version.  As Kafka's
``ConsumerProtocol`` does, a version newer than we know is read as the newest we know;
the bytes we could not interpret are kept in ``trailing`` and written back unchanged.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, replace
from typing import Any, Final

from gatehouse.codecs._compile import message_codec
from gatehouse.codecs.errors import ProtocolError, RemoteProtocolError
from gatehouse.codecs.primitives import Buffer
from gatehouse.codecs.schema import MESSAGES, MessageSpec

CONSUMER_PROTOCOL_TYPE: Final = "consumer"
SUBSCRIPTION: Final = MESSAGES["ConsumerProtocolSubscription"]
ASSIGNMENT: Final = MESSAGES["ConsumerProtocolAssignment"]
_VERSION: Final = struct.Struct(">h")


@dataclass(frozen=True, slots=True)
class ConsumerProtocolData:
    """A decoded subscription or assignment, with the version it was written in."""

    spec: MessageSpec
    version: int  # as written on the wire (may be newer than we know)
    body: Any  # the record (ConsumerProtocolSubscription / ...Assignment)
    trailing: bytes = b""  # bytes of fields newer than we know, kept verbatim

    def replace(self, **changes: Any) -> ConsumerProtocolData:
        return replace(self, **changes)

    def encode(self) -> bytes:
        read_as = min(self.version, self.spec.valid.hi)
        out = bytearray(_VERSION.pack(self.version))
        message_codec(self.spec, read_as).write(out, self.body)
        out += self.trailing
        return bytes(out)


def _decode(spec: MessageSpec, data: Buffer) -> ConsumerProtocolData:
    view = memoryview(data)
    if len(view) < 2:
        raise RemoteProtocolError(f"{spec.name}: {len(view)} bytes, too short for a version", offset=0)
    (version,) = _VERSION.unpack_from(view, 0)
    if version < spec.valid.lo:
        raise RemoteProtocolError(f"{spec.name}: unsupported version {version}", offset=0)
    read_as = min(version, spec.valid.hi)
    try:
        body, end, _ = message_codec(spec, read_as).read(view[2:])
    except ProtocolError as exc:
        if exc.offset is not None:
            exc.offset += 2
        exc.api_name = spec.name
        exc.api_version = version
        raise
    trailing = bytes(view[2 + end :])
    if trailing and version <= spec.valid.hi:
        raise RemoteProtocolError(
            f"{spec.name} v{version}: {len(trailing)} unexpected bytes after the body", offset=2 + end
        )
    return ConsumerProtocolData(spec, version, body, trailing)


def decode_subscription(data: Buffer) -> ConsumerProtocolData:
    """JoinGroup request protocol metadata / JoinGroup response member metadata."""
    return _decode(SUBSCRIPTION, data)


def decode_assignment(data: Buffer) -> ConsumerProtocolData:
    """SyncGroup assignment bytes (both directions), DescribeGroups member assignment."""
    return _decode(ASSIGNMENT, data)


def subscription(version: int, **fields: Any) -> ConsumerProtocolData:
    """Build a subscription in code: ``subscription(3, topics=("orders",))``."""
    return ConsumerProtocolData(SUBSCRIPTION, version, SUBSCRIPTION.root.cls(**fields))


def assignment(version: int, **fields: Any) -> ConsumerProtocolData:
    return ConsumerProtocolData(ASSIGNMENT, version, ASSIGNMENT.root.cls(**fields))
