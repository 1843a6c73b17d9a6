"""The report's tables against what they must equal, computed without Spark.

impact/ decides once per distinct combination of what the rules read, then joins the
decisions back: it must say exactly what deciding every record on its own says.  Rules
here read every kind of client fact (client id, source address, listener, software) and
rename topics; the log mixes clients with and without those facts (nulls included).

The latency per API comes from log-scale histograms: within 1% of the exact percentile.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq

from gatehouse.capture.schema import SCHEMA_VERSION
from gatehouse.configfile import load_yaml_text
from gatehouse.pipeline.impact import decide
from gatehouse.pipeline.job import ReportOptions, latency_table, spark_session
from gatehouse.rules import parse_rules
from tests.support.spark import SPARK_ENV

RULES = """\
rules:
  - name: no-legacy-metadata
    match: {client_id: "^legacy-"}
    deny_apis: [Metadata]
  - name: inside-only
    match: {source: 10.1.0.0/16, listener: broker-1}
    min_api_version: {Fetch: 12}
  - name: modern-librdkafka
    min_client_software: {librdkafka: 2.0.0}
    unknown_software: refuse
    mode: observe
  - name: tenant
    match: {client_id: "^staging-"}
    topic_prefix: staging.
  - name: alice-modern-fetch
    match: {principal: "^alice$"}
    min_api_version: {Fetch: 12}
  - name: bob-groups
    match: {principal: "^bob$"}
    allow_groups: ['team-b\\..*']
"""
API = {0: "Produce", 1: "Fetch", 3: "Metadata", 11: "JoinGroup", 18: "ApiVersions"}
VERSIONS = {0: [3, 9], 1: [4, 11, 16], 3: [1, 12], 11: [5, 9], 18: [0, 3]}


def records(count: int) -> list[dict[str, object]]:
    rng = random.Random(5)
    clients = []
    for conn in range(1, 40):
        software = rng.choice([(None, None), ("confluent-kafka-python", "2.6.0-rdkafka-2.6.0"),
                               ("confluent-kafka-go", "1.9.2-rdkafka-1.9.2"),
                               ("apache-kafka-java", "3.7.0")])
        clients.append((conn, f"10.{rng.choice([1, 2])}.0.{rng.randrange(1, 5)}:"
                        f"{rng.randrange(30000, 30100)}", rng.choice(["bootstrap", "broker-1"]),
                        rng.choice([None, "legacy-a", "staging-b", "app"]),
                        rng.choice([None, "alice", "bob"]), *software))
    out = []
    for i in range(count):
        conn, client, listener, client_id, principal, name, version = rng.choice(clients)
        key = rng.choice(list(API))
        topics = [{"name": t, "id": None, "records": 1, "bytes": 10}
                  for t in rng.sample(["orders", "staging.logs", "clicks"], rng.randrange(3))
                  ] if key in (0, 1, 3) else []
        out.append({"v": SCHEMA_VERSION, "time": 1_700_000_000 + i, "proxy": "p", "run": "r",
                    "conn": conn, "client": client, "listener": listener,
                    "client_id": client_id, "principal": principal,
                    "software_name": name, "software_version": version,
                    "api": API[key], "api_key": key, "api_version": rng.choice(VERSIONS[key]),
                    "latency_ms": 1.0, "error_count": 0, "topics": topics, "sample": 1.0,
                    "group_id": rng.choice(["team-a.g", "team-b.g"]) if key == 11 else None})
    return out


def test_impact_says_what_deciding_each_record_says(tmp_path: Path) -> None:
    log = records(3000)
    (tmp_path / "captures").mkdir()
    (tmp_path / "captures" / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    (tmp_path / "rules.yaml").write_text(RULES)
    result = subprocess.run(
        [sys.executable, "-m", "gatehouse.cli", "report", "--captures",
         str(tmp_path / "captures"), "--out", str(tmp_path / "out"), "--rules",
         str(tmp_path / "rules.yaml"), "--master", "local[1]", "--driver-memory", "768m",
         "--shuffle-partitions", "2"],
        capture_output=True, text=True, timeout=600, env=SPARK_ENV)
    assert result.returncode == 0, result.stderr[-3000:]

    ruleset = parse_rules(load_yaml_text(RULES, "rules.yaml"), "rules.yaml")
    expected: Counter[tuple[object, ...]] = Counter()
    for record in log:
        row = {**record, "topic_names": sorted({t["name"] for t in record["topics"]})}
        host = str(record["client"]).rsplit(":", 1)[0]
        for rule, _, action, effect, _, _, _ in decide(ruleset, row):
            expected[(rule, action, effect, record["client_id"], host, record["api"],
                      record["api_version"])] += 1
    got: Counter[tuple[object, ...]] = Counter()
    for r in pq.read_table(tmp_path / "out" / "impact").to_pylist():  # a row per software too
        got[(r["rule"], r["action"], r["effect"], r["client_id"], r["client_host"], r["api"],
             r["api_version"])] += r["requests"]
    assert {rule for rule, *_ in expected} == {
        "no-legacy-metadata", "inside-only", "modern-librdkafka", "tenant",
        "alice-modern-fetch", "bob-groups"}
    assert got == expected


def test_latency_percentiles_are_within_one_percent(tmp_path: Path) -> None:
    rng = random.Random(3)
    rows: list[tuple[str, float | None, float]] = []
    exact: dict[str, list[float]] = {}
    for api, scale in (("Produce", 1.0), ("Fetch", 40.0), ("Metadata", 0.01)):
        for _ in range(5000):
            latency = round(rng.lognormvariate(0, 1.5) * scale, 3)
            weight = rng.choice([1.0, 1.0, 4.0])  # sampled 1 in 4: counts 4 times
            rows.append((api, latency, weight))
            exact.setdefault(api, []).extend([latency] * int(weight))
    rows.append(("Produce", None, 1.0))  # no latency (acks=0): left out
    rows.append(("Metadata", 0.0, 1.0))  # below the floor: in the first bucket
    exact["Metadata"].append(0.0)

    spark = spark_session(ReportOptions(captures="", out=tmp_path, master="local[1]",
                                        shuffle_partitions=2))
    try:
        df = spark.createDataFrame(rows, "api STRING, latency_ms DOUBLE, weight DOUBLE")
        got = {r.api: r for r in latency_table(df).collect()}
    finally:
        spark.stop()
    assert set(got) == set(exact)
    for api, values in exact.items():
        values.sort()
        assert got[api].requests == len(values)
        for share, column in ((0.5, "p50"), (0.99, "p99")):
            true = values[math.ceil(share * len(values)) - 1]  # the first reaching the share
            assert abs(got[api][column] - true) <= 0.01 * true + 0.001, (api, column, true)
