"""The user name a SASL client claims, read from its first token (pure).

The proxy passes authentication through; the broker decides.  Once the broker accepts
the exchange (a SaslAuthenticate answer with no error), the name the client claimed is
the one it authenticated as, and rules may match on it (``match: {principal: ...}``):
unlike the client id, a client cannot choose it without the password.

Only the name is read.  The password (PLAIN) and the proofs (SCRAM) are neither kept
nor returned, and nothing here logs.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass, field

PLAIN = "PLAIN"
SCRAM = ("SCRAM-SHA-256", "SCRAM-SHA-512")
OAUTHBEARER = "OAUTHBEARER"


def claimed_user(mechanism: str | None, token: bytes | memoryview,
                 claim: str = "sub") -> str | None:
    """The user name in a client's first SASL token for ``mechanism`` (PLAIN: the
    authentication id; SCRAM: the client-first message's ``n=``; OAUTHBEARER: the
    ``claim`` of its JSON Web Token, which the broker's validator checks and takes as
    the principal: ``sub`` unless the broker's ``sasl.oauthbearer.sub.claim.name`` says
    otherwise); None for other mechanisms (GSSAPI: the broker maps
    Kerberos names itself) and for tokens that are not what the mechanism says."""
    if mechanism is None:
        return None
    mechanism = mechanism.upper()
    data = bytes(token)
    try:
        if mechanism == PLAIN:
            # [authzid] NUL authcid NUL passwd (RFC 4616)
            parts = data.split(b"\0")
            if len(parts) != 3 or not parts[1]:
                return None
            return parts[1].decode("utf-8")
        if mechanism in SCRAM:
            # gs2-header ("n,," or "y,," or "n,a=authzid,") then "n=user,r=nonce" (RFC 5802)
            fields = data.decode("utf-8").split(",")
            if len(fields) < 4 or fields[0] not in ("n", "y") or not fields[2].startswith("n="):
                return None
            name = fields[2][2:]
            if not name:
                return None
            return name.replace("=2C", ",").replace("=3D", "=")
        if mechanism == OAUTHBEARER:
            return _bearer_subject(data, claim)
    except UnicodeDecodeError:
        return None
    return None


@dataclass(frozen=True)
class BearerMessage:
    """An OAUTHBEARER client's first message (RFC 7628 section 3.1), read for a proxy
    that validates the token itself."""

    token: str = field(repr=False)
    authzid: str | None = None  # the identity it asks to act as ("a=" in the gs2 header)
    extensions: dict[str, str] = field(default_factory=dict)  # SASL extensions (KIP-342)


# RFC 7628: key = 1*(ALPHA); value = *(VCHAR / SP / HTAB / CR / LF); the token is b64token
# (RFC 6750: letters, digits and -._~+/ then any '=' padding).
_KEY = re.compile(r"[A-Za-z]+")
_VALUE = re.compile(r"[\x21-\x7e \t\r\n]*")
_TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")
# What a client sends after it has been told its token is bad (RFC 7628 section 3.2.3).
BEARER_ACKNOWLEDGE = b"\x01"


def bearer_message(token: str, authzid: str | None = None, **extensions: str) -> bytes:
    """A client's first OAUTHBEARER message for ``token``, as Kafka's clients write it."""
    header = "n,," if authzid is None else f"n,a={authzid.replace('=', '=3D').replace(',', '=2C')},"
    pairs = "".join(f"\x01{key}={value}" for key, value in extensions.items())
    return f"{header}\x01auth=Bearer {token}{pairs}\x01\x01".encode("ascii")


def parse_bearer_message(data: bytes) -> BearerMessage:
    """The client's first OAUTHBEARER message (``gs2-header \x01 auth=Bearer <token>
    \x01 [key=value \x01]... \x01``); ValueError naming what is wrong (never the
    token) if it is not one."""
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise ValueError("the OAUTHBEARER message is not ASCII") from None
    header, sep, rest = text.partition("\x01")
    parts = header.split(",")
    if not sep or len(parts) != 3 or parts[0] not in ("n", "y") or parts[2]:
        raise ValueError("the OAUTHBEARER message does not begin with a gs2 header "
                         "('n,,' or 'n,a=NAME,')")
    authzid = None
    if parts[1]:
        if not parts[1].startswith("a=") or len(parts[1]) == 2:
            raise ValueError("the OAUTHBEARER gs2 header's authorization id is malformed")
        authzid = parts[1][2:].replace("=2C", ",").replace("=3D", "=")
    if not rest.endswith("\x01\x01"):
        raise ValueError("the OAUTHBEARER message does not end with two \\x01")
    token: str | None = None
    extensions: dict[str, str] = {}
    for pair in rest[:-2].split("\x01"):
        key, eq, value = pair.partition("=")
        if not eq or not _KEY.fullmatch(key) or not _VALUE.fullmatch(value):
            raise ValueError("the OAUTHBEARER message holds a malformed key=value pair")
        if key in extensions or (key == "auth" and token is not None):
            raise ValueError(f"the OAUTHBEARER message gives {key!r} twice")
        if key != "auth":
            extensions[key] = value
            continue
        scheme, _, token = value.partition(" ")
        if scheme.lower() != "bearer" or not _TOKEN.fullmatch(token):
            raise ValueError("the OAUTHBEARER message's auth is not 'Bearer <token>'")
    if token is None:
        raise ValueError("the OAUTHBEARER message has no auth=Bearer token")
    return BearerMessage(token, authzid, extensions)


def _bearer_subject(data: bytes, claim: str) -> str | None:
    """The ``claim`` claim of the JWT in an OAUTHBEARER client message (RFC 7628:
    gs2-header, then ``\x01``-separated key=value pairs, ``auth=Bearer <token>``)."""
    for pair in data.split(b"\x01")[1:]:
        if not pair.startswith(b"auth="):
            continue
        scheme, _, token = pair[5:].decode("ascii").partition(" ")
        parts = token.strip().split(".")
        if scheme.lower() != "bearer" or len(parts) != 3:
            return None
        payload = parts[1] + "=" * (-len(parts[1]) % 4)
        try:
            claims = json.loads(base64.urlsafe_b64decode(payload))
        except (binascii.Error, ValueError):
            return None
        subject = claims.get(claim) if isinstance(claims, dict) else None
        return subject if isinstance(subject, str) and subject else None
    return None
