"""OAUTHBEARER at the proxy, without a broker: the client's message (RFC 7628), JWKS
documents, the token checks a broker's validator makes, one client's exchange, the
config (errors with file:line), reloads of a JWKS file and fetches of a JWKS URL."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import jwt
import pytest
import trio

from gatehouse.codecs.sasl import bearer_message, parse_bearer_message
from gatehouse.codecs.scram import SaslError
from gatehouse.configfile import ConfigError
from gatehouse.proxy.config import config_from_text, security_warnings
from gatehouse.proxy.oauth import (
    OAuthClient,
    OAuthSettings,
    TokenRefused,
    TokenSource,
    TokenValidator,
    UnknownSigningKey,
    fetch_token,
    parse_jwks,
    renew_after,
)
from gatehouse.proxy.sasl import ClientSasl
from tests.support.oauth import (
    AUDIENCE,
    ISSUER,
    JwksServer,
    TokenEndpoint,
    ec_key,
    ed_key,
    hmac_over_the_public_key,
    jwks,
    rsa_key,
    write_jwks,
)

RSA = rsa_key()
OTHER = rsa_key("rsa-1")  # the same key id, another key: a forged signature
EC = ec_key()
ED = ed_key()


def validator_for(*keys: object) -> TokenValidator:
    """A validator with ``keys`` held in memory (no file)."""
    tokens = TokenValidator(OAuthSettings())
    tokens.keys = parse_jwks(json.dumps(jwks(*keys)).encode(), "keys")  # type: ignore[arg-type]
    return tokens


def validator(tmp_path: Path, *keys: object, **settings: object) -> TokenValidator:
    path = write_jwks(tmp_path / "jwks.json", *(keys or (RSA, EC, ED)))  # type: ignore[arg-type]
    return TokenValidator(OAuthSettings(jwks_file=path, **settings))  # type: ignore[arg-type]


# -- the client's message -------------------------------------------------------------------


def test_the_client_message_as_kafkas_clients_write_it() -> None:
    message = parse_bearer_message(bearer_message("a.b.c"))
    assert (message.token, message.authzid, message.extensions) == ("a.b.c", None, {})
    message = parse_bearer_message(bearer_message("a.b.c", "bob", traceId="x 1", host="h"))
    assert message.authzid == "bob"
    assert message.extensions == {"traceId": "x 1", "host": "h"}
    assert "a.b.c" not in repr(message)  # never printed


@pytest.mark.parametrize(("data", "error"), [
    (b"auth=Bearer a.b.c\x01\x01", "gs2 header"),
    (b"p=x,,\x01auth=Bearer a.b.c\x01\x01", "gs2 header"),
    (b"n,b=bob,\x01auth=Bearer a.b.c\x01\x01", "authorization id"),
    (b"n,,\x01auth=Bearer a.b.c\x01", "two \\\\x01"),
    (b"n,,\x01auth=Basic YWxpY2U=\x01\x01", "not 'Bearer <token>'"),
    (b"n,,\x01auth=Bearer a b\x01\x01", "not 'Bearer <token>'"),
    (b"n,,\x01host=x\x01\x01", "no auth=Bearer"),
    (b"n,,\x01auth=Bearer a\x01auth=Bearer b\x01\x01", "twice"),
    (b"n,,\x01a-b=c\x01auth=Bearer a\x01\x01", "malformed key=value"),
    (b"n,,\x01auth=Bearer \xff\x01\x01", "not ASCII"),
])
def test_messages_that_are_not_rfc_7628s(data: bytes, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_bearer_message(data)


# -- JWKS documents -------------------------------------------------------------------------


def test_a_jwks_of_rsa_ec_and_edwards_keys() -> None:
    keys = parse_jwks(json.dumps(jwks(RSA, EC, ED)).encode(), "jwks.json")
    assert keys.count == 3
    assert [k.algorithms for k in keys.for_token("ec-1", "ES256")] == [("ES256",)]
    assert keys.for_token("ec-1", "RS256") == []
    assert len(keys.for_token(None, "EdDSA")) == 1
    # A key without "alg" verifies what its type and curve allow.
    bare = {**EC.jwk()}
    del bare["alg"]
    assert parse_jwks(json.dumps({"keys": [bare]}).encode(), "x").for_token(
        "ec-1", "ES256")
    # An RSA key without "alg" verifies RS* and PS* tokens alike.
    no_alg = {k: v for k, v in RSA.jwk().items() if k != "alg"}
    tokens = TokenValidator(OAuthSettings())
    tokens.keys = parse_jwks(json.dumps({"keys": [no_alg]}).encode(), "x")
    ps_signed = jwt.encode({"sub": "p", "iat": int(time.time()), "exp": int(time.time()) + 60},
                           RSA.private, algorithm="PS256", headers={"kid": RSA.kid})
    assert tokens.verify(ps_signed).principal == "p"
    assert tokens.verify(RSA.token("r")).principal == "r"
    # Encryption keys sign nothing: skipped.
    both = {"keys": [{**RSA.jwk(), "use": "enc", "kid": "e"}, RSA.jwk()]}
    assert parse_jwks(json.dumps(both).encode(), "x").count == 1


@pytest.mark.parametrize(("document", "error", "line"), [
    ('{"keys": [\n  {"kty": "RSA",}\n]}', "not JSON", 2),
    ('{"key": []}', '"keys"', None),
    ('{"keys": []}', "no signing key", None),
    ('{"keys": [{"kty": "oct", "k": "c2VjcmV0"}]}', "secret", None),
    ('{"keys": [{"kty": "DSA"}]}', "'DSA' is not one of", None),
    ('{"keys": [{"kty": "RSA", "n": "AQAB"}]}', "not a usable RSA key", None),
    (json.dumps({"keys": [{**EC.jwk(), "alg": "RS256"}]}), "does not go with", None),
])
def test_a_bad_jwks_is_refused_saying_where(document: str, error: str,
                                            line: int | None) -> None:
    with pytest.raises(ConfigError, match=error) as caught:
        parse_jwks(document.encode(), "keys.json")
    assert caught.value.file == "keys.json" and caught.value.line == line


# -- tokens ---------------------------------------------------------------------------------


@pytest.mark.parametrize("key", [RSA, EC, ED, rsa_key("ps", "PS256")], ids=lambda k: k.algorithm)
def test_a_good_token_gives_its_subject_and_expiry(tmp_path: Path, key: object) -> None:
    tokens = validator(tmp_path, RSA, EC, ED, key)
    token = key.token("alice", lifetime=600)  # type: ignore[attr-defined]
    verified = tokens.verify(token)
    assert verified.principal == "alice"
    assert abs(verified.expires - (time.time() + 600)) < 5


def test_the_checks_a_brokers_validator_makes(tmp_path: Path) -> None:
    tokens = validator(tmp_path, expected_issuer=ISSUER, expected_audience=(AUDIENCE, "other"),
                       clock_skew=30)
    now = time.time()
    refusals = {
        "expired": RSA.token(issued=now - 3700, lifetime=3600),
        "not valid yet": RSA.token(nbf=int(now + 300)),
        "'exp' or 'iat' claim is not a number": RSA.token(iat="yesterday"),
        "not for this audience": RSA.token(aud="billing"),
        "from another issuer": RSA.token(iss="https://elsewhere"),
        "no 'sub' claim": RSA.token(None),
        "no 'exp' claim": RSA.token(exp=None),
        "no 'iat' claim": RSA.token(iat=None),
        "signature does not verify": OTHER.token(),
        "not a signed JSON Web Token": "not-a-token",
        r"not signed \(alg none\)": jwt.encode({"sub": "eve"}, None, algorithm="none"),
        "'sub' claim is not a name": RSA.token(sub=" "),
    }
    for reason, token in refusals.items():
        with pytest.raises(TokenRefused, match=reason):
            tokens.verify(token)
    # Issued in the future: good, as for Kafka's validator (it checks exp and nbf).
    assert tokens.verify(RSA.token(issued=now + 300)).principal == "alice"
    # Within the clock skew: still good (the session is then short).
    assert tokens.verify(RSA.token(issued=now - 3620, lifetime=3600)).principal == "alice"
    assert tokens.verify(RSA.token(aud=["x", "other"])).principal == "alice"


def test_a_public_key_cannot_sign_as_a_shared_secret(tmp_path: Path) -> None:
    """The algorithm confusion attack: a token "signed" with HMAC over the RSA public
    key's bytes (which anyone has) is refused, not checked with that key as a secret."""
    with pytest.raises(TokenRefused, match="no key of the JWKS verifies algorithm 'HS256'"):
        validator(tmp_path).verify(hmac_over_the_public_key(RSA))


