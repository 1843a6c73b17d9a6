"""What metrics cost: direct vs Gatehouse without metrics vs Gatehouse with metrics (per-API,
per-error, per-topic counters from record batch headers, latency histograms, group census)
scraped every few seconds, same broker, same run.

    python bench/metrics.py [--records 100000] [--rounds 3] [--scrape-every 5]

Load comes from Kafka's ProducerPerformance / ConsumerPerformance (bench/proxy.py's
helpers).  Goal (issue #5): metrics cost <= 5% throughput versus no metrics.
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

from bench.proxy import compare_throughput, cpu_seconds, print_ratios, start_gatehouse
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scrape-every", type=float, default=5.0)
    args = parser.parse_args()
    os.environ.setdefault("GATEHOUSE_KAFKA_VERSION", "4.4.0")
    metrics_port = free_port()
    with KafkaCluster(1) as kafka:
        plain, plain_addr = start_gatehouse(kafka.bootstrap)
        metered, metered_addr = start_gatehouse(
            kafka.bootstrap, f"metrics: {{listen: 127.0.0.1:{metrics_port}}}\n")
        scraper = Scraper(f"http://127.0.0.1:{metrics_port}/metrics", args.scrape_every)
        scraper.start()
        try:
            per_mb: dict[str, dict[str, list[float]]] = {}
            results = compare_throughput(
                kafka, {"direct": kafka.bootstrap, "no-metrics": plain_addr,
                        "metrics": metered_addr},
                records=args.records, rounds=args.rounds, sizes=SIZES,
                pids={"no-metrics": plain.pid, "metrics": metered.pid}, cpu=per_mb)
            # Both proxies carried the same records: their CPU time is the cost, and it
            # is less disturbed by other load on the machine than throughput is.
            cpu = {"no-metrics": cpu_seconds(plain.pid), "metrics": cpu_seconds(metered.pid)}
        finally:
            scraper.stop.set()
            scraper.join(60)
            for proc in (plain, metered):
                proc.terminate()
                proc.wait(15)
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
    if scraper.durations:
        print(f"scrapes: {len(scraper.durations)}, median "
              f"{1000 * statistics.median(scraper.durations):.1f} ms, max "
              f"{1000 * max(scraper.durations):.1f} ms, last {scraper.size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
