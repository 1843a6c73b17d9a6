"""The proxy's memory: the byte budget all connections share (large frames wait for it
instead of growing RSS) and the start-up heap frozen out of the collector's walks."""

from __future__ import annotations

import struct

import pytest
import trio
import trio.testing

from gatehouse.proxy.budget import ByteBudget
from gatehouse.proxy.config import Limits
from gatehouse.proxy.connection import ConnectionContext, ProxyConnection
from gatehouse.proxy.hooks import ConnectionInfo, Observer, Policy
from tests.support.fakebroker import FrameStream, request

KIB = 1024


async def test_take_is_immediate_while_bytes_are_free_and_fifo_after() -> None:
    budget = ByteBudget(100)
    assert await budget.take(60) == 60
    order: list[str] = []

    async def taker(name: str, size: int) -> None:
        await budget.take(size)
        order.append(name)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(taker, "big", 80)
        await trio.testing.wait_all_tasks_blocked()
        # 10 bytes would fit, but the big frame waits first: it is not starved.
        nursery.start_soon(taker, "small", 10)
        await trio.testing.wait_all_tasks_blocked()
        assert order == [] and budget.waits == 2
        budget.give(40)  # room for the big one only (20 + 80)
        await trio.testing.wait_all_tasks_blocked()
        assert order == ["big"] and budget.held == 100
        budget.give(80)
        await trio.testing.wait_all_tasks_blocked()
        assert order == ["big", "small"]
    assert budget.held == 30


async def test_a_frame_larger_than_the_budget_takes_all_of_it() -> None:
    budget = ByteBudget(100)
    assert await budget.take(10_000) == 100
    assert budget.held == 100


async def test_a_cancelled_waiter_leaves_the_line_and_unblocks_the_next() -> None:
    budget = ByteBudget(100)
    await budget.take(50)
    got: list[int] = []

    async def take(size: int) -> None:
        got.append(await budget.take(size))

    async with trio.open_nursery() as nursery:
        async with trio.open_nursery() as big_waiter:
            big_waiter.start_soon(take, 90)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(take, 40)  # fits, but waits behind the 90
            await trio.testing.wait_all_tasks_blocked()
            assert got == []
            big_waiter.cancel_scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert got == [40] and budget.held == 90


def test_a_budget_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        ByteBudget(0)


def _big_produce(correlation_id: int, size: int) -> bytes:
    req = request(0, 9, correlation_id, acks=1, timeout_ms=1000, topic_data=[
        {"name": "t", "partition_data": [{"index": 0, "records": b"x" * size}]}])
    body = bytes(req.encode())
    return struct.pack(">i", len(body)) + body


async def test_connections_share_the_request_budget_and_wait_for_it() -> None:
    """Two clients each send a 700 KiB request through a 1 MiB budget to brokers that do
    not read yet: the second client's frame is not read past its first chunk until the
    first frame has gone upstream and given its bytes back."""
    ctx = _context(max_buffered_request_bytes=1024 * KIB)
    frames = [_big_produce(1, 700 * KIB), _big_produce(2, 700 * KIB)]
    clients, brokers, conns = [], [], []
    async with trio.open_nursery() as nursery:
        for i in range(2):
            client, proxy_client = trio.testing.lockstep_stream_pair()
            proxy_upstream, broker = trio.testing.lockstep_stream_pair()
            conn = ConnectionInfo(id=i, client=f"10.0.0.{i}:1", listener="bootstrap",
                                  upstream="broker:9092")
            nursery.start_soon(ProxyConnection(proxy_client, proxy_upstream, conn, ctx).run)
            clients.append(client)
            brokers.append(FrameStream(broker))
            conns.append(conn)

        nursery.start_soon(clients[0].send_all, frames[0])
        await trio.testing.wait_all_tasks_blocked()
        assert ctx.request_budget.held == len(frames[0])  # parked in the upstream send
        nursery.start_soon(clients[1].send_all, frames[1])
        await trio.testing.wait_all_tasks_blocked()
        assert ctx.request_budget.waits == 1
        assert conns[1].bytes_from_client <= 256 * KIB  # stopped reading: TCP pushes back

        first = await brokers[0].receive()  # the first broker reads: bytes given back
        second = await brokers[1].receive()
        assert first is not None and bytes(first) == frames[0][4:]
        assert second is not None and bytes(second) == frames[1][4:]
        await trio.testing.wait_all_tasks_blocked()
        assert ctx.request_budget.held == 0
        nursery.cancel_scope.cancel()


