"""TLS for the proxy: the client-side context for connections to the brokers
(``tls.upstream``), and the principal a client's verified certificate names.

One definition of the upstream context for everything that connects to the upstream
cluster: the proxy's broker connections and the capture's Kafka sink.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from typing import Any, Final

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


# The attribute keywords of RFC 4514 (and RFC 2253 before it), by the names Python's ssl
# module gives them (OpenSSL's long names).  Others keep those names.
_KEYWORDS: Final = {
    "commonName": "CN",
    "localityName": "L",
    "stateOrProvinceName": "ST",
    "organizationName": "O",
    "organizationalUnitName": "OU",
    "countryName": "C",
    "streetAddress": "STREET",
    "domainComponent": "DC",
    "userId": "UID",
}
_ESCAPED: Final = frozenset(',+"\\<>;')


def certificate_principal(cert: Mapping[str, Any] | None) -> str | None:
    """The subject of a verified client certificate (``SSLObject.getpeercert()``) as a
    distinguished name, the way Kafka's default principal builder writes an SSL client's
    (``X500Principal.getName()``, RFC 2253): most specific part first
    (``CN=app,OU=team-a,O=corp``), values escaped, several attributes of one part joined
    by ``+``.  None without a certificate or with an empty subject."""
    subject = (cert or {}).get("subject") or ()
    parts = ["+".join(f"{_KEYWORDS.get(name, name)}={_escape(value)}" for name, value in rdn)
             for rdn in reversed(subject)]
    return ",".join(parts) or None


def _escape(value: str) -> str:
    out = "".join(f"\\{c}" if c in _ESCAPED else "\\00" if c == "\0" else c for c in value)
    if len(value) > 1 and value.endswith(" "):
        out = out[:-1] + "\\ "
    return "\\" + out if value.startswith(("#", " ")) else out
