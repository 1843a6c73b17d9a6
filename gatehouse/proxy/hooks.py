"""What the connection pumps call out to: the policy (rules) and observers (metrics, capture).

Both are plain synchronous objects: decisions are pure and fast, and observers only
count or enqueue.  The proxy wires them; ``gatehouse.rules`` never imports trio.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from gatehouse.codecs import Request, Response, decode_response, fetch, peek, produce
from gatehouse.proxy.apiversions import RangeAdjuster

# A connection's tallies hold this many API keys (Kafka has about 90; a client can send
# any int16) and topics each way (a consumer of a regex may fetch thousands: ~150 bytes
# a topic, so at most ~15 KiB a connection); the rest fold into OTHER.  Parentheses are
# in no API's name nor in any legal topic name.
CONN_APIS_MAX = 100
CONN_TOPICS_MAX = 50
CONN_ERRORS_MAX = 32  # kinds of error ("Fetch NOT_LEADER_OR_FOLLOWER")
OTHER = "(other)"


def tally_error(conn: ConnectionInfo, api: str, error: str, count: int) -> None:
    """Add ``count`` answers of ``api`` carrying ``error`` (anywhere in them, a partition's
    included) to the connection's ``errors``, and make it its ``last_error``."""
    key = f"{api} {error}"
    errors = conn.errors
    if key not in errors and len(errors) >= CONN_ERRORS_MAX:
        key = OTHER
    errors[key] = errors.get(key, 0) + count
    conn.last_error = (api, error, time.monotonic())


def tally_topic(tally: dict[str, list[int]], topic: str, records: int, size: int) -> None:
    """Add a request's records and bytes of ``topic`` to a connection's ``tally``."""
    counts = tally.get(topic)
    if counts is None:
        if len(tally) >= CONN_TOPICS_MAX:
            topic = OTHER
        counts = tally.get(topic)
        if counts is None:
            counts = tally[topic] = [0, 0]
    counts[0] += records
    counts[1] += size


@dataclass(eq=False)
class ConnectionInfo:
    """One client connection, as policies, observers and log lines see it."""

    id: int
    client: str  # the client's address, "host:port"
    listener: str  # "bootstrap" or "broker-<node>"
    node_id: int | None = None
    upstream: str | None = None
    tls: bool = False
    via: str | None = None  # the load balancer whose PROXY protocol header named the client
    client_id: str | None = None
    software_name: str | None = None  # KIP-511, from ApiVersions v3+
    software_version: str | None = None
    # Who the client is: the SASL user the proxy (sasl.downstream: proxy.sasl) or the
    # broker (codecs.sasl) accepted, else the subject of the certificate the client CA
    # verified (proxy.principal), else None.
    principal: str | None = None
    opened: float = field(default_factory=time.monotonic)
    requests: int = 0
    responses: int = 0
    bytes_from_client: int = 0
    bytes_to_client: int = 0
    refused: int = 0
    # What it does, for /connections (gatehouse.proxy.live): requests by API key (the
    # pumps count them), and [records, bytes] by client-side topic produced and fetched
    # (the metrics count them, as they read the batch headers anyway; empty without
    # metrics).  Each bounded (CONN_APIS_MAX, CONN_TOPICS_MAX): the rest under OTHER.
    api_requests: dict[int | str, int] = field(default_factory=dict)
    produced: dict[str, list[int]] = field(default_factory=dict)
    fetched: dict[str, list[int]] = field(default_factory=dict)
    # Error codes in the answers it got, by "API ERROR_NAME" (the metrics count them:
    # empty without metrics; at most CONN_ERRORS_MAX kinds), and the last one: (API,
    # error, when: time.monotonic()).
    errors: dict[str, int] = field(default_factory=dict)
    last_error: tuple[str, str, float] | None = None
    # Per-connection memory for policies, e.g. the protocol type a JoinGroup declared
    # (needed to decode consumer-protocol bytes of pre-KIP-559 versions).  Bounded by
    # the policy that writes it.
    state: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        return {
            "conn": self.id,
            "client": self.client,
            "client_id": self.client_id,
            "software": (
                f"{self.software_name}/{self.software_version}" if self.software_name else None
            ),
            "listener": self.listener,
            **({"principal": self.principal} if self.principal is not None else {}),
            **({"via": self.via} if self.via is not None else {}),
        }


