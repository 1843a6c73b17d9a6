"""A real Gatehouse proxy on real sockets, run by trio in a background thread.

Blocking clients (librdkafka, kafka-python, Java tools) talk to it from the test's thread.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from typing import Any

import trio

from gatehouse.configfile import load_yaml_text
from gatehouse.metrics import ProxyMetrics
from gatehouse.proxy.config import config_from_text
from gatehouse.proxy.hooks import Observer, Policy
from gatehouse.proxy.policy import RulesPolicy
from gatehouse.proxy.server import Proxy
from gatehouse.rules import parse_rules


class ProxyThread:
    """``with ProxyThread(upstream, rules_yaml=...) as p: p.bootstrap``."""

    def __init__(self, upstream: str | None = None, *, extra_config: str = "",
                 rules_yaml: str | None = None, policy: Policy | None = None,
                 observers: Sequence[Observer] = (), config_text: str | None = None,
                 metrics: bool = True) -> None:
        """``config_text``, when given, is the whole config (fixed ports, say, so that a
        restarted proxy comes back where its clients left it); else one is made for
        ``upstream`` with OS-chosen ports, plus ``extra_config``.  ``metrics=False``: no
        metrics observer (the plain proxy, which moves large frames socket to socket)."""
        if config_text is None:
            config_text = (f"listen: 127.0.0.1:0\nupstream: [{upstream}]\n"
                           "brokers: {start_port: 0}\n" + extra_config)
        self.config = config_from_text(config_text)
        if policy is None and rules_yaml is not None:
            policy = RulesPolicy(parse_rules(load_yaml_text(rules_yaml, "rules.yaml"),
                                             "rules.yaml"))
        self.policy = policy or Policy()
        self.metrics = ProxyMetrics(client_telemetry=self.config.client_telemetry)
        if isinstance(self.policy, RulesPolicy):
            self.metrics.attach(self.policy, None)
        self.metered = metrics
        self.proxy = Proxy(self.config, self.policy,
                           [self.metrics, *observers] if metrics else list(observers),
                           client_telemetry=self.metrics.client_telemetry if metrics else None)
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._started = threading.Event()
        self.error: BaseException | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.proxy.bootstrap_ports[0]}"

    @property
    def port(self) -> int:
        """The bootstrap port."""
        return self.proxy.bootstrap_ports[0]

    @property
    def broker_ports(self) -> set[int]:
        return {b.port for b in self.proxy.brokers.values()}

    @property
    def ports(self) -> set[int]:
        return {*self.proxy.bootstrap_ports, *self.broker_ports}

    def _run(self) -> None:
        async def main() -> None:
            self._token = trio.lowlevel.current_trio_token()
            async with trio.open_nursery() as nursery:
                await nursery.start(self.proxy.serve)
                self._started.set()

        try:
            trio.run(main)
        except BaseException as exc:  # surfaced to the test by stop()
            self.error = exc
            self._started.set()

    def start(self) -> ProxyThread:
        self._thread = threading.Thread(target=self._run, name="gatehouse-proxy", daemon=True)
        self._thread.start()
        self._started.wait(60)
        if self.error is not None:
            raise RuntimeError("proxy failed to start") from self.error
        return self

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def call(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)`` in the proxy's trio thread (e.g. to swap rules)."""
        return trio.from_thread.run_sync(fn, *args, trio_token=self._token)

    def stop(self) -> None:
        if self._thread is None:
            return
        if self._token is not None and self._thread.is_alive():
            with contextlib.suppress(trio.RunFinishedError):
                self.call(self.proxy.shutdown)
        self._thread.join(self.config.limits.shutdown_grace + 10)
        assert not self._thread.is_alive(), "the proxy did not stop"
        if self.error is not None:
            raise RuntimeError("the proxy crashed") from self.error
        if self.proxy.internal_errors:  # contained to their connections, but bugs
            raise RuntimeError("the proxy hit an internal error") from (
                self.proxy.internal_errors[0])

    def sample(self, name: str, **labels: str) -> float:
        assert self.metered, "this proxy has no metrics observer: every sample would be 0"
        value = self.metrics.registry.get_sample_value(name, labels)
        return value or 0.0

    def summed(self, name: str, **labels: str) -> float:
        """``sample`` over every label set that holds ``labels`` (the others any)."""
        assert self.metered, "this proxy has no metrics observer: every sample would be 0"
        return sum(s.value for metric in self.metrics.registry.collect()
                   for s in metric.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    def summed_by(self, name: str, label: str, **labels: str) -> dict[str, float]:
        """``summed`` for each value of ``label`` (the samples that hold ``labels``)."""
        assert self.metered, "this proxy has no metrics observer: every sample would be 0"
        found: dict[str, float] = {}
        for metric in self.metrics.registry.collect():
            for s in metric.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    found[s.labels[label]] = found.get(s.labels[label], 0.0) + s.value
        return found

    def sample_reaches(self, name: str, minimum: float, timeout: float = 10.0,
                       **labels: str) -> float:
        """``sample``, read again until it reaches ``minimum`` (or ``timeout`` passes):
        for gauges of live connections, which a client opens and closes as it goes, and
        counts of what a client does not wait on (acks=0 requests)."""
        deadline = time.monotonic() + timeout
        while (value := self.sample(name, **labels)) < minimum and time.monotonic() < deadline:
            time.sleep(0.05)
        return value

    def __enter__(self) -> ProxyThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
