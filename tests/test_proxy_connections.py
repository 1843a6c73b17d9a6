"""/connections: the live client connections, as the proxy knows them (gatehouse.proxy.live),
served by the metrics endpoint to loopback clients unless told otherwise, and
`gatehouse connections`' table of them.  Real sockets: a fake broker, the proxy, raw
Kafka frames; the real-broker tests are in tests/integration/test_connections.py."""

from __future__ import annotations

import contextlib
import datetime
import http.server
import io
import json
import socket
import struct
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
from rich.console import Console

from gatehouse import codecs
from gatehouse.cli.connections import chosen, connections_url, render, run_connections
from gatehouse.configfile import ConfigError
from gatehouse.metrics import ConnectionsEndpoint, is_loopback, serve_endpoints
from gatehouse.proxy.config import Address, config_from_text
from gatehouse.proxy.hooks import (
    CONN_APIS_MAX,
    CONN_TOPICS_MAX,
    OTHER,
    ConnectionInfo,
    tally_topic,
)
from gatehouse.proxy.workers import Supervisor
from tests.reliability.support import (
    FakeBrokerServer,
    connect,
    local_address,
    read_frame,
    wait_until,
)
from tests.support.fakebroker import frame_bytes, request, response_body
from tests.support.ports import free_port, port_is_listening
from tests.support.proxythread import ProxyThread

BASE = "listen: 127.0.0.1:9192\nupstream: [127.0.0.1:9092]\n"


# -- who may read it -----------------------------------------------------------------


def test_metrics_connections_is_local_unless_told() -> None:
    assert config_from_text(BASE).metrics_connections == "local"
    for said, readers in [("", "local"), ("connections: local", "local"),
                          ("connections: any", "any"), ("connections: off", "off"),
                          ("connections: false", "off")]:
        config = config_from_text(BASE + "metrics:\n  listen: 9464\n  " + said + "\n")
        assert config.metrics_connections == readers, said


