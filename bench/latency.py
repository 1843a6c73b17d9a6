"""Added request latency at half the direct throughput, through Gatehouse, on a real broker.

    python bench/latency.py [--rounds 5] [--seconds 10]

Issue #3's goal: added p99 latency <= 1 ms at half the direct throughput.  Kafka's
ProducerPerformance reports latencies in whole milliseconds, and its JVM at full tilt
shares the two cores with the broker, so bench/proxy.py cannot settle a 1 ms goal.  Here
the load is bench/replay.py's Produce client (48 KiB Produce v12 requests: 3 partitions x
a batch of 16 x 1 KiB records, acks=-1, at most 5 in flight) against one Apache Kafka
broker (KRaft), timed per request with ``time.perf_counter``:

1. its full rate, direct (unpaced, 5 s): the direct throughput;
2. then, alternating direct and Gatehouse (`gatehouse run`, no rules, no metrics), requests
   sent on a fixed schedule at half that rate for ``--seconds``; each request's latency is
   from its send to its answer.

Prints p50/p99/p99.9 per target (median over rounds) and the paired per-round added
latency (Gatehouse minus direct).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.proxy import bench_cluster, start_gatehouse
from bench.replay import PARTITIONS, TOPIC, WORKLOADS, run_client, run_paced_client

PRODUCE_VERSION = 12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    os.environ.setdefault("GATEHOUSE_KAFKA_VERSION", "4.4.0")
    workload = WORKLOADS["produce-1k"]
    with bench_cluster() as kafka:
        kafka.create_topic(TOPIC, partitions=PARTITIONS)
        gate, gate_addr = start_gatehouse(kafka.bootstrap)
        try:
            full = run_client(kafka.bootstrap, workload, 50, 5, PRODUCE_VERSION, 17, None)
            rate = full["requests"] / full["seconds"] / 2
            print(f"direct full rate: {full['mb_per_s']:.1f} MB/s "
                  f"({full['requests'] / full['seconds']:.0f} requests/s); paced at "
                  f"{rate:.0f} requests/s ({full['mb_per_s'] / 2:.1f} MB/s), "
                  f"{args.seconds:g} s a run, {args.rounds} rounds", flush=True)
            targets = {"direct": kafka.bootstrap, "gatehouse": gate_addr}
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in targets}
            for r in range(args.rounds):
                order = list(targets) if r % 2 == 0 else list(reversed(targets))
                for name in order:
                    result = run_paced_client(targets[name], workload, rate, args.seconds,
                                              PRODUCE_VERSION, None)
                    runs[name].append(result)
                    print(f"  round {r + 1} {name:<10} {result['mb_per_s']:6.1f} MB/s  "
                          f"p50 {result['p50_ms']:.3f}  p99 {result['p99_ms']:.3f}  "
                          f"p99.9 {result['p999_ms']:.3f} ms", flush=True)
        finally:
            gate.terminate()
            gate.wait(15)
    print("\n| target | MB/s | p50 ms | p99 ms | p99.9 ms |\n|---|---:|---:|---:|---:|")
    for name, results in runs.items():
        med = {k: statistics.median(x[k] for x in results)
               for k in ("mb_per_s", "p50_ms", "p99_ms", "p999_ms")}
        print(f"| {name} | {med['mb_per_s']:.1f} | {med['p50_ms']:.3f} | {med['p99_ms']:.3f} | "
              f"{med['p999_ms']:.3f} |")
    for key in ("p50_ms", "p99_ms", "p999_ms"):
        added = [g[key] - d[key] for g, d in zip(runs["gatehouse"], runs["direct"], strict=True)]
        print(f"added {key[:-3]}: median {statistics.median(added):+.3f} ms "
              f"(rounds {min(added):+.3f} .. {max(added):+.3f})")
    added_p99 = statistics.median(g["p99_ms"] - d["p99_ms"]
                                  for g, d in zip(runs["gatehouse"], runs["direct"], strict=True))
    print(f"Goal: added p99 <= 1 ms at half the direct throughput: {added_p99:+.3f} ms -> "
          f"{'met' if added_p99 <= 1.0 else 'NOT met'}")


if __name__ == "__main__":
    main()
