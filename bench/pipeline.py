"""The PySpark pipeline's throughput on synthetic capture logs with realistic shapes.

    python bench/pipeline.py [--records 1000000 10000000] [--master local[2]]

A generator writes capture files (schema v1, as the proxy writes them): a client mix
of librdkafka wrappers, kafka-python, the Java client, franz-go and clients without
KIP-511; API shares and versions by client; Zipf-distributed topics; log-normal batch
sizes and latencies; rare errors; one hour of time.  Then `gatehouse report` runs over
it with proposed rules (census, traffic, impact, report.html) and the records/s are
printed, with a plain Spark read-and-count of the same files (a baseline measured in
the same run) for the ratio.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gatehouse.capture.schema import SCHEMA_VERSION
from gatehouse.pipeline.job import ReportOptions, read_captures, run_report, spark_session
from gatehouse.rules import parse_rules

# (software name, version, share of connections, {api: version})
CLIENTS = [
    ("confluent-kafka-python", "2.16.1-rdkafka-2.16.0", 0.30,
     {"Produce": 10, "Fetch": 16, "Metadata": 13, "Heartbeat": 4, "OffsetCommit": 9,
      "ListOffsets": 7, "ApiVersions": 3, "FindCoordinator": 4, "JoinGroup": 9}),
    ("confluent-kafka-go", "2.3.0-rdkafka-2.3.0", 0.15,
     {"Produce": 9, "Fetch": 11, "Metadata": 12, "Heartbeat": 4, "OffsetCommit": 8,
      "ListOffsets": 7, "ApiVersions": 3, "FindCoordinator": 3, "JoinGroup": 7}),
    ("apache-kafka-java", "3.7.0", 0.25,
     {"Produce": 10, "Fetch": 16, "Metadata": 12, "Heartbeat": 4, "OffsetCommit": 9,
      "ListOffsets": 8, "ApiVersions": 3, "FindCoordinator": 4, "JoinGroup": 9}),
    ("kafka-python", "2.0.2", 0.12,
     {"Produce": 8, "Fetch": 11, "Metadata": 9, "Heartbeat": 3, "OffsetCommit": 7,
      "ListOffsets": 5, "ApiVersions": 3, "FindCoordinator": 2, "JoinGroup": 5}),
    ("franz-go", "1.16.1", 0.10,
     {"Produce": 11, "Fetch": 16, "Metadata": 12, "Heartbeat": 4, "OffsetCommit": 9,
      "ListOffsets": 8, "ApiVersions": 3, "FindCoordinator": 4, "JoinGroup": 9}),
    (None, None, 0.08,  # old clients: no KIP-511 software name
     {"Produce": 3, "Fetch": 4, "Metadata": 1, "Heartbeat": 1, "OffsetCommit": 2,
      "ListOffsets": 1, "ApiVersions": 0, "FindCoordinator": 0, "JoinGroup": 2}),
]
API_SHARE = {"Produce": 0.38, "Fetch": 0.36, "Metadata": 0.05, "Heartbeat": 0.10,
             "OffsetCommit": 0.06, "ListOffsets": 0.02, "ApiVersions": 0.01,
             "FindCoordinator": 0.01, "JoinGroup": 0.01}
API_KEYS = {"Produce": 0, "Fetch": 1, "ListOffsets": 2, "Metadata": 3, "OffsetCommit": 8,
            "FindCoordinator": 10, "JoinGroup": 11, "Heartbeat": 12, "ApiVersions": 18}
TOPICS = [f"team{i % 17}.events-{i}" for i in range(200)]
HOUR = 3600.0
PROPOSED_RULES = """
- name: modern-produce
  min_api_version: {Produce: 9}
- name: no-pre-kip511
  min_api_version: {Metadata: 4, Fetch: 4}
- name: staging-prefix
  mode: observe
  match: {client_id: "^staging-"}
  topic_prefix: staging.
