"""Certificates rotated while the proxy runs: the TLS contexts are rebuilt from their
files when a file changes (or on SIGHUP), new handshakes get the new certificate, and a
file that cannot be loaded keeps the old contexts in force and says so."""

from __future__ import annotations

import logging
import ssl
from pathlib import Path

import pytest
import trio
import trio.testing
import trustme

from gatehouse.logs import FIELDS_ATTR
from gatehouse.metrics import ProxyMetrics
from gatehouse.proxy.config import config_from_text
from gatehouse.proxy.setup import reload_all, watch_files
from gatehouse.proxy.tls import TlsContexts


def issue(tmp: Path, name: str) -> trustme.CA:
    """A CA whose server certificate for localhost goes to ``tmp``/server.pem and .key
    (overwriting), its own certificate to ``tmp``/``name``-ca.pem."""
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp / f"{name}-ca.pem"))
    cert = ca.issue_cert("localhost")
    cert.cert_chain_pems[0].write_to_path(str(tmp / "server.pem"))
    cert.private_key_pem.write_to_path(str(tmp / "server.key"))
    return ca


def contexts(tmp: Path) -> TlsContexts:
    return TlsContexts(config_from_text(
        f"listen: 127.0.0.1:1\nupstream: [x:1]\ntls:\n  downstream: "
        f"{{cert: {tmp}/server.pem, key: {tmp}/server.key}}\n"))


async def handshake(server: ssl.SSLContext | None, ca_file: Path) -> bool:
    """Whether a client trusting ``ca_file`` completes a TLS handshake with ``server``."""
    assert server is not None
    client_side, server_side = trio.testing.memory_stream_pair()
    client = trio.SSLStream(client_side, ssl.create_default_context(cafile=str(ca_file)),
                            server_hostname="localhost")
    served = trio.SSLStream(server_side, server, server_side=True)
    results: list[bool] = []

    async def side(stream: trio.SSLStream[trio.abc.Stream]) -> None:
        try:
            await stream.do_handshake()
            results.append(True)
        except trio.BrokenResourceError:
            results.append(False)
            await trio.aclose_forcefully(stream)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(side, client)
        nursery.start_soon(side, served)
    return all(results)


async def test_new_handshakes_get_the_new_certificate(tmp_path: Path) -> None:
    issue(tmp_path, "old")
    tls = contexts(tmp_path)
    before = tls.server
    assert await handshake(before, tmp_path / "old-ca.pem")
    assert not tls.changed()

    issue(tmp_path, "new")  # rotated in place, as cert-manager does
    assert tls.changed() and not tls.changed()  # seen once
    assert tls.reload()
    assert await handshake(tls.server, tmp_path / "new-ca.pem")
    assert not await handshake(tls.server, tmp_path / "old-ca.pem")
    assert await handshake(before, tmp_path / "old-ca.pem")  # what open ones keep
    assert (tls.succeeded, tls.failed) == (1, 0)


@pytest.mark.parametrize("damage", ["garbage", "missing", "another key"])
async def test_a_bad_file_keeps_the_old_certificate(
        tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    issue(tmp_path, "old")
    tls = contexts(tmp_path)
    metrics = ProxyMetrics()
    metrics.watch_tls(tls)
    if damage == "garbage":
        (tmp_path / "server.pem").write_text("-----BEGIN CERTIFICATE-----\nnope\n")
    elif damage == "missing":
        (tmp_path / "server.key").unlink()
    else:  # half a rotation: a new key beside the old certificate
        trustme.CA().issue_cert("localhost").private_key_pem.write_to_path(
            str(tmp_path / "server.key"))
    with caplog.at_level(logging.ERROR, logger="gatehouse.proxy"):
        assert not tls.reload()
    [record] = [r for r in caplog.records if r.name == "gatehouse.proxy"]
    assert record.getMessage() == "TLS reload failed: keeping the old certificates"
    fields = getattr(record, FIELDS_ATTR)
    assert str(tmp_path / "server.pem") in fields["files"]  # says which files
    assert fields["error"]
    assert await handshake(tls.server, tmp_path / "old-ca.pem")
    assert tls.failed == 1 and tls.last_error
    assert metrics.registry.get_sample_value("gatehouse_tls_last_reload_success") == 0
    assert metrics.registry.get_sample_value("gatehouse_tls_reloads_total",
                                             {"outcome": "failed"}) == 1

    issue(tmp_path, "new")  # the rotation completes: the next reload takes it
    assert tls.reload()
    assert await handshake(tls.server, tmp_path / "new-ca.pem")
    assert metrics.registry.get_sample_value("gatehouse_tls_last_reload_success") == 1


async def test_a_changed_file_is_reloaded_by_the_watcher(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    issue(tmp_path, "old")
    tls = contexts(tmp_path)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_files, tls)
        await trio.sleep(5)
        assert tls.succeeded == 0  # nothing changed: nothing reloaded
        issue(tmp_path, "new")
        await trio.sleep(1.5)  # one poll
        assert tls.succeeded == 1
        nursery.cancel_scope.cancel()
    assert await handshake(tls.server, tmp_path / "new-ca.pem")


def test_without_tls_a_reload_is_nothing(tmp_path: Path) -> None:
    tls = TlsContexts(config_from_text("listen: 127.0.0.1:1\nupstream: [x:1]\n"))
    assert (tls.server, tls.client, tls.files) == (None, None, ())
    reload_all(tls)  # SIGHUP on a proxy without TLS
    assert not tls.changed() and (tls.succeeded, tls.failed) == (0, 0)
