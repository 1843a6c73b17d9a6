"""What metrics cost: direct vs Gatehouse without metrics vs Gatehouse with metrics (per-API,
per-error, per-topic counters from record batch headers, latency histograms, group census)
scraped every few seconds, same broker, same run.

    python bench/metrics.py [--records 100000] [--rounds 3] [--scrape-every 5]
                            [--side-by-side-records 1000000]

Load comes from Kafka's ProducerPerformance / ConsumerPerformance (bench/proxy.py's
helpers).  Goal (issue #5): metrics cost <= 5% throughput versus no metrics.

Runs alternate direct / no metrics / metrics, and their throughput drifts by more than
5% from run to run on a shared 2-core machine.  So the producers also run side by side:
one through each proxy at the same time, on the same broker, each printing its rate
every second; the seconds both ran (after the first two) are paired, and their median
ratio is the cost, measured in the same moments.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.proxy import (
    bench_cluster,
    compare_throughput,
    cpu_seconds,
    print_ratios,
    produce_rate,
    start_gatehouse,
)
from gatehouse.embedded import free_port
from tests.support.kafka import KafkaCluster

SIZES = (1024, 100 * 1024)


class Scraper(threading.Thread):
    """Scrapes /metrics every ``every`` seconds, as Prometheus would, until stopped."""

    def __init__(self, url: str, every: float) -> None:
        super().__init__(daemon=True)
        self.url, self.every = url, every
        self.stop = threading.Event()
        self.durations: list[float] = []
        self.size = 0

    def run(self) -> None:
        while not self.stop.wait(self.every):
            t0 = time.perf_counter()
            with urllib.request.urlopen(self.url, timeout=30) as response:
                self.size = len(response.read())
            self.durations.append(time.perf_counter() - t0)


def side_by_side(kafka: KafkaCluster, targets: dict[str, str], *, records: int, size: int,
                 rounds: int) -> tuple[list[float], list[float], dict[str, float]]:
    """Producers through the two targets at once, ``rounds`` times.  Of the seconds both
    ran (the first two, start-up, and the last of the shorter run, a part-second, left
    out): the ``metrics``/``no-metrics`` ratio of each round's MB (its sums), the ratio
    of each second, and each target's median MB/s."""
    per_round: list[float] = []
    per_second: list[float] = []
    rates: dict[str, list[float]] = {name: [] for name in targets}
    for r in range(rounds):
        windows: dict[str, list[float]] = {name: [] for name in targets}
        threads = []
        topics = [f"side-{size}-{name}-{r}" for name in targets]
        for (name, addr), topic in zip(targets.items(), topics, strict=True):
            kafka.create_topic(topic, partitions=3)
            threads.append(threading.Thread(target=produce_rate, args=(
                kafka, addr, topic, records, size), kwargs={"timeout": 900,
                                                            "windows": windows[name]}))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        kafka.delete_topics(topics)  # the disk stays bounded
        both = range(2, min(len(w) for w in windows.values()) - 1)
        if not both:
            raise RuntimeError("the producers ran side by side for under 4 s: more records")
        metered, plain = windows["metrics"], windows["no-metrics"]
        per_round.append(sum(metered[i] for i in both) / sum(plain[i] for i in both))
        per_second.extend(metered[i] / plain[i] for i in both)
        for name in targets:
            rates[name].extend(windows[name][i] for i in both)
    return per_round, per_second, {name: statistics.median(v) for name, v in rates.items()}