def test_key_ids_the_keys_lack(tmp_path: Path) -> None:
    tokens = validator(tmp_path, RSA)
    with pytest.raises(UnknownSigningKey, match="'rsa-2'"):
        tokens.verify(rsa_key("rsa-2").token())
    assert tokens.verify(RSA.token(kid=None)).principal == "alice"  # no id: every key tried
    # Keys without an id are tried for any id (as Kafka's key resolver does).
    bare = {**RSA.jwk()}
    del bare["kid"]
    (tmp_path / "jwks.json").write_text(json.dumps({"keys": [bare]}))
    assert tokens.reload()
    assert tokens.verify(RSA.token(kid="whatever")).principal == "alice"


def test_the_principal_claim_and_no_audience_check(tmp_path: Path) -> None:
    tokens = validator(tmp_path, principal_claim="client_id")
    assert tokens.verify(RSA.token("ignored", client_id="svc-orders")).principal == "svc-orders"
    with pytest.raises(TokenRefused, match="no 'client_id' claim"):
        tokens.verify(RSA.token("alice"))
    # No expected audience: a token's aud is not checked (Kafka's default).
    assert validator(tmp_path).verify(RSA.token(aud="anything")).principal == "alice"


# -- one client's exchange ------------------------------------------------------------------


def test_one_clients_oauthbearer_exchange(tmp_path: Path) -> None:
    tokens = validator(tmp_path)
    sasl = ClientSasl(None, ("OAUTHBEARER",), tokens)
    assert sasl.handshake("PLAIN", 1) == 33
    assert sasl.handshake("OAUTHBEARER", 1) == 0
    answer, done = sasl.step(bearer_message(RSA.token("alice", lifetime=120)))
    assert (answer, done, sasl.user) == (b"", True, "alice")
    assert sasl.expires is not None and 100 < sasl.expires - time.time() <= 120
    # KIP-368: again, with a new token of the same subject; another subject is refused.
    assert sasl.handshake("OAUTHBEARER", 1) == 0
    assert sasl.step(bearer_message(EC.token("alice", lifetime=600)))[1]
    assert sasl.expires - time.time() > 500
    assert sasl.handshake("OAUTHBEARER", 1) == 0
    with pytest.raises(SaslError, match="a connection keeps its user"):
        sasl.step(bearer_message(RSA.token("bob")))


