"""Wiring a config file into a running proxy: rules, metrics, capture, signals."""

from __future__ import annotations

from pathlib import Path

import trio

from gatehouse.proxy.config import ProxyConfig, load_config
from gatehouse.proxy.hooks import Observer, Policy
from gatehouse.proxy.server import Proxy


def load_everything(path: str | Path) -> tuple[ProxyConfig, Policy]:
    """The config and the policy it names; raises ConfigError with file:line."""
    config = load_config(path)
    return config, build_policy(config)


def build_policy(config: ProxyConfig) -> Policy:
    return Policy()


def build_observers(config: ProxyConfig) -> list[Observer]:
    return []


async def run_configured(config: ProxyConfig, policy: Policy, path: str | Path) -> None:
    from gatehouse.cli import handle_signals

    proxy = Proxy(config, policy, build_observers(config))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(handle_signals, proxy, None)
        await proxy.serve()
        nursery.cancel_scope.cancel()
