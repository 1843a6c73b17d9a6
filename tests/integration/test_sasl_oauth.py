"""OAUTHBEARER at the proxy on a real Apache Kafka broker, with real clients.

``sasl.downstream.oauthbearer``: librdkafka, kafka-python, aiokafka and the Java
producer log in with JSON Web Tokens signed by keys made in the test; the proxy checks
them against the keys' JWKS (a file, or a URL served from a real socket) and the
broker's plain listener never hears SASL.  The token's subject is the principal rules
match; a bad token is refused with the check it failed, as clients see it; a session
ends with its token and KIP-368 clients log in again with a fresh one; a provider's new
key is fetched when a token first names it.  No token reaches the log.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import confluent_kafka as ck
import jwt
import pytest
from confluent_kafka.admin import AdminClient

from gatehouse.proxy.oauth import OAuthSettings, TokenRefused, TokenValidator
from tests.integration.test_sasl_proxy import client_errors, logged, requests_counted
from tests.support.clients import (
    aiokafka_produce,
    consume,
    kafka_python_produce,
    kafka_python_read,
    produce,
    produce_for,
    unique,
    watermarks,
)
from tests.support.kafka import BROKER_JVM_OPTS, JAVA_SOURCES, KafkaCluster, run_java_tool
from tests.support.oauth import (
    AUDIENCE,
    ISSUER,
    JwksServer,
    SigningKey,
    TokenEndpoint,
    ec_key,
    ed_key,
    hmac_over_the_public_key,
    rsa_key,
    write_jwks,
)
from tests.support.proxythread import ProxyThread

# svc-reports may not delete topics; everyone else may.
RULES = ("- name: reports-keep-topics\n  match: {principal: '^svc-reports$'}\n"
         "  deny_apis: [DeleteTopics]\n")


def oauth_config(jwks: str, *, url: bool = False) -> str:
    where = f"jwks_url: '{jwks}'" if url else f"jwks_file: {jwks}"
    return (f"sasl:\n  downstream:\n    oauthbearer: {{{where}, expected_issuer: '{ISSUER}', "
            f"expected_audience: {AUDIENCE}}}\n")


class Minter:
    """librdkafka's oauth_cb: a fresh token of ``subject`` at each call, counted."""

    def __init__(self, key: SigningKey, subject: str, lifetime: float = 3600,
                 **claims: Any) -> None:
        self.key, self.subject, self.lifetime, self.claims = key, subject, lifetime, claims
        self.tokens: list[str] = []

    def __call__(self, _config: str) -> tuple[str, float]:
        token = self.key.token(self.subject, lifetime=self.lifetime, **self.claims)
        self.tokens.append(token)
        # librdkafka will not send a token it is told has expired: an expired one (for
        # the proxy to refuse) is said to last a minute.  Otherwise its exp, which is
        # what the proxy ends the session at (whole seconds: up to one before now +
        # lifetime), so that librdkafka renews it when it should.
        if self.lifetime <= 0:
            return token, time.time() + 60
        expires = jwt.decode(token, options={"verify_signature": False}).get("exp")
        return token, float(expires) if expires is not None else time.time() + self.lifetime


def oauth_conf(proxy: ProxyThread, minter: Minter, **extra: Any) -> dict[str, Any]:
    return {"bootstrap.servers": proxy.bootstrap, "security.protocol": "SASL_PLAINTEXT",
            "sasl.mechanism": "OAUTHBEARER", "oauth_cb": minter, **extra}