@pytest.mark.parametrize(("said", "error"), [
    ("connections: true", "who may read /connections: local (loopback clients, the "
                          "default), any (whoever reaches metrics.listen) or off, not true"),
    ("connections: everyone", "or off, not 'everyone'"),
    ("connections: 1", "metrics.connections must be a string or true or false"),
])
def test_metrics_connections_refused_with_its_line(said: str, error: str) -> None:
    with pytest.raises(ConfigError) as caught:
        config_from_text(BASE + "metrics:\n  listen: 9464\n  " + said + "\n", "proxy.yaml")
    assert str(caught.value).startswith("proxy.yaml:5: ")
    assert error in str(caught.value)


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.3.2.1", True), ("::1", True), ("::ffff:127.0.0.1", True),
    ("192.0.2.2", False), ("10.1.2.3", False), ("::ffff:10.1.2.3", False),
    ("fe80::1%eth0", False), ("2001:db8::1", False), ("", False), ("not-an-address", False),
])
def test_loopback_peers(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def non_loopback_address() -> str:
    """An address of this host that is not loopback: a connection made from it to this
    host is not a loopback client's (the kernel keeps it on lo, with this source)."""
    found = json.loads(subprocess.run(["ip", "-j", "-4", "addr"], capture_output=True,
                                      check=True, text=True).stdout)
    for link in found:
        for info in link.get("addr_info", []):
            if info.get("scope") == "global":
                return str(info["local"])
    raise AssertionError("this host has no IPv4 address but loopback's to test from")


def get(url: str, source: str | None = None) -> tuple[int, bytes]:
    """``GET url`` from ``source`` (an address of this host): status and body."""
    parts = urllib.request.urlparse(url)
    host, port = parts.hostname or "", parts.port or 80
    with socket.create_connection((host, port), timeout=10,
                                  source_address=(source, 0) if source else None) as sock:
        sock.sendall(f"GET {parts.path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


DOCUMENT = b'{"count":0,"connections":[]}\n'


async def document() -> bytes:
    return DOCUMENT


@pytest.mark.parametrize(("readers", "from_loopback", "from_elsewhere"), [
    ("local", 200, 403), ("any", 200, 200), ("off", 404, 404),
])
async def test_who_is_served_connections(readers: str, from_loopback: int,
                                         from_elsewhere: int) -> None:
    elsewhere = non_loopback_address()
    async with trio.open_nursery() as nursery:
        port = await nursery.start(lambda task_status: serve_endpoints(
            Address("0.0.0.0", 0), lambda: b"", lambda: True,
            connections=ConnectionsEndpoint(document, readers), task_status=task_status))
        # From loopback to loopback; from elsewhere; and from loopback to the host's
        # address, as a mesh sidecar hands over the network's connections (Istio:
        # from 127.0.0.6 to the pod's address).
        seen = [await trio.to_thread.run_sync(get, f"http://{host}:{port}/connections",
                                              source)
                for host, source in (("127.0.0.1", None), (elsewhere, elsewhere),
                                     (elsewhere, "127.0.0.6"))]
        # /metrics and the rest answer anyone who reaches them, as before.
        metrics = await trio.to_thread.run_sync(get, f"http://{elsewhere}:{port}/healthz",
                                                elsewhere)
        nursery.cancel_scope.cancel()
    assert [status for status, _ in seen] == [from_loopback, from_elsewhere, from_elsewhere]
    for status, body in seen:
        if status == 200:
            assert body == DOCUMENT
        elif status == 403:
            assert b"served to loopback clients only (metrics.connections: local)" in body
        else:
            assert b"metrics.connections: off" in body
    assert metrics == (200, b"ok\n")


# -- what it shows -------------------------------------------------------------------


def no_metadata_answer(req: codecs.Request) -> Any:
    """The broker answers everything but Metadata (a client left waiting)."""
    return None if req.api_key == 3 else response_body(req.api_key, req.api_version)


@pytest.fixture
def broker() -> Iterator[FakeBrokerServer]:
    with FakeBrokerServer(no_metadata_answer) as server:
        yield server


@pytest.fixture
def proxy(broker: FakeBrokerServer) -> Iterator[ProxyThread]:
    with ProxyThread(f"127.0.0.1:{broker.port}", metrics=False,
                     extra_config="limits: {shutdown_grace: 1}\n") as proxy:
        yield proxy


def listed(proxy: ProxyThread) -> dict[str, Any]:
    async def take() -> bytes:
        return await proxy.proxy.live.json()

    return dict(json.loads(trio.from_thread.run(take, trio_token=proxy._token)))


def test_each_connection_as_the_proxy_knows_it(proxy: ProxyThread) -> None:
    assert listed(proxy) == {"count": 0, "connections": []}
    before = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    with connect(proxy.port) as known, connect(proxy.port) as silent:
        hello = frame_bytes(request(18, 3, 1, client_id="orders-app",
                                    client_software_name="probe-lib",
                                    client_software_version="1.2.3").encode())
        known.sendall(hello)
        answer = read_frame(known)
        assert answer is not None
        # A request the broker leaves unanswered: owed to the client.
        waiting = frame_bytes(request(3, 12, 2, client_id="orders-app", topics=None).encode())
        known.sendall(waiting)
        wait_until(lambda: len(listed(proxy)["connections"]) == 2
                   and any(c["answers_owed"] == 1 for c in listed(proxy)["connections"]),
                   10, "both connections, one owed an answer")
        doc = listed(proxy)
        assert doc["count"] == 2
        first, second = doc["connections"]  # oldest first
        assert first["id"] < second["id"]
        by_client = {c["client"]: c for c in doc["connections"]}
        mine = by_client[local_address(known)]
        assert {k: mine[k] for k in ("listener", "node_id", "state", "tls", "sasl_mechanism",
                                     "principal", "client_id", "software_name",
                                     "software_version", "via", "requests", "responses",
                                     "refused", "answers_owed", "requests_by_api",
                                     "produced", "fetched")} == {
            "listener": "bootstrap", "node_id": None, "state": "open", "tls": False,
            "sasl_mechanism": None, "principal": None, "client_id": "orders-app",
            "software_name": "probe-lib", "software_version": "1.2.3", "via": None,
            "requests": 2, "responses": 1, "refused": 0, "answers_owed": 1,
            "requests_by_api": {"ApiVersions": 1, "Metadata": 1},
            "produced": {}, "fetched": {}}  # no metrics here: no topics counted
        assert mine["upstream"] == f"127.0.0.1:{proxy.config.upstream[0].port}"
        assert mine["bytes_from_client"] == len(hello) + len(waiting)
        assert mine["bytes_to_client"] == 4 + len(answer)
        opened = datetime.datetime.fromisoformat(mine["opened"].replace("Z", "+00:00"))
        assert before <= opened <= datetime.datetime.now(datetime.UTC)
        assert 0 <= mine["seconds_idle"] <= mine["seconds_open"] < 60
        oldest = mine["oldest_owed"]
        assert (oldest["api"], oldest["version"]) == ("Metadata", 12)
        assert 0 <= oldest["seconds"] <= mine["seconds_open"]
        quiet = by_client[local_address(silent)]
        assert (quiet["client_id"], quiet["software_name"], quiet["requests"],
                quiet["bytes_from_client"], quiet["state"], quiet["oldest_owed"],
                quiet["requests_by_api"]) == (None, None, 0, 0, "open", None, {})
    # Closed: the silent one gone, the other waiting for its answer, to no one.
    wait_until(lambda: [(c["client"], c["state"], c["answers_owed"])
                        for c in listed(proxy)["connections"]]
               == [(mine["client"], "closing", 1)], 10, "the one owed an answer alone")


def test_a_connection_past_its_age_closes_once_answered(broker: FakeBrokerServer) -> None:
    with ProxyThread(f"127.0.0.1:{broker.port}", metrics=False,
                     extra_config="limits: {max_connection_age: 0.5, shutdown_grace: 1}\n"
                     ) as proxy, connect(proxy.port) as sock:
        sock.sendall(frame_bytes(request(3, 12, 1, topics=None).encode()))  # left owed
        # Past its age (0.45-0.55 s): no more requests read, the answer still awaited.
        wait_until(lambda: [(c["state"], c["answers_owed"], c["requests"])
                            for c in listed(proxy)["connections"]] == [("closing", 1, 1)],
                   10, "the drain")
        [waiting] = listed(proxy)["connections"]
        assert waiting["oldest_owed"]["api"] == "Metadata"
        assert waiting["oldest_owed"]["seconds"] >= 0.4  # past the age, nearly


def test_a_connection_still_in_its_tls_handshake_is_connecting(
        broker: FakeBrokerServer, tmp_path: Path) -> None:
    import trustme

    cert = trustme.CA().issue_cert("127.0.0.1")
    cert.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "proxy.pem"))
    cert.private_key_pem.write_to_path(str(tmp_path / "proxy.key"))
    with ProxyThread(f"127.0.0.1:{broker.port}", metrics=False, extra_config=(
            f"tls: {{downstream: {{cert: {tmp_path / 'proxy.pem'}, "
            f"key: {tmp_path / 'proxy.key'}}}}}\nlimits: {{shutdown_grace: 1}}\n")
                     ) as proxy, connect(proxy.port) as sock:  # no ClientHello
        wait_until(lambda: listed(proxy)["count"] == 1, 10, "the connection")
        [conn] = listed(proxy)["connections"]
        assert conn["client"] == local_address(sock)
        assert (conn["state"], conn["tls"], conn["upstream"], conn["seconds_idle"],
                conn["answers_owed"], conn["oldest_owed"], conn["requests"]) == (
            "connecting", True, None, None, 0, None, 0)
        sock.close()
        wait_until(lambda: listed(proxy)["count"] == 0, 10, "the connection to go")


