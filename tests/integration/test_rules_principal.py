"""Rules that match the principal, on a real Apache Kafka broker: with SCRAM, the
tenant prefix follows the user the broker accepted, not the client id a client picks;
with mutual TLS at the proxy, it follows the subject of the client's certificate."""

from __future__ import annotations

import socket
import ssl
import struct
from pathlib import Path

import pytest
import trustme
from confluent_kafka.admin import AdminClient

from gatehouse import codecs
from tests.support.clients import (
    consume,
    kafka_python_produce,
    kafka_python_read,
    produce,
    unique,
    watermarks,
)
from tests.support.kafka import SCRAM_PASSWORD, SCRAM_USER, KafkaCluster
from tests.support.proxythread import ProxyThread

RULES = (f"- name: by-user\n  match: {{principal: '^{SCRAM_USER}$'}}\n"
         f"  topic_prefix: {{broker: '{SCRAM_USER}.', hide_others: true, groups: true}}\n")


def test_the_tenant_prefix_follows_the_authenticated_user_not_the_client_id(
        kafka_scram: KafkaCluster) -> None:
    name = unique("orders")
    tenant_topic = f"{SCRAM_USER}.{name}"
    kafka_scram.create_topic(tenant_topic)
    kafka_scram.create_topic(name)
    with ProxyThread(kafka_scram.sasl_bootstrap, rules_yaml=RULES) as proxy:
        conf = {**kafka_scram.client_config(sasl=True), "bootstrap.servers": proxy.bootstrap,
                "client.id": "whatever"}
        sent = produce(conf, name, count=20)
        assert sorted(consume(conf, name, 20)) == sorted(sent)
        admin = AdminClient(conf)
        topics = admin.list_topics(timeout=10).topics
        assert name in topics and tenant_topic not in topics  # its own names only
        assert proxy.sample_reaches("gatehouse_principals", 1, principal=SCRAM_USER) >= 1  # admin's
    assert watermarks(kafka_scram.bootstrap, tenant_topic) == (0, 20)
    assert watermarks(kafka_scram.bootstrap, name) == (0, 0)

    # kafka-python pinned below 1.0 speaks SaslHandshake v0 (raw SCRAM tokens): the
    # broker's server-final message says it took the user, who is the principal too.
    with ProxyThread(kafka_scram.sasl_bootstrap, rules_yaml=RULES) as proxy:
        old_client = {"bootstrap_servers": proxy.bootstrap, "api_version": (0, 11),
                      "security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "SCRAM-SHA-256",
                      "sasl_plain_username": SCRAM_USER, "sasl_plain_password": SCRAM_PASSWORD}
        kafka_python_produce(old_client, (f"old-{i}".encode() for i in range(4)), name)
        assert proxy.sample("gatehouse_rule_decisions_total", rule="by-user",
                            action="rename") > 0
    assert watermarks(kafka_scram.bootstrap, tenant_topic) == (0, 24)

    # No SASL: naming itself after the user in its client id does not make it the user.
    with ProxyThread(kafka_scram.bootstrap, rules_yaml=RULES) as proxy:
        conf = {"bootstrap.servers": proxy.bootstrap, "client.id": SCRAM_USER}
        produce(conf, name, count=5)
        assert proxy.sample("gatehouse_principals", principal=SCRAM_USER) == 0
    assert watermarks(kafka_scram.bootstrap, name) == (0, 5)
    assert watermarks(kafka_scram.bootstrap, tenant_topic) == (0, 24)


def test_an_oauthbearer_principal_is_the_tokens_subject(kafka_scram: KafkaCluster) -> None:
    """librdkafka's unsecured JWT (the broker's test validator accepts it): the principal
    the broker derives is the token's subject, and so is the proxy's."""
    name = unique("events")
    kafka_scram.create_topic(f"{SCRAM_USER}.{name}")
    with ProxyThread(kafka_scram.sasl_bootstrap, rules_yaml=RULES) as proxy:
        conf = {"bootstrap.servers": proxy.bootstrap, "security.protocol": "SASL_PLAINTEXT",
                "sasl.mechanism": "OAUTHBEARER", "enable.sasl.oauthbearer.unsecure.jwt": True,
                "sasl.oauthbearer.config": f"principal={SCRAM_USER}"}
        sent = produce(conf, name, count=10)
        assert sorted(consume(conf, name, 10)) == sorted(sent)
    assert watermarks(kafka_scram.bootstrap, f"{SCRAM_USER}.{name}") == (0, 10)