@dataclass(slots=True, eq=False)
class Pending:
    """A request the client awaits an answer to, in the order the answers must go."""

    correlation_id: int
    api_key: int
    api_version: int
    started: float
    local: bytes | None = None  # the answer, when the proxy answers itself
    # ``local`` is the proxy's service, not a refusal: its own SASL (sasl.downstream).
    by_proxy: bool = False
    raw: bool = False  # a SaslHandshake v0 token: no Kafka header either way
    wants_response: bool = False  # decode the response body (rewrite or inspect)
    context: Any = None  # whatever the policy needs back with the response
    policy: Any = None  # the policy that decided: in-flight requests finish under it
    decoded: Response | None = None  # the response as sent, if the proxy decoded it
    # A Produce or Fetch response read from its bytes instead (``scanned_response``);
    # for a Fetch answer whose records went by unread (``Observer.response`` with no
    # frame), what the proxy's walk read of them on the way, when it could.
    scan: Any = None
    sasl_user: str | None = None  # a SaslAuthenticate's: the user the client claims
    # The proxy's own request (re-authenticating to the broker, KIP-368): its answer goes
    # here, not to the client, and no observer hears of it.
    internal: Callable[[bytes], None] | None = None


def decoded_response(pending: Pending, frame: Any) -> Response:
    """The response to ``pending`` as the client got it (``frame``), decoded once: the
    proxy's own decode if it made one, else decoded here and kept for the next observer.
    Raises the codec's errors (``ProtocolError``, ``UnknownApi``)."""
    resp = pending.decoded
    if resp is None:
        resp = pending.decoded = decode_response(frame, pending.api_key, pending.api_version)
    return resp


# The responses read from their bytes: error codes, top-level tags (and for Fetch the
# topics' records and bytes), without a decode; ApiVersions for its one error code.
PRODUCE, FETCH, API_VERSIONS, SHARE_FETCH = 0, 1, 18, 78
# The answers that carry records to consumers: a consumer's Fetch, a share consumer's
# ShareFetch (KIP-932); counted, logged and held to fetch quotas alike.
FETCHES = (FETCH, SHARE_FETCH)
_RESPONSE_SCANS: dict[int, Callable[[Any, int], Any]] = {
    PRODUCE: produce.response_scan,
    FETCH: fetch.response_scan,
    API_VERSIONS: peek.api_versions_scan,
}


SCANNED_RESPONSES = frozenset(_RESPONSE_SCANS)


def top_level_tags(pending: Pending, frame: Any, whole: bool = False
                   ) -> tuple[int, ...] | None:
    """The numbers of a Produce or Fetch response's top-level tagged fields, from its
    bytes; None for other APIs and unexpected bytes.  A Produce response's whole scan is
    kept for the observers; a Fetch response's records are counted only when ``whole``
    (an observer will read them: one walk for both), not for the plain proxy."""
    if pending.api_key == FETCH and not whole:
        return fetch.top_level_tags(frame, pending.api_version)
    scan = scanned_response(pending, frame)
    return None if scan is None else scan[1]


def scanned_response(pending: Pending, frame: Any) -> Any:
    """A Produce or Fetch response read from its bytes (``codecs.produce.response_scan``,
    ``codecs.fetch.response_scan``: error codes and top-level tags first), once for the
    proxy and every observer.  None for other APIs and when the bytes are not what the
    reader expects (the decoder then takes over); with no ``frame`` (its bytes went by
    unread), what the proxy read of them on the way, if anything."""
    scan = pending.scan
    if scan is None and frame is not None:
        reader = _RESPONSE_SCANS.get(pending.api_key)
        if reader is not None:
            scan = pending.scan = reader(frame, pending.api_version)
    return scan


# Close reasons that are no fault of either side (``connection_closed``): the client
# left, the proxy is stopping, or the connection reached ``limits.max_connection_age``.
CLIENT_CLOSED, SHUTTING_DOWN, AGE_LIMIT = ("client closed", "proxy shutting down",
                                          "connection age limit reached")
CLEAN_CLOSES = frozenset({CLIENT_CLOSED, SHUTTING_DOWN, AGE_LIMIT})


