"""The PROXY protocol header (v1 and v2): parsed exactly, read without a byte past its
end, and mistakes in the config reported with file:line."""

from __future__ import annotations

import ipaddress
import struct

import pytest
import trio
import trio.testing

from gatehouse.configfile import ConfigError
from gatehouse.proxy.config import config_from_text
from gatehouse.proxy.proxyprotocol import (
    V2_SIGNATURE,
    ProxyHeaderError,
    parse_v1,
    read_proxy_header,
)


def v2(command: int = 1, family: int = 0x11, body: bytes = b"") -> bytes:
    return V2_SIGNATURE + struct.pack(">BBH", 0x20 | command, family, len(body)) + body


def inet(source: str, port: int, tlvs: bytes = b"") -> bytes:
    return (ipaddress.IPv4Address(source).packed + ipaddress.IPv4Address("10.0.0.1").packed
            + struct.pack(">HH", port, 9192) + tlvs)


def inet6(source: str, port: int) -> bytes:
    return (ipaddress.IPv6Address(source).packed + ipaddress.IPv6Address("::1").packed
            + struct.pack(">HH", port, 9192))


async def read(data: bytes) -> tuple[object, bytes]:
    """The header read from ``data`` followed by Kafka bytes, and the bytes left after."""
    send, receive = trio.testing.memory_stream_pair()
    await send.send_all(data + b"\x00\x00\x00\x0bKAFKA-BYTES")
    source = await read_proxy_header(receive)
    await send.aclose()
    rest = b""
    while chunk := await receive.receive_some(1000):
        rest += chunk
    return source, rest


@pytest.mark.parametrize("header, source", [
    (b"PROXY TCP4 198.51.100.7 10.0.0.1 56324 9192\r\n", ("198.51.100.7", 56324)),
    (b"PROXY TCP6 2001:db8::7 ::1 443 9192\r\n", ("2001:db8::7", 443)),
    (b"PROXY UNKNOWN\r\n", None),  # the balancer's own connection: served as its peer
    (b"PROXY UNKNOWN ffff:f...f:ffff ffff:f...f:ffff 65535 65535\r\n", None),
    (v2(body=inet("203.0.113.9", 4242)), ("203.0.113.9", 4242)),
    (v2(body=inet("203.0.113.9", 4242, tlvs=b"\x04\x00\x02ab" * 10)), ("203.0.113.9", 4242)),
    (v2(family=0x21, body=inet6("2001:db8::9", 7)), ("2001:db8::9", 7)),
    (v2(command=0, family=0x00), None),  # LOCAL: a health check
    (v2(family=0x00), None),  # UNSPEC
])
async def test_headers_name_the_client_and_leave_the_rest_unread(
        header: bytes, source: object) -> None:
    assert await read(header) == (source, b"\x00\x00\x00\x0bKAFKA-BYTES")


@pytest.mark.parametrize("data, message", [
    (b"\x00\x00\x00\x1a\x00\x12\x00\x03", "no PROXY protocol header: the connection began"),
    (b"PROXY TCP4 198.51.100.7 10.0.0.1 99999 9192\r\n", "PROXY v1: bad source"),
    (b"PROXY TCP4 2001:db8::7 10.0.0.1 1 9192\r\n", "PROXY v1: bad source"),
    (b"PROXY TCP4 not-an-address 10.0.0.1 1 9192\r\n", "PROXY v1: bad source"),
    (b"PROXY UDP4 198.51.100.7 10.0.0.1 1 2\r\n", "PROXY v1: unexpected"),
    (b"PROXY TCP4 " + b"1" * 200, "PROXY v1 line longer than 107 bytes"),
    (V2_SIGNATURE + b"\x31\x11\x00\x0c" + bytes(12), "unknown version/command 0x31"),
    (V2_SIGNATURE + b"\x21\x11\xff\xff", "65535 bytes of addresses and TLVs"),
    (v2(body=b"\x01\x02\x03"), "family 0x11 with 3 address bytes"),
])
async def test_what_is_not_a_header_is_an_error(data: bytes, message: str) -> None:
    with pytest.raises(ProxyHeaderError, match=message.replace("(", r"\(")):
        await read(data)


async def test_a_header_cut_short_is_an_error() -> None:
    send, receive = trio.testing.memory_stream_pair()
    await send.send_all(b"PROXY TCP4 198.51")
    await send.aclose()
    with pytest.raises(ProxyHeaderError,
                       match="closed before the end of the PROXY protocol header"):
        await read_proxy_header(receive)


def test_parse_v1_wants_the_whole_line() -> None:
    with pytest.raises(ProxyHeaderError):
        parse_v1(b"PROXY TCP4 198.51.100.7 10.0.0.1 1 2")


def test_config() -> None:
    base = "listen: 127.0.0.1:9192\nupstream: [x:1]\n"
    assert config_from_text(base).proxy_protocol_from == ()
    config = config_from_text(base + "proxy_protocol: {from: [10.0.0.0/8, 192.0.2.7]}\n")
    assert config.proxy_protocol_from == (ipaddress.ip_network("10.0.0.0/8"),
                                          ipaddress.ip_network("192.0.2.7/32"))
    for text, line, message in [
        ("proxy_protocol: {}\n", 3, "proxy_protocol needs 'from'"),
        ("proxy_protocol:\n  from: [10.0.0.0/8, lb.example.com]\n", 4,
         "proxy_protocol.from: 'lb.example.com' is not a CIDR"),
        ("proxy_protocol:\n  from: 10.0.0.0/8\n  v2_only: true\n", 5, "v2_only"),
    ]:
        with pytest.raises(ConfigError) as info:
            config_from_text(base + text, "proxy.yaml")
        assert str(info.value).startswith(f"proxy.yaml:{line}: "), str(info.value)
        assert message in str(info.value)
