"""The client-side TLS context for connections to the brokers (``tls.upstream``).

One definition for everything that connects to the upstream cluster: the proxy's broker
connections and the capture's Kafka sink.
"""

from __future__ import annotations

import ssl

from gatehouse.proxy.config import UpstreamTls


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
