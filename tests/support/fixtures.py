"""A pytest plugin with session-scoped real brokers (``pytest_plugins`` in tests/conftest.py).

Fixtures:
    kafka_libs     Path of the Apache Kafka jars (fetched with Maven once, then cached)
    kafka          KafkaCluster, 1 node
    kafka_cluster  KafkaCluster, 3 nodes
    kafka_scram    KafkaCluster, 1 node, with a SASL_PLAINTEXT SCRAM-SHA-256 listener
    tansu          TansuBroker

Tests that use the Kafka fixtures get the ``kafka`` marker (``pytest -m "not kafka"``).
A test that stops or pauses a node of a shared cluster must bring it back.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.fetch_kafka import ensure_kafka
from tests.support.kafka import KafkaCluster
from tests.support.tansu import TansuBroker

KAFKA_FIXTURES = frozenset({"kafka_libs", "kafka", "kafka_cluster", "kafka_scram"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if KAFKA_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.kafka)


@pytest.fixture(scope="session")
def kafka_libs() -> Path:
    return ensure_kafka()


@pytest.fixture(scope="session")
def kafka(kafka_libs: Path) -> Iterator[KafkaCluster]:
    with KafkaCluster(1, libs=kafka_libs) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def kafka_cluster(kafka_libs: Path) -> Iterator[KafkaCluster]:
    with KafkaCluster(3, libs=kafka_libs) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def kafka_scram(kafka_libs: Path) -> Iterator[KafkaCluster]:
    with KafkaCluster(1, sasl_scram=True, libs=kafka_libs) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def tansu() -> Iterator[TansuBroker]:
    with TansuBroker() as broker:
        yield broker