def orders_batch(count: int) -> bytes:
    """A v2 record batch whose header claims ``count`` records (what the metrics read)."""
    body = struct.pack(">hiqqqhii", 0, 0, 0, 0, -1, -1, -1, count) + b"\x00" * 30
    return struct.pack(">qii", 0, 9 + len(body), 0) + b"\x02" + struct.pack(">I", 0) + body


def fetched_orders(req: codecs.Request) -> Any:
    """A broker whose Fetch answers hold 7 records of "orders" partition 0, and
    NOT_LEADER_OR_FOLLOWER for its partition 1."""
    if req.api_key != 1:
        return response_body(req.api_key, req.api_version)
    partition = {"partition_index": 0, "error_code": 0, "high_watermark": 7,
                 "last_stable_offset": 7, "log_start_offset": 0, "aborted_transactions": [],
                 "preferred_read_replica": -1, "records": orders_batch(7)}
    moved = {**partition, "partition_index": 1, "error_code": 6, "records": None}
    return response_body(1, req.api_version, throttle_time_ms=0, error_code=0, session_id=0,
                         responses=[{"topic": "orders", "partitions": [partition, moved]}])


def test_what_each_connection_does_by_api_and_topic() -> None:
    """Requests by API (most first), the records and bytes of each topic produced and
    fetched (the metrics' count, read from the batch headers), and the errors its
    answers carried, over real sockets: the produced topics as the client named them,
    before any rename."""
    with FakeBrokerServer(fetched_orders) as broker, ProxyThread(
            f"127.0.0.1:{broker.port}", extra_config="limits: {shutdown_grace: 1}\n",
            rules_yaml="rules:\n  - name: tenant\n    topic_prefix: acme.\n") as proxy, \
            connect(proxy.port) as writer, connect(proxy.port) as reader:
        for n in range(3):
            writer.sendall(frame_bytes(request(
                0, 9, n, transactional_id=None, acks=-1, timeout_ms=1000, topic_data=[
                    {"name": "orders", "partition_data": [{"index": 0,
                                                           "records": orders_batch(5)}]},
                    {"name": "audit", "partition_data": [{"index": 0,
                                                          "records": orders_batch(1)}]}],
            ).encode()))
            assert read_frame(writer) is not None
        writer.sendall(frame_bytes(request(3, 12, 9, topics=None).encode()))
        assert read_frame(writer) is not None
        for n in range(2):
            reader.sendall(frame_bytes(request(1, 12, n, max_wait_ms=0, min_bytes=1,
                                               max_bytes=1 << 20, topics=[]).encode()))
            assert read_frame(reader) is not None
        by_client = {c["client"]: c for c in listed(proxy)["connections"]}
        wrote, read = by_client[local_address(writer)], by_client[local_address(reader)]
        size = len(orders_batch(5))
        assert list(wrote["requests_by_api"].items()) == [("Produce", 3), ("Metadata", 1)]
        assert list(wrote["produced"].items()) == [  # most bytes first
            ("orders", {"records": 15, "bytes": 3 * size}),
            ("audit", {"records": 3, "bytes": 3 * len(orders_batch(1))})]
        assert (wrote["fetched"], read["produced"]) == ({}, {})
        assert read["requests_by_api"] == {"Fetch": 2}
        assert read["fetched"] == {"orders": {"records": 14, "bytes": 2 * len(orders_batch(7))}}
        # A partition's error in each Fetch answer: counted on the reader, not the writer.
        assert read["errors"] == {"Fetch NOT_LEADER_OR_FOLLOWER": 2}
        last = read["last_error"]
        assert (last["api"], last["error"]) == ("Fetch", "NOT_LEADER_OR_FOLLOWER")
        assert 0 <= last["seconds_ago"] < 60
        assert (wrote["errors"], wrote["last_error"]) == ({}, None)