"""


def _zipf_weights(n: int, s: float = 1.1) -> list[float]:
    return [1.0 / (i + 1) ** s for i in range(n)]


def generate(directory: Path, records: int, seed: int = 7, per_file: int = 250_000) -> int:
    """Writes ``records`` capture records; returns the bytes written."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    topic_weights = _zipf_weights(len(TOPICS))
    apis = list(API_SHARE)
    api_weights = [API_SHARE[a] for a in apis]
    # Connections: each a client with a fixed software, host, client id and topic set.
    n_conns = max(10, records // 400)
    conns = []
    for conn_id in range(1, n_conns + 1):
        name, version, _, versions = rng.choices(CLIENTS, [c[2] for c in CLIENTS])[0]
        host = f"10.{rng.randrange(4)}.{rng.randrange(32)}.{rng.randrange(1, 250)}"
        team = rng.randrange(40)
        prefix = "staging-" if rng.random() < 0.1 else ""
        topics = rng.choices(TOPICS, topic_weights, k=3)
        conns.append((conn_id, name, version, versions, f"{host}:{rng.randrange(30000, 60000)}",
                      f"{prefix}svc-{team}", topics))
    start = time.time() - HOUR
    written = 0
    file_no = 0
    out = None
    dumps = json.dumps
    for i in range(records):
        if i % per_file == 0:
            if out is not None:
                out.close()
            file_no += 1
            out = open(directory / f"gatehouse-bench-{file_no:05d}.jsonl", "w")  # noqa: SIM115
        conn_id, name, version, versions, client, client_id, conn_topics = conns[
            rng.randrange(n_conns)]
        api = rng.choices(apis, api_weights)[0]
        topics = []
        if api in ("Produce", "Fetch"):
            for topic in conn_topics[:rng.randrange(1, 3)]:
                n = max(1, int(rng.lognormvariate(3.0, 1.2)))
                topics.append({"name": topic, "broker": topic, "id": None,
                               "partitions": sorted(rng.sample(range(12), rng.randrange(1, 4))),
                               "records": n, "bytes": int(n * rng.lognormvariate(5.3, 0.6))})
        elif api in ("Metadata", "ListOffsets", "OffsetCommit"):
            topics = [{"name": t, "broker": t, "id": None, "partitions": [], "records": None,
                       "bytes": None} for t in conn_topics[:1]]
        latency = rng.lognormvariate(0.7, 0.8)
        if api == "Fetch" and rng.random() < 0.3:
            latency = rng.uniform(100, 500)  # long polls with nothing to return
        error = rng.random() < 0.004
        record = {
            "v": SCHEMA_VERSION, "time": start + HOUR * i / records, "proxy": "bench",
            "run": "00000000", "conn": conn_id, "client": client, "listener": "bootstrap",
            "client_id": client_id, "software_name": name, "software_version": version,
            "api": api, "api_key": API_KEYS[api], "api_version": versions[api],
            "correlation_id": i & 0x7FFFFFFF, "request_bytes": 100 + sum(
                t["bytes"] or 0 for t in topics) if api == "Produce" else 120,
            "response_bytes": 80 + (sum(t["bytes"] or 0 for t in topics)
                                    if api == "Fetch" else 0),
            "latency_ms": round(latency, 3), "outcome": "answered",
            "errors": [6] if error else [], "error_count": 1 if error else 0,
            "topics": topics, "group_id": f"group-{client_id}" if api in (
                "Heartbeat", "OffsetCommit", "JoinGroup") else None,
            "protocol_type": "consumer" if api == "JoinGroup" else None,
            "protocol_name": "range" if api == "JoinGroup" else None,
            "rules": [], "sample": 1.0,
        }
        line = dumps(record, separators=(",", ":")) + "\n"
        written += len(line)
        assert out is not None
        out.write(line)
    if out is not None:
        out.close()
    return written


def count_baseline(directory: Path, master: str) -> float:
    """Seconds for Spark to read and count the same files (the floor under any report)."""
    options = ReportOptions(captures=str(directory), out=directory, master=master)
    spark = spark_session(options)
    try:
        began = time.perf_counter()
        read_captures(spark, options).count()
        return time.perf_counter() - began
    finally:
        spark.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, nargs="+", default=[1_000_000])
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--keep", action="store_true", help="keep the generated files")
    args = parser.parse_args()
    rules = parse_rules(__import__("yaml").safe_load(PROPOSED_RULES), "proposed.yaml")
    for n in args.records:
        work = Path(tempfile.mkdtemp(prefix="gatehouse-bench-pipeline-"))
        try:
            began = time.perf_counter()
            size = generate(work / "captures", n)
            gen_s = time.perf_counter() - began
            print(f"{n:,} records, {size / 1e6:,.0f} MB generated in {gen_s:.0f} s", flush=True)
            count_s = count_baseline(work / "captures", args.master)
            began = time.perf_counter()
            data = run_report(ReportOptions(captures=str(work / "captures"),
                                            out=work / "report", rules=rules,
                                            master=args.master, driver_memory="2g"))
            report_s = time.perf_counter() - began
            assert data.records == n, (data.records, n)
            print(f"  read+count baseline: {count_s:6.1f} s  {n / count_s:>10,.0f} records/s")
            print(f"  gatehouse report:    {report_s:6.1f} s  {n / report_s:>10,.0f} records/s"
                  f"  (census, traffic, impact of {len(rules.rules)} rules, report.html)")
            print(f"  report / baseline time: {report_s / count_s:.2f}x", flush=True)
        finally:
            if not args.keep:
                shutil.rmtree(work, ignore_errors=True)
            else:
                print(f"  kept {work}")


if __name__ == "__main__":
    main()
