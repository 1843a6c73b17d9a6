"""What the observation log costs: direct vs Gatehouse vs Gatehouse with capture, one run.

    python bench/capture.py [--records 200000] [--rounds 2] [--formats jsonl parquet]

Same Kafka broker, same load (Kafka's ProducerPerformance / ConsumerPerformance, acks=all,
1 KiB and 100 KiB records), the proxies as their own `gatehouse run` processes (one
without capture, one per capture format), the runs alternating so drift hits all alike.
Prints MB/s and ratios against direct, each capture-on/capture-off ratio (the goal:
capture costs <= 10%), added request latency, each proxy's CPU, and what the captures
wrote or dropped (from their /metrics counters).
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

from bench.proxy import (
    bench_cluster,
    compare_throughput,
    cpu_seconds,
    latencies,
    pct,
    print_ratios,
    start_gatehouse,
)
from gatehouse.embedded import free_port


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
    parser.add_argument("--gzip", action="store_true", help="gzip the jsonl capture files")
    parser.add_argument("--formats", nargs="+", choices=("jsonl", "parquet"),
                        default=["jsonl"], help="capture.format: one proxy each, same run")
    args = parser.parse_args()
    os.environ.setdefault("GATEHOUSE_KAFKA_VERSION", "4.4.0")
    work = Path(tempfile.mkdtemp(prefix="gatehouse-bench-capture-"))
    off_metrics = free_port()
    procs = []
    with bench_cluster() as kafka:
        plain, plain_addr = start_gatehouse(
            kafka.bootstrap, f"metrics: {{listen: 127.0.0.1:{off_metrics}}}\n")
        procs.append(plain)
        targets = {"direct": kafka.bootstrap, "gatehouse": plain_addr}
        capturing: dict[str, tuple[int, Path]] = {}  # target -> metrics port, directory
        for capture_format in args.formats:
            name, port = f"capture-{capture_format}", free_port()
            gzip = args.gzip and capture_format == "jsonl"
            captured, targets[name] = start_gatehouse(
                kafka.bootstrap, f"metrics: {{listen: 127.0.0.1:{port}}}\n"
                f"capture: {{dir: {work / name}, gzip: {str(gzip).lower()}, "
                f"format: {capture_format}}}\n")
            procs.append(captured)
            capturing[name] = (port, work / name)
        pids = dict(zip(["gatehouse", *capturing], [p.pid for p in procs], strict=True))
        try:
            results = compare_throughput(kafka, targets, records=args.records,
                                         rounds=args.rounds, sizes=(1024, 100 * 1024))
            lat = {name: latencies(addr) for name, addr in targets.items()}
            cpu = {name: cpu_seconds(pid) for name, pid in pids.items()}
            written = {name: scrape(port, "gatehouse_capture_records_total")
                       for name, (port, _) in capturing.items()}
            written_bytes = {name: scrape(port, "gatehouse_capture_bytes_written_total")
                             for name, (port, _) in capturing.items()}
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(30)
            on_disk = {name: sum(p.stat().st_size for p in directory.iterdir())
                       for name, (_, directory) in capturing.items()}
            shutil.rmtree(work, ignore_errors=True)
    print_ratios(results)
    print(f"{'metric':<22}" + "".join(f"{name + '/gatehouse':>26}" for name in capturing))
    for metric in results["direct"]:
        off = statistics.median(results["gatehouse"][metric])
        print(f"{metric:<22}" + "".join(
            f"{statistics.median(results[name][metric]) / off:>26.3f}" for name in capturing))
    for q in (50, 99):
        direct = pct(lat["direct"], q)
        added = {n: f"{1000 * (pct(v, q) - direct):.3f}" for n, v in lat.items()
                 if n != "direct"}
        print(f"added latency p{q} (ms): {added} (direct p{q} {1000 * direct:.3f})")
    print("proxy CPU seconds (whole run, same traffic): " + ", ".join(
        f"{name}={seconds:.1f}" for name, seconds in cpu.items()))
    for name in capturing:
        outcomes = {re.sub(r'[{}"]|outcome=', "", k): v for k, v in written[name].items()}
        encoded = "JSON" if name.endswith("jsonl") else "Parquet row groups"
        print(f"{name}: records " + ", ".join(f"{k}={v:,.0f}" for k, v in outcomes.items())
              + f"; {written_bytes[name].get('', 0) / 1e6:,.1f} MB {encoded}, "
              f"{on_disk[name] / 1e6:,.1f} MB on disk"
              + (" (gzip)" if args.gzip and name.endswith("jsonl") else ""))


if __name__ == "__main__":
    main()
