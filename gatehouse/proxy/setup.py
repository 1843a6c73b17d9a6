"""Wiring a config file into a running proxy: rules, metrics, capture, signals."""

from __future__ import annotations

import gc
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import trio

from gatehouse.proxy.config import ProxyConfig, load_config
from gatehouse.proxy.hooks import Observer, Policy
from gatehouse.proxy.hostcounts import HostCounts
from gatehouse.proxy.policy import Reloader, RulesPolicy, RulesSource
from gatehouse.proxy.server import Proxy
from gatehouse.rules import RuleSet, load_rules_file, parse_rules

if TYPE_CHECKING:
    from gatehouse.proxy.workers import SupervisorLink

RELOAD_POLL_SECONDS = 1.0


def load_everything(path: str | Path) -> tuple[ProxyConfig, RulesPolicy]:
    """The config and the policy its rules make; raises ConfigError with file:line."""
    config = load_config(path)
    return config, RulesPolicy(load_ruleset(config))


def load_ruleset(config: ProxyConfig) -> RuleSet:
    if config.rules_file is not None:
        return load_rules_file(config.rules_file)
    return parse_rules(config.rules, config.source)


def rules_source(config: ProxyConfig, path: str | Path | None) -> RulesSource:
    return RulesSource(Path(path) if path is not None else None, config.rules_file, config.rules)


def build_observers(config: ProxyConfig, policy: Policy, reloader: Reloader | None
                    ) -> list[Observer]:
    observers: list[Observer] = []
    registry = None  # the capture's counters join the metrics, when there are metrics
    if config.metrics_listen is not None:
        from gatehouse.metrics import ProxyMetrics

        metrics = ProxyMetrics(label_cap=config.metrics_label_cap,
                               client_telemetry=config.client_telemetry)
        metrics.attach(policy, reloader)
        observers.append(metrics)
        registry = metrics.registry
    if config.capture is not None:
        from gatehouse.capture.kafka_sink import sink_for
        from gatehouse.capture.observer import CaptureObserver

        capture = CaptureObserver(config.capture, registry=registry, kafka=sink_for(config))
        capture.attach(policy)
        observers.append(capture)
    return observers


def close_observers(observers: list[Observer]) -> None:
    """Flush what observers hold (the capture's queued records) on shutdown."""
    from gatehouse.capture.observer import CaptureObserver

    for observer in observers:
        if isinstance(observer, CaptureObserver):
            observer.close()


class Reloadable(Protocol):
    def changed(self) -> bool: ...
    def reload(self) -> bool: ...


async def watch_files(*watched: Reloadable, poll: float = RELOAD_POLL_SECONDS) -> None:
    """Reload what reads a file (the rules, the TLS certificates) when that file changes
    (polling: no inotify dependency)."""
    while True:
        await trio.sleep(poll)
        for each in watched:
            if each.changed():
                each.reload()


def reload_all(*watched: Reloadable) -> None:
    """SIGHUP: each reloads from its files (a bad one keeps its old state and says so)."""
    for each in watched:
        each.reload()


async def freeze_heap_when_ready(proxy: Proxy) -> None:
    """Move what start-up built (codec tables, rules, config) out of the collector's reach.

    A full collection walks every tracked object: tens of milliseconds with the codec
    tables, a pause every request in flight would wait for.  Frozen, the objects of
    start-up are never walked again, and a full collection of what traffic allocates
    takes microseconds.
    """
    await proxy.ready.wait()
    gc.collect()
    gc.freeze()


async def _report_ready(proxy: Proxy, link: SupervisorLink) -> None:
    await proxy.ready.wait()
    await link.report(ready=True)


async def run_configured(config: ProxyConfig, policy: RulesPolicy, path: str | Path,
                         link: SupervisorLink | None = None,
                         host_counts: HostCounts | None = None) -> None:
    """Run the proxy a config describes until it is stopped; ``link``: this process is
    a worker of a supervisor (``workers: N``), which it reports to, and
    ``host_counts`` the connections per address it counts with the other workers."""
    from gatehouse.cli import handle_signals

    reloader = Reloader(policy, rules_source(config, path),
                        shared_identity=config.sasl_upstream is not None)
    observers = build_observers(config, policy, reloader)
    proxy = Proxy(config, policy, observers, host_counts,
                  client_telemetry=(observers[0].client_telemetry  # type: ignore[attr-defined]
                                    if config.metrics_listen is not None else None))
    if config.metrics_listen is not None:
        observers[0].watch_buffers(proxy.ctx.request_budget,  # type: ignore[attr-defined]
                                   proxy.ctx.response_budget)
        observers[0].watch_tls(proxy.tls)  # type: ignore[attr-defined]
        if proxy.sasl_tokens is not None:
            observers[0].watch_jwks(proxy.sasl_tokens)  # type: ignore[attr-defined]
    try:
        async with trio.open_nursery() as nursery:
            watched: list[Reloadable] = [reloader, proxy.tls]
            if proxy.sasl_users is not None:
                watched.append(proxy.sasl_users)
            if proxy.sasl_tokens is not None:
                watched.append(proxy.sasl_tokens)
            nursery.start_soon(handle_signals, proxy, partial(reload_all, *watched))
            nursery.start_soon(watch_files, *watched)
            nursery.start_soon(freeze_heap_when_ready, proxy)
            if config.metrics_listen is not None:
                from gatehouse.metrics import ConnectionsEndpoint, serve_metrics

                port = await nursery.start(partial(
                    serve_metrics, config.metrics_listen, observers[0],  # type: ignore[arg-type]
                    lambda: proxy.ready.is_set() and proxy.upstream_reachable,
                    # A worker's is for its supervisor to read (over loopback).
                    connections=ConnectionsEndpoint(proxy.live.json, (
                        "local" if link is not None and config.metrics_connections == "any"
                        else config.metrics_connections))))
                if link is not None:
                    await link.report(metrics_port=port)
            if link is not None:
                nursery.start_soon(link.watch, proxy.shutdown)
                nursery.start_soon(_report_ready, proxy, link)
            await proxy.serve()
            nursery.cancel_scope.cancel()
    finally:
        close_observers(observers)