def java_producer(kafka: KafkaCluster, proxy: ProxyThread, directory: Path, topic: str,
                  token: str, records: int) -> Any:
    """ProducerPerformance through the proxy, logging in with ``token`` (Kafka's own
    OAUTHBEARER login, reading the token from a file)."""
    token_file = directory / f"{unique('token')}.jwt"
    token_file.write_text(token)
    settings = directory / "producer.properties"
    settings.write_text(
        f"bootstrap.servers={proxy.bootstrap}\nacks=all\n"
        "security.protocol=SASL_PLAINTEXT\nsasl.mechanism=OAUTHBEARER\n"
        "sasl.login.callback.handler.class=org.apache.kafka.common.security.oauthbearer."
        "OAuthBearerLoginCallbackHandler\n"
        f"sasl.oauthbearer.token.endpoint.url={token_file.as_uri()}\n"
        "sasl.jaas.config=org.apache.kafka.common.security.oauthbearer."
        "OAuthBearerLoginModule required ;\n")
    return kafka.run_java_tool(
        "org.apache.kafka.tools.ProducerPerformance", "--topic", topic,
        "--num-records", str(records), "--record-size", "100", "--throughput", "-1",
        "--producer.config", str(settings), timeout=120,
        jvm_opts=("-Xmx256m", f"-Dorg.apache.kafka.sasl.oauthbearer.allowed.urls="
                  f"{token_file.as_uri()}"))


def no_token_in(caplog: pytest.LogCaptureFixture, tokens: list[str]) -> None:
    text = "\n".join(f"{r.getMessage()} {getattr(r, 'gatehouse_fields', '')}"
                     for r in caplog.records)
    for token in tokens:
        # A token's signature is what makes it a credential: none may be logged.
        assert token.rsplit(".", 1)[1] not in text


def test_clients_log_in_with_tokens_the_proxy_checks(
        kafka: KafkaCluster, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="gatehouse.proxy")
    rsa, ec = rsa_key(), ec_key()
    jwks = write_jwks(tmp_path / "jwks.json", rsa, ec)
    topic = unique("oauth")
    kafka.create_topic(topic)
    minted: list[str] = []
    with ProxyThread(kafka.bootstrap, extra_config=oauth_config(str(jwks)),
                     rules_yaml=RULES) as proxy:
        orders = Minter(rsa, "svc-orders")
        sent = produce(oauth_conf(proxy, orders), topic, count=20)
        reports = Minter(ec, "svc-reports")
        assert sorted(consume(oauth_conf(proxy, reports), topic, 20)) == sorted(sent)
        # The census counts live connections by the token's subject.
        live = ck.Producer(oauth_conf(proxy, orders))
        live.produce(topic, b"live")
        assert live.flush(30) == 0
        assert proxy.sample_reaches("gatehouse_principals", 1, principal="svc-orders") >= 1
        del live

        # Rules see the token's subject: svc-reports may not delete the topic.
        admin = AdminClient(oauth_conf(proxy, Minter(ec, "svc-reports")))
        with pytest.raises(ck.KafkaException, match="CLUSTER_AUTHORIZATION_FAILED"):
            admin.delete_topics([topic], operation_timeout=10)[topic].result(timeout=30)
        assert topic in AdminClient({"bootstrap.servers": kafka.bootstrap}).list_topics(
            timeout=10).topics

        # kafka-python and aiokafka, each with its token provider.
        from kafka.net.sasl.oauth import AbstractTokenProvider as KafkaPythonProvider

        class KafkaPythonTokens(KafkaPythonProvider):
            def token(self) -> str:
                minted.append(rsa.token("svc-legacy"))
                return minted[-1]

        args = {"bootstrap_servers": proxy.bootstrap, "security_protocol": "SASL_PLAINTEXT",
                "sasl_mechanism": "OAUTHBEARER",
                "sasl_oauth_token_provider": KafkaPythonTokens()}
        legacy = [f"legacy-{i}".encode() for i in range(7)]
        kafka_python_produce(args, legacy, topic)
        assert sorted(kafka_python_read(args, topic, 28)) == sorted([*sent, b"live", *legacy])

        from aiokafka.abc import AbstractTokenProvider

        class AioTokens(AbstractTokenProvider):
            async def token(self) -> str:
                minted.append(ec.token("svc-async"))
                return minted[-1]

        aiokafka_produce([f"aio-{i}".encode() for i in range(5)], topic,
                         bootstrap_servers=proxy.bootstrap, security_protocol="SASL_PLAINTEXT",
                         sasl_mechanism="OAUTHBEARER", sasl_oauth_token_provider=AioTokens())

        # Kafka's own login module, with its token read from a file.
        java_token = rsa.token("svc-java")
        minted.append(java_token)
        java = java_producer(kafka, proxy, tmp_path, topic, java_token, 300)
        assert java.returncode == 0, java.stderr[-3000:]
        assert "300 records sent" in java.stdout
        assert proxy.sample("gatehouse_responses_total", api="SaslAuthenticate",
                            error="SASL_AUTHENTICATION_FAILED") == 0
    assert watermarks(kafka.bootstrap, topic) == (0, 20 + 1 + 7 + 5 + 300)
    authenticated = {f["principal"] for f in logged(caplog, "client authenticated")}
    assert authenticated == {"svc-orders", "svc-reports", "svc-legacy", "svc-async",
                             "svc-java"}
    assert {f["mechanism"] for f in logged(caplog, "client authenticated")} == {"OAUTHBEARER"}
    no_token_in(caplog, [*orders.tokens, *reports.tokens, *minted])


