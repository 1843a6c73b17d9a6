"""SASL at the proxy: clients authenticated by the proxy itself (``sasl.downstream``,
termination) and the proxy authenticated to the brokers with its own credentials
(``sasl.upstream``, origination).

Termination: the client's SaslHandshake and SaslAuthenticate are answered here, against
a users file of SCRAM credentials (``SaslUsers``) or, for OAUTHBEARER, an identity
provider's public keys (``gatehouse.proxy.oauth``), and never reach the brokers; the user
the client proved it is becomes its principal, which rules, quotas, metrics and logs
use.  Until then the client may only ask for ApiVersions, as on a broker's SASL
listener.  Origination: each upstream connection authenticates right after it opens
(``authenticate_upstream``), before any client byte goes up.  The two combine: clients
prove who they are to the proxy, the brokers see the proxy's one identity.

Passwords, proofs and keys are never logged: the log says who failed and why in words.
"""

from __future__ import annotations

import hmac
import logging
import weakref
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache, partial
from pathlib import Path
from typing import Any, Protocol

import trio

from gatehouse import codecs
from gatehouse.codecs._error_codes import ERROR_NAMES
from gatehouse.codecs.sasl import (
    BEARER_ACKNOWLEDGE,
    bearer_message,
    claimed_user,
    parse_bearer_message,
)
from gatehouse.codecs.scram import (
    MECHANISMS,
    PLAIN,
    SCRAM_MECHANISMS,
    SaslCredentials,
    SaslError,
    ScramClient,
    ScramCredential,
    ScramServer,
    parse_plain,
    plain_token,
)
from gatehouse.configfile import (
    ConfigError,
    FileWatch,
    Reader,
    Source,
    line_of,
    load_yaml_file,
    take_password,
)
from gatehouse.logs import log_event
from gatehouse.proxy.kerberos import (
    GSSAPI,
    KerberosAcceptance,
    KerberosAcceptor,
    KerberosIdentity,
    KerberosLogin,
)
from gatehouse.proxy.oauth import (
    OAUTHBEARER,
    TokenRefused,
    TokenSource,
    TokenValidator,
    UnknownSigningKey,
)

logger = logging.getLogger("gatehouse.proxy")

SASL_HANDSHAKE, SASL_AUTHENTICATE = 17, 36
NONE, UNSUPPORTED_SASL_MECHANISM, ILLEGAL_SASL_STATE = 0, 33, 34
SASL_AUTHENTICATION_FAILED = 58
# What the client is told when its credentials are wrong: the same for an unknown user
# and a wrong password (Kafka's words), so answers do not tell which names exist.
FAILED_MESSAGE = "Authentication failed: Invalid username or password"
# Seconds a failed authentication's answer waits (Kafka's
# connection.failed.authentication.delay.ms, 100 ms by default).
FAILED_AUTHENTICATION_DELAY = 0.1


# -- the users file -------------------------------------------------------------------------


@dataclass(frozen=True)
class SaslUser:
    # Set when the file gives the password itself (password, password_file or
    # password_env); else only SCRAM credentials, and PLAIN is checked against them.
    password: str | None = field(default=None, repr=False)
    scram: dict[str, ScramCredential] = field(default_factory=dict, repr=False)
    written_in: bool = False  # the password is in the users file itself (``password:``)

    def same_secret(self, other: SaslUser | None) -> bool:
        """Whether ``other`` proves the same password (the SCRAM credentials made from a
        password get a new salt at every load, so a password is compared as such)."""
        if other is None:
            return False
        if self.password is not None or other.password is not None:
            return self.password == other.password
        return self.scram == other.scram


class Session(Protocol):
    """A connection authenticated by the proxy, which a reload may end."""

    @property
    def sasl_user(self) -> str | None: ...

    def revoke(self, reason: str) -> None: ...


