"""SASL GSSAPI (Kerberos) on a real MIT KDC and a real Apache Kafka broker whose SASL
listener takes only GSSAPI and whose authorizer lets only the proxy's principal in:
the proxy logs in as its own principal from a keytab (``sasl.upstream``), for clients
with no SASL at all, and again before the broker's session ends (KIP-368); a principal
the KDC does not know is reported with Kerberos's reason and the client let go; the
capture's Kafka sink logs in the same way."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import confluent_kafka as ck
import pytest

from gatehouse.proxy.config import config_from_text
from gatehouse.proxy.hooks import Policy
from gatehouse.proxy.kerberos import keytab_principals
from gatehouse.proxy.setup import build_observers, close_observers
from tests.integration.test_capture_kafka import (
    kafka_sink_of,
    observations,
    produce_each,
    proxy_config,
)
from tests.integration.test_sasl_proxy import logged, wait_for
from tests.support.clients import produce_and_consume_for, unique, watermarks
from tests.support.kafka import BROKER_JVM_OPTS, PERF, TOOL_JVM_OPTS, KafkaCluster
from tests.support.kerberos import REALM, KerberosRealm
from tests.support.proxythread import ProxyThread
from tests.test_capture import read_records

SESSION_MS = 6000


@pytest.fixture(scope="module")
def realm() -> Iterator[KerberosRealm]:
    with KerberosRealm() as kdc:
        yield kdc


@pytest.fixture(scope="module")
def kerberos_kafka(realm: KerberosRealm, kafka_libs: Path) -> Iterator[KafkaCluster]:
    """One broker: PLAINTEXT for the tests' own admin work, SASL_PLAINTEXT taking only
    GSSAPI (principal kafka/localhost: clients ask for 127.0.0.1's canonical name);
    only ANONYMOUS (the PLAINTEXT listener), the proxy's principal and alice may do
    anything; sessions end after SESSION_MS."""
    keytab = realm.principal("kafka/localhost")
    config = {
        "sasl.enabled.mechanisms": "GSSAPI",
        "sasl.kerberos.service.name": "kafka",
        "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "super.users": "User:ANONYMOUS;User:gatehouse;User:alice",
        "allow.everyone.if.no.acl.found": "false",
        "connections.max.reauth.ms": SESSION_MS,
        "listener.name.sasl_plaintext.gssapi.sasl.jaas.config": jaas(keytab, "kafka/localhost"),
    }
    with KafkaCluster(1, sasl_scram=True, libs=kafka_libs, extra_config=config,
                      jvm_opts=(*BROKER_JVM_OPTS,
                                f"-Djava.security.krb5.conf={realm.krb5_conf}")) as cluster:
        yield cluster


def jaas(keytab: Path, principal: str) -> str:
    """Java's Kerberos login from a keytab, as a Kafka JAAS entry."""
    return ("com.sun.security.auth.module.Krb5LoginModule required useKeyTab=true "
            f'storeKey=true keyTab="{keytab}" principal="{principal}@{REALM}";')


@pytest.fixture
def krb5_config(realm: KerberosRealm, monkeypatch: pytest.MonkeyPatch) -> None:
    """The proxy (in this process) reads the realm's krb5.conf, as a deployment's
    proxy reads KRB5_CONFIG or /etc/krb5.conf."""
    monkeypatch.setenv("KRB5_CONFIG", str(realm.krb5_conf))


def upstream(principal: str, keytab: Path) -> str:
    return (f"sasl:\n  upstream: {{mechanism: GSSAPI, principal: '{principal}', "
            f"keytab: '{keytab}'}}\n")


def test_the_proxy_logs_in_with_its_keytab_and_again_before_the_session_ends(
        realm: KerberosRealm, kerberos_kafka: KafkaCluster, krb5_config: None,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="gatehouse.proxy")
    keytab = realm.principal("gatehouse")
    # kadmin's keytab (a key per encryption type) read as the config check reads it.
    assert keytab_principals(keytab.read_bytes()) == [f"gatehouse@{REALM}"]
    topic = unique("kerberos")
    kerberos_kafka.create_topic(topic)
    with ProxyThread(kerberos_kafka.sasl_bootstrap,
                     extra_config=upstream(f"gatehouse@{REALM}", keytab)) as proxy:
        # Past the broker's session (6 s; the proxy logs in again at 85% of it).
        sent, got = produce_and_consume_for(proxy.bootstrap, topic, SESSION_MS / 1000 * 1.4)
    assert sorted(got) == sorted(sent) and len(sent) > 20
    assert watermarks(kerberos_kafka.bootstrap, topic) == (0, len(sent))
    again = logged(caplog, "re-authenticated to the broker")
    assert len(again) >= 2, len(again)  # producer and consumer at least
    assert all(f["session_seconds"] == SESSION_MS / 1000 for f in again)
    reasons = {f["reason"] for f in logged(caplog, "connection closed")}
    assert not [r for r in reasons if "broker" in r or "authentication" in r], reasons


def test_a_principal_the_kdc_does_not_know_is_reported_and_the_client_let_go(
        realm: KerberosRealm, kerberos_kafka: KafkaCluster, krb5_config: None,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gatehouse.proxy")
    keytab = realm.principal("stranger")
    realm.delete_principal("stranger")  # its keytab left behind, no longer any good
    topic = unique("kerberos")
    kerberos_kafka.create_topic(topic)
    with ProxyThread(kerberos_kafka.sasl_bootstrap,
                     extra_config=upstream(f"stranger@{REALM}", keytab)) as proxy:
        producer = ck.Producer({"bootstrap.servers": proxy.bootstrap, "log_level": 0,
                                "message.timeout.ms": 3000})
        producer.produce(topic, b"never")
        assert producer.flush(10) == 0  # the message timed out: reported, not kept
        failures = wait_for(lambda: [f for f in logged(caplog, "connection closed")
                                     if "upstream unreachable" in str(f.get("reason"))])
        reason = failures[0]["reason"]
        assert "SASL authentication failed" in reason
        assert f"no credential for 'stranger@{REALM}' from keytab '{keytab}'" in reason
        assert "not found in Kerberos database" in reason
        assert proxy.sample("gatehouse_upstream_failures_total",
                            broker=kerberos_kafka.sasl_bootstrap) >= 1
        assert not proxy.proxy.upstream_reachable
    assert watermarks(kerberos_kafka.bootstrap, topic) == (0, 0)


def test_the_capture_sink_logs_in_with_kerberos(
        realm: KerberosRealm, kerberos_kafka: KafkaCluster, krb5_config: None,
        tmp_path: Path) -> None:
    """The observation log's Kafka sink writes to the brokers' GSSAPI listener as the
    proxy's principal, beside the proxy's own connections there."""
    keytab = realm.principal("gatehouse")
    obs = unique("observations")
    sasl = f"{{mechanism: GSSAPI, principal: 'gatehouse@{REALM}', keytab: '{keytab}'}}"
    text = (proxy_config(kerberos_kafka.sasl_bootstrap, tmp_path,
                         f"{{topic: {obs}, linger_seconds: 0.01, sasl: {sasl}}}")
            + upstream(f"gatehouse@{REALM}", keytab))
    observers = build_observers(config_from_text(text), Policy(), None)
    sink = kafka_sink_of(observers)
    data = unique("kerberos")
    kerberos_kafka.create_topic(data)
    try:
        with ProxyThread(config_text=text, observers=observers) as proxy:
            produce_each({"bootstrap.servers": proxy.bootstrap}, data, 5, "kerberos-producer")
    finally:
        close_observers(observers)
    files = read_records(tmp_path)
    assert sink.statistics().written == len(files)
    values = [json.loads(m.value()) for m in observations(
        {"bootstrap.servers": kerberos_kafka.bootstrap}, obs, len(files))]
    assert len(values) == len(files)
    assert sum(1 for v in values if v["api"] == "Produce"
               and v["client_id"] == "kerberos-producer") == 5


def test_a_java_clients_own_kerberos_login_passes_through(
        realm: KerberosRealm, kerberos_kafka: KafkaCluster, krb5_config: None,
        caplog: pytest.LogCaptureFixture) -> None:
    """No sasl.upstream: a Java producer and consumer log in to the broker as alice,
    through the proxy (the GSSAPI tokens passed as they are), and move every record.
    With the broker's keys (sasl.passthrough_kerberos), the proxy reads alice's name
    from her ticket, as the broker's rules name her, for its own rules and metrics:
    a topic her rule denies is kept from her."""
    caplog.set_level(logging.INFO, logger="gatehouse.proxy")
    keytab = realm.principal("alice")
    topic, other = unique("kerberos"), unique("kerberos-denied")
    kerberos_kafka.create_topic(topic)
    kerberos_kafka.create_topic(other)
    jvm = (*TOOL_JVM_OPTS, f"-Djava.security.krb5.conf={realm.krb5_conf}")
    properties = java_client(realm, "alice", keytab, "kafka")
    config = ("sasl:\n  passthrough_kerberos:\n"
              f"    keytab: '{realm.keytab_of('kafka/localhost')}'\n"
              "    principal_to_local_rules: ['RULE:[1:$1](alice)s/alice/team-a/', DEFAULT]\n")
    rules = (f"- name: team-a-not-there\n  match: {{principal: '^team-a$'}}\n"
             f"  deny_topics: ['{other}']\n")

    def produce(proxy: ProxyThread, to: str, count: int) -> Any:
        return kerberos_kafka.run_java_tool(
            PERF, "--topic", to, "--num-records", str(count), "--record-size", "100",
            "--throughput", "-1", "--producer-props", f"bootstrap.servers={proxy.bootstrap}",
            "acks=all", "max.block.ms=5000", "delivery.timeout.ms=10000",
            "request.timeout.ms=5000", "--producer.config", str(properties), timeout=120,
            jvm_opts=jvm)

    with ProxyThread(kerberos_kafka.sasl_bootstrap, extra_config=config,
                     rules_yaml=rules) as proxy:
        produced = produce(proxy, topic, 500)
        assert produced.returncode == 0, produced.stderr[-2000:]
        assert watermarks(kerberos_kafka.bootstrap, topic) == (0, 500)
        kerberos_kafka.consume_with_java(proxy.bootstrap, topic, 500, "--command-config",
                                         str(properties), jvm_opts=jvm)
        assert proxy.sample("gatehouse_topic_records_total", topic=topic,
                            direction="fetch") == 500
        # Each connection of both tools logged in through the proxy (before its client
        # names its software), a token or more each.
        handshakes = proxy.summed("gatehouse_requests_total", api="SaslHandshake")
        assert handshakes >= 2
        assert proxy.summed("gatehouse_requests_total", api="SaslAuthenticate") >= handshakes
        refused = produce(proxy, other, 5)
        assert f"Topic {other} not present in metadata" in refused.stderr
        assert proxy.summed("gatehouse_rule_decisions_total", rule="team-a-not-there") >= 1
    assert watermarks(kerberos_kafka.bootstrap, other) == (0, 0)
    closed = logged(caplog, "connection closed")
    named = [f for f in closed if f.get("principal") == "team-a"]
    assert len(named) >= 3, [f.get("principal") for f in closed]  # every tool's logins
    assert not logged(caplog, "Kerberos ticket not read")


def test_a_ticket_the_proxy_cannot_read_still_passes_through(
        realm: KerberosRealm, kerberos_kafka: KafkaCluster, krb5_config: None,
        caplog: pytest.LogCaptureFixture) -> None:
    """sasl.passthrough_kerberos with keys for another service than the one clients ask
    tickets for: each login is logged as unread, with Kerberos's reason, and the broker
    still takes it (the proxy only reads; the connection has no principal)."""
    caplog.set_level(logging.INFO, logger="gatehouse.proxy")
    keytab = realm.principal("alice")
    elsewhere = realm.principal("kafka/elsewhere")
    topic = unique("kerberos")
    kerberos_kafka.create_topic(topic)
    jvm = (*TOOL_JVM_OPTS, f"-Djava.security.krb5.conf={realm.krb5_conf}")
    config = f"sasl:\n  passthrough_kerberos: {{keytab: '{elsewhere}'}}\n"
    with ProxyThread(kerberos_kafka.sasl_bootstrap, extra_config=config) as proxy:
        produced = kerberos_kafka.run_java_tool(
            PERF, "--topic", topic, "--num-records", "50", "--record-size", "100",
            "--throughput", "-1", "--producer-props", f"bootstrap.servers={proxy.bootstrap}",
            "acks=all", "--producer.config", str(java_client(realm, "alice", keytab, "kafka")),
            timeout=120, jvm_opts=jvm)
        assert produced.returncode == 0, produced.stderr[-2000:]
    assert watermarks(kerberos_kafka.bootstrap, topic) == (0, 50)
    unread = logged(caplog, "Kerberos ticket not read")
    assert unread and all(f["client"].startswith("127.0.0.1:") for f in unread)
    assert f"kafka/localhost@{REALM} not found in keytab" in unread[0]["reason"]
    closed = logged(caplog, "connection closed")
    assert closed and not [f for f in closed if f.get("principal")]


def java_client(realm: KerberosRealm, principal: str, keytab: Path, service: str) -> Path:
    """A Java client's properties: Kerberos as ``principal`` to ``service``'s tickets."""
    properties = realm.dir / f"{principal}-{service}.properties"
    properties.write_text(
        "security.protocol=SASL_PLAINTEXT\nsasl.mechanism=GSSAPI\n"
        f"sasl.kerberos.service.name={service}\nsasl.jaas.config={jaas(keytab, principal)}\n")
    return properties


def test_clients_log_in_to_the_proxy_with_kerberos(
        realm: KerberosRealm, kerberos_kafka: KafkaCluster, krb5_config: None,
        caplog: pytest.LogCaptureFixture) -> None:
    """sasl.downstream.kerberos: Java clients log in to the proxy's own service
    principal (gatehouse/localhost); their principals become names as a broker's
    rules make them, for the proxy's rules and metrics (mallory is kept out by a rule,
    alice writes, also after the service key is rotated under the running proxy); a
    ticket for another service's key is refused with Kerberos's reason, the client told
    SASL_AUTHENTICATION_FAILED."""
    caplog.set_level(logging.DEBUG, logger="gatehouse.proxy")
    service_keytab = realm.principal("gatehouse/localhost")
    jvm = (*TOOL_JVM_OPTS, f"-Djava.security.krb5.conf={realm.krb5_conf}")
    topic = unique("kerberos")
    kerberos_kafka.create_topic(topic)
    # Sessions of 2 s: clients log in again (KIP-368) as they go on.
    # The tickets the proxy accepts kept in a file of the test's (a container's
    # read-only root file system has no /var/tmp to write).
    replay_cache = realm.dir / "proxy-tickets"
    config = (f"sasl:\n  downstream:\n    session_lifetime: 2\n    kerberos:\n"
              f"      keytab: '{service_keytab}'\n      replay_cache: '{replay_cache}'\n"
              "      principal_to_local_rules: ['RULE:[1:$1](mallory)s/.*/intruder/', DEFAULT]\n")
    rules = ("- name: no-intruders\n  match: {principal: '^intruder$'}\n"
             "  deny_topics: ['.*']\n")

    def produce_as(principal: str, service: str = "gatehouse", count: int = 500,
                   rate: int = -1) -> Any:
        keytab = realm.keytab_of(principal)
        return kerberos_kafka.run_java_tool(
            PERF, "--topic", topic, "--num-records", str(count), "--record-size", "100",
            "--throughput", str(rate), "--producer-props", f"bootstrap.servers={proxy.bootstrap}",
            "acks=all", "max.block.ms=5000", "delivery.timeout.ms=10000",
            "request.timeout.ms=5000", "--producer.config",
            str(java_client(realm, principal, keytab, service)), timeout=120, jvm_opts=jvm)

    realm.principal("alice")
    realm.principal("mallory")
    with ProxyThread(kerberos_kafka.bootstrap, extra_config=config,
                     rules_yaml=rules) as proxy:
        produced = produce_as("alice", rate=100)  # 5 s
        assert produced.returncode == 0, produced.stderr[-2000:]
        assert watermarks(kerberos_kafka.bootstrap, topic) == (0, 500)
        # The service key rotated (the keytab replaced with old and new keys): new
        # tickets carry the new key's version, and the running proxy reads them.
        realm.rotate_key("gatehouse/localhost")
        assert produce_as("alice", count=5).returncode == 0
        assert watermarks(kerberos_kafka.bootstrap, topic) == (0, 505)
        refused = produce_as("mallory", count=5)  # named intruder: no topic for it
        assert f"Topic {topic} not present in metadata" in refused.stderr
        wrong = produce_as("alice", service="kafka", count=5)  # a ticket for the broker
        assert "SaslAuthenticationException" in wrong.stdout + wrong.stderr
    assert watermarks(kerberos_kafka.bootstrap, topic) == (0, 505)
    assert replay_cache.stat().st_size > 0
    again = [f for f in logged(caplog, "client authenticated again")
             if f.get("principal") == "alice"]
    assert len(again) >= 2 and all(f["mechanism"] == "GSSAPI" for f in again)
    closed = logged(caplog, "connection closed")
    assert {f.get("principal") for f in closed} >= {"alice", "intruder"}
    failed = [f for f in closed if "authentication" in str(f.get("reason"))]
    assert failed, [f.get("reason") for f in closed]
    assert failed[0]["reason"].startswith(
        "SASL authentication (GSSAPI) failed: the client's Kerberos ticket: Request ticket "
        f"server kafka/localhost@{REALM} not found in keytab")
