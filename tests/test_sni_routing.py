"""``brokers.sni``: the config, the route a server name takes, and reading the name a
client asks for during the TLS handshake (memory streams).  The real-broker tests are
in tests/integration/test_sni_routing.py."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest
import trio
import trio.testing
import trustme

from gatehouse.configfile import ConfigError
from gatehouse.proxy.config import ProxyConfig, config_from_text
from gatehouse.proxy.tls import TlsContexts, accept_tls, server_ssl_context


def config(tmp_path: Path, brokers: str) -> ProxyConfig:
    for name in ("c.pem", "k.pem"):
        if not (tmp_path / name).exists():
            (tmp_path / name).write_text("")
    return config_from_text(
        "listen: 0.0.0.0:9092\nupstream: [kafka:9092]\n"
        f"tls:\n  downstream: {{cert: {tmp_path}/c.pem, key: {tmp_path}/k.pem}}\n"
        + brokers, "gatehouse.yaml")


SNI = ("brokers:\n  sni:\n    bootstrap: [Kafka.example.com, bootstrap.kafka.example.com]\n"
       "    broker: b-$(nodeId).kafka.example.com\n")


def test_a_server_name_routes_to_the_bootstrap_or_a_broker(tmp_path: Path) -> None:
    sni = config(tmp_path, SNI).brokers.sni
    assert sni is not None and sni.advertise_port is None
    assert sni.route("b-0.kafka.example.com") == ("broker-0", 0)
    assert sni.route("B-1234.Kafka.Example.com.") == ("broker-1234", 1234)  # DNS: any case
    assert sni.route("kafka.example.com") == ("bootstrap", None)
    assert sni.route(None) == ("bootstrap", None)  # connected by address
    for elsewhere in ("b-01.kafka.example.com", "b-.kafka.example.com", "b-1.kafka.example",
                      "x.b-1.kafka.example.com", "b-1x.kafka.example.com"):
        assert sni.route(elsewhere) is None, elsewhere
    assert sni.broker_host(7) == "b-7.kafka.example.com"
    told = config(tmp_path, SNI + "    advertise_port: 443\n").brokers.sni
    assert told is not None and told.advertise_port == 443


@pytest.mark.parametrize(("brokers", "line", "message"), [
    ("brokers:\n  start_port: 9100\n  sni: {bootstrap: k, broker: b-$(nodeId)}\n", 6,
     "brokers.start_port is for a port per broker"),
    ("brokers:\n  sni:\n    bootstrap: k\n    broker: broker.kafka\n", 8,
     "must be a host name with .* once in it"),
    ("brokers:\n  sni:\n    bootstrap: [k, 'not a name']\n    broker: b-$(nodeId)\n", 7,
     "'not a name' is not a host name"),
    ("brokers:\n  sni:\n    bootstrap: b-1\n    broker: b-$(nodeId)\n", 7,
     "'b-1' is also a broker name"),
    ("brokers:\n  sni:\n    broker: b-$(nodeId)\n", 7, "needs 'bootstrap'"),
    ("brokers:\n  sni: {bootstrap: k, broker: b-$(nodeId), advertise_port: 70000}\n", 6,
     "advertise_port must be 1-65535"),
])
def test_bad_sni_settings_say_file_and_line(tmp_path: Path, brokers: str, line: int,
                                            message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        config(tmp_path, brokers)
    assert str(info.value).startswith(f"gatehouse.yaml:{line}: ")


def test_sni_needs_the_proxy_to_end_tls() -> None:
    with pytest.raises(ConfigError, match=r"needs tls\.downstream") as info:
        config_from_text("listen: 0.0.0.0:9092\nupstream: [kafka:9092]\n" + SNI,
                         "gatehouse.yaml")
    assert str(info.value).startswith("gatehouse.yaml:4: ")


def issue(tmp_path: Path) -> trustme.CA:
    """A CA and its certificate for ``*.kafka.example.com`` in ``tmp_path`` (c.pem,
    k.pem: the files ``config`` names)."""
    ca = trustme.CA()
    issued = ca.issue_cert("*.kafka.example.com")
    issued.cert_chain_pems[0].write_to_path(str(tmp_path / "c.pem"))
    issued.private_key_pem.write_to_path(str(tmp_path / "k.pem"))
    return ca


async def name_read(server: ssl.SSLContext, ca: trustme.CA, asked: str | None) -> str | None:
    """The server name ``accept_tls`` reads from a client trusting ``ca`` that asks for
    ``asked`` (None: a client that connected by address sends none)."""
    client_context = ssl.create_default_context()
    ca.configure_trust(client_context)
    if asked is None:
        client_context.check_hostname = False  # by address: no name to send or check
    client_side, server_side = trio.testing.memory_stream_pair()
    client = trio.SSLStream(client_side, client_context, server_hostname=asked)
    served = trio.SSLStream(server_side, server, server_side=True)
    names: list[str | None] = []

    async def serve() -> None:
        names.append(await accept_tls(served))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        nursery.start_soon(client.do_handshake)
    [name] = names
    return name


@pytest.mark.parametrize("asked", ["b-3.kafka.example.com", None])
async def test_the_handshake_says_which_name_the_client_asked_for(
        tmp_path: Path, asked: str | None) -> None:
    ca = issue(tmp_path)
    downstream = config(tmp_path, SNI).tls_downstream
    assert downstream is not None
    assert await name_read(server_ssl_context(downstream), ca, asked) == asked


async def test_a_reloaded_certificate_still_reads_the_server_name(tmp_path: Path) -> None:
    """The contexts a certificate rotation builds are the start-up ones' kind: they read
    the name each client asks for too."""
    issue(tmp_path)
    contexts = TlsContexts(config(tmp_path, SNI))
    ca = issue(tmp_path)  # rotated
    assert contexts.reload() and contexts.server is not None
    assert await name_read(contexts.server, ca, "b-9.kafka.example.com") == \
        "b-9.kafka.example.com"