def load_users(path: Path) -> dict[str, SaslUser]:
    """A users file (ConfigError with file:line if it is not one)::

        users:
          alice: {password_file: alice.secret}      # or password / password_env
          bob:                                      # as `gatehouse credential` prints
            SCRAM-SHA-512: {salt: ..., iterations: 4096, stored_key: ..., server_key: ...}
    """
    data = load_yaml_file(path)
    source = Source(str(path))
    top = Reader(data, source, "users file")
    raw = top.take("users", dict)
    if not raw:
        raise top.error("users" if top.has("users") else None,
                        "the users file needs 'users:', a mapping of user name to credentials")
    top.finish()
    base = path.parent
    users: dict[str, SaslUser] = {}
    for name, entry in raw.items():
        if not isinstance(name, str) or not name:
            raise source.error(f"a user name must be a string, not {name!r}", line_of(raw, name))
        reader = Reader(entry, source, f"users.{name}", line_of(raw, name))
        written_in = reader.has("password")
        password = take_password(reader, base)
        scram: dict[str, ScramCredential] = {}
        for key in list(reader.data):
            mechanism = str(key).upper()
            if mechanism not in SCRAM_MECHANISMS:
                continue
            section = reader.take(key, dict)
            try:
                scram[mechanism] = ScramCredential.from_dict(mechanism, dict(section))
            except ValueError as exc:
                raise reader.error(key, f"users.{name}.{key}: {exc}") from None
        reader.finish()
        if password is not None and scram:
            raise reader.error(None, f"users.{name}: give a password or SCRAM credentials, "
                               "not both")
        if password is None and not scram:
            raise reader.error(None, f"users.{name} needs a password (password, "
                               "password_file, password_env) or SCRAM credentials "
                               "(SCRAM-SHA-256, SCRAM-SHA-512: `gatehouse credential` "
                               "prints them)")
        if password is not None:
            scram = {m: _from_password(m, password) for m in SCRAM_MECHANISMS}
        users[name] = SaslUser(password, scram, written_in)
    return users


@lru_cache(maxsize=4096)
def _from_password(mechanism: str, password: str) -> ScramCredential:
    """A password's SCRAM credential, made once per process (PBKDF2 takes milliseconds):
    the config's check of the users file, the proxy's own load and each reload (on the
    event loop) find the unchanged passwords' credentials made."""
    return ScramCredential.from_password(mechanism, password)


