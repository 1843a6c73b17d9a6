"""What a rename rule costs: direct vs Gatehouse without rules vs Gatehouse renaming every
topic on Produce and Fetch, same broker, same run.

    python bench/rules.py [--records 100000] [--rounds 3]

Load comes from Kafka's ProducerPerformance / ConsumerPerformance. Goal (issue #4): a
rename costs <= 10% throughput versus no rules.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.proxy import compare_throughput, print_ratios, start_gatehouse
from tests.support.kafka import KafkaCluster

SIZES = (1024, 100 * 1024)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("GATEHOUSE_KAFKA_VERSION", "4.4.0")

    def topic_for(name: str, size: int, r: int) -> str:
        return f"bench-{size}-{name}-{r}"

    # The renaming proxy maps each of its client-side names to a broker-side one.
    aliases = {topic_for("rename", size, r): f"renamed.{topic_for('rename', size, r)}"
               for size in SIZES for r in range(args.rounds)}
    rules = "rules:\n  - name: rename\n    rename_topics:\n" + "".join(
        f"      {alias}: {real}\n" for alias, real in aliases.items())
    with KafkaCluster(1) as kafka:
        plain, plain_addr = start_gatehouse(kafka.bootstrap)
        renaming, renaming_addr = start_gatehouse(kafka.bootstrap, rules)
        try:
            results = compare_throughput(
                kafka, {"direct": kafka.bootstrap, "no-rules": plain_addr,
                        "rename": renaming_addr},
                records=args.records, rounds=args.rounds, sizes=SIZES, topic_for=topic_for,
                broker_topic=lambda t: aliases.get(t, t))
        finally:
            for proc in (plain, renaming):
                proc.terminate()
                proc.wait(15)
    print_ratios(results)
    print("rename/no-rules: " + ", ".join(
        f"{metric} {statistics.median(results['rename'][metric]) / statistics.median(results['no-rules'][metric]):.3f}"
        for metric in results["direct"]))






if __name__ == "__main__":
    main()