def test_a_refused_token_is_answered_as_kafka_answers_it(tmp_path: Path) -> None:
    tokens = validator(tmp_path)
    sasl = ClientSasl(None, ("OAUTHBEARER",), tokens)
    sasl.handshake("OAUTHBEARER", 1)
    answer, done = sasl.step(bearer_message(RSA.token("eve", lifetime=-100, issued=0)))
    # RFC 7628's error challenge; the client acknowledges it, then the exchange fails.
    assert json.loads(answer) == {"status": "invalid_token"} and not done
    assert sasl.claimed == "eve" and sasl.user is None
    with pytest.raises(SaslError, match="the token is expired"):
        sasl.step(b"\x01")
    with pytest.raises(SaslError, match="already authenticated"):
        sasl.step(b"\x01")

    sasl = ClientSasl(None, ("OAUTHBEARER",), tokens)
    sasl.handshake("OAUTHBEARER", 1)
    with pytest.raises(SaslError, match="asks to act as 'bob' with a token of 'alice'"):
        sasl.step(bearer_message(RSA.token("alice"), authzid="bob"))
    sasl = ClientSasl(None, ("OAUTHBEARER",), tokens)
    sasl.handshake("OAUTHBEARER", 1)
    with pytest.raises(SaslError, match="gs2 header"):
        sasl.step(b"garbage")
    # Unknown key ids propagate untouched (the connection fetches a URL's keys again)...
    sasl = ClientSasl(None, ("OAUTHBEARER",), tokens)
    sasl.handshake("OAUTHBEARER", 1)
    message = bearer_message(rsa_key("new").token())
    with pytest.raises(UnknownSigningKey) as caught:
        sasl.step(message)
    # ... and are then refused like any bad token.
    assert sasl.refuse_unknown_key(caught.value) == (b'{"status":"invalid_token"}', False)
    with pytest.raises(SaslError, match="key id 'new'"):
        sasl.step(b"\x01")


