"""The PROXY protocol (HAProxy's, versions 1 and 2): the header a load balancer puts in
front of a connection to say who the client is.

Behind a TCP load balancer (an AWS NLB, HAProxy, Envoy...) every connection comes from
the balancer, so logs, metrics, ``source`` rules and ``max_connections_per_ip`` would
see the balancer.  With ``proxy_protocol: {from: [CIDRs]}`` a connection from one of
those peers must begin with this header, which names the client; other peers are served
as they are (their bytes are never read as a header, so a client cannot pose as another).

The header is read byte-exact (never past its end), so TLS or Kafka bytes after it stay
in the socket.  Spec: https://www.haproxy.org/download/2.9/doc/proxy-protocol.txt
"""

from __future__ import annotations

import ipaddress
import struct
from typing import Final

import trio

V2_SIGNATURE: Final = b"\r\n\r\n\x00\r\nQUIT\n"
V1_PREFIX: Final = b"PROXY "
V1_MAX: Final = 107  # the longest v1 line, CRLF included
V2_MAX_BODY: Final = 4096  # addresses and TLVs; the spec's 16-bit length is more than any LB sends
_V2_FIXED: Final = struct.Struct(">12sBBH")


class ProxyHeaderError(Exception):
    """Bytes that are not a PROXY protocol header (from a peer that must send one)."""


Source = tuple[str, int] | None  # the client's (host, port); None: the balancer's own
# connection (v2 LOCAL, v1 UNKNOWN: a health check), served as its peer's


def parse_v1(line: bytes) -> Source:
    """``PROXY TCP4 <src> <dst> <sport> <dport>\\r\\n`` (or TCP6, or UNKNOWN ...)."""
    if not line.startswith(V1_PREFIX) or not line.endswith(b"\r\n"):
        raise ProxyHeaderError("not a PROXY protocol v1 line")
    parts = line[len(V1_PREFIX):-2].decode("ascii", "replace").split(" ")
    if parts[0] == "UNKNOWN":
        return None
    if parts[0] not in ("TCP4", "TCP6") or len(parts) != 5:
        raise ProxyHeaderError(f"PROXY v1: unexpected {line[:-2]!r}")
    family, source, _, port_text, _ = parts
    try:
        address = ipaddress.ip_address(source)
        port = int(port_text)
    except ValueError:
        raise ProxyHeaderError(f"PROXY v1: bad source {source!r} {port_text!r}") from None
    if (address.version == 4) != (family == "TCP4") or not 0 <= port <= 0xFFFF:
        raise ProxyHeaderError(f"PROXY v1: bad source {source!r} {port_text!r}")
    return str(address), port


def v2_body_length(fixed: bytes) -> int:
    """From a v2 header's first 16 bytes: the length of what follows them."""
    signature, version_command, _, length = _V2_FIXED.unpack(fixed)
    if signature != V2_SIGNATURE:
        raise ProxyHeaderError("not a PROXY protocol v2 signature")
    if version_command >> 4 != 2 or version_command & 0x0F not in (0, 1):
        raise ProxyHeaderError(f"PROXY v2: unknown version/command 0x{version_command:02x}")
    if length > V2_MAX_BODY:
        raise ProxyHeaderError(f"PROXY v2: {length} bytes of addresses and TLVs")
    return int(length)


def parse_v2(fixed: bytes, body: bytes) -> Source:
    """A v2 header: its 16 fixed bytes, then ``v2_body_length`` more (TLVs ignored)."""
    v2_body_length(fixed)
    version_command, family = fixed[12], fixed[13]
    if version_command & 0x0F == 0:  # LOCAL: the balancer's own connection
        return None
    address_family, transport = family >> 4, family & 0x0F
    if address_family == 0 or transport != 1:  # UNSPEC, or not a stream
        return None
    if address_family == 1 and len(body) >= 12:
        return str(ipaddress.IPv4Address(body[0:4])), int.from_bytes(body[8:10], "big")
    if address_family == 2 and len(body) >= 36:
        return str(ipaddress.IPv6Address(body[0:16])), int.from_bytes(body[32:34], "big")
    if address_family == 3:  # UNIX sockets: no address to speak of
        return None
    raise ProxyHeaderError(f"PROXY v2: family 0x{family:02x} with {len(body)} address bytes")


async def _exactly(stream: trio.abc.ReceiveStream, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = await stream.receive_some(n - len(data))
        if not chunk:
            raise ProxyHeaderError("the connection closed before the end of the PROXY "
                                   "protocol header")
        data += chunk
    return data


async def read_proxy_header(stream: trio.abc.ReceiveStream) -> Source:
    """Reads one header (v1 or v2) off ``stream``, not a byte more; the client it names."""
    start = await _exactly(stream, 8)
    if start == V2_SIGNATURE[:8]:
        fixed = start + await _exactly(stream, 8)
        body = await _exactly(stream, v2_body_length(fixed))
        return parse_v2(fixed, body)
    if not start.startswith(V1_PREFIX):
        raise ProxyHeaderError(f"no PROXY protocol header: the connection began {start!r}")
    line = start
    while not line.endswith(b"\r\n"):  # a byte at a time: never past the line's end
        if len(line) >= V1_MAX:
            raise ProxyHeaderError(f"PROXY v1 line longer than {V1_MAX} bytes")
        line += await _exactly(stream, 1)
    return parse_v1(line)