def test_a_connections_tallies_are_bounded() -> None:
    """A client choosing API keys no API has, and a consumer of thousands of topics:
    past CONN_TOPICS_MAX topics a tally folds the rest into "(other)" (the pumps' count
    by API, past CONN_APIS_MAX keys: below)."""
    conn = ConnectionInfo(id=1, client="c", listener="bootstrap")
    for n in range(CONN_TOPICS_MAX + 50):
        tally_topic(conn.fetched, f"t{n}", 2, 10)
    assert len(conn.fetched) == CONN_TOPICS_MAX + 1
    assert conn.fetched[OTHER] == [100, 500]
    assert conn.fetched["t0"] == [2, 10]
    tally_topic(conn.fetched, "t0", 1, 1)  # a listed one goes on being counted
    assert conn.fetched["t0"] == [3, 11]


def test_requests_with_keys_no_api_has_fold_into_other() -> None:
    with FakeBrokerServer(lambda req: None) as broker, ProxyThread(
            f"127.0.0.1:{broker.port}", metrics=False,
            extra_config="limits: {shutdown_grace: 1}\n") as proxy, \
            connect(proxy.port) as sock:
        # Unknown keys are forwarded untouched; this broker answers none of them.
        for key in range(1000, 1000 + CONN_APIS_MAX + 20):
            sock.sendall(frame_bytes(struct.pack(">hhi", key, 0, key) + b"\xff\xff"))
        wait_until(lambda: [c["requests"] for c in listed(proxy)["connections"]]
                   == [CONN_APIS_MAX + 20], 10, "every request read")
        [conn] = listed(proxy)["connections"]
        assert len(conn["requests_by_api"]) == CONN_APIS_MAX + 1
        assert conn["requests_by_api"]["(other)"] == 20
        assert conn["requests_by_api"]["api-1000"] == 1


# -- `gatehouse connections` -----------------------------------------------------------


def test_the_endpoint_beside_the_metrics_one() -> None:
    for given in ("http://127.0.0.1:9464/metrics", "http://127.0.0.1:9464/",
                  "http://127.0.0.1:9464", "127.0.0.1:9464",
                  "http://127.0.0.1:9464/connections"):
        assert connections_url(given) == "http://127.0.0.1:9464/connections", given
    assert connections_url("https://h:1/proxy/metrics") == "https://h:1/proxy/connections"