def print_alternating(results: dict[str, dict[str, list[float]]],
                      per_mb: dict[str, dict[str, list[float]]], cpu: dict[str, float]) -> None:
    print_ratios(results)
    print("metrics/no-metrics: " + ", ".join(
        f"{metric} {statistics.median(results['metrics'][metric]) / statistics.median(results['no-metrics'][metric]):.3f}"
        for metric in results["direct"]))
    # Runs alternate within a round, so a round's two proxies saw the same machine load:
    # the ratio per round, then its median and spread, is steadier than medians' ratio.
    for metric in results["direct"]:
        paired = sorted(m / n for m, n in zip(results["metrics"][metric],
                                              results["no-metrics"][metric], strict=True))
        print(f"paired metrics/no-metrics per round, {metric}: median "
              f"{statistics.median(paired):.3f} (min {paired[0]:.3f}, max {paired[-1]:.3f})")
    # Where the proxy is the bottleneck, throughput goes as 1 / (CPU per MB): the ratio of
    # the two proxies' CPU per MB of the same runs bounds what metrics cost there.
    for metric in results["direct"]:
        plain_ms = 1000 * statistics.median(per_mb["no-metrics"][metric])
        metered_ms = 1000 * statistics.median(per_mb["metrics"][metric])
        print(f"proxy CPU per MB, {metric.removesuffix(' MB/s')}: no-metrics {plain_ms:.2f} ms, "
              f"metrics {metered_ms:.2f} ms, metrics/no-metrics {metered_ms / plain_ms:.3f}")
    print(f"proxy CPU seconds for the whole run: no-metrics {cpu['no-metrics']:.1f}, "
          f"metrics {cpu['metrics']:.1f}, metrics/no-metrics "
          f"{cpu['metrics'] / cpu['no-metrics']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scrape-every", type=float, default=5.0)
    parser.add_argument("--no-alternating", action="store_true",
                        help="only the side-by-side producers")
    parser.add_argument("--side-by-side-records", type=int, default=1_000_000,
                        help="1 KiB records per producer side by side (0: none); a 50th "
                             "as many of 100 KiB")
    args = parser.parse_args()
    os.environ.setdefault("GATEHOUSE_KAFKA_VERSION", "4.4.0")
    metrics_port = free_port()
    with bench_cluster() as kafka:
        plain, plain_addr = start_gatehouse(kafka.bootstrap)
        metered, metered_addr = start_gatehouse(
            kafka.bootstrap, f"metrics: {{listen: 127.0.0.1:{metrics_port}}}\n")
        scraper = Scraper(f"http://127.0.0.1:{metrics_port}/metrics", args.scrape_every)
        scraper.start()
        try:
            per_mb: dict[str, dict[str, list[float]]] = {}
            results: dict[str, dict[str, list[float]]] = {}
            if not args.no_alternating:
                results = compare_throughput(
                    kafka, {"direct": kafka.bootstrap, "no-metrics": plain_addr,
                            "metrics": metered_addr},
                    records=args.records, rounds=args.rounds, sizes=SIZES,
                    pids={"no-metrics": plain.pid, "metrics": metered.pid}, cpu=per_mb)
            # Both proxies carried the same records: their CPU time is the cost, and it
            # is less disturbed by other load on the machine than throughput is.
            cpu = {"no-metrics": cpu_seconds(plain.pid), "metrics": cpu_seconds(metered.pid)}
            at_once: dict[int, tuple[list[float], list[float], dict[str, float]]] = {}
            if args.side_by_side_records:
                for size in SIZES:
                    n = args.side_by_side_records // (1 if size <= 1024 else 50)
                    at_once[size] = side_by_side(
                        kafka, {"no-metrics": plain_addr, "metrics": metered_addr},
                        records=n, size=size, rounds=args.rounds)
        finally:
            scraper.stop.set()
            scraper.join(60)
            for proc in (plain, metered):
                proc.terminate()
                proc.wait(15)
    if results:
        print_alternating(results, per_mb, cpu)
    for size, (per_round, per_second, rates) in at_once.items():
        per_second.sort()
        print(f"side by side, produce {size // 1024} KiB: metrics/no-metrics MB of the "
              f"seconds both ran, per round {', '.join(f'{r:.3f}' for r in per_round)} "
              f"(median {statistics.median(per_round):.3f}); per second median "
              f"{statistics.median(per_second):.3f} (quartiles "
              f"{per_second[len(per_second) // 4]:.3f}-"
              f"{per_second[3 * len(per_second) // 4]:.3f}, {len(per_second)} s); "
              f"median MB/s no-metrics {rates['no-metrics']:.1f}, metrics "
              f"{rates['metrics']:.1f}")
    if scraper.durations:
        print(f"scrapes: {len(scraper.durations)}, median "
              f"{1000 * statistics.median(scraper.durations):.1f} ms, max "
              f"{1000 * max(scraper.durations):.1f} ms, last {scraper.size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
