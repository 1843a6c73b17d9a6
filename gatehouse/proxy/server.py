"""The proxy server: a bootstrap listener, one listener per discovered broker.

``serve_proxy(config)`` runs until cancelled or until ``Proxy.shutdown()``: it stops
accepting, lets the requests in flight finish (bounded by ``limits.shutdown_grace``)
and returns.  Brokers are discovered from the responses that name them (Metadata,
FindCoordinator, DescribeCluster, ...) and by a Metadata request at start-up, and each
gets its own port, opened before the response naming it reaches the client.
"""

from __future__ import annotations

import errno
import ipaddress
import itertools
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import trio

from gatehouse import codecs
from gatehouse.codecs import Request
from gatehouse.codecs._native import BYTE_READERS, PYTHON_ASKED, python_reason
from gatehouse.logs import FIELDS_ATTR, log_event
from gatehouse.proxy.addresses import BrokerAddress
from gatehouse.proxy.apiversions import API_VERSIONS
from gatehouse.proxy.config import Address, ProxyConfig, security_warnings
from gatehouse.proxy.connection import (
    STREAM_ERRORS,
    ConnectionContext,
    ProxyConnection,
    aclose_quietly,
)
from gatehouse.proxy.hooks import CLIENT_CLOSED, ConnectionInfo, Observer, Observers, Policy
from gatehouse.proxy.hostcounts import HostCounts
from gatehouse.proxy.kerberos import KerberosAcceptor, KerberosCredentials, kerberos_identity
from gatehouse.proxy.live import LiveConnections
from gatehouse.proxy.oauth import OAuthClient, TokenSource, TokenValidator
from gatehouse.proxy.principal import certificate_principal, mapped_principal
from gatehouse.proxy.proxyprotocol import ProxyHeaderError, read_proxy_header
from gatehouse.proxy.sasl import (
    SaslError,
    SaslUsers,
    UpstreamCredentials,
    authenticate_upstream,
    roundtrip,
)
from gatehouse.proxy.tls import TlsContexts, accept_tls

logger = logging.getLogger("gatehouse.proxy")
_KEPT_ERRORS = 16  # internal errors remembered (each is logged)

METADATA = codecs.api("Metadata").key


# Seconds between Metadata requests for a broker a client named that the proxy did not
# know (SNI routing), or one that did not answer at its address (it may have moved): a
# client retrying a gone broker must not turn into a request storm.
_REDISCOVER_EVERY = 5.0


class UpstreamUnavailable(Exception):
    pass


async def ask_for_brokers(stream: trio.abc.Stream
                          ) -> tuple[dict[int, tuple[int, int]], Any | None]:
    """On a broker connection ready for requests: the API version ranges the broker
    offers, and the cluster's Metadata answer (no topics: its brokers, cluster id and
    controller; None from a broker too old to list them, Metadata v0 only)."""
    versions = await roundtrip(stream, Request.build(
        API_VERSIONS, 0, 1, "gatehouse", codecs.api(API_VERSIONS).request.root.cls()))
    ranges = {e.api_key: (e.min_version, e.max_version) for e in versions.body.api_keys}
    lo, hi = ranges.get(METADATA, (0, 0))
    version = min(hi, codecs.api(METADATA).versions.hi)
    if version < max(lo, 1):
        return ranges, None
    metadata = await roundtrip(stream, Request.build(
        METADATA, version, 2, "gatehouse", codecs.api(METADATA).request.root.cls(topics=())))
    return ranges, metadata.body


@dataclass
class Upstream:
    """A broker connection ready for a client's bytes (TLS and SASL done)."""

    stream: trio.abc.Stream
    target: Address
    # Seconds until the broker ends the proxy's SASL session (sasl.upstream against a
    # broker with connections.max.reauth.ms); None: no end.
    session_lifetime: float | None = None


@dataclass
class BrokerListener:
    node_id: int
    port: int
    real: BrokerAddress
    listeners: list[trio.SocketListener] = field(default_factory=list)