TEAM_A = "CN=team-a,OU=tenants,O=corp"
CERT_RULES = ("- name: team-a\n  match: {principal: '^CN=team-a,'}\n"
              "  topic_prefix: {broker: 'a.', hide_others: true, groups: true}\n")


@pytest.fixture()
def mtls(tmp_path: Path) -> dict[str, str]:
    """The proxy's certificate and, from the same CA, clients': team-a and team-b (OU
    tenants) and an outsider (OU contractors)."""
    ca = trustme.CA()
    paths: dict[str, str] = {"ca": str(tmp_path / "ca.pem")}
    ca.cert_pem.write_to_path(paths["ca"])
    issued = {"proxy": ca.issue_cert("localhost", "127.0.0.1")}
    for team in ("team-a", "team-b"):
        issued[team] = ca.issue_cert(f"{team}.clients", common_name=team,
                                     organization_unit_name="tenants", organization_name="corp")
    issued["outsider"] = ca.issue_cert("outsider.clients", common_name="outsider",
                                       organization_unit_name="contractors",
                                       organization_name="corp")
    for name, cert in issued.items():
        paths[f"{name}.cert"] = str(tmp_path / f"{name}.pem")
        paths[f"{name}.key"] = str(tmp_path / f"{name}.key")
        cert.cert_chain_pems[0].write_to_path(paths[f"{name}.cert"])
        cert.private_key_pem.write_to_path(paths[f"{name}.key"])
    return paths


def test_the_tenant_prefix_follows_the_client_certificate(kafka: KafkaCluster,
                                                          mtls: dict[str, str]) -> None:
    """The proxy ends the clients' TLS, so the broker sees only the proxy: the verified
    certificate's subject is the principal rules match, metrics count and logs name."""
    name = unique("orders")
    kafka.create_topic(f"a.{name}")
    kafka.create_topic(name)
    tls = (f"tls:\n  downstream: {{cert: {mtls['proxy.cert']}, key: {mtls['proxy.key']}, "
           f"client_ca: {mtls['ca']}}}\n")
    with ProxyThread(kafka.bootstrap, extra_config=tls, rules_yaml=CERT_RULES) as proxy:
        def conf(team: str) -> dict[str, str]:
            return {"bootstrap.servers": proxy.bootstrap, "security.protocol": "SSL",
                    "ssl.ca.location": mtls["ca"],
                    "ssl.certificate.location": mtls[f"{team}.cert"],
                    "ssl.key.location": mtls[f"{team}.key"], "client.id": "same-for-both"}

        sent = produce(conf("team-a"), name, count=20)
        assert sorted(consume(conf("team-a"), name, 20)) == sorted(sent)
        # The admin is held while the gauge is read: a live-connection gauge drops as
        # soon as the client is freed and its connection closed (seen once under load).
        admin = AdminClient(conf("team-a"))
        topics = admin.list_topics(timeout=10).topics
        assert name in topics and f"a.{name}" not in topics  # its own names only
        assert proxy.sample_reaches("gatehouse_principals", 1, principal=TEAM_A) >= 1  # the admin's
        del admin
        produce(conf("team-b"), name, count=5)  # another tenant's certificate: not prefixed

        # kafka-python, certificate and all, is team-a too.
        ssl_args = {"bootstrap_servers": proxy.bootstrap, "security_protocol": "SSL",
                    "ssl_cafile": mtls["ca"], "ssl_certfile": mtls["team-a.cert"],
                    "ssl_keyfile": mtls["team-a.key"]}
        kafka_python_produce(ssl_args, (f"kp-{i}".encode() for i in range(7)), name)
        read = kafka_python_read(ssl_args, name, 27, timeout_ms=10_000)
        assert len(read) == 27 and sorted(read) == sorted([*sent, *(f"kp-{i}".encode()
                                                                   for i in range(7))])

        # Without a certificate there is no connection at all.
        with pytest.raises((ssl.SSLError, ConnectionError)):
            talk_with(proxy.proxy.bootstrap_ports[0], mtls, None)
    assert watermarks(kafka.bootstrap, f"a.{name}") == (0, 27)
    assert watermarks(kafka.bootstrap, name) == (0, 5)



