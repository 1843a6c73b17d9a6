"""`gatehouse top`'s arithmetic: rates between scrapes, counter resets, quantiles."""

from __future__ import annotations

import io
import math

import pytest
from prometheus_client import generate_latest
from rich.console import Console

from gatehouse.cli.top import ScrapeError, latency_quantiles, parse, quantile, rates, render
from gatehouse.metrics import ProxyMetrics
from gatehouse.metrics.telemetry import TelemetrySettings
from gatehouse.proxy.hooks import ConnectionInfo
from tests.support.fakebroker import request
from tests.support.otlp import gauge, kv, metrics_data


def test_quantile_interpolates_like_prometheus() -> None:
    # 10 observations <= 0.1, 10 more <= 0.2: the median is the bucket edge, p75 halfway.
    buckets = {0.1: 10.0, 0.2: 20.0, math.inf: 20.0}
    assert quantile(0.5, buckets) == pytest.approx(0.1)
    assert quantile(0.75, buckets) == pytest.approx(0.15)
    assert math.isnan(quantile(0.5, {0.1: 0.0, math.inf: 0.0}))
    # Everything above the last finite bound: that bound (as histogram_quantile).
    assert quantile(0.99, {0.1: 0.0, math.inf: 5.0}) == pytest.approx(0.1)


def text(requests: int, api: str = "Produce") -> str:
    return ("# TYPE gatehouse_requests_total counter\n"
            f'gatehouse_requests_total{{api="{api}",version="9"}} {requests}\n')


def test_rates_between_scrapes_and_after_a_restart() -> None:
    before, after = parse(text(100), 10.0), parse(text(150), 12.0)
    assert rates(before, after, "gatehouse_requests_total", ("api",)) == {("Produce",): 25.0}
    # The proxy restarted: the counter went down, so it counts from zero.
    restarted = parse(text(4), 14.0)
    assert rates(after, restarted, "gatehouse_requests_total", ("api",)) == {("Produce",): 2.0}
    assert rates(None, after, "gatehouse_requests_total", ("api",)) == {("Produce",): 0.0}


def test_not_prometheus_text_is_an_error() -> None:
    with pytest.raises(ScrapeError):
        parse("this is { not metrics\n", 0.0)


def test_render_from_a_real_registry() -> None:
    metrics = ProxyMetrics()
    metrics.requests.labels(api="Fetch", version="17", client_software="x/1",
                            listener="bootstrap").inc(3)
    metrics.duration.labels(api="Metadata", kind="request").observe(0.004)
    first = parse(generate_latest(metrics.registry).decode(), 1.0)
    metrics.requests.labels(api="Fetch", version="17", client_software="x/1",
                            listener="bootstrap").inc(10)
    metrics.duration.labels(api="Metadata", kind="request").observe(0.004)
    metrics.topic_records.labels(topic="orders", direction="fetch").inc(42)
    metrics.decisions.labels(rule="old-clients", action="refuse").inc()
    metrics.principals.labels(principal="svc-orders").inc(2)
    second = parse(generate_latest(metrics.registry).decode(), 3.0)
    p50, _ = latency_quantiles(first, second)["Metadata"]
    assert 0.0025 < p50 <= 0.005
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(render(first, second, "URL"))
    shown = out.getvalue()
    assert "over 2.0 s" in shown and "NOT READY" in shown  # no broker seen yet
    fetch = next(line for line in shown.splitlines() if "Fetch" in line)
    assert "5" in fetch.split("│")[2]  # 10 requests in 2 s
    assert "orders" in shown and "old-clients" in shown
    principal = next(line for line in shown.splitlines() if "principal: svc-orders" in line)
    assert principal.split("│")[3].strip() == "2"  # its live connections


def row_cells(shown: str, needle: str) -> list[str]:
    """The cells of the first table row of ``shown`` that holds ``needle``."""
    line = next(line for line in shown.splitlines() if needle in line)
    return [c.strip() for c in line.split("│") if c.strip()]


