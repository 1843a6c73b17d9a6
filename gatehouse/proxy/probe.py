"""``gatehouse check --probe``: the brokers as the proxy would reach them, before any
client does.

Each bootstrap server is connected to exactly as a client's connection would be (TCP
within the connect timeout, tls.upstream, the proxy's own SASL login), the cluster is
asked for its brokers, and each broker is connected to the same way at the address the
cluster gives: the addresses a sidecar or an edge proxy cannot resolve or reach, the
certificates it does not trust and the credentials the brokers refuse (a pod without
its AWS role, a rotated password) show at deploy time, one line each, instead of as
clients' errors later.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from gatehouse.codecs import APIS, ProtocolError, api, api_name
from gatehouse.proxy.addresses import BrokerAddress
from gatehouse.proxy.config import Address
from gatehouse.proxy.connection import STREAM_ERRORS, aclose_quietly
from gatehouse.proxy.server import Proxy, Upstream, UpstreamUnavailable, ask_for_brokers


async def probe_upstream(proxy: Proxy, say: Callable[[str], None]) -> bool:
    """Connect to every bootstrap server and every broker the cluster lists, as the
    proxy does; ``say`` one line for each.  True if every one answered."""
    config = proxy.config
    proxy.bootstrap_ports = [config.listen.port]  # what clients are told, under SNI
    ok = True
    metadata = None
    ranges: dict[int, tuple[int, int]] = {}
    for target in config.upstream:
        upstream = await _connect(proxy, target, "bootstrap", say)
        if upstream is None:
            ok = False
            continue
        try:
            if metadata is None:
                with trio.fail_after(config.limits.connect_timeout * 2):
                    ranges, metadata = await ask_for_brokers(upstream.stream)
        except (trio.TooSlowError, *STREAM_ERRORS, ProtocolError) as exc:
            say(f"bootstrap {target}: no answer to Metadata: {str(exc) or repr(exc)}")
            ok = False
        finally:
            await aclose_quietly(upstream.stream)
    if metadata is None:
        say("the cluster's brokers: not known (no bootstrap server answered)")
        return False
    brokers = sorted(metadata.brokers, key=lambda b: b.node_id)
    say(f"cluster {metadata.cluster_id}: {len(brokers)} "
        f"broker{'s' if len(brokers) != 1 else ''}, controller {metadata.controller_id}")
    say(versions_line(ranges))
    telemetry = telemetry_line(config.client_telemetry is not None
                               and config.client_telemetry.receives, ranges)
    if telemetry is not None:
        say(telemetry)
    for broker in brokers:
        served = proxy.map_address(BrokerAddress(broker.node_id, broker.host, broker.port))
        what = (f"broker {broker.node_id} (clients: "
                + (f"{served[0]}:{served[1] or 'a port chosen at start'})" if served
                   else "no proxy port: brokers.ports names none for it)"))
        if served is None:
            ok = False
        upstream = await _connect(proxy, Address(broker.host, broker.port), what, say)
        if upstream is None:
            ok = False
        else:
            await aclose_quietly(upstream.stream)
    return ok


async def _connect(proxy: Proxy, target: Address, what: str,
                   say: Callable[[str], None]) -> Upstream | None:
    try:
        upstream = await proxy.connect_to(target)
    except UpstreamUnavailable as exc:
        say(f"{what} {exc}")  # the message starts with the target
        return None
    credentials = proxy.upstream_credentials
    said = [f"{what} {target}: connected"]
    if proxy.tls.client is not None:
        said.append("TLS")
    if credentials is not None:
        said.append(f"logged in as {credentials.username!r} ({credentials.mechanism})")
    if upstream.session_lifetime is not None:
        said.append(f"session {upstream.session_lifetime:g} s")
    say(", ".join(said))
    return upstream


def versions_line(ranges: dict[int, tuple[int, int]]) -> str:
    """What the broker's API versions mean for the proxy: how many it decodes, and what
    is newer than its tables (forwarded untouched, and kept out of clients' ApiVersions
    answers) -- a broker upgraded past the proxy shows here."""
    newer, unknown = [], []
    for key, (_, hi) in sorted(ranges.items()):
        spec = APIS.get(key)
        if spec is None:
            unknown.append(str(key))
        elif hi > spec.versions.hi:
            newer.append(f"{api_name(key)} v{spec.versions.hi + 1}-{hi}")
    line = (f"broker APIs: {len(ranges)}, {len(ranges) - len(unknown)} known to this "
            "proxy's tables")
    if newer:
        line += f"; versions newer than its tables (not offered to clients): {', '.join(newer)}"
    if unknown:
        line += f"; API keys it does not know (not offered to clients): {', '.join(unknown)}"
    return line


_PUSH_TELEMETRY = api("PushTelemetry").key


def telemetry_line(receiving: bool, ranges: dict[int, tuple[int, int]]) -> str | None:
    """Who receives the clients' own metrics (KIP-714), when the proxy does
    (``receiving``: metrics.client_telemetry) or the brokers do (they offer
    PushTelemetry only with a receiver plugin); None when neither does."""
    brokers = _PUSH_TELEMETRY in ranges
    if receiving and brokers:
        return ("client telemetry: the brokers have a receiver of their own, which gets "
                "none of these clients' metrics: the proxy answers them "
                "(metrics.client_telemetry)")
    if receiving:
        return ("client telemetry: the proxy receives the clients' metrics (the brokers "
                "have no receiver)")
    if brokers:
        return "client telemetry: the brokers receive the clients' metrics, through the proxy"
    return None