class Proxy:
    """State shared by all connections: the broker map, the policy, the observers."""

    def __init__(
        self,
        config: ProxyConfig,
        policy: Policy | None = None,
        observers: Sequence[Observer] = (),
        host_counts: HostCounts | None = None,
        client_telemetry: Any = None,
    ) -> None:
        """``client_telemetry``: the receiver of the clients' KIP-714 metrics (a
        ``gatehouse.metrics.telemetry.ClientTelemetry``), which answers their telemetry
        requests; None: they go to the brokers."""
        self.config = config
        self.policy = policy or Policy()
        self.observer = Observers(list(observers))
        self.brokers: dict[int, BrokerListener] = {}
        self.draining = trio.Event()
        self.stopped = trio.Event()
        self.ready = trio.Event()
        self.bootstrap_ports: list[int] = []
        self.upstream_reachable = False  # for /readyz: the last connect attempt worked
        # The last internal errors (bugs) that ended a connection: logged, and kept for
        # the tests to fail on.
        self.internal_errors: list[Exception] = []
        self._ids = itertools.count(1)
        self._rotate = itertools.count()
        self.live = LiveConnections()  # what /connections shows
        # Open connections per client address (a worker's: over all the workers).
        self.host_counts = host_counts or HostCounts()
        self._refusing: set[str] = set()  # hosts at max_connections_per_ip, logged
        self._balancers = config.proxy_protocol_from  # peers that send a PROXY header
        self.tls = TlsContexts(config)
        # sasl.downstream: the users clients authenticate as (reloaded like the rules)
        # and the keys OAUTHBEARER tokens are checked against (a file reloaded the same
        # way, a URL fetched again by serve).
        down = config.sasl_downstream
        self.sasl_users = (SaslUsers(down.users_file)
                           if down is not None and down.users_file is not None else None)
        self.sasl_tokens = (TokenValidator(down.oauthbearer)
                            if down is not None and down.oauthbearer is not None else None)
        self.sasl_kerberos = (KerberosAcceptor(down.kerberos)
                              if down is not None and down.kerberos is not None else None)
        passthrough = config.sasl_passthrough_kerberos
        self.sasl_passthrough_kerberos = (KerberosAcceptor(passthrough)
                                          if passthrough is not None else None)
        # sasl.upstream: what the proxy logs in to the brokers with (OAUTHBEARER: one
        # token source for every broker connection, so they share its fetches).
        up = config.sasl_upstream
        self.upstream_credentials: UpstreamCredentials | None = (
            TokenSource(up) if isinstance(up, OAuthClient)
            else kerberos_identity(up) if isinstance(up, KerberosCredentials) else up)
        self._principal_rules = (config.tls_downstream.principal_mapping
                                 if config.tls_downstream is not None else ())
        self._listener_lock = trio.Lock()
        self._discovery_lock = trio.Lock()
        self._discovered_at = -_REDISCOVER_EVERY
        self._nursery: trio.Nursery | None = None
        self.ctx = ConnectionContext(
            limits=config.limits,
            observer=self.observer,
            address_mapper=self.map_address,
            brokers_seen=self.brokers_seen,
            draining=self.draining,
            get_policy=lambda: self.policy,
            oauthbearer_claim=config.oauthbearer_sub_claim,
            sasl_users=self.sasl_users,
            sasl_tokens=self.sasl_tokens,
            sasl_kerberos=self.sasl_kerberos,
            sasl_passthrough_kerberos=self.sasl_passthrough_kerberos,
            sasl_mechanisms=(config.sasl_downstream.mechanisms
                             if config.sasl_downstream is not None else ()),
            sasl_session_lifetime=(config.sasl_downstream.session_lifetime
                                   if config.sasl_downstream is not None else None),
            upstream_credentials=self.upstream_credentials,
            client_telemetry=client_telemetry,
        )

    # -- broker map ---------------------------------------------------------------------

    @property
    def broker_host(self) -> str:
        return self.config.brokers.listen_host or self.config.listen.host

    @property
    def sni_port(self) -> int:
        """The port clients are told under ``brokers.sni``: the advertised one, else the
        one the proxy listens on."""
        sni = self.config.brokers.sni
        advertised = sni.advertise_port if sni is not None else None
        return advertised or self.bootstrap_ports[0]

    def map_address(self, real: BrokerAddress) -> tuple[str, int] | None:
        sni = self.config.brokers.sni
        if sni is not None:
            return sni.broker_host(real.node_id), self.sni_port
        known = self.brokers.get(real.node_id)
        port = known.port if known else self.config.brokers.port_for(real.node_id)
        if not port:
            return None  # no port for this node: the client would bypass us; logged below
        return self.config.advertise_host, port

    async def brokers_seen(self, seen: Sequence[BrokerAddress]) -> None:
        for real in seen:
            known = self.brokers.get(real.node_id)
            if known is not None:
                if known.real != real:
                    log_event(logger, logging.INFO, "broker address changed",
                              node=real.node_id, old=f"{known.real.host}:{known.real.port}",
                              new=f"{real.host}:{real.port}")
                    known.real = real
                continue
            await self._open_broker_listener(real)

    async def _open_broker_listener(self, real: BrokerAddress) -> None:
        async with self._listener_lock:
            if real.node_id in self.brokers or self._nursery is None:
                return
            sni = self.config.brokers.sni
            if sni is not None:  # no port of its own: its name leads to it
                self.brokers[real.node_id] = BrokerListener(real.node_id, self.sni_port, real)
                log_event(logger, logging.INFO, "broker routed by TLS server name",
                          node=real.node_id, name=sni.broker_host(real.node_id),
                          broker=f"{real.host}:{real.port}")
                return
            port = self.config.brokers.port_for(real.node_id)
            if port is None:
                log_event(logger, logging.ERROR, "no proxy port for broker: clients will fail "
                          "to reach it", node=real.node_id, broker=f"{real.host}:{real.port}")
                return
            try:
                listeners = await open_listeners(port, self.broker_host,
                                                 self.config.reuse_port)
            except OSError as exc:
                log_event(logger, logging.ERROR, "cannot open broker listener",
                          node=real.node_id, port=port, error=exc.strerror or str(exc))
                return
            port = listeners[0].socket.getsockname()[1]  # the OS's choice when port is 0
            entry = BrokerListener(real.node_id, port, real, listeners)
            self.brokers[real.node_id] = entry
            log_event(logger, logging.INFO, "broker listener opened", node=real.node_id,
                      listen=f"{self.broker_host}:{port}", broker=f"{real.host}:{real.port}")
            self._nursery.start_soon(self._accept_loop, listeners, f"broker-{real.node_id}",
                                     real.node_id)

    # -- upstream -----------------------------------------------------------------------

    def _upstream_targets(self, node_id: int | None) -> list[Address]:
        if node_id is None:
            upstream = list(self.config.upstream)
            start = next(self._rotate) % len(upstream)
            return upstream[start:] + upstream[:start]
        real = self.brokers[node_id].real
        return [Address(real.host, real.port)]

    async def open_upstream(self, node_id: int | None) -> Upstream:
        """A connection to broker ``node_id`` (None: a bootstrap server, each tried in
        turn); UpstreamUnavailable with every target's failure."""
        errors = []
        for target in self._upstream_targets(node_id):
            try:
                upstream = await self.connect_to(target)
            except UpstreamUnavailable as exc:
                errors.append(str(exc))
                continue
            self.upstream_reachable = True
            return upstream
        self.upstream_reachable = False
        raise UpstreamUnavailable("; ".join(errors))

    async def connect_to(self, target: Address) -> Upstream:
        """One connection to ``target`` as every broker connection is opened: TCP within
        the connect timeout, TLS (tls.upstream), the proxy's SASL login (sasl.upstream);
        UpstreamUnavailable saying what failed (also told to the observers)."""
        stream: trio.abc.Stream | None = None
        try:
            with trio.fail_after(self.config.limits.connect_timeout):
                stream = await trio.open_tcp_stream(target.host, target.port)
                client_ssl = self.tls.client  # read once: a reload may replace it
                if client_ssl is not None:
                    hostname = (self.config.tls_upstream.server_hostname  # type: ignore[union-attr]
                                or target.host)
                    tls_stream = trio.SSLStream(stream, client_ssl, server_hostname=hostname)
                    await tls_stream.do_handshake()
                    stream = tls_stream
                lifetime = None
                if self.upstream_credentials is not None:
                    lifetime = await authenticate_upstream(partial(roundtrip, stream),
                                                           self.upstream_credentials,
                                                           target.host)
            return Upstream(stream, target, lifetime)
        except trio.TooSlowError:
            error = f"{target}: connect timed out"
        except SaslError as exc:
            error = f"{target}: SASL authentication failed: {exc}"
        except (*STREAM_ERRORS, ssl.SSLError, codecs.ProtocolError) as exc:
            error = f"{target}: {_describe(exc)}"
        if stream is not None:
            await aclose_quietly(stream)
        self.observer.upstream_failure(str(target), error)
        raise UpstreamUnavailable(error)

    async def _open_upstream_where_it_is(self, node_id: int | None) -> Upstream:
        """``open_upstream``; for a broker that does not answer at the address the proxy
        knows, the cluster is asked where its brokers are (``_rediscover``) and a new
        address tried at once: a broker restarted on another address (a new pod IP, a new
        port) is reached on the client's first try rather than after the client has
        failed, backed off and asked for metadata again."""
        try:
            return await self.open_upstream(node_id)
        except UpstreamUnavailable:
            if node_id is None:
                raise
            known = self.brokers[node_id].real
            await self._rediscover()
            if self.brokers[node_id].real == known:
                raise
            return await self.open_upstream(node_id)

    # -- listeners ----------------------------------------------------------------------

    async def _accept_loop(
        self, listeners: list[trio.SocketListener], name: str, node_id: int | None
    ) -> None:
        async with trio.open_nursery() as nursery:
            for listener in listeners:
                nursery.start_soon(self._accept_one_listener, listener, name, node_id, nursery)

    async def _accept_one_listener(
        self, listener: trio.SocketListener, name: str, node_id: int | None, nursery: trio.Nursery
    ) -> None:
        async with listener:
            while not self.draining.is_set():
                try:
                    stream, address = await _accept(listener)
                except trio.ClosedResourceError:
                    return  # closed by shutdown
                except OSError as exc:  # e.g. EMFILE: back off instead of spinning
                    log_event(logger, logging.ERROR, "accept failed", listener=name,
                              error=exc.strerror or str(exc))
                    await trio.sleep(0.1)
                    continue
                limits = self.config.limits
                host, client = _peer(address)
                # The whole proxy's limit (all workers': hostcounts).
                if not self.host_counts.admit_total(limits.max_connections):
                    self._refuse(client, "limit reached", limits.max_connections)
                    await stream.aclose()
                    continue
                if self._balancers and _within(host, self._balancers):
                    # The client is named by the header: the per-address limit waits
                    # for it (read in the connection's own task, not here).
                    nursery.start_soon(self._admit_from_balancer, stream, name, node_id,
                                       host, client)
                    continue
                if not self._admit_host(host, client):
                    self.host_counts.release_total()
                    await stream.aclose()
                    continue
                nursery.start_soon(self._serve_client, stream, name, node_id, host, client)

    def _admit_host(self, host: str, client: str) -> bool:
        """Counts a connection of ``host`` unless it is at ``max_connections_per_ip``
        (then the refusal is counted and logged, and False)."""
        per_ip = self.config.limits.max_connections_per_ip
        if not self.host_counts.admit(host, per_ip):
            assert per_ip is not None
            self._refuse(client, "per-address limit reached", per_ip,
                         logged=host in self._refusing)
            self._refusing.add(host)
            return False
        return True

    async def _admit_from_balancer(self, stream: trio.SocketStream, listener: str,
                                   node_id: int | None, balancer_host: str,
                                   balancer: str) -> None:
        """A connection from a load balancer (``proxy_protocol.from``): its PROXY
        protocol header names the client, which the rest of the connection is served
        as (logs, metrics, rules' ``source``, the per-address limit)."""
        try:
            with trio.fail_after(self.config.limits.connect_timeout):
                if await _closed_before_a_byte(stream):
                    # The balancer's TCP health check: no bad header, an INFO line.
                    self.host_counts.release_total()
                    log_event(logger, logging.INFO, "connection closed before a PROXY "
                              "protocol header (a port check?)", balancer=balancer)
                    await aclose_quietly(stream)
                    return
                source = await read_proxy_header(stream)
        except (trio.TooSlowError, ProxyHeaderError, *STREAM_ERRORS) as exc:
            self.host_counts.release_total()
            why = ("no header within limits.connect_timeout"
                   if isinstance(exc, trio.TooSlowError) else _describe(exc))
            log_event(logger, logging.WARNING, "connection closed: bad PROXY protocol "
                      "header", balancer=balancer, error=why)
            await aclose_quietly(stream)
            return
        host, client = ((balancer_host, balancer) if source is None
                        else (source[0], _address_text(*source)))
        if not self._admit_host(host, client):
            self.host_counts.release_total()
            await aclose_quietly(stream)
            return
        await self._serve_client(stream, listener, node_id, host, client,
                                 via=balancer if source is not None else None)

    def _refuse(self, client: str, why: str, limit: int, logged: bool = False) -> None:
        """Count a connection turned away at a limit, and log it (a host at its own
        limit: once, until one of its connections closes)."""
        self.observer.connection_refused(client, why)
        if not logged:
            log_event(logger, logging.WARNING, f"connection refused: {why}", client=client,
                      limit=limit)

    async def _serve_client(self, stream: trio.SocketStream, listener: str,
                            node_id: int | None, host: str, client_address: str,
                            via: str | None = None) -> None:
        server_ssl = self.tls.server  # read once: a reload may replace it
        conn = ConnectionInfo(id=next(self._ids), client=client_address, listener=listener,
                              node_id=node_id, tls=server_ssl is not None, via=via)
        self.live.opened(conn)
        client: trio.abc.Stream = stream
        reason = CLIENT_CLOSED
        level = logging.INFO
        opened = trio.current_time()
        try:
            if server_ssl is not None:
                tls = trio.SSLStream(stream, server_ssl, server_side=True)
                try:
                    with trio.fail_after(self.config.limits.connect_timeout):
                        if await _closed_before_a_byte(stream):
                            # A TCP check (a load balancer's, Kubernetes'): it began no
                            # handshake, so none failed; an INFO line, not a warning.
                            reason = "closed before a TLS handshake began (a port check?)"
                            await aclose_quietly(stream)
                            return
                        server_name = await accept_tls(tls)
                except (trio.TooSlowError, *STREAM_ERRORS, ssl.SSLError) as exc:
                    reason, level = f"TLS handshake failed: {_describe(exc)}", logging.WARNING
                    await aclose_quietly(stream)
                    return
                client = tls
                if self.config.brokers.sni is not None:
                    refusal = await self._route_by_name(conn, server_name)
                    if refusal is not None:
                        reason, level = refusal, logging.WARNING
                        await aclose_quietly(client)
                        return
                    node_id = conn.node_id
                # A certificate the client CA verified names the client (SASL, if it
                # follows, names it again): the brokers only ever see the proxy.
                subject = certificate_principal(tls.getpeercert())
                rules = self._principal_rules
                mapped = mapped_principal(rules, subject or "") if rules else subject
                conn.principal = mapped or None
                if rules and mapped is None:
                    # As a broker does: a certificate no mapping rule matches is refused.
                    reason, level = ("no tls.downstream.principal_mapping_rules rule matches "
                                     f"the client certificate's subject {subject!r}",
                                     logging.WARNING)
                    await aclose_quietly(client)
                    return
            try:
                upstream = await self._open_upstream_where_it_is(node_id)
            except UpstreamUnavailable as exc:
                reason, level = f"upstream unreachable: {exc}", logging.WARNING
                await aclose_quietly(client)
                return
            conn.upstream = str(upstream.target)
            self.observer.connection_opened(conn)
            log_event(logger, logging.DEBUG, "connection opened", **conn.describe(),
                      upstream=conn.upstream)
            pumps = ProxyConnection(client, upstream.stream, conn, self.ctx,
                                    upstream.session_lifetime, upstream.target.host)
            self.live.serving(conn, pumps)
            try:
                await pumps.run()
            finally:
                reason, level = pumps.close_reason, pumps.close_level
                self.observer.connection_closed(conn, reason)
        except Exception as exc:
            # A bug (ours): it ends this connection, logged with its traceback, and
            # the proxy serves every other one on (one connection's failure never
            # touches another's).
            reason, level = f"internal error: {_innermost(exc)!r}", logging.ERROR
            self.internal_errors.append(exc)
            del self.internal_errors[:-_KEPT_ERRORS]
            self.observer.internal_error(conn, reason)
            logger.error("internal error: the connection is closed (a bug: please report "
                         "it with this traceback)", exc_info=exc,
                         extra={FIELDS_ATTR: conn.describe()})
            await aclose_quietly(client)
        finally:
            self.live.closed(conn)
            self.host_counts.release_total()
            self.host_counts.release(host)
            self._refusing.discard(host)
            log_event(logger, level, "connection closed", **conn.describe(),
                      upstream=conn.upstream, reason=reason,
                      requests=conn.requests, responses=conn.responses,
                      refused=conn.refused or None,
                      bytes_in=conn.bytes_from_client, bytes_out=conn.bytes_to_client,
                      seconds=round(trio.current_time() - opened, 3))

    async def _route_by_name(self, conn: ConnectionInfo, server_name: str | None) -> str | None:
        """Point ``conn`` at the broker (or the bootstrap) its TLS server name names
        (``brokers.sni``); the reason to close it when the name leads nowhere.  A broker
        the proxy has not heard of yet (the proxy restarted under clients that remember
        the cluster) is looked for once with a Metadata request."""
        sni = self.config.brokers.sni
        assert sni is not None
        route = sni.route(server_name)
        if route is None:
            return (f"TLS server name {server_name!r} is neither a bootstrap name nor a "
                    f"broker name ({sni.broker})")
        conn.listener, conn.node_id = route
        if conn.node_id is None or conn.node_id in self.brokers:
            return None
        await self._rediscover()
        if conn.node_id in self.brokers:
            return None
        return (f"TLS server name {server_name!r} names broker {conn.node_id}, which the "
                "cluster does not list")

    async def _rediscover(self) -> None:
        """``discover`` again, at most once per ``_REDISCOVER_EVERY`` seconds however many
        connections ask at once, and for at most ``connect_timeout``: a client waits on
        it, and bootstrap servers that swallow connections must not hold it for a connect
        timeout each."""
        with trio.move_on_after(self.config.limits.connect_timeout):
            async with self._discovery_lock:
                now = trio.current_time()
                if now - self._discovered_at < _REDISCOVER_EVERY:
                    return
                self._discovered_at = now  # an attempt cut short counts too
                await self.discover()

    # -- discovery ----------------------------------------------------------------------

    async def discover(self) -> None:
        """Ask the cluster for its brokers and their addresses: once at the start, so
        their ports are open from then on, and again when a client needs a broker the
        proxy does not know or cannot reach (``_rediscover``)."""
        try:
            upstream = await self.open_upstream(None)
        except UpstreamUnavailable as exc:
            log_event(logger, logging.WARNING, "brokers not reachable to discover them; "
                      "they will be learnt from client traffic", error=str(exc))
            return
        stream, target = upstream.stream, upstream.target
        try:
            with trio.fail_after(self.config.limits.connect_timeout * 2):
                _, metadata = await ask_for_brokers(stream)
            if metadata is None:
                return
            seen = [BrokerAddress(b.node_id, b.host, b.port) for b in metadata.brokers]
            await self.brokers_seen(seen)
        except (trio.TooSlowError, *STREAM_ERRORS, codecs.ProtocolError) as exc:
            log_event(logger, logging.WARNING, "broker discovery failed", upstream=str(target),
                      error=str(exc) or repr(exc))
        finally:
            await aclose_quietly(stream)

    # -- running ------------------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listen = self.config.listen
        async with trio.open_nursery() as outer, trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                listeners = await open_listeners(listen.port, listen.host,
                                                 self.config.reuse_port)
            except OSError as exc:
                raise OSError(exc.errno, f"cannot listen on {listen}: "
                              f"{exc.strerror or exc}") from exc
            self.bootstrap_ports = [ln.socket.getsockname()[1] for ln in listeners]
            nursery.start_soon(self._accept_loop, listeners, "bootstrap", None)
            sni = self.config.brokers.sni
            log_event(logger, logging.INFO, "proxy listening",
                      listen=f"{listen.host}:{self.bootstrap_ports[0]}",
                      brokers_by_name=(f"{sni.broker}:{self.sni_port}" if sni is not None
                                       else None),
                      upstream=",".join(map(str, self.config.upstream)),
                      advertise=self.config.advertise_host, byte_readers=BYTE_READERS)
            if python_reason is not None:  # a warning unless asked for
                log_event(logger, logging.INFO if PYTHON_ASKED else logging.WARNING,
                          "the Python byte readers run", reason=python_reason)
            if self.config.tls_upstream is not None and not self.config.tls_upstream.verify:
                # Never silent: on every start, for as long as the config says so.
                log_event(logger, logging.WARNING, "upstream TLS verification is DISABLED "
                          "(tls.upstream.verify: false): broker certificates and names are "
                          "not checked; anyone on the path can impersonate the brokers",
                          upstream=",".join(map(str, self.config.upstream)))
            self._log_sasl()
            keys_fetch = trio.CancelScope()
            if self.sasl_tokens is not None and self.sasl_tokens.settings.jwks_url is not None:
                # Before clients come (a failure is logged, and tried again soon).
                fetched = await self.sasl_tokens.fetch()
                nursery.start_soon(_run_in, keys_fetch,
                                   partial(self.sasl_tokens.keep_fresh, fetched))
            await self.discover()
            self.ready.set()
            task_status.started()
            await self.draining.wait()
            keys_fetch.cancel()
            # Stop accepting now; connections finish their in-flight requests.
            outer.cancel_scope.deadline = trio.current_time() + self.config.limits.shutdown_grace
            for entry in self.brokers.values():
                for ln in entry.listeners:
                    await aclose_quietly(ln)
            for ln in listeners:
                await aclose_quietly(ln)
        if self.ctx.pipes is not None:
            self.ctx.pipes.close()
        self.stopped.set()

    def _log_sasl(self) -> None:
        """What the proxy does with SASL, and a warning when PLAIN passwords would cross
        a network in clear text."""
        config = self.config
        down, up = config.sasl_downstream, config.sasl_upstream
        if down is not None:
            tokens = self.sasl_tokens
            log_event(logger, logging.INFO, "clients authenticate with the proxy "
                      "(sasl.downstream)", mechanisms=",".join(down.mechanisms),
                      users=None if self.sasl_users is None else len(self.sasl_users),
                      file=None if down.users_file is None else str(down.users_file),
                      jwks=None if tokens is None else tokens.settings.jwks_source,
                      keytab=None if down.kerberos is None else str(down.kerberos.keytab))
        if up is not None:
            log_event(logger, logging.INFO, "the proxy authenticates to the brokers "
                      "(sasl.upstream)", mechanism=up.mechanism, user=up.username)
        if config.sasl_passthrough_kerberos is not None:
            log_event(logger, logging.INFO, "GSSAPI logins passing through name their "
                      "clients (sasl.passthrough_kerberos)",
                      keytab=str(config.sasl_passthrough_kerberos.keytab))
        for warning in security_warnings(config):
            log_event(logger, logging.WARNING, warning)

    def shutdown(self) -> None:
        self.draining.set()


