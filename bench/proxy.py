"""Direct vs through Gatehouse vs through Tansu's proxy, same Kafka broker, same run.

    python bench/proxy.py [--records 500000] [--rounds 2]

Load comes from Kafka's own ProducerPerformance / ConsumerPerformance (separate JVMs),
the proxy runs as its own process (`gatehouse run`), and the runs alternate
direct / gatehouse / tansu, each round starting with the next, so drift hits all three
alike.  Prints ratios against direct: throughput (1 KiB and 100 KiB records, acks=all),
consumer throughput (from the first fetch: the group join left out), added latency
p50/p99 of a request-response loop at low load, and the proxy's RSS with 1,000 idle
client connections.
"""

from __future__ import annotations

import argparse
import atexit
import os
import re
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gatehouse import codecs
from gatehouse.embedded import free_port, tansu_binary, wait_for_port
from tests.support.clients import recv_exact
from tests.support.kafka import BROKER_JVM_OPTS, CONSUMER_PERF, PERF, KafkaCluster

T = TypeVar("T")

# The broker and the Java clients run as production runs them, with the JVM's full JIT.
# The tests' options stop at C1 (-XX:TieredStopAtLevel=1, a quicker start), whose code
# spends more CPU a byte (and has no AES-GCM intrinsics: TLS at 14-20 MB/s): on this
# 2-core host the JVMs then took cores from the proxy, and a proxy's share weighed less.
# Tables in RESULTS.md before the forty-ninth session's were measured with C1 JVMs.
BROKER_JVM = tuple(opt for opt in BROKER_JVM_OPTS if not opt.startswith("-XX:TieredStopAtLevel"))
CLIENT_JVM = ("-Xmx512m", "-XX:+UseSerialGC", "-XX:-UsePerfData", "-Djava.awt.headless=true")
_SIZE = struct.Struct(">i")


def bench_cluster(brokers: int = 1, **options: Any) -> KafkaCluster:
    """The tests' KafkaCluster with the broker's JVM as production runs it (``BROKER_JVM``)."""
    return KafkaCluster(brokers, jvm_opts=BROKER_JVM, **options)


def start_gatehouse(upstream: str, extra_config: str = "") -> tuple[subprocess.Popen[bytes], str]:
    """``gatehouse run`` as its own process; ``extra_config`` is appended YAML (rules...)."""
    port = free_port()
    config = Path(tempfile.mkdtemp()) / "gatehouse.yaml"
    config.write_text(f"listen: 127.0.0.1:{port}\nupstream: [{upstream}]\n"
                      "brokers: {start_port: 0}\n"
                      "log: {level: WARNING}\n" + extra_config)
    proc = subprocess.Popen([sys.executable, "-m", "gatehouse.cli", "run", "--config",
                             str(config)], stdin=subprocess.DEVNULL)
    wait_for_port("127.0.0.1", port, 30, proc)
    return proc, f"127.0.0.1:{port}"


_TANSU_LOGS: dict[int, Path] = {}  # a Tansu proxy's pid -> its log (warnings and errors)


