"""The PySpark pipeline's throughput on synthetic capture logs with realistic shapes.

    python bench/pipeline.py [--records 1000000 10000000] [--format parquet|jsonl]
                             [--master local[2]] [--cluster]

A generator writes capture files (schema v1, as the proxy's writer writes them, JSON
Lines or Parquet): a client mix
of librdkafka wrappers, kafka-python, the Java client, franz-go and clients without
KIP-511; API shares and versions by client; Zipf-distributed topics; log-normal batch
sizes and latencies; rare errors; one hour of time.  Then `gatehouse report` runs over
it with proposed rules (census, traffic, impact, report.html) and the records/s are
printed: of the job, and with Spark's start and stop (a fixed cost, whatever the size),
beside a plain Spark read-and-count of the same files.  ``--cluster`` runs the same job
on a Spark standalone cluster of 1 worker with 1 core, then 2 workers with 1 core each,
and prints the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gatehouse.capture.schema import SCHEMA_VERSION
from gatehouse.capture.writer import BATCH, ParquetEncoder
from gatehouse.pipeline.job import ReportOptions, read_captures, report, spark_session
from gatehouse.rules import parse_rules
from tests.support.spark import SparkStandalone

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
# Standalone clusters for --cluster: (name, workers, cores each, CPUs of each worker).
CLUSTERS = [("1 worker x 1 core", 1, 1, ["0"]), ("1 worker x 2 cores", 1, 2, ["0,1"]),
            ("2 workers x 1 core", 2, 1, ["0", "1"])]
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


def synthetic_records(records: int, seed: int = 7) -> Iterator[dict[str, Any]]:
    """``records`` capture records (schema v1) with the shapes described above."""
    rng = random.Random(seed)
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
    for i in range(records):
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
        yield {
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


def generate(directory: Path, records: int, seed: int = 7, per_file: int = 250_000,
             file_format: str = "jsonl") -> int:
    """Writes ``records`` capture records as the proxy's writer would (JSON Lines, or
    Parquet through its ``ParquetEncoder``); returns the bytes on disk."""
    directory.mkdir(parents=True, exist_ok=True)
    source = synthetic_records(records, seed)
    file_no = 0
    while True:
        chunk = list(islice(source, per_file))
        if not chunk:
            break
        file_no += 1
        path = directory / f"gatehouse-bench-{file_no:05d}.{file_format}"
        with open(path, "xb") as out:
            if file_format == "parquet":
                encoder = ParquetEncoder(max_pending_bytes=1 << 40)
                encoder.open(out)
                for i in range(0, len(chunk), BATCH):  # the writer thread's batches
                    if encoder.add(encoder.encode(chunk[i:i + BATCH])):
                        encoder.flush()
                encoder.flush()
                encoder.close()
            else:
                dumps = json.dumps
                out.write("".join(dumps(r, separators=(",", ":")) + "\n"
                                  for r in chunk).encode())
    return sum(p.stat().st_size for p in directory.iterdir())


@dataclass
class Timing:
    session_s: float  # starting Spark (the JVM, the executors): once per run, any size
    job_s: float  # the report's passes, tables and report.html (or the baseline's count)
    stop_s: float

    def rates(self, n: int) -> str:
        total = self.session_s + self.job_s + self.stop_s
        return (f"{self.job_s:6.1f} s job {n / self.job_s:>10,.0f} records/s | "
                f"{total:6.1f} s with Spark's start/stop {n / total:>10,.0f} records/s")


def run_one(spec: dict[str, Any]) -> Timing:
    """One measured run in this (fresh) process: a cold JVM, like ``gatehouse report``."""
    rules = parse_rules(yaml.safe_load(PROPOSED_RULES), "proposed.yaml")
    options = ReportOptions(captures=spec["captures"], out=Path(spec["out"]), rules=rules,
                            master=spec["master"], driver_memory="2g",
                            executor_memory=spec["executor_memory"], spark_conf=spec["conf"])
    began = time.perf_counter()
    spark = spark_session(options)
    try:
        # On a cluster: the executors' JVMs are part of the start, not of the job.
        deadline = time.monotonic() + 120
        while (spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size()
               < spec["executors"] + 1 and time.monotonic() < deadline):
            time.sleep(0.1)
        started = time.perf_counter()
        if spec["kind"] == "count":  # the baseline: read the same files and count them
            records = read_captures(spark, options).count()
        else:
            records = report(spark, options).records
        done = time.perf_counter()
    finally:
        spark.stop()
    stopped = time.perf_counter()
    assert records == spec["records"], (records, spec["records"])
    return Timing(started - began, done - started, stopped - done)


def measured(kind: str, captures: Path, out: Path, master: str, n: int,
             executors: int = 0, executor_memory: str = "1g",
             conf: dict[str, str] | None = None) -> Timing:
    """``run_one`` in a new Python process (so a JVM warmed by an earlier run is not reused);
    ``executors``: how many to wait for before the clock starts (0: local)."""
    spec = {"kind": kind, "captures": str(captures), "out": str(out), "master": master,
            "records": n, "executors": executors, "executor_memory": executor_memory,
            "conf": conf or {}}
    result = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)],
                            capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{kind} run failed:\n{result.stderr[-3000:]}")
    return Timing(**json.loads(result.stdout.strip().splitlines()[-1]))


def load() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, nargs="+", default=[1_000_000])
    parser.add_argument("--format", choices=("parquet", "jsonl"), default="parquet",
                        help="capture.format of the generated files")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--cluster", action="store_true",
                        help="also on a Spark standalone cluster: 1 worker of 1 core, 1 worker "
                        "of 2 cores, 2 workers of 1 core, each worker (and its executor) "
                        "pinned to its CPUs (the scaling a 2-core machine can show)")
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                        help="a Spark setting for the local report, as `gatehouse report "
                        "--conf` (e.g. spark.driver.extraJavaOptions=-XX:TieredStopAtLevel=1)")
    parser.add_argument("--keep", action="store_true", help="keep the generated files")
    parser.add_argument("--data", type=Path, help="keep the generated files here and reuse "
                        "them on the next run (<data>/<format>-<records>/)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a measured run (a child process)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(asdict(run_one(json.loads(args.one)))))
        return
    rules = parse_rules(yaml.safe_load(PROPOSED_RULES), "proposed.yaml")
    what = f"census, traffic, impact of {len(rules.rules)} rules, report.html"
    for n in args.records:
        work = Path(tempfile.mkdtemp(prefix="gatehouse-bench-pipeline-"))
        captures = work / "captures"
        if args.data:
            captures = args.data / f"{args.format}-{n}"
        try:
            if captures.is_dir():
                size = sum(p.stat().st_size for p in captures.iterdir())
                print(f"{n:,} records, {size / 1e6:,.0f} MB of {args.format} from {captures}",
                      flush=True)
            else:
                began = time.perf_counter()
                size = generate(captures, n, file_format=args.format)
                print(f"{n:,} records, {size / 1e6:,.0f} MB of {args.format} generated in "
                      f"{time.perf_counter() - began:.0f} s", flush=True)
            print(f"  {size / n:.0f} bytes/record; machine load {load()} (1-minute average, "
                  f"{os.cpu_count()} cores)", flush=True)
            if not args.skip_baseline:
                timing = measured("count", captures, work / "count", args.master, n)
                print(f"  read+count baseline ({args.master}): {timing.rates(n)}  "
                      f"(load {load()})", flush=True)
            conf = dict(pair.split("=", 1) for pair in args.conf)
            timing = measured("report", captures, work / "report", args.master, n, conf=conf)
            print(f"  gatehouse report ({args.master}{', ' if conf else ''}"
                  f"{', '.join(args.conf)}): {timing.rates(n)}  "
                  f"(Spark start {timing.session_s:.1f} s; {what}; load {load()})", flush=True)
            if args.cluster:
                rates = {}
                for name, workers, cores, cpus in CLUSTERS:
                    with SparkStandalone(work / name, workers=workers, cores=cores,
                                         memory="1536m", cpus=cpus) as master:
                        timing = measured("report", captures, work / f"report-{name}", master,
                                          n, workers)
                    rates[name] = n / timing.job_s
                    print(f"  standalone, {name} (CPUs {'/'.join(cpus)}): {timing.rates(n)}  "
                          f"(load {load()})", flush=True)
                one = rates[CLUSTERS[0][0]]
                print("  scaling (job records/s): " + ", ".join(
                    f"{name} / {CLUSTERS[0][0]} {rate / one:.2f}x"
                    for name, rate in list(rates.items())[1:]), flush=True)
        finally:
            if not args.keep:
                shutil.rmtree(work, ignore_errors=True)
            else:
                print(f"  kept {work}")


if __name__ == "__main__":
    main()