@dataclass(frozen=True, slots=True)
class Forward:
    request: Request  # maybe rewritten
    wants_response: bool = False
    context: Any = None
    # For a request sent on as it arrives (``Policy.forwards_unread``): the bytes that
    # take the place of its first ``n`` bytes (from the api key on), and ``n``; and what
    # reports the decision, called once the observers have seen the request (the
    # observation log gives a request's record the rule outcomes that follow it).
    new_head: tuple[bytes, int] | None = None
    report: Callable[[], None] | None = None
    # Once the request is sent, close the connection, saying why: an acks=0 Produce some
    # of whose partitions were refused (a broker writes the others, then closes, since no
    # answer can carry the errors).
    close_after: str | None = None


@dataclass(frozen=True, slots=True)
class Respond:
    response: Response  # the proxy's own answer at the request's version


@dataclass(frozen=True, slots=True)
class Close:
    reason: str


Decision = Forward | Respond | Close


class Policy:
    """The default policy: forward everything, change nothing."""

    def on_request(self, conn: ConnectionInfo, req: Request) -> Decision:
        return Forward(req)

    def offload(self, conn: ConnectionInfo, req: Request) -> Callable[[], None] | None:
        """Work on a whole request that may take long (reading every record of a large
        Produce request), for the caller to run in a thread before ``on_request``, so
        the event loop serves the other connections meanwhile (the work holds the GIL
        only in turns).  It keeps what it finds for ``on_request`` (in ``conn.state``)
        and touches nothing else the loop uses.  None: nothing to do."""
        return None


    def offload_response(self, conn: ConnectionInfo, pending: Pending, resp: Response
                         ) -> Callable[[], None] | None:
        """The same for an answer ``on_response`` will change at length (a large Fetch
        answer's records decrypted), or that needs blocking I/O first (a data key a KMS
        must open): run in a thread before it.  None: nothing to do there (what is
        quick may be done here, kept in ``conn.state`` for ``on_response``)."""
        return None
    def refuses_unread(self, conn: ConnectionInfo, req: Request) -> str | None:
        """Why a request the codec cannot read (an API or version newer than its tables,
        which the ApiVersions answer did not offer) may not go on untouched: a rule that
        would read or rewrite it applies.  None: it goes on as it came."""
        return None

    def lookups(self, conn: ConnectionInfo, req: Request
                ) -> Callable[[], Awaitable[None]] | None:
        """What must be fetched before ``offload`` and ``on_request`` can judge ``req``
        (the schemas its records name, for a rule that looks them up in a Schema
        Registry), for the caller to await first; that connection's later requests wait
        behind it, in order.  None: nothing to fetch."""
        return None

    def forwards_unread(self, conn: ConnectionInfo, req: Request) -> Forward | None:
        """The decision for a request that has begun to arrive (``req.frame`` holds its
        first bytes: its header at least) if ``on_request`` would forward it, whatever
        the rest of its body holds, with its first bytes at most changed
        (``Forward.new_head``): the request then goes upstream as it arrives, and counts
        as decided (as ``on_request`` would count it) when the caller calls
        ``Forward.report``, after its observers.  None: ``on_request`` decides it once
        it is whole.

        Here: ``Forward(req)`` only where ``on_request`` is this class's own (forward
        everything), so a policy that decides by the body is never bypassed unless it
        says so."""
        return Forward(req) if type(self).on_request is Policy.on_request else None

    def on_response(self, conn: ConnectionInfo, pending: Pending, resp: Response) -> Response:
        return resp

    def api_version_adjusters(self, conn: ConnectionInfo) -> tuple[RangeAdjuster, ...]:
        return ()

    def quota_charges(self, conn: ConnectionInfo, now: float) -> tuple[Any, ...]:
        """The quotas the connection spends from (``proxy.quotas.Charge``): none here."""
        return ()

    def throttled(self, conn: ConnectionInfo, charge: Any, seconds: float,
                  held: bool) -> None:
        """A request ``charge``'s quota holds back ``seconds`` (``held``), or would
        (observe mode)."""