def start_tansu_proxy(upstream: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    fd, name = tempfile.mkstemp(prefix="gatehouse-tansu-proxy-", suffix=".log")
    with os.fdopen(fd, "wb") as log:
        proc = subprocess.Popen([str(tansu_binary()), "proxy", "--listener-url", url,
                                 "--advertised-listener-url", url, "--origin-url",
                                 f"tcp://{upstream}"], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL,
                                env={**os.environ, "RUST_LOG": "warn", "NO_COLOR": "1"})
    _TANSU_LOGS[proc.pid] = Path(name)
    atexit.register(Path(name).unlink, missing_ok=True)  # read by then, if it failed
    wait_for_port("127.0.0.1", port, 30, proc)
    return proc, f"127.0.0.1:{port}"


def peer_log_errors(proc: subprocess.Popen[bytes] | None) -> str:
    """What a Tansu proxy logged as errors (how many, the most frequent), for the report
    of a workload it failed; empty for any other peer or none logged.  Its log goes."""
    log = _TANSU_LOGS.pop(proc.pid, None) if proc is not None else None
    if log is None or not log.exists():
        return ""
    # "<time> ERROR <span>: <where>: err=...": counted by what follows the time.
    errors = Counter(line.split(" ERROR ", 1)[1][-200:]
                     for line in log.read_text(errors="replace").splitlines()
                     if " ERROR " in line)
    log.unlink()
    if not errors:
        return ""
    common = "; ".join(f"{n} x {text}" for text, n in errors.most_common(2))
    return f" (its log: {errors.total()} errors, most often: {common})"


# A ProducerPerformance progress line, and the summary line (the last) alike.
PRODUCED = re.compile(r"(\d+) records sent, ([\d.]+) records/sec \(([\d.]+) MB/sec\)")


def produce_rate(kafka: KafkaCluster, bootstrap: str, topic: str, records: int,
                 size: int, timeout: float = 600, windows: list[float] | None = None,
                 payload_file: Path | None = None, props: Sequence[str] = (),
                 jvm_opts: Sequence[str] = CLIENT_JVM) -> float:
    """ProducerPerformance's MB/s; with ``windows``, the MB/s of each second of the run
    are added to it too.  With ``payload_file``, records are its lines, drawn at random
    (``size`` unused).  ``props``: more producer properties (``key=value``: TLS...);
    ``jvm_opts``: the client JVM's own."""
    interval = () if windows is None else ("--reporting-interval", "1000")
    payload = (("--record-size", str(size)) if payload_file is None
               else ("--payload-file", str(payload_file)))
    result = kafka.run_java_tool(PERF, "--topic", topic, "--num-records", str(records),
                                 *payload, "--throughput", "-1",
                                 *interval,
                                 "--producer-props", f"bootstrap.servers={bootstrap}",
                                 "acks=all", "linger.ms=5", "delivery.timeout.ms=60000",
                                 *props, timeout=timeout, jvm_opts=jvm_opts)
    lines = result.stdout.strip().splitlines() if result.stdout else []
    match = PRODUCED.search(lines[-1] if lines else "")
    if result.returncode != 0 or match is None:
        raise RuntimeError(f"ProducerPerformance failed: {result.stderr[-1500:]}")
    if windows is not None:
        windows.extend(float(m.group(3)) for line in lines[:-1]
                       if (m := PRODUCED.match(line)))
    return float(match.group(3))


# ProducerPerformance's summary line; the producer's own metric (--print-metrics).
PERCENTILES = re.compile(r"([\d.]+) ms avg latency.*?([\d.]+) ms 50th, [\d.]+ ms 95th, "
                         r"([\d.]+) ms 99th")
REQUEST_LATENCY = re.compile(r"^producer-metrics:request-latency-avg:.*: ([\d.]+)$", re.M)


def produce_latency(kafka: KafkaCluster, bootstrap: str, topic: str, records: int,
                    size: int, rate: int) -> tuple[float, float, float, float]:
    """ProducerPerformance throttled to ``rate`` records/s: its steady-state record
    latency (p50, p99, average; the first quarter of the records, JIT warm-up and
    connections, left out: whole milliseconds but the average) and the producer's own
    average request latency (its ``request-latency-avg`` metric, over the run), in ms."""
    result = kafka.run_java_tool(PERF, "--topic", topic, "--num-records", str(records),
                                 "--warmup-records", str(records // 4),
                                 "--record-size", str(size), "--throughput", str(rate),
                                 "--print-metrics",
                                 "--producer-props", f"bootstrap.servers={bootstrap}",
                                 "acks=all", "linger.ms=0", timeout=600, jvm_opts=CLIENT_JVM)
    found = PERCENTILES.findall(result.stdout or "")
    match = found[-1] if found else None  # the steady-state summary comes last
    request = REQUEST_LATENCY.search(result.stdout or "")
    if result.returncode != 0 or match is None or request is None:
        raise RuntimeError(f"ProducerPerformance failed: {result.stderr[-1500:]}")
    return float(match[1]), float(match[2]), float(match[0]), float(request[1])


def consume_rate(kafka: KafkaCluster, bootstrap: str, topic: str, records: int,
                 props: Sequence[str] = (), jvm_opts: Sequence[str] = CLIENT_JVM) -> float:
    """ConsumerPerformance's fetch.MB.sec: MB over the time from its first fetch to its last
    record.  Its MB.sec also counts the group join before the first fetch (0.2-0.4 s here,
    through a proxy or not), a third of a run that moves 500 MB in a second.  ``props``:
    more consumer properties (``key=value``); ``jvm_opts`` as ``produce_rate``'s."""
    result = kafka.run_java_tool(CONSUMER_PERF, "--bootstrap-server", bootstrap, "--topic",
                                 topic, "--messages", str(records), "--timeout", "60000",
                                 *(a for prop in props for a in ("--command-property", prop)),
                                 timeout=600, jvm_opts=jvm_opts)
    lines = [ln for ln in result.stdout.splitlines() if ln and ln[0].isdigit()]
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"ConsumerPerformance failed: {result.stderr[-1500:]}")
    # start.time, end.time, data.consumed.in.MB, MB.sec, data.consumed.in.nMsg, nMsg.sec,
    # rebalance.time.ms, fetch.time.ms, fetch.MB.sec, fetch.nMsg.sec
    return float(lines[-1].split(",")[8])


def rotated(items: list[T], round_: int) -> list[T]:
    """``items`` starting at the ``round_``-th (cyclically): each round starts with another
    target, so that what a place in the order costs (the broker's state after the one
    before) moves round rather than always falling on the same target."""
    k = round_ % len(items)
    return items[k:] + items[:k]


def compare_throughput(kafka: KafkaCluster, targets: dict[str, str], *, records: int,
                       rounds: int, sizes: tuple[int, ...] = (1024,),
                       topic_for: Callable[[str, int, int], str] | None = None,
                       broker_topic: Callable[[str], str] = lambda t: t,
                       pids: Mapping[str, int] | None = None,
                       cpu: dict[str, dict[str, list[float]]] | None = None,
                       payload_file: Path | None = None,
                       client_props: Mapping[str, Sequence[str]] | None = None,
                       ) -> dict[str, dict[str, list[float]]]:
    """Produce (acks=all) then consume through each target, alternating targets each round
    so drift hits them alike; MB/s lists per target and metric.  ``payload_file``: the
    producer's records are its lines (``produce_rate``); ``client_props``: a target's own
    client properties (TLS...), for its producer and consumer alike.

    ``topic_for(name, size, round)`` is the topic the client uses and ``broker_topic`` maps
    it to the name to create on the broker (they differ behind a rename rule).  With
    ``pids`` (a proxy process per target name), ``cpu`` gets that process's CPU seconds
    per MB of each run, per target and metric.
    """
    topic_for = topic_for or (lambda name, size, r: f"bench-{size}-{name}-{r}")
    results: dict[str, dict[str, list[float]]] = {name: {} for name in targets}
    for size in sizes:
        n = records if size <= 1024 else max(records // 50, 500)
        for r in range(rounds):
            for name, addr in rotated(list(targets.items()), r):
                topic = topic_for(name, size, r)
                kafka.create_topic(broker_topic(topic), partitions=3)
                label = f"{size // 1024} KiB"
                props = (client_props or {}).get(name, ())
                for metric, run in ((f"produce {label} MB/s", partial(produce_rate, size=size,
                                                                 payload_file=payload_file,
                                                                 props=props)),
                                    (f"consume {label} MB/s", partial(
                                        consume_rate, props=props))):
                    measure(results, cpu, name, metric, (pids or {}).get(name),
                            n * size / 1e6, partial(run, kafka, addr, topic, n))
                kafka.delete_topics([broker_topic(topic)])  # the disk stays bounded
    return results


def measure(results: dict[str, dict[str, list[float]]],
            cpu: dict[str, dict[str, list[float]]] | None, name: str, metric: str,
            pid: int | None, megabytes: float, run: Callable[[], float]) -> None:
    """One run of a workload through target ``name``: its MB/s added to ``results``, and,
    with a ``pid`` (the target's proxy process) and ``cpu``, that process's CPU seconds
    per MB of the ``megabytes`` the run moved."""
    before = cpu_seconds(pid) if pid else 0.0
    results.setdefault(name, {}).setdefault(metric, []).append(run())
    if pid and cpu is not None:
        cpu.setdefault(name, {}).setdefault(metric, []).append(
            (cpu_seconds(pid) - before) / megabytes)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc/<pid>/stat)."""
    return sum(user_system_seconds(pid))


def user_system_seconds(pid: int) -> tuple[float, float]:
    """User and system CPU time of a process so far, apart (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def compare_rules(name: str, rules: str, *, records: int, rounds: int,
                  sizes: tuple[int, ...], broker_topic: Callable[[str], str] = lambda t: t,
                  cpu: dict[str, dict[str, list[float]]] | None = None,
                  payload_file: Path | None = None,
                  ) -> dict[str, dict[str, list[float]]]:
    """``compare_throughput`` of direct, Gatehouse without rules ("no-rules") and
    Gatehouse with ``rules`` (``name``), on a broker of its own: what the rules cost."""
    with bench_cluster() as kafka:
        plain, plain_addr = start_gatehouse(kafka.bootstrap)
        ruled, ruled_addr = start_gatehouse(kafka.bootstrap, rules)
        try:
            return compare_throughput(
                kafka, {"direct": kafka.bootstrap, "no-rules": plain_addr, name: ruled_addr},
                records=records, rounds=rounds, sizes=sizes, broker_topic=broker_topic,
                pids={"no-rules": plain.pid, name: ruled.pid}, cpu=cpu,
                payload_file=payload_file)
        finally:
            for proc in (plain, ruled):
                proc.terminate()
                proc.wait(15)


def print_against(results: dict[str, dict[str, list[float]]], name: str,
                  baseline: str) -> None:
    """One line: ``name``'s median over ``baseline``'s, per metric (what a feature costs
    against the proxy without it)."""
    print(f"{name}/{baseline}: " + ", ".join(
        f"{metric} {statistics.median(results[name][metric]) / statistics.median(results[baseline][metric]):.3f}"
        for metric in results[baseline]))


def print_ratios(results: dict[str, dict[str, list[float]]], baseline: str = "direct") -> None:
    """Median MB/s per target and metric, and each target's ratio to the baseline."""
    names = list(results)
    others = [n for n in names if n != baseline]
    print(f"{'metric':<22}" + "".join(f"{n:>16}" for n in names)
          + "".join(f"{n + '/' + baseline:>26}" for n in others))
    for metric in results[baseline]:
        row = {n: statistics.median(results[n][metric]) for n in names}
        print(f"{metric:<22}" + "".join(f"{row[n]:>16.1f}" for n in names)
              + "".join(f"{row[n] / row[baseline]:>26.3f}" for n in others))


def latencies(bootstrap: str, n: int = 2000) -> list[float]:
    host, port = bootstrap.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out = []
    body = codecs.api(18).request.root.cls()
    for i in range(n):
        frame = bytes(codecs.Request.build(18, 3, i, "bench", body).encode())
        t0 = time.perf_counter()
        sock.sendall(struct.pack(">i", len(frame)) + frame)
        receive_frame(sock)
        out.append(time.perf_counter() - t0)
    sock.close()
    return out


def receive_frame(sock: socket.socket) -> bytes:
    """One size-prefixed frame from a blocking socket: its bytes after the prefix."""
    return recv_exact(sock, _SIZE.unpack(recv_exact(sock, 4))[0])



def rss_with_idle_connections(proc: subprocess.Popen[bytes], bootstrap: str,
                              n: int = 1000) -> tuple[float, float]:
    def rss() -> float:
        text = Path(f"/proc/{proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+)", text).group(1)) / 1024  # type: ignore[union-attr]

    before = rss()
    host, port = bootstrap.rsplit(":", 1)
    socks = []
    frame = bytes(codecs.Request.build(18, 3, 1, "idle", codecs.api(18).request.root.cls())
                  .encode())
    for _ in range(n):
        s = socket.create_connection((host, int(port)))
        s.sendall(struct.pack(">i", len(frame)) + frame)
        socks.append(s)
    for s in socks:  # every connection has been served once, then sits idle
        receive_frame(s)
    after = rss()
    for s in socks:
        s.close()
    return before, after


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1]


