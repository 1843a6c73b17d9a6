"""One client connection: two pumps in a nursery, backpressure through awaited sends.

    client ──► client_reader ──────────────────────────────────► upstream
                    │ (the line: Pending entries in request order, bounded)
                    ▼
    client ◄── upstream_reader ◄─────────────────────────────── upstream

Kafka answers requests in order on a connection, so the order of ``Pending`` entries in
the line *is* the order of answers: an upstream answer is matched to the oldest
entry (and its correlation id checked), and an answer the proxy makes itself (a refused
request) waits in line behind earlier forwarded ones.  Produce with acks=0 gets no
entry.  Each pump writes what it read, itself: the client reader sends a request up
before it reads the next one, and the upstream reader sends an answer (and the proxy's
own answers queued behind it) to the client before it reads the next one.  A hand-off to
a writer task would put a trip through trio's scheduler on the path of every request and
every answer; this way a request and its answer cost two (one wake-up per socket), and a
slow socket at either end stops the pump that feeds it: the slow client stops the
upstream reads, a flood of requests stops at the line's bound, memory stays flat.
The client reader writes to the client only when no answer is owed (a refusal with
nothing in flight), so the two pumps never write to the client at once.

Sockets are read and written through ``fastio.FastStream``: while bytes are there, the
pumps run on without a trip through trio's scheduler per call (cancellation is still
checked, and a full socket still makes them wait).
"""

from __future__ import annotations

import logging
import math
import random
import struct
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

from gatehouse.codecs import (
    ProtocolError,
    Request,
    Response,
    UnknownApi,
    api,
    api_name,
    decode_request,
    decode_response,
    fetch,
    produce,
    throttle_time_at,
)
from gatehouse.codecs.peek import produce_acks
from gatehouse.codecs.primitives import Buffer
from gatehouse.codecs.reader import FrameReader
from gatehouse.codecs.sasl import claimed_user
from gatehouse.codecs.scram import SaslError
from gatehouse.logs import log_event
from gatehouse.proxy import fastio
from gatehouse.proxy.addresses import (
    DESCRIBE_CONFIGS,
    AddressMapper,
    BrokerAddress,
    address_tags,
    carries_addresses,
    rewrite_addresses,
)
from gatehouse.proxy.apiversions import API_VERSIONS, adjust_api_versions
from gatehouse.proxy.budget import BufferPool, ByteBudget
from gatehouse.proxy.config import Limits
from gatehouse.proxy.fastio import FastStream, Pipe, PipePool
from gatehouse.proxy.hooks import (
    AGE_LIMIT,
    CLIENT_CLOSED,
    CONN_APIS_MAX,
    FETCH,
    FETCHES,
    OTHER,
    SCANNED_RESPONSES,
    SHUTTING_DOWN,
    Close,
    ConnectionInfo,
    Forward,
    Observer,
    Pending,
    Policy,
    Respond,
    top_level_tags,
)
from gatehouse.proxy.kerberos import GSSAPI, KerberosAcceptor
from gatehouse.proxy.oauth import OAUTHBEARER, TokenValidator, UnknownSigningKey
from gatehouse.proxy.quotas import Charge
from gatehouse.proxy.sasl import (
    FAILED_AUTHENTICATION_DELAY,
    FAILED_MESSAGE,
    ClientSasl,
    SaslUsers,
    UpstreamCredentials,
    authenticate_answer,
    authenticate_upstream,
    handshake_answer,
)

logger = logging.getLogger("gatehouse.proxy")

_SIZE = struct.Struct(">i")
PRODUCE = 0
SASL_HANDSHAKE, SASL_AUTHENTICATE = 17, 36
# SaslHandshake v0 is followed by raw size-prefixed tokens, no Kafka header.  How many
# client tokens each mechanism sends; None: unknown, so watch for the first frame that
# parses as a whole Kafka request (GSSAPI's exchange length varies).
SASL_RAW_ROUNDS: dict[str, int | None] = {
    "PLAIN": 1,
    "SCRAM-SHA-256": 2,
    "SCRAM-SHA-512": 2,
    "OAUTHBEARER": 1,
}
_RECEIVE_SIZE = 256 * 1024
# An answer at least this big that has not all arrived goes on to the client as its
# bytes come (cut-through): a consumer waits for one Fetch answer per broker at a time,
# so holding a 3 MB answer until its last byte adds its whole transfer to every fetch.
_STREAM_MIN = _RECEIVE_SIZE
# The end of a streamed Fetch v16+ answer waits for the rest: its top-level tags may
# name new leaders (KIP-951 NodeEndpoints), rewritten in a section of the same size.
_TAIL_HOLD = 64 * 1024
# A Produce request at least this big that has not all arrived goes upstream as its bytes
# come, when no rule reads or changes its body: a producer of large records would wait
# at the proxy for the last byte of every request otherwise (its observers still see it
# whole, before its last bytes go up).
_STREAM_REQUEST_MIN = 64 * 1024
_REQUEST_HEAD = 1024  # read for the header and acks of a request that may stream
# Under quotas, a streamed answer starts once this much is in: its throttle time (after
# the correlation id and the header's tags) may have to be written in place.
_THROTTLE_HEAD = 64
# sasl.upstream: the proxy authenticates to the broker again once this much of the
# session the broker gave has passed (Kafka's clients pick 85-95%).
_REAUTHENTICATE_AT = 0.85
# Seconds of session given to an OAUTHBEARER token that expires sooner (or has just
# expired, within the clock skew allowed): the client is told to authenticate again at
# once (a session lifetime of 0 would mean "never").
_SHORTEST_SESSION = 1.0
# Where answers' records go socket to socket (splice), the first read of an answer and the
# reads of its structure (partition headers, tags) take at most this much, and an answer
# this big that has not all arrived is spliced: the rest never enters the proxy.
_SPLICE_READ = 16 * 1024
# An answer read whole before it goes on (its body may change) is received straight
# into a pooled buffer from this size on (``_receive_whole_answer``).
_WHOLE_ANSWER_MIN = 64 * 1024
_KEPT_FRAME_BYTES = 32 * 1024 * 1024
_KEPT_API_VERSIONS_ANSWERS = 256
# Fetch answers whose layout the walk of a spliced answer knows: the flexible versions
# of the tables (a newer one goes through the proxy's buffers, untouched).
_WALKED_FETCH_VERSIONS = range(fetch.FIRST_VERSION, api(FETCH).versions.hi + 1)
# Produce requests whose records the walk of a spliced request counts (``produce.RequestWalk``):
# a newer one goes through the proxy's buffers when an observer counts its records.
_WALKED_PRODUCE_VERSIONS = range(produce.FIRST_VERSION, api(PRODUCE).versions.hi + 1)
STREAM_ERRORS = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)


@dataclass
class ConnectionContext:
    """What every connection shares with the server (set up by ``serve_proxy``)."""

    limits: Limits
    observer: Observer
    address_mapper: AddressMapper
    brokers_seen: Callable[[Sequence[BrokerAddress]], Awaitable[None]]
    draining: trio.Event
    get_policy: Callable[[], Policy]
    # The JWT claim an OAUTHBEARER principal is (the brokers' sasl.oauthbearer.sub.claim.name).
    oauthbearer_claim: str = "sub"
    # sasl.downstream: the proxy authenticates clients against these users itself.
    sasl_users: SaslUsers | None = None
    sasl_mechanisms: tuple[str, ...] = ()
    # sasl.downstream.oauthbearer: the keys OAUTHBEARER clients' tokens are checked against.
    sasl_tokens: TokenValidator | None = None
    # sasl.downstream.kerberos: the proxy's service keys GSSAPI clients log in to.
    sasl_kerberos: KerberosAcceptor | None = None
    # sasl.passthrough_kerberos: the brokers' keys, to name GSSAPI clients passing through.
    sasl_passthrough_kerberos: KerberosAcceptor | None = None
    # Seconds a client's authentication lasts before it must authenticate again (KIP-368).
    sasl_session_lifetime: float | None = None
    # sasl.upstream: broker connections are authenticated by the proxy (a client's own
    # SASL requests would find them authenticated already), and re-authenticated in the
    # middle of a client's traffic when the broker limits sessions (KIP-368).
    upstream_credentials: UpstreamCredentials | None = None
    # metrics.client_telemetry: the clients' KIP-714 telemetry requests are answered by
    # it (a gatehouse.metrics.telemetry.ClientTelemetry), and offered to them.
    client_telemetry: Any = None
    added_apis: tuple[tuple[int, int, int], ...] = field(init=False)  # in ApiVersions
    request_budget: ByteBudget = field(init=False)
    response_budget: ByteBudget = field(init=False)
    frame_buffers: BufferPool = field(init=False)
    api_versions_answers: dict[tuple[Any, ...], bytes] = field(init=False)
    # For answers whose records go socket to socket (splice(2)); None where the system
    # has no splice.
    pipes: PipePool | None = field(init=False)

    def __post_init__(self) -> None:
        self.added_apis = (self.client_telemetry.added_apis
                           if self.client_telemetry is not None else ())
        self.request_budget = ByteBudget(self.limits.max_buffered_request_bytes)
        self.response_budget = ByteBudget(self.limits.max_buffered_response_bytes)
        # Kept between large frames; within the response budget, at most 32 MiB.
        self.frame_buffers = BufferPool(min(self.limits.max_buffered_response_bytes,
                                            _KEPT_FRAME_BYTES))
        # (version, broker's answer after the correlation id, adjusters) -> the capped
        # answer's bytes after the correlation id (see handle_response_frame).
        self.api_versions_answers: dict[tuple[Any, ...], bytes] = {}
        self.pipes = PipePool() if PipePool.supported() else None

    def remember_api_versions(self, key: tuple[Any, ...], body: bytes) -> None:
        answers = self.api_versions_answers
        if len(answers) >= _KEPT_API_VERSIONS_ANSWERS:
            answers.clear()  # bounded: brokers x versions x client kinds is small
        answers[key] = body


