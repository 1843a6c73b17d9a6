"""The proxy's YAML config: parsed into frozen dataclasses, errors as file:line.

The minimal config is two lines::

    listen: 127.0.0.1:9192
    upstream: [127.0.0.1:9092]
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gatehouse.codecs import DEFAULT_MAX_FRAME_SIZE
from gatehouse.codecs.scram import MECHANISMS, SaslCredentials, SaslError
from gatehouse.configfile import (
    ConfigError,
    Reader,
    Source,
    line_of,
    load_yaml_file,
    load_yaml_text,
)
from gatehouse.proxy.kerberos import (
    GSSAPI,
    KerberosCredentials,
    KerberosService,
    PrincipalRule,
    gssapi_library,
    parse_principal_rules,
)
from gatehouse.proxy.oauth import (
    OAUTHBEARER,
    OAuthClient,
    OAuthSettings,
    load_jwks_file,
    read_client_sasl,
    read_keytab,
)
from gatehouse.proxy.principal import MappingRule, PrincipalMappingError, parse_principal_mapping
from gatehouse.proxy.sasl import load_users

DEFAULT_METRICS_LISTEN = "127.0.0.1:9464"


@dataclass(frozen=True)
class Address:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class BrokerPorts:
    """How the proxy gives each broker node its own port.

    Default: port-per-broker, ``start_port + node_id``; ``ports`` pins nodes explicitly
    (nodes outside it still use the scheme unless ``start_port`` is null).  A
    ``start_port`` of 0 lets the OS pick a free port for each broker as it is found.
    """

    start_port: int | None
    ports: dict[int, int] = field(default_factory=dict)
    listen_host: str | None = None  # default: the bootstrap listener's host
    sni: SniRouting | None = None  # set: no port per broker, the server name says which

    def port_for(self, node_id: int) -> int | None:
        if node_id in self.ports:
            return self.ports[node_id]
        if self.start_port is None or node_id < 0:
            return None
        if self.start_port == 0:
            return 0
        port = self.start_port + node_id
        return port if port <= 65535 else None


NODE_ID = "$(nodeId)"  # the broker's node id in ``brokers.sni.broker`` (Kroxylicious' token)
_HOST_NAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                        r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")


@dataclass(frozen=True)
class SniRouting:
    """Every broker on the one ``listen`` port, told apart by the TLS server name (SNI)
    the client connects with: the bootstrap names, or the broker name pattern with the
    node id in it.  What a Kubernetes ingress or a single load balancer port needs,
    where a port per broker does not fit.  A client that sends no server name (it
    connected by address) is a bootstrap connection."""

    bootstrap: tuple[str, ...]  # lower case
    broker: str  # with NODE_ID in it
    # The port clients are told (a load balancer's, say); None: the one the proxy listens on.
    advertise_port: int | None = None

    def __post_init__(self) -> None:
        head, _, tail = self.broker.lower().partition(NODE_ID.lower())
        pattern = re.compile(re.escape(head) + "(0|[1-9][0-9]{0,9})" + re.escape(tail))
        object.__setattr__(self, "_pattern", pattern)

    def broker_host(self, node_id: int) -> str:
        return self.broker.replace(NODE_ID, str(node_id))

    def route(self, server_name: str | None) -> tuple[str, int | None] | None:
        """(listener, node id) for the name a client asked for: ``("bootstrap", None)``,
        ``("broker-3", 3)``; None for a name that is neither."""
        if not server_name:
            return "bootstrap", None
        name = server_name.lower().rstrip(".")
        if name in self.bootstrap:
            return "bootstrap", None
        node_id = self.broker_node(name)
        return None if node_id is None else (f"broker-{node_id}", node_id)

    def broker_node(self, name: str) -> int | None:
        """The node id in a broker name (lower case), None if it is not one."""
        found = self._pattern.fullmatch(name)  # type: ignore[attr-defined]
        return None if found is None else int(found.group(1))


@dataclass(frozen=True)
class DownstreamTls:
    cert: Path
    key: Path
    client_ca: Path | None = None  # set: clients must present a certificate
    # Kafka's ssl.principal.mapping.rules: certificate subject -> principal; () keeps
    # the whole subject (DEFAULT).
    principal_mapping: tuple[MappingRule, ...] = ()


@dataclass(frozen=True)
class UpstreamTls:
    ca: Path | None = None  # None: the system trust store
    verify: bool = True
    server_hostname: str | None = None  # SNI and the name checked; default the broker host
    cert: Path | None = None  # client certificate for mutual TLS to the brokers
    key: Path | None = None


@dataclass(frozen=True)
class DownstreamSasl:
    """The proxy authenticates clients itself (gatehouse.proxy.sasl)."""

    users_file: Path | None  # PLAIN and SCRAM's users; None: OAUTHBEARER only
    mechanisms: tuple[str, ...] = ("SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN")
    # Seconds after which a client must authenticate again (KIP-368, as a broker's
    # connections.max.reauth.ms); None: never (an OAUTHBEARER session still ends with
    # its token).
    session_lifetime: float | None = None
    oauthbearer: OAuthSettings | None = None  # where OAUTHBEARER tokens are checked
    kerberos: KerberosService | None = None  # the proxy's service keys for GSSAPI


@dataclass(frozen=True)
class Limits:
    max_frame_bytes: int = DEFAULT_MAX_FRAME_SIZE
    max_connections: int = 10_000
    # Per client address (Kafka's max.connections.per.ip): one host cannot take them all.
    max_connections_per_ip: int | None = None
    max_in_flight: int = 1_000  # per connection; Kafka clients use 5 by default
    # seconds without a whole request from the client or a byte from the broker (bytes of
    # a request that never completes do not count: slowloris); Kafka's default is 9 min
    idle_timeout: float = 600.0
    connect_timeout: float = 10.0
    # Seconds after which a connection stops taking requests, answers the ones in flight
    # and closes (the client reconnects): behind a load balancer, long-lived Kafka
    # connections would otherwise stay on the replicas that were there first.
    max_connection_age: float | None = None
    shutdown_grace: float = 10.0  # in-flight requests get this long on SIGTERM
    # Frame bytes held at once across all connections, per direction (a frame's declared
    # size is reserved before the rest of it is read): memory stays bounded however many
    # connections send large frames at once.  Like Kafka's queued.max.request.bytes.
    max_buffered_request_bytes: int = 256 * 1024 * 1024
    max_buffered_response_bytes: int = 256 * 1024 * 1024


@dataclass(frozen=True)
class ProxyConfig:
    listen: Address
    upstream: tuple[Address, ...]
    advertise_host: str
    brokers: BrokerPorts
    limits: Limits = Limits()
    tls_downstream: DownstreamTls | None = None
    tls_upstream: UpstreamTls | None = None
    metrics_listen: Address | None = None
    metrics_label_cap: int = 500  # distinct topic / client values per label
    # Who may read /connections (the live client connections): "local" (loopback
    # clients), "any" (whoever reaches metrics.listen) or "off" (not served).
    metrics_connections: str = "local"
    # metrics.client_telemetry: the proxy receives the clients' KIP-714 metrics (a
    # gatehouse.metrics.telemetry.TelemetrySettings); None: the brokers' business.
    client_telemetry: Any = None
    capture: Any = None  # a gatehouse.capture.CaptureSettings
    rules: Any = None  # validated by gatehouse.rules
    rules_file: Path | None = None
    source: str = "<config>"
    log_level: str = "INFO"
    log_json: bool = False
    # The JWT claim an OAUTHBEARER client's principal is: the brokers'
    # sasl.oauthbearer.sub.claim.name.
    oauthbearer_sub_claim: str = "sub"
    # SASL termination (the proxy authenticates clients) and origination (the proxy
    # authenticates to the brokers as one user); None: neither (SASL passes through).
    sasl_downstream: DownstreamSasl | None = None
    sasl_upstream: SaslCredentials | OAuthClient | KerberosCredentials | None = None
    # The brokers' Kerberos keys and rules: GSSAPI logins passing through name their
    # client (its principal, as the brokers name it) for rules, metrics and logs.
    sasl_passthrough_kerberos: KerberosService | None = None
    # Several proxy processes on the same ports (SO_REUSEPORT): the kernel spreads new
    # connections over them, one event loop per process, to use more than one core.
    reuse_port: bool = False
    # `gatehouse run` starts this many such processes itself and supervises them
    # (gatehouse.proxy.workers); above 1 it implies reuse_port.
    workers: int = 1
    # Peers (load balancers) whose connections begin with a PROXY protocol header naming
    # the client (gatehouse.proxy.proxyprotocol); empty: none.
    proxy_protocol_from: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()


def parse_address(text: Any, source: Source, line: int | None, what: str,
                  default_host: str = "0.0.0.0") -> Address:
    """``host:port``; a bare port (``9464`` or ``:9464``) binds ``default_host``."""
    if isinstance(text, int) and not isinstance(text, bool):
        text = f"{default_host}:{text}"
    if not isinstance(text, str):
        raise source.error(f"{what} must be 'host:port', not {text!r}", line)
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isdigit():
        raise source.error(f"{what} must be 'host:port', not {text!r}", line)
    host = host.strip("[]") or default_host
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise source.error(f"{what}: port {port} is out of range", line)
    return Address(host, port)


def _path(reader: Reader, key: str, base: Path, required: bool = False) -> Path | None:
    value = reader.require(key, str) if required else reader.take(key, str)
    if value is None:
        return None
    path = Path(value)
    if not path.is_absolute():
        path = base / path
    if not path.exists():
        raise reader.error(key, f"{reader.what}.{key}: file {str(path)!r} does not exist")
    return path


def _positive(reader: Reader, key: str, default: float | None, integer: bool = False) -> Any:
    """A positive number (None, the default of some: no limit)."""
    types: tuple[type, ...] = (int,) if integer else (int, float)
    value = reader.take(key, types, default)
    if value is None:
        return None
    if value <= 0:
        raise reader.error(key, f"{reader.what}.{key} must be positive, not {value}")
    return value


CONNECTIONS_READERS = ("local", "any", "off")


def _connections_readers(metrics: Reader) -> str:
    """``metrics.connections``: who may read /connections, which names every live
    client (address, client id, principal): loopback clients by default (a shell on the
    host, ``kubectl port-forward``), whoever reaches ``metrics.listen``, or nobody."""
    value = metrics.take("connections", (str, bool), "local")
    if value is False:  # YAML reads an unquoted off (or false, no) as false
        return "off"
    if value not in CONNECTIONS_READERS:
        raise metrics.error("connections", "metrics.connections says who may read "
                            "/connections: local (loopback clients, the default), any "
                            f"(whoever reaches metrics.listen) or off, not "
                            f"{'true' if value is True else repr(value)}")
    return str(value)


OBSERVED_PUSH_INTERVAL = 300.0  # seconds: Kafka's client metrics interval.ms default


def _client_telemetry(section: Reader) -> Any:
    """``metrics.client_telemetry``: which metrics the clients are asked for (name
    prefixes; none given: all), how often (seconds), and the bounds."""
    from gatehouse.metrics.telemetry import TelemetrySettings

    wanted = section.take_each("metrics", str)
    if wanted is None:
        wanted = [("", None)]  # all of them
    for prefix, line in wanted:
        if not isinstance(prefix, str):
            raise section.source.error(f"{section.what}.metrics: each entry is a metric "
                                       f"name prefix (text), not {prefix!r}", line)
    if not wanted:
        raise section.error("metrics", f"{section.what}.metrics asks for no metric: name "
                            "prefixes, or '' for all (leave client_telemetry out for none)")
    mode = section.take("mode", str, "receive")
    if mode not in ("receive", "observe"):
        raise section.error("mode", f"{section.what}.mode is 'receive' (the proxy receives "
                            "the clients' metrics) or 'observe' (the brokers do, the proxy "
                            f"reads them on the way), not {mode!r}")
    # Observing, the brokers' subscription sets the interval: Kafka's default
    # (interval.ms, 5 minutes) stands in for it unless told, so that a client's series
    # outlive the time between its pushes.
    settings = TelemetrySettings(
        mode=mode,
        metrics=tuple(prefix for prefix, _ in wanted),
        push_interval=float(_positive(section, "push_interval",
                                      TelemetrySettings.push_interval if mode == "receive"
                                      else OBSERVED_PUSH_INTERVAL)),
        max_bytes=_positive(section, "max_bytes", TelemetrySettings.max_bytes, True),
        max_series=_positive(section, "max_series", TelemetrySettings.max_series, True),
    )
    section.finish()
    return settings


def parse_config(data: Any, source_name: str = "<config>", base: Path | None = None) -> ProxyConfig:
    source = Source(source_name)
    base = base or Path.cwd()
    top = Reader(data, source, "config")
    listen = parse_address(top.require("listen", (str, int)), source, top.line_of("listen"), "listen")
    raw_upstream = top.require("upstream", (str, list))
    if isinstance(raw_upstream, str):
        raw_upstream = [part.strip() for part in raw_upstream.split(",") if part.strip()]
    if not raw_upstream:
        raise top.error("upstream", "upstream needs at least one broker address")
    upstream = tuple(
        parse_address(item, source, line_of(raw_upstream, i) or top.line_of("upstream"), "upstream")
        for i, item in enumerate(raw_upstream)
    )
    advertise = top.take("advertise_host", str)
    advertise_given = advertise is not None
    if advertise is None:
        advertise = listen.host if listen.host not in ("0.0.0.0", "::") else "localhost"

    brokers_reader = top.child("brokers")
    start_port = brokers_reader.take(
        "start_port", (int, type(None)), listen.port + 1 if listen.port else 0
    )
    if brokers_reader.has("start_port") and brokers_reader.data["start_port"] is None:
        start_port = None
    explicit_raw = brokers_reader.take("ports", dict, {})
    explicit: dict[int, int] = {}
    for key, port in explicit_raw.items():
        line = line_of(explicit_raw, key)
        try:
            node = int(key)
        except ValueError:
            raise source.error(f"brokers.ports: node id {key!r} is not an integer", line) from None
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port <= 65535:
            raise source.error(f"brokers.ports: port for node {node} must be 1-65535", line)
        explicit[node] = port
    broker_host = brokers_reader.take("listen_host", str)
    sni = _sni_routing(brokers_reader) if brokers_reader.has("sni") else None
    brokers_reader.finish()
    brokers = BrokerPorts(start_port=start_port, ports=explicit, listen_host=broker_host,
                          sni=sni)
    if advertise_given and sni is not None:
        raise top.error("advertise_host", "advertise_host has no effect with brokers.sni: "
                        "clients are told the broker names brokers.sni.broker makes")
    clashes = [n for n, p in explicit.items() if p == listen.port]
    if clashes:
        raise brokers_reader.error("ports", f"node {clashes[0]} would share the bootstrap port")

    limits_reader = top.child("limits")
    limits = Limits(
        max_frame_bytes=_positive(limits_reader, "max_frame_bytes", Limits.max_frame_bytes, True),
        max_connections=_positive(limits_reader, "max_connections", Limits.max_connections, True),
        max_connections_per_ip=_positive(limits_reader, "max_connections_per_ip", None, True),
        max_connection_age=_positive(limits_reader, "max_connection_age", None),
        max_in_flight=_positive(limits_reader, "max_in_flight", Limits.max_in_flight, True),
        idle_timeout=float(_positive(limits_reader, "idle_timeout", Limits.idle_timeout)),
        connect_timeout=float(_positive(limits_reader, "connect_timeout", Limits.connect_timeout)),
        shutdown_grace=float(_positive(limits_reader, "shutdown_grace", Limits.shutdown_grace)),
        max_buffered_request_bytes=_positive(limits_reader, "max_buffered_request_bytes",
                                             Limits.max_buffered_request_bytes, True),
        max_buffered_response_bytes=_positive(limits_reader, "max_buffered_response_bytes",
                                              Limits.max_buffered_response_bytes, True),
    )
    limits_reader.finish()

    tls_reader = top.child("tls")
    tls_down = tls_up = None
    if tls_reader.has("downstream"):
        down = tls_reader.child("downstream")
        cert = _path(down, "cert", base, required=True)
        key = _path(down, "key", base, required=True)
        assert cert is not None and key is not None
        client_ca = _path(down, "client_ca", base)
        mapping = _principal_mapping(down)
        if mapping and client_ca is None:
            raise down.error("principal_mapping_rules", "tls.downstream.principal_mapping_rules "
                             "maps client certificates: it needs client_ca")
        tls_down = DownstreamTls(cert=cert, key=key, client_ca=client_ca,
                                 principal_mapping=mapping)
        down.finish()
    if tls_reader.has("upstream"):
        up = tls_reader.child("upstream")
        tls_up = UpstreamTls(
            ca=_path(up, "ca", base),
            verify=up.take("verify", bool, True),
            server_hostname=up.take("server_hostname", str),
            cert=_path(up, "cert", base),
            key=_path(up, "key", base),
        )
        up.finish()
        if (tls_up.cert is None) != (tls_up.key is None):
            raise up.error(None, "tls.upstream needs both cert and key for mutual TLS")
    tls_reader.finish()
    if sni is not None and tls_down is None:
        raise brokers_reader.error("sni", "brokers.sni routes by the TLS server name: it "
                                   "needs tls.downstream (the proxy ends the clients' TLS)")

    metrics_listen = None
    label_cap = 500
    connections = "local"
    client_telemetry = None
    if top.has("metrics"):
        metrics = top.child("metrics")
        # Localhost unless a host is named: /metrics tells anyone who can reach it the
        # topics, client ids and software of every client.
        metrics_listen = parse_address(
            metrics.take("listen", (str, int), DEFAULT_METRICS_LISTEN), source,
            metrics.line_of("listen"), "metrics.listen", default_host="127.0.0.1",
        )
        label_cap = metrics.take("label_cap", int, 500)
        if label_cap < 1:
            raise metrics.error("label_cap", f"metrics.label_cap must be at least 1, not "
                                f"{label_cap}")
        connections = _connections_readers(metrics)
        if metrics.has("client_telemetry"):
            client_telemetry = _client_telemetry(metrics.child("client_telemetry"))
        metrics.finish()

    sasl = top.child("sasl")
    claim = sasl.take("oauthbearer_sub_claim_name", str, "sub")
    if not claim:
        raise sasl.error("oauthbearer_sub_claim_name", "sasl.oauthbearer_sub_claim_name "
                         "must name a claim")
    sasl_downstream = _sasl_downstream(sasl, base, claim)
    sasl_upstream = (read_client_sasl(sasl.child("upstream"), base) if sasl.has("upstream")
                     else None)
    passthrough_kerberos = None
    if sasl.has("passthrough_kerberos"):
        # Only logins that reach the brokers can be read with the brokers' keys.
        for other, why in (("downstream", "clients log in to the proxy"),
                           ("upstream", "the proxy logs in to the brokers for its clients")):
            if sasl.has(other):
                raise sasl.error("passthrough_kerberos", f"sasl.passthrough_kerberos reads "
                                 f"clients' logins passing through to the brokers; with "
                                 f"sasl.{other}, {why}: none pass through")
        passthrough_kerberos = _kerberos_service(sasl.child("passthrough_kerberos"), base,
                                                 passing=True)
    sasl.finish()

    log = top.child("log")
    level = str(log.take("level", str, "INFO")).upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise log.error("level", f"log.level must be DEBUG, INFO, WARNING or ERROR, not {level}")
    log_json = log.take("json", bool, False)
    log.finish()

    capture = None
    if top.has("capture"):
        from gatehouse.capture.settings import parse_capture

        capture = parse_capture(top.child("capture"), base)
    proxy_protocol_from = _proxy_protocol(top)
    reuse_port = top.take("reuse_port", bool, False)
    workers = _workers(top)
    if workers > 1:
        _check_fixed_ports(top, "workers", "workers above 1 need", listen, brokers)
    elif reuse_port:
        _check_fixed_ports(top, "reuse_port", "reuse_port needs", listen, brokers)
    rules = top.take("rules", (list, type(None)))
    rules_file = _path(top, "rules_file", base)
    if rules is not None and rules_file is not None:
        raise top.error("rules_file", "use either rules or rules_file, not both")
    top.finish()
    return ProxyConfig(
        listen=listen,
        upstream=upstream,
        advertise_host=advertise,
        brokers=brokers,
        limits=limits,
        tls_downstream=tls_down,
        tls_upstream=tls_up,
        metrics_listen=metrics_listen,
        metrics_label_cap=label_cap,
        metrics_connections=connections,
        client_telemetry=client_telemetry,
        capture=capture,
        rules=rules,
        rules_file=rules_file,
        source=source_name,
        log_level=level,
        log_json=log_json,
        oauthbearer_sub_claim=claim,
        sasl_downstream=sasl_downstream,
        sasl_upstream=sasl_upstream,
        sasl_passthrough_kerberos=passthrough_kerberos,
        reuse_port=reuse_port or workers > 1,
        workers=workers,
        proxy_protocol_from=proxy_protocol_from,
    )


def security_warnings(config: ProxyConfig) -> list[str]:
    """Where the config leaves a door open: passwords or bearer tokens (which anyone who
    sees them can use) crossing a network in clear text, token signing keys fetched
    where anyone on the path could replace them, tokens for other services taken.
    Logged at every start and said by ``gatehouse check``."""
    out = []
    down, up = config.sasl_downstream, config.sasl_upstream
    for mechanism, what in (("PLAIN", "passwords"), (OAUTHBEARER, "tokens")):
        if down is not None and mechanism in down.mechanisms and config.tls_downstream is None:
            out.append(f"sasl.downstream offers {mechanism} without tls.downstream: clients "
                       f"send their {what} in clear text")
    if up is not None and up.mechanism in ("PLAIN", OAUTHBEARER) and config.tls_upstream is None:
        what = "password" if up.mechanism == "PLAIN" else "token"
        out.append(f"sasl.upstream uses {up.mechanism} without tls.upstream: the {what} goes "
                   "to the brokers in clear text")
    if isinstance(up, OAuthClient) and (up.token_endpoint_url or "").startswith("http://"):
        out.append("sasl.upstream.token_endpoint_url is http://: the client secret goes to "
                   "the token endpoint in clear text")
    oauth = down.oauthbearer if down is not None and OAUTHBEARER in down.mechanisms else None
    if oauth is not None and (oauth.jwks_url or "").startswith("http://"):
        out.append("sasl.downstream.oauthbearer.jwks_url is http://: anyone on the path to "
                   "the identity provider can hand the proxy keys of their own and forge "
                   "tokens for any principal")
    if oauth is not None and not oauth.expected_audience:
        out.append("sasl.downstream.oauthbearer has no expected_audience: a token the "
                   "identity provider issued for any other service is taken too")
    return out


def _sasl_downstream(sasl: Reader, base: Path, claim: str) -> DownstreamSasl | None:
    """``sasl.downstream: {users_file, mechanisms, session_lifetime, oauthbearer}``; the
    users file and a JWKS file are read now, so a bad one is reported by ``gatehouse
    check`` with its own file:line."""
    if not sasl.has("downstream"):
        return None
    down = sasl.child("downstream")
    users_file = _path(down, "users_file", base)
    oauth = _oauthbearer(down.child("oauthbearer"), base, claim) if down.has("oauthbearer") else None
    kerberos = _kerberos_service(down.child("kerberos"), base) if down.has("kerberos") else None
    offered = [m for m in DownstreamSasl.mechanisms if users_file is not None]
    if oauth is not None:
        offered.append(OAUTHBEARER)
    if kerberos is not None:
        offered.append(GSSAPI)
    if not offered:
        raise down.error(None, "sasl.downstream needs users_file (PLAIN, SCRAM), "
                         "oauthbearer (OAUTHBEARER) or kerberos (GSSAPI), or several")
    given = down.take_each("mechanisms", str)
    named = [(m, None) for m in offered] if given is None else given
    for mechanism, line in named:
        if mechanism not in (*MECHANISMS, OAUTHBEARER, GSSAPI):
            raise sasl.source.error(f"sasl.downstream.mechanisms: {mechanism!r} is not one of "
                                    f"{', '.join((*MECHANISMS, OAUTHBEARER, GSSAPI))}", line)
        if mechanism == OAUTHBEARER and oauth is None:
            raise sasl.source.error("sasl.downstream.mechanisms: OAUTHBEARER needs "
                                    "sasl.downstream.oauthbearer (where the token signing "
                                    "keys are)", line)
        if mechanism == GSSAPI and kerberos is None:
            raise sasl.source.error("sasl.downstream.mechanisms: GSSAPI needs "
                                    "sasl.downstream.kerberos (the proxy's service keytab)",
                                    line)
        if mechanism not in (OAUTHBEARER, GSSAPI) and users_file is None:
            raise sasl.source.error(f"sasl.downstream.mechanisms: {mechanism} needs "
                                    "sasl.downstream.users_file", line)
    if not named:
        raise down.error("mechanisms", "sasl.downstream.mechanisms must name at least one")
    mechanisms = [m for m, _ in named]
    lifetime = _positive(down, "session_lifetime", None)
    down.finish()
    if users_file is not None:
        load_users(users_file)
    return DownstreamSasl(users_file, tuple(dict.fromkeys(mechanisms)),
                          None if lifetime is None else float(lifetime), oauth, kerberos)


def _kerberos_service(section: Reader, base: Path, passing: bool = False) -> KerberosService:
    """``sasl.downstream.kerberos: {keytab, principal_to_local_rules, replay_cache}``
    (the proxy's service keys) or ``sasl.passthrough_kerberos: {keytab,
    principal_to_local_rules}`` (the brokers'): the keytab read now (a service key in
    it), the rules parsed (each error at its line), where tickets seen are kept checked."""
    what = section.what
    keytab = _path(section, "keytab", base)
    if keytab is None:
        whose = ("the brokers' service keys (kafka/broker-host@REALM: the names clients "
                 "ask tickets for)" if passing else
                 "the proxy's service keys (kafka/proxy-host@REALM), as a broker's")
        raise section.error(None, f"{what} needs keytab: {whose}")
    held = read_keytab(section, keytab)
    if not held:
        raise section.error("keytab", f"{what}.keytab: {str(keytab)!r} holds no keys")
    rules: list[PrincipalRule] = []
    for text, line in section.take_each("principal_to_local_rules", str) or [("DEFAULT", None)]:
        try:
            rules.extend(parse_principal_rules([str(text)]))
        except ValueError as exc:
            raise section.source.error(f"{what}.principal_to_local_rules: {exc}",
                                       line) from None
    try:
        gssapi_library()
    except SaslError as exc:
        raise section.error("keytab", f"{what}: {exc}") from None
    # A replayed ticket is for the brokers to refuse when it passes through (the proxy
    # only reads it, so it keeps no cache); one presented to the proxy is the proxy's.
    replay_cache = "none:" if passing else _replay_cache(section, base)
    section.finish()
    return KerberosService(keytab, tuple(rules), replay_cache, tuple(held))


def _replay_cache(section: Reader, base: Path) -> str | None:
    """``replay_cache``: the file MIT Kerberos keeps the tickets it has accepted in (a
    ticket seen again is refused), in a directory the proxy can write; None: MIT's
    default, ``$KRB5RCACHEDIR`` or ``/var/tmp``, checked the same way (a container's
    read-only root file system would refuse every login at the first ticket)."""
    given = section.take("replay_cache", str)
    if given is None:
        directory = Path(os.environ.get("KRB5RCACHEDIR") or "/var/tmp")
        if not os.access(directory, os.W_OK | os.X_OK):
            raise section.error(None, f"{section.what}: Kerberos's replay cache directory "
                                f"{str(directory)!r} is not writable (a read-only root file "
                                "system?): set replay_cache to a file on a writable volume")
        return None
    path = base / given  # an absolute path stays itself
    if path.is_dir() or not os.access(path.parent, os.W_OK | os.X_OK):
        raise section.error("replay_cache", f"{section.what}.replay_cache: {str(path)!r} must "
                            "be a file in a directory the proxy can write")
    return f"file2:{path}"


def _oauthbearer(section: Reader, base: Path, claim: str) -> OAuthSettings:
    """``sasl.downstream.oauthbearer: {jwks_file | jwks_url, jwks_refresh,
    expected_issuer, expected_audience, clock_skew}`` (a JWKS file is read now)."""
    jwks_file = _path(section, "jwks_file", base)
    jwks_url = section.take("jwks_url", str)
    if (jwks_file is None) == (jwks_url is None):
        raise section.error(None, "sasl.downstream.oauthbearer needs one of jwks_file and "
                            "jwks_url: the identity provider's public keys (a JWKS)")
    if jwks_url is not None and not jwks_url.startswith(("https://", "http://")):
        raise section.error("jwks_url", "sasl.downstream.oauthbearer.jwks_url must be an "
                            f"https:// (or http://) URL, not {jwks_url!r}")
    refresh = _positive(section, "jwks_refresh", 3600.0)
    issuer = section.take("expected_issuer", str)
    audience = []
    for each, line in section.take_each("expected_audience", str) or ():
        if not isinstance(each, str) or not each:
            raise section.source.error("sasl.downstream.oauthbearer.expected_audience: "
                                       f"{each!r} is not an audience name", line)
        audience.append(each)
    skew = section.take("clock_skew", (int, float), 30)
    if skew < 0:
        raise section.error("clock_skew", "sasl.downstream.oauthbearer.clock_skew must not "
                            f"be negative, not {skew}")
    section.finish()
    if jwks_file is not None:
        load_jwks_file(jwks_file)
    return OAuthSettings(jwks_file, jwks_url, float(refresh), issuer or None,
                         tuple(audience), claim, float(skew))


def _proxy_protocol(top: Reader) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """``proxy_protocol: {from: CIDR or [CIDRs]}``: the load balancers that send it."""
    if not top.has("proxy_protocol"):
        return ()
    section = top.child("proxy_protocol")
    if not section.has("from"):
        raise section.error(None, "proxy_protocol needs 'from': the addresses (CIDRs) of the "
                            "load balancers that send the header")
    networks = section.take_networks("from", "proxy_protocol.from")
    section.finish()
    return networks or ()


def _workers(top: Reader) -> int:
    """``workers``: a count, or ``auto`` (one per CPU this process may use)."""
    value = top.take("workers", (int, str), 1)
    if value == "auto":
        return usable_cpus()
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 256:
        raise top.error("workers", f"workers must be a number from 1 to 256 or 'auto', "
                        f"not {value!r}")
    return value


def usable_cpus(cpu_max: Path = Path("/sys/fs/cgroup/cpu.max")) -> int:
    """CPUs this process may use: those it may run on, capped by its cgroup's CPU quota
    (a container's CPU limit: on a 64-core node, a pod limited to 2 CPUs gets 2)."""
    cpus = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count() or 1)
    try:
        quota, period = cpu_max.read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, -(-int(quota) // int(period)))  # a part of a CPU counts as one
    except (OSError, ValueError):
        pass  # no cgroup v2 limit readable: the affinity stands
    return max(1, cpus)


def fixed_ports_problem(listen: Address, brokers: BrokerPorts) -> str | None:
    """Why processes cannot share these ports (what is missing after "needs"), or None.

    Processes sharing ports must agree on them: none may be the OS's pick."""
    if listen.port == 0:
        return ("a fixed listen port (processes sharing ports must agree on them), not 0")
    if brokers.sni is None and brokers.start_port == 0:
        return ("fixed broker ports (brokers.start_port other than 0, or brokers.ports with "
                "start_port: null, or brokers.sni)")
    return None


def _check_fixed_ports(top: Reader, key: str, needs: str, listen: Address,
                       brokers: BrokerPorts) -> None:
    problem = fixed_ports_problem(listen, brokers)
    if problem is not None:
        raise top.error(key, f"{needs} {problem}")


def _sni_routing(brokers: Reader) -> SniRouting:
    """``brokers.sni``: the bootstrap name(s), the broker name pattern, the port
    clients are told; a port-per-broker setting beside it is an error."""
    for key in ("start_port", "ports", "listen_host"):
        if brokers.has(key):
            raise brokers.error(key, f"brokers.{key} is for a port per broker; brokers.sni "
                                "serves every broker on the listen port")
    sni = brokers.child("sni")
    raw = sni.require("bootstrap", (str, list))
    names = [raw] if isinstance(raw, str) else raw
    if not names:
        raise sni.error("bootstrap", "brokers.sni.bootstrap needs at least one name")
    for i, name in enumerate(names):
        if not isinstance(name, str) or not _HOST_NAME.fullmatch(name):
            line = sni.line_of("bootstrap") if isinstance(raw, str) else (
                line_of(raw, i) or sni.line_of("bootstrap"))
            raise sni.source.error(f"brokers.sni.bootstrap: {name!r} is not a host name", line)
    pattern = sni.require("broker", str)
    if pattern.count(NODE_ID) != 1 or not _HOST_NAME.fullmatch(pattern.replace(NODE_ID, "0")):
        raise sni.error("broker", f"brokers.sni.broker must be a host name with {NODE_ID} "
                        f"once in it (broker-{NODE_ID}.kafka.example.com), not {pattern!r}")
    port = sni.take("advertise_port", int)
    if port is not None and not 0 < port <= 65535:
        raise sni.error("advertise_port", "brokers.sni.advertise_port must be 1-65535 (the "
                        "port clients connect to; default the listen port)")
    routing = SniRouting(bootstrap=tuple(n.lower() for n in names), broker=pattern,
                         advertise_port=port)
    clash = next((n for n in routing.bootstrap if routing.broker_node(n) is not None), None)
    if clash is not None:
        raise sni.error("bootstrap", f"brokers.sni.bootstrap: {clash!r} is also a broker name")
    sni.finish()
    return routing


def _principal_mapping(down: Reader) -> tuple[MappingRule, ...]:
    """``principal_mapping_rules``: Kafka's string (rules separated by commas or new
    lines) or a list of rules; each error names its line."""
    key = "principal_mapping_rules"
    raw = down.take(key, (str, list))
    if raw is None:
        return ()
    items = [(raw, down.line_of(key))] if isinstance(raw, str) else [
        (item, line_of(raw, i) or down.line_of(key)) for i, item in enumerate(raw)]
    rules: list[MappingRule] = []
    for item, line in items:
        if not isinstance(item, str):
            raise down.source.error(f"tls.downstream.{key}: each rule is a string", line)
        try:
            rules.extend(parse_principal_mapping(item))
        except PrincipalMappingError as exc:
            raise down.source.error(f"tls.downstream.{key}: {exc}", line) from None
    return tuple(rules)


def load_config(path: str | Path) -> ProxyConfig:
    path = Path(path)
    return parse_config(load_yaml_file(path), str(path), path.parent.resolve())


def config_from_text(text: str, name: str = "<config>", base: Path | None = None) -> ProxyConfig:
    return parse_config(load_yaml_text(text, name), name, base)


__all__ = [
    "Address",
    "BrokerPorts",
    "ConfigError",
    "DownstreamTls",
    "Limits",
    "ProxyConfig",
    "SniRouting",
    "UpstreamTls",
    "config_from_text",
    "load_config",
    "parse_config",
]
