"""TLS terminated at the proxy: what it costs, same broker, same run.

    python bench/tls.py [--records 300000] [--rounds 3]

The edge's usual set-up: clients speak TLS to Gatehouse (`tls.downstream`), which speaks
plaintext to the broker behind it.  Kafka's own perf tools (acks=all, 1 KiB and 100 KiB
records) and a librdkafka producer (1 KiB, twice the records) produce and consume direct
in plaintext, through Gatehouse in plaintext, and through Gatehouse with TLS from the
clients, the targets rotated each round so drift hits them alike.  The Java tools run
with the JVM's full JIT here (the tests' C1-only JVMs decrypt TLS at some 14 MB/s, which
would measure the client).  Prints MB/s and ratios to direct, the TLS proxy's ratio to
the plaintext one round by round (what TLS costs), and each proxy's CPU per MB.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trustme

from bench.peers import librdkafka_rate
from bench.proxy import (
    compare_throughput,
    cpu_seconds,
    print_ratios,
    rotated,
    start_gatehouse,
)
from tests.support.kafka import KafkaCluster

# The clients' JVMs: the tests' options without -XX:TieredStopAtLevel=1 (C1 has no
# AES-GCM intrinsics: Java's TLS at C1 is slower than any proxy).
CLIENT_JVM = ("-Xmx512m", "-XX:+UseSerialGC", "-XX:-UsePerfData", "-Djava.awt.headless=true")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=300_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("GATEHOUSE_KAFKA_VERSION", "4.4.0")
    work = Path(tempfile.mkdtemp(prefix="gatehouse-bench-tls-"))
    ca = trustme.CA()
    issued = ca.issue_cert("127.0.0.1", "localhost")
    cert, key, ca_pem = work / "proxy.pem", work / "proxy.key", work / "ca.pem"
    issued.cert_chain_pems[0].write_to_path(str(cert))
    for extra in issued.cert_chain_pems[1:]:
        extra.write_to_path(str(cert), append=True)
    issued.private_key_pem.write_to_path(str(key))
    ca.cert_pem.write_to_path(str(ca_pem))
    # Java's client reads a PEM trust store itself and checks the IP address SAN.
    tls_client = ("security.protocol=SSL", "ssl.truststore.type=PEM",
                  f"ssl.truststore.location={ca_pem}")
    procs = []
    try:
        with KafkaCluster(1) as kafka:
            plain, plain_addr = start_gatehouse(kafka.bootstrap)
            procs.append(plain)
            tls, tls_addr = start_gatehouse(
                kafka.bootstrap, f"tls: {{downstream: {{cert: {cert}, key: {key}}}}}\n")
            procs.append(tls)
            targets = {"direct": kafka.bootstrap, "gatehouse": plain_addr,
                       "gatehouse-tls": tls_addr}
            cpu: dict[str, dict[str, list[float]]] = {}
            pids = {"gatehouse": plain.pid, "gatehouse-tls": tls.pid}
            results = compare_throughput(
                kafka, targets, records=args.records, rounds=args.rounds,
                sizes=(1024, 100 * 1024), pids=pids, cpu=cpu,
                client_props={"gatehouse-tls": tls_client}, client_jvm_opts=CLIENT_JVM)
            metric = "librdkafka produce 1 KiB MB/s"
            rdkafka_tls = {"security.protocol": "SSL", "ssl.ca.location": str(ca_pem)}
            for r in range(args.rounds):
                for name, addr in rotated(list(targets.items()), r):
                    topic = f"bench-rdkafka-{name}-{r}"
                    kafka.create_topic(topic, partitions=3)
                    pid = pids.get(name)
                    before = cpu_seconds(pid) if pid else 0.0
                    records = 2 * args.records
                    results[name].setdefault(metric, []).append(librdkafka_rate(
                        addr, topic, records, conf=rdkafka_tls if name == "gatehouse-tls"
                        else None))
                    if pid:
                        cpu.setdefault(name, {}).setdefault(metric, []).append(
                            (cpu_seconds(pid) - before) / (records * 1024 / 1e6))
                    kafka.delete_topics([topic])
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)
        shutil.rmtree(work, ignore_errors=True)
    print_ratios(results)
    print(f"{'metric':<22}{'tls/plain proxy':>18}{'rounds':>26}"
          f"{'CPU ms/MB plain':>18}{'CPU ms/MB tls':>16}")
    for metric in results["direct"]:
        paired = [t / p for t, p in zip(results["gatehouse-tls"][metric],
                                        results["gatehouse"][metric], strict=True)]
        print(f"{metric:<22}{statistics.median(paired):>18.3f}"
              f"{f'{min(paired):.3f}-{max(paired):.3f}':>26}"
              f"{1000 * statistics.median(cpu['gatehouse'][metric]):>18.2f}"
              f"{1000 * statistics.median(cpu['gatehouse-tls'][metric]):>16.2f}")


if __name__ == "__main__":
    main()