class _Close(Exception):
    """Ends the connection; ``reason`` goes into the close log line."""

    def __init__(self, reason: str, level: int = logging.INFO) -> None:
        super().__init__(reason)
        self.reason = reason
        self.level = level


def _looks_like_request(frame: memoryview) -> bool:
    try:
        req = decode_request(frame)
        if not req.known:
            return False
        req.body  # noqa: B018 - a full decode is the test
    except ProtocolError:
        return False
    return True


class ProxyConnection:
    """The pumps of one client connection (see the module docstring)."""

    def __init__(
        self,
        client: trio.abc.Stream,
        upstream: trio.abc.Stream,
        conn: ConnectionInfo,
        ctx: ConnectionContext,
        upstream_session: float | None = None,
        upstream_host: str = "",
    ) -> None:
        """``upstream_session``: the seconds the broker gives the proxy's SASL session on
        ``upstream`` (sasl.upstream); the proxy authenticates again before it ends, to
        ``upstream_host`` (the broker's host, which a Kerberos ticket names)."""
        self.client = client
        self.upstream = upstream
        self.upstream_host = upstream_host
        # What the pumps read and write through (see fastio): the streams themselves
        # are still what gets closed.
        self.client_io = FastStream(client)
        self.upstream_io = FastStream(upstream)
        self.conn = conn
        self.ctx = ctx
        self.limits = ctx.limits
        # The run's clock, read directly: trio.current_time() is three calls deep, and
        # the pumps read it several times a request.
        self.now: Callable[[], float] = trio.lowlevel.current_clock().current_time
        # The answers owed, in request order; an entry leaves once its answer is sent.
        self.line: deque[Pending] = deque()
        self.room = trio.lowlevel.ParkingLot()  # the client reader, while the line is full
        self.request_bytes = _Share(ctx.request_budget)
        self.response_bytes = _Share(ctx.response_budget)
        self.answered = trio.lowlevel.ParkingLot()  # unparked when the line empties
        self.client_done = False  # no more requests will come
        self.close_reason = CLIENT_CLOSED
        self.close_level = logging.INFO
        self.sasl_raw_rounds: int | None = 0  # >0: that many raw tokens; None: until Kafka
        self.sasl_mechanism: str | None = None  # the last SaslHandshake's
        self.sasl_raw_claim: str | None = None  # the user a raw (v0) exchange claims
        self.sasl_first_token = False  # the next SaslAuthenticate begins an exchange
        # sasl.downstream: the client's exchange with the proxy (None: SASL is the
        # broker's business, passed through).
        self.client_sasl = (ClientSasl(ctx.sasl_users, ctx.sasl_mechanisms, ctx.sasl_tokens,
                                       ctx.sasl_kerberos)
                            if ctx.sasl_mechanisms else None)
        # sasl.downstream.session_lifetime or the client's OAUTHBEARER token's expiry:
        # when the client's authentication ends unless it authenticates again (KIP-368).
        self.client_session_ends = math.inf
        # When to authenticate to the broker again (sasl.upstream against a broker with
        # connections.max.reauth.ms): checked before each request goes up.
        self.reauthenticate_at = (self.now() + upstream_session * _REAUTHENTICATE_AT
                                  if upstream_session is not None else math.inf)
        self.line_empty = trio.lowlevel.ParkingLot()  # unparked when no answer is owed
        self.idle = trio.CancelScope()
        self.last_active = 0.0  # trio clock: the last whole request or byte from the broker
        # What a drain cancels, and only while the reader waits for a request's bytes
        # that have not come (see _drain); stop_reading stops the reader at its next
        # receive otherwise.  A cancel that came as the bytes did would be kept for the
        # next checkpoint: in the middle of forwarding the request they made, owed an
        # answer never asked for.  On a plain TCP socket, where a drain can see whether
        # bytes are waiting, one scope around the whole reader (a new scope costs more
        # than the rest of a small request's receive); on other streams (TLS, the tests'
        # memory streams), a new one around each receive.
        self.reader_scope = trio.CancelScope()
        self.receive_scope = trio.CancelScope()
        # The reader waits in _receive_from_client: never while a streamed request's
        # bytes come (a drain lets it finish: it goes up whole).
        self.awaiting_request = False
        self.stop_reading = False
        self.drain_reason = SHUTTING_DOWN  # why it stopped reading (``_drain``)
        # The request being received was found not to stream: not asked again at every
        # receive of its bytes.
        self.store_and_forward = False
        self.telemetry_keys = (ctx.client_telemetry.intercepts
                               if ctx.client_telemetry is not None else ())
        # Answers the telemetry receiver reads (observing: the brokers' subscriptions).
        self.telemetry_answers = (ctx.client_telemetry.reads_answers
                                  if ctx.client_telemetry is not None else ())
        # Whether large frames' records may go socket to socket: both ends are plain TCP.
        self.splices_requests = (ctx.pipes is not None and self.client_io.socket is not None
                                 and self.upstream_io.socket is not None)
        # And answers' (see _splices): where observers read what Fetch answers carry
        # (metrics, capture), only those, counted on the way from the batch headers
        # peeked at in the broker's socket; not where the system cannot peek past the
        # first waiting byte (a splice for every batch would cost more than a copy).
        self.counts_answers = ctx.observer.reads_scans
        self.splicing = self.splices_requests and (
            not self.counts_answers or (self.upstream_io.peeks and fastio.peeks_at_offsets()))
        self.answer_read = _SPLICE_READ if self.splicing else _RECEIVE_SIZE
        # The client's next read: after a request whose records went socket to socket,
        # the next one is likely as large, and only its first bytes need reading (the
        # rest is spliced rather than copied in and out); after a whole one, the most.
        self.client_read = _RECEIVE_SIZE
        self.stream_min = _SPLICE_READ if self.splicing else _STREAM_MIN

    @property
    def in_flight(self) -> int:
        """Forwarded requests not yet answered (the rest of the line: the proxy's own)."""
        return sum(1 for pending in self.line if pending.local is None)

    # -- lifecycle -----------------------------------------------------------------

    async def run(self) -> None:
        self._touch()
        try:
            with self.idle:
                async with trio.open_nursery() as nursery:
                    self.nursery = nursery
                    nursery.start_soon(self._guard, self.upstream_reader)
                    nursery.start_soon(self._watch_drain)
                    nursery.start_soon(self._watch_idle)
                    if self.limits.max_connection_age is not None:
                        nursery.start_soon(self._watch_age, self.limits.max_connection_age)
                    await self._guard(self.client_reader)
                    # No more requests: the connection ends once every answer owed is sent.
                    while self.line:
                        await self.answered.park()
                    nursery.cancel_scope.cancel()
            if self.idle.cancelled_caught:
                self.close_reason = "idle timeout"
        finally:
            self.request_bytes.give(self.request_bytes.held)
            self.response_bytes.give(self.response_bytes.held)
            await aclose_quietly(self.upstream)  # each shielded from the cancel around it
            await aclose_quietly(self.client)

    async def _guard(self, task: Callable[[], Awaitable[None]]) -> None:
        try:
            await task()
        except _Close as exc:
            self._record_close(exc.reason, exc.level)
            self.nursery.cancel_scope.cancel()
        except STREAM_ERRORS as exc:
            self._record_close(f"connection error: {exc!r}", logging.INFO)
            self.nursery.cancel_scope.cancel()

    def _record_close(self, reason: str, level: int) -> None:
        if self.close_reason == CLIENT_CLOSED or level > self.close_level:
            self.close_reason = reason
            self.close_level = level

    def _touch(self) -> None:
        # A plain store: moving a cancel scope's deadline costs ~10 us (trio's deadline
        # heap), several times per request; the watchdog reads this instead.
        self.last_active = self.now()

    async def _watch_idle(self) -> None:
        while True:
            deadline = self.last_active + self.limits.idle_timeout
            if self.now() >= deadline:
                self.idle.cancel()
                return
            await trio.sleep_until(deadline)

    async def _watch_drain(self) -> None:
        await self.ctx.draining.wait()
        self._drain(SHUTTING_DOWN)

    async def _watch_age(self, age: float) -> None:
        # Spread over +-10%: connections opened together (a client fleet's restart) do
        # not all reconnect at once.
        await trio.sleep(age * random.uniform(0.9, 1.1))
        self._drain(AGE_LIMIT)

    def _drain(self, reason: str) -> None:
        # Stop taking new requests; the upstream reader answers the ones in flight.  Only
        # the wait for bytes is cancelled: a request being handled is forwarded whole,
        # with its Pending entry, or not at all.
        if self.stop_reading:
            return
        self.drain_reason = reason
        self.stop_reading = True
        client = self.client_io
        if not (client.waiting and self.awaiting_request):
            return
        if client.socket is not None:
            # Bytes, EOF or an error waiting end the wait by themselves (the reader may
            # already be scheduled to run with them): it takes them and stops after.
            try:
                if client.peek_at(0, 1) is not None:
                    return
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            self.reader_scope.cancel()
        else:
            self.receive_scope.cancel()

    # -- client -> upstream ----------------------------------------------------------

    async def _wire_frames(
        self, receive: Callable[[], Awaitable[bytes | bytearray | None]], direction: str,
        share: _Share,
        stream: Callable[[FrameReader, int], Awaitable[Buffer | None]] | None = None,
    ) -> AsyncIterator[tuple[Buffer, int]]:
        """Whole frames (size prefix included) as they arrive, each with the budget bytes
        it holds; ``receive`` returns b"" at EOF (a partial frame is malformed) and None
        to stop quietly (a drain).  ``stream(reader, size)`` may take a frame that has
        begun to arrive and deal with it whole, returning the bytes read past its end
        (None: it did not)."""
        reader = FrameReader(self.limits.max_frame_bytes)
        reserved = 0  # budget bytes held for the frame being assembled
        while True:
            data = await receive()
            if data is None:
                return
            if not data:
                try:
                    reader.check_eof()
                except ProtocolError as exc:
                    self._malformed(direction, exc)
                return
            whole = reader.whole_frame(data)
            if whole is not None:  # one frame in one read: handed on as it came
                yield whole, 0
                continue
            reader.feed(data)
            while True:
                while True:
                    try:
                        wire = reader.next_wire_view()
                    except ProtocolError as exc:
                        self._malformed(direction, exc)
                    if wire is None:
                        break
                    yield wire, reserved
                    reserved = 0
                if (expected := reader.expected_size) is None:
                    break
                if not reserved:
                    # Reserve the rest of a partly read frame before reading more of it.
                    reserved = await share.take(expected + 4)
                if stream is None or (after := await stream(reader, expected)) is None:
                    break
                share.give(reserved)
                reserved = 0
                reader.feed(after)  # the next frames' first bytes

    async def _receive_from_client(self) -> bytes | bytearray | None:
        if self.stop_reading:
            self._record_close(self.drain_reason, logging.INFO)
            return None
        self.awaiting_request = True
        try:
            if self.client_io.socket is not None:  # inside the reader's scope
                data = await self.client_io.receive_some(self.client_read)
            else:
                with trio.CancelScope() as self.receive_scope:
                    data = await self.client_io.receive_some(self.client_read)
                if self.receive_scope.cancelled_caught:
                    self._record_close(self.drain_reason, logging.INFO)
                    return None
        finally:
            self.awaiting_request = False
        self.conn.bytes_from_client += len(data)
        return data

    async def client_reader(self) -> None:
        try:
            with self.reader_scope:
                async for wire, reserved in self._wire_frames(self._receive_from_client,
                                                              "request", self.request_bytes,
                                                              self._stream_request):
                    # Only whole requests are activity: a client trickling the bytes of a
                    # frame that never completes (slowloris) still meets the idle timeout.
                    self._touch()
                    self.store_and_forward = False
                    self.client_read = _RECEIVE_SIZE
                    await self.handle_request_frame(wire)
                    if reserved:  # forwarded or answered here: done with its bytes
                        self.request_bytes.give(reserved)
            if self.reader_scope.cancelled_caught:  # a drain, as the reader waited
                self._record_close(self.drain_reason, logging.INFO)
        finally:
            self.client_done = True

    def _malformed(self, direction: str, exc: ProtocolError) -> None:
        self.ctx.observer.malformed(self.conn, direction, str(exc))
        who = "client" if direction == "request" else "broker"
        raise _Close(f"malformed {direction} from {who}: {exc}", logging.WARNING)

    async def handle_request_frame(self, wire: Buffer) -> None:
        """One request as received: ``wire`` is the frame with its size prefix."""
        conn = self.conn
        frame = memoryview(wire)[4:]  # read-only view: decoding copies nothing
        if self.client_sasl is not None and self.client_sasl.raw:
            await self._client_sasl_token(bytes(frame), None)
            return
        if self.sasl_raw_rounds != 0:
            if self.sasl_raw_rounds is None and _looks_like_request(frame):
                self.sasl_raw_rounds = 0
            else:
                pending = Pending(-1, -1, -1, self.now(), raw=True)
                if self.sasl_raw_rounds is not None:
                    self.sasl_raw_rounds -= 1
                    self._raw_sasl_token(bytes(frame), pending)
                await self._forward(wire, pending)
                return
        try:
            req = decode_request(frame)
        except ProtocolError as exc:
            self._malformed("request", exc)
        header = req.header
        self._count_request(header)
        if self.client_session_ends < math.inf and header.api_key not in (
                SASL_HANDSHAKE, SASL_AUTHENTICATE) and (
                self.now() >= self.client_session_ends):
            # As a broker with connections.max.reauth.ms: no request after the session.
            raise _Close("SASL session expired: the client did not authenticate again "
                         "(sasl.downstream.session_lifetime, or its token's expiry)")
        if header.api_key in (SASL_HANDSHAKE, SASL_AUTHENTICATE) or (
                self.client_sasl is not None and self.client_sasl.user is None
                and header.api_key != API_VERSIONS):
            if self.client_sasl is not None:
                await self._answer_client_sasl(req, len(frame))
                return
            if self.ctx.upstream_credentials is not None:
                raise _Close(f"the client sent {api_name(header.api_key)}, but the proxy "
                             "authenticates to the brokers itself (sasl.upstream) and does "
                             "not authenticate clients (no sasl.downstream)", logging.WARNING)
        try:
            if header.api_key == API_VERSIONS and header.api_version >= 3 and req.known:
                body = req.body
                conn.software_name = body.client_software_name or None
                conn.software_version = body.client_software_version or None
            expects_response = not (header.api_key == PRODUCE and produce_acks(req) == 0)
            self.ctx.observer.request(conn, req, len(frame))
            policy = self.ctx.get_policy()
            fetch = policy.lookups(conn, req)
            if fetch is not None:
                await fetch()
            work = policy.offload(conn, req)
            if work is not None:
                await trio.to_thread.run_sync(work)
            decision = policy.on_request(conn, req)
        except UnknownApi:
            # Newer than our tables: forward untouched, we cannot look inside; unless a
            # rule must (a tenant's names mapped, say): then it would slip past it.
            refusal = self.ctx.get_policy().refuses_unread(conn, req)
            if refusal is not None:
                conn.refused += 1
                raise _Close(refusal, logging.WARNING) from None
            await self._forward(
                wire,
                Pending(header.correlation_id, header.api_key, header.api_version, self.now()),
            )
            return
        except ProtocolError as exc:
            self._malformed("request", exc)
        now = self.now()
        if isinstance(decision, Forward) and header.api_key in self.telemetry_keys:
            # The clients' telemetry, received by the proxy (answered here, never by the
            # broker), or observed on its way to the broker's own receiver.
            telemetry = self.ctx.client_telemetry
            read = telemetry.offload(decision.request, conn)
            if read is not None:  # a large push: read in a thread, the loop serving on
                read = await trio.to_thread.run_sync(read)
            answer = telemetry.answer(decision.request, conn, read)
            if answer is not None:
                await self._answer_locally(Pending(
                    header.correlation_id, header.api_key, header.api_version, now,
                    local=bytes(answer.encode()), policy=policy))
                return
        if isinstance(decision, Forward):
            charges = policy.quota_charges(conn, now)
            if charges:
                now = await self._hold_for_quotas(charges, policy, header.api_key,
                                                  len(frame) + 4, now)
            out = decision.request.encode()
            pending = Pending(
                header.correlation_id,
                header.api_key,
                header.api_version,
                now,
                wants_response=decision.wants_response,
                context=decision.context,
                policy=policy,
            )
            if header.api_key in (SASL_HANDSHAKE, SASL_AUTHENTICATE):
                ticket = self._sasl_request(decision.request, pending)
                if ticket is not None:
                    pending.sasl_user = await self._ticket_user(ticket)
            await self._forward(wire if out is frame else out,
                                pending if expects_response else None, prefixed=out is frame)
            if decision.close_after is not None:
                conn.refused += 1
                self._stop_after_answers(decision.close_after, logging.INFO)
        elif isinstance(decision, Respond) and expects_response:
            conn.refused += 1
            await self._answer_locally(Pending(
                header.correlation_id, header.api_key, header.api_version, now,
                local=bytes(decision.response.encode()), policy=policy))
        else:  # Close, or an answer to an acks=0 Produce, which has none to carry it
            conn.refused += 1
            reason = (decision.reason if isinstance(decision, Close) else
                      "refused a Produce request with acks=0 (no response possible)")
            if expects_response:
                # The client waits for this request's answer before any later one's.
                raise _Close(reason, logging.INFO)
            self._stop_after_answers(reason, logging.INFO)

    async def _reauthenticate_if_due(self) -> None:
        """Before a request goes up: authenticate to the broker again if the session is
        near its end (no clock read where the broker gave no end)."""
        if self.reauthenticate_at < math.inf and self.now() >= self.reauthenticate_at:
            await self._reauthenticate_upstream()

    async def _reauthenticate_upstream(self) -> None:
        """Authenticate to the broker again before the session it gave ends (KIP-368),
        between the client's requests: once every answer owed has come (the broker takes
        no re-authentication with requests in flight), the exchange goes through the
        line like the client's requests, its answers kept by the proxy.  The client
        waits meanwhile (a request in hand is not sent yet); it sees no change."""
        credentials = self.ctx.upstream_credentials
        assert credentials is not None
        while self.line:
            await self.line_empty.park()
        try:
            lifetime = await authenticate_upstream(self._own_call, credentials,
                                                   self.upstream_host)
        except SaslError as exc:
            raise _Close(f"re-authentication to broker {self.conn.upstream} failed: {exc}",
                         logging.WARNING) from None
        except ProtocolError as exc:
            self._malformed("response", exc)
        now = self.now()
        self.reauthenticate_at = (now + lifetime * _REAUTHENTICATE_AT if lifetime is not None
                                  else math.inf)
        log_event(logger, logging.DEBUG, "re-authenticated to the broker",
                  **self.conn.describe(), upstream=self.conn.upstream,
                  session_seconds=lifetime)

    async def _own_call(self, req: Request) -> Response:
        """One request of the proxy's own on this connection, answered: queued in the line
        (its answer is handed back, not sent to the client), then sent."""
        answers: list[bytes] = []
        answered = trio.Event()

        def keep(frame: bytes) -> None:
            answers.append(frame)
            answered.set()

        await self._queue(Pending(req.correlation_id, req.api_key, req.api_version,
                                  self.now(), internal=keep))
        await self.upstream_io.send_frame(req.encode())
        await answered.wait()
        resp = decode_response(answers[0], req.api_key, req.api_version)
        resp.body  # noqa: B018 - decoded here, inside the caller's error handling
        return resp

    async def _answer_locally(self, pending: Pending) -> None:
        """An answer the proxy makes (``pending.local``), in its place in line."""
        if self.line:  # behind answers still owed: sent after them
            await self._queue(pending)
        else:  # nothing owed: the upstream reader is not writing to the client
            await self._send_local(pending)

    async def _answer_client_sasl(self, req: Request, size: int) -> None:
        """A request of a client the proxy authenticates (sasl.downstream) that is the
        proxy's to answer: its SaslHandshake or SaslAuthenticate, or, before it has
        proved who it is, anything but ApiVersions (closed, as a broker's SASL listener
        does)."""
        sasl = self.client_sasl
        assert sasl is not None
        header = req.header
        key = header.api_key
        if key not in (SASL_HANDSHAKE, SASL_AUTHENTICATE):
            raise _Close(f"{api_name(key)} before SASL authentication (sasl.downstream: "
                         "the client must authenticate first)", logging.WARNING)
        if sasl.user is not None and self.client_session_ends == math.inf:
            raise _Close(f"{api_name(key)} after authenticating as {sasl.user!r} (the proxy "
                         "asks for no re-authentication)", logging.WARNING)
        try:
            body = req.body
        except (ProtocolError, UnknownApi) as exc:
            self._malformed("request", ProtocolError(str(exc)))
        self.ctx.observer.request(self.conn, req, size)
        if key == SASL_HANDSHAKE:
            mechanism = str(body.mechanism)
            code = sasl.handshake(mechanism, header.api_version)
            answer = handshake_answer(req, code, sasl.mechanisms)
            await self._answer_locally(Pending(header.correlation_id, key, header.api_version,
                                               self.now(), local=bytes(answer.encode()),
                                               by_proxy=True))
            if code:
                self.conn.refused += 1
                self._stop_after_answers(f"SASL handshake for {mechanism!r} refused (the proxy "
                                         f"offers {', '.join(sasl.mechanisms)}; a client "
                                         "authenticates again with the mechanism it used, "
                                         "in SaslHandshake v1)")
            return
        await self._client_sasl_token(bytes(body.auth_bytes), req)

    async def _client_sasl_token(self, token: bytes, req: Request | None) -> None:
        """One SASL token of a client the proxy authenticates: in a SaslAuthenticate
        (``req``) or raw after a SaslHandshake v0 (``req`` None; the answer is raw too,
        and a failure just closes, as Kafka does)."""
        sasl = self.client_sasl
        assert sasl is not None
        try:
            if sasl.slow_step:  # PBKDF2 (PLAIN against SCRAM credentials): off the loop
                answer, done = await trio.to_thread.run_sync(sasl.step, token)
            else:
                try:
                    answer, done = sasl.step(token)
                except UnknownSigningKey as unknown:
                    # The identity provider may have a new key: its JWKS fetched again
                    # (not too often), then the token checked once more.
                    assert sasl.tokens is not None
                    if await sasl.tokens.fetch_for_unknown_key():
                        try:
                            answer, done = sasl.step(token)
                        except UnknownSigningKey as still:
                            answer, done = sasl.refuse_unknown_key(still)
                    else:
                        answer, done = sasl.refuse_unknown_key(unknown)
            failure = None
        except SaslError as exc:
            answer, done, failure = b"", True, str(exc)
            # As a broker waits (connection.failed.authentication.delay.ms): a client
            # guessing passwords gets its answers, and new connections, more slowly.
            await trio.sleep(FAILED_AUTHENTICATION_DELAY)
        now = self.now()
        lifetime = self.ctx.sasl_session_lifetime
        if done and failure is None:
            again = self.conn.principal == sasl.user and self.client_session_ends < math.inf
            self.conn.principal = sasl.user
            if sasl.expires is not None:  # OAUTHBEARER: no longer than the token
                left = max(sasl.expires - time.time(), _SHORTEST_SESSION)
                lifetime = left if lifetime is None else min(lifetime, left)
            elif sasl.users is not None and sasl.mechanism != GSSAPI:
                sasl.users.sessions.add(self)  # a users file reload may revoke it
            if lifetime is not None:
                self.client_session_ends = now + lifetime
            log_event(logger, logging.DEBUG, "client authenticated again" if again
                      else "client authenticated", **self.conn.describe(),
                      mechanism=sasl.mechanism)
        if req is None:
            sasl.raw = not done
            if failure is None:
                # Under SaslAuthenticate's key: what the metrics' principal census
                # listens for (a raw answer is never decoded).
                await self._answer_locally(Pending(-1, SASL_AUTHENTICATE, 0, now, local=answer,
                                                   raw=True, by_proxy=True))
        else:
            header = req.header
            reply = authenticate_answer(req, answer, _failure_message(sasl.mechanism, failure),
                                        lifetime if done else None)
            await self._answer_locally(Pending(header.correlation_id, SASL_AUTHENTICATE,
                                               header.api_version, now,
                                               local=bytes(reply.encode()), by_proxy=True))
        if failure is not None:
            self.conn.refused += 1
            who = f" as {sasl.claimed!r}" if sasl.claimed is not None else ""
            self._stop_after_answers(f"SASL authentication{who} ({sasl.mechanism}) "
                                     f"failed: {failure}")

    @property
    def sasl_user(self) -> str | None:
        """The user this connection authenticated as with the proxy (sasl.downstream)."""
        return None if self.client_sasl is None else self.client_sasl.user

    def revoke(self, reason: str) -> None:
        """The user's access was revoked (a users file reload): the connection takes no
        more requests, answers those it took, and closes."""
        self._record_close(reason, logging.WARNING)
        self._drain(reason)

    def _stop_after_answers(self, reason: str, level: int = logging.WARNING) -> None:
        """Read no more requests: the connection closes, with ``reason``, once the
        answers owed are sent.  Also where a request that is owed no answer (an acks=0
        Produce) ends the connection: a broker owes none by then (it reads a
        connection's next request once it has answered the last), so a client sees the
        same, its earlier requests answered and then the close."""
        self._record_close(reason, level)
        self.stop_reading = True

    async def _hold_for_quotas(self, charges: tuple[Charge, ...], policy: Policy,
                               api_key: int, size: int, now: float) -> float:
        """A request under quotas: held while a quota it spends from is in debt (the
        client's earlier requests or answers took more than its rate: the connection is
        not read meanwhile, so TCP pushes back), then spent from; the time it goes on."""
        held: dict[str, tuple[Charge, float]] = {}  # enforced rule -> its longest wait
        observed: set[str] = set()
        for charge in charges:
            wait = charge.bucket.wait(now)
            if wait <= 0:
                continue
            if charge.mode == "enforce":
                if wait > held.get(charge.rule, (charge, 0.0))[1]:
                    held[charge.rule] = (charge, wait)
            elif charge.rule not in observed:
                observed.add(charge.rule)
                policy.throttled(self.conn, charge, wait, held=False)
        if held:
            # Each rule in debt counts the time it holds the request; the request waits
            # for the longest.
            for charge, wait in held.values():
                policy.throttled(self.conn, charge, wait, held=True)
            await trio.sleep(max(wait for _, wait in held.values()))
            now = self.now()
        for charge in charges:
            if charge.kind == "requests":
                charge.bucket.spend(1, now)
            elif charge.kind == "produce_bytes" and api_key == PRODUCE:
                charge.bucket.spend(size, now)
        return now

    def _count_request(self, header: Any) -> None:
        conn = self.conn
        conn.requests += 1
        by_api = conn.api_requests
        key: int | str = header.api_key
        count = by_api.get(key)
        if count is None:
            if len(by_api) >= CONN_APIS_MAX:  # keys no API has, a client's choice
                key = OTHER
            count = by_api.get(key, 0)
        by_api[key] = count + 1
        if header.client_id is not None:
            conn.client_id = header.client_id

    async def _stream_request(self, reader: FrameReader, size: int) -> Buffer | None:
        """A large Produce request that has begun to arrive, sent upstream as its bytes
        come when the policy forwards it unread (``Policy.forwards_unread``: maybe with
        its first bytes changed, a topic renamed), else received whole and then handled:
        b"" once it is sent (nothing is read past its end), None when it is not one to
        stream.  Its observers see it whole, as the client sent it, before its last
        bytes go up, so before any answer."""
        if size < _STREAM_REQUEST_MIN or self.sasl_raw_rounds != 0 or self.store_and_forward:
            return None
        head = reader.peek_partial(_REQUEST_HEAD)
        try:
            req = decode_request(memoryview(head)[4:])
            if req.api_key != PRODUCE or not req.known:
                self.store_and_forward = True
                return None
            acks = produce_acks(req)
        except ProtocolError:
            # Received whole then (and reported as any other request), unless its
            # header has not all arrived yet.
            self.store_and_forward = len(head) >= _REQUEST_HEAD
            return None
        policy = self.ctx.get_policy()
        decision = policy.forwards_unread(self.conn, req)
        if decision is None:
            return await self._receive_whole_request(reader, size)
        header = req.header
        self._count_request(header)
        await self._reauthenticate_if_due()
        pending = None
        if acks != 0:
            pending = Pending(header.correlation_id, PRODUCE, header.api_version,
                              self.now(), wants_response=decision.wants_response,
                              context=decision.context, policy=policy)
            await self._queue(pending)  # before its bytes go up, as in _forward
        total = 4 + size
        head = reader.take_partial()
        lead, skip = b"", 0  # what goes first in place of the frame's first skip bytes
        if decision.new_head is not None:
            # The new beginning, under the new size; the rest goes up as it came.
            new_head, end = decision.new_head
            lead, skip = struct.pack(">i", size - end + len(new_head)) + new_head, 4 + end
        # Its records go socket to socket unless an observer reads them; where observers
        # count them, the walk does on the way (from each batch's header).
        observer = self.ctx.observer
        walk = None
        if (observer.counts_request_records and req.api_version in _WALKED_PRODUCE_VERSIONS
                and self.client_io.peeks):
            walk = produce.RequestWalk(req.api_version, size)
        pipe = (self._take_pipe() if self.splices_requests and not observer.reads_request_bodies
                and (walk is not None or not observer.counts_request_records) else None)
        if pipe is not None:
            await self._splice_request(head, lead + memoryview(head)[skip:] if skip else head,
                                       total, decision, pending, pipe, walk)
            self.client_read = _SPLICE_READ
            return b""
        limit = total - 1  # the last byte waits for the observers
        if lead:
            await self.upstream_io.send_all(lead)
        whole, view = await self._relay_large(
            head, total, limit, self.client_io.receive_into,
            self.upstream_io.send_all, self._received_from_client,
            f"client closed the connection in the middle of a {size}-byte request", skip)
        self._touch()
        frame = view.toreadonly()[4:]
        self._observed(decode_request(frame), size, decision)
        if pending is not None:
            pending.started = self.now()  # its answer's time runs from here
        await self.upstream_io.send_all(view[limit:])
        del frame, view  # the buffer goes back once no one else holds a view of it
        self.ctx.frame_buffers.give(whole)
        return b""

    def _observed(self, req: Request, size: int, decision: Forward) -> None:
        """A request forwarded unread, as its observers see it, then its decision
        reported (in that order, as ``handle_request_frame`` has them)."""
        self.ctx.observer.request(self.conn, req, size)
        if decision.report is not None:
            decision.report()

    async def _splice_request(self, head: Buffer, sent: Buffer, total: int, decision: Forward,
                              pending: Pending | None, pipe: Pipe,
                              walk: produce.RequestWalk | None) -> None:
        """A large Produce request forwarded unread up to the broker: ``sent`` first (for
        ``head``, the frame's first bytes as they came, maybe changed), then the rest
        socket to socket through ``pipe``.  Where no observer reads its body, they hear
        of it (``decision.request``: its header) before its bytes go up.  Where they
        count its records, ``walk`` reads each batch's header: the parts around the
        records are peeked at where they lie in the client's socket (past records not yet
        moved, where the system can: SO_PEEK_OFF), so the records usually go in one
        splice, once the walk has seen every part but records; the observers hear of it
        then, with what the walk counted, before its last bytes go up (so before any
        answer).  A request the walk cannot follow goes on unread at once, reported
        uncounted (the broker answers for it)."""
        size = total - 4
        gone = f"client closed the connection in the middle of a {size}-byte request"
        counted = walk is not None
        walking = self._walked(walk, memoryview(head)[4:])
        client = self.client_io
        moved = len(head)  # bytes of the frame taken from the client's socket
        at = moved  # bytes of the frame the walk has gone past (read or skipped)
        try:
            while walking is not None and not walking.finished:
                try:
                    at, reached = client.peek_walk(walking, at, moved, total)
                except produce.Unexpected:
                    walking = None  # not a request the walk can follow
                    break
                if reached == fastio.PAST_END:  # the frame ends inside a part
                    walking = None
                elif reached == fastio.WALKED:
                    break
                elif at > moved:  # nothing more to see yet: on with what was walked
                    await self._splice_up(sent, at - moved, pipe, gone)
                    sent = b""
                    moved = at
                elif reached == fastio.EMPTY:
                    await client.wait_readable()
                else:
                    raise _Close(gone, logging.WARNING)  # EOF
            req = decision.request
            if counted:
                produce.remember_request_topics(req, None if walking is None
                                                else walking.topics())
            self._observed(req, size, decision)
            if pending is not None:
                pending.started = self.now()
            await self._splice_up(sent, total - moved, pipe, gone)
        finally:
            self._give_pipe(pipe)
        self._touch()

    async def _splice_up(self, first: Buffer, n: int, pipe: Pipe, gone: str) -> None:
        """``first`` (bytes in hand) then the client's next ``n`` bytes, up to the broker."""
        if first:
            await self.upstream_io.send_all(first)
        if n:
            await self._splice(self.client_io, self.upstream_io, n, pipe,
                               self._received_from_client, gone)

    def _walked(self, walk: produce.RequestWalk | None, data: Buffer
                ) -> produce.RequestWalk | None:
        """``walk`` fed ``data``; None once it cannot follow the request."""
        if walk is not None:
            try:
                walk.feed(data)
            except produce.Unexpected:
                return None
        return walk

    async def _receive_whole_request(self, reader: FrameReader, size: int) -> Buffer:
        """A large request that must be read before it goes up (a rule maps its topics,
        say), received straight into a pooled buffer rather than gathered from chunks
        into a new one (whose pages would be faulted in afresh for every request), then
        handled as any other; b"" (nothing is read past its end)."""
        whole, view = await self._relay_large(
            reader.take_partial(), 4 + size, 0, self.client_io.receive_into, _send_nothing,
            self._received_from_client,
            f"client closed the connection in the middle of a {size}-byte request")
        self._touch()  # a whole request, as in client_reader
        await self.handle_request_frame(view.toreadonly())
        del view  # the buffer goes back once no one else holds a view of it
        self.ctx.frame_buffers.give(whole)
        return b""

    def _received_from_client(self, n: int) -> None:
        self.conn.bytes_from_client += n

    async def _relay_large(
        self, head: Buffer, total: int, limit: int,
        receive_into: Callable[[memoryview], Awaitable[int]],
        send: Callable[[Any], Awaitable[None]], received: Callable[[int], None], gone: str,
        skip: int = 0,
    ) -> tuple[bytearray, memoryview]:
        """A frame of ``total`` bytes whose first bytes, ``head``, are in hand: the rest
        received straight into a pooled buffer (never past the frame's end), its bytes
        from ``skip`` (the caller sent its own for those before) to ``limit`` sent on
        with ``send`` as they come.  Returns the buffer and the frame's view in it: the
        caller sends the rest and gives the buffer back.  ``received(n)`` hears of each
        piece; the other end closing raises ``gone``."""
        whole = self.ctx.frame_buffers.take(total)
        view = memoryview(whole)[:total]
        got = len(head)
        view[:got] = head
        sent = max(min(got, limit), skip)
        if sent > skip:
            await send(view[skip:sent])
        while got < total:
            n = await receive_into(view[got:])
            if not n:
                raise _Close(gone, logging.WARNING)
            got += n
            received(n)
            if sent < limit:
                upto = min(got, limit)
                await send(view[sent:upto])
                sent = upto
        return whole, view

    async def _forward(self, wire: Any, pending: Pending | None, *, prefixed: bool = True
                       ) -> None:
        """A request up to the broker: ``wire`` as it came (with its size prefix), or a
        changed frame without one (``prefixed=False``)."""
        await self._reauthenticate_if_due()
        if pending is not None:
            # Queued before the bytes go up, so the entry is there when the answer comes.
            await self._queue(pending)
        # Sent by this task: a hand-off to a writer task would put a trip through the
        # scheduler on every request's path.  Outside the drain's scope: a request
        # already accepted goes up whole.
        if prefixed:
            await self.upstream_io.send_all(wire)
        else:
            await self.upstream_io.send_frame(wire)

    # -- upstream -> client ----------------------------------------------------------

    def _received_from_upstream(self, n: int) -> None:
        self._touch()  # every byte from the broker is activity

    async def _receive_from_upstream(self) -> bytes | bytearray:
        data = await self.upstream_io.receive_some(self.answer_read)
        self._touch()
        return data

    async def _queue(self, pending: Pending) -> None:
        # A full line stops this reader: backpressure on a client that floods us.
        while len(self.line) >= self.limits.max_in_flight:
            await self.room.park()
        self.line.append(pending)

    def _answered_first(self) -> None:
        """The oldest entry's answer is sent: it leaves the line."""
        self.line.popleft()
        if self.room:
            self.room.unpark()
        if not self.line:
            if self.line_empty:  # rarely anyone there: the call costs more than the look
                self.line_empty.unpark_all()
            if self.client_done:
                self.answered.unpark_all()

    async def upstream_reader(self) -> None:
        line = self.line
        async for wire, ticket in self._wire_frames(self._receive_from_upstream,
                                                    "response", self.response_bytes,
                                                    self._stream_response):
            if not line:
                raise _Close(f"broker {self.conn.upstream} sent a response to no request",
                             logging.WARNING)
            pending = line[0]  # forwarded: the proxy's own answers never wait at the head
            if pending.raw:
                if pending.sasl_user is not None:
                    self._raw_sasl_answer(memoryview(wire)[4:], pending)
                await self._send_client(wire)
                if pending.api_key == SASL_AUTHENTICATE:
                    self._answered(pending, None, len(wire) - 4)
            elif pending.internal is not None:  # the proxy's own request's answer
                frame = memoryview(wire)[4:]
                if len(frame) < 4:
                    self._malformed("response", ProtocolError(f"response of {len(frame)} bytes"))
                (correlation_id,) = _SIZE.unpack_from(frame, 0)
                if correlation_id != pending.correlation_id:
                    raise _out_of_step(correlation_id, pending)
                pending.internal(bytes(frame))
            else:
                await self._answer(wire, pending)
            if ticket:
                self.response_bytes.give(ticket)
            await self._answer_sent()
        if in_flight := self.in_flight:
            raise _Close(f"broker {self.conn.upstream} closed the connection with "
                         f"{in_flight} request(s) in flight", logging.WARNING)
        raise _Close(f"broker {self.conn.upstream} closed the connection")

    async def _answer(self, wire: Buffer, pending: Pending) -> None:
        """The broker's answer to ``pending`` (a request forwarded for the client, the
        line's first), ``wire`` with its size prefix, handled and sent on."""
        frame = memoryview(wire)[4:]
        charges = self._quota_charges(pending)
        throttle = self._answer_throttle(pending, len(frame), charges) if charges else 0
        out = await self.handle_response_frame(frame, pending)
        if throttle:
            out = self._with_throttle(out, pending, throttle)
        if out is frame:
            await self._send_client(wire)
        else:
            await self._send_client_frame(out)
        self._answered(pending, out)

    async def _receive_whole_answer(self, reader: FrameReader, size: int,
                                    pending: Pending) -> None:
        """A large answer that is read whole before it goes on (its body may change: an
        address rewritten, values decrypted), received straight into a pooled buffer in
        reads as long as what is left of it, rather than gathered from reads of
        ``answer_read`` bytes into a new buffer (whose pages would be faulted in afresh
        for every answer: a decrypting consumer's 3 MB Fetch answers); then handled as
        any other."""
        whole, view = await self._relay_large(
            reader.take_partial(), 4 + size, 0, self.upstream_io.receive_into,
            _send_nothing, self._received_from_upstream,
            f"broker {self.conn.upstream} closed the connection in the middle of an answer")
        await self._answer(view.toreadonly(), pending)
        del view  # the buffer goes back once no one else holds a view of it
        self.ctx.frame_buffers.give(whole)
        await self._answer_sent()

    async def _answer_sent(self) -> None:
        """The oldest entry's answer is sent; the proxy's own answers in line behind it
        go now: no broker answer will come for them."""
        line = self.line
        self._answered_first()
        while line and line[0].local is not None:
            await self._send_local(line[0])
            self._answered_first()

    async def _stream_response(self, reader: FrameReader, size: int) -> Buffer | None:
        """A large answer that has begun to arrive, sent on to the client as its bytes
        come (all but a Fetch v16+ answer's last ``_TAIL_HOLD`` bytes, which wait for
        its end: see ``_streamed_tail``); b"" once it is sent (nothing is read past its
        end), or None when it is not one to stream (small, or its body may change before
        the end).  One whose body may change is received whole here, if large
        (``_receive_whole_answer``)."""
        line = self.line
        if size < min(self.stream_min, _WHOLE_ANSWER_MIN) or not line or reader.buffered < 8:
            return None
        pending = line[0]
        hold = _held_tail(pending)
        if hold is None:
            if pending.raw or pending.internal is not None or size < _WHOLE_ANSWER_MIN:
                return None
            await self._receive_whole_answer(reader, size, pending)
            return b""
        if size < self.stream_min:
            return None
        charges = self._quota_charges(pending)
        if charges and reader.buffered < _THROTTLE_HEAD:
            return None  # the throttle time may have to be written in its first bytes
        pipe = self._take_pipe() if self._splices(pending, hold) else None
        if pipe is None and size < _STREAM_MIN:
            return None
        head: Buffer = reader.take_partial()
        (correlation_id,) = _SIZE.unpack_from(head, 4)
        if correlation_id != pending.correlation_id:
            raise _out_of_step(correlation_id, pending)
        if charges and (throttle := self._answer_throttle(pending, size, charges)):
            head = self._with_throttle_in_head(head, pending, throttle)
        total = 4 + size
        if pipe is not None:
            version = pending.api_version
            if self.counts_answers:
                await self._splice_counted_response(
                    head, total, pending, fetch.AnswerWalk(version, size, count=True), pipe, hold)
            else:
                await self._splice_response(
                    head, total, pending, fetch.AnswerWalk(version, size) if hold else None, pipe)
            self._answered(pending, None, size)
            await self._answer_sent()
            return b""
        limit = total - hold  # bytes that go on as they come
        # The whole answer, for its tail and the observers (no chunks to join).
        whole, view = await self._relay_large(
            head, total, limit, self.upstream_io.receive_into, self._send_client,
            self._received_from_upstream,
            f"broker {self.conn.upstream} closed the connection in the middle of an answer")
        frame = view.toreadonly()[4:]
        out = frame
        if limit < total:
            out = await self._streamed_tail(frame, pending, limit - 4)
            await self._send_client(out[limit - 4:])
        self._answered(pending, out)
        del frame, out, view  # the buffer goes back once no one else holds a view of it
        self.ctx.frame_buffers.give(whole)
        await self._answer_sent()
        return b""

    def _take_pipe(self) -> Pipe | None:
        """A pipe to splice through; None when there is none (the bytes then go through
        the proxy's buffers)."""
        pipes = self.ctx.pipes
        return None if pipes is None else pipes.take()

    def _spliced_to_client(self, n: int) -> None:
        self.conn.bytes_to_client += n
        self._touch()

    def _give_pipe(self, pipe: Pipe) -> None:
        pipes = self.ctx.pipes
        assert pipes is not None
        pipes.give(pipe)

    async def _splice(self, src: FastStream, dst: FastStream, n: int, pipe: Pipe,
                      heard: Callable[[int], None], gone: str) -> None:
        """``n`` bytes from ``src`` to ``dst`` through ``pipe`` (``heard`` of each piece
        received), counted in the pool; ``src`` closing first raises ``gone``."""
        moved = await src.splice_to(dst, n, pipe, heard)
        pipes = self.ctx.pipes
        assert pipes is not None
        pipes.spliced += moved
        self._touch()
        if moved < n:
            raise _Close(gone, logging.WARNING)

    def _splices(self, pending: Pending, hold: int) -> bool:
        """Whether a streamed answer's bytes may go socket to socket: the connection
        splices, and the proxy can find the answer's tag section without its records
        (a Fetch answer's) or need not look (no addresses in it); where observers read
        what answers carry, only a Fetch answer (its records counted on the way)."""
        if not self.splicing:
            return False
        walked = pending.api_key == FETCH and pending.api_version in _WALKED_FETCH_VERSIONS
        return walked or not (hold or self.counts_answers)

    async def _splice_response(self, head: Buffer, total: int, pending: Pending,
                               walk: fetch.AnswerWalk | None, pipe: Pipe) -> None:
        """A large answer of ``total`` bytes, whose first ones are ``head``, sent on with
        its records moved socket to socket (never read into the proxy).  With ``walk``
        (a Fetch answer that may name leaders), the structure around the records is
        read to find the top-level tag section, which waits for the answer's end and is
        rewritten in place if it names brokers (see ``_tail_with_proxy_addresses``)."""
        gone = f"broker {self.conn.upstream} closed the connection in the middle of an answer"
        try:
            got = len(head)
            out = memoryview(head)  # in hand, not yet sent (the size prefix included)
            fresh = out[4:]  # of which the walk has not seen these
            tail: bytearray | None = None
            while True:
                if walk is not None:
                    try:
                        taken = walk.feed(fresh)
                    except fetch.Unexpected:
                        raise self._bad_answer() from None
                    if walk.tags_at is not None:  # the rest of the answer is the tail
                        tail = bytearray(fresh[taken:])
                        out = out[:len(out) - (len(fresh) - taken)]
                if out:
                    await self._send_client(out)
                left = total - got
                if tail is not None or not left:
                    break
                if walk is None or walk.opaque:
                    n = left if walk is None else min(walk.opaque, left)
                    await self._splice(self.upstream_io, self.client_io, n, pipe,
                                       self._spliced_to_client, gone)
                    got += n
                    if walk is not None:
                        walk.skip(n)
                    out = fresh = memoryview(b"")
                    continue
                data = await self._answer_bytes(min(left, _SPLICE_READ), gone)
                got += len(data)
                out = fresh = memoryview(data)
            if walk is None:
                return
            if tail is None:
                raise self._bad_answer()  # ended before its tag section
            await self._receive_rest(tail, total - got, gone)
            await self._send_client(await self._tail_with_proxy_addresses(pending, walk.head, tail))
        finally:
            self._give_pipe(pipe)

    async def _splice_counted_response(self, head: Buffer, total: int, pending: Pending,
                                       walk: fetch.AnswerWalk, pipe: Pipe, hold: int) -> None:
        """A large Fetch answer sent on as ``_splice_response`` sends it, its records
        counted on the way for the observers that read what answers carry: ``walk``
        (``count``) reads every part but the records, batch headers included, peeked at
        where they lie in the broker's socket (as a spliced Produce request's parts are
        in the client's), so the records usually go in a few long splices.  The
        top-level tag section is received, rewritten where ``hold`` says it may name
        leaders, and sent last; what the walk read is left in ``pending.scan``."""
        gone = f"broker {self.conn.upstream} closed the connection in the middle of an answer"
        upstream = self.upstream_io
        try:
            view = memoryview(head)
            moved = len(head)  # bytes of the frame taken from the broker's socket
            try:
                at = 4 + walk.feed(view[4:])  # bytes of the frame the walk has gone past
                await self._send_client(view[:at])
                while not walk.finished:
                    at, reached = upstream.peek_walk(walk, at, moved, total)
                    if reached == fastio.WALKED:
                        break
                    if reached == fastio.PAST_END:
                        raise self._bad_answer()  # the frame ends inside a part
                    if at > moved:  # nothing more to see yet: on with what was walked
                        await self._splice(upstream, self.client_io, at - moved, pipe,
                                           self._spliced_to_client, gone)
                        moved = at
                    elif reached == fastio.EMPTY:
                        await upstream.wait_readable()
                    else:
                        raise _Close(gone, logging.WARNING)  # EOF
            except fetch.Unexpected:
                raise self._bad_answer() from None
            if at > moved:
                await self._splice(upstream, self.client_io, at - moved, pipe,
                                   self._spliced_to_client, gone)
                moved = at
            tail = bytearray(view[at:])  # the tag section, which ends the answer
            await self._receive_rest(tail, total - moved, gone)
            pending.scan = walk.scan(tail)
            await self._send_client(await self._tail_with_proxy_addresses(pending, walk.head, tail)
                                    if hold else tail)
        finally:
            self._give_pipe(pipe)

    async def _receive_rest(self, tail: bytearray, n: int, gone: str) -> None:
        """The last ``n`` bytes of an answer being spliced (its tag section), added to
        ``tail``; the broker closing first raises ``gone``."""
        while n > 0:
            data = await self._answer_bytes(n, gone)
            n -= len(data)
            tail += data

    async def _answer_bytes(self, max_bytes: int, gone: str) -> bytes | bytearray:
        """The next bytes of an answer being spliced (at most ``max_bytes``); the broker
        closing first raises ``gone``."""
        data = await self.upstream_io.receive_some(max_bytes)
        if not data:
            raise _Close(gone, logging.WARNING)
        self._touch()
        return data

    def _bad_answer(self) -> _Close:
        return _Close(f"broker {self.conn.upstream} sent an answer that is not a Fetch "
                      f"response after its first bytes had gone on", logging.WARNING)

    async def _tail_with_proxy_addresses(self, pending: Pending, head: bytes,
                                         tail: Buffer) -> Any:
        """A streamed Fetch answer's top-level tag section (``tail``, which ends the
        answer; ``head``: the answer up to its topics) as the client gets it: the same
        bytes unless it names leaders, which are then rewritten in a section of the
        same size, read from an answer made of the head, no topics and the tail."""
        key, version = pending.api_key, pending.api_version
        try:
            present = tuple(tag for tag, _ in fetch.tag_fields(memoryview(tail), 0))
        except (fetch.Unexpected, IndexError):
            raise self._bad_answer() from None
        tags = address_tags(key, version)
        if tags is not None and tags.isdisjoint(present):
            return tail
        try:
            resp = decode_response(b"".join((head, b"\x01", tail)), key, version)
            resp = await self._with_proxy_addresses(resp)
        except ProtocolError:
            raise self._bad_answer() from None
        new = fetch.top_level_tag_fields(resp.encode(), version)
        if new is None:
            raise self._bad_answer()
        return self._fitted_tags(key, version, new[1], len(tail))

    def _fitted_tags(self, key: int, version: int, fields: list[tuple[int, bytes]],
                     size: int) -> bytes:
        """A tag section of ``size`` bytes with ``fields``, or without the leaders when
        they do not fit (the client then finds them through Metadata)."""
        free = _first_unknown_tag(key)
        section = fetch.fit_tag_section(fields, size, free)
        tags = address_tags(key, version)
        if section is None and tags is not None:
            section = fetch.fit_tag_section([f for f in fields if f[0] not in tags], size, free)
        if section is None:
            raise _Close(f"broker {self.conn.upstream} sent a Fetch answer whose tags "
                         f"could not be rewritten in place", logging.WARNING)
        return section

    async def _streamed_tail(self, frame: memoryview, pending: Pending, sent: int) -> Any:
        """A streamed Fetch v16+ answer as the client gets it, whose first ``sent`` bytes
        (after the size prefix) are already on their way: ``frame`` itself unless its
        top-level tags name leaders.  Those are rewritten as a spliced answer's are
        (``_tail_with_proxy_addresses``: the tag section alone, kept to its size, for
        the size prefix has gone), with no need to decode the records' part."""
        version = pending.api_version
        if version not in _WALKED_FETCH_VERSIONS:  # newer than the codec: untouched
            return frame
        if self._names_no_brokers(pending, frame):
            return frame
        parts = fetch.head_and_tags_at(frame, version)
        if parts is None or parts[1] < sent:
            raise self._bad_answer()
        head_end, at = parts
        section = await self._tail_with_proxy_addresses(pending, bytes(frame[:head_end]),
                                                        frame[at:])
        return memoryview(b"".join((frame[:at], section)))

    def _names_no_brokers(self, pending: Pending, frame: Any) -> bool:
        """Whether a Produce v10+ or Fetch v16+ answer's bytes show that it names no new
        leaders (KIP-951 NodeEndpoints, a top-level tagged field): most of them are then
        not decoded.  The walk is kept for the observers that read it."""
        present = top_level_tags(pending, frame, self.ctx.observer.reads_scans)
        tags = address_tags(pending.api_key, pending.api_version)
        return present is not None and tags is not None and tags.isdisjoint(present)

    async def _with_proxy_addresses(self, resp: Response) -> Response:
        """``resp`` with the proxy's address for every broker it names: first the brokers
        are learnt (their listeners must be open before the client reads their
        addresses), then rewritten with their ports."""
        if resp.api_key == DESCRIBE_CONFIGS:  # names brokers, lists none to learn
            return rewrite_addresses(resp, self.ctx.address_mapper)[0]
        _, seen = rewrite_addresses(resp, _keep)
        if seen:
            await self.ctx.brokers_seen(seen)
            resp, _ = rewrite_addresses(resp, self.ctx.address_mapper)
        return resp

    async def _send_local(self, pending: Pending) -> None:
        """An answer the proxy made (a refusal), to the client."""
        assert pending.local is not None
        await self._send_client_frame(pending.local)
        self._answered(pending, pending.local)

    def _answered(self, pending: Pending, frame: Any, size: int | None = None) -> None:
        """The answer to ``pending`` is sent: ``frame`` (None when its bytes went by
        unread: ``size`` says how many there were)."""
        self.conn.responses += 1
        now = self.now()
        size = len(frame) if size is None else size
        self.ctx.observer.response(self.conn, pending, size, now - pending.started, frame)
        # The observers' decoded answer, done with: it may hold views of a pooled buffer
        # that is to go back for the next answer.
        pending.decoded = None

    def _quota_charges(self, pending: Pending) -> tuple[Charge, ...]:
        """The quotas a broker's answer to ``pending`` falls under (usually none)."""
        policy = pending.policy
        if policy is None or pending.local is not None:
            return ()
        # The time of the last activity is recent enough for finding buckets (every
        # answer asks: no clock read for connections under no quota).
        charges: tuple[Charge, ...] = policy.quota_charges(self.conn, self.last_active)
        return charges

    def _answer_throttle(self, pending: Pending, size: int,
                         charges: tuple[Charge, ...]) -> int:
        """An answer of ``size`` bytes from the broker, under the connection's quotas: a
        Fetch (or ShareFetch) answer's bytes are spent (the next request waits for the
        debt), and the milliseconds the client is asked to wait, as a broker's quotas ask in
        ``throttle_time_ms`` (KIP-219 clients then hold their next request back
        themselves; all report it): the longest debt of the enforced quotas of this
        answer's kind (``charges``: ``_quota_charges``).  0: nothing to say."""
        now = self.now()
        key = pending.api_key
        wait = 0.0
        for charge in charges:
            kind = charge.kind
            if kind == "fetch_bytes":
                if key not in FETCHES:
                    continue
                charge.bucket.spend(size + 4, now)
            elif kind == "produce_bytes" and key != PRODUCE:
                continue
            if charge.mode == "enforce":
                wait = max(wait, charge.bucket.wait(now))
        return math.ceil(wait * 1000)

    def _with_throttle(self, out: Any, pending: Pending, throttle: int) -> Any:
        """An answer (``out``: from its correlation id) asking the client to wait at least
        ``throttle`` ms: written in place where the field comes first, else the answer is
        decoded and encoded again (Produce's comes after its partitions: a small answer).
        The broker's own throttle stands when it is longer."""
        key, version = pending.api_key, pending.api_version
        written = _throttle_written(out, 0, pending, throttle)
        if written is not None:
            return written
        try:
            resp = decode_response(out, key, version)
            if not resp.known:
                return out
            body = resp.body
            current = getattr(body, "throttle_time_ms", None)
            if current is None or current >= throttle or not any(
                    f.attr == "throttle_time_ms" and f.present_in(version)
                    for f in api(key).response.root.fields):
                return out
            return resp.replace(body=body.replace(throttle_time_ms=throttle)).encode()
        except (ProtocolError, UnknownApi):
            return out  # the broker's bytes, as they were: the hold still applies

    def _with_throttle_in_head(self, head: Buffer, pending: Pending, throttle: int) -> Buffer:
        """The first bytes of a streamed answer (size prefix included) with the throttle
        time written in place (a streamed answer is a Fetch or another whose field comes
        first; if it did not fit in these bytes the hold alone applies)."""
        written = _throttle_written(head, 4, pending, throttle)
        return head if written is None else written

    async def handle_response_frame(self, frame: memoryview, pending: Pending) -> Any:
        """The response the client gets: ``frame`` itself when nothing changed."""
        if len(frame) < 4:
            self._malformed("response", ProtocolError(f"response of {len(frame)} bytes"))
        (correlation_id,) = _SIZE.unpack_from(frame, 0)
        if correlation_id != pending.correlation_id:
            raise _out_of_step(correlation_id, pending)
        key = pending.api_key
        if pending.sasl_user is not None:
            self._authenticated(frame, pending)
        rewrite = carries_addresses(key, pending.api_version)
        if rewrite and key in SCANNED_RESPONSES:
            # Read from the bytes, also when a policy will read the answer: walking a
            # decoded answer for addresses it does not hold costs more than the scan.
            rewrite = not self._names_no_brokers(pending, frame)
        if not (rewrite or key == API_VERSIONS or pending.wants_response
                or key in self.telemetry_answers):
            return frame  # nothing to look at: the original bytes go through
        policy: Policy = pending.policy or self.ctx.get_policy()
        adjusters: tuple[Any, ...] = ()
        kept: tuple[Any, ...] | None = None  # the key of a capped ApiVersions answer
        if key == API_VERSIONS:
            adjusters = policy.api_version_adjusters(self.conn)
            if not (rewrite or pending.wants_response):
                # Every connection starts with ApiVersions, and a broker gives the same
                # answer each time: capped once per answer and adjusters, then reused.
                kept = (pending.api_version, bytes(frame[4:]), adjusters)
                try:
                    body = self.ctx.api_versions_answers.get(kept)
                except TypeError:  # adjusters that cannot be part of a key: not kept
                    body = kept = None
                if body is not None:
                    return b"".join((frame[:4], body))
        try:
            came = resp = decode_response(frame, key, pending.api_version)
            if not resp.known:
                return frame
            if key in self.telemetry_answers:
                self.ctx.client_telemetry.subscribed(resp)
            if key == API_VERSIONS:
                resp = adjust_api_versions(resp, *adjusters, added=self.ctx.added_apis)
            if rewrite:
                resp = await self._with_proxy_addresses(resp)
            if pending.wants_response:
                work = policy.offload_response(self.conn, pending, resp)
                if work is not None:  # long work on a large answer: the loop serves on
                    await trio.to_thread.run_sync(work)
                resp = policy.on_response(self.conn, pending, resp)
            if resp is not came:
                pending.decoded = resp  # observers need not decode it again
                pending.scan = None  # a scan of the broker's bytes, not of these
            elif resp.body_decoded:
                pending.decoded = resp
            # else: the broker's very bytes go on, unread: observers read them as they
            # would had no policy looked (``scanned_response``), not by a decode.
            out = resp.encode()
            if kept is not None:
                self.ctx.remember_api_versions(kept, bytes(out[4:]))
            return out
        except UnknownApi:
            return frame
        except ProtocolError as exc:
            self._malformed("response", exc)

    def _sasl_request(self, req: Request, pending: Pending) -> bytes | None:
        """SaslHandshake: its mechanism (and v0's raw tokens to pass on); SaslAuthenticate:
        the name the client claims, its principal once the broker says yes.  A version
        the codec has no table for, or a body it cannot read, is the broker's to judge:
        the connection just has no principal.  Returns a GSSAPI exchange's first token
        (the client's ticket) when the brokers' keys are there to read it with."""
        try:
            if req.api_key == SASL_HANDSHAKE:
                mechanism = self.sasl_mechanism = str(req.body.mechanism).upper()
                self.sasl_first_token = True
                if req.api_version == 0:
                    self.sasl_raw_rounds = SASL_RAW_ROUNDS.get(mechanism)
                    self.sasl_raw_claim = None
            elif self.sasl_mechanism == GSSAPI:
                first, self.sasl_first_token = self.sasl_first_token, False
                if first and self.ctx.sasl_passthrough_kerberos is not None:
                    return bytes(req.body.auth_bytes)
            else:
                pending.sasl_user = claimed_user(self.sasl_mechanism, req.body.auth_bytes,
                                                 self.ctx.oauthbearer_claim)
        except (ProtocolError, UnknownApi):
            pass
        return None

    async def _ticket_user(self, ticket: bytes) -> str | None:
        """The client's name, from its ticket read with the brokers' keys (off the
        loop: the keytab is read, the ticket decrypted); None, logged, if it cannot be
        read (the login still goes on to the broker, which decides)."""
        keys = self.ctx.sasl_passthrough_kerberos
        assert keys is not None
        try:
            return await trio.to_thread.run_sync(keys.ticket_user, ticket)
        except SaslError as exc:
            log_event(logger, logging.WARNING, "Kerberos ticket not read",
                      **self.conn.describe(), reason=str(exc))
            return None

    def _raw_sasl_token(self, token: bytes, pending: Pending) -> None:
        """A raw token after SaslHandshake v0 (PLAIN, SCRAM): the first names the user
        the client claims; the last one's answer says whether the broker took it (a
        broker ends a failed raw exchange by closing the connection, so PLAIN's answer
        is a yes, and SCRAM's server-final message begins with its signature, ``v=``)."""
        if self.sasl_mechanism is None:
            return
        if self.sasl_raw_claim is None:
            self.sasl_raw_claim = claimed_user(self.sasl_mechanism, token,
                                               self.ctx.oauthbearer_claim) or ""
        if self.sasl_raw_rounds == 0 and self.sasl_raw_claim:
            # Its answer is the last of the exchange: under SaslAuthenticate's key, which
            # the principal census listens for (a raw answer is never decoded).
            pending.sasl_user, pending.api_key = self.sasl_raw_claim, SASL_AUTHENTICATE
            self.sasl_raw_claim = None

    def _raw_sasl_answer(self, answer: memoryview, pending: Pending) -> None:
        if self.sasl_mechanism == "PLAIN" or bytes(answer[:2]) == b"v=":
            self.conn.principal = pending.sasl_user

    def _authenticated(self, frame: memoryview, pending: Pending) -> None:
        """A SaslAuthenticate answer: with no error, the client is the user it claimed."""
        try:
            resp = decode_response(frame, SASL_AUTHENTICATE, pending.api_version)
            accepted = resp.known and resp.body.error_code == 0
        except (ProtocolError, UnknownApi):
            accepted = False
        if accepted:
            self.conn.principal = pending.sasl_user

    async def _send_client(self, wire: Any) -> None:
        await self.client_io.send_all(wire)
        self.conn.bytes_to_client += len(wire)
        self._touch()

    async def _send_client_frame(self, frame: Any) -> None:
        """A changed (or the proxy's own) answer, which has no size prefix yet."""
        await self.client_io.send_frame(frame)
        self.conn.bytes_to_client += 4 + len(frame)
        self._touch()


