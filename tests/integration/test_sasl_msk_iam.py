"""sasl.upstream with Amazon MSK IAM on a real Apache Kafka broker, with real clients.

No MSK here, so the broker is made to check tokens as MSK's IAM listener does: its
OAUTHBEARER validator (tests/support/java/MskIamValidator.java, a plugin on the
broker's classpath) takes only presigned ``kafka-cluster:Connect`` URLs for its region
with a SigV4 signature that the secret of the access key they name reproduces, until
they expire.  The proxy signs them with AWS's own signer from the credentials botocore
finds (here: the environment); clients with no SASL and no AWS credentials produce and
consume through it, across the broker's re-authentications.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.test_sasl_proxy import client_errors, logged
from tests.support.awssig import no_aws_credentials
from tests.support.clients import consume, produce, produce_for, unique, watermarks
from tests.support.kafka import BROKER_JVM_OPTS, JAVA_SOURCES, KafkaCluster, libs_with_plugin
from tests.support.proxythread import ProxyThread

REGION = "eu-west-1"
KEY, SECRET = "AKIAGATEHOUSEPROXY", "c2VjcmV0IGtleSBvZiB0aGUgcHJveHk/+Xq"
UPSTREAM = f"sasl:\n  upstream: {{mechanism: OAUTHBEARER, aws_msk_iam: {{region: {REGION}}}}}\n"


@pytest.fixture(scope="module")
def kafka_msk(kafka_libs: Path, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[KafkaCluster]:
    """A broker whose SASL listener takes OAUTHBEARER tokens only as MSK IAM tokens of
    KEY in REGION, and ends sessions after 4 s (connections.max.reauth.ms)."""
    libs = libs_with_plugin(kafka_libs, JAVA_SOURCES / "MskIamValidator.java",
                            tmp_path_factory.mktemp("msk-plugin"))
    with KafkaCluster(1, sasl_scram=True, libs=libs, extra_config={
            "listener.name.sasl_plaintext.oauthbearer.sasl.server.callback.handler.class":
                "MskIamValidator",
            "connections.max.reauth.ms": 4000,
    }, jvm_opts=(*BROKER_JVM_OPTS, f"-Dgatehouse.msk.keys={KEY}={SECRET}",
                 f"-Dgatehouse.msk.region={REGION}")) as cluster:
        yield cluster


@pytest.fixture
def aws_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The proxy's AWS credentials in its environment (as an EKS pod's or a CI job's)."""
    home = no_aws_credentials(monkeypatch, tmp_path)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    return home


def test_the_proxy_logs_in_to_an_msk_iam_broker_for_clients_without_credentials(
        kafka_msk: KafkaCluster, aws_credentials: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="gatehouse.proxy")
    topic = unique("msk-iam")
    kafka_msk.create_topic(topic)
    with ProxyThread(kafka_msk.sasl_bootstrap, extra_config=UPSTREAM) as proxy:
        conf = {"bootstrap.servers": proxy.bootstrap}
        sent = produce(conf, topic, count=30)
        assert sorted(consume(conf, topic, 30)) == sorted(sent)
        count = produce_for(conf, topic, 6)  # across the broker's 4 s sessions
        # One token signed for every login (15 minutes, renewed after 12).
        assert proxy.proxy.upstream_credentials.fetches == 1  # type: ignore[union-attr]
    assert watermarks(kafka_msk.bootstrap, topic) == (0, 30 + count)
    assert len(logged(caplog, "re-authenticated to the broker")) >= 1
    closed = [f["reason"] for f in logged(caplog, "connection closed")]
    assert not [r for r in closed if "authentic" in r], closed
    text = "\n".join(f"{r.getMessage()} {getattr(r, 'gatehouse_fields', '')}"
                     for r in caplog.records)
    assert SECRET not in text and "X-Amz-Signature" not in text
    assert "MskIamValidator refused" not in kafka_msk.nodes[0].log_path.read_text()


def test_credentials_the_broker_does_not_know_are_reported_naming_the_broker(
        kafka_msk: KafkaCluster, aws_credentials: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gatehouse.proxy")
    topic = unique("msk-iam-refused")
    broker = kafka_msk.sasl_bootstrap
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with ProxyThread(broker, extra_config=UPSTREAM) as proxy:
        assert client_errors({"bootstrap.servers": proxy.bootstrap}, topic)
        assert proxy.sample("gatehouse_upstream_failures_total", broker=broker) >= 1
    reasons = [str(f.get("reason")) for f in logged(caplog, "connection closed")]
    assert any(f"{broker}: SASL authentication failed: the broker refused 'AWS IAM "
               f"(default credentials, {REGION})' (OAUTHBEARER)" in r for r in reasons), reasons
    assert ("MskIamValidator refused a token: the signature does not match"
            in kafka_msk.nodes[0].log_path.read_text())
    caplog.clear()
    # No credentials at all: said before any broker is asked.
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with ProxyThread(broker, extra_config=UPSTREAM) as proxy:
        assert client_errors({"bootstrap.servers": proxy.bootstrap}, topic)
    reasons = [str(f.get("reason")) for f in logged(caplog, "connection closed")]
    assert any("SASL authentication failed: no AWS credentials found for aws_msk_iam" in r
               for r in reasons), reasons


def test_check_probe_says_whether_the_pods_aws_credentials_log_in(
        kafka_msk: KafkaCluster, aws_credentials: Path, monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    """The deploy-time question (`gatehouse check --probe`): do these AWS credentials get
    the proxy into the cluster?"""
    config = tmp_path / "proxy.yaml"
    config.write_text(f"listen: 127.0.0.1:9192\nupstream: [{kafka_msk.sasl_bootstrap}]\n"
                      + UPSTREAM)

    def probe() -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "gatehouse.cli", "check", "--config",
                               str(config), "--probe"], capture_output=True, text=True,
                              timeout=120)

    result = probe()
    assert result.returncode == 0, result.stdout + result.stderr
    assert (f"  bootstrap {kafka_msk.sasl_bootstrap}: connected, logged in as 'AWS IAM "
            f"(default credentials, {REGION})' (OAUTHBEARER), session 4 s") in result.stdout
    assert SECRET not in result.stdout + result.stderr
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    result = probe()
    assert result.returncode == 1
    assert (f"  bootstrap {kafka_msk.sasl_bootstrap}: SASL authentication failed: no AWS "
            "credentials found for aws_msk_iam") in result.stdout, result.stdout