def entry(id_: int, **fields: Any) -> dict[str, Any]:
    base = {"id": id_, "client": f"10.0.0.{id_}:5000", "via": None, "listener": "bootstrap",
            "node_id": None, "upstream": "b:9092", "state": "open", "tls": False,
            "sasl_mechanism": None, "principal": None, "client_id": None,
            "software_name": None, "software_version": None, "opened": "2026-01-01T00:00:00Z",
            "seconds_open": 100.0 - id_, "seconds_idle": 1.0, "requests": 0,
            "requests_by_api": {}, "produced": {}, "fetched": {}, "responses": 0,
            "refused": 0, "errors": {}, "last_error": None, "answers_owed": 0, "oldest_owed": None, "bytes_from_client": 0,
            "bytes_to_client": 0}
    return {**base, **fields}


DOC = {"count": 3, "connections": [
    entry(1, client_id="billing", requests=5, bytes_from_client=10),
    entry(2, client_id="orders-writer", principal="svc-orders", sasl_mechanism="SCRAM-SHA-512",
          software_name="confluent-kafka-python", software_version="2.16.2", requests=50,
          requests_by_api={"Produce": 46, "Metadata": 3, "ApiVersions": 1},
          produced={"orders": {"records": 4000, "bytes": 4900},
                    "audit": {"records": 10, "bytes": 80},
                    "payments-eu": {"records": 1, "bytes": 20}},
          bytes_from_client=5000, bytes_to_client=100, answers_owed=2,
          oldest_owed={"api": "Fetch", "version": 17, "seconds": 3.25}),
    entry(3, client_id="reader", requests=9, requests_by_api={"Fetch": 9},
          fetched={"payments": {"records": 90, "bytes": 899_000}}, bytes_to_client=900_000,
          errors={"Fetch NOT_LEADER_OR_FOLLOWER": 3, "Metadata LEADER_NOT_AVAILABLE": 1},
          last_error={"api": "Fetch", "error": "NOT_LEADER_OR_FOLLOWER", "seconds_ago": 1.5},
          seconds_idle=30.0, answers_owed=5,
          oldest_owed={"api": "Metadata", "version": 12, "seconds": 0.5}),
]}


def test_sorted_matched_and_cut() -> None:
    def ids(**how: Any) -> list[int]:
        return [c["id"] for c in chosen(DOC, **how)]

    assert ids() == [1, 2, 3]  # oldest first
    assert ids(sort="bytes") == [3, 2, 1]
    assert ids(sort="requests") == [2, 3, 1]
    assert ids(sort="idle") == [3, 1, 2]
    assert ids(sort="owed") == [2, 3, 1]  # waiting longest first
    assert ids(sort="errors") == [3, 1, 2]
    assert ids(match="not_leader") == [3]  # an error it was answered with
    assert ids(match="ORDERS") == [2]
    assert ids(match="payments") == [2, 3]  # a topic each produced to or fetched from
    assert ids(match="payments-eu") == [2]
    assert ids(match="svc-orders") == [2]
    assert ids(match="10.0.0.3") == [3]
    assert ids(sort="bytes", limit=1) == [3]


def test_the_table() -> None:
    out = io.StringIO()
    Console(file=out, width=320, color_system=None).print(
        render(DOC, chosen(DOC, match="payments"), "http://h/connections"))
    shown = out.getvalue()
    assert "3 connections, 2 shown" in shown
    row = next(line for line in shown.splitlines() if "orders-writer" in line)
    cells = [c.strip() for c in row.split("│") if c.strip()]
    assert cells[:7] == ["2", "10.0.0.2:5000", "bootstrap > b:9092", "open", "orders-writer",
                         "confluent-kafka-python 2.16.2", "svc-orders (SCRAM-SHA-512)"]
    assert cells[7:] == ["1m38s", "1s", "50", "Produce 46, Metadata 3 +1",
                         "> orders, audit +1", "-", "2 (Fetch v17, 3.2s)", "4.9 KiB", "100 B"]
    row = next(line for line in shown.splitlines() if "reader" in line)
    assert [c.strip() for c in row.split("│") if c.strip()][10:13] == [
        "Fetch 9", "< payments", "4 (NOT_LEADER_OR_FOLLOWER)"]
    assert "billing" not in shown
    # A supervisor's: each connection is its worker's; a silent worker is said.
    workers = {"count": 1, "workers": 2, "workers_unavailable": [1],
               "connections": [{**entry(7), "worker": 0}]}
    out = io.StringIO()
    Console(file=out, width=320, color_system=None).print(
        render(workers, chosen(workers), "u"))
    assert "workers not answering: 1" in out.getvalue()
    row = next(line for line in out.getvalue().splitlines() if "10.0.0.7:5000" in line)
    assert next(c.strip() for c in row.split("│") if c.strip()) == "0:7"
    # What a client chose is shown literally: no markup read, no escape sequence sent.
    evil = {"count": 1, "connections": [entry(8, client_id="[red]x[/red]\x1b]0;t\x07")]}
    out = io.StringIO()
    Console(file=out, width=320, force_terminal=True, color_system=None).print(
        render(evil, chosen(evil), "u"))
    assert "\x1b" not in out.getvalue() and "\x07" not in out.getvalue()
    assert r"[red]x[/red]\x1b]0;t\x07" in out.getvalue()