# -- the config -----------------------------------------------------------------------------


def test_the_oauthbearer_config(tmp_path: Path) -> None:
    write_jwks(tmp_path / "jwks.json", RSA)
    head = "listen: 127.0.0.1:0\nupstream: [127.0.0.1:9092]\nsasl:\n"
    config = config_from_text(
        head + "  oauthbearer_sub_claim_name: azp\n  downstream:\n    oauthbearer:\n"
        "      jwks_file: jwks.json\n      expected_issuer: https://idp\n"
        "      expected_audience: kafka\n      clock_skew: 5\n", base=tmp_path)
    down = config.sasl_downstream
    assert down is not None and down.users_file is None
    assert down.mechanisms == ("OAUTHBEARER",)
    assert down.oauthbearer == OAuthSettings(tmp_path / "jwks.json", None, 3600.0,
                                             "https://idp", ("kafka",), "azp", 5.0)
    url = config_from_text(
        head + "  downstream:\n    oauthbearer: {jwks_url: 'https://idp/jwks', "
        "jwks_refresh: 60}\n", base=tmp_path).sasl_downstream
    assert url is not None and url.oauthbearer is not None
    assert (url.oauthbearer.jwks_url, url.oauthbearer.jwks_refresh) == ("https://idp/jwks", 60)
    (tmp_path / "users.yaml").write_text("users:\n  alice: {password: x}\n")
    both = config_from_text(
        head + "  downstream:\n    users_file: users.yaml\n    oauthbearer: "
        "{jwks_file: jwks.json}\n", base=tmp_path).sasl_downstream
    assert both is not None
    assert both.mechanisms == ("SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN", "OAUTHBEARER")
    (tmp_path / "bad.json").write_text('{"keys": [\n  {"kty": "oct", "k": "eA"}]}')
    for text, line, error in [
        ("  downstream: {mechanisms: [OAUTHBEARER]}\n", 4, "needs users_file"),
        ("  downstream:\n    oauthbearer: {}\n", 5, "needs one of jwks_file and jwks_url"),
        ("  downstream:\n    oauthbearer: {jwks_file: jwks.json, jwks_url: 'https://x'}\n",
         5, "needs one of"),
        ("  downstream:\n    oauthbearer: {jwks_url: 'ftp://x'}\n", 5, "https://"),
        ("  downstream:\n    oauthbearer: {jwks_file: jwks.json, clock_skew: -1}\n", 5,
         "must not be negative"),
        ("  downstream:\n    oauthbearer: {jwks_file: jwks.json, scopes: [a]}\n", 5,
         "unknown key 'scopes'"),
        ("  downstream:\n    oauthbearer: {jwks_file: jwks.json}\n"
         "    mechanisms: [OAUTHBEARER, PLAIN]\n", 6, "PLAIN needs sasl.downstream.users_file"),
        ("  downstream:\n    users_file: users.yaml\n    mechanisms: [OAUTHBEARER]\n", 6,
         "OAUTHBEARER needs sasl.downstream.oauthbearer"),
    ]:
        with pytest.raises(ConfigError, match=error) as caught:
            config_from_text(head + text, "proxy.yaml", base=tmp_path)
        assert caught.value.line == line, (text, caught.value)
    with pytest.raises(ConfigError, match="secret") as caught:
        config_from_text(head + "  downstream:\n    oauthbearer: {jwks_file: bad.json}\n",
                         "proxy.yaml", base=tmp_path)
    assert caught.value.file == str(tmp_path / "bad.json")


# -- where the keys come from ---------------------------------------------------------------


def test_a_bad_jwks_reload_keeps_the_keys_before_it(tmp_path: Path) -> None:
    tokens = validator(tmp_path, RSA)
    path = tmp_path / "jwks.json"
    path.write_text("{not json")
    assert tokens.changed() and not tokens.reload()
    assert tokens.last_error is not None and "not JSON" in tokens.last_error
    assert tokens.verify(RSA.token()).principal == "alice"
    write_jwks(path, EC)  # rotated: the old key's tokens fail, the new key's pass
    assert tokens.changed() and tokens.reload()
    assert tokens.verify(EC.token()).principal == "alice"
    with pytest.raises(UnknownSigningKey):
        tokens.verify(RSA.token())


