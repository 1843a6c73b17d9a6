"""TLS at the proxy: what it costs, against the broker's own TLS, same broker, same run.

    python bench/tls.py [--records 300000] [--rounds 3]

One broker with a plaintext and an SSL listener.  Targets: the broker directly in
plaintext (`direct`) and over TLS (`direct-tls`); Gatehouse in plaintext (`gatehouse`);
Gatehouse terminating TLS (`tls.downstream`) in front of the plaintext listener, the
edge's usual set-up (`gatehouse-tls`); Gatehouse with TLS on both sides, to the SSL
listener (`gatehouse-tls-both`); and the peer, Kroxylicious, terminating TLS the same
way in front of the plaintext listener (`kroxylicious-tls`).  Kafka's own perf tools
(acks=all, 1 KiB and 100 KiB records) and a librdkafka producer (1 KiB, twice the
records), targets rotated each round so drift hits them alike.  The Java tools and the
broker run with the JVM's full JIT, as every bench's do (the tests' C1-only JVMs do TLS
at some 14-20 MB/s, which would measure them).

Prints MB/s and ratios to direct, then each TLS target against direct-tls (what the
proxy costs a TLS client) and against the plaintext proxy, round by round, with each
proxy's CPU per MB.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.peers import librdkafka_rate, start_kroxylicious
from bench.proxy import (
    bench_cluster,
    compare_throughput,
    measure,
    print_ratios,
    rotated,
    start_gatehouse,
)
from tests.support.kafka import tls_files_for_loopback

TLS_TARGETS = ("direct-tls", "gatehouse-tls", "gatehouse-tls-both", "kroxylicious-tls")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=300_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("GATEHOUSE_KAFKA_VERSION", "4.4.0")
    work = Path(tempfile.mkdtemp(prefix="gatehouse-bench-tls-"))
    files = tls_files_for_loopback(work)
    cert, key, keystore, ca_pem = (files[n] for n in ("cert", "key", "keystore", "ca"))
    # Java's client reads a PEM trust store itself and checks the IP address SAN.
    java_tls = ("security.protocol=SSL", "ssl.truststore.type=PEM",
                f"ssl.truststore.location={ca_pem}")
    rdkafka_tls = {"security.protocol": "SSL", "ssl.ca.location": str(ca_pem)}
    downstream = f"tls: {{downstream: {{cert: {cert}, key: {key}}}"
    procs = []
    try:
        with bench_cluster(tls_keystore=keystore) as kafka:
            plain, plain_addr = start_gatehouse(kafka.bootstrap)
            tls, tls_addr = start_gatehouse(kafka.bootstrap, downstream + "}\n")
            both, both_addr = start_gatehouse(
                kafka.ssl_bootstrap, downstream + f", upstream: {{ca: {ca_pem}}}}}\n")
            # The peer terminating TLS the same way (Netty's TLS, the JVM's full JIT).
            kroxy, kroxy_addr = start_kroxylicious(
                kafka.bootstrap, tls=f"    tls:\n      key: {{privateKeyFile: {keystore}, "
                                     f"certificateFile: {cert}}}\n")
            procs += [plain, tls, both, kroxy]
            targets = {"direct": kafka.bootstrap, "direct-tls": kafka.ssl_bootstrap,
                       "gatehouse": plain_addr, "gatehouse-tls": tls_addr,
                       "gatehouse-tls-both": both_addr, "kroxylicious-tls": kroxy_addr}
            pids = {"gatehouse": plain.pid, "gatehouse-tls": tls.pid,
                    "gatehouse-tls-both": both.pid, "kroxylicious-tls": kroxy.pid}
            cpu: dict[str, dict[str, list[float]]] = {}
            results = compare_throughput(
                kafka, targets, records=args.records, rounds=args.rounds,
                sizes=(1024, 100 * 1024), pids=pids, cpu=cpu,
                client_props={name: java_tls for name in TLS_TARGETS})
            metric = "librdkafka produce 1 KiB MB/s"
            for r in range(args.rounds):
                for name, addr in rotated(list(targets.items()), r):
                    topic = f"bench-rdkafka-{name}-{r}"
                    kafka.create_topic(topic, partitions=3)
                    records = 2 * args.records
                    measure(results, cpu, name, metric, pids.get(name), records * 1024 / 1e6,
                            partial(librdkafka_rate, addr, topic, records,
                                    conf=rdkafka_tls if name in TLS_TARGETS else None))
                    kafka.delete_topics([topic])
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)
        shutil.rmtree(work, ignore_errors=True)
    print_ratios(results)
    for name, baseline in (("gatehouse-tls", "direct-tls"), ("kroxylicious-tls", "direct-tls"),
                           ("gatehouse-tls-both", "direct-tls"), ("gatehouse-tls", "gatehouse")):
        print(f"\n{name} / {baseline}, round by round; the proxies' CPU ms/MB")
        for metric in results["direct"]:
            paired = [t / b for t, b in zip(results[name][metric], results[baseline][metric],
                                            strict=True)]
            print(f"  {metric:<30}{statistics.median(paired):>7.3f}"
                  f"  ({min(paired):.3f}-{max(paired):.3f})"
                  + "".join(f"  {who} {1000 * statistics.median(cpu[who][metric]):.2f}"
                            for who in (name, baseline) if who in cpu))


if __name__ == "__main__":
    main()
