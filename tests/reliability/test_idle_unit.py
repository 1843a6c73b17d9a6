"""The idle timeout counts whole requests, not bytes (unit test, autojump clock)."""

from __future__ import annotations

import trio
import trio.testing

from gatehouse.proxy.config import Limits
from gatehouse.proxy.connection import ConnectionContext, ProxyConnection
from gatehouse.proxy.hooks import ConnectionInfo, Observer, Policy
from tests.support.fakebroker import FakeBroker, frame_bytes, request, response_body


async def _never_called(real: object) -> None:
    raise AssertionError("no broker addresses expected")


async def test_trickled_bytes_do_not_keep_a_connection_alive(
        autojump_clock: trio.testing.MockClock) -> None:
    client, proxy_client = trio.testing.memory_stream_pair()
    proxy_upstream, broker_side = trio.testing.memory_stream_pair()
    ctx = ConnectionContext(limits=Limits(idle_timeout=30), observer=Observer(),
                            address_mapper=lambda real: None, brokers_seen=_never_called,
                            draining=trio.Event(), get_policy=Policy)
    conn = ConnectionInfo(id=1, client="127.0.0.1:5555", listener="bootstrap")
    pumps = ProxyConnection(proxy_client, proxy_upstream, conn, ctx)
    broker = FakeBroker(broker_side, lambda req: response_body(3, req.api_version))
    wire = frame_bytes(request(3, 12, 1).encode())
    closed_at: list[float] = []

    async def run_pumps() -> None:
        await pumps.run()
        closed_at.append(trio.current_time())

    with trio.fail_after(300):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_pumps)
            nursery.start_soon(broker.serve)
            # A whole request at t=0..: activity; then one byte every 10 s of the next.
            await client.send_all(wire)
            assert await client.receive_some(65536)
            for i in range(len(wire) - 1):
                if closed_at:
                    break
                await trio.sleep(10)
                try:
                    await client.send_all(wire[i:i + 1])
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    break
            await trio.sleep(60)
            nursery.cancel_scope.cancel()
    assert closed_at and 30 <= closed_at[0] <= 41
    assert pumps.close_reason == "idle timeout"
