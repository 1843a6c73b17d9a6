"""/connections: the client connections a proxy holds now, one JSON object each.

The question at an incident, or before raising a minimum version or moving a tenant, is
who is on the proxy right now: from where, as whom, with which client library, to which
broker, moving how much, waiting on what.  The metrics answer it in aggregate (the
census gauges); this answers it per connection, from the proxy's own state, as
pgbouncer's SHOW CLIENTS does for PostgreSQL.  ``gatehouse connections`` prints it as a
table.

It names clients (addresses, client ids, principals), so the metrics endpoint serves it
to loopback clients only unless ``metrics.connections`` says otherwise.  No secret is
on a connection's record: only the SASL mechanism and the principal it proved.

The snapshot is taken on the event loop (a copy of the table: a reference per
connection) and read in a thread, so ten thousand connections do not hold up the loop;
each connection's numbers are read as they are at that moment (a few may move on while
the others are read).
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import trio

from gatehouse.codecs import api_name
from gatehouse.proxy.hooks import ConnectionInfo

if TYPE_CHECKING:
    from gatehouse.proxy.connection import ProxyConnection

# The connection's stage: before the pumps (a TLS handshake, a PROXY header, the
# broker's connect), serving, or reading no more requests (the client closed its side,
# or a drain: shutdown, max_connection_age) while the answers owed are delivered.
CONNECTING, OPEN, CLOSING = "connecting", "open", "closing"


class LiveConnections:
    """The proxy's open client connections, by id; each one's pumps once they run."""

    def __init__(self) -> None:
        self.conns: dict[int, ConnectionInfo] = {}
        self.pumps: dict[int, ProxyConnection] = {}

    def opened(self, conn: ConnectionInfo) -> None:
        self.conns[conn.id] = conn

    def serving(self, conn: ConnectionInfo, pumps: ProxyConnection) -> None:
        self.pumps[conn.id] = pumps

    def closed(self, conn: ConnectionInfo) -> None:
        self.conns.pop(conn.id, None)
        self.pumps.pop(conn.id, None)

    async def json(self) -> bytes:
        """The document /connections serves (see ``document``)."""
        # The tallies copied here, on the loop, which adds keys to them (their numbers
        # may move on while the thread reads them, as the connection's others).
        taken = [(conn, self.pumps.get(conn.id), Tallies(
            dict(conn.api_requests), dict(conn.produced), dict(conn.fetched), dict(conn.errors)))
                 for conn in self.conns.values()]
        now, wall, loop_now = time.monotonic(), time.time(), trio.current_time()
        return await trio.to_thread.run_sync(_document_bytes, taken, now, wall, loop_now)


class Tallies(NamedTuple):
    """A connection's requests by API key, [records, bytes] by topic and errors by kind,
    copied."""

    api_requests: dict[int | str, int]
    produced: dict[str, list[int]]
    fetched: dict[str, list[int]]
    errors: dict[str, int]


def entry(conn: ConnectionInfo, pumps: ProxyConnection | None, now: float, wall: float,
          loop_now: float, tallies: Tallies) -> dict[str, Any]:
    """One connection as /connections shows it (every key always there, null where the
    proxy does not know: a stable shape for jq and dashboards); ``tallies``: its own,
    copied on the loop."""
    opened = wall - (now - conn.opened)
    client_sasl = pumps.client_sasl if pumps is not None else None
    mechanism = (client_sasl.mechanism if client_sasl is not None
                 else pumps.sasl_mechanism if pumps is not None else None)
    return {
        "id": conn.id,
        "client": conn.client,
        "via": conn.via,
        "listener": conn.listener,
        "node_id": conn.node_id,
        "upstream": conn.upstream,
        "state": (CONNECTING if pumps is None
                  else CLOSING if pumps.client_done or pumps.stop_reading else OPEN),
        "tls": conn.tls,
        "sasl_mechanism": mechanism,
        "principal": conn.principal,
        "client_id": conn.client_id,
        "software_name": conn.software_name,
        "software_version": conn.software_version,
        "opened": datetime.datetime.fromtimestamp(opened, datetime.UTC)
        .isoformat(timespec="seconds").replace("+00:00", "Z"),
        "seconds_open": round(now - conn.opened, 3),
        # Since its last whole request or the broker's last bytes (the idle timeout's
        # measure).
        "seconds_idle": (round(max(0.0, loop_now - pumps.last_active), 3)
                         if pumps is not None else None),
        "requests": conn.requests,
        # What it asks for and moves, most first: requests by API, and records and
        # bytes by client-side topic (the metrics' count, from the batch headers).
        "requests_by_api": _by_api(tallies.api_requests),
        "produced": _by_topic(tallies.produced),
        "fetched": _by_topic(tallies.fetched),
        "responses": conn.responses,
        "refused": conn.refused,
        # Error codes in its answers (a partition's included, as the metrics count
        # them), most first, and the latest: a client in trouble, and with what.
        "errors": dict(sorted(tallies.errors.items(), key=lambda item: -item[1])),
        "last_error": _last_error(conn, now),
        # Answers the client is owed, in the order it asked (the broker's and the
        # proxy's own): a count that stays up is a client waiting on something.
        "answers_owed": len(pumps.line) if pumps is not None else 0,
        "oldest_owed": _oldest_owed(pumps, loop_now),
        "bytes_from_client": conn.bytes_from_client,
        "bytes_to_client": conn.bytes_to_client,
    }


def _by_api(counts: Mapping[int | str, int]) -> dict[str, int]:
    named = [(api_name(key) if isinstance(key, int) else key, n) for key, n in counts.items()]
    return dict(sorted(named, key=lambda item: -item[1]))


def _by_topic(counts: Mapping[str, list[int]]) -> dict[str, dict[str, int]]:
    ordered = sorted(counts.items(), key=lambda item: -item[1][1])  # bytes
    return {topic: {"records": records, "bytes": size} for topic, (records, size) in ordered}


def _last_error(conn: ConnectionInfo, now: float) -> dict[str, Any] | None:
    last = conn.last_error  # one tuple: replaced whole, never half-read
    if last is None:
        return None
    api, error, when = last
    return {"api": api, "error": error, "seconds_ago": round(max(0.0, now - when), 3)}


def _oldest_owed(pumps: ProxyConnection | None, loop_now: float) -> dict[str, Any] | None:
    """The request whose answer the client has waited for longest (the first in its
    line): which API, and for how long; None when none is owed."""
    try:
        pending = pumps.line[0] if pumps is not None else None
    except IndexError:  # answered meanwhile (the loop runs on as this is read)
        pending = None
    if pending is None:
        return None
    return {"api": api_name(pending.api_key) if pending.api_key >= 0 else "SASL token",
            "version": pending.api_version if pending.api_key >= 0 else None,
            "seconds": round(max(0.0, loop_now - pending.started), 3)}


def document(entries: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """``{"count": N, "connections": [...]}`` (oldest first) plus ``extra``."""
    entries.sort(key=lambda e: (e.get("worker", 0), e["id"]))
    return {"count": len(entries), **extra, "connections": entries}


def _document_bytes(taken: list[tuple[ConnectionInfo, ProxyConnection | None, Tallies]],
                    now: float, wall: float, loop_now: float) -> bytes:
    entries = [entry(conn, pumps, now, wall, loop_now, tallies)
               for conn, pumps, tallies in taken]
    return encode(document(entries))


def encode(doc: Mapping[str, Any]) -> bytes:
    return (json.dumps(doc, separators=(",", ":")) + "\n").encode()
