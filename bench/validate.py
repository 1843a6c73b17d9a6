"""What ``validate_records`` costs: direct vs Gatehouse without rules vs Gatehouse reading
every record of every Produce request (value UTF-8 text of at most 1 MiB: each record
parsed from its batch and checked), same broker, same run, targets rotated each round.

    python bench/validate.py [--records 200000] [--rounds 3]

Load comes from Kafka's ProducerPerformance (its records are random letters: text, not
JSON) and ConsumerPerformance; the proxies' CPU seconds per MB are printed beside the
rates.  No goal: the numbers tell a platform team what turning the rule on costs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.proxy import compare_rules, print_against, print_ratios

SIZES = (1024, 100 * 1024)
RULES = ("rules:\n  - name: text-only\n    validate_records:\n"
         "      value: {format: utf8, max_bytes: 1048576}\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("GATEHOUSE_KAFKA_VERSION", "4.4.0")
    cpu: dict[str, dict[str, list[float]]] = {}
    results = compare_rules("validate", RULES, records=args.records, rounds=args.rounds,
                            sizes=SIZES, cpu=cpu)
    print_ratios(results)
    print_against(results, "validate", "no-rules")
    for name, metrics in cpu.items():
        print(f"{name} CPU s/MB: " + ", ".join(
            f"{metric.removesuffix(' MB/s')} {statistics.median(values):.4f}"
            for metric, values in metrics.items()))


if __name__ == "__main__":
    main()
