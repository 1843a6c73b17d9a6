"""What a rename rule costs: direct vs Gatehouse without rules vs Gatehouse renaming every
topic on Produce and Fetch, same broker, same run.

    python bench/rules.py [--records 100000] [--rounds 3]

Load comes from Kafka's ProducerPerformance / ConsumerPerformance. Goal (issue #4): a
rename costs <= 10% throughput versus no rules.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.proxy import compare_rules, print_against, print_ratios

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
    results = compare_rules("rename", rules, records=args.records, rounds=args.rounds,
                            sizes=SIZES, broker_topic=lambda t: aliases.get(t, t))
    print_ratios(results)
    print_against(results, "rename", "no-rules")






if __name__ == "__main__":
    main()
