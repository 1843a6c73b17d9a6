"""`gatehouse top`: the proxy's /metrics as a live terminal view, for a shell without Grafana.

Scrapes the Prometheus text endpoint every ``interval`` seconds; rates are the difference
between two scrapes.  ``--once`` takes two scrapes, prints one view and exits.
"""

from __future__ import annotations

import contextlib
import math
import re
import time
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final

from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group, JustifyMethod, RenderableType
from rich.style import StyleType
from rich.table import Table
from rich.text import Text

Labels = tuple[tuple[str, str], ...]
TOP_ROWS = 10


class ScrapeError(Exception):
    """The metrics endpoint could not be read or parsed."""


@dataclass
class Snapshot:
    """One scrape: sample name -> labels -> value, and when it was taken."""

    at: float
    samples: dict[str, dict[Labels, float]] = field(default_factory=dict)
    # The proxy's /connections at the same moment; None where it is not served to us.
    connections: list[dict[str, Any]] | None = None

    def series(self, name: str) -> dict[Labels, float]:
        return self.samples.get(name, {})

    def total(self, name: str, **match: str) -> float:
        return sum(v for labels, v in self.series(name).items() if _matches(labels, match))


def _matches(labels: Labels, match: dict[str, str]) -> bool:
    found = dict(labels)
    return all(found.get(k) == v for k, v in match.items())


def parse(text: str, at: float) -> Snapshot:
    snap = Snapshot(at)
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = tuple(sorted(s.labels.items()))
                snap.samples.setdefault(s.name, {})[labels] = float(s.value)
    except ValueError as exc:
        raise ScrapeError(f"not Prometheus text format: {exc}") from exc
    return snap


def scrape(url: str, timeout: float = 5.0) -> Snapshot:
    """/metrics, and /connections beside it when the proxy answers us there."""
    from gatehouse.cli.connections import ConnectionsError, connections_url, fetch

    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            text = response.read().decode("utf-8")
    except (urllib.error.URLError, OSError, UnicodeDecodeError) as exc:
        raise ScrapeError(f"{url}: {getattr(exc, 'reason', None) or exc}") from exc
    snap = parse(text, time.monotonic())
    with contextlib.suppress(ConnectionsError):  # not ours to read: the rest still is
        snap.connections = fetch(connections_url(url), timeout)["connections"]
    return snap


# -- numbers ------------------------------------------------------------------------


def grouped(snap: Snapshot, name: str, by: Iterable[str], **match: str) -> dict[tuple[str, ...],
                                                                              float]:
    """Sum of ``name`` by the labels ``by`` (PromQL ``sum by``)."""
    keys = tuple(by)
    out: dict[tuple[str, ...], float] = defaultdict(float)
    for labels, value in snap.series(name).items():
        if _matches(labels, match):
            found = dict(labels)
            out[tuple(found.get(k, "") for k in keys)] += value
    return dict(out)


def maxed(snap: Snapshot, name: str, by: Iterable[str]) -> dict[tuple[str, ...], float]:
    """Largest of ``name`` by the labels ``by`` (PromQL ``max by``)."""
    keys = tuple(by)
    out: dict[tuple[str, ...], float] = {}
    for labels, value in snap.series(name).items():
        found = dict(labels)
        key = tuple(found.get(k, "") for k in keys)
        out[key] = max(value, out.get(key, -math.inf))
    return out


def rates(prev: Snapshot | None, cur: Snapshot, name: str, by: Iterable[str],
          **match: str) -> dict[tuple[str, ...], float]:
    """Per-second increase between two scrapes, by ``by`` (0 without a previous scrape)."""
    keys = tuple(by)
    now = grouped(cur, name, keys, **match)
    if prev is None or cur.at <= prev.at:
        return dict.fromkeys(now, 0.0)
    before = grouped(prev, name, keys, **match)
    seconds = cur.at - prev.at
    # A counter that went down was reset (the proxy restarted): count from zero.
    return {k: (v - before.get(k, 0.0) if v >= before.get(k, 0.0) else v) / seconds
            for k, v in now.items()}


