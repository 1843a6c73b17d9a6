"""Reading single facts from a frame without decoding its body.

A proxy must know whether a Produce request expects a response (acks=0 does not)
before it forwards it; decoding the whole body (every topic and partition) just for
that would waste the lazy header decode.
"""

from __future__ import annotations

import struct

from gatehouse.codecs.errors import RemoteProtocolError
from gatehouse.codecs.frames import Request
from gatehouse.codecs.primitives import Buffer, read_uvarint

PRODUCE = 0
_INT16 = struct.Struct(">h")


def produce_acks(req: Request) -> int:
    """The ``Acks`` of a Produce request, read from its bytes (or its decoded body), once
    for all who ask (the pumps, the policy, the observation log)."""
    if req.api_key != PRODUCE:
        raise ValueError("not a Produce request")
    return req.read_once("peek.produce_acks", _produce_acks)  # type: ignore[no-any-return]


def _produce_acks(req: Request) -> int:
    if req.body_decoded or req.frame is None:
        return int(req.body.acks)
    frame = req.frame
    pos = req._body_offset
    version = req.api_version
    try:
        if version >= 3:  # TransactionalId (nullable string) comes first
            if version >= 9:
                n, pos = read_uvarint(frame, pos)
                pos += max(n - 1, 0)
            else:
                (n,) = _INT16.unpack_from(frame, pos)
                pos += 2 + max(n, 0)
        (acks,) = _INT16.unpack_from(frame, pos)
    except (struct.error, RemoteProtocolError):
        raise RemoteProtocolError(
            "Produce request ends before its acks",
            api_key=PRODUCE,
            api_version=version,
            api_name="Produce",
            path=("acks",),
            offset=pos,
        ) from None
    return int(acks)


def api_versions_scan(frame: Buffer, version: int) -> tuple[dict[int, int], tuple[int, ...]] | None:
    """The error code of an ApiVersions response (``frame`` from the correlation id on),
    as ``produce.response_scan`` gives codes: its only one, right after the correlation
    id in every version (the header is v0 even for flexible versions, KIP-511), so the
    ~90 entries need no decode.  None for a frame too short to hold it."""
    if len(frame) < 6:
        return None
    return {_INT16.unpack_from(frame, 4)[0]: 1}, ()