class _Share:
    """A connection's share of a budget all connections use: what it holds goes back
    when the connection ends, however it ends."""

    __slots__ = ("budget", "held")

    def __init__(self, budget: ByteBudget) -> None:
        self.budget = budget
        self.held = 0

    async def take(self, size: int) -> int:
        taken = await self.budget.take(size)
        self.held += taken
        return taken

    def give(self, size: int) -> None:
        self.held -= size
        self.budget.give(size)


def _out_of_step(correlation_id: int, pending: Pending) -> _Close:
    return _Close(f"broker answered correlation id {correlation_id}, expected "
                  f"{pending.correlation_id}: the connection is out of step", logging.WARNING)


def _held_tail(pending: Pending) -> int | None:
    """How many bytes at the end of a large answer to ``pending`` wait for its last byte
    (see ``ProxyConnection._stream_response``); None: the answer is not streamed, for
    its body may change (a rewrite or a policy) or it is not a Kafka answer."""
    if (pending.raw or pending.wants_response or pending.api_key == API_VERSIONS
            or pending.internal is not None):
        return None
    if not carries_addresses(pending.api_key, pending.api_version):
        return 0
    if pending.api_key == FETCH and address_tags(pending.api_key, pending.api_version):
        return _TAIL_HOLD
    return None