def main() -> None:
    parser = argparse.ArgumentParser()
    # 500,000 x 1 KiB: a consumer reads 100,000 in well under a second, when its start-up
    # and group join weigh as much as the transfer and hide the proxy's cost.
    parser.add_argument("--records", type=int, default=500_000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("GATEHOUSE_KAFKA_VERSION", "4.4.0")
    with bench_cluster() as kafka:
        gate, gate_addr = start_gatehouse(kafka.bootstrap)
        tansu, tansu_addr = start_tansu_proxy(kafka.bootstrap)
        targets = {"direct": kafka.bootstrap, "gatehouse": gate_addr, "tansu-proxy": tansu_addr}
        results: dict[str, dict[str, list[float]]] = {k: {} for k in targets}
        broken: dict[str, str] = {}
        try:
            for size, records in ((1024, args.records), (100 * 1024, max(args.records // 50,
                                                                        500))):
                for r in range(args.rounds):
                    for name, addr in rotated(list(targets.items()), r):
                        if name in broken:
                            continue
                        topic = f"bench-{size}-{name}-{r}"
                        kafka.create_topic(topic, partitions=3)
                        try:
                            mbs = produce_rate(kafka, addr, topic, records, size, timeout=180)
                        except Exception as exc:  # a peer that cannot carry the load
                            broken[name] = str(exc).splitlines()[0][:200]
                        else:
                            results[name].setdefault(f"produce {size // 1024} KiB MB/s",
                                                     []).append(mbs)
                            if size == 1024:
                                c = consume_rate(kafka, addr, topic, records)
                                results[name].setdefault("consume 1 KiB MB/s", []).append(c)
                        finally:
                            kafka.delete_topics([topic])  # the disk stays bounded
            lat = {name: latencies(addr) for name, addr in targets.items() if name not in broken}
            # Added producer latency at half the direct 1 KiB throughput (records/s).
            half = int(statistics.median(results["direct"]["produce 1 KiB MB/s"])
                       * 1e6 / 1024 / 2)
            at_half: dict[str, list[tuple[float, float, float, float]]] = {}
            for r in range(args.rounds):
                for name, addr in rotated(list(targets.items()), r):
                    if name in broken:
                        continue
                    topic = f"bench-half-{name}-{r}"
                    kafka.create_topic(topic, partitions=3)
                    at_half.setdefault(name, []).append(
                        produce_latency(kafka, addr, topic, half * 20, 1024, half))
                    kafka.delete_topics([topic])
            before, after = rss_with_idle_connections(gate, gate_addr)
        finally:
            for proc in (gate, tansu):
                proc.terminate()
                proc.wait(15)
    print(f"{'metric':<24}" + "".join(f"{n:>14}" for n in targets) + "   gatehouse/direct"
          "   tansu/direct")
    nan = float("nan")
    for metric in results["direct"]:
        row = {n: statistics.median(results[n][metric]) if results[n].get(metric) else nan
               for n in targets}
        print(f"{metric:<24}" + "".join(f"{row[n]:>14.1f}" for n in targets) +
              f"{row['gatehouse'] / row['direct']:>18.2f}{row['tansu-proxy'] / row['direct']:>15.2f}")
    for q in (50, 99):
        direct = pct(lat["direct"], q)
        added = {n: f"{1000 * (pct(v, q) - direct):.3f}" for n, v in lat.items() if n != "direct"}
        print(f"added latency p{q} (ms): {added} (direct p{q} {1000 * direct:.3f})")
    for what, i in (("p50", 0), ("p99", 1), ("avg", 2), ("request avg", 3)):
        direct_q = statistics.median(v[i] for v in at_half["direct"])
        added_q = {n: f"{statistics.median(v[i] for v in vals) - direct_q:.2f}"
                   for n, vals in at_half.items() if n != "direct"}
        print(f"added producer latency {what} at {half} records/s (half the direct rate), "
              f"ms: {added_q} (direct {what} {direct_q:.2f})")
    for name, why in broken.items():
        print(f"{name}: failed under load: {why}"
              f"{peer_log_errors(tansu) if name == 'tansu-proxy' else ''}")
    print(f"gatehouse RSS: {before:.1f} MiB idle, {after:.1f} MiB with 1000 idle connections")


if __name__ == "__main__":
    main()
