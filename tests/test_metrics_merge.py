"""Several workers' expositions served as one: every sample labelled with its worker,
each family described once, and the result parses as Prometheus text."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from gatehouse.metrics.merge import merge_by_worker


def worker_exposition(requests: int, connections: int, latencies: list[float]) -> str:
    registry = CollectorRegistry()
    counter = Counter("gatehouse_requests", "Requests", ["api"], registry=registry)
    counter.labels(api="Produce").inc(requests)
    Gauge("gatehouse_connections", "Open connections", ["side"],
          registry=registry).labels(side="client").set(connections)
    histogram = Histogram("gatehouse_request_duration_seconds", "Latency", ["api"],
                          buckets=(0.001, 0.01), registry=registry)
    for value in latencies:
        histogram.labels(api="Produce").observe(value)
    return generate_latest(registry).decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_every_sample_keeps_its_value_under_its_worker() -> None:
    own = GaugeMetricFamily("gatehouse_workers", "Workers", labels=["state"])
    own.add_metric(["ready"], 2)
    text = merge_by_worker([("0", worker_exposition(5, 3, [0.0005, 0.005])),
                            ("1", worker_exposition(7, 1, [0.5]))], own=[own]).decode()
    found = samples(text)
    assert found[("gatehouse_workers", (("state", "ready"),))] == 2
    assert found[("gatehouse_requests_total", (("api", "Produce"), ("worker", "0")))] == 5
    assert found[("gatehouse_requests_total", (("api", "Produce"), ("worker", "1")))] == 7
    assert found[("gatehouse_connections", (("side", "client"), ("worker", "1")))] == 1
    bucket = ("gatehouse_request_duration_seconds_bucket",
              (("api", "Produce"), ("le", "0.01"), ("worker", "0")))
    assert found[bucket] == 2
    assert found[("gatehouse_request_duration_seconds_count",
                  (("api", "Produce"), ("worker", "1")))] == 1
    # One HELP and TYPE per family, however many workers.
    assert text.count("# TYPE gatehouse_requests_total counter") == 1
    assert text.count("# TYPE gatehouse_request_duration_seconds histogram") == 1
    # Nothing but the supervisor's own families without a worker label.
    assert {name for name, labels in found if "worker" not in dict(labels)} == {
        "gatehouse_workers"}


def test_no_worker_answering_leaves_the_supervisors_own_numbers() -> None:
    own = GaugeMetricFamily("gatehouse_workers", "Workers", labels=["state"])
    own.add_metric(["ready"], 0)
    assert samples(merge_by_worker([], own=[own]).decode()) == {
        ("gatehouse_workers", (("state", "ready"),)): 0}
