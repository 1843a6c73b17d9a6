"""OAUTHBEARER at the proxy.

Termination (``sasl.downstream.oauthbearer``): clients log in with a JSON
Web Token that the proxy checks itself, against the identity provider's public keys (a
JWKS, from a file or a URL), as a broker's ``sasl.oauthbearer.jwks.endpoint.url``
validator does: signature, ``exp`` and ``iat`` present and in date (with a clock skew),
issuer and audience if configured, and the principal claim (``sub`` unless
``sasl.oauthbearer_sub_claim_name`` says otherwise), which becomes the client's
principal.  A session lasts no longer than its token.

Origination (``sasl.upstream`` with ``mechanism: OAUTHBEARER``): the proxy logs in to
the brokers with a token of its own, from the identity provider's token endpoint (the
client credentials grant, RFC 6749 section 4.4, as Kafka's
``sasl.oauthbearer.token.endpoint.url`` login) or from a file something else keeps
fresh (``TokenSource``).

Tokens and secrets are never logged: the log says which check failed.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import math
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeGuard

import trio

from gatehouse.codecs.scram import MECHANISMS, SaslCredentials, SaslError
from gatehouse.configfile import (
    ConfigError,
    FileWatch,
    Reader,
    Source,
    read_sasl_credentials,
    take_password,
)
from gatehouse.logs import log_event
from gatehouse.proxy.awsiam import EXTRA_HINT, msk_iam_token, signer_installed
from gatehouse.proxy.kerberos import (
    DEFAULT_SERVICE_NAME,
    GSSAPI,
    KerberosCredentials,
    gssapi_library,
    keytab_principals,
)

logger = logging.getLogger("gatehouse.proxy")

OAUTHBEARER: Final = "OAUTHBEARER"
# The signature algorithms each kind of public key verifies (RFC 7518, RFC 8037).  No
# "none", no HMAC: a JWKS is public, so a key in it must not be able to sign.
_ALGORITHMS: Final[dict[str, tuple[str, ...]]] = {
    "RSA": ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512"),
    "EC": ("ES256", "ES384", "ES512", "ES256K"),
    "OKP": ("EdDSA",),
}
_CURVES: Final = {"P-256": "ES256", "P-384": "ES384", "P-521": "ES512", "secp256k1": "ES256K"}
# A JWKS URL is fetched for a token whose key id it lacks (a provider's new key) at most
# this often, so tokens with made-up ids cannot make the proxy hammer the provider.
MIN_REFETCH_SECONDS: Final = 10.0
FETCH_TIMEOUT_SECONDS: Final = 10.0
MAX_JWKS_BYTES: Final = 1024 * 1024


@dataclass(frozen=True)
class OAuthSettings:
    """``sasl.downstream.oauthbearer``: where the signing keys are and what a token must
    say (the brokers' ``sasl.oauthbearer.*`` settings of the same names)."""

    jwks_file: Path | None = None
    jwks_url: str | None = None
    jwks_refresh: float = 3600.0  # seconds between fetches of jwks_url
    expected_issuer: str | None = None
    expected_audience: tuple[str, ...] = ()  # any one of them; empty: not checked
    principal_claim: str = "sub"
    clock_skew: float = 30.0

    @property
    def jwks_source(self) -> str:
        return str(self.jwks_file) if self.jwks_file is not None else str(self.jwks_url)


@dataclass(frozen=True)
class VerifiedToken:
    principal: str
    expires: float  # seconds since the epoch: the token's exp


class TokenRefused(SaslError):
    """The token failed a check; the message says which, never the token."""


class UnknownSigningKey(TokenRefused):
    """No key of the JWKS has the token's key id (the provider may have a new one)."""


@dataclass(frozen=True)
class _Key:
    # The key as PyJWT verifies it, once per algorithm it may sign with (a PyJWK
    # verifies with its own algorithm, whatever the token's header says).
    by_algorithm: dict[str, Any]

    @property
    def algorithms(self) -> tuple[str, ...]:
        return tuple(self.by_algorithm)


class SigningKeys:
    """The public keys of a JWKS document, by key id."""

    def __init__(self, keys: Sequence[tuple[str | None, _Key]] = ()) -> None:
        self._by_id: dict[str | None, list[_Key]] = {}
        for kid, key in keys:
            self._by_id.setdefault(kid, []).append(key)
        self.count = len(keys)

    def for_token(self, kid: str | None, algorithm: str) -> list[_Key]:
        """The keys that may have signed a token with this header and verify its
        algorithm: those with its key id and those without one (a token without one:
        every key)."""
        if kid is None:
            found = [k for keys in self._by_id.values() for k in keys]
        else:
            found = self._by_id.get(kid, []) + self._by_id.get(None, [])
        return [k for k in found if algorithm in k.algorithms]

    def has_id(self, kid: str | None) -> bool:
        """Whether a token naming ``kid`` has keys to try (keys without an id count)."""
        return kid is None or kid in self._by_id or None in self._by_id


def parse_jwks(data: bytes, source: str) -> SigningKeys:
    """A JWKS document's signing keys (``{"keys": [...]}``, RFC 7517); ConfigError with
    the source (and the line, for bad JSON) if it is not one or holds a key that could
    not be used (a secret key, an unknown type)."""
    import jwt  # PyJWT; imported here so configs without OAUTHBEARER do not load it

    src = Source(source)
    try:
        document = json.loads(data)
    except UnicodeDecodeError:
        raise src.error("the JWKS is not UTF-8 text", None) from None
    except json.JSONDecodeError as exc:
        raise src.error(f"the JWKS is not JSON: {exc.msg}", exc.lineno) from None
    entries = document.get("keys") if isinstance(document, dict) else None
    if not isinstance(entries, list):
        raise src.error('the JWKS needs "keys": a list of keys (RFC 7517)', None)
    keys: list[tuple[str | None, _Key]] = []
    for i, entry in enumerate(entries):
        where = f"keys[{i}]"
        if not isinstance(entry, dict):
            raise src.error(f"{where} is not a JSON object", None)
        if entry.get("use", "sig") != "sig":
            continue  # an encryption key: signs nothing
        kty = entry.get("kty")
        if kty == "oct":
            raise src.error(f"{where} is a secret (oct) key: a JWKS is public, and a key "
                            "anyone can read must not be able to sign tokens", None)
        if kty not in _ALGORITHMS:
            raise src.error(f"{where}: key type {kty!r} is not one of "
                            f"{', '.join(_ALGORITHMS)}", None)
        algorithms = _ALGORITHMS[kty]
        if kty == "EC" and entry.get("crv") in _CURVES:
            algorithms = (_CURVES[entry["crv"]],)
        alg = entry.get("alg")
        if alg is not None:
            if alg not in algorithms:
                raise src.error(f"{where}: algorithm {alg!r} does not go with a {kty} key "
                                f"(one of {', '.join(algorithms)})", None)
            algorithms = (alg,)
        try:
            key = _Key({algorithm: jwt.PyJWK(entry, algorithm) for algorithm in algorithms})
        except (jwt.PyJWKError, jwt.InvalidKeyError, ValueError, TypeError, KeyError) as exc:
            raise src.error(f"{where} is not a usable {kty} key: {exc}", None) from None
        kid = entry.get("kid")
        keys.append((kid if isinstance(kid, str) else None, key))
    if not keys:
        raise src.error("the JWKS holds no signing key", None)
    return SigningKeys(keys)


def _fetch(url: str) -> bytes:
    """The document at ``url`` (blocking: run in a thread)."""
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    with urllib.request.urlopen(request, timeout=FETCH_TIMEOUT_SECONDS) as answer:
        data: bytes = answer.read(MAX_JWKS_BYTES + 1)
    if len(data) > MAX_JWKS_BYTES:
        raise ValueError(f"the answer is larger than {MAX_JWKS_BYTES} bytes")
    return data


class TokenValidator:
    """Checks OAUTHBEARER tokens against the signing keys of a JWKS: a file (read again
    when it changes, or on SIGHUP: a bad file keeps the keys before it) or a URL
    (fetched at start, every ``jwks_refresh`` seconds and for a token whose key id it
    lacks; a failed fetch keeps the keys before it, and says so)."""

    def __init__(self, settings: OAuthSettings) -> None:
        self.settings = settings
        self.keys = SigningKeys()
        self.last_error: str | None = None
        self.fetches = self.failed_fetches = 0
        # Told whether each load of the keys (a reload, a fetch) worked: the metrics.
        self.listeners: list[Callable[[bool], None]] = []
        self._watch: FileWatch | None = None
        if settings.jwks_file is not None:
            self.keys = load_jwks_file(settings.jwks_file)  # at start a bad file is fatal
            self._watch = FileWatch((settings.jwks_file,))
        self._refetched_at = -math.inf  # the last fetch for an unknown key id
        self._fetch_lock = trio.Lock()
        self._wake = trio.Event()

    # -- the keys -----------------------------------------------------------------------

    def changed(self) -> bool:
        return self._watch is not None and self._watch.changed()

    def reload(self) -> bool:
        """The file read again (a URL: fetched again soon, by ``keep_fresh``)."""
        if self.settings.jwks_file is None:
            self._wake.set()
            return True
        try:
            keys = load_jwks_file(self.settings.jwks_file)
        except ConfigError as exc:
            self.last_error = str(exc)
            log_event(logger, logging.ERROR, "JWKS reload failed: keeping the old keys",
                      error=self.last_error)
            return self._loaded(False)
        self.keys, self.last_error = keys, None
        log_event(logger, logging.INFO, "JWKS reloaded", keys=keys.count,
                  file=str(self.settings.jwks_file))
        return self._loaded(True)

    def _loaded(self, ok: bool) -> bool:
        for listener in self.listeners:
            listener(ok)
        return ok

    async def fetch(self) -> bool:
        """``jwks_url`` fetched now (off the event loop); whether the keys were taken."""
        url = self.settings.jwks_url
        assert url is not None
        async with self._fetch_lock:
            self.fetches += 1
            try:
                data = await trio.to_thread.run_sync(_fetch, url, abandon_on_cancel=True)
                keys = parse_jwks(data, url)
            except (OSError, ValueError, ConfigError) as exc:
                self.failed_fetches += 1
                self.last_error = f"{url}: {exc}"
                log_event(logger, logging.ERROR, "JWKS fetch failed: keeping the keys "
                          "before it" if self.keys.count else "JWKS fetch failed: no keys, "
                          "OAUTHBEARER clients are refused", url=url, error=str(exc))
                return self._loaded(False)
            first = self.keys.count == 0
            self.keys, self.last_error = keys, None
            log_event(logger, logging.INFO if first else logging.DEBUG, "JWKS fetched",
                      url=url, keys=keys.count)
            return self._loaded(True)

    async def fetch_for_unknown_key(self) -> bool:
        """A token named a key id the keys lack: fetch again, unless a fetch for that
        reason was made in the last MIN_REFETCH_SECONDS; whether the keys are new."""
        if self.settings.jwks_url is None:
            return False
        now = trio.current_time()
        if now - self._refetched_at < MIN_REFETCH_SECONDS:
            return False
        self._refetched_at = now
        return await self.fetch()

    async def keep_fresh(self, fetched: bool) -> None:
        """Fetch ``jwks_url`` every ``jwks_refresh`` seconds (sooner after a failure,
        and on SIGHUP) until cancelled; ``fetched``: whether the caller's first fetch
        worked."""
        if self.settings.jwks_url is None:
            return
        ok = fetched
        while True:
            wait = self.settings.jwks_refresh if ok else min(self.settings.jwks_refresh,
                                                             MIN_REFETCH_SECONDS)
            with trio.move_on_after(wait):
                await self._wake.wait()
            self._wake = trio.Event()
            ok = await self.fetch()

    # -- tokens -------------------------------------------------------------------------

    def verify(self, token: str) -> VerifiedToken:
        """The token's principal and expiry if it passes every check; TokenRefused
        (UnknownSigningKey: no key has its key id) saying which failed."""
        import jwt

        settings = self.settings
        try:
            header = jwt.get_unverified_header(token)
        except jwt.DecodeError:
            raise TokenRefused("not a signed JSON Web Token (JWS compact form)") from None
        algorithm = header.get("alg")
        if not isinstance(algorithm, str) or algorithm.lower() == "none":
            raise TokenRefused("the token is not signed (alg none)")
        kid = header.get("kid") if isinstance(header.get("kid"), str) else None
        if not self.keys.has_id(kid):
            raise UnknownSigningKey(f"no key of the JWKS has the token's key id {kid!r}")
        candidates = self.keys.for_token(kid, algorithm)
        if not candidates:
            raise TokenRefused(f"no key of the JWKS verifies algorithm {algorithm!r}"
                               + (f" under key id {kid!r}" if kid is not None else ""))
        claim = settings.principal_claim
        # iat must be there but may be in the future, as for Kafka's validator (jose4j
        # checks exp and nbf against the clock, not iat).
        options: Any = {"require": ["exp", "iat", claim], "verify_iat": False,
                        "verify_aud": bool(settings.expected_audience)}
        claims: dict[str, Any] | None = None
        for candidate in candidates:
            try:
                claims = jwt.decode(
                    token, candidate.by_algorithm[algorithm], algorithms=[algorithm],
                    audience=list(settings.expected_audience) or None,
                    issuer=settings.expected_issuer, leeway=settings.clock_skew,
                    options=options)
                break
            except jwt.InvalidSignatureError:
                continue
            except jwt.ExpiredSignatureError:
                failure = "is expired"
            except jwt.ImmatureSignatureError:
                failure = "is not valid yet (nbf)"
            except jwt.InvalidAudienceError:
                failure = "is not for this audience (aud)"
            except jwt.InvalidIssuerError:
                failure = "is from another issuer (iss)"
            except jwt.MissingRequiredClaimError as exc:
                failure = f"has no {exc.claim!r} claim"
            except jwt.InvalidTokenError as exc:
                failure = f"is invalid: {exc}"
            raise TokenRefused(f"the token {failure}")
        if claims is None:
            raise TokenRefused("the token's signature does not verify")
        principal = claims.get(claim)
        if not isinstance(principal, str) or not principal.strip():
            raise TokenRefused(f"the token's {claim!r} claim is not a name")
        expires, issued = claims.get("exp"), claims.get("iat")
        if not _is_number(expires) or not _is_number(issued):
            raise TokenRefused("the token's 'exp' or 'iat' claim is not a number")
        return VerifiedToken(principal, float(expires))


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def load_jwks_file(path: Path) -> SigningKeys:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read the JWKS: {exc.strerror or exc}", file=str(path)) from None
    return parse_jwks(data, str(path))


# -- the proxy's own tokens (origination) ---------------------------------------------------

# A token is fetched again once this share of its lifetime has passed (Kafka's login
# refreshes at sasl.login.refresh.window.factor, 0.8)...
RENEW_AT: Final = 0.8
# ... or when fewer seconds than this are left, whichever comes first: a broker gives a
# session no longer than the token's life, and takes a re-authentication at most once a
# second (KafkaChannel's MIN_REAUTH_INTERVAL_ONE_SECOND), so a login with a token nearly
# spent makes a session the proxy cannot renew in time (it tries at 85%).
RENEW_BEFORE_END: Final = 2.0
# A token whose lifetime cannot be told (no expires_in, no exp) is used this long.
UNKNOWN_LIFETIME: Final = 60.0


@dataclass(frozen=True)
class OAuthClient:
    """``sasl.upstream`` with OAUTHBEARER: where the proxy's own tokens come from, a
    token endpoint (client credentials), a file, or AWS credentials (Amazon MSK IAM)."""

    token_endpoint_url: str | None = None
    client_id: str | None = None
    client_secret: str | None = field(default=None, repr=False)
    scope: str | None = None
    token_file: Path | None = None
    mechanism: str = OAUTHBEARER
    aws_region: str | None = None  # aws_msk_iam: the MSK cluster's region
    aws_profile: str | None = None  # ... and the credentials' profile (None: the default)

    @property
    def username(self) -> str:
        """Who the proxy is to the identity provider, for the log."""
        if self.aws_region is not None:
            return f"AWS IAM ({self.aws_profile or 'default'} credentials, {self.aws_region})"
        return self.client_id if self.client_id is not None else f"the token in {self.token_file}"


def read_client_sasl(up: Reader, base: Path
                     ) -> SaslCredentials | OAuthClient | KerberosCredentials:
    """What a client side of the proxy's (``sasl.upstream``, ``capture.kafka.sasl``)
    logs in with: a user and password (PLAIN, SCRAM), where OAUTHBEARER tokens come
    from: ``{mechanism: OAUTHBEARER, token_endpoint_url, client_id, client_secret |
    client_secret_file | client_secret_env, scope}``, ``{..., token_file}`` or
    ``{..., aws_msk_iam: {region, profile}}``, or a Kerberos principal:
    ``{mechanism: GSSAPI, principal, keytab, service_name}``."""
    what = up.what
    mechanism = up.data.get("mechanism") if isinstance(up.data, dict) else None
    if isinstance(mechanism, str) and mechanism.upper() == GSSAPI:
        return _read_kerberos(up, base)
    if not isinstance(mechanism, str) or mechanism.upper() != OAUTHBEARER:
        return read_sasl_credentials(up, base, (*MECHANISMS, OAUTHBEARER, GSSAPI))
    up.take("mechanism", str)
    url = up.take("token_endpoint_url", str)
    token_file = up.take("token_file", str)
    aws = up.child("aws_msk_iam") if up.has("aws_msk_iam") else None
    if sum(x is not None for x in (url, token_file, aws)) != 1:
        raise up.error(None, f"{what} with OAUTHBEARER needs one of token_endpoint_url (the "
                       "identity provider's, with client_id and client_secret), "
                       "token_file (a token something else keeps fresh) and aws_msk_iam "
                       "(Amazon MSK's IAM tokens)")
    if aws is not None:
        region = aws.take("region", str)
        if not region:
            raise aws.error(None, f"{aws.what} needs region: the MSK cluster's (us-east-1...)")
        profile = aws.take("profile", str)
        aws.finish()
        if not signer_installed():
            raise up.error("aws_msk_iam", f"{what}.aws_msk_iam needs AWS's token signer: "
                           f"{EXTRA_HINT}")
        up.finish()
        return OAuthClient(aws_region=region, aws_profile=profile or None)
    if url is not None and not url.startswith(("https://", "http://")):
        raise up.error("token_endpoint_url", f"{what}.token_endpoint_url must be an "
                       f"https:// (or http://) URL, not {url!r}")
    path = None
    if token_file is not None:
        path = Path(token_file) if Path(token_file).is_absolute() else base / token_file
        if not path.exists():
            raise up.error("token_file", f"{what}.token_file: file {str(path)!r} does not exist")
    client_id = up.take("client_id", str)
    secret = take_password(up, base, "client_secret")
    scope = up.take("scope", str)
    if url is not None and (not client_id or secret is None):
        raise up.error(None, f"{what}.token_endpoint_url needs client_id and one of "
                       "client_secret, client_secret_file, client_secret_env")
    if path is not None and (client_id is not None or secret is not None or scope):
        raise up.error(None, f"{what}.token_file takes no client_id, client_secret or scope "
                       "(they are the token endpoint's)")
    up.finish()
    return OAuthClient(url, client_id, secret, scope or None, path)


def read_keytab(reader: Reader, keytab: Path) -> list[str]:
    """The principals the keytab ``reader.keytab`` names holds keys for; ConfigError at
    its line if it cannot be read or is not a keytab."""
    try:
        return keytab_principals(keytab.read_bytes())
    except OSError as exc:
        raise reader.error("keytab", f"{reader.what}.keytab: cannot read {str(keytab)!r}: "
                           f"{exc.strerror or exc}") from None
    except ValueError as exc:
        raise reader.error("keytab", f"{reader.what}.keytab: {str(keytab)!r}: {exc}") from None


def _read_kerberos(up: Reader, base: Path) -> KerberosCredentials:
    what = up.what
    up.take("mechanism", str)
    principal = up.require("principal", str)
    if not principal:
        raise up.error("principal", f"{what}.principal must name the proxy's Kerberos "
                       "principal (gatehouse/proxy.example.com@EXAMPLE.COM)")
    keytab = base / up.require("keytab", str)  # an absolute path stays itself
    held = read_keytab(up, keytab)
    # A principal without its realm is in the default realm (krb5.conf's): any realm.
    if principal not in held and not ("@" not in principal and any(
            name.rpartition("@")[0] == principal for name in held)):
        raise up.error("principal", f"{what}.principal: keytab {str(keytab)!r} holds no key "
                       f"for {principal!r} (it holds: {', '.join(held) or 'none'})")
    service_name = up.take("service_name", str, DEFAULT_SERVICE_NAME)
    if not service_name:
        raise up.error("service_name", f"{what}.service_name must name the brokers' "
                       "Kerberos service (their principals' first part, Kafka's "
                       "sasl.kerberos.service.name)")
    try:
        gssapi_library()
    except SaslError as exc:
        raise up.error("mechanism", f"{what}.mechanism GSSAPI: {exc}") from None
    up.finish()
    return KerberosCredentials(principal, keytab, service_name)


def fetch_token(client: OAuthClient) -> tuple[str, float | None]:
    """A token to log in with (blocking: run in a thread) and the seconds it lasts
    (None: not known, or a file's, read again at every login); SaslError saying why
    there is none."""
    if client.aws_region is not None:
        return msk_iam_token(client.aws_region, client.aws_profile)
    path = client.token_file
    if path is not None:
        try:
            token = path.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise SaslError(f"cannot read the token file {path}: "
                            f"{getattr(exc, 'strerror', None) or exc}") from None
        if not token:
            raise SaslError(f"the token file {path} is empty")
        return token, None
    token, expires_in = _client_credentials(client)
    # The broker ends the session at the token's exp; expires_in can say more (whole
    # seconds from the answer, where exp was rounded down from the issue).
    lifetimes = [t for t in (expires_in, _lifetime_of(token)) if t is not None]
    return token, min(lifetimes) if lifetimes else None


def _client_credentials(client: OAuthClient) -> tuple[str, float | None]:
    """A token from the endpoint (blocking: run in a thread) and the seconds it lasts
    (``expires_in``; None if not said); SaslError saying why not, never the secret."""
    url = client.token_endpoint_url
    assert url is not None and client.client_id is not None and client.client_secret is not None
    form = {"grant_type": "client_credentials"}
    if client.scope:
        form["scope"] = client.scope
    # RFC 6749 section 2.3.1: id and secret form-encoded, then HTTP Basic.
    pair = f"{urllib.parse.quote(client.client_id)}:{urllib.parse.quote(client.client_secret)}"
    request = urllib.request.Request(
        url, data=urllib.parse.urlencode(form).encode(), method="POST",
        headers={"Authorization": "Basic " + base64.b64encode(pair.encode()).decode(),
                 "Content-Type": "application/x-www-form-urlencoded",
                 "Accept": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=FETCH_TIMEOUT_SECONDS) as answer:
            body = answer.read(MAX_JWKS_BYTES)
    except urllib.error.HTTPError as exc:
        said = _oauth_error(exc.read(4096))
        raise SaslError(f"the token endpoint {url} answered {exc.code}"
                        + (f" ({said})" if said else "")) from None
    except (OSError, ValueError) as exc:
        raise SaslError(f"cannot reach the token endpoint {url}: "
                        f"{getattr(exc, 'reason', None) or exc}") from None
    try:
        document = json.loads(body)
        token = document["access_token"]
        expires_in = document.get("expires_in")
    except (ValueError, KeyError, TypeError, AttributeError):
        raise SaslError(f"the token endpoint {url} did not answer with an access_token") from None
    if not isinstance(token, str) or not token:
        raise SaslError(f"the token endpoint {url} did not answer with an access_token")
    return token, float(expires_in) if _is_number(expires_in) else None


def _oauth_error(body: bytes) -> str | None:
    """An OAuth error answer's words (RFC 6749 section 5.2), if it has them."""
    try:
        document = json.loads(body)
    except ValueError:
        return None
    if not isinstance(document, dict):
        return None
    words = [str(document[k]) for k in ("error", "error_description") if document.get(k)]
    return ": ".join(words) or None


def _lifetime_of(token: str) -> float | None:
    """Seconds until a JWT's exp (read, not verified: it is the proxy's own token)."""
    try:
        payload = token.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except (IndexError, ValueError, binascii.Error):
        return None
    expires = claims.get("exp") if isinstance(claims, dict) else None
    return expires - time.time() if _is_number(expires) else None


def renew_after(lifetime: float | None) -> float:
    """Seconds a token of this lifetime (None or <= 0: not known) is used for logins."""
    if lifetime is None or lifetime <= 0:
        lifetime = UNKNOWN_LIFETIME
    return max(0.0, min(RENEW_AT * lifetime, lifetime - RENEW_BEFORE_END))


class TokenSource:
    """The proxy's token for the brokers: fetched from the endpoint and kept until
    RENEW_AT of its lifetime has passed or RENEW_BEFORE_END seconds are left (one fetch
    for every broker connection that opens meanwhile), or read from the file at every
    login."""

    def __init__(self, client: OAuthClient) -> None:
        self.client = client
        self.fetches = 0
        self._token: str | None = None
        self._renew_at = -math.inf
        self._lock = trio.Lock()

    @property
    def mechanism(self) -> str:
        return OAUTHBEARER

    @property
    def username(self) -> str:
        return self.client.username

    async def token(self) -> str:
        """A token to log in with now; SaslError saying why there is none."""
        if self.client.token_file is not None:  # read at every login: no caching
            token, _ = await trio.to_thread.run_sync(fetch_token, self.client)
            return token
        async with self._lock:  # connections opening together share one fetch
            if self._token is not None and trio.current_time() < self._renew_at:
                return self._token
            self.fetches += 1
            token, lifetime = await trio.to_thread.run_sync(
                fetch_token, self.client, abandon_on_cancel=True)
            self._token = token
            self._renew_at = trio.current_time() + renew_after(lifetime)
            log_event(logger, logging.DEBUG, "OAUTHBEARER token fetched",
                      endpoint=self.client.token_endpoint_url, seconds=lifetime)
            return token


__all__ = [
    "OAUTHBEARER",
    "OAuthClient",
    "OAuthSettings",
    "SigningKeys",
    "TokenRefused",
    "TokenSource",
    "TokenValidator",
    "UnknownSigningKey",
    "VerifiedToken",
    "fetch_token",
    "load_jwks_file",
    "parse_jwks",
    "read_client_sasl",
    "renew_after",
]
