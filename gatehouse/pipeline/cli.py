"""The ``gatehouse report`` subcommand: arguments, one-line errors, the run."""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime
from pathlib import Path

from gatehouse.configfile import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--captures", required=True,
                        help="directory (or glob, or hdfs:// / s3a:// URL) of capture files")
    parser.add_argument("--out", required=True, help="where census/, traffic/, impact/ and "
                        "report.html go (replaced)")
    parser.add_argument("--rules", help="proposed rules (YAML): what would they refuse?")
    parser.add_argument("--master", default="local[*]",
                        help="Spark master: local[*] (default), local[N], spark://host:port")
    parser.add_argument("--since", help="from this time on (ISO 8601, UTC if no zone)")
    parser.add_argument("--until", help="before this time (ISO 8601, UTC if no zone)")
    parser.add_argument("--driver-memory", default="1g")
    parser.add_argument("--executor-memory", default="512m")
    parser.add_argument("--shuffle-partitions", type=int, default=8)
    parser.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                        help="a Spark setting (repeatable), e.g. spark.driver."
                        "extraJavaOptions=-XX:TieredStopAtLevel=1 for a faster start on "
                        "small logs")


def _epoch(text: str | None, what: str) -> float | None:
    if text is None:
        return None
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise SystemExit(f"error: --{what} {text!r} is not an ISO 8601 time") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def _spark_conf(pairs: list[str]) -> dict[str, str]:
    conf = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"error: --conf {pair!r} is not KEY=VALUE")
        conf[key.strip()] = value
    return conf


def main(args: argparse.Namespace) -> int:
    from gatehouse.pipeline.job import PipelineError, ReportOptions, run_report
    from gatehouse.rules import load_rules_file

    try:
        rules = load_rules_file(args.rules) if args.rules else None
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    options = ReportOptions(
        captures=args.captures, out=Path(args.out), rules=rules, master=args.master,
        since=_epoch(args.since, "since"), until=_epoch(args.until, "until"),
        driver_memory=args.driver_memory, executor_memory=args.executor_memory,
        shuffle_partitions=args.shuffle_partitions, spark_conf=_spark_conf(args.conf))
    try:
        data = run_report(options)
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{data.records} exchanges -> {options.out}/report.html "
          f"(census/, traffic/{', impact/' if rules is not None else ''})")
    return 0