class SaslUsers:
    """The users clients authenticate as, from a users file; ``reload`` reads it again
    (SIGHUP, or the file changed): a bad file keeps the users before it, and says so."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._users = load_users(path)  # at start a bad file is fatal
        self._watch = FileWatch((path,))
        # Connections authenticated by the proxy: a reload ends those whose user is gone
        # or has another password (revoked access does not wait for a reconnect).
        self.sessions: weakref.WeakSet[Session] = weakref.WeakSet()
        self.succeeded = 0
        self.failed = 0
        self.last_error: str | None = None

    def __len__(self) -> int:
        return len(self._users)

    def changed(self) -> bool:
        return self._watch.changed()

    def reload(self) -> bool:
        try:
            users = load_users(self.path)
        except ConfigError as exc:
            self.failed += 1
            self.last_error = str(exc)
            log_event(logger, logging.ERROR, "SASL users reload failed: keeping the old "
                      "users", error=self.last_error)
            return False
        before, self._users = self._users, users
        self.succeeded += 1
        self.last_error = None
        revoked = 0
        for session in list(self.sessions):
            name = session.sasl_user
            if name is None:
                continue
            old = before.get(name)
            if old is not None and old.same_secret(users.get(name)):
                continue
            gone = name not in users
            session.revoke(f"SASL user {name!r} " + ("removed from the users file" if gone
                                                     else "has new credentials"))
            self.sessions.discard(session)
            revoked += 1
        log_event(logger, logging.INFO, "SASL users reloaded", users=len(users),
                  file=str(self.path), connections_ended=revoked or None)
        return True

    def scram(self, mechanism: str, name: str) -> ScramCredential | None:
        user = self._users.get(name)
        return None if user is None else user.scram.get(mechanism)

    def check_plain(self, name: str, password: str) -> bool:
        """Whether ``password`` is ``name``'s.  Against SCRAM credentials this runs
        PBKDF2 (milliseconds): callers keep it off the event loop."""
        user = self._users.get(name)
        if user is None:
            return False
        if user.password is not None:
            return hmac.compare_digest(user.password.encode(), password.encode())
        credential = next(iter(user.scram.values()))
        return credential.check_password(password)


# -- one client's exchange with the proxy (termination) -------------------------------------


# The challenge that tells an OAUTHBEARER client its token was refused (RFC 7628 section
# 3.2.2, Kafka's words): the client answers with BEARER_ACKNOWLEDGE, and then fails.
_BEARER_REFUSED = b'{"status":"invalid_token"}'


class ClientSasl:
    """One client connection's SASL exchange with the proxy: ``handshake`` takes its
    SaslHandshake, ``step`` each of its tokens; ``user`` is set once it has proved who
    it is (with OAUTHBEARER, ``expires`` says until when).  ``claimed`` is the name it
    gave, for the log when it fails."""

    def __init__(self, users: SaslUsers | None, mechanisms: Sequence[str],
                 tokens: TokenValidator | None = None,
                 kerberos: KerberosAcceptor | None = None) -> None:
        self.users = users
        self.tokens = tokens
        self.kerberos = kerberos
        self._acceptance: KerberosAcceptance | None = None
        self.mechanisms = tuple(mechanisms)
        self.mechanism: str | None = None
        self.raw = False  # SaslHandshake v0: the tokens come with no Kafka header
        self.user: str | None = None
        self.claimed: str | None = None
        self.expires: float | None = None  # OAUTHBEARER: the token's exp (epoch seconds)
        self.reauthenticating = False  # KIP-368: a new exchange, the same user
        self._scram: ScramServer | None = None
        self._in_exchange = False
        self._bearer_refused: str | None = None  # why, once the client has been told

    def handshake(self, mechanism: str, version: int) -> int:
        """The error code for a SaslHandshake asking for ``mechanism``: the first one,
        or (KIP-368) one that re-authenticates an authenticated client, with the same
        mechanism and SaslHandshake v1."""
        if self._in_exchange:
            return ILLEGAL_SASL_STATE
        if self.user is not None:
            if version == 0 or mechanism != self.mechanism:
                return ILLEGAL_SASL_STATE  # Kafka: re-authentication keeps its mechanism
            self.reauthenticating = True
        elif self.mechanism is not None:
            return ILLEGAL_SASL_STATE
        if mechanism not in self.mechanisms:  # Kafka compares names exactly
            return UNSUPPORTED_SASL_MECHANISM
        self.mechanism = mechanism
        self.raw = version == 0
        self.claimed = None
        self._in_exchange = True
        self._bearer_refused = None
        self._scram = (ScramServer(mechanism, partial(self.users.scram, mechanism))
                       if mechanism in SCRAM_MECHANISMS and self.users is not None else None)
        if self._acceptance is not None:
            self._acceptance.close()
        self._acceptance = (KerberosAcceptance(self.kerberos)
                            if mechanism == GSSAPI and self.kerberos is not None else None)
        return NONE

    @property
    def slow_step(self) -> bool:
        """Whether the next ``step`` may run PBKDF2 (PLAIN checked against SCRAM
        credentials) or GSS-API (a replay cache on disk): the caller runs it in a
        thread."""
        return self.mechanism in (PLAIN, GSSAPI)

    def step(self, token: bytes) -> tuple[bytes, bool]:
        """The answer to a client token and whether the exchange is over (``user`` set);
        SaslError when it fails (the exchange is then over too)."""
        if self.mechanism is None:
            raise SaslError("SaslAuthenticate before a SaslHandshake")
        if not self._in_exchange:
            raise SaslError("already authenticated")
        if self.mechanism == OAUTHBEARER:
            return self._bearer_step(token)
        if self._acceptance is not None:
            return self._kerberos_step(self._acceptance, token)
        if self._scram is None:  # PLAIN
            assert self.users is not None
            user, password = parse_plain(token)
            self.claimed = user
            if not self.users.check_plain(user, password):
                self._in_exchange = False
                raise SaslError("invalid credentials")
            return b"", self._proved(user)
        scram = self._scram
        try:
            if scram.claimed is None:
                answer = scram.first(token)
                self.claimed = scram.claimed
                return answer, False
            answer = scram.final(token)
        except SaslError:
            self._in_exchange = False
            raise
        return answer, self._proved(scram.user)

    def _bearer_step(self, message: bytes) -> tuple[bytes, bool]:
        """OAUTHBEARER (RFC 7628, as Kafka's server): a good token ends the exchange; a
        refused one is answered with an error challenge, and the client's
        acknowledgement of it then fails the exchange.  UnknownSigningKey propagates
        with nothing changed, so the caller may fetch the keys again and retry."""
        assert self.tokens is not None
        if self._bearer_refused is not None:
            self._in_exchange = False
            if message != BEARER_ACKNOWLEDGE:
                raise SaslError(f"{self._bearer_refused} (and the client did not "
                                "acknowledge the refusal)")
            raise SaslError(self._bearer_refused)
        try:
            bearer = parse_bearer_message(message)
        except ValueError as exc:
            self._in_exchange = False
            raise SaslError(str(exc)) from None
        self.claimed = claimed_user(OAUTHBEARER, message, self.tokens.settings.principal_claim)
        try:
            verified = self.tokens.verify(bearer.token)
        except UnknownSigningKey:
            raise  # the caller's to retry after a fetch (before the wider clause below)
        except TokenRefused as exc:
            self._bearer_refused = str(exc)
            return _BEARER_REFUSED, False
        if bearer.authzid is not None and bearer.authzid != verified.principal:
            self._in_exchange = False
            raise SaslError(f"the client asks to act as {bearer.authzid!r} with a token of "
                            f"{verified.principal!r}")
        done = self._proved(verified.principal)
        self.expires = verified.expires
        return b"", done

    def _kerberos_step(self, acceptance: KerberosAcceptance, token: bytes
                       ) -> tuple[bytes, bool]:
        try:
            answer, done = acceptance.step(token)
        except SaslError:
            self._in_exchange = False
            acceptance.close()
            raise
        finally:
            self.claimed = acceptance.principal
        if not done:
            return answer, False
        acceptance.close()
        return answer, self._proved(acceptance.user)

    def refuse_unknown_key(self, refusal: UnknownSigningKey) -> tuple[bytes, bool]:
        """The answer to a token whose key id the keys lack even after a fetch: refused
        like any other bad token."""
        self._bearer_refused = str(refusal)
        return _BEARER_REFUSED, False

    def _proved(self, user: str | None) -> bool:
        """The exchange is over: the client is ``user`` (re-authenticating: again)."""
        self._in_exchange = False
        if self.reauthenticating and user != self.user:
            raise SaslError(f"re-authentication as {user!r} by a connection of "
                            f"{self.user!r} (a connection keeps its user)")
        self.user = user
        self.reauthenticating = False
        return True


def handshake_answer(req: codecs.Request, error_code: int,
                     mechanisms: Sequence[str]) -> codecs.Response:
    body = codecs.api(SASL_HANDSHAKE).response.root.cls(error_code=error_code,
                                                        mechanisms=tuple(mechanisms))
    return codecs.Response.build(SASL_HANDSHAKE, req.api_version, req.correlation_id, body)


def authenticate_answer(req: codecs.Request, token: bytes, error: str | None = None,
                        session_lifetime: float | None = None) -> codecs.Response:
    """A SaslAuthenticate answer: ``token`` for the client, or ``error`` (said in the
    answer's error message).  ``session_lifetime`` (seconds; v1+): when the client must
    have authenticated again (KIP-368); None: never."""
    fields: dict[str, Any] = {"auth_bytes": token}
    if session_lifetime is not None and error is None:
        fields["session_lifetime_ms"] = round(session_lifetime * 1000)
    if error is not None:
        fields.update(error_code=SASL_AUTHENTICATION_FAILED, error_message=error)
    body = codecs.api(SASL_AUTHENTICATE).response.root.cls(**fields)
    return codecs.Response.build(SASL_AUTHENTICATE, req.api_version, req.correlation_id, body)


# -- the proxy's own exchange with a broker (origination) -----------------------------------


async def roundtrip(stream: trio.abc.Stream, req: codecs.Request) -> codecs.Response:
    """``req`` sent and its answer read (decoded now, so errors surface here)."""
    frame = req.encode()
    await stream.send_all(len(frame).to_bytes(4, "big") + bytes(frame))
    reader = codecs.FrameReader()
    while True:
        answer = reader.next_frame()
        if answer is not None:
            resp = codecs.decode_response(answer, req.api_key, req.api_version)
            resp.body  # noqa: B018 - decode now, inside the caller's error handling
            return resp
        data = await stream.receive_some(65536)
        if not data:
            raise trio.BrokenResourceError("broker closed the connection")
        reader.feed(data)


# SaslHandshake v1 (tokens in SaslAuthenticate) and SaslAuthenticate v1 (it says how long
# the session lasts, and KIP-368 re-authentication needs it): what every broker since
# Kafka 2.2 takes, 4.x included.
_HANDSHAKE_VERSION, _AUTHENTICATE_VERSION = 1, 1
# Correlation ids of the proxy's own requests on a client's connection (re-authentication
# in the middle of its traffic): negative, never a client's.
_OWN_IDS = range(-2, -12, -1)

# One request of the proxy's own to the broker, answered (decoded).
Call = Callable[[codecs.Request], Awaitable[codecs.Response]]


UpstreamCredentials = SaslCredentials | TokenSource | KerberosIdentity


async def authenticate_upstream(call: Call, credentials: UpstreamCredentials, host: str
                                ) -> float | None:
    """Authenticate a connection to the broker at ``host`` as ``credentials`` say (a user
    and password, OAUTHBEARER tokens from a ``TokenSource``, or a Kerberos principal,
    whose ticket names the broker's host), each request sent and its
    answer read by ``call`` (a new connection's ``roundtrip``; an open one's line of
    requests when it re-authenticates, KIP-368); the seconds the broker gives the session
    (``connections.max.reauth.ms``), None for no limit.  SaslError says why the broker
    refused."""
    mechanism = credentials.mechanism
    ids = iter(_OWN_IDS)

    async def send(api_key: int, version: int, **fields: Any) -> Any:
        body = codecs.api(api_key).request.root.cls(**fields)
        req = codecs.Request.build(api_key, version, next(ids), "gatehouse", body)
        return (await call(req)).body

    answer = await send(SASL_HANDSHAKE, _HANDSHAKE_VERSION, mechanism=mechanism)
    if answer.error_code:
        offered = ", ".join(answer.mechanisms) or "none"
        raise SaslError(f"the broker does not take SASL {mechanism} (it offers {offered})")

    async def step(token: bytes) -> tuple[bytes, int]:
        body = await send(SASL_AUTHENTICATE, _AUTHENTICATE_VERSION, auth_bytes=token)
        if body.error_code:
            raise SaslError(f"the broker refused {credentials.username!r} ({mechanism}): "
                            f"{body.error_message or ERROR_NAMES.get(body.error_code, body.error_code)}")
        return bytes(body.auth_bytes), body.session_lifetime_ms

    if isinstance(credentials, KerberosIdentity):
        lifetime = await _kerberos_login(step, KerberosLogin(credentials, host))
    elif isinstance(credentials, TokenSource):
        challenge, lifetime = await step(bearer_message(await credentials.token()))
        if challenge:  # RFC 7628's error challenge: acknowledged, the broker then refuses
            await step(BEARER_ACKNOWLEDGE)
            raise SaslError(f"the broker refused the token of {credentials.username!r}")
    elif mechanism == PLAIN:
        _, lifetime = await step(plain_token(credentials.username, credentials.password))
    else:
        scram = ScramClient(mechanism, credentials.username, credentials.password)
        server_first, _ = await step(scram.first_message())
        server_final, lifetime = await step(scram.final_message(server_first))
        scram.check_final(server_final)
    return lifetime / 1000 if lifetime > 0 else None


async def _kerberos_login(step: Callable[[bytes], Awaitable[tuple[bytes, int]]],
                          login: KerberosLogin) -> int:
    """RFC 4752's exchange, each GSS-API call in a thread (they may ask the KDC); the
    session lifetime the broker's last answer gives."""
    try:
        token: bytes | None = await trio.to_thread.run_sync(login.first)
        lifetime = 0
        while token is not None:
            challenge, lifetime = await step(token)
            token = await trio.to_thread.run_sync(login.step, challenge)
        return lifetime
    finally:
        login.close()


__all__ = [
    "MECHANISMS",
    "ClientSasl",
    "SaslError",
    "SaslUser",
    "SaslUsers",
    "Session",
    "UpstreamCredentials",
    "authenticate_answer",
    "authenticate_upstream",
    "handshake_answer",
    "load_users",
    "roundtrip",
]