def test_a_bad_token_is_refused_with_the_check_it_failed(
        kafka: KafkaCluster, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="gatehouse.proxy")
    rsa, stranger = rsa_key(), rsa_key("rsa-1")  # the same key id, another key
    jwks = write_jwks(tmp_path / "jwks.json", rsa)
    topic = unique("oauth-refused")
    kafka.create_topic(topic)
    with ProxyThread(kafka.bootstrap, extra_config=oauth_config(str(jwks))) as proxy:
        expired = Minter(rsa, "svc-late", lifetime=-120)
        errors = client_errors(oauth_conf(proxy, expired), topic)
        assert errors and errors[0].code() == ck.KafkaError._AUTHENTICATION
        assert "the token is expired" in errors[0].str()
        forged = Minter(stranger, "svc-forged")
        errors = client_errors(oauth_conf(proxy, forged), topic)
        assert errors and "signature does not verify" in errors[0].str()
        elsewhere = Minter(rsa, "svc-other", aud="billing")
        errors = client_errors(oauth_conf(proxy, elsewhere), topic)
        assert errors and "not for this audience" in errors[0].str()
        # Java sees Kafka's exception, with the same reason.
        java = java_producer(kafka, proxy, tmp_path, topic,
                             stranger.token("svc-java"), 10)
        assert "SaslAuthenticationException: Authentication failed: the token's signature " \
            "does not verify" in java.stderr + java.stdout, java.stderr[-3000:]
        assert proxy.sample("gatehouse_responses_total", api="SaslAuthenticate",
                            error="SASL_AUTHENTICATION_FAILED") >= 4
        assert proxy.sample("gatehouse_requests_total", api="Produce") == 0
    assert watermarks(kafka.bootstrap, topic) == (0, 0)
    failures = [f["reason"] for f in logged(caplog, "connection closed")
                if "SASL authentication" in f["reason"]]
    assert any("as 'svc-late' (OAUTHBEARER) failed: the token is expired" in r
               for r in failures), failures
    assert any("as 'svc-forged'" in r and "signature does not verify" in r
               for r in failures), failures
    no_token_in(caplog, [*expired.tokens, *forged.tokens, *elsewhere.tokens])


def test_a_session_ends_with_its_token(kafka: KafkaCluster, tmp_path: Path,
                                       caplog: pytest.LogCaptureFixture) -> None:
    """Tokens of 4 s: librdkafka fetches a new one before each runs out and logs in
    again on its connections (KIP-368); nothing is lost and no connection closes."""
    caplog.set_level(logging.DEBUG, logger="gatehouse.proxy")
    rsa = rsa_key()
    jwks = write_jwks(tmp_path / "jwks.json", rsa)
    topic = unique("oauth-renew")
    kafka.create_topic(topic)
    with ProxyThread(kafka.bootstrap, extra_config=oauth_config(str(jwks))) as proxy:
        minter = Minter(rsa, "svc-orders", lifetime=4)
        sent = produce_for(oauth_conf(proxy, minter), topic, 10)
    assert len(minter.tokens) >= 3  # a new token before each 4 s runs out
    again = logged(caplog, "client authenticated again")
    assert len(again) >= 2, len(again)
    closed = [f["reason"] for f in logged(caplog, "connection closed")]
    assert not [r for r in closed if "expired" in r], closed
    assert watermarks(kafka.bootstrap, topic) == (0, sent)