def test_render_shows_the_clients_own_measures_when_they_push_them() -> None:
    metrics = ProxyMetrics(client_telemetry=TelemetrySettings())
    assert metrics.client_telemetry is not None
    out = io.StringIO()
    console = Console(file=out, width=200, color_system=None)
    empty = parse(generate_latest(metrics.registry).decode(), 1.0)
    console.print(render(None, empty, "URL"))
    assert "Clients' own measures" not in out.getvalue()  # nothing pushed: no table

    pushed = metrics_data(
        gauge("org.apache.kafka.producer.record.queue.time.avg", 3.25),
        gauge("org.apache.kafka.producer.node.request.latency.avg", 2.0, kv("node_id", int_value=1)),
        gauge("org.apache.kafka.producer.node.request.latency.avg", 7.5, kv("node_id", int_value=2)),
        gauge("org.apache.kafka.consumer.fetch.manager.records.lag.max", 1200.0,
              kv("topic", string_value="orders")))
    conn = ConnectionInfo(id=1, client="10.0.0.5:40000", listener="broker-0",
                          client_id="orders-app", software_name="apache-kafka-java")
    req = request(72, 0, 1, client_instance_id="00000000-0000-0000-0000-000000000001",
                  subscription_id=metrics.client_telemetry.subscription_id,
                  terminating=False, compression_type=0, metrics=pushed)
    metrics.client_telemetry.answer(req, conn)
    snap = parse(generate_latest(metrics.registry).decode(), 2.0)
    console.print(render(empty, snap, "URL"))
    shown = out.getvalue()
    assert "Clients' own measures (KIP-714)" in shown
    # client id | software | queue ms | request ms (the slowest broker) | fetch ms | lag
    assert row_cells(shown, "orders-app")[:6] == ["orders-app", "apache-kafka-java", "3.2", "7.5", "-", "1,200"]


def test_render_shows_what_encrypt_records_did() -> None:
    metrics = ProxyMetrics()
    out = io.StringIO()
    console = Console(file=out, width=220, color_system=None)
    empty = parse(generate_latest(metrics.registry).decode(), 1.0)
    console.print(render(None, empty, "URL"))
    assert "Records encrypted" not in out.getvalue()  # no rule encrypts: no table
    for outcome, count in (("encrypted", 100), ("decrypted", 40), ("kms_unavailable", 6)):
        metrics._encrypted_records("payments-encrypted", "payments", outcome, count)
    first = parse(generate_latest(metrics.registry).decode(), 1.0)
    metrics._encrypted_records("payments-encrypted", "payments", "encrypted", 20)
    metrics._encrypted_records("payments-encrypted", "payments", "undecryptable", 2)
    second = parse(generate_latest(metrics.registry).decode(), 3.0)
    console.print(render(first, second, "URL"))
    shown = out.getvalue()
    assert "Records encrypted (encrypt_records)" in shown
    # rule | topic | encrypted/s | decrypted/s | undecryptable/s | KMS/s | not opened
    assert row_cells(shown, "payments-encrypted") == ["payments-encrypted", "payments", "10", "0", "1", "0", "8"]