async def test_a_jwks_url_is_fetched_and_fetched_again_for_a_new_key() -> None:
    server = JwksServer(RSA)
    with server.running():
        tokens = TokenValidator(OAuthSettings(jwks_url=server.url))
        with pytest.raises(UnknownSigningKey):  # nothing fetched yet
            tokens.verify(RSA.token())
        assert await tokens.fetch() and server.requests == 1
        assert tokens.verify(RSA.token()).principal == "alice"
        # The provider rotates in a new key; a token signed with it makes the proxy
        # fetch again at once, but not twice within MIN_REFETCH_SECONDS.
        server.keys.append(EC)
        assert await tokens.fetch_for_unknown_key() and server.requests == 2
        assert tokens.verify(EC.token()).principal == "alice"
        assert not await tokens.fetch_for_unknown_key() and server.requests == 2
        # The provider down: the keys before it stay, and the failure is kept to say.
        server.down = True
        assert not await tokens.fetch() and server.requests == 3
        assert tokens.last_error is not None and "503" in tokens.last_error
        assert tokens.verify(EC.token()).principal == "alice"


async def test_keep_fresh_fetches_on_a_timer_and_on_reload() -> None:
    server = JwksServer(RSA)
    with server.running():
        tokens = TokenValidator(OAuthSettings(jwks_url=server.url, jwks_refresh=0.2))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tokens.keep_fresh, True)
            with trio.fail_after(10):
                while server.requests < 3:  # every 0.2 s
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
        hourly = TokenValidator(OAuthSettings(jwks_url=server.url, jwks_refresh=3600))
        seen = server.requests
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hourly.keep_fresh, True)
            assert hourly.reload()  # SIGHUP: fetched again now, not in an hour
            with trio.fail_after(10):
                while server.requests == seen:
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
        assert hourly.verify(RSA.token()).principal == "alice"


def test_the_metrics_count_the_loads_of_the_keys(tmp_path: Path) -> None:
    from gatehouse.metrics import ProxyMetrics

    metrics = ProxyMetrics()
    tokens = validator(tmp_path, RSA)
    metrics.watch_jwks(tokens)

    def sample(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, labels)

    assert sample("gatehouse_jwks_last_load_success") == 1
    assert sample("gatehouse_jwks_loads_total", outcome="failed") == 0
    (tmp_path / "jwks.json").write_text("{}")
    assert not tokens.reload()
    assert sample("gatehouse_jwks_last_load_success") == 0
    assert sample("gatehouse_jwks_loads_total", outcome="failed") == 1
    write_jwks(tmp_path / "jwks.json", EC)
    assert tokens.reload()
    assert sample("gatehouse_jwks_last_load_success") == 1
    assert sample("gatehouse_jwks_loads_total", outcome="ok") == 1


