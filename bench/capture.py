"""What the observation log costs: direct vs Gatehouse vs Gatehouse with capture, one run.

    python bench/capture.py [--records 200000] [--rounds 2]

Same Kafka broker, same load (Kafka's ProducerPerformance / ConsumerPerformance, acks=all,
1 KiB and 100 KiB records), the two proxies as their own `gatehouse run` processes, the
runs alternating so drift hits all three alike.  Prints MB/s and ratios against direct,
the capture-on/capture-off ratio (the goal: capture costs <= 10%), added request
latency, and what the capture wrote or dropped (from its /metrics counters).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.proxy import compare_throughput, latencies, pct, print_ratios, start_gatehouse
from gatehouse.embedded import free_port
from tests.support.kafka import KafkaCluster


def scrape(port: int, name: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    out = {}
    for line in text.decode().splitlines():
        match = re.match(rf"^{name}(\{{[^}}]*\}})? ([0-9.e+]+)$", line)
        if match:
            out[match.group(1) or ""] = float(match.group(2))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--gzip", action="store_true", help="gzip the capture files")
    args = parser.parse_args()
    os.environ.setdefault("GATEHOUSE_KAFKA_VERSION", "4.4.0")
    captures = Path(tempfile.mkdtemp(prefix="gatehouse-bench-capture-"))
    off_metrics, on_metrics = free_port(), free_port()
    with KafkaCluster(1) as kafka:
        plain, plain_addr = start_gatehouse(
            kafka.bootstrap, f"metrics: {{listen: 127.0.0.1:{off_metrics}}}\n")
        captured, captured_addr = start_gatehouse(
            kafka.bootstrap, f"metrics: {{listen: 127.0.0.1:{on_metrics}}}\n"
            f"capture: {{dir: {captures}, gzip: {str(args.gzip).lower()}}}\n")
        targets = {"direct": kafka.bootstrap, "gatehouse": plain_addr,
                   "capture": captured_addr}
        try:
            results = compare_throughput(kafka, targets, records=args.records,
                                         rounds=args.rounds, sizes=(1024, 100 * 1024))
            lat = {name: latencies(addr) for name, addr in targets.items()}
            written = scrape(on_metrics, "gatehouse_capture_records_total")
            written_bytes = scrape(on_metrics, "gatehouse_capture_bytes_written_total")
        finally:
            for proc in (plain, captured):
                proc.terminate()
                proc.wait(30)
            on_disk = sum(p.stat().st_size for p in captures.iterdir())
            shutil.rmtree(captures, ignore_errors=True)
    print_ratios(results)
    print(f"{'metric':<22}{'capture/gatehouse':>20}")
    for metric in results["direct"]:
        on = statistics.median(results["capture"][metric])
        off = statistics.median(results["gatehouse"][metric])
        print(f"{metric:<22}{on / off:>20.3f}")
    for q in (50, 99):
        direct = pct(lat["direct"], q)
        added = {n: f"{1000 * (pct(v, q) - direct):.3f}" for n, v in lat.items()
                 if n != "direct"}
        print(f"added latency p{q} (ms): {added} (direct p{q} {1000 * direct:.3f})")
    outcomes = {re.sub(r'[{}"]|outcome=', "", k): v for k, v in written.items()}
    print("capture records: " + ", ".join(f"{k}={v:,.0f}" for k, v in outcomes.items()))
    print(f"capture bytes: {written_bytes.get('', 0) / 1e6:,.1f} MB JSON, "
          f"{on_disk / 1e6:,.1f} MB on disk{' (gzip)' if args.gzip else ''}")


if __name__ == "__main__":
    main()
