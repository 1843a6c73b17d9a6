"""End to end: real clients through the proxy with capture on -> `gatehouse report` on
Spark (local, then a standalone master + worker started from pyspark's own classes).

librdkafka (confluent-kafka) and kafka-python pinned to an old protocol level produce
through the proxy, a consumer reads everything back; the report must name both
clients with their versions, count exactly the records produced, and say that a
proposed ``min_api_version`` rule refuses exactly the clients that used older versions.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import confluent_kafka as ck
import pyarrow.parquet as pq
import pytest

from gatehouse.capture.observer import CaptureObserver
from gatehouse.capture.settings import CaptureSettings
from gatehouse.capture.writer import CaptureWriter
from tests.support.clients import consume, produce, unique
from tests.support.kafka import KafkaCluster
from tests.support.proxythread import ProxyThread
from tests.support.spark import SPARK_ENV, SparkStandalone
from tests.test_capture import read_records

GATEHOUSE = [sys.executable, "-m", "gatehouse.cli"]
FROM_LIBRDKAFKA, FROM_KAFKA_PYTHON = 120, 45


@dataclass
class Captured:
    captures: Path
    topic: str
    produce_versions: dict[str, set[int]]  # client id -> Produce versions in the raw log
    rules: Path
    local_out: Path


@pytest.fixture(scope="module")
def captured(kafka: KafkaCluster, tmp_path_factory: pytest.TempPathFactory) -> Captured:
    from kafka import KafkaProducer

    work = tmp_path_factory.mktemp("pipeline")
    capture = CaptureObserver(CaptureSettings(dir=work / "captures", instance="e2e"))
    topic = unique("report")
    kafka.create_topic(topic, partitions=2)
    with ProxyThread(kafka.bootstrap, observers=[capture]) as proxy:
        conf = {"bootstrap.servers": proxy.bootstrap, "client.id": "ck-orders"}
        produce(conf, topic, count=FROM_LIBRDKAFKA)
        legacy = KafkaProducer(bootstrap_servers=proxy.bootstrap, client_id="kp-legacy",
                               api_version=(2, 5, 0), linger_ms=5, acks="all")
        for i in range(FROM_KAFKA_PYTHON):
            legacy.send(topic, b"legacy-%d" % i)
        legacy.flush(30)
        legacy.close()
        got = consume({"bootstrap.servers": proxy.bootstrap, "client.id": "ck-reader"},
                      topic, FROM_LIBRDKAFKA + FROM_KAFKA_PYTHON)
        assert len(got) == FROM_LIBRDKAFKA + FROM_KAFKA_PYTHON
    assert capture.close(10)
    versions: dict[str, set[int]] = {}
    for record in read_records(work / "captures"):
        if record["api"] == "Produce":
            versions.setdefault(record["client_id"], set()).add(record["api_version"])
    # The proposal: librdkafka's Produce version as the minimum.
    newest = max(max(v) for v in versions.values())
    rules = work / "proposed.yaml"
    rules.write_text(f"rules:\n  - name: modern-produce\n    min_api_version: "
                     f"{{Produce: {newest}}}\n  - name: no-admin\n    deny_apis: [DeleteTopics]\n")
    return Captured(work / "captures", topic, versions, rules, work / "local")


def run_report(captured: Captured, out: Path, master: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [*GATEHOUSE, "report", "--captures", str(captured.captures), "--out", str(out),
         "--rules", str(captured.rules), "--master", master, "--driver-memory", "768m",
         "--executor-memory", "512m", "--shuffle-partitions", "4"],
        capture_output=True, text=True, timeout=600, env=SPARK_ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def table(out: Path, name: str) -> list[dict[str, Any]]:
    rows = pq.read_table(out / name).to_pylist()
    return sorted(rows, key=lambda r: json.dumps(r, sort_keys=True, default=str))


def test_report_local(captured: Captured) -> None:
    from kafka import __version__ as kafka_python_version

    result = run_report(captured, captured.local_out, "local[2]")
    assert "report.html" in result.stdout
    out = captured.local_out

    census = table(out, "census")
    by_name = {(r["software_name"], r["software_version"]): r for r in census}
    kp = by_name[("kafka-python", kafka_python_version)]
    assert "kp-legacy" in kp["client_ids"] and kp["addresses"] == ["127.0.0.1"]
    assert kp["principals"] == []  # no SASL here
    assert {(a["api"], a["api_version"]) for a in kp["apis"]} >= {
        ("Produce", v) for v in captured.produce_versions["kp-legacy"]}
    librdkafka = [r for r in census if dict(r["libraries"] or []).get("librdkafka")
                  == ck.libversion()[0]]
    assert librdkafka and {"ck-orders", "ck-reader"} <= set(librdkafka[0]["client_ids"])
    assert librdkafka[0]["software_name"] == "confluent-kafka-python"

    traffic = table(out, "traffic")
    produced = [r for r in traffic if r["topic"] == captured.topic and r["api"] == "Produce"]
    assert sum(r["records"] for r in produced) == FROM_LIBRDKAFKA + FROM_KAFKA_PYTHON
    assert all(r["bytes"] > 0 and r["latency_p50_ms"] > 0 for r in produced)
    fetched = [r for r in traffic if r["topic"] == captured.topic and r["api"] == "Fetch"]
    assert sum(r["records"] for r in fetched) >= FROM_LIBRDKAFKA + FROM_KAFKA_PYTHON

    impact = table(out, "impact")
    newest = max(max(v) for v in captured.produce_versions.values())
    older = {c for c, versions in captured.produce_versions.items() if min(versions) < newest}
    assert older == {"kp-legacy"}  # the clients differ as the test means them to
    refused = [r for r in impact if r["rule"] == "modern-produce"]
    assert {r["client_id"] for r in refused} == older
    assert {(r["software_name"], r["effect"], r["api"]) for r in refused} == {
        ("kafka-python", "refuse", "Produce")}
    produce_requests_kp = sum(1 for r in read_records(captured.captures)
                              if r["api"] == "Produce" and r["client_id"] == "kp-legacy")
    assert sum(r["requests"] for r in refused) == produce_requests_kp
    assert not [r for r in impact if r["rule"] == "no-admin"]

    page = (out / "report.html").read_text()
    assert page.count("<svg") >= 4 and "<script" not in page
    assert "Rule <b>modern-produce</b> <span class=refuse>would refuse" in page
    assert f"kafka-python {kafka_python_version} (kp-legacy)" in page
    assert "Rule <b>no-admin</b> <span class=ok>would refuse no request" in page


def test_report_on_a_spark_standalone_cluster_matches_local(captured: Captured,
                                                           tmp_path: Path) -> None:
    if not (captured.local_out / "census").exists():
        run_report(captured, captured.local_out, "local[2]")
    with SparkStandalone(tmp_path) as master:
        run_report(captured, tmp_path / "cluster", master)
    for name in ("census", "traffic", "impact"):
        assert table(tmp_path / "cluster", name) == table(captured.local_out, name), name


def write_as_parquet(records: list[dict[str, Any]], directory: Path) -> None:
    """``records`` as the proxy's writer writes them with ``capture.format: parquet``."""
    writer = CaptureWriter(CaptureSettings(dir=directory, instance="e2e-parquet",
                                           format="parquet", queue=len(records) + 1))
    assert all(writer.offer(record) for record in records)
    assert writer.close(30)
    assert [p.suffix for p in directory.iterdir()] == [".parquet"]