def _throttle_written(data: Any, start: int, pending: Pending, throttle: int) -> Any:
    """``data`` (an answer from its correlation id at ``start``) with a throttle time of
    at least ``throttle`` ms written in place: itself when the broker's is as long, a
    changed copy otherwise; None when the field is not the body's first (or not in
    these bytes)."""
    at = throttle_time_at(memoryview(data)[start:], pending.api_key, pending.api_version)
    if at is None:
        return None
    at += start
    (current,) = _SIZE.unpack_from(data, at)
    if current >= throttle:
        return data
    changed = bytearray(data)
    _SIZE.pack_into(changed, at, throttle)
    return changed


def _first_unknown_tag(api_key: int) -> int:
    """A top-level tag number the API's responses do not define (in any version)."""
    tags = [f.tag for f in api(api_key).response.root.fields if f.tag is not None]
    return max(tags, default=-1) + 1


async def _send_nothing(data: Any) -> None:
    return None


def _keep(real: BrokerAddress) -> None:
    return None


async def aclose_quietly(resource: trio.abc.AsyncResource) -> None:
    """Closed, within a second and whatever cancels around it: a stream already broken
    is closed enough."""
    try:
        with trio.CancelScope(shield=True), trio.move_on_after(1):
            await resource.aclose()
    except STREAM_ERRORS:
        pass


def elapsed_ms(started: float) -> float:
    return round((time.monotonic() - started) * 1000, 3) if math.isfinite(started) else 0.0


def _failure_message(mechanism: str | None, failure: str | None) -> str | None:
    """What a client whose authentication failed is told: which check its token failed
    (OAUTHBEARER: nothing secret, and the client's operator needs it), else Kafka's
    words, the same for an unknown user and a wrong password."""
    if failure is None:
        return None
    if mechanism == OAUTHBEARER:
        return f"Authentication failed: {failure}"
    return FAILED_MESSAGE