async def test_a_connection_that_ends_gives_its_bytes_back() -> None:
    """A client that sends half of a large frame and goes away frees its reservation."""
    ctx = _context(max_buffered_request_bytes=1024 * KIB)
    frame = _big_produce(1, 700 * KIB)
    client, proxy_client = trio.testing.memory_stream_pair()
    proxy_upstream, _broker = trio.testing.memory_stream_pair()
    conn = ConnectionInfo(id=1, client="10.0.0.1:1", listener="bootstrap", upstream="b:9092")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ProxyConnection(proxy_client, proxy_upstream, conn, ctx).run)
        await client.send_all(frame[: 300 * KIB])
        await trio.testing.wait_all_tasks_blocked()
        assert ctx.request_budget.held == len(frame)
        await client.aclose()
        await trio.testing.wait_all_tasks_blocked()
        assert ctx.request_budget.held == 0


async def test_large_responses_share_the_response_budget() -> None:
    """A broker answering with a frame larger than the response budget: the frame still
    arrives whole (it takes all of the budget) and the budget is whole again after."""
    ctx = _context(max_buffered_response_bytes=64 * KIB)
    client, proxy_client = trio.testing.memory_stream_pair()
    proxy_upstream, broker = trio.testing.memory_stream_pair()
    conn = ConnectionInfo(id=1, client="10.0.0.1:1", listener="bootstrap", upstream="b:9092")
    client_frames, broker_frames = FrameStream(client), FrameStream(broker)
    async with trio.open_nursery() as nursery:
        pumps = ProxyConnection(proxy_client, proxy_upstream, conn, ctx)
        nursery.start_soon(pumps.run)
        await client_frames.send(request(1, 4, 7, replica_id=-1, max_wait_ms=0, min_bytes=0,
                                         topics=[]).encode())
        assert await broker_frames.receive() is not None
        answer = struct.pack(">i", 7) + b"\0" * (500 * KIB)
        await broker_frames.send_raw(struct.pack(">i", len(answer)) + answer)
        got = await client_frames.receive()
        assert got is not None and bytes(got) == answer, pumps.close_reason
        await trio.testing.wait_all_tasks_blocked()
        assert ctx.response_budget.held == 0 and ctx.response_budget.waits == 0
        nursery.cancel_scope.cancel()


def _context(**limits: int) -> ConnectionContext:
    return ConnectionContext(
        limits=Limits(**limits), observer=Observer(), address_mapper=lambda real: None,
        brokers_seen=_nothing, draining=trio.Event(), get_policy=lambda: Policy())


async def _nothing(seen: object) -> None:
    return None


async def test_gatehouse_run_freezes_the_start_up_heap_once_ready() -> None:
    """Full collections must not walk the codec tables while traffic waits (see
    freeze_heap_when_ready): the freeze happens once the proxy is ready, not before."""
    import gc
    from types import SimpleNamespace

    from gatehouse.proxy.setup import freeze_heap_when_ready

    gc.unfreeze()
    proxy = SimpleNamespace(ready=trio.Event())
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(freeze_heap_when_ready, proxy)
            await trio.testing.wait_all_tasks_blocked()
            assert gc.get_freeze_count() == 0
            proxy.ready.set()
        assert gc.get_freeze_count() > 10_000
    finally:
        gc.unfreeze()
