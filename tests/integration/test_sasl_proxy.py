"""SASL at the proxy on a real Apache Kafka broker, with real clients.

Termination (``sasl.downstream``): librdkafka, kafka-python, aiokafka and the Java
producer authenticate with the proxy (PLAIN, SCRAM-SHA-256, SCRAM-SHA-512) against its
users file; the broker's plain listener never sees SASL; the proven user is the
principal rules match.  A wrong password is refused the way a broker refuses it, an
unauthenticated request closes the connection, and no password reaches the log.
Origination (``sasl.upstream``): clients with no SASL at all reach the broker's SCRAM
listener as the proxy's user; a wrong proxy password is reported, naming the broker.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import confluent_kafka as ck
import pytest
from confluent_kafka.admin import AdminClient

from gatehouse import codecs
from gatehouse.codecs.scram import ScramCredential
from tests.reliability.support import (
    GatehouseProcess,
    api_versions_request,
    connect,
    read_frame,
    wait_until,
)
from tests.support.clients import (
    aiokafka_produce,
    consume,
    kafka_python_produce,
    kafka_python_read,
    produce,
    produce_and_consume_for,
    produce_for,
    unique,
    watermarks,
)
from tests.support.fakebroker import frame_bytes, request
from tests.support.kafka import SCRAM_MECHANISM, SCRAM_PASSWORD, SCRAM_USER, KafkaCluster
from tests.support.ports import free_port
from tests.support.proxythread import ProxyThread

ALICE_PASSWORD = "alice-pw-7f3a"
BOB_PASSWORD = "bob-pw-91c2"
WRONG_PASSWORD = "not-it-55e0"
SECRETS = (ALICE_PASSWORD, BOB_PASSWORD, WRONG_PASSWORD, SCRAM_PASSWORD)
# bob may not delete topics; everyone else may.
RULES = ("- name: bob-keeps-topics\n  match: {principal: '^bob$'}\n"
         "  deny_apis: [DeleteTopics]\n")


@pytest.fixture()
def users_file(tmp_path: Path) -> Path:
    """alice by password (in a file), bob by a SCRAM-SHA-512 credential only."""
    (tmp_path / "alice.secret").write_text(ALICE_PASSWORD + "\n")
    bob = ScramCredential.from_password("SCRAM-SHA-512", BOB_PASSWORD).as_dict()
    path = tmp_path / "users.yaml"
    path.write_text(f"users:\n  alice: {{password_file: alice.secret}}\n"
                    f"  bob:\n    SCRAM-SHA-512: {bob}\n")
    return path


def terminating(users: Path) -> str:
    return f"sasl:\n  downstream: {{users_file: {users}}}\n"


def sasl_conf(proxy: ProxyThread, mechanism: str, user: str, password: str) -> dict[str, Any]:
    return {"bootstrap.servers": proxy.bootstrap, "security.protocol": "SASL_PLAINTEXT",
            "sasl.mechanism": mechanism, "sasl.username": user, "sasl.password": password}


def logged(caplog: pytest.LogCaptureFixture, message: str) -> list[dict[str, Any]]:
    return [r.gatehouse_fields for r in caplog.records  # type: ignore[attr-defined]
            if r.getMessage() == message]


def wait_for(found: Callable[[], Any], timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := found()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def client_errors(conf: dict[str, Any], topic: str) -> list[ck.KafkaError]:
    """The errors a librdkafka producer reports trying to send one record (none is
    delivered: the test then purges it)."""
    errors: list[ck.KafkaError] = []
    producer = ck.Producer({**conf, "error_cb": errors.append, "log_level": 0})
    producer.produce(topic, b"never")
    wait_for(lambda: (producer.poll(0.1), errors)[1])
    producer.purge()
    producer.flush(1)
    return errors


def java_producer_as_bob(kafka: KafkaCluster, proxy: ProxyThread, directory: Path,
                         topic: str, records: int, throughput: int) -> None:
    """ProducerPerformance through the proxy as bob (SCRAM-SHA-512): every record sent
    (``throughput`` records a second; -1: as fast as it can)."""
    settings = directory / "producer.properties"
    settings.write_text(
        f"bootstrap.servers={proxy.bootstrap}\nacks=all\n"
        "security.protocol=SASL_PLAINTEXT\nsasl.mechanism=SCRAM-SHA-512\n"
        "sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule "
        f'required username="bob" password="{BOB_PASSWORD}";\n')
    result = kafka.run_java_tool(
        "org.apache.kafka.tools.ProducerPerformance", "--topic", topic,
        "--num-records", str(records), "--record-size", "100", "--throughput",
        str(throughput), "--producer.config", str(settings), timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"{records} records sent" in result.stdout


def no_secret_in(caplog: pytest.LogCaptureFixture) -> None:
    text = "\n".join(f"{r.getMessage()} {getattr(r, 'gatehouse_fields', '')}"
                     for r in caplog.records)
    for secret in SECRETS:
        assert secret not in text


def test_clients_authenticate_with_the_proxy(kafka_scram: KafkaCluster, users_file: Path,
                                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="gatehouse.proxy")
    topic = unique("terminated")
    kafka_scram.create_topic(topic)
    # The broker's plain listener: it never hears SASL; the proxy does all of it.
    with ProxyThread(kafka_scram.bootstrap, extra_config=terminating(users_file),
                     rules_yaml=RULES) as proxy:
        alice_plain = sasl_conf(proxy, "PLAIN", "alice", ALICE_PASSWORD)
        sent = produce(alice_plain, topic, count=20)
        alice_scram = sasl_conf(proxy, "SCRAM-SHA-256", "alice", ALICE_PASSWORD)
        assert sorted(consume(alice_scram, topic, 20)) == sorted(sent)
        assert proxy.sample_reaches("gatehouse_principals", 1, principal="alice") >= 1

        # kafka-python as bob (SCRAM-SHA-512 against a stored credential).
        bob_args = {"bootstrap_servers": proxy.bootstrap, "security_protocol": "SASL_PLAINTEXT",
                    "sasl_mechanism": "SCRAM-SHA-512", "sasl_plain_username": "bob",
                    "sasl_plain_password": BOB_PASSWORD}
        bobs = [f"bob-{i}".encode() for i in range(7)]
        kafka_python_produce(bob_args, bobs, topic)
        assert sorted(kafka_python_read(bob_args, topic, 27)) == sorted([*sent, *bobs])

        # Rules see the proven user: bob may not delete the topic, alice may not be him.
        bob_admin = AdminClient(sasl_conf(proxy, "SCRAM-SHA-512", "bob", BOB_PASSWORD))
        future = bob_admin.delete_topics([topic], operation_timeout=10)[topic]
        with pytest.raises(ck.KafkaException):
            future.result(timeout=30)
        assert topic in AdminClient(kafka_scram.client_config()).list_topics(timeout=10).topics

        # aiokafka as alice (SCRAM-SHA-256).
        aiokafka_produce([f"aio-{i}".encode() for i in range(5)], topic,
                         bootstrap_servers=proxy.bootstrap, security_protocol="SASL_PLAINTEXT",
                         sasl_mechanism="SCRAM-SHA-256", sasl_plain_username="alice",
                         sasl_plain_password=ALICE_PASSWORD)

        # The Java producer as bob (SCRAM-SHA-512).
        java_producer_as_bob(kafka_scram, proxy, users_file.parent, topic, 300, -1)
        assert proxy.sample("gatehouse_responses_total", api="SaslAuthenticate",
                            error="SASL_AUTHENTICATION_FAILED") == 0
    assert watermarks(kafka_scram.bootstrap, topic) == (0, 20 + 7 + 5 + 300)
    authenticated = {f["principal"] for f in logged(caplog, "client authenticated")}
    assert authenticated == {"alice", "bob"}
    no_secret_in(caplog)


def test_a_wrong_password_is_refused_as_a_broker_refuses_it(
        kafka_scram: KafkaCluster, users_file: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gatehouse.proxy")
    topic = unique("refused")
    kafka_scram.create_topic(topic)
    with ProxyThread(kafka_scram.bootstrap, extra_config=terminating(users_file)) as proxy:
        for mechanism, user in (("PLAIN", "alice"), ("SCRAM-SHA-512", "bob"),
                                ("SCRAM-SHA-256", "mallory")):
            errors = client_errors(sasl_conf(proxy, mechanism, user, WRONG_PASSWORD), topic)
            assert errors and errors[0].code() == ck.KafkaError._AUTHENTICATION, errors
            assert "Invalid username or password" in errors[0].str()
        expected = ("as 'alice' (PLAIN) failed: invalid credentials",
                    "as 'bob' (SCRAM-SHA-512) failed: invalid credentials",
                    "as 'mallory' (SCRAM-SHA-256) failed: invalid credentials")

        def failures() -> list[str]:
            return [r for r in (str(f["reason"]) for f in logged(caplog, "connection closed"))
                    if "SASL authentication" in r]

        wait_for(lambda: all(any(e in r for r in failures()) for e in expected))
        for each in expected:  # the name given, the mechanism, never the password
            assert any(each in r for r in failures()), (each, failures())
        assert proxy.sample("gatehouse_responses_total", api="SaslAuthenticate",
                            error="SASL_AUTHENTICATION_FAILED") >= 3

        # A mechanism the proxy does not offer is refused in the handshake.
        errors = client_errors({**sasl_conf(proxy, "OAUTHBEARER", "x", "y"),
                                "enable.sasl.oauthbearer.unsecure.jwt": True}, topic)
        assert errors and "OAUTHBEARER" in errors[0].str(), errors

        # Before authenticating, ApiVersions is answered and anything else closes.
        with connect(proxy.port) as sock:
            sock.sendall(api_versions_request(1))
            answer = read_frame(sock)
            assert answer is not None
            assert codecs.decode_response(answer, 18, 3).body.api_keys
            sock.sendall(frame_bytes(request(3, 12, 2, topics=None).encode()))
            assert sock.recv(4) == b""
        reasons = wait_for(lambda: [f["reason"] for f in logged(caplog, "connection closed")
                                    if "before SASL" in str(f["reason"])])
        assert reasons == ["Metadata before SASL authentication (sasl.downstream: the client "
                           "must authenticate first)"]
    assert watermarks(kafka_scram.bootstrap, topic) == (0, 0)
    no_secret_in(caplog)


def test_an_old_client_with_raw_sasl_tokens(kafka_scram: KafkaCluster, users_file: Path) -> None:
    """SaslHandshake v0: the tokens that follow have no Kafka header, and neither have
    the proxy's answers (kafka-python pinned below 1.0 speaks it)."""
    from kafka import KafkaProducer

    topic = unique("raw")
    kafka_scram.create_topic(topic)
    with ProxyThread(kafka_scram.bootstrap, extra_config=terminating(users_file)) as proxy:
        for mechanism, user, password in (("PLAIN", "alice", ALICE_PASSWORD),
                                          ("SCRAM-SHA-512", "bob", BOB_PASSWORD)):
            producer = KafkaProducer(bootstrap_servers=proxy.bootstrap, api_version=(0, 11),
                                     security_protocol="SASL_PLAINTEXT",
                                     sasl_mechanism=mechanism, sasl_plain_username=user,
                                     sasl_plain_password=password, acks="all")
            for i in range(5):
                producer.send(topic, f"{user}-{i}".encode())
            producer.flush(30)
            assert proxy.sample_reaches("gatehouse_principals", 1, principal=user) >= 1
            producer.close()
        # The exchange took the raw path: SaslHandshake v0, no SaslAuthenticate.
        assert requests_counted(proxy, "SaslHandshake", "0") >= 2  # bootstrap, broker
        assert requests_counted(proxy, "SaslAuthenticate", None) == 0
    assert watermarks(kafka_scram.bootstrap, topic) == (0, 10)


