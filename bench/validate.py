"""What ``validate_records`` costs: direct vs Gatehouse without rules vs Gatehouse reading
every record of every Produce request (value UTF-8 text of at most 1 MiB: each record
parsed from its batch and checked), same broker, same run, targets rotated each round.

    python bench/validate.py [--records 200000] [--rounds 3]
                             [--schema | --registry | --protobuf]

Load comes from Kafka's ProducerPerformance (its records are random letters: text, not
JSON) and ConsumerPerformance; the proxies' CPU seconds per MB are printed beside the
rates.  ``--schema``: the records are JSON orders of about 1 KiB (bench/records.py's,
drawn from a payload file) and every value is parsed and checked against the order's
JSON Schema.  ``--registry``: the same orders in the Schema Registry's framing, the
order's JSON Schema registered in a real registry (Apicurio Registry,
tests/support/apicurio.py) and each value's id looked up there (once) and the value
checked against it.  ``--protobuf``: orders of about 1 KiB as Protobuf, framed for the
registry, their ``.proto`` registered there and each value walked as the message it
names (the orders are built of bytes below 0x80 and without a newline, as
ProducerPerformance reads its payload file as text lines).  No goal: the numbers tell a
platform team what turning the rule on costs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.proxy import compare_rules, print_against, print_ratios
from bench.records import ORDER_SCHEMA, order

# An order as Protobuf whose bytes are all text (below 0x80, no newline): no field 1 of
# a length-delimited type (its tag is a newline), small varints, lengths below 128.
ORDER_PROTO = """\
syntax = "proto3";
package bench;
message Order {
  string id = 2;
  string customer = 3;
  Status status = 4;
  repeated Line items = 5;
  string total = 6;
  string note = 7;
  enum Status { NEW = 0; PAID = 1; SHIPPED = 2; }
  message Line { string sku = 2; int32 quantity = 3; int32 price_cents = 4; }
}
"""


def protobuf_order(n: int) -> bytes:
    """Order ``n`` of ``ORDER_PROTO`` (13 lines, about 1 KiB)."""
    def text(number: int, value: str) -> bytes:
        raw = value.encode()
        assert len(raw) < 128 and len(raw) != 10
        return bytes([number << 3 | 2, len(raw)]) + raw

    lines = b""
    for i in range(13):
        line = (text(2, f"sku-{n}-{i:04d}-abcdefghijklmnopqrstuvwxyz-0123456789")
                + bytes([3 << 3, 1 + i % 3, 4 << 3, 99 + i]))
        lines += bytes([5 << 3 | 2, len(line)]) + line
    return (text(2, f"o-{n}") + text(3, f"customer-{n:08d}-with-a-long-name")
            + bytes([4 << 3, 1]) + lines + text(6, f"{n * 3.5:.2f}") + text(7, "x" * 120))


SIZES = (1024, 100 * 1024)
RULES = ("rules:\n  - name: text-only\n    validate_records:\n"
         "      value: {format: utf8, max_bytes: 1048576}\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    choice = parser.add_mutually_exclusive_group()
    choice.add_argument("--schema", action="store_true")
    choice.add_argument("--registry", action="store_true")
    choice.add_argument("--protobuf", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("GATEHOUSE_KAFKA_VERSION", "4.4.0")
    cpu: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as folder, contextlib.ExitStack() as stack:
        rules, sizes, payload = RULES, SIZES, None
        if args.schema or args.registry or args.protobuf:
            # 1 KiB JSON orders; for the registry, in its framing, the schema registered.
            frame = b""
            if args.schema:
                schema = Path(folder) / "order.json"
                schema.write_text(json.dumps(ORDER_SCHEMA))
                rules = ("rules:\n  - name: orders-schema\n    validate_records:\n"
                         f"      value: {{schema: {schema}, required: true}}\n")
            else:
                from tests.support.apicurio import ApicurioRegistry

                registry = stack.enter_context(ApicurioRegistry())
                schema_id = (registry.register("orders-value", ORDER_PROTO, "PROTOBUF")
                             if args.protobuf else
                             registry.register("orders-value", json.dumps(ORDER_SCHEMA)))
                # ProducerPerformance reads the file as text lines: the framing's bytes
                # are characters too (the id holds no newline byte).
                frame = b"\x00" + schema_id.to_bytes(4, "big")
                assert b"\n" not in frame
                rules = ("rules:\n  - name: orders-registered\n    validate_records:\n"
                         f"      value: {{registry: '{registry.url}', required: true}}\n")
            payload = Path(folder) / "orders.txt"
            orders = ([b"\x00" + protobuf_order(n) for n in range(1000)] if args.protobuf
                      else [order(n, items=13) for n in range(1000)])
            assert all(b"\n" not in value and value.isascii() for value in orders)
            payload.write_bytes(b"\n".join(frame + value for value in orders))
            sizes = (1024,)
        results = compare_rules("validate", rules, records=args.records,
                                rounds=args.rounds, sizes=sizes, cpu=cpu,
                                payload_file=payload)
    print_ratios(results)
    print_against(results, "validate", "no-rules")
    for name, metrics in cpu.items():
        print(f"{name} CPU s/MB: " + ", ".join(
            f"{metric.removesuffix(' MB/s')} {statistics.median(values):.4f}"
            for metric, values in metrics.items()))


if __name__ == "__main__":
    main()