def test_the_busiest_connections_between_two_scrapes() -> None:
    def conn(id_: int, client_id: str, sent: int, got: int, requests: int,
             **more: object) -> dict[str, object]:
        return {"id": id_, "client": f"10.0.0.{id_}:4000", "client_id": client_id,
                "software_name": "librdkafka", "software_version": "2.16", "principal": None,
                "bytes_from_client": sent, "bytes_to_client": got, "requests": requests,
                "answers_owed": 0, **more}

    first = parse(text(1), 10.0)
    first.connections = [conn(1, "quiet", 1_000, 1_000, 10),
                         conn(2, "busy", 1_000, 0, 10)]
    second = parse(text(2), 12.0)
    second.connections = [conn(1, "quiet", 1_000, 3_048, 12),
                          conn(2, "busy", 2_098_152, 0, 410, answers_owed=3,
                               oldest_owed={"api": "Produce", "version": 12, "seconds": 0.2},
                               produced={"orders": {"records": 2048, "bytes": 2_097_152}},
                               requests_by_api={"Produce": 400, "Metadata": 8, "Fetch": 2},
                               errors={"Produce NOT_LEADER_OR_FOLLOWER": 2},
                               last_error={"api": "Produce", "error": "NOT_LEADER_OR_FOLLOWER",
                                           "seconds_ago": 1.5}),
                          conn(3, "new", 0, 4_096, 2, principal="svc-new")]
    out = io.StringIO()
    Console(file=out, width=320, color_system=None).print(render(first, second, "URL"))
    shown = out.getvalue().split("Busiest connections", 1)[1]
    rows = [row_cells(shown, name) for name in ("busy", "new", "quiet")]
    # id | client | client id | software | principal | req/s | in/s | out/s | owed | APIs
    # | topics | errors
    assert rows[0] == ["2", "10.0.0.2:4000", "busy", "librdkafka 2.16", "-", "200",
                       "1.0 MiB", "0 B", "3 (Produce v12, 0.2s)", "Produce 400, Metadata 8 +1",
                       "> orders", "2 (NOT_LEADER_OR_FOLLOWER)"]
    assert rows[1][9:] == ["-", "-", "-"]  # nothing asked yet, moved or refused
    assert rows[1][4:8] == ["svc-new", "1", "0 B", "2.0 KiB"]  # new: counted from 0
    assert rows[2][5:8] == ["1", "0 B", "1.0 KiB"]
    assert shown.index("busy") < shown.index("new") < shown.index("quiet")
    # A restarted proxy's connection 1 is another connection: counted from 0.
    third = parse(text(3), 14.0)
    third.connections = [conn(1, "reborn", 2_048, 0, 1, opened="2026-12-06T16:00:00Z")]
    out = io.StringIO()
    Console(file=out, width=320, color_system=None).print(render(second, third, "URL"))
    assert row_cells(out.getvalue().split("Busiest connections", 1)[1], "reborn")[5:8] == [
        "0.5", "1.0 KiB", "0 B"]
    # Not served to us (or no connection): no table.
    second.connections = None
    out = io.StringIO()
    Console(file=out, width=250, color_system=None).print(render(first, second, "URL"))
    assert "Busiest connections" not in out.getvalue()


def test_what_clients_chose_is_shown_as_it_is() -> None:
    """A client id, topic or software name that holds rich markup or a terminal's escape
    sequences is printed literally: it cannot style, link or drive the terminal."""
    evil = "[bold red]x[/] [link=http://evil]y[/link]\x1b]0;pwned\x07\x1b[2J\x9b"
    metrics = ProxyMetrics()
    metrics.topic_records.labels(topic=evil, direction="produce").inc(3)
    metrics.clients.labels(software_name=evil, software_version="1").inc()
    snap = parse(generate_latest(metrics.registry).decode(), 1.0)
    snap.connections = [{"id": 1, "client": "10.0.0.1:1", "client_id": evil,
                         "software_name": evil, "software_version": None,
                         "principal": evil, "bytes_from_client": 1, "bytes_to_client": 0,
                         "requests": 1, "answers_owed": 0}]
    out = io.StringIO()
    Console(file=out, width=400, force_terminal=True, color_system=None).print(
        render(None, snap, "URL"))
    shown = out.getvalue()
    assert "\x1b" not in shown and "\x07" not in shown and "\x9b" not in shown
    literal = r"[bold red]x[/] [link=http://evil]y[/link]\x1b]0;pwned\x07\x1b[2J\x9b"
    # The topics table, the census and the busiest connections, each literally.
    assert shown.count(literal) >= 3, shown