def serve_beside(proxy: ProxyThread, readers: str) -> int:
    """The proxy's /connections on a port of its own, served by the proxy's event loop
    (as `gatehouse run` serves it)."""
    port = free_port()
    trio.from_thread.run_sync(
        trio.lowlevel.spawn_system_task, partial(
            serve_endpoints, Address("127.0.0.1", port), lambda: b"", lambda: True,
            connections=ConnectionsEndpoint(proxy.proxy.live.json, readers)),
        trio_token=proxy._token)
    wait_until(lambda: port_is_listening(port), 10, "the endpoint")
    return port


def test_the_command_against_a_real_endpoint(proxy: ProxyThread) -> None:
    on, off = serve_beside(proxy, "local"), serve_beside(proxy, "off")
    with connect(proxy.port) as sock:
        sock.sendall(frame_bytes(request(18, 3, 1, client_id="cli-test",
                                         client_software_name="probe-lib",
                                         client_software_version="9").encode()))
        assert read_frame(sock) is not None
        out = io.StringIO()
        assert run_connections(f"http://127.0.0.1:{on}/metrics", as_json=True,
                               console=Console(file=out, width=200)) == 0
        [shown] = json.loads(out.getvalue())["connections"]
        assert (shown["client_id"], shown["software_name"], shown["client"]) == (
            "cli-test", "probe-lib", local_address(sock))
        out = io.StringIO()
        assert run_connections(f"http://127.0.0.1:{on}", console=Console(
            file=out, width=250, color_system=None)) == 0
        assert "cli-test" in out.getvalue() and "probe-lib 9" in out.getvalue()
    out = io.StringIO()
    assert run_connections(f"http://127.0.0.1:{off}/metrics", console=Console(
        file=out, width=250, color_system=None)) == 1
    assert "404 not served here (metrics.connections: off)" in out.getvalue()
    out = io.StringIO()
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        closed = unused.getsockname()[1]
    assert run_connections(f"http://127.0.0.1:{closed}/metrics", console=Console(
        file=out, width=250, color_system=None)) == 1
    assert "error:" in out.getvalue() and "refused" in out.getvalue().lower()
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(f"http://127.0.0.1:{off}/connections", timeout=10)


@contextlib.contextmanager
def answering(status: int, body: bytes) -> Iterator[int]:
    """A worker's metrics endpoint as the supervisor meets it: /connections answered
    with ``status`` and ``body``; its port."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # the standard library calls it by this name
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_the_supervisor_lists_every_workers_connections() -> None:
    supervisor = Supervisor(config_from_text(BASE + "workers: 4\nmetrics: {listen: 9464}\n"),
                            [])
    first = {"count": 2, "connections": [entry(5), entry(1)]}
    last = {"count": 1, "connections": [entry(1, client_id="w3")]}
    with answering(200, json.dumps(first).encode()) as port0, \
            answering(404, b"not served here\n") as port2, \
            answering(200, json.dumps(last).encode()) as port3:
        # Worker 1 is starting again (no endpoint yet); worker 2 says no.
        for index, port in ((0, port0), (2, port2), (3, port3)):
            supervisor.workers[index].metrics_port = port
        doc = json.loads(supervisor.render_connections())
    assert (doc["count"], doc["workers"], doc["workers_unavailable"]) == (3, 4, [1, 2])
    assert [(c["worker"], c["id"], c["client_id"]) for c in doc["connections"]] == [
        (0, 1, None), (0, 5, None), (3, 1, "w3")]