async def _closed_before_a_byte(stream: trio.abc.Stream) -> bool:
    """Whether the client closed (or reset) the connection before sending a byte: waits
    for its first byte or its close, and leaves the byte where it is."""
    sock = getattr(stream, "socket", None)
    if sock is None:  # a test's memory stream: nothing to peek at
        return False
    try:
        return await sock.recv(1, socket.MSG_PEEK) == b""  # type: ignore[no-any-return]
    except ConnectionResetError:
        return True


def _innermost(exc: BaseException) -> BaseException:
    """The one error inside nurseries' groups of one (what went wrong, to name it)."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


async def _run_in(scope: trio.CancelScope, job: Callable[[], Awaitable[None]]) -> None:
    """``job`` until it ends or ``scope`` is cancelled (a background task that must not
    keep a nursery open)."""
    with scope:
        await job()


async def open_listeners(port: int, host: str, reuse_port: bool = False
                         ) -> list[trio.SocketListener]:
    """``trio.open_tcp_listeners``; with ``reuse_port``, sockets that other processes may
    bind too (SO_REUSEPORT): the kernel then spreads new connections over them all."""
    if not reuse_port:
        return await trio.open_tcp_listeners(port, host=host)
    tsocket = trio.socket
    listeners: list[trio.SocketListener] = []
    try:
        for family, kind, proto, _, address in await tsocket.getaddrinfo(
                host, port, type=tsocket.SOCK_STREAM, flags=tsocket.AI_PASSIVE):
            sock = tsocket.socket(family, kind, proto)
            try:
                sock.setsockopt(tsocket.SOL_SOCKET, tsocket.SO_REUSEADDR, 1)
                sock.setsockopt(tsocket.SOL_SOCKET, tsocket.SO_REUSEPORT, 1)
                if family == tsocket.AF_INET6:
                    sock.setsockopt(tsocket.IPPROTO_IPV6, tsocket.IPV6_V6ONLY, 1)
                await sock.bind(address)
                sock.listen(socket.SOMAXCONN)
            except BaseException:
                sock.close()
                raise
            listeners.append(trio.SocketListener(sock))
    except BaseException:
        for listener in listeners:
            listener.socket.close()
        raise
    return listeners


def _describe(exc: BaseException) -> str:
    """What went wrong, for the log: trio wraps TLS errors (certificate verify failed...)
    in a BrokenResourceError whose own text is empty."""
    text = getattr(exc, "strerror", None) or str(exc)
    cause = exc.__cause__ or exc.__context__
    if not text and cause is not None:
        return _describe(cause)
    return text or type(exc).__name__


# accept(2)'s errors that concern the one connection, not the listener (a firewall's
# EPERM, network errors already pending on it): the next connection is accepted.
_ACCEPT_ERRNOS = frozenset(getattr(errno, name) for name in (
    "EPERM", "ECONNABORTED", "EPROTO", "ENETDOWN", "ENOPROTOOPT", "EHOSTDOWN", "ENONET",
    "EHOSTUNREACH", "EOPNOTSUPP", "ENETUNREACH", "ENOSR", "ESOCKTNOSUPPORT",
    "EPROTONOSUPPORT", "ETIMEDOUT", "ECONNRESET") if hasattr(errno, name))


async def _accept(listener: trio.SocketListener) -> tuple[trio.SocketStream, Any]:
    """``listener.accept()``, and the client's address as accept(2) gave it: trio's drops
    it, and a client that resets at once has none left for getpeername (its lines would
    name it "?", and one from a balancer would not be known as such)."""
    while True:
        try:
            sock, address = await listener.socket.accept()
        except OSError as exc:
            if exc.errno == errno.EBADF:  # the listener closed (shutdown)
                raise trio.ClosedResourceError from None
            if exc.errno not in _ACCEPT_ERRNOS:
                raise
        else:
            return trio.SocketStream(sock), address


def _peer(address: Any) -> tuple[str, str]:
    """The client's host, and its address as the logs write it (``host:port``)."""
    try:
        host, port, *_ = address
    except (TypeError, ValueError):  # not an IP socket's address
        return "?", "?"
    return host, _address_text(host, port)


def _address_text(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _within(host: str, networks: tuple[Any, ...]) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return any(address in network for network in networks)


async def serve_proxy(
    config: ProxyConfig,
    policy: Policy | None = None,
    observers: Sequence[Observer] = (),
    *,
    task_status: trio.TaskStatus[Proxy] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a proxy until cancelled or until its ``shutdown()``; ``nursery.start`` gives it."""
    proxy = Proxy(config, policy, observers)
    async with trio.open_nursery() as nursery:
        await nursery.start(proxy.serve)
        task_status.started(proxy)
