"""The proxy's TLS contexts: the server side for clients (``tls.downstream``), the client
side for the brokers (``tls.upstream``), and their reload when the files change.

Certificates are rotated while a proxy runs (cert-manager renews a Kubernetes secret
weeks before it expires), so the contexts are rebuilt from their files on SIGHUP and
when a file changes.  New connections get the new contexts; open ones keep theirs.  A
file that cannot be loaded (half-written, a key that does not fit its certificate)
keeps the old contexts in force and is reported, as a bad rules file is.

One definition of the upstream context for everything that connects to the upstream
cluster: the proxy's broker connections and the capture's Kafka sink.
"""

from __future__ import annotations

import contextvars
import logging
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from gatehouse.configfile import FileWatch
from gatehouse.logs import log_event
from gatehouse.proxy.config import DownstreamTls, ProxyConfig, UpstreamTls

logger = logging.getLogger("gatehouse.proxy")


# The server names (SNI) the handshakes in progress in this task were asked for: set by
# ``accept_tls`` around its handshake, appended to by the context's SNI callback, which
# OpenSSL calls inside that handshake, in that task's context.
_SERVER_NAMES: contextvars.ContextVar[list[str]] = contextvars.ContextVar("server_names")


def _note_server_name(_conn: Any, server_name: str | None, _ctx: ssl.SSLContext) -> None:
    noted = _SERVER_NAMES.get(None)
    if noted is not None and server_name:
        noted.append(server_name)


async def accept_tls(stream: trio.SSLStream[Any]) -> str | None:
    """The server side of ``stream``'s handshake; the server name the client asked for
    (SNI), None when it sent none (it connected by address)."""
    noted: list[str] = []
    token = _SERVER_NAMES.set(noted)
    try:
        await stream.do_handshake()
    finally:
        _SERVER_NAMES.reset(token)
    return noted[-1] if noted else None


def server_ssl_context(tls: DownstreamTls) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(tls.cert), str(tls.key))
    ctx.sni_callback = _note_server_name
    if tls.client_ca is not None:
        ctx.load_verify_locations(str(tls.client_ca))
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def upstream_ssl_context(tls: UpstreamTls) -> ssl.SSLContext:
    ctx = ssl.create_default_context(
        ssl.Purpose.SERVER_AUTH, cafile=str(tls.ca) if tls.ca else None
    )
    if not tls.verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if tls.cert is not None and tls.key is not None:
        ctx.load_cert_chain(str(tls.cert), str(tls.key))
    return ctx


class TlsContexts:
    """The contexts new connections use (``server``, ``client``: None without TLS on that
    side), rebuilt from their files by ``reload``."""

    def __init__(self, config: ProxyConfig) -> None:
        self.downstream = config.tls_downstream
        self.upstream = config.tls_upstream
        self.server, self.client = self._build()  # at start a bad file is fatal
        self.files = tuple(dict.fromkeys(
            path for tls in (self.downstream, self.upstream) if tls is not None
            for path in (getattr(tls, name, None) for name in ("cert", "key", "client_ca", "ca"))
            if isinstance(path, Path)))
        self.succeeded = 0
        self.failed = 0
        self.last_error: str | None = None
        self.listeners: list[Callable[[bool], None]] = []
        self._watch = FileWatch(self.files)

    def _build(self) -> tuple[ssl.SSLContext | None, ssl.SSLContext | None]:
        return (None if self.downstream is None else server_ssl_context(self.downstream),
                None if self.upstream is None else upstream_ssl_context(self.upstream))


    def changed(self) -> bool:
        """Whether a file changed since the last call (or the start)."""
        return self._watch.changed()

    def reload(self) -> bool:
        """New contexts from the files; on an error the old ones stay and it is logged."""
        if not self.files:
            return True  # no TLS: nothing to reload
        try:
            self.server, self.client = self._build()
        except (OSError, ssl.SSLError, ValueError) as exc:
            self.failed += 1
            self.last_error = str(exc)
            log_event(logger, logging.ERROR, "TLS reload failed: keeping the old "
                      "certificates", error=self.last_error,
                      files=", ".join(map(str, self.files)))
            for listener in self.listeners:
                listener(False)
            return False
        self.succeeded += 1
        self.last_error = None
        log_event(logger, logging.INFO, "TLS certificates reloaded",
                  files=", ".join(map(str, self.files)))
        for listener in self.listeners:
            listener(True)
        return True
