"""report.html: one self-contained page (inline SVG charts, no scripts, no fetches)."""

from __future__ import annotations

import html
from collections import defaultdict
from datetime import datetime
from typing import Any

# The APIs whose log records carry record counts, and the traffic chart's series for each.
RECORD_APIS = {"Produce": "produced", "Fetch": "fetched", "ShareFetch": "fetched by share groups"}
PALETTE = ("#2b6cb0", "#dd6b20", "#38a169", "#805ad5", "#d53f8c", "#319795", "#b7791f",
           "#718096")
STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:2rem auto;max-width:72rem;
color:#1a202c;padding:0 1rem}
h1{font-size:1.6rem}h2{font-size:1.25rem;margin-top:2.5rem;border-bottom:1px solid #e2e8f0}
table{border-collapse:collapse;width:100%;font-size:.85rem;margin:.75rem 0}
th,td{text-align:left;padding:.3rem .5rem;border-bottom:1px solid #edf2f7;vertical-align:top}
th{background:#f7fafc}td.n{text-align:right;font-variant-numeric:tabular-nums}
.note{color:#4a5568;font-size:.9rem}.verdict{font-size:1.05rem;margin:.5rem 0}
.refuse{color:#c53030;font-weight:600}.ok{color:#2f855a;font-weight:600}
svg{max-width:100%;height:auto;font-family:inherit}
"""


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value))


def _n(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:,.0f}" if value.is_integer() else f"{value:,.1f}"
    return f"{value:,}"


def _t(value: Any) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if isinstance(value, datetime) else _e(value)


def bar_chart(title: str, items: list[tuple[str, float]], unit: str = "",
              width: int = 760) -> str:
    """Horizontal bars, largest first."""
    if not items:
        return f"<p class=note>{_e(title)}: nothing to show.</p>"
    label_w, row_h = 300, 22
    top = max(v for _, v in items) or 1.0
    height = 30 + row_h * len(items)
    parts = [f'<svg viewBox="0 0 {width} {height}" role="img" aria-label="{_e(title)}">',
             f'<text x="0" y="16" font-size="14" font-weight="600">{_e(title)}</text>']
    for i, (label, value) in enumerate(items):
        y = 28 + i * row_h
        w = max(1.0, (width - label_w - 90) * value / top)
        parts.append(f'<text x="{label_w - 6}" y="{y + 14}" font-size="12" '
                     f'text-anchor="end">{_e(label[:48])}</text>')
        parts.append(f'<rect x="{label_w}" y="{y + 2}" width="{w:.1f}" height="{row_h - 6}" '
                     f'fill="{PALETTE[0]}"><title>{_e(label)}: {_n(value)}{unit}</title></rect>')
        parts.append(f'<text x="{label_w + w + 4:.1f}" y="{y + 14}" font-size="11">'
                     f'{_n(value)}{unit}</text>')
    parts.append("</svg>")
    return "".join(parts)


def grouped_bars(title: str, groups: list[tuple[str, dict[str, float]]], series: list[str],
                 unit: str = "", width: int = 760) -> str:
    """One row per group, one bar per series (e.g. p50 and p99 per API)."""
    if not groups:
        return f"<p class=note>{_e(title)}: nothing to show.</p>"
    label_w, bar_h = 200, 12
    row_h = bar_h * len(series) + 8
    top = max((v for _, values in groups for v in values.values() if v is not None),
              default=1.0) or 1.0
    height = 50 + row_h * len(groups)
    parts = [f'<svg viewBox="0 0 {width} {height}" role="img" aria-label="{_e(title)}">',
             f'<text x="0" y="16" font-size="14" font-weight="600">{_e(title)}</text>']
    for s, name in enumerate(series):
        parts.append(f'<rect x="{label_w + s * 90}" y="24" width="10" height="10" '
                     f'fill="{PALETTE[s % len(PALETTE)]}"/><text x="{label_w + 14 + s * 90}" '
                     f'y="33" font-size="11">{_e(name)}</text>')
    for i, (label, values) in enumerate(groups):
        y = 44 + i * row_h
        parts.append(f'<text x="{label_w - 6}" y="{y + row_h / 2 + 3}" font-size="12" '
                     f'text-anchor="end">{_e(label)}</text>')
        for s, name in enumerate(series):
            value = values.get(name) or 0.0
            w = max(1.0, (width - label_w - 90) * value / top)
            by = y + s * bar_h
            parts.append(f'<rect x="{label_w}" y="{by}" width="{w:.1f}" height="{bar_h - 2}" '
                         f'fill="{PALETTE[s % len(PALETTE)]}"><title>{_e(label)} {_e(name)}: '
                         f'{_n(value)}{unit}</title></rect>')
            parts.append(f'<text x="{label_w + w + 4:.1f}" y="{by + 9}" font-size="10">'
                         f'{_n(value)}{unit}</text>')
    parts.append("</svg>")
    return "".join(parts)


def line_chart(title: str, series: dict[str, list[tuple[datetime, float]]],
               unit: str = "", width: int = 760, height: int = 260) -> str:
    """Lines over time (one per series), with the time axis labelled at both ends."""
    points = [p for values in series.values() for p in values]
    if not points:
        return f"<p class=note>{_e(title)}: nothing to show.</p>"
    left, right, top_pad, bottom = 70, 20, 40, 40
    t0 = min(t for t, _ in points).timestamp()
    t1 = max(t for t, _ in points).timestamp()
    span = (t1 - t0) or 60.0
    top = max(v for _, v in points) or 1.0
    plot_w, plot_h = width - left - right, height - top_pad - bottom

    def xy(t: datetime, v: float) -> tuple[float, float]:
        return (left + plot_w * (t.timestamp() - t0) / span,
                top_pad + plot_h * (1 - v / top))

    parts = [f'<svg viewBox="0 0 {width} {height}" role="img" aria-label="{_e(title)}">',
             f'<text x="0" y="16" font-size="14" font-weight="600">{_e(title)}</text>',
             f'<line x1="{left}" y1="{top_pad + plot_h}" x2="{width - right}" '
             f'y2="{top_pad + plot_h}" stroke="#a0aec0"/>',
             f'<line x1="{left}" y1="{top_pad}" x2="{left}" y2="{top_pad + plot_h}" '
             f'stroke="#a0aec0"/>',
             f'<text x="{left - 6}" y="{top_pad + 4}" font-size="11" text-anchor="end">'
             f'{_n(top)}{unit}</text>',
             f'<text x="{left - 6}" y="{top_pad + plot_h}" font-size="11" '
             f'text-anchor="end">0</text>']
    first = min(t for t, _ in points)
    last = max(t for t, _ in points)
    parts.append(f'<text x="{left}" y="{height - 12}" font-size="11">{_t(first)} UTC</text>')
    parts.append(f'<text x="{width - right}" y="{height - 12}" font-size="11" '
                 f'text-anchor="end">{_t(last)} UTC</text>')
    for s, (name, values) in enumerate(series.items()):
        color = PALETTE[s % len(PALETTE)]
        values = sorted(values)
        coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(t, v) for t, v in values))
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" '
                     f'points="{coords}"/>')
        for t, v in values if len(values) <= 120 else ():
            x, y = xy(t, v)
            parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{color}">'
                         f'<title>{_e(name)} {_t(t)}: {_n(v)}{unit}</title></circle>')
        parts.append(f'<rect x="{left + 10 + s * 140}" y="24" width="10" height="10" '
                     f'fill="{color}"/><text x="{left + 24 + s * 140}" y="33" font-size="11">'
                     f'{_e(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _software(row: Any) -> str:
    if not row.software_name:
        return "(software not reported)"
    return f"{row.software_name} {row.software_version or ''}".strip()


def _refuses(rule: Any) -> bool:
    return bool(rule.min_api_version or rule.max_api_version or rule.deny_apis
                or rule.allow_apis is not None or rule.min_client_software
                or rule.cluster_refused or rule.cluster_configs
                or rule.unknown_software == "refuse"
                or any(m.filters for m in rule.maps()))


def _census_section(data: Any) -> str:
    census = data.census
    chart = bar_chart("Requests by client software (KIP-511 name and version)",
                      [(_software(r), float(r.requests)) for r in census[:20]])
    rows = []
    for r in census:
        libraries = ", ".join(f"{k} {v}" for k, v in sorted((r.libraries or {}).items()))
        apis = ", ".join(f"{a.api} v{a.api_version}" for a in r.apis)
        rows.append(
            f"<tr><td>{_e(r.software_name)}</td><td>{_e(r.software_version)}</td>"
            f"<td>{_e(libraries)}</td><td>{_e(', '.join(r.client_ids))}</td>"
            f"<td>{_e(', '.join(r.principals))}</td>"
            f"<td>{_e(', '.join(r.addresses))}</td><td>{_e(apis)}</td>"
            f"<td class=n>{_n(r.connections)}</td><td class=n>{_n(r.requests)}</td>"
            f"<td>{_t(r.first_seen)}</td><td>{_t(r.last_seen)}</td></tr>")
    # Which versions of each API are in use, and by whom: the question behind a minimum.
    by_api: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for r in census:
        for a in r.apis:
            by_api[a.api][a.api_version] += a.requests
    top_apis = sorted(by_api, key=lambda a: -sum(by_api[a].values()))[:8]
    version_rows = []
    for api in top_apis:
        for version in sorted(by_api[api]):
            users = sorted({_software(r) for r in census for a in r.apis
                            if a.api == api and a.api_version == version})
            version_rows.append(f"<tr><td>{_e(api)}</td><td>v{version}</td>"
                                f"<td class=n>{_n(int(by_api[api][version]))}</td>"
                                f"<td>{_e('; '.join(users))}</td></tr>")
    return (
        "<h2>Who connects: client census</h2>" + chart +
        "<table><tr><th>Software</th><th>Version</th><th>Libraries</th><th>Client ids</th>"
        "<th>Principals</th><th>Source addresses</th><th>APIs and versions used</th><th>Connections</th>"
        "<th>Requests</th><th>First seen</th><th>Last seen</th></tr>" + "".join(rows) +
        "</table><h2>API versions in use</h2><p class=note>Before raising a minimum version: "
        "the clients still on each version.</p><table><tr><th>API</th><th>Version</th>"
        "<th>Requests</th><th>Client software</th></tr>" + "".join(version_rows) + "</table>")


def _traffic_section(data: Any) -> str:
    records: dict[str, list[tuple[datetime, float]]] = defaultdict(list)
    requests: dict[datetime, float] = defaultdict(float)
    for r in data.per_minute:
        series = RECORD_APIS.get(r.api)
        if series is not None and r.records:
            records[series].append((r.minute, float(r.records)))
        requests[r.minute] += r.requests
    chart = line_chart("Records per minute", dict(records))
    chart_requests = line_chart("Requests per minute (all APIs)",
                                {"requests": sorted(requests.items())})
    rows = "".join(
        f"<tr><td>{_e(r.topic)}</td><td>{_e(r.api)}</td><td class=n>{_n(r.records)}</td>"
        f"<td class=n>{_n(r.bytes)}</td></tr>" for r in data.topics)
    return ("<h2>Traffic over time</h2>" + chart + chart_requests +
            "<table><tr><th>Topic</th><th>API</th><th>Records</th><th>Bytes (batches)</th>"
            "</tr>" + rows + "</table>")


def _latency_section(data: Any) -> str:
    groups = [(r.api, {"p50": r.p50, "p99": r.p99}) for r in data.latency]
    return ("<h2>Latency</h2><p class=note>Proxy to broker and back, per API (approximate "
            "percentiles). Fetch and group joins may wait on purpose (long polls).</p>" +
            grouped_bars("Latency per API (ms)", groups, ["p50", "p99"], " ms"))


def _impact_section(data: Any) -> str:
    if data.rules is None:
        return ("<h2>Proposed rules</h2><p class=note>Run with <code>--rules PROPOSED.yaml"
                "</code> to see which requests proposed rules would refuse or rewrite.</p>")
    rows_by_rule: dict[str, list[Any]] = defaultdict(list)
    for r in data.impact or []:
        rows_by_rule[r.rule].append(r)
    parts = ["<h2>What the proposed rules would do</h2><p class=note>Computed by the "
             "proxy's own rules code over every request in the log.</p>"]
    chart_items = []
    for rule in data.rules.rules:
        rows = rows_by_rule.get(rule.name, [])
        refused = [r for r in rows if r.effect == "refuse"]
        rewritten = [r for r in rows if r.effect == "rewrite"]
        n_refused = sum(r.requests for r in refused)
        n_rewritten = sum(r.requests for r in rewritten)
        chart_items.append((rule.name, float(n_refused + n_rewritten)))
        clients = sorted({f"{_software(r)} ({r.client_id or 'no client id'})" for r in refused})
        mode = " (observe mode in the proposal)" if rule.mode == "observe" else ""
        if not _refuses(rule):
            pass
        elif refused:
            parts.append(f"<p class=verdict>Rule <b>{_e(rule.name)}</b>{_e(mode)} "
                         f"<span class=refuse>would refuse {_n(n_refused)} requests</span> "
                         f"from {len(clients)} client(s): {_e('; '.join(clients))}.</p>")
        else:
            parts.append(f"<p class=verdict>Rule <b>{_e(rule.name)}</b>{_e(mode)} "
                         f"<span class=ok>would refuse no request</span> in this log.</p>")
        if rule.topic_map is not None:
            who = sorted({f"{_software(r)} ({r.client_id or 'no client id'})"
                          for r in rewritten})
            parts.append(f"<p class=verdict>Rule <b>{_e(rule.name)}</b>{_e(mode)} would "
                         f"rewrite topic names in {_n(n_rewritten)} requests from "
                         f"{len(who)} client(s){': ' if who else ''}{_e('; '.join(who))}.</p>")
        if rows:
            parts.append(
                "<table><tr><th>Effect</th><th>Client software</th><th>Client id</th>"
                "<th>Address</th><th>API</th><th>Requests</th><th>Why</th><th>First seen</th>"
                "<th>Last seen</th></tr>" + "".join(
                    f"<tr><td>{_e(r.effect)}</td><td>{_e(_software(r))}</td>"
                    f"<td>{_e(r.client_id)}</td><td>{_e(r.client_host)}</td>"
                    f"<td>{_e(r.api)} v{r.api_version}</td><td class=n>{_n(r.requests)}</td>"
                    f"<td>{_e(r.reason or ', '.join(r.topics))}</td><td>{_t(r.first_seen)}</td>"
                    f"<td>{_t(r.last_seen)}</td></tr>" for r in rows) + "</table>")
    parts.insert(1, bar_chart("Requests each proposed rule would refuse or rewrite",
                              chart_items))
    return "".join(parts)


def render_report(data: Any) -> str:
    period = f"{_t(data.first)} to {_t(data.last)} UTC"
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        "<title>Gatehouse report</title><style>" + STYLE + "</style></head><body>"
        f"<h1>Gatehouse report</h1><p class=note>{_n(data.records)} exchanges captured, "
        f"{period}.</p>" + _impact_section(data) + _census_section(data) +
        _traffic_section(data) + _latency_section(data) + "</body></html>")
