"""Connection limits at the door, over real sockets: ``limits.max_connections_per_ip``
turns away a host's connections past its share (counted, logged once), and
``limits.max_connections`` every connection past the proxy's (counted, logged each);
either frees a place as connections close."""

from __future__ import annotations

import logging
import socket
import struct
from functools import partial

import pytest
import trio

from gatehouse.logs import FIELDS_ATTR
from gatehouse.metrics import ProxyMetrics
from gatehouse.proxy.config import config_from_text
from gatehouse.proxy.server import Proxy


async def hold(stream: trio.SocketStream) -> None:
    await trio.sleep_forever()  # a broker that keeps the proxy's connections open


async def closed_by_proxy(stream: trio.SocketStream) -> bool:
    """Whether the proxy closed ``stream`` (EOF) rather than keeping it open."""
    with trio.move_on_after(1.0):
        try:
            return await stream.receive_some(1) == b""
        except trio.BrokenResourceError:
            return True
    return False


@pytest.mark.parametrize(("limit", "refused", "logged"), [
    ("max_connections_per_ip", "per-address limit reached", 1),  # once for the host
    ("max_connections", "limit reached", 2),
])
async def test_connections_past_the_limit_are_turned_away(
        limit: str, refused: str, logged: int, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="gatehouse.proxy")
    async with trio.open_nursery() as nursery:
        [broker] = await nursery.start(partial(trio.serve_tcp, hold, 0, host="127.0.0.1"))
        port = broker.socket.getsockname()[1]
        config = config_from_text(
            f"listen: 127.0.0.1:0\nupstream: [127.0.0.1:{port}]\nbrokers: {{start_port: 0}}\n"
            f"limits: {{{limit}: 2, connect_timeout: 0.5}}\n")
        metrics = ProxyMetrics()
        proxy = Proxy(config, observers=[metrics])
        await nursery.start(proxy.serve)
        bootstrap = proxy.bootstrap_ports[0]

        first = [await trio.open_tcp_stream("127.0.0.1", bootstrap) for _ in range(2)]
        while proxy.host_counts.total_open < 2:
            await trio.sleep(0.01)
        turned_away = [await trio.open_tcp_stream("127.0.0.1", bootstrap) for _ in range(2)]
        assert [await closed_by_proxy(s) for s in turned_away] == [True, True]
        assert [await closed_by_proxy(s) for s in first] == [False, False]
        assert metrics.registry.get_sample_value(
            "gatehouse_connections_total", {"side": "client", "outcome": "refused"}) == 2
        refusals = [r for r in caplog.records
                    if r.getMessage() == f"connection refused: {refused}"]
        assert len(refusals) == logged

        # A connection that closes frees its share.
        await first[0].aclose()
        while proxy.host_counts.total_open > 1:
            await trio.sleep(0.01)
        again = await trio.open_tcp_stream("127.0.0.1", bootstrap)
        assert not await closed_by_proxy(again)
        for stream in (*first[1:], *turned_away, again):
            await stream.aclose()
        proxy.shutdown()
        nursery.cancel_scope.cancel()


async def test_a_client_that_resets_before_the_proxy_accepts_is_still_named(
        caplog: pytest.LogCaptureFixture) -> None:
    """A connection reset while it waits in the listen queue has no peer left for
    getpeername, but accept(2) gave its address: the proxy's close line names the client
    (not "?"), and a balancer's health check is still known as the balancer's."""
    caplog.set_level(logging.INFO, logger="gatehouse.proxy")
    async with trio.open_nursery() as nursery:
        [broker] = await nursery.start(partial(trio.serve_tcp, hold, 0, host="127.0.0.1"))
        port = broker.socket.getsockname()[1]
        proxy = Proxy(config_from_text(f"listen: 127.0.0.1:0\nupstream: [127.0.0.1:{port}]\n"
                                       "brokers: {start_port: 0}\n"
                                       "limits: {connect_timeout: 0.5}\n"))
        await nursery.start(proxy.serve)
        # Connected and reset without a checkpoint: the proxy's accept comes after.
        client = socket.create_connection(("127.0.0.1", proxy.bootstrap_ports[0]))
        named = f"127.0.0.1:{client.getsockname()[1]}"
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.close()  # an RST, not a FIN

        def closes() -> list[str]:
            return [getattr(r, FIELDS_ATTR)["client"] for r in caplog.records
                    if r.getMessage() == "connection closed"]

        with trio.fail_after(10):
            while not closes():
                await trio.sleep(0.01)
        assert closes() == [named]
        proxy.shutdown()
        nursery.cancel_scope.cancel()
