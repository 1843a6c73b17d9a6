"""The user name a SASL client claims, read from its first token (pure).

The proxy passes authentication through; the broker decides.  Once the broker accepts
the exchange (a SaslAuthenticate answer with no error), the name the client claimed is
the one it authenticated as, and rules may match on it (``match: {principal: ...}``):
unlike the client id, a client cannot choose it without the password.

Only the name is read.  The password (PLAIN) and the proofs (SCRAM) are neither kept
nor returned, and nothing here logs.
"""

from __future__ import annotations

PLAIN = "PLAIN"
SCRAM = ("SCRAM-SHA-256", "SCRAM-SHA-512")


def claimed_user(mechanism: str | None, token: bytes | memoryview) -> str | None:
    """The user name in a client's first SASL token for ``mechanism`` (PLAIN: the
    authentication id; SCRAM: the client-first message's ``n=``); None for other
    mechanisms (GSSAPI, OAUTHBEARER: the broker derives those principals itself) and
    for tokens that are not what the mechanism says."""
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
    except UnicodeDecodeError:
        return None
    return None