def test_the_proxy_authenticates_to_the_brokers(kafka_scram: KafkaCluster, tmp_path: Path,
                                                users_file: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gatehouse.proxy")
    (tmp_path / "proxy.secret").write_text(SCRAM_PASSWORD + "\n")
    topic = unique("originated")
    kafka_scram.create_topic(topic)
    upstream = (f"sasl:\n  upstream: {{mechanism: {SCRAM_MECHANISM}, username: {SCRAM_USER}, "
                f"password_file: {tmp_path / 'proxy.secret'}}}\n")
    # Clients with no SASL at all, at the broker's SCRAM listener through the proxy.
    with ProxyThread(kafka_scram.sasl_bootstrap, extra_config=upstream) as proxy:
        conf = {"bootstrap.servers": proxy.bootstrap}
        sent = produce(conf, topic, count=30)
        assert sorted(consume(conf, topic, 30)) == sorted(sent)
        # A client that tries SASL itself is told what is wrong, not left to guess.
        assert client_errors(sasl_conf(proxy, "PLAIN", "x", "y"), topic)
        assert wait_for(lambda: [f for f in logged(caplog, "connection closed")
                                 if "sasl.upstream" in str(f["reason"])])

    # Both at once: clients prove who they are to the proxy, the broker sees the proxy.
    with ProxyThread(kafka_scram.sasl_bootstrap,
                     extra_config=upstream + f"  downstream: {{users_file: {users_file}}}\n"
                     ) as proxy:
        conf = sasl_conf(proxy, "SCRAM-SHA-512", "bob", BOB_PASSWORD)
        more = produce(conf, topic, count=10, tag="both")
        assert sorted(consume(conf, topic, 40)) == sorted([*sent, *more])
        assert proxy.sample_reaches("gatehouse_principals", 1, principal="bob") >= 1

    # The wrong proxy password: reported with the broker's reason, the client let go.
    (tmp_path / "proxy.secret").write_text(WRONG_PASSWORD)
    with ProxyThread(kafka_scram.sasl_bootstrap, extra_config=upstream) as proxy:
        errors = []
        producer = ck.Producer({"bootstrap.servers": proxy.bootstrap, "log_level": 0,
                                "error_cb": errors.append, "message.timeout.ms": 3000})
        producer.produce(topic, b"never")
        producer.flush(10)
        failures = [f for f in logged(caplog, "connection closed")
                    if "SASL authentication failed" in str(f.get("reason"))]
        assert failures, [f.get("reason") for f in logged(caplog, "connection closed")]
        assert f"the broker refused '{SCRAM_USER}' ({SCRAM_MECHANISM})" in failures[0]["reason"]
        assert proxy.sample("gatehouse_upstream_failures_total",
                            broker=kafka_scram.sasl_bootstrap) >= 1
        assert not proxy.proxy.upstream_reachable
    assert watermarks(kafka_scram.bootstrap, topic) == (0, 40)
    no_secret_in(caplog)


def requests_counted(proxy: ProxyThread, api: str, version: str | None) -> float:
    """``gatehouse_requests_total`` of ``api`` (at ``version``, or any), summed."""
    return sum(sample.value for family in proxy.metrics.registry.collect()
               for sample in family.samples
               if sample.name == "gatehouse_requests_total" and sample.labels["api"] == api
               and version in (None, sample.labels["version"]))


def test_clients_outlive_the_brokers_sasl_session_limit(kafka_libs: Path, tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    """A broker that ends SASL sessions after 6 s (connections.max.reauth.ms) closes a
    connection whose session ran out at its next request.  The proxy authenticates
    again on each broker connection in the middle of its client's traffic (KIP-368), at
    85% of the session: a producer and a consumer running for 15 s keep their
    connections, lose nothing and see no error at all."""
    caplog.set_level(logging.DEBUG, logger="gatehouse.proxy")
    (tmp_path / "proxy.secret").write_text(SCRAM_PASSWORD)
    with KafkaCluster(1, sasl_scram=True, libs=kafka_libs,
                      extra_config={"connections.max.reauth.ms": 6000}) as cluster:
        topic = unique("reauth")
        cluster.create_topic(topic)
        upstream = (f"sasl:\n  upstream: {{mechanism: {SCRAM_MECHANISM}, "
                    f"username: {SCRAM_USER}, password_file: {tmp_path / 'proxy.secret'}}}\n")
        with ProxyThread(cluster.sasl_bootstrap, extra_config=upstream) as proxy:
            sent, got = produce_and_consume_for(proxy.bootstrap, topic, 15)
        assert sorted(got) == sorted(sent) and len(sent) > 50
        again = logged(caplog, "re-authenticated to the broker")
        assert len(again) >= 4, len(again)  # producer and consumer, twice each at least
        assert all(f["session_seconds"] == 6.0 for f in again)
        # No connection was lost to it: none was closed by the broker (an expired
        # session) or by a failed re-authentication (a client closing while an answer
        # was on its way, a broken pipe, is the client's own doing).
        reasons = {f["reason"] for f in logged(caplog, "connection closed")}
        assert not [r for r in reasons if "broker" in r or "authentication" in r], reasons
        assert watermarks(cluster.bootstrap, topic) == (0, len(sent))


def test_users_come_and_go_with_the_users_file(kafka_scram: KafkaCluster, users_file: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """A reload (SIGHUP, or the file changed: gatehouse.proxy.setup wires both) adds and
    removes users; a removed user's open connections end; a file that does not load
    keeps the users."""
    caplog.set_level(logging.INFO, logger="gatehouse.proxy")
    topic = unique("users")
    kafka_scram.create_topic(topic)
    with ProxyThread(kafka_scram.bootstrap, extra_config=terminating(users_file)) as proxy:
        users = proxy.proxy.sasl_users
        assert users is not None

        def reload() -> bool:
            assert users is not None
            return bool(proxy.call(users.reload))  # in the proxy's thread, as SIGHUP does

        carol = sasl_conf(proxy, "SCRAM-SHA-256", "carol", "carols-pw")
        assert client_errors(carol, topic)[0].code() == ck.KafkaError._AUTHENTICATION
        users_file.write_text(users_file.read_text() + "  carol: {password: carols-pw}\n")
        assert reload()
        produce(carol, topic, count=3)
        users_file.write_text("users:\n  carol: {password: carols-pw\n")  # broken
        assert not reload()
        assert any("users.yaml:" in str(f["error"])
                   for f in logged(caplog, "SASL users reload failed: keeping the old users"))
        produce(sasl_conf(proxy, "PLAIN", "alice", ALICE_PASSWORD), topic, count=2)
        # alice connected when she is removed: her connections end, new ones fail.
        alice_admin = AdminClient({**sasl_conf(proxy, "PLAIN", "alice", ALICE_PASSWORD),
                                   "log_level": 0})
        assert topic in alice_admin.list_topics(timeout=10).topics

        def alice_on_a_broker_listener() -> bool:
            # librdkafka drops its bootstrap connection once it knows the brokers and
            # keeps one to a broker's listener: wait for that one to be authenticated
            # (on a busy machine the reload could otherwise land between the two).
            return bool(proxy.call(lambda: any(
                s.sasl_user == "alice" and s.conn.listener != "bootstrap"
                for s in list(users.sessions))))

        assert wait_for(alice_on_a_broker_listener), "alice's admin client is not connected"
        users_file.write_text("users:\n  carol: {password: carols-pw}\n")  # alice removed
        assert reload()
        ended = wait_for(lambda: [f for f in logged(caplog, "connection closed")
                                  if f.get("principal") == "alice" and "removed" in
                                  str(f["reason"])])
        assert ended and ended[0]["reason"] == "SASL user 'alice' removed from the users file", (
            "; ".join(f"{f.get('principal')}: {f['reason']}"
                      for f in logged(caplog, "connection closed")))
        with pytest.raises(ck.KafkaException):
            alice_admin.list_topics(timeout=5)
        errors = client_errors(sasl_conf(proxy, "PLAIN", "alice", ALICE_PASSWORD), topic)
        assert errors[0].code() == ck.KafkaError._AUTHENTICATION
        # carol's password is the same after the reloads: her connections were left alone.
        assert not [f for f in logged(caplog, "connection closed")
                    if f.get("principal") == "carol" and "SASL user" in str(f["reason"])]
    assert watermarks(kafka_scram.bootstrap, topic) == (0, 5)

    # `gatehouse run` reloads the users file on SIGHUP.
    port = free_port()
    config = users_file.parent / "gatehouse.yaml"
    config.write_text(f"listen: 127.0.0.1:{port}\nupstream: [{kafka_scram.bootstrap}]\n"
                      "brokers: {start_port: 0}\n" + terminating(users_file))
    with GatehouseProcess(config, port, users_file.parent / "gatehouse.log") as process:
        dave = {"bootstrap.servers": f"127.0.0.1:{port}", "security.protocol": "SASL_PLAINTEXT",
                "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "dave",
                "sasl.password": "daves-pw"}
        assert client_errors(dave, topic)[0].code() == ck.KafkaError._AUTHENTICATION
        users_file.write_text(users_file.read_text() + "  dave: {password: daves-pw}\n")
        process.signal(signal.SIGHUP)
        wait_until(lambda: "SASL users reloaded" in process.log_text(), 10, "the reload")
        produce(dave, topic, count=4)
    assert watermarks(kafka_scram.bootstrap, topic) == (0, 9)


def test_clients_authenticate_again_when_their_session_ends(
        kafka_scram: KafkaCluster, users_file: Path, caplog: pytest.LogCaptureFixture) -> None:
    """sasl.downstream.session_lifetime: 3 s (KIP-368, as a broker's
    connections.max.reauth.ms): librdkafka and the Java producer authenticate again on
    their connections and go on; nothing is lost and no connection closes."""
    caplog.set_level(logging.DEBUG, logger="gatehouse.proxy")
    topic = unique("reauth-clients")
    kafka_scram.create_topic(topic)
    config = (f"sasl:\n  downstream: {{users_file: {users_file}, session_lifetime: 3}}\n")
    with ProxyThread(kafka_scram.bootstrap, extra_config=config) as proxy:
        sent = produce_for(sasl_conf(proxy, "SCRAM-SHA-512", "bob", BOB_PASSWORD), topic, 8)
        java_producer_as_bob(kafka_scram, proxy, users_file.parent, topic, 2000, 250)
    again = logged(caplog, "client authenticated again")
    assert len(again) >= 3, len(again)  # librdkafka for 8 s, Java for 8 s, 3 s sessions
    assert {f["software"].split("/")[0] for f in again} >= {"confluent-kafka-python",
                                                            "apache-kafka-java"}
    closed = [f["reason"] for f in logged(caplog, "connection closed")]
    assert not [r for r in closed if "expired" in r], closed
    assert watermarks(kafka_scram.bootstrap, topic) == (0, sent + 2000)
