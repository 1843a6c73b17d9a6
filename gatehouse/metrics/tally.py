"""Counters and histograms for the proxy's hot path: plain numbers, no locks.

prometheus_client's metrics take a lock on every increment (threads may share them) and
go through three Python calls to do it; with about eight updates per request that was a
quarter of what the metrics cost the proxy.  The proxy updates its metrics from its one
trio thread only, so a child here is a bare number that thread adds to.  Scrapes run on
the metrics server's thread and read the numbers through ``collect``: each read is of a
whole float (the GIL), and the children are copied before they are walked.

The families expose what prometheus_client's ``Counter`` and ``Histogram`` would
(``<name>_total``; ``_bucket{le}``, ``_sum``, ``_count``), without ``_created``.
"""

from __future__ import annotations

import contextlib
import importlib
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any, Generic, TypeVar

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from gatehouse.codecs._native import speedups

# The metrics' counting of the usual exchange in C (_counting.c), where built, with its
# Tally; the Python below stays the reference.  GATEHOUSE_PURE_PYTHON, which turns off
# the C byte readers, turns this off too.
counting: ModuleType | None = None
if speedups is not None:
    with contextlib.suppress(ImportError):  # not built here
        counting = importlib.import_module("gatehouse.metrics._counting")


class Tally:
    """One counter child: ``inc`` adds, nothing else."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("counters only go up")
        self.value += amount


class HistogramTally:
    """One histogram child: a count per bucket (upper bounds, ``le``) and the sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value


Child = TypeVar("Child", Tally, HistogramTally)


class _Family(Generic[Child]):
    """Children by label values, as prometheus_client's ``labels()`` gives them."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.children: dict[tuple[str, ...], Child] = {}

    def _new_child(self) -> Child:
        raise NotImplementedError

    def labels(self, *values: str, **named: str) -> Child:
        if named:
            if values or set(named) != set(self.labelnames):
                raise ValueError(f"{self.name}: labels are {', '.join(self.labelnames)}")
            values = tuple(named[n] for n in self.labelnames)
        elif len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: labels are {', '.join(self.labelnames)}")
        key = tuple(str(v) for v in values)
        child = self.children.get(key)
        if child is None:
            child = self.children[key] = self._new_child()
        return child

    def describe(self) -> Iterator[Metric]:
        return iter(())  # the registry need not call collect() to learn the names


# What children are: the C ones where the counting is in C (it adds to them directly),
# else the Python ones.  Both have ``value`` and ``inc``; ``observe``, ``counts``, ``sum``.
_NEW_TALLY: Any = Tally if counting is None else counting.Tally
_NEW_HISTOGRAM: Any = HistogramTally if counting is None else counting.HistogramTally


class CounterFamily(_Family[Tally]):
    def _new_child(self) -> Tally:
        return _NEW_TALLY()  # type: ignore[no-any-return]

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for key, child in list(self.children.items()):
            family.add_metric(key, child.value)
        yield family


class HistogramFamily(_Family[HistogramTally]):
    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 buckets: Sequence[float]) -> None:
        super().__init__(name, documentation, labelnames)
        self.bounds = tuple(sorted(float(b) for b in buckets if b != float("inf")))
        # As prometheus_client writes its own bounds (dashboards match on le="0.001").
        self._le = [floatToGoString(b) for b in self.bounds] + ["+Inf"]  # type: ignore[no-untyped-call]

    def _new_child(self) -> HistogramTally:
        return _NEW_HISTOGRAM(self.bounds)  # type: ignore[no-any-return]

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for key, child in list(self.children.items()):
            counts, total = list(child.counts), child.sum
            cumulative, buckets = 0, []
            for le, n in zip(self._le, counts, strict=True):
                cumulative += n
                buckets.append((le, float(cumulative)))
            family.add_metric(key, buckets, total)
        yield family
