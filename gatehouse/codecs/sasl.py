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
