"""A bounded coverage-guided fuzz run of the frame splitter and the codecs (atheris, see
fuzz_codec.py), seeded with frames real clients and a real broker exchanged through the
proxy; and every crash ever found, replayed as a regression test.

CI runs the fuzzer for FUZZ_SECONDS; ``GATEHOUSE_SOAK=1`` runs it for ten minutes.  A crash
leaves its input in the artifact directory: copy it into fuzz_regressions/ with the fix.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gatehouse import codecs
from gatehouse.proxy.hooks import ConnectionInfo, Observer, Pending
from tests.reliability.fuzz_codec import check_input, request_seed, response_seed
from tests.reliability.support import ProxyRunner, scaled
from tests.support.clients import consume, produce, unique
from tests.support.fakebroker import frame_bytes
from tests.support.kafka import KafkaCluster

FUZZ_SECONDS = scaled(30, 600)
REGRESSIONS = Path(__file__).with_name("fuzz_regressions")


class Seeds(Observer):
    """Every frame through the proxy, as fuzzer inputs."""

    def __init__(self) -> None:
        self.inputs: list[bytes] = []

    def request(self, conn: ConnectionInfo, req: codecs.Request, size: int) -> None:
        if req.frame is not None:
            self.inputs.append(request_seed(frame_bytes(req.frame)))

    def response(self, conn: ConnectionInfo, pending: Pending, size: int, elapsed: float,
                 frame: Any = None) -> None:
        if frame is not None and pending.api_key >= 0:
            self.inputs.append(response_seed(pending.api_key, pending.api_version,
                                             frame_bytes(frame)))


@pytest.fixture(scope="module")
def corpus(kafka: KafkaCluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from confluent_kafka.admin import AdminClient, NewTopic

    seeds = Seeds()
    with ProxyRunner(f"listen: 127.0.0.1:0\nupstream: [{kafka.bootstrap}]\n"
                     "brokers: {start_port: 0}\n", observers=[seeds]) as proxy:
        conf = {"bootstrap.servers": proxy.bootstrap}
        topic = unique("fuzz-seed")
        admin = AdminClient(conf)
        admin.create_topics([NewTopic(topic, 2, 1)])[topic].result(30)
        # Batches of every codec, for the record reader's decompression.
        sent = [value for codec in ("lz4", "gzip", "snappy", "zstd", "none")
                for value in produce({**conf, "compression.type": codec}, topic, count=8,
                                     tag=f"{codec}-")]
        assert sorted(consume(conf, topic, len(sent))) == sorted(sent)
        admin.list_consumer_groups().result(30)
    directory = tmp_path_factory.mktemp("fuzz-corpus")
    unique_inputs = {hashlib.sha1(s).hexdigest(): s for s in seeds.inputs}
    for name, data in unique_inputs.items():
        (directory / name).write_bytes(data)
    for path in REGRESSIONS.glob("*"):
        (directory / path.name).write_bytes(path.read_bytes())
    assert len(unique_inputs) > 20
    return directory


def test_seeds_pass_the_checks(corpus: Path) -> None:
    for path in corpus.iterdir():
        check_input(path.read_bytes())


@pytest.mark.timeout(FUZZ_SECONDS + 300)
def test_fuzz_smoke(corpus: Path, tmp_path: Path) -> None:
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "tests.reliability.fuzz_codec", str(corpus),
         f"-max_total_time={FUZZ_SECONDS}", "-rss_limit_mb=2048", "-timeout=10",
         f"-artifact_prefix={artifacts}/", "-print_final_stats=1"],
        capture_output=True, text=True, timeout=FUZZ_SECONDS + 120)
    crashes = sorted(artifacts.iterdir())
    assert result.returncode == 0 and not crashes, (
        f"fuzzer found {[str(c) for c in crashes]}:\n{result.stderr[-6000:]}")
    assert "Done" in result.stderr and "cov:" in result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize("path", sorted(REGRESSIONS.glob("*")), ids=lambda p: p.name)
def test_fuzz_regressions(path: Path) -> None:
    check_input(path.read_bytes())