def test_gatehouse_check_says_where_tokens_are_checked(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gatehouse.cli import main

    write_jwks(tmp_path / "jwks.json", RSA, EC)
    path = tmp_path / "gatehouse.yaml"
    path.write_text("listen: 127.0.0.1:9192\nupstream: [127.0.0.1:9092]\nsasl:\n"
                    "  downstream:\n    session_lifetime: 600\n    oauthbearer: "
                    f"{{jwks_file: jwks.json, expected_issuer: '{ISSUER}', "
                    "expected_audience: [kafka, ops]}\n")
    assert main(["check", "--config", str(path)]) == 0
    out, err = capsys.readouterr()
    assert (f"sasl.downstream: OAUTHBEARER tokens checked against the 2 keys of "
            f"{tmp_path / 'jwks.json'}; the principal is their 'sub' claim, issuer "
            f"{ISSUER}, audience kafka or ops; a session lasts no longer than its token, "
            "session lifetime 600 s") in out
    # A bearer token is as good as a password to whoever sees it.
    assert err == ("warning: sasl.downstream offers OAUTHBEARER without tls.downstream: "
                   "clients send their tokens in clear text\n")
    path.write_text(path.read_text().replace("jwks_file: jwks.json",
                                             "jwks_url: 'https://idp/jwks'"))
    assert main(["check", "--config", str(path)]) == 0
    assert ("OAUTHBEARER tokens checked against the keys at https://idp/jwks (fetched at "
            "start and every 3600 s)") in capsys.readouterr().out
    (tmp_path / "jwks.json").write_text('{"keys": [\n  {"kty": "oct", "k": "eA"}\n]}')
    path.write_text(path.read_text().replace("jwks_url: 'https://idp/jwks'",
                                             "jwks_file: jwks.json"))
    assert main(["check", "--config", str(path)]) == 1
    assert "jwks.json: keys[0] is a secret (oct) key" in capsys.readouterr().err


# -- the proxy's own tokens (sasl.upstream) -------------------------------------------------


def test_the_upstream_oauthbearer_config(tmp_path: Path) -> None:
    (tmp_path / "client.secret").write_text("s3cret\n")
    head = "listen: 127.0.0.1:0\nupstream: [127.0.0.1:9092]\nsasl:\n"
    config = config_from_text(
        head + "  upstream: {mechanism: OAUTHBEARER, token_endpoint_url: 'https://idp/token', "
        "client_id: gh, client_secret_file: client.secret, scope: kafka}\n", base=tmp_path)
    assert config.sasl_upstream == OAuthClient("https://idp/token", "gh", "s3cret", "kafka")
    assert "s3cret" not in repr(config.sasl_upstream)
    (tmp_path / "token.jwt").write_text("x")
    config = config_from_text(
        head + "  upstream: {mechanism: oauthbearer, token_file: token.jwt}\n", base=tmp_path)
    assert config.sasl_upstream == OAuthClient(token_file=tmp_path / "token.jwt")
    for text, error in [
        ("{mechanism: OAUTHBEARER}", "needs one of token_endpoint_url"),
        ("{mechanism: OAUTHBEARER, token_endpoint_url: 'https://x', token_file: token.jwt}",
         "needs one of token_endpoint_url"),
        ("{mechanism: OAUTHBEARER, token_endpoint_url: 'https://x', client_id: gh}",
         "needs client_id and one of client_secret"),
        ("{mechanism: OAUTHBEARER, token_endpoint_url: 'ftp://x', client_id: a, "
         "client_secret: b}", "https://"),
        ("{mechanism: OAUTHBEARER, token_file: token.jwt, client_id: gh}",
         "takes no client_id"),
        ("{mechanism: OAUTHBEARER, token_file: token.jwt, username: gh}", "unknown key"),
        ("{mechanism: OAUTHBEARER, token_endpoint_url: 'https://x', client_id: a, "
         "client_secret: b, client_secret_env: B}", "exactly one of client_secret"),
    ]:
        with pytest.raises(ConfigError, match=error) as caught:
            config_from_text(head + f"  upstream: {text}\n", "proxy.yaml", base=tmp_path)
        assert caught.value.line == 4, (text, caught.value)
    warned = security_warnings(config_from_text(
        head + "  upstream: {mechanism: OAUTHBEARER, token_endpoint_url: 'http://idp/t', "
        "client_id: a, client_secret: b}\n", base=tmp_path))
    assert warned == ["sasl.upstream uses OAUTHBEARER without tls.upstream: the token goes to "
                      "the brokers in clear text", "sasl.upstream.token_endpoint_url is "
                      "http://: the client secret goes to the token endpoint in clear text"]


async def test_a_token_source_fetches_once_for_many_logins() -> None:
    endpoint = TokenEndpoint(RSA, "gh", "s3cret", lifetime=600)
    with endpoint.running():
        source = TokenSource(OAuthClient(endpoint.url, "gh", "s3cret", "kafka read"))
        first = await source.token()
        assert await source.token() == first and source.fetches == 1
        assert endpoint.scopes == ["kafka read"]
        assert validator_for(RSA).verify(first).principal == "gatehouse"
        source._renew_at = trio.current_time()  # 80% of its life gone: fetched again
        await source.token()
        assert source.fetches == 2 and len(endpoint.issued) == 2
        with pytest.raises(SaslError, match=r"answered 401 \(invalid_client: bad client "):
            await TokenSource(OAuthClient(endpoint.url, "gh", "guess")).token()
    with pytest.raises(SaslError, match="cannot reach the token endpoint"):
        await TokenSource(OAuthClient(endpoint.url, "gh", "s3cret")).token()


def test_a_token_is_renewed_before_the_broker_would_end_its_sessions_too_soon() -> None:
    """A token lasts until its exp or its expires_in, whichever is sooner (a broker ends
    the session at exp; an endpoint that rounds exp down says a second too many), and is
    used for logins until 80% of that has passed or 2 s are left: a login with less would
    get a session shorter than the broker's one-second floor between re-authentications
    lets the proxy renew."""
    client = OAuthClient(token_endpoint_url="", client_id="gh", client_secret="s3cret")
    for claims, expected in [({"exp": int(time.time()) + 300}, 300),  # exp sooner
                             ({}, 600),  # exp later by at most the rounding: expires_in
                             ({"exp": None}, 600)]:  # no exp
        endpoint = TokenEndpoint(RSA, "gh", "s3cret", lifetime=600.5, **claims)
        with endpoint.running():
            token, lifetime = fetch_token(replace(client, token_endpoint_url=endpoint.url))
        assert token == endpoint.issued[0]
        assert lifetime is not None and expected - 2 < lifetime <= expected, (claims, lifetime)
    assert renew_after(3600) == 2880 and renew_after(6) == 4 and renew_after(1.5) == 0
    assert renew_after(None) == renew_after(0) == 48  # not known: a minute


async def test_the_proxy_logs_in_with_a_token_as_a_broker_expects() -> None:
    """``authenticate_upstream`` with OAUTHBEARER against a broker that answers as RFC
    7628 says (an error challenge, then a failure once acknowledged) or as Kafka does."""
    from gatehouse import codecs
    from gatehouse.proxy.sasl import authenticate_upstream

    endpoint = TokenEndpoint(RSA, "gh", "s3cret", lifetime=600)
    sent: list[bytes] = []

    def broker(refuse: str | None) -> Any:
        async def call(req: codecs.Request) -> codecs.Response:
            cls = codecs.api(req.api_key).response.root.cls
            if req.api_key == 17:
                body = cls(error_code=0, mechanisms=("OAUTHBEARER",))
            else:
                sent.append(bytes(req.body.auth_bytes))
                if refuse == "challenge" and sent[-1] != b"\x01":
                    body = cls(auth_bytes=b'{"status":"invalid_token"}')
                elif refuse is not None:
                    body = cls(error_code=58, error_message="Authentication failed")
                else:
                    body = cls(auth_bytes=b"", session_lifetime_ms=4000)
            return codecs.Response.build(req.api_key, req.api_version, req.correlation_id, body)
        return call

    with endpoint.running():
        source = TokenSource(OAuthClient(endpoint.url, "gh", "s3cret"))
        assert await authenticate_upstream(broker(None), source, "broker") == 4.0
        assert parse_bearer_message(sent[0]).token == endpoint.issued[0]
        sent.clear()
        with pytest.raises(SaslError, match=r"the broker refused 'gh' .*Authentication failed"):
            await authenticate_upstream(broker("challenge"), source, "broker")
        assert sent[1] == b"\x01"  # the challenge acknowledged, as RFC 7628 says
        with pytest.raises(SaslError, match="the broker refused 'gh'"):
            await authenticate_upstream(broker("at once"), source, "broker")


def test_open_doors_in_the_oauthbearer_config_are_warned_of(tmp_path: Path) -> None:
    tls = tmp_path / "tls"
    tls.mkdir()
    head = "listen: 127.0.0.1:0\nupstream: [127.0.0.1:9092]\nsasl:\n"
    warned = security_warnings(config_from_text(
        head + "  downstream:\n    oauthbearer: {jwks_url: 'http://idp/jwks'}\n",
        base=tmp_path))
    assert warned == [
        "sasl.downstream offers OAUTHBEARER without tls.downstream: clients send their "
        "tokens in clear text",
        "sasl.downstream.oauthbearer.jwks_url is http://: anyone on the path to the identity "
        "provider can hand the proxy keys of their own and forge tokens for any principal",
        "sasl.downstream.oauthbearer has no expected_audience: a token the identity provider "
        "issued for any other service is taken too"]
    warned = security_warnings(config_from_text(
        head + "  downstream:\n    oauthbearer: {jwks_url: 'https://idp/jwks', "
        "expected_audience: kafka}\n", base=tmp_path))
    assert warned == [warned[0]] and "clear text" in warned[0]  # only the missing TLS
