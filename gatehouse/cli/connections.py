"""`gatehouse connections`: the proxy's live client connections (its /connections) as a
table, or as the JSON it serves.

    gatehouse connections --metrics http://127.0.0.1:9464/metrics [--sort bytes]
                          [--match TEXT] [--limit N] [--json]

The URL is the metrics endpoint's, as for `gatehouse top` (its path is replaced by
/connections), or /connections itself.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any, Final

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from gatehouse.cli.top import _bytes, _num, _table

# --sort: each connection's key, the first listed first.
SORTS: Final[dict[str, Callable[[dict[str, Any]], Any]]] = {
    "age": lambda c: -c["seconds_open"],  # oldest first
    "bytes": lambda c: -(c["bytes_from_client"] + c["bytes_to_client"]),
    "requests": lambda c: -c["requests"],
    "idle": lambda c: -(c["seconds_idle"] or 0.0),
    # Waiting longest first (then most owed).
    "owed": lambda c: (-(c.get("oldest_owed") or {}).get("seconds", -1.0), -c["answers_owed"]),
    "errors": lambda c: -error_count(c),
    "client": lambda c: c["client"],
}
# --match looks in these, and in the topics each produced to and fetched from and the
# errors it was answered with.
_SEARCHED: Final = ("client", "via", "client_id", "principal", "software_name",
                    "software_version", "listener", "upstream")
_NAMED: Final = ("produced", "fetched", "errors")


class ConnectionsError(Exception):
    """The endpoint could not be read, or did not answer with connections."""


def connections_url(url: str) -> str:
    """/connections beside the metrics endpoint ``url`` names."""
    parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
    path = parts.path.rstrip("/")
    if not path.endswith("/connections"):
        path = path.removesuffix("/metrics") + "/connections"
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def fetch(url: str, timeout: float = 10.0) -> dict[str, Any]:
    """The document /connections serves (gatehouse.proxy.live)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            doc = json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        said = exc.read().decode(errors="replace").strip()
        raise ConnectionsError(f"{url}: {exc.code} {said or exc.reason}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise ConnectionsError(f"{url}: {getattr(exc, 'reason', None) or exc}") from exc
    except ValueError as exc:
        raise ConnectionsError(f"{url}: not JSON: {exc}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("connections"), list):
        raise ConnectionsError(f"{url}: no connections listed (is it a Gatehouse?)")
    return doc


def chosen(doc: dict[str, Any], sort: str = "age", match: str | None = None,
           limit: int | None = None) -> list[dict[str, Any]]:
    """The connections to show: those ``match`` finds (a substring of any of
    ``_SEARCHED``, of a topic it produced to or fetched from, or of an error it was
    answered with, case-insensitive), in ``sort`` order, at most ``limit``."""
    listed: list[dict[str, Any]] = list(doc["connections"])
    if match:
        needle = match.lower()
        listed = [c for c in listed
                  if any(needle in str(c.get(k) or "").lower() for k in _SEARCHED)
                  or any(needle in name.lower() for k in _NAMED for name in c.get(k) or ())]
    listed.sort(key=SORTS[sort])
    return listed[:limit] if limit is not None else listed


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


def owed(c: dict[str, Any]) -> str:
    """The answers a connection is owed, and the one it has waited for longest."""
    oldest = c.get("oldest_owed")
    if not oldest:
        return _num(c["answers_owed"])
    what = oldest["api"] + (f" v{oldest['version']}" if oldest.get("version") is not None
                            else "")
    return f"{_num(c['answers_owed'])} ({what}, {oldest['seconds']:.1f}s)"


def ident(c: dict[str, Any]) -> str:
    """A connection's number, its worker's first under a supervisor (ids restart with
    each process)."""
    return f"{c['worker']}:{c['id']}" if "worker" in c else str(c["id"])


def software(c: dict[str, Any]) -> str:
    """The client library and version it gave (KIP-511), or "-"."""
    return " ".join(filter(None, (c.get("software_name"), c.get("software_version")))) or "-"


def _first(names: list[str], shown: int = 2) -> str:
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" +{more}" if more > 0 else "")


def apis(c: dict[str, Any]) -> str:
    """Its requests by API, most first (the first two named)."""
    counts = c.get("requests_by_api") or {}
    return _first([f"{api} {_num(n)}" for api, n in counts.items()]) or "-"


def topics(c: dict[str, Any]) -> str:
    """The topics it produced to (">") and fetched from ("<"), most bytes first."""
    said = [f"{arrow} {_first(list(c[key]))}"
            for arrow, key in ((">", "produced"), ("<", "fetched")) if c.get(key)]
    return "  ".join(said) or "-"


def error_count(c: dict[str, Any]) -> int:
    """How many error codes its answers carried."""
    return sum((c.get("errors") or {}).values())


def errors(c: dict[str, Any]) -> str:
    """How many error codes its answers carried, and the latest."""
    total = error_count(c)
    last = c.get("last_error")
    if not total:
        return "-"
    return f"{_num(total)} ({last['error']})" if last else _num(total)


def _who(c: dict[str, Any]) -> str:
    how = [m for m in (c.get("sasl_mechanism"), "TLS" if c.get("tls") else None) if m]
    principal = c.get("principal") or "-"
    return f"{principal} ({', '.join(how)})" if how else principal


def render(doc: dict[str, Any], shown: list[dict[str, Any]], url: str) -> RenderableType:
    count = doc.get("count", len(doc["connections"]))
    header = Text.assemble(("gatehouse connections ", "bold"), (url, "cyan"),
                           f"\n{count:,} connection{'' if count == 1 else 's'}")
    if len(shown) != len(doc["connections"]):
        header.append(f", {len(shown):,} shown")
    unavailable = doc.get("workers_unavailable") or []
    if unavailable:
        header.append(f"   workers not answering: {', '.join(map(str, unavailable))}",
                      style="bold red")
    table: Table = _table("", [("id", "right"), ("client", "left"), ("to", "left"),
                               ("state", "left"), ("client id", "left"),
                               ("software", "left"), ("principal", "left"),
                               ("open", "right"), ("idle", "right"), ("requests", "right"),
                               ("APIs", "left"), ("topics", "left"), ("errors", "left"),
                               ("owed", "right"), ("in", "right"), ("out", "right")])
    for c in shown:
        client = c["client"] + (f" via {c['via']}" if c.get("via") else "")
        to = f"{c['listener']} > {c.get('upstream') or '-'}"
        table.add_row(ident(c), client, to, c["state"], c.get("client_id") or "-", software(c),
                      _who(c), _duration(c["seconds_open"]), _duration(c.get("seconds_idle")),
                      _num(c["requests"]), apis(c), topics(c), errors(c), owed(c),
                      _bytes(c["bytes_from_client"]), _bytes(c["bytes_to_client"]))
    return Group(header, table)


def run_connections(url: str, *, sort: str = "age", match: str | None = None,
                    limit: int | None = None, as_json: bool = False,
                    console: Console | None = None) -> int:
    """The `gatehouse connections` command; returns the exit status."""
    console = console or Console()
    where = connections_url(url)
    try:
        doc = fetch(where)
    except ConnectionsError as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        return 1
    shown = chosen(doc, sort, match, limit)
    if as_json:
        console.out(json.dumps({**doc, "shown": len(shown), "connections": shown},
                               indent=2), highlight=False)
        return 0
    console.print(render(doc, shown, where))
    return 0