def test_a_providers_new_key_is_fetched_when_a_token_names_it(
        kafka: KafkaCluster, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gatehouse.proxy")
    old, new = rsa_key("2026-10"), ec_key("2026-11")
    server = JwksServer(old)
    topic = unique("oauth-rotate")
    kafka.create_topic(topic)
    with server.running(), ProxyThread(
            kafka.bootstrap, extra_config=oauth_config(server.url, url=True)) as proxy:
        assert server.requests == 1  # fetched before the proxy took clients
        produce(oauth_conf(proxy, Minter(old, "svc-orders")), topic, count=5)
        server.keys.append(new)  # the provider adds a key and signs with it
        produce(oauth_conf(proxy, Minter(new, "svc-orders")), topic, count=5)
        assert server.requests == 2
        # A key id nobody has, soon after: refused, and the provider is not asked again.
        errors = client_errors(oauth_conf(proxy, Minter(rsa_key("forged"), "eve")), topic)
        assert errors and "no key of the JWKS has the token's key id 'forged'" in errors[0].str()
        assert server.requests == 2
    assert watermarks(kafka.bootstrap, topic) == (0, 10)
    assert [f["url"] for f in logged(caplog, "JWKS fetched")] == [server.url]


def test_the_proxy_checks_tokens_as_kafkas_own_validator_does(
        kafka_libs: Path, tmp_path: Path) -> None:
    """The same tokens through the proxy's checks and a Kafka broker's validator
    (BrokerJwtValidator, with the same JWKS, issuer, audiences and clock skew): the
    same verdicts, the same principals."""
    rsa, ps, ec, ed = rsa_key(), rsa_key("ps-1", "PS256"), ec_key(), ed_key()
    jwks = write_jwks(tmp_path / "jwks.json", rsa, ps, ec, ed)
    now = time.time()
    confused = hmac_over_the_public_key(rsa)
    tokens = {
        "RS256": rsa.token("alice"),
        "PS256": ps.token("bob"),
        "ES256": ec.token("carol"),
        "EdDSA": ed.token("dave"),
        "no key id": rsa.token("erin", kid=None),
        "expired within the skew": rsa.token(issued=now - 3610, lifetime=3600),
        "expired past the skew": rsa.token(issued=now - 3700, lifetime=3600),
        "issued in the future": rsa.token(issued=now + 600),
        "not before, within the skew": rsa.token(nbf=int(now + 10)),
        "not before, past the skew": rsa.token(nbf=int(now + 120)),
        "one of the audiences": rsa.token(aud=["billing", "other"]),
        "another audience": rsa.token(aud="billing"),
        "no audience": rsa.token(aud=None),
        "another issuer": rsa.token(iss="https://elsewhere"),
        "no issuer": rsa.token(iss=None),
        "no subject": rsa.token(None),
        "a blank subject": rsa.token(" "),
        "a number for subject": rsa.token(sub=42),
        "no expiry": rsa.token(exp=None),
        "an expiry that is text": rsa.token(exp=str(int(now + 600))),
        "no issued-at": rsa.token(iat=None),
        "an issued-at that is text": rsa.token(iat="yesterday"),
        "scope as a list": rsa.token(scope=["kafka", "read"]),
        "scope as a number": rsa.token(scope=42),
        "another key, same id": rsa_key("rsa-1").token(),
        "an unknown key id": rsa_key("rsa-9").token(),
        "an EC key id, RS256": rsa.token(kid="ec-1"),
        "unsigned": jwt.encode({"sub": "eve", "iat": int(now), "exp": int(now) + 60,
                                "iss": ISSUER, "aud": AUDIENCE}, None, algorithm="none"),
        "HMAC over the public key": confused,
        "not a token": "abc",
    }
    token_file = tmp_path / "tokens.txt"
    token_file.write_text("\n".join(tokens.values()) + "\n")
    kafka_says = run_java_tool(
        kafka_libs, str(JAVA_SOURCES / "KafkaJwtOracle.java"), jwks.as_uri(), ISSUER,
        f"{AUDIENCE},other", "30", "sub", str(token_file), timeout=120,
        jvm_opts=("-Xmx256m", f"-Dorg.apache.kafka.sasl.oauthbearer.allowed.urls="
                  f"{jwks.as_uri()}"))
    assert kafka_says.returncode == 0, kafka_says.stderr[-3000:]
    validator = TokenValidator(OAuthSettings(jwks_file=jwks, expected_issuer=ISSUER,
                                             expected_audience=(AUDIENCE, "other")))

    def ours(token: str) -> str:
        try:
            return f"OK {validator.verify(token).principal}"
        except TokenRefused:
            return "REFUSED"

    verdicts = dict(zip(tokens, kafka_says.stdout.splitlines(), strict=True))
    assert {name: ours(token) for name, token in tokens.items()} == verdicts
    assert verdicts["RS256"] == "OK alice" and verdicts["unsigned"] == "REFUSED"



# -- the proxy's own tokens (sasl.upstream with OAUTHBEARER) --------------------------------

IDP_KEY = rsa_key("idp-1")
CLIENT_ID, CLIENT_SECRET = "gatehouse-proxy", "s3cret-8d1f"


@pytest.fixture(scope="module")
def kafka_oauth(kafka_libs: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[KafkaCluster]:
    """A broker whose SASL listener checks OAUTHBEARER tokens with Kafka's own validator
    against IDP_KEY's JWKS, and ends sessions after 4 s (connections.max.reauth.ms)."""
    jwks = write_jwks(tmp_path_factory.mktemp("idp") / "jwks.json", IDP_KEY)
    handler = "org.apache.kafka.common.security.oauthbearer.OAuthBearerValidatorCallbackHandler"
    with KafkaCluster(1, sasl_scram=True, libs=kafka_libs, extra_config={
            "listener.name.sasl_plaintext.oauthbearer.sasl.server.callback.handler.class":
                handler,
            "sasl.oauthbearer.jwks.endpoint.url": jwks.as_uri(),
            "sasl.oauthbearer.expected.audience": AUDIENCE,
            "sasl.oauthbearer.expected.issuer": ISSUER,
            "connections.max.reauth.ms": 4000,
    }, jvm_opts=(*BROKER_JVM_OPTS,
                 f"-Dorg.apache.kafka.sasl.oauthbearer.allowed.urls={jwks.as_uri()}")
    ) as cluster:
        yield cluster


def originating(url: str, secret: str = CLIENT_SECRET) -> str:
    return (f"sasl:\n  upstream: {{mechanism: OAUTHBEARER, token_endpoint_url: '{url}', "
            f"client_id: {CLIENT_ID}, client_secret: {secret}, scope: kafka}}\n")


def test_the_proxy_logs_in_to_the_brokers_with_its_own_tokens(
        kafka_oauth: KafkaCluster, caplog: pytest.LogCaptureFixture) -> None:
    """Clients with no SASL at all reach a broker that takes only tokens: the proxy
    gets one from the token endpoint (once for all its broker connections), logs in
    with it, and, as the broker's 4 s sessions end, logs in again on each connection
    with a fresh one (tokens of 6 s), between the clients' requests: nothing is lost."""
    caplog.set_level(logging.DEBUG, logger="gatehouse.proxy")
    topic = unique("oauth-up")
    kafka_oauth.create_topic(topic)
    endpoint = TokenEndpoint(IDP_KEY, CLIENT_ID, CLIENT_SECRET, lifetime=6)
    with endpoint.running(), ProxyThread(kafka_oauth.sasl_bootstrap,
                                         extra_config=originating(endpoint.url)) as proxy:
        conf = {"bootstrap.servers": proxy.bootstrap}
        sent = produce(conf, topic, count=30)
        assert len(endpoint.issued) == 1 and endpoint.scopes == ["kafka"]
        assert sorted(consume(conf, topic, 30)) == sorted(sent)
        count = produce_for(conf, topic, 10)
    assert watermarks(kafka_oauth.bootstrap, topic) == (0, 30 + count)
    again = logged(caplog, "re-authenticated to the broker")
    assert len(again) >= 2, len(again)
    assert len(endpoint.issued) >= 2  # a fresh token once 80% of one had passed
    closed = [f["reason"] for f in logged(caplog, "connection closed")]
    assert not [r for r in closed if "authentic" in r], closed
    no_token_in(caplog, endpoint.issued)
    text = "\n".join(f"{r.getMessage()} {getattr(r, 'gatehouse_fields', '')}"
                     for r in caplog.records)
    assert CLIENT_SECRET not in text


def test_the_proxys_token_trouble_is_reported_naming_the_broker(
        kafka_oauth: KafkaCluster, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gatehouse.proxy")
    topic = unique("oauth-up-refused")
    kafka_oauth.create_topic(topic)
    broker = kafka_oauth.sasl_bootstrap

    def reasons_after_a_client_tries(proxy: ProxyThread) -> list[str]:
        errors: list[ck.KafkaError] = []
        producer = ck.Producer({"bootstrap.servers": proxy.bootstrap, "log_level": 0,
                                "error_cb": errors.append, "message.timeout.ms": 3000})
        producer.produce(topic, b"never")
        producer.flush(10)
        assert errors  # the client is let go, not left hanging
        assert proxy.sample("gatehouse_upstream_failures_total", broker=broker) >= 1
        assert not proxy.proxy.upstream_reachable
        return [str(f.get("reason")) for f in logged(caplog, "connection closed")
                if "SASL authentication failed" in str(f.get("reason"))]

    # The identity provider does not know the proxy's secret.
    endpoint = TokenEndpoint(IDP_KEY, CLIENT_ID, CLIENT_SECRET)
    with endpoint.running(), ProxyThread(broker, extra_config=originating(
            endpoint.url, "wrong-secret")) as proxy:
        failures = reasons_after_a_client_tries(proxy)
    assert any(f"{broker}: SASL authentication failed: the token endpoint {endpoint.url} "
               "answered 401 (invalid_client: bad client credentials)" in r
               for r in failures), failures
    caplog.clear()
    # The broker refuses the token it gets (meant for another audience).
    endpoint = TokenEndpoint(IDP_KEY, CLIENT_ID, CLIENT_SECRET, aud="billing")
    with endpoint.running(), ProxyThread(broker, extra_config=originating(endpoint.url)) as proxy:
        failures = reasons_after_a_client_tries(proxy)
    # Kafka answers with SASL_AUTHENTICATION_FAILED at once, RFC 7628's words inside.
    assert any(f"{broker}: SASL authentication failed: the broker refused {CLIENT_ID!r} "
               '(OAUTHBEARER): {"status":"invalid_token"}' in r for r in failures), failures
    caplog.clear()
    # A token kept fresh in a file by something else: read at every login.
    token_file = tmp_path / "token.jwt"
    token_file.write_text(IDP_KEY.token("gatehouse") + "\n")
    with ProxyThread(broker, extra_config="sasl:\n  upstream: {mechanism: OAUTHBEARER, "
                     f"token_file: {token_file}}}\n") as proxy:
        sent = produce({"bootstrap.servers": proxy.bootstrap}, topic, count=5)
        token_file.write_text("")  # emptied: the next broker connection cannot log in
        failures = reasons_after_a_client_tries(proxy)
    assert any(f"the token file {token_file} is empty" in r for r in failures), failures
    assert len(sent) == 5
    assert watermarks(kafka_oauth.bootstrap, topic) == (0, 5)


def test_an_old_client_logs_in_with_raw_tokens(kafka: KafkaCluster, tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """SaslHandshake v0 (kafka-python pinned below 1.0): the OAUTHBEARER message and the
    proxy's answer travel with no Kafka header; a refused token's challenge too, and the
    connection then closes."""
    from kafka import KafkaProducer
    from kafka.errors import KafkaError
    from kafka.net.sasl.oauth import AbstractTokenProvider as KafkaPythonProvider

    caplog.set_level(logging.INFO, logger="gatehouse.proxy")
    rsa = rsa_key()
    jwks = write_jwks(tmp_path / "jwks.json", rsa)
    topic = unique("oauth-raw")
    kafka.create_topic(topic)

    class Tokens(KafkaPythonProvider):
        def __init__(self, token: str) -> None:
            self._token = token

        def token(self) -> str:
            return self._token

    def producer(token: str) -> Any:
        return KafkaProducer(bootstrap_servers=proxy.bootstrap, api_version=(0, 11),
                             security_protocol="SASL_PLAINTEXT", sasl_mechanism="OAUTHBEARER",
                             sasl_oauth_token_provider=Tokens(token), acks="all",
                             max_block_ms=5000)

    with ProxyThread(kafka.bootstrap, extra_config=oauth_config(str(jwks))) as proxy:
        good = producer(rsa.token("svc-old"))
        for i in range(5):
            good.send(topic, f"old-{i}".encode())
        good.flush(30)
        assert proxy.sample_reaches("gatehouse_principals", 1, principal="svc-old") >= 1
        good.close()
        # The exchange took the raw path: SaslHandshake v0, no SaslAuthenticate.
        assert requests_counted(proxy, "SaslHandshake", "0") >= 2  # bootstrap, broker
        assert requests_counted(proxy, "SaslAuthenticate", None) == 0
        bad = producer(rsa.token("svc-stale", aud="billing"))
        with pytest.raises(KafkaError):
            bad.send(topic, b"never").get(timeout=10)
        bad.close()
    assert watermarks(kafka.bootstrap, topic) == (0, 5)
    failures = [f["reason"] for f in logged(caplog, "connection closed")
                if "SASL authentication" in str(f["reason"])]
    assert failures and all("as 'svc-stale' (OAUTHBEARER) failed: the token is not for "
                            "this audience (aud)" in r for r in failures), failures


def test_the_capture_sink_logs_in_with_a_token(kafka_oauth: KafkaCluster,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """capture.kafka.sasl with OAUTHBEARER: the observation log reaches a topic on a
    cluster that takes only tokens; a client secret the endpoint refuses is counted and
    explained, the secret not in the log."""
    from gatehouse.capture.kafka_sink import KafkaSink, KafkaSinkSettings
    from gatehouse.proxy.config import Address
    from gatehouse.proxy.oauth import OAuthClient
    from tests.integration.test_capture_kafka import observations

    obs = unique("observations")
    address = Address("127.0.0.1", kafka_oauth.nodes[0].sasl_port or 0)
    endpoint = TokenEndpoint(IDP_KEY, CLIENT_ID, CLIENT_SECRET)
    with endpoint.running():
        sink = KafkaSink(KafkaSinkSettings(topic=obs, linger_seconds=0, sasl=OAuthClient(
            endpoint.url, CLIENT_ID, CLIENT_SECRET)), [address])
        for i in range(20):
            sink.offer({"v": 1, "time": time.time(), "conn": i})
        assert sink.close(30)
        assert sink.statistics().written == 20
        assert endpoint.issued  # logged in with the endpoint's token
        caplog.clear()
        refused = KafkaSink(KafkaSinkSettings(topic=obs, retries=0, linger_seconds=0,
                                              sasl=OAuthClient(endpoint.url, CLIENT_ID,
                                                               "wrong-secret")), [address])
        refused.offer({"v": 1, "time": time.time(), "conn": 1})
        assert refused.close(30)
        assert (refused.statistics().written, refused.statistics().write_errors) == (0, 1)
    text = "\n".join(str(r.__dict__.get("gatehouse_fields")) for r in caplog.records)
    assert "answered 401 (invalid_client: bad client credentials)" in text
    assert "wrong-secret" not in text
    values = [json.loads(m.value()) for m in observations({"bootstrap.servers":
                                                           kafka_oauth.bootstrap}, obs, 20)]
    assert sorted(v["conn"] for v in values) == list(range(20))