class Observer:
    """Hooks for metrics, capture and the demo's summary; every method defaults to nothing."""

    # Whether ``response`` reads what moved in Produce and Fetch responses (their whole
    # ``scanned_response``): the proxy then scans them once for itself and the observer.
    reads_scans = False
    # Whether ``request`` reads request bodies (a large Produce request's topics and
    # records): if none does, such a request's body may go upstream unread (splice)
    # and ``request`` gets it with its header only.
    reads_request_bodies = False
    # Whether ``request`` reads no more of a Produce request's body than its topics and
    # record counts (``produce.request_topics_of``): its records may then go up unread,
    # counted on the way from each batch's header (``produce.RequestWalk``).
    counts_request_records = False

    def connection_opened(self, conn: ConnectionInfo) -> None:
        pass

    def connection_closed(self, conn: ConnectionInfo, reason: str) -> None:
        pass

    def connection_refused(self, client: str, reason: str) -> None:
        """A client connection turned away before it was served (a connection limit)."""

    def request(self, conn: ConnectionInfo, req: Request, size: int) -> None:
        pass

    def response(
        self, conn: ConnectionInfo, pending: Pending, size: int, elapsed: float,
        frame: Any = None,
    ) -> None:
        """``frame``: the response as sent to the client (after any rewrite); None when
        its bytes went by unread (socket to socket): for a Fetch answer, an observer that
        ``reads_scans`` then finds what moved in ``pending.scan``, counted on the way
        (None where the proxy could not count it)."""

    def upstream_failure(self, target: str, error: str) -> None:
        pass

    def malformed(self, conn: ConnectionInfo, direction: str, error: str) -> None:
        pass

    def internal_error(self, conn: ConnectionInfo, error: str) -> None:
        """A bug ended ``conn`` (the proxy served every other connection on)."""


class Observers(Observer):
    """Fan-out to several observers; one failing observer is logged, never fatal."""

    def __init__(self, observers: list[Observer] | None = None) -> None:
        self.observers: list[Observer] = []
        # The per-request hooks, bound once: called for every request and response.
        self._requests: list[Any] = []
        self._responses: list[Any] = []
        for observer in observers or []:
            self.add(observer)

    def add(self, observer: Observer) -> None:
        self.observers.append(observer)
        self._requests.append(observer.request)
        self._responses.append(observer.response)
        self.reads_scans = self.reads_scans or observer.reads_scans
        self.reads_request_bodies = self.reads_request_bodies or observer.reads_request_bodies
        self.counts_request_records = (self.counts_request_records
                                       or observer.counts_request_records)

    def _each(self, method: str, *args: Any) -> None:
        for observer in self.observers:
            try:
                getattr(observer, method)(*args)
            except Exception:  # an observer bug must not break traffic
                _observer_failed(observer, method)

    def connection_opened(self, conn: ConnectionInfo) -> None:
        self._each("connection_opened", conn)

    def connection_closed(self, conn: ConnectionInfo, reason: str) -> None:
        self._each("connection_closed", conn, reason)

    def connection_refused(self, client: str, reason: str) -> None:
        self._each("connection_refused", client, reason)

    def request(self, conn: ConnectionInfo, req: Request, size: int) -> None:
        for hook in self._requests:
            try:
                hook(conn, req, size)
            except Exception:
                _observer_failed(self._owner(hook, "request"), "request")

    def response(self, conn: ConnectionInfo, pending: Pending, size: int, elapsed: float,
                 frame: Any = None) -> None:
        for hook in self._responses:
            try:
                hook(conn, pending, size, elapsed, frame)
            except Exception:
                _observer_failed(self._owner(hook, "response"), "response")

    def _owner(self, hook: Any, method: str) -> Any:
        """The observer whose ``method`` ``hook`` is (a bound method, or what an observer
        set in its place: ProxyMetrics' C functions)."""
        return next((o for o in self.observers if getattr(o, method) == hook), hook)

    def upstream_failure(self, target: str, error: str) -> None:
        self._each("upstream_failure", target, error)

    def malformed(self, conn: ConnectionInfo, direction: str, error: str) -> None:
        self._each("malformed", conn, direction, error)

    def internal_error(self, conn: ConnectionInfo, error: str) -> None:
        self._each("internal_error", conn, error)


def _observer_failed(observer: Any, method: str) -> None:
    import logging

    logging.getLogger("gatehouse.proxy").exception(
        "observer %s failed in %s", type(observer).__name__, method
    )
