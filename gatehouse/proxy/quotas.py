"""Rules' quotas as token buckets: what a connection spends, and how long it waits.

A rule's ``quota`` gives a rate per kind (Produce request bytes, Fetch answer bytes,
requests) shared by everyone in one scope (a principal, a client id, a host, a
connection, or the whole rule).  Each (rule, kind, scope) has a bucket that holds up
to a second of its rate and refills at the rate.  A request, or a Fetch answer, spends
from it even past empty: the debt is what the client has taken beyond its rate.  The
client's next request is held (the proxy stops reading that connection: TCP pushes
back) until the debt is paid, as a broker mutes a channel after a response over quota.
The debt is capped at ``MAX_HOLD`` seconds of the rate, as a broker caps a throttle at
its quota window, so one very large answer never holds a client past its request timeout.

Buckets are plain numbers with the time passed in: the connection uses trio's clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Protocol

from gatehouse.rules.model import ClientFacts, Mode, Rule

BURST_SECONDS: Final = 1.0  # a client idle for a while may send a second's worth at once
MAX_HOLD: Final = 10.0  # seconds: the most a bucket's debt (so one hold) can be
MAX_BUCKETS: Final = 10_000  # scopes come from clients (client ids): bounded


class Bucket:
    """A token bucket that may go into debt (see the module's docstring)."""

    __slots__ = ("at", "level", "rate")

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.level = rate * BURST_SECONDS  # full
        self.at: float | None = None  # when ``level`` was last brought up to date

    def _refill(self, now: float) -> None:
        if self.at is not None:
            self.level = min(self.rate * BURST_SECONDS,
                             self.level + (now - self.at) * self.rate)
        self.at = now

    def spend(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level = max(self.level - amount, -self.rate * MAX_HOLD)

    def wait(self, now: float) -> float:
        """Seconds until the debt is paid (0: none)."""
        self._refill(now)
        return 0.0 if self.level >= 0 else -self.level / self.rate

    def idle(self, now: float) -> bool:
        """Full: it remembers nothing a new bucket would not."""
        return self.wait(now) == 0.0 and self.level >= self.rate * BURST_SECONDS

    def set_rate(self, rate: float, now: float) -> None:
        """A new rate (the rules were reloaded): the debt stays, the burst follows."""
        self.wait(now)
        self.rate = rate
        self.level = min(self.level, rate * BURST_SECONDS)


class SharedBuckets(Protocol):
    """Where buckets shared with other processes come from (``sharedquotas``)."""

    def slot(self, key: str, rate: float) -> Any: ...


@dataclass(frozen=True, slots=True)
class Charge:
    """One quota a connection spends from: its rule, the kind, the shared bucket."""

    rule: str
    mode: Mode
    kind: str  # rules.model.QUOTA_KINDS
    bucket: Bucket  # or a sharedquotas.SharedBucket, which behaves the same
    rate: float


class QuotaBuckets:
    """The buckets of every (rule, kind, scope) seen, bounded: past ``MAX_BUCKETS``,
    full buckets are dropped (they hold nothing), then the oldest."""

    def __init__(self, max_buckets: int = MAX_BUCKETS) -> None:
        self.max_buckets = max_buckets
        self.buckets: dict[tuple[str, str, str], Bucket] = {}
        # workers: N: the supervisor's table, so that a quota is the whole proxy's.
        self.shared: SharedBuckets | None = None

    def charges(self, rules: tuple[Rule, ...], facts: ClientFacts, connection: int,
                now: float) -> tuple[Charge, ...]:
        """The charges of connection ``connection``, with ``facts``, under ``rules``
        (each with a quota): each spends from its rule's bucket for its scope."""
        out = []
        for rule in rules:
            assert rule.quota is not None
            scope = rule.quota.scope_key(facts, connection)
            for kind, rate in rule.quota.rates():
                key = (rule.name, kind, scope)
                bucket = self.buckets.get(key)
                if bucket is None:
                    if len(self.buckets) >= self.max_buckets:
                        self._evict(now)
                    shared = (self.shared.slot("\0".join(key), rate)
                              if self.shared is not None else None)
                    bucket = self.buckets[key] = shared or Bucket(rate)
                elif bucket.rate != rate:  # the rules were reloaded with a new rate
                    bucket.set_rate(rate, now)
                out.append(Charge(rule.name, rule.mode, kind, bucket, rate))
        return tuple(out)

    def _evict(self, now: float) -> None:
        for key in [k for k, b in self.buckets.items() if b.idle(now)]:
            del self.buckets[key]
        if len(self.buckets) >= self.max_buckets:
            for key in list(self.buckets)[: max(1, len(self.buckets) // 2)]:
                del self.buckets[key]
