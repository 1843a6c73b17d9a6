"""A broker that does not answer at the address the proxy knows: the proxy asks the
cluster where its brokers are (at most once per few seconds, and within the connect
timeout) and tries a new address at once.  tests/integration/test_proxy_brokers.py moves
a real broker to another port."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from gatehouse.proxy.addresses import BrokerAddress
from gatehouse.proxy.config import config_from_text
from gatehouse.proxy.server import BrokerListener, Proxy, UpstreamUnavailable

CONNECT_TIMEOUT = 3
OLD, NEW = BrokerAddress(1, "10.0.0.2", 9092), BrokerAddress(1, "10.0.0.3", 9092)


def proxy_knowing_broker_1(answers_at: BrokerAddress | None,
                           tried: list[Any]) -> Proxy:
    """A proxy that knows broker 1 at ``OLD``, whose broker connections succeed only to
    ``answers_at``, recording each address tried (``None``: the bootstrap servers)."""
    proxy = Proxy(config_from_text(
        f"listen: 127.0.0.1:0\nupstream: [10.0.0.1:9092]\n"
        f"limits: {{connect_timeout: {CONNECT_TIMEOUT}}}\n"))
    proxy.brokers[1] = BrokerListener(1, 9001, OLD)

    async def open_upstream(node_id: int | None) -> Any:
        target = None if node_id is None else proxy.brokers[node_id].real
        tried.append(target)
        if target is not None and target == answers_at:
            return f"connected to {target.host}"
        raise UpstreamUnavailable("refused")

    proxy.open_upstream = open_upstream  # type: ignore[method-assign]
    return proxy


async def test_a_broker_moved_elsewhere_is_tried_at_its_new_address_at_once(
        autojump_clock: trio.abc.Clock) -> None:
    tried: list[Any] = []
    proxy = proxy_knowing_broker_1(NEW, tried)

    async def discover() -> None:  # the cluster's Metadata names broker 1 at NEW
        tried.append("discover")
        proxy.brokers[1].real = NEW

    proxy.discover = discover  # type: ignore[method-assign]
    assert await proxy._open_upstream_where_it_is(1) == "connected to 10.0.0.3"
    assert tried == [OLD, "discover", NEW]


async def test_a_broker_gone_where_it_was_is_reported_after_one_bounded_look(
        autojump_clock: trio.abc.Clock) -> None:
    tried: list[Any] = []
    proxy = proxy_knowing_broker_1(None, tried)

    async def discover() -> None:  # bootstrap servers that swallow connections
        tried.append("discover")
        await trio.sleep_forever()

    proxy.discover = discover  # type: ignore[method-assign]
    start = trio.current_time()
    with pytest.raises(UpstreamUnavailable):
        await proxy._open_upstream_where_it_is(1)
    assert trio.current_time() - start == CONNECT_TIMEOUT
    # The next connections within a few seconds are refused at once: no second look.
    with pytest.raises(UpstreamUnavailable):
        await proxy._open_upstream_where_it_is(1)
    assert tried == [OLD, "discover", OLD]
    assert trio.current_time() - start == CONNECT_TIMEOUT
    # The bootstrap's own connections never look (the cluster is what they reach).
    with pytest.raises(UpstreamUnavailable):
        await proxy._open_upstream_where_it_is(None)
    assert tried == [OLD, "discover", OLD, None]