def quantile(q: float, buckets: dict[float, float]) -> float:
    """Prometheus' histogram_quantile over cumulative ``le -> count`` (NaN if empty)."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return math.nan
    rank = q * buckets[bounds[-1]]
    lower_bound, lower_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count)
        lower_bound, lower_count = bound, count
    return bounds[-1]


def latency_quantiles(prev: Snapshot | None, cur: Snapshot,
                      qs: tuple[float, ...] = (0.5, 0.99)) -> dict[str, tuple[float, ...]]:
    """Per API (kind=request): quantiles of the latencies observed between two scrapes
    (since start without a previous scrape)."""
    name = "gatehouse_request_duration_seconds_bucket"
    now = grouped(cur, name, ("api", "le"), kind="request")
    before = grouped(prev, name, ("api", "le"), kind="request") if prev else {}
    per_api: dict[str, dict[float, float]] = defaultdict(dict)
    for (api, le), value in now.items():
        per_api[api][float(le)] = max(value - before.get((api, le), 0.0), 0.0)
    return {api: tuple(quantile(q, b) for q in qs) for api, b in per_api.items()}


# -- the view -----------------------------------------------------------------------


def _num(value: float) -> str:
    if math.isnan(value):
        return "-"
    if value >= 100 or value == int(value):
        return f"{value:,.0f}"
    return f"{value:,.1f}"


def _bytes(value: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.1f} {unit}"
        value /= 1024
    return f"{value:,.1f} GiB"  # pragma: no cover - the loop returns


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1000:,.1f}"


# C0 and C1 control characters: ESC starts a terminal's escape sequences.
_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def plain(value: str) -> Text:
    """A string the clients chose (a client id, a topic, a software name) shown as it
    is: no rich markup read in it, and its control characters written out (\\x1b), so a
    client cannot style, link or drive the terminal of whoever watches the proxy."""
    return Text(_CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", value))


class _Table(Table):
    """A rich table whose text cells are ``plain``."""

    def add_row(self, *renderables: RenderableType | None, style: StyleType | None = None,
                end_section: bool = False) -> None:
        super().add_row(*(plain(r) if isinstance(r, str) else r for r in renderables),
                        style=style, end_section=end_section)


def _table(title: str, columns: list[tuple[str, JustifyMethod]]) -> Table:
    table = _Table(title=title, title_justify="left", expand=False, pad_edge=False)
    for name, justify in columns:
        table.add_column(name, justify=justify)
    return table


def _top(items: dict[tuple[str, ...], float], n: int = TOP_ROWS) -> list[tuple[str, ...]]:
    return [k for k, _ in sorted(items.items(), key=lambda kv: (-kv[1], kv[0]))[:n]]


def render(prev: Snapshot | None, cur: Snapshot, url: str) -> RenderableType:
    """Everything the view shows, from two scrapes (``prev`` None: totals, zero rates)."""
    seconds = cur.at - prev.at if prev else 0.0
    ready = cur.total("gatehouse_ready")
    clients = cur.total("gatehouse_connections", side="client")
    brokers = cur.total("gatehouse_connections", side="broker")
    req_rate = sum(rates(prev, cur, "gatehouse_requests_total", ()).values())
    byte_rates = rates(prev, cur, "gatehouse_bytes_total", ("direction",))
    header = Text.assemble(
        ("gatehouse top ", "bold"), (url, "cyan"),
        f"  over {seconds:.1f} s\n" if prev else "  (totals since start)\n",
        ("ready" if ready else "NOT READY", "green" if ready else "bold red"),
        f"   connections: {clients:,.0f} client / {brokers:,.0f} broker"
        f"   requests/s: {_num(req_rate)}"
        f"   in: {_bytes(byte_rates.get(('client_to_proxy',), 0.0))}/s"
        f"   out: {_bytes(byte_rates.get(('proxy_to_client',), 0.0))}/s",
    )

    api = _table("Requests by API", [("API", "left"), ("req/s", "right"),
                                     ("total", "right"), ("errors/s", "right"),
                                     ("p50 ms", "right"), ("p99 ms", "right")])
    per_api = rates(prev, cur, "gatehouse_requests_total", ("api",))
    totals = grouped(cur, "gatehouse_requests_total", ("api",))
    errors = _without_none(rates(prev, cur, "gatehouse_responses_total", ("api", "error")))
    latency = latency_quantiles(prev, cur)
    order = per_api if prev and any(per_api.values()) else totals
    for key in _top(order, n=len(order)):
        name = key[0]
        err = sum(v for (a, _), v in errors.items() if a == name)
        p50, p99 = latency.get(name, (math.nan, math.nan))
        api.add_row(name, _num(per_api.get(key, 0.0)), _num(totals.get(key, 0.0)),
                    _num(err), _ms(p50), _ms(p99))

    err_table = _table("Errors by code", [("API", "left"), ("error", "left"),
                                          ("/s", "right"), ("total", "right")])
    error_totals = _without_none(grouped(cur, "gatehouse_responses_total", ("api", "error")))
    for key in _top(error_totals):
        err_table.add_row(key[0], key[1], _num(errors.get(key, 0.0)),
                          _num(error_totals[key]))

    census = _table("Clients (KIP-511)", [("software", "left"), ("version", "left"),
                                         ("connections", "right")])
    live = {k: v for k, v in grouped(cur, "gatehouse_clients",
                                     ("software_name", "software_version")).items() if v}
    for key in _top(live):
        census.add_row(key[0], key[1], _num(live[key]))
    groups = {k: v for k, v in grouped(cur, "gatehouse_consumer_groups",
                                       ("protocol_type", "protocol")).items() if v}
    for key in _top(groups):
        census.add_row(f"group: {key[0]}", key[1], f"{_num(groups[key])} group(s)")
    principals = {k: v for k, v in grouped(cur, "gatehouse_principals",
                                           ("principal",)).items() if v}
    for key in _top(principals):
        census.add_row(f"principal: {key[0]}", "", _num(principals[key]))

    topics = _table("Top topics", [("topic", "left"), ("produced rec/s", "right"),
                                   ("fetched rec/s", "right"), ("produced", "right"),
                                   ("fetched", "right"), ("bytes in/s", "right"),
                                   ("bytes out/s", "right")])
    rec_rate = rates(prev, cur, "gatehouse_topic_records_total", ("topic", "direction"))
    rec_total = grouped(cur, "gatehouse_topic_records_total", ("topic", "direction"))
    byte_rate = rates(prev, cur, "gatehouse_topic_bytes_total", ("topic", "direction"))
    by_topic: dict[tuple[str, ...], float] = defaultdict(float)
    for (topic, _), value in (rec_rate if any(rec_rate.values()) else rec_total).items():
        by_topic[(topic,)] += value
    for (topic,) in _top(dict(by_topic)):
        topics.add_row(topic, _num(rec_rate.get((topic, "produce"), 0.0)),
                       _num(rec_rate.get((topic, "fetch"), 0.0)),
                       _num(rec_total.get((topic, "produce"), 0.0)),
                       _num(rec_total.get((topic, "fetch"), 0.0)),
                       _bytes(byte_rate.get((topic, "produce"), 0.0)),
                       _bytes(byte_rate.get((topic, "fetch"), 0.0)))

    decisions = _table("Rule decisions", [("rule", "left"), ("action", "left"),
                                          ("/s", "right"), ("total", "right")])
    decision_rates = rates(prev, cur, "gatehouse_rule_decisions_total", ("rule", "action"))
    decision_totals = grouped(cur, "gatehouse_rule_decisions_total", ("rule", "action"))
    for key in _top(decision_totals):
        decisions.add_row(key[0], key[1], _num(decision_rates.get(key, 0.0)),
                          _num(decision_totals[key]))
    reloads = grouped(cur, "gatehouse_rules_reloads_total", ("outcome",))
    if any(reloads.values()):
        decisions.caption = (f"reloads: {reloads.get(('ok',), 0):,.0f} ok, "
                             f"{reloads.get(('failed',), 0):,.0f} failed")

    connections = _table("Connections", [("side", "left"), ("outcome", "left"),
                                         ("/s", "right"), ("total", "right")])
    conn_rates = rates(prev, cur, "gatehouse_connections_total", ("side", "outcome"))
    conn_totals = grouped(cur, "gatehouse_connections_total", ("side", "outcome"))
    for key in sorted(conn_totals):
        connections.add_row(key[0], key[1], _num(conn_rates.get(key, 0.0)),
                            _num(conn_totals[key]))

    parts: list[RenderableType] = [header, api, err_table, topics, census, decisions,
                                   connections]
    busiest = _busiest(prev, cur)
    if busiest is not None:
        parts.append(busiest)
    measured = _client_measures(cur)
    if measured is not None:
        parts.insert(5, measured)
    encrypted = _encryption(prev, cur)
    if encrypted is not None:
        parts.insert(parts.index(decisions) + 1, encrypted)
    return Group(*parts)


def _busiest(prev: Snapshot | None, cur: Snapshot) -> Table | None:
    """The client connections moving the most bytes between the two scrapes (with no
    earlier scrape: the most bytes since they opened), from /connections; None when
    the proxy did not serve it to us or holds no connection."""
    from gatehouse.cli.connections import apis, errors, ident, owed, software, topics

    if not cur.connections:
        return None
    seconds = cur.at - prev.at if prev is not None and cur.at > prev.at else 0.0

    def identity(conn: dict[str, Any]) -> tuple[Any, ...]:
        # Ids start again with a process (a restarted proxy or worker): when it opened
        # tells the connections apart.
        return conn.get("worker"), conn["id"], conn.get("opened")

    before = {identity(c): c for c in (prev.connections or [])} if prev else {}

    def per_second(conn: dict[str, Any], key: str) -> float:
        if not seconds:
            return 0.0
        earlier = before.get(identity(conn), {})
        return float(conn[key] - earlier.get(key, 0)) / seconds

    def moved(conn: dict[str, Any]) -> float:
        return (per_second(conn, "bytes_from_client") + per_second(conn, "bytes_to_client")
                if seconds else float(conn["bytes_from_client"] + conn["bytes_to_client"]))

    table = _table("Busiest connections" + ("" if seconds else " (bytes since opened)"), [
        ("id", "right"), ("client", "left"), ("client id", "left"), ("software", "left"),
        ("principal", "left"), ("req/s", "right"), ("in/s", "right"), ("out/s", "right"),
        ("owed", "right"), ("APIs", "left"), ("topics", "left"), ("errors", "left")])
    for c in sorted(cur.connections, key=moved, reverse=True)[:TOP_ROWS]:
        table.add_row(ident(c), c["client"], c.get("client_id") or "-", software(c),
                      c.get("principal") or "-", _num(per_second(c, "requests")),
                      _bytes(per_second(c, "bytes_from_client")),
                      _bytes(per_second(c, "bytes_to_client")), owed(c), apis(c), topics(c),
                      errors(c))
    return table


# encrypt_records' outcomes, as the columns show them.
ENCRYPTION_OUTCOMES = {"encrypted/s": "encrypted", "decrypted/s": "decrypted",
                       "undecryptable/s": "undecryptable",
                       "waiting for the KMS/s": "kms_unavailable"}


def _encryption(prev: Snapshot | None, cur: Snapshot) -> Table | None:
    """Records encrypted and decrypted by rule and topic, and those that were not
    (undecryptable, or held back for the KMS) with their totals; None when no rule
    encrypts."""
    by = ("rule", "topic", "outcome")
    totals = grouped(cur, "gatehouse_encrypted_records_total", by)
    if not totals:
        return None
    per_second = rates(prev, cur, "gatehouse_encrypted_records_total", by)
    places = {(rule, topic) for rule, topic, _ in totals}
    table = _table("Records encrypted (encrypt_records)", [
        ("rule", "left"), ("topic", "left"),
        *((column, "right") for column in ENCRYPTION_OUTCOMES),
        ("not opened, total", "right")])
    ranked: dict[tuple[str, ...], float] = {
        place: sum((v for (r, t, _), v in totals.items() if (r, t) == place), 0.0)
        for place in places}
    for rule, topic in _top(ranked):
        failed = sum(totals.get((rule, topic, o), 0.0)
                     for o in ("undecryptable", "kms_unavailable"))
        table.add_row(rule, topic, *(_num(per_second.get((rule, topic, o), 0.0))
                                     for o in ENCRYPTION_OUTCOMES.values()), _num(failed))
    return table


# What the clients measure themselves (KIP-714, metrics.client_telemetry): column ->
# the exported metrics it shows (the largest over a client's brokers and partitions).
CLIENT_MEASURES = {
    "queue ms": ("kafka_client_producer_record_queue_time_avg",),
    "request ms": ("kafka_client_producer_node_request_latency_avg",
                   "kafka_client_consumer_node_request_latency_avg"),
    "fetch ms": ("kafka_client_consumer_fetch_manager_fetch_latency_avg",),
    "lag": ("kafka_client_consumer_fetch_manager_records_lag_max",),
}


def _client_measures(cur: Snapshot) -> Table | None:
    """The clients' own measures by client id and software; None when none pushed."""
    by = ("client_id", "client_software_name")
    columns: dict[str, dict[tuple[str, ...], float]] = {c: {} for c in CLIENT_MEASURES}
    for column, names in CLIENT_MEASURES.items():
        for name in names:
            for key, value in maxed(cur, name, by).items():
                columns[column][key] = max(value, columns[column].get(key, -math.inf))
    clients = sorted({key for values in columns.values() for key in values})
    if not clients:
        return None
    table = _table("Clients' own measures (KIP-714)", [
        ("client id", "left"), ("software", "left"),
        *((column, "right") for column in CLIENT_MEASURES)])
    for key in clients[:TOP_ROWS]:
        table.add_row(*key, *(_num(columns[c][key]) if key in columns[c] else "-"
                              for c in CLIENT_MEASURES))
    return table


def _without_none(values: dict[tuple[str, ...], float]) -> dict[tuple[str, ...], float]:
    return {k: v for k, v in values.items() if k[1] != "NONE"}


# -- running ------------------------------------------------------------------------


def run_top(url: str, *, interval: float = 2.0, once: bool = False,
            console: Console | None = None,
            wait: Callable[[float], None] = time.sleep) -> int:
    """The `gatehouse top` command; returns the exit status."""
    console = console or Console()
    try:
        prev = scrape(url)
        if once:
            wait(interval)
            console.print(render(prev, scrape(url), url))
            return 0
        from rich.live import Live

        with Live(render(None, prev, url), console=console, auto_refresh=False,
                  screen=False) as live:
            while True:
                wait(interval)
                try:
                    cur = scrape(url)
                except ScrapeError as exc:  # e.g. the proxy restarting: keep trying
                    live.update(Group(Text(f"error: {exc}", style="bold red"),
                                      render(None, prev, url)), refresh=True)
                    continue
                live.update(render(prev, cur, url), refresh=True)
                prev = cur
    except ScrapeError as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 1
    except KeyboardInterrupt:
        return 0