def test_sasl_after_tls_names_the_client_again(kafka_scram: KafkaCluster,
                                               mtls: dict[str, str]) -> None:
    """A client with a certificate that then authenticates with SASL (SASL_SSL) is the
    SASL user, as on a broker's SASL_SSL listener: the user's prefix applies, the
    certificate's does not."""
    name = unique("ledger")
    for prefix in ("a.", f"{SCRAM_USER}."):
        kafka_scram.create_topic(prefix + name)
    rules = CERT_RULES + RULES
    tls = (f"tls:\n  downstream: {{cert: {mtls['proxy.cert']}, key: {mtls['proxy.key']}, "
           f"client_ca: {mtls['ca']}}}\n")
    with ProxyThread(kafka_scram.sasl_bootstrap, extra_config=tls, rules_yaml=rules) as proxy:
        conf = {**kafka_scram.client_config(sasl=True), "bootstrap.servers": proxy.bootstrap,
                "security.protocol": "SASL_SSL", "ssl.ca.location": mtls["ca"],
                "ssl.certificate.location": mtls["team-a.cert"],
                "ssl.key.location": mtls["team-a.key"]}
        sent = produce(conf, name, count=10)
        assert sorted(consume(conf, name, 10)) == sorted(sent)
        admin = AdminClient(conf)
        assert name in admin.list_topics(timeout=10).topics  # a live connection, counted:
        assert proxy.sample_reaches("gatehouse_principals", 1, principal=SCRAM_USER) >= 1
        assert proxy.sample("gatehouse_principals", principal=TEAM_A) == 0  # moved over
    assert watermarks(kafka_scram.bootstrap, f"{SCRAM_USER}.{name}") == (0, 10)
    assert watermarks(kafka_scram.bootstrap, f"a.{name}") == (0, 0)


def test_kafkas_mapping_rules_give_short_principals(kafka: KafkaCluster,
                                                    mtls: dict[str, str]) -> None:
    """``principal_mapping_rules`` as a broker's ``ssl.principal.mapping.rules``: the
    tenants' common names become their principals; a certificate no rule matches is
    refused, as a broker refuses it."""
    name = unique("orders")
    kafka.create_topic(f"a.{name}")
    tls = (f"tls:\n  downstream:\n    cert: {mtls['proxy.cert']}\n"
           f"    key: {mtls['proxy.key']}\n    client_ca: {mtls['ca']}\n"
           "    principal_mapping_rules: 'RULE:^CN=([^,]*),OU=tenants,.*$/$1/'\n")
    rules = ("- name: team-a\n  match: {principal: '^team-a$'}\n"
             "  topic_prefix: {broker: 'a.', hide_others: true}\n")
    with ProxyThread(kafka.bootstrap, extra_config=tls, rules_yaml=rules) as proxy:
        def conf(who: str) -> dict[str, str]:
            return {"bootstrap.servers": proxy.bootstrap, "security.protocol": "SSL",
                    "ssl.ca.location": mtls["ca"],
                    "ssl.certificate.location": mtls[f"{who}.cert"],
                    "ssl.key.location": mtls[f"{who}.key"]}

        sent = produce(conf("team-a"), name, count=12)
        admin = AdminClient(conf("team-a"))
        assert name in admin.list_topics(timeout=10).topics
        assert proxy.sample_reaches("gatehouse_principals", 1, principal="team-a") >= 1
        assert sorted(consume(conf("team-a"), name, 12)) == sorted(sent)

        with pytest.raises((ssl.SSLError, ConnectionError)):
            talk_with(proxy.proxy.bootstrap_ports[0], mtls, "outsider")
        talk_with(proxy.proxy.bootstrap_ports[0], mtls, "team-b")  # answered: mapped
    assert watermarks(kafka.bootstrap, f"a.{name}") == (0, 12)

def talk_with(port: int, mtls: dict[str, str], who: str | None) -> None:
    """An ApiVersions request over TLS with ``who``'s certificate (None: none), and a
    read of the answer's size: the proxy's refusal comes in the handshake or, with TLS
    1.3, as the first thing read after it.  Returns only if the request was answered."""
    context = ssl.create_default_context(cafile=mtls["ca"])
    if who is not None:
        context.load_cert_chain(mtls[f"{who}.cert"], mtls[f"{who}.key"])
    frame = codecs.Request.build(18, 0, 1, "tls", codecs.api(18).request.root.cls()).encode()
    with (socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
          context.wrap_socket(raw, server_hostname="localhost") as tls):
        tls.sendall(struct.pack(">i", len(frame)) + bytes(frame))
        if len(tls.recv(4)) != 4:
            raise ConnectionError("closed by the proxy")
