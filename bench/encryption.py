"""What record encryption costs: Gatehouse's ``encrypt_records`` against Kroxylicious'
RecordEncryption filter, each against itself without it, same broker, same run.

    python bench/encryption.py [--records 200000] [--rounds 3]

Targets, alternated each round so that drift hits them alike: direct, Gatehouse with no
rules, Gatehouse encrypting every topic (a key file), Kroxylicious with no filters, and
Kroxylicious with its RecordEncryption filter (its in-memory KMS, one key for every
topic; 0.12.0 from Maven Central).  Load: Kafka's ProducerPerformance (1 KiB records,
acks=all) then ConsumerPerformance, reading what was produced (so the consumers
decrypt).  Prints MB/s and ratios: each encrypting proxy against itself plain (what
encryption costs it) and against direct, and the proxies' CPU seconds per MB.  Checks
first that both encrypt (a record read from the broker directly carries their header).
"""

from __future__ import annotations

import argparse
import base64
import os
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.peers import start_kroxylicious
from bench.proxy import bench_cluster, compare_throughput, print_ratios, start_gatehouse
from tests.support.kafka import KafkaCluster

KEK = os.urandom(32)


def start_encrypting_gatehouse(upstream: str) -> tuple[subprocess.Popen[bytes], str]:
    keys = Path(tempfile.mkdtemp()) / "keys.yaml"
    keys.write_text(f"keys: {{bench: {base64.b64encode(KEK).decode()}}}\n")
    keys.chmod(0o600)
    return start_gatehouse(upstream, "rules:\n  - name: sealed\n    encrypt_records: "
                                     f"{{key_file: {keys}, key: bench}}\n")


def start_encrypting_kroxylicious(upstream: str) -> tuple[subprocess.Popen[bytes], str]:
    """Kroxylicious with its RecordEncryption filter: its in-memory KMS
    (UnitTestingKmsService) with one AES key, the alias every topic's template names."""
    key = base64.b64encode(KEK).decode()
    return start_kroxylicious(upstream, f"""filterDefinitions:
  - name: encrypt
    type: RecordEncryption
    config:
      kms: UnitTestingKmsService
      kmsConfig:
        numIvBytes: 12
        numAuthBits: 128
        existingKeks:
          - {{uuid: {uuid.uuid4()}, key: "{key}", algorithm: AES, alias: bench}}
      selector: TemplateKekSelector
      selectorConfig: {{template: bench}}
defaultFilters: [encrypt]
""")


def encrypted_headers(kafka: KafkaCluster, addr: str, topic: str) -> list[str]:
    """The header keys of a record produced through ``addr``, read from the broker."""
    import confluent_kafka as ck

    producer = ck.Producer({"bootstrap.servers": addr, "log_level": 0})
    producer.produce(topic, b"plain text")
    assert producer.flush(60) == 0
    consumer = ck.Consumer({"bootstrap.servers": kafka.bootstrap, "group.id": "check",
                            "auto.offset.reset": "earliest", "log_level": 0})
    consumer.subscribe([topic])
    try:
        for _ in range(120):
            msg = consumer.poll(0.5)
            if msg is not None and msg.error() is None:
                assert msg.value() != b"plain text", "stored in the clear"
                return [key for key, _ in msg.headers() or ()]
    finally:
        consumer.close()
    raise RuntimeError(f"nothing read back from {topic}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("GATEHOUSE_KAFKA_VERSION", "4.4.0")
    with bench_cluster() as kafka:
        procs = {
            "gatehouse": start_gatehouse(kafka.bootstrap),
            "gatehouse-enc": start_encrypting_gatehouse(kafka.bootstrap),
            "kroxylicious": start_kroxylicious(kafka.bootstrap),
            "kroxylicious-enc": start_encrypting_kroxylicious(kafka.bootstrap),
        }
        try:
            for name in ("gatehouse-enc", "kroxylicious-enc"):
                topic = f"check-{name}"
                kafka.create_topic(topic)
                print(f"{name}: a record on the broker carries headers "
                      f"{encrypted_headers(kafka, procs[name][1], topic)}")
            targets = {"direct": kafka.bootstrap, **{n: a for n, (_, a) in procs.items()}}
            cpu: dict[str, dict[str, list[float]]] = {}
            results = compare_throughput(kafka, targets, records=args.records,
                                         rounds=args.rounds,
                                         pids={n: p.pid for n, (p, _) in procs.items()},
                                         cpu=cpu)
        finally:
            for proc, _ in procs.values():
                proc.terminate()
                proc.wait(30)
    print(f"\n{args.records} records of 1 KiB, {args.rounds} rounds, medians "
          f"(host: {os.cpu_count()} cores)")
    print_ratios(results)
    for name, plain in (("gatehouse-enc", "gatehouse"), ("kroxylicious-enc", "kroxylicious")):
        print(f"{name}/{plain}: " + ", ".join(
            f"{metric} {statistics.median(results[name][metric]) / statistics.median(results[plain][metric]):.3f}"
            for metric in results[plain]))
    print("gatehouse-enc/kroxylicious-enc: " + ", ".join(
        f"{metric} {statistics.median(results['gatehouse-enc'][metric]) / statistics.median(results['kroxylicious-enc'][metric]):.3f}"
        for metric in results["direct"]))
    print("CPU seconds per MB: " + "; ".join(
        f"{name} " + ", ".join(f"{metric.split()[0]} {statistics.median(v):.4f}"
                               for metric, v in by_metric.items())
        for name, by_metric in cpu.items()))


if __name__ == "__main__":
    main()
