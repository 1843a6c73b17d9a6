"""SASL PLAIN and SCRAM (RFC 4616, 5802, 7677) as Kafka speaks them, both sides (pure).

Sans-I/O like the rest of ``codecs``: each side turns the peer's token into its own.
The client (``ScramClient``) is what the proxy uses to authenticate to brokers
(``sasl.upstream``) and what the observation log's Kafka sink uses; the server
(``ScramServer``, ``check_plain``) is what it uses to authenticate clients itself
(``sasl.downstream``).  Credentials are stored as Kafka stores SCRAM credentials (salt,
iterations, StoredKey, ServerKey: ``ScramCredential``), never as passwords.

As Kafka does: no channel binding ("n,," or "y,,"), an authorization id only if it is
the user name, no extensions (``tokenauth``: delegation tokens are the brokers').
Nothing here logs, and no error text holds a password, a proof or a key.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

PLAIN = "PLAIN"
SCRAM_MECHANISMS = ("SCRAM-SHA-256", "SCRAM-SHA-512")
MECHANISMS = (PLAIN, *SCRAM_MECHANISMS)
# Kafka's floor for SCRAM iterations (ScramMechanism.minIterations) and kafka-configs'
# default; the ceiling keeps a hostile server from making a client spin.
MIN_ITERATIONS = 4096
MAX_ITERATIONS = 1_000_000
DEFAULT_ITERATIONS = 4096


class SaslError(Exception):
    """Authentication failed or a token is not what the mechanism says.  The message
    names what went wrong, never a password or proof."""


def _hash_name(mechanism: str) -> str:
    if mechanism == "SCRAM-SHA-256":
        return "sha256"
    if mechanism == "SCRAM-SHA-512":
        return "sha512"
    raise ValueError(f"not a SCRAM mechanism: {mechanism!r}")


def _hmac(hash_name: str, key: bytes, message: bytes) -> bytes:
    return hmac.new(key, message, hash_name).digest()


def _keys(hash_name: str, password: bytes, salt: bytes, iterations: int
          ) -> tuple[bytes, bytes, bytes]:
    """(ClientKey, StoredKey, ServerKey) of a password (RFC 5802: one PBKDF2 run)."""
    salted = hashlib.pbkdf2_hmac(hash_name, password, salt, iterations)
    client_key = _hmac(hash_name, salted, b"Client Key")
    return (client_key, hashlib.new(hash_name, client_key).digest(),
            _hmac(hash_name, salted, b"Server Key"))


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise SaslError(f"{what} is not base64") from None


# -- credentials ----------------------------------------------------------------------------


@dataclass(frozen=True)
class SaslCredentials:
    """What a client side authenticates with."""

    mechanism: str
    username: str
    password: str = field(repr=False)


@dataclass(frozen=True)
class ScramCredential:
    """A user's SCRAM credential for one mechanism, as Kafka keeps it: the password
    itself cannot be had back from it."""

    mechanism: str
    salt: bytes = field(repr=False)
    iterations: int
    stored_key: bytes = field(repr=False)
    server_key: bytes = field(repr=False)

    @classmethod
    def from_password(cls, mechanism: str, password: str, *, salt: bytes | None = None,
                      iterations: int = DEFAULT_ITERATIONS) -> ScramCredential:
        salt = secrets.token_bytes(32) if salt is None else salt
        _, stored_key, server_key = _keys(_hash_name(mechanism), password.encode("utf-8"),
                                          salt, iterations)
        return cls(mechanism, salt, iterations, stored_key, server_key)

    def check_password(self, password: str) -> bool:
        """Whether ``password`` is the one this credential was made from (one PBKDF2 run:
        milliseconds, so callers keep it off an event loop)."""
        other = ScramCredential.from_password(self.mechanism, password, salt=self.salt,
                                              iterations=self.iterations)
        return hmac.compare_digest(other.stored_key, self.stored_key)

    def as_dict(self) -> dict[str, str | int]:
        """The form a users file holds (``gatehouse credential`` prints it)."""
        return {"salt": _b64(self.salt), "iterations": self.iterations,
                "stored_key": _b64(self.stored_key), "server_key": _b64(self.server_key)}

    @classmethod
    def from_dict(cls, mechanism: str, data: dict[str, object]) -> ScramCredential:
        """The inverse of ``as_dict``; ValueError says which part is wrong."""
        hash_name = _hash_name(mechanism)
        size = hashlib.new(hash_name).digest_size
        iterations = data.get("iterations")
        if not isinstance(iterations, int) or isinstance(iterations, bool) or not (
                MIN_ITERATIONS <= iterations <= MAX_ITERATIONS):
            raise ValueError(f"iterations must be a whole number from {MIN_ITERATIONS} to "
                             f"{MAX_ITERATIONS}, not {iterations!r}")
        parts: dict[str, bytes] = {}
        for key in ("salt", "stored_key", "server_key"):
            value = data.get(key)
            try:
                parts[key] = base64.b64decode(str(value), validate=True)
            except (binascii.Error, ValueError):
                raise ValueError(f"{key} must be base64, not {value!r}") from None
            if key != "salt" and len(parts[key]) != size:
                raise ValueError(f"{key} must be {size} bytes for {mechanism} "
                                 f"(base64 of a {hash_name} digest)")
        if not parts["salt"]:
            raise ValueError("salt must not be empty")
        extra = set(data) - {"salt", "iterations", "stored_key", "server_key"}
        if extra:
            raise ValueError(f"unknown key(s): {', '.join(sorted(extra))}")
        return cls(mechanism, parts["salt"], iterations, parts["stored_key"],
                   parts["server_key"])


# -- PLAIN ----------------------------------------------------------------------------------


def plain_token(username: str, password: str) -> bytes:
    return b"\x00" + username.encode() + b"\x00" + password.encode()


def parse_plain(token: bytes) -> tuple[str, str]:
    """(user, password) from a PLAIN client message: ``[authzid] NUL authcid NUL passwd``.
    An authorization id other than the user is refused, as Kafka does."""
    parts = token.split(b"\x00")
    if len(parts) != 3 or not parts[1] or not parts[2]:
        raise SaslError("not a PLAIN client message (authzid NUL user NUL password)")
    try:
        authzid, user, password = (p.decode("utf-8") for p in parts)
    except UnicodeDecodeError:
        raise SaslError("the PLAIN client message is not UTF-8") from None
    if authzid and authzid != user:
        raise SaslError("the authorization id is not the user name")
    return user, password


# -- SCRAM ----------------------------------------------------------------------------------


def _attributes(text: str) -> list[tuple[str, str]]:
    out = []
    for part in text.split(","):
        name, sep, value = part.partition("=")
        if not sep or len(name) != 1:
            raise SaslError("a SCRAM message part is not name=value")
        out.append((name, value))
    return out


def _scram_attrs(text: str) -> dict[str, str]:
    """The attributes of a SCRAM message, leniently (the client reads the server's)."""
    out = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        if sep and len(name) == 1:
            out[name] = value
    return out


def _saslname(name: str) -> str:
    """A user name as SCRAM writes it (``=`` and ``,`` escaped)."""
    return name.replace("=", "=3D").replace(",", "=2C")


def _from_saslname(text: str) -> str:
    if "=" in text.replace("=3D", "").replace("=2C", ""):
        raise SaslError("the SCRAM user name has a bad escape")
    return text.replace("=2C", ",").replace("=3D", "=")


class ScramClient:
    """The client side of SCRAM as Kafka uses it: no channel binding."""

    def __init__(self, mechanism: str, username: str, password: str,
                 nonce: str | None = None) -> None:
        self.hash = _hash_name(mechanism)
        self.password = password.encode()
        self.nonce = nonce or secrets.token_urlsafe(24)
        self.first_bare = f"n={_saslname(username)},r={self.nonce}"
        self._server_signature = b""

    def first_message(self) -> bytes:
        return ("n,," + self.first_bare).encode()

    def final_message(self, server_first: bytes) -> bytes:
        text = server_first.decode("utf-8", "replace")
        attrs = _scram_attrs(text)
        nonce, salt, iterations = attrs.get("r", ""), attrs.get("s"), attrs.get("i", "")
        if not nonce.startswith(self.nonce) or salt is None or not iterations.isdigit():
            raise SaslError("the server's SCRAM challenge is not valid")
        if not 0 < int(iterations) <= MAX_ITERATIONS:
            raise SaslError(f"the server asks for {iterations} SCRAM iterations")
        client_key, stored_key, server_key = _keys(self.hash, self.password,
                                                   _unb64(salt, "the salt"), int(iterations))
        without_proof = f"c=biws,r={nonce}"  # biws: base64 of "n,," (no channel binding)
        auth_message = f"{self.first_bare},{text},{without_proof}".encode()
        signature = _hmac(self.hash, stored_key, auth_message)
        proof = bytes(a ^ b for a, b in zip(client_key, signature, strict=True))
        self._server_signature = _hmac(self.hash, server_key, auth_message)
        return f"{without_proof},p={_b64(proof)}".encode()

    def check_final(self, server_final: bytes) -> None:
        attrs = _scram_attrs(server_final.decode("utf-8", "replace"))
        if "e" in attrs:
            raise SaslError(f"SCRAM authentication failed: {attrs['e']}")
        given = base64.b64decode(attrs.get("v", ""))
        if not hmac.compare_digest(given, self._server_signature):
            raise SaslError("the server's SCRAM signature does not match (not the real server?)")


class ScramServer:
    """The server side of one SCRAM exchange: ``first`` answers the client-first
    message, ``final`` checks the client's proof and answers with the server's
    signature; ``user`` is who the client is once ``final`` has returned.

    ``lookup(user)`` gives the user's credential for this mechanism, or None.  An unknown
    user gets a made-up challenge and fails at the proof, like a wrong password: the
    answers do not tell which names exist."""

    def __init__(self, mechanism: str, lookup: Callable[[str], ScramCredential | None],
                 nonce: str | None = None) -> None:
        self.mechanism = mechanism
        self.hash = _hash_name(mechanism)
        self.lookup = lookup
        self.nonce = nonce or secrets.token_urlsafe(24)
        self.user: str | None = None  # set once the proof checks
        self.claimed: str | None = None  # the name in the client-first message
        self._credential: ScramCredential | None = None
        self._gs2 = ""
        self._auth_start = ""  # client-first-bare "," server-first
        self._combined_nonce = ""

    def first(self, client_first: bytes) -> bytes:
        try:
            text = client_first.decode("utf-8")
        except UnicodeDecodeError:
            raise SaslError("the SCRAM client-first message is not UTF-8") from None
        flag, sep1, rest = text.partition(",")
        authzid, sep2, bare = rest.partition(",")
        if not (sep1 and sep2) or flag not in ("n", "y"):
            raise SaslError("the SCRAM client-first message must start with n,, "
                            "(channel binding is not supported)")
        parts = bare.split(",")
        attrs = _attributes(",".join(parts[:2]))
        if len(attrs) < 2 or attrs[0][0] != "n" or attrs[1][0] != "r" or not attrs[1][1]:
            raise SaslError("the SCRAM client-first message must be n=user,r=nonce")
        user = _from_saslname(attrs[0][1])
        if not user:
            raise SaslError("the SCRAM user name is empty")
        if parts[2:]:
            # Kafka's extensions (tokenauth=true: a delegation token) are the brokers'.
            raise SaslError("SCRAM extensions (delegation tokens) are not supported")
        if authzid and (not authzid.startswith("a=") or _from_saslname(authzid[2:]) != user):
            raise SaslError("the authorization id is not the user name")
        self.claimed = user
        credential = self.lookup(user)
        if credential is None:
            # Made up, so an unknown name looks like any other until the proof fails.
            credential = ScramCredential(self.mechanism, secrets.token_bytes(32),
                                         DEFAULT_ITERATIONS, b"", b"")
        self._credential = credential
        self._gs2 = f"{flag},{authzid},"
        self._combined_nonce = attrs[1][1] + self.nonce
        server_first = (f"r={self._combined_nonce},s={_b64(credential.salt)},"
                        f"i={credential.iterations}")
        self._auth_start = f"{bare},{server_first}"
        return server_first.encode()

    def final(self, client_final: bytes) -> bytes:
        credential = self._credential
        if credential is None:
            raise SaslError("a SCRAM client-final message before the client-first")
        try:
            text = client_final.decode("utf-8")
        except UnicodeDecodeError:
            raise SaslError("the SCRAM client-final message is not UTF-8") from None
        without_proof, sep, proof_text = text.rpartition(",p=")
        if not sep:
            raise SaslError("the SCRAM client-final message has no proof")
        attrs = dict(_attributes(without_proof))
        if attrs.get("c") != _b64(self._gs2.encode()):
            raise SaslError("the SCRAM channel binding does not match the client-first message")
        if attrs.get("r") != self._combined_nonce:
            raise SaslError("the SCRAM nonce does not match")
        proof = _unb64(proof_text, "the SCRAM proof")
        auth_message = f"{self._auth_start},{without_proof}".encode()
        signature = _hmac(self.hash, credential.stored_key or b"\0", auth_message)
        if len(proof) != len(signature):
            raise SaslError("invalid credentials")
        client_key = bytes(a ^ b for a, b in zip(proof, signature, strict=True))
        if not credential.stored_key or not hmac.compare_digest(
                hashlib.new(self.hash, client_key).digest(), credential.stored_key):
            raise SaslError("invalid credentials")
        self.user = self.claimed
        return f"v={_b64(_hmac(self.hash, credential.server_key, auth_message))}".encode()
