"""A pytest plugin with session-scoped real brokers (``pytest_plugins`` in tests/conftest.py).

Fixtures:
    kafka_libs     Path of the Apache Kafka jars (fetched with Maven once, then cached)
    kafka          KafkaCluster, 1 node
    kafka_cluster  KafkaCluster, 3 nodes
    kafka_scram    KafkaCluster, 1 node, with a SASL_PLAINTEXT SCRAM-SHA-256 listener
    kafka_acls     KafkaCluster, 1 node, keeping and enforcing ACLs (the proxies: super users)
    tansu          TansuBroker
    apicurio       ApicurioRegistry (a Schema Registry: Confluent's REST API)
    tls_files      {"ca", "cert", "key"}: PEM paths of a CA and a localhost/127.0.0.1 certificate

Every test: ``no_kafka_python_client_left_open`` fails one that leaves a kafka-python
client's threads running.

Tests that use the Kafka fixtures get the ``kafka`` marker (``pytest -m "not kafka"``).
A test that stops or pauses a node of a shared cluster must bring it back.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.fetch_kafka import ensure_kafka
from tests.support.apicurio import ApicurioRegistry
from tests.support.kafka import KafkaCluster, tls_files_for_loopback
from tests.support.tansu import TansuBroker

KAFKA_FIXTURES = frozenset({"kafka_libs", "kafka", "kafka_cluster", "kafka_scram",
                            "kafka_acls"})
# The threads of a kafka-python client (its network thread, its I/O loop).
KAFKA_PYTHON_THREADS = ("kafka-python-", "kafka-io-kafka-python")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if KAFKA_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.kafka)


@pytest.fixture(autouse=True)
def no_kafka_python_client_left_open() -> Iterator[None]:
    """A kafka-python client a test leaves open keeps reconnecting in its threads through
    the tests after it (and draws from the random module under their Hypothesis
    strategies): each test closes the ones it opens."""
    before = set(threading.enumerate())
    yield
    left = [t for t in threading.enumerate()
            if t not in before and t.name.startswith(KAFKA_PYTHON_THREADS)]
    for thread in left:
        thread.join(2)  # a client closed at the very end may still be stopping
    names = [t.name for t in left if t.is_alive()]
    assert not names, f"kafka-python clients left open by this test: {names}"


@pytest.fixture(scope="session")
def kafka_libs() -> Path:
    return ensure_kafka()


@pytest.fixture(scope="session")
def kafka(kafka_libs: Path) -> Iterator[KafkaCluster]:
    with KafkaCluster(1, libs=kafka_libs) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def kafka_acls(kafka_libs: Path) -> Iterator[KafkaCluster]:
    """A broker with Kafka's authorizer, for clients that keep ACLs there (MirrorMaker 2
    copies them, kafka-acls writes them); whoever connects without SASL, as the proxies
    do, is a super user."""
    with KafkaCluster(1, libs=kafka_libs, extra_config={
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "super.users": "User:ANONYMOUS"}) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def kafka_cluster(kafka_libs: Path) -> Iterator[KafkaCluster]:
    with KafkaCluster(3, libs=kafka_libs) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def kafka_scram(kafka_libs: Path) -> Iterator[KafkaCluster]:
    with KafkaCluster(1, sasl_scram=True, libs=kafka_libs) as cluster:
        yield cluster


@pytest.fixture()
def tls_files(tmp_path: Path) -> dict[str, str]:
    return {k: str(v) for k, v in tls_files_for_loopback(tmp_path).items()}


@pytest.fixture(scope="session")
def tansu() -> Iterator[TansuBroker]:
    with TansuBroker() as broker:
        yield broker


@pytest.fixture(scope="session")
def apicurio() -> Iterator[ApicurioRegistry]:
    with ApicurioRegistry() as registry:
        yield registry