def test_parquet_captures_give_the_same_tables(captured: Captured, tmp_path: Path) -> None:
    """The proxy's records written as Parquet, then half as Parquet and half as JSON Lines
    side by side: the report reads both formats into the same tables."""
    if not (captured.local_out / "census").exists():
        run_report(captured, captured.local_out, "local[2]")
    records = read_records(captured.captures)
    assert {"Produce", "Fetch", "Metadata"} <= {r["api"] for r in records}
    write_as_parquet(records, tmp_path / "parquet")
    half = len(records) // 2
    mixed = tmp_path / "mixed"
    write_as_parquet(records[:half], mixed / "older")
    (mixed / "gatehouse-e2e-newer.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records[half:]))
    for name, captures in (("parquet", tmp_path / "parquet"), ("mixed", mixed)):
        out = tmp_path / f"out-{name}"
        result = run_report(dataclasses.replace(captured, captures=captures), out, "local[2]")
        assert f"{len(records)} exchanges" in result.stdout, name
        for table_name in ("census", "traffic", "impact"):
            assert table(out, table_name) == table(captured.local_out, table_name), (
                name, table_name)
        assert verdicts(out) == verdicts(captured.local_out), name


def verdicts(out: Path) -> list[str]:
    """The page's per-rule sentences ("Rule X would refuse N requests from ...")."""
    page = (out / "report.html").read_text()
    found = re.findall(r"<p class=verdict>.*?</p>", page)
    assert found
    return found


def test_report_of_an_empty_period_says_so(captured: Captured, tmp_path: Path) -> None:
    result = subprocess.run([*GATEHOUSE, "report", "--captures", str(captured.captures),
                             "--out", str(tmp_path / "out"), "--master", "local[1]",
                             "--driver-memory", "512m", "--until", "2001-01-01T00:00",
                             "--conf", "spark.driver.extraJavaOptions=-XX:TieredStopAtLevel=1"],
                            capture_output=True, text=True, timeout=300, env=SPARK_ENV)
    assert result.returncode == 1
    assert "error: no capture records in" in result.stderr
    assert not (tmp_path / "out" / "report.html").exists()


def test_a_spark_setting_that_is_not_key_value_says_so(tmp_path: Path) -> None:
    result = subprocess.run([*GATEHOUSE, "report", "--captures", str(tmp_path), "--out",
                             str(tmp_path / "out"), "--conf", "spark.executor.cores"],
                            capture_output=True, text=True, timeout=120, env=SPARK_ENV)
    assert result.returncode == 1
    assert result.stderr.strip() == "error: --conf 'spark.executor.cores' is not KEY=VALUE"


def test_report_without_java_says_so_in_one_line(captured: Captured, tmp_path: Path) -> None:
    env = {k: v for k, v in SPARK_ENV.items() if k != "JAVA_HOME"}
    env["PATH"] = str(Path(sys.executable).parent)  # python, but no java
    result = subprocess.run([*GATEHOUSE, "report", "--captures", str(captured.captures),
                             "--out", str(tmp_path / "out")], capture_output=True, text=True,
                            timeout=120, env=env)
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0
    assert result.stderr.startswith("error: Spark needs Java")
