"""The Spark job behind ``gatehouse report``: capture files in, Parquet tables out.

    census/   one row per client software name/version
    traffic/  one row per minute, topic and API
    impact/   with proposed rules: one row per rule, effect, client and API version

The same code runs on ``local[*]`` and on a Spark standalone cluster (``spark://``).
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gatehouse.capture.schema import spark_ddl
from gatehouse.pipeline.html import RECORD_APIS, render_report
from gatehouse.pipeline.impact import filters_groups, rewrites_topics
from gatehouse.rules import ClientFacts, RuleSet
from gatehouse.rules.model import software_versions

MAX_LISTED = 50  # client ids / addresses listed per census row
OBJECT_AGGREGATE_GROUPS = 200_000  # percentile summaries held per task before sorting
PERCENTILE_ACCURACY = 1000  # percentile_approx: rank error about 1/1000 of the rows
# What the report reads of each record (the JSON reader skips the rest unparsed).
READ_FIELDS = frozenset({
    "time", "proxy", "run", "conn", "client", "listener", "client_id", "software_name",
    "software_version", "principal", "api", "api_key", "api_version", "latency_ms",
    "error_count", "topics", "sample"})
READ_TOPIC_FIELDS = frozenset({"name", "id", "records", "bytes"})
# The throughput collector for the driver and the executors (a ``--conf`` of the same key
# replaces it): the report is a batch job, and G1's concurrent threads and write barriers
# cost it 20% of its time on a 2-core machine (bench/RESULTS.md, issue 6).
JVM_OPTIONS = "-XX:+UseParallelGC"


class PipelineError(Exception):
    """A one-line reason the report cannot run (no Java, no pyspark, no captures)."""


@dataclass
class ReportOptions:
    captures: str
    out: Path
    rules: RuleSet | None = None
    master: str = "local[*]"
    since: float | None = None  # seconds since the epoch
    until: float | None = None
    driver_memory: str = "1g"
    executor_memory: str = "512m"
    shuffle_partitions: int = 8
    spark_conf: dict[str, str] = field(default_factory=dict)


def java_available() -> bool:
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").is_file():
        return True
    return shutil.which("java") is not None


def spark_session(options: ReportOptions) -> Any:
    if not java_available():
        raise PipelineError("Spark needs Java (17 or newer) and none was found: install a JRE "
                            "(e.g. apt-get install openjdk-17-jre-headless) or set JAVA_HOME")
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        raise PipelineError("gatehouse report needs PySpark: pip install "
                            "'kafka-gatehouse[pipeline]'") from None
    builder = (SparkSession.builder.master(options.master).appName("gatehouse-report")
               .config("spark.driver.memory", options.driver_memory)
               .config("spark.executor.memory", options.executor_memory)
               .config("spark.sql.shuffle.partitions", str(options.shuffle_partitions))
               .config("spark.sql.session.timeZone", "UTC")
               # Tasks of at most ~1M Parquet records (or 50k JSON lines): bounded memory
               # for the percentile summaries below, and work for every core.
               .config("spark.sql.files.maxPartitionBytes", str(32 * 1024 * 1024))
               # traffic/ has one percentile summary per minute, topic and API: Spark's
               # default (128 groups a task) falls back to sorting every row, which was
               # 60% of the CPU of the whole report.  Rows per task bound the memory.
               .config("spark.sql.objectHashAggregate.sortBased.fallbackThreshold",
                       str(OBJECT_AGGREGATE_GROUPS))
               .config("spark.driver.extraJavaOptions", JVM_OPTIONS)
               .config("spark.executor.extraJavaOptions", JVM_OPTIONS)
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.pyspark.python", sys.executable)
               .config("spark.pyspark.driver.python", sys.executable))
    for key, value in options.spark_conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    if not options.master.startswith("local"):
        # Executors elsewhere get this very Gatehouse (the rules code runs there).
        spark.sparkContext.addPyFile(_package_zip())
    return spark


def _package_zip() -> str:
    root = Path(__file__).resolve().parents[1]
    folder = tempfile.mkdtemp(prefix="gatehouse-pyfiles-")
    atexit.register(shutil.rmtree, folder, True)
    target = Path(folder) / "gatehouse.zip"
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in root.rglob("*.py"):
            archive.write(path, Path("gatehouse") / path.relative_to(root))
    return str(target)


# Capture files by format (``capture.format``): JSON Lines, gzipped or not, and Parquet.
JSON_GLOB = "*.{jsonl,jsonl.gz}"
PARQUET_GLOB = "*.parquet"


def read_captures(spark: Any, options: ReportOptions) -> Any:
    """The capture records of the period, both formats in one DataFrame (the columns the
    report uses).  JSON Lines are parsed once and cached (``persist``) when there are any:
    the report makes three passes, and parsing is most of a pass.  Parquet files are read
    again by each pass instead, only the columns it needs (cheaper than a cache)."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    # The group id only when a rule restricts groups (the impact report reads it).
    groups = ("group_id",) if filters_groups(options.rules) else ()
    ddl = spark_ddl(READ_FIELDS | frozenset(groups), READ_TOPIC_FIELDS)

    def reader(glob: str) -> Any:
        return (spark.read.schema(ddl).option("recursiveFileLookup", "true")
                .option("pathGlobFilter", glob))

    try:
        json_df = reader(JSON_GLOB).option("mode", "PERMISSIVE").json(options.captures)
        parquet_df = reader(PARQUET_GLOB).parquet(options.captures)
    except Exception as exc:  # AnalysisException: path does not exist
        raise PipelineError(f"cannot read captures from {options.captures}: "
                            f"{str(exc).splitlines()[0]}") from None
    has_json, has_parquet = bool(json_df.inputFiles()), bool(parquet_df.inputFiles())
    if has_json and has_parquet:
        df = json_df.unionByName(parquet_df)
    else:
        df = json_df if has_json else parquet_df
    df = df.where(F.col("time").isNotNull() & F.col("api").isNotNull())
    if options.since is not None:
        df = df.where(F.col("time") >= options.since)
    if options.until is not None:
        df = df.where(F.col("time") < options.until)
    weight = F.lit(1.0) / F.when(F.col("sample") > 0, F.col("sample")).otherwise(F.lit(1.0))
    df = df.select(
        "time", "proxy", "run", "conn", "client", "listener", "client_id", "software_name",
        "software_version", "principal", "api", "api_key", "api_version", "latency_ms",
        "error_count", "topics", *groups, weight.alias("weight"))
    if has_json:
        df = df.persist(StorageLevel.MEMORY_AND_DISK)
    return df


def _weighted_count(F: Any, condition: Any = None) -> Any:
    value = F.col("weight") if condition is None else F.when(condition, F.col("weight"))
    return F.round(F.coalesce(F.sum(value), F.lit(0.0))).cast("long")


def _client_host(F: Any) -> Any:
    return F.regexp_extract("client", r"^\[?(.*?)\]?:\d+$", 1)


def facts_table(df: Any, with_topics: bool = True, with_groups: bool = False) -> Any:
    """The log by everything the census and rule decisions look at: one pass over the
    records, down to a few rows per connection, API version and topic list (materialized:
    the summary, the census and the impact read it).  Only plain columns are grouped on;
    what is derived from them (address host, connection name, sorted topic names) is
    computed once per group afterwards, not once per record.  Without ``with_topics`` the
    topic names are left out (an empty list): grouping on them is ~40% of the pass, and
    only rules that rename topics read them; the group id likewise (``with_groups``:
    rules that restrict groups read it)."""
    from pyspark.sql import functions as F

    keys = ["software_name", "software_version", "client_id", "client", "listener",
            "principal", "proxy", "run", "conn", "api", "api_key", "api_version"]
    if with_groups:
        keys.append("group_id")
    group_id = F.col("group_id") if with_groups else F.lit(None).cast("string")
    if with_topics:
        df = df.select(*keys, "time", "weight", F.col("topics.name").alias("topic_list"))
        keys.append("topic_list")
        names = F.filter("topic_list", lambda n: n.isNotNull())
        topic_names = F.array_sort(F.array_distinct(names))
    else:
        topic_names = F.array().cast("array<string>")
    grouped = (df.groupBy(*keys)
               .agg(F.sum("weight").alias("requests"), F.count(F.lit(1)).alias("records"),
                    F.min("time").alias("first_seen"), F.max("time").alias("last_seen")))
    return (grouped.select(
        "software_name", "software_version", "client_id", "client",
        _client_host(F).alias("client_host"), "listener", "principal",
        F.concat_ws("/", "proxy", "run", "conn").alias("connection"), "api", "api_key",
        "api_version", topic_names.alias("topic_names"), group_id.alias("group_id"),
        "requests", "records",
        "first_seen", "last_seen")
        .localCheckpoint(eager=True))


def census_table(facts: Any, libraries: dict[tuple[str, str], dict[str, str]]) -> Any:
    """One row per client software name and version (one partition, sorted: small)."""
    from pyspark.sql import functions as F

    fine = facts.select(
        F.coalesce("software_name", F.lit("(not reported)")).alias("software_name"),
        F.coalesce("software_version", F.lit("")).alias("software_version"),
        "client_id", "client_host", "principal", "connection", "api", "api_version",
        "requests", "first_seen", "last_seen")
    # Two aggregations (by API version, then by software): sets are merged, not recounted.
    per_api = fine.groupBy("software_name", "software_version", "api", "api_version").agg(
        F.sum("requests").alias("requests"), F.collect_set("connection").alias("connections"),
        F.collect_set("client_id").alias("client_ids"),
        F.collect_set("client_host").alias("addresses"),
        F.collect_set("principal").alias("principals"),
        F.min("first_seen").alias("first_seen"), F.max("last_seen").alias("last_seen"))

    def merged(column: str) -> Any:
        return F.array_distinct(F.flatten(F.collect_list(column)))

    main = per_api.groupBy("software_name", "software_version").agg(
        F.round(F.sum("requests")).cast("long").alias("requests"),
        F.size(merged("connections")).cast("long").alias("connections"),
        F.slice(F.sort_array(merged("client_ids")), 1, MAX_LISTED).alias("client_ids"),
        F.slice(F.sort_array(merged("addresses")), 1, MAX_LISTED).alias("addresses"),
        F.slice(F.sort_array(merged("principals")), 1, MAX_LISTED).alias("principals"),
        F.timestamp_seconds(F.min("first_seen")).alias("first_seen"),
        F.timestamp_seconds(F.max("last_seen")).alias("last_seen"),
        F.sort_array(F.collect_list(F.struct(
            "api", "api_version", F.round("requests").cast("long").alias("requests"))))
        .alias("apis"))
    spark = facts.sparkSession
    lib_rows = [(n, v, libs) for (n, v), libs in libraries.items()]
    lib_df = spark.createDataFrame(
        lib_rows, "software_name STRING, software_version STRING, "
                  "libraries MAP<STRING, STRING>")
    return (main.join(F.broadcast(lib_df), ["software_name", "software_version"], "left")
            .coalesce(1)
            .sortWithinPartitions(F.desc("requests"), "software_name", "software_version"))


@dataclass
class FactsSummary:
    records: int
    first: Any  # datetime of the first record
    last: Any
    # name/version -> the libraries in it (librdkafka inside confluent-kafka-python, ...)
    libraries: dict[tuple[str, str], dict[str, str]]


def summarize(facts: Any) -> FactsSummary:
    """Record count, period and the libraries in each client software (by the rules' own
    parser of KIP-511 versions), in one small query: few software name/version pairs."""
    from pyspark.sql import functions as F

    pairs = (facts.groupBy(F.coalesce("software_name", F.lit("(not reported)")).alias("n"),
                           F.coalesce("software_version", F.lit("")).alias("v"))
             .agg(F.sum("records").alias("records"),
                  F.timestamp_seconds(F.min("first_seen")).alias("first"),
                  F.timestamp_seconds(F.max("last_seen")).alias("last"))
             .collect())
    libraries = {}
    for row in pairs:
        facts_of = ClientFacts(software_name=row.n, software_version=row.v)
        libraries[(row.n, row.v)] = {name: ".".join(map(str, version))
                                     for name, version in software_versions(facts_of).items()}
    return FactsSummary(records=sum(row.records for row in pairs),
                        first=min((row.first for row in pairs), default=None),
                        last=max((row.last for row in pairs), default=None),
                        libraries=libraries)


def traffic_table(df: Any) -> Any:
    """traffic/: one row per minute, topic and API."""
    from pyspark.sql import functions as F

    exploded = df.select(F.date_trunc("minute", F.timestamp_seconds("time")).alias("minute"),
                         "api", "latency_ms", "error_count", "weight",
                         F.explode_outer("topics").alias("t"))
    return (exploded.groupBy("minute", F.coalesce("t.name", "t.id").alias("topic"), "api")
            .agg(_weighted_count(F).alias("requests"),
                 F.round(F.coalesce(F.sum(F.col("t.records") * F.col("weight")), F.lit(0.0)))
                 .cast("long").alias("records"),
                 F.round(F.coalesce(F.sum(F.col("t.bytes") * F.col("weight")), F.lit(0.0)))
                 .cast("long").alias("bytes"),
                 _weighted_count(F, F.col("error_count") > 0).alias("error_responses"),
                 _percentiles(F).alias("latency"))
            .select("minute", "topic", "api", "requests", "records", "bytes",
                    "error_responses", F.col("latency")[0].alias("latency_p50_ms"),
                    F.col("latency")[1].alias("latency_p99_ms")))
    # Not sorted: a global sort would cost one more pass over the log; readers sort.


def _percentiles(F: Any) -> Any:
    """p50 and p99 of latency_ms with one summary per group (not one each)."""
    return F.percentile_approx("latency_ms", F.array(F.lit(0.5), F.lit(0.99)),
                               PERCENTILE_ACCURACY)


def latency_table(df: Any) -> Any:
    """p50/p99 per API over the whole period (the report's latency chart), from one
    histogram per API (``_latency_bucket``): a compiled sum per API and bucket, where
    percentile_approx fed every record to one of a few summaries (4 s of 50 at 10M)."""
    from pyspark.sql import functions as F

    per_bucket = (df.where(F.col("latency_ms").isNotNull())
                  .groupBy("api", _latency_bucket(F, "latency_ms").alias("b"))
                  .agg(F.sum("weight").alias("w")))
    histogram = F.array_sort(F.collect_list(F.struct("b", "w")))
    return (per_bucket.groupBy("api")
            .agg(F.round(F.sum("w")).cast("long").alias("requests"),
                 histogram.alias("histogram"))
            .select("api", "requests", _histogram_percentile(F, "histogram", 0.5).alias("p50"),
                    _histogram_percentile(F, "histogram", 0.99).alias("p99"))
            .orderBy(F.desc("requests")))


# Log-scale buckets 2% wide, as DDSketch: a percentile read from them is within 1% of
# the true value, in the tail as in the middle.
LATENCY_GROWTH = 1.02
LATENCY_FLOOR_MS = 0.001  # smaller latencies (and 0) count in the bucket of 1 us


def _latency_bucket(F: Any, column: str) -> Any:
    value = F.greatest(F.col(column), F.lit(LATENCY_FLOOR_MS))
    return F.floor(F.log(LATENCY_GROWTH, value)).cast("int")


def _histogram_percentile(F: Any, histogram: str, share: float) -> Any:
    """The ``share`` percentile of a sorted array of (bucket b, weight w): the first bucket
    where the running weight reaches that share of the total, valued at its middle."""
    total = F.aggregate(histogram, F.lit(0.0), lambda acc, x: acc + x["w"])
    # The target rides in the accumulator: computed once, not once per element.
    start = F.struct(F.lit(0.0).alias("seen"), F.lit(None).cast("int").alias("b"),
                     (total * share).alias("target"))
    found = F.aggregate(histogram, start, lambda acc, x: F.when(
        acc["seen"] >= acc["target"], acc).otherwise(F.struct(
            (acc["seen"] + x["w"]).alias("seen"), x["b"].alias("b"),
            acc["target"].alias("target"))))
    # Bucket b holds [g^b, g^(b+1)); 2 g^(b+1) / (1 + g) is off by at most (g-1)/(g+1).
    middle = F.pow(F.lit(LATENCY_GROWTH), found["b"] + 1) * (2 / (1 + LATENCY_GROWTH))
    return F.round(middle, 6)  # no float noise in the page; far below 1%


def impact_table(facts: Any, ruleset: RuleSet) -> Any:
    """impact/: what ``ruleset`` refuses or rewrites, per rule, client and API version.
    Decided once per distinct combination of the columns decisions read (often a few
    hundred rows for millions of requests), then joined back to the facts."""
    from functools import reduce

    from pyspark.sql import functions as F

    from gatehouse.pipeline.impact import DECISION_FIELDS, decision_columns, evaluate_partition

    keys = decision_columns(ruleset)
    spark = facts.sparkSession
    ddl = ", ".join([f"key_{c} {facts.schema[c].dataType.simpleString()}" for c in keys]
                    + [f"{name} {kind}" for name, kind in DECISION_FIELDS])
    combinations = facts.select(*keys).distinct()
    decided = spark.createDataFrame(
        combinations.rdd.mapPartitions(evaluate_partition(ruleset, keys)), ddl)
    # Null-safe: a client without a client id or software name is a combination too.
    same = reduce(lambda a, b: a & b, [facts[c].eqNullSafe(decided[f"key_{c}"]) for c in keys])
    return (facts.join(F.broadcast(decided), same)
            .groupBy("rule_index", "rule", "effect", "action", "mode", "software_name",
                     "software_version", "client_id", "client_host", "api", "api_version")
            .agg(F.round(F.sum("requests")).cast("long").alias("requests"),
                 F.countDistinct("connection").alias("connections"),
                 F.first("reason", ignorenulls=True).alias("reason"),
                 F.array_sort(F.array_distinct(F.flatten(F.collect_list("topics"))))
                 .alias("topics"),
                 F.timestamp_seconds(F.min("first_seen")).alias("first_seen"),
                 F.timestamp_seconds(F.max("last_seen")).alias("last_seen"))
            .coalesce(1)  # small: one sorted file
            .sortWithinPartitions("rule_index", "effect", F.desc("requests"), "software_name",
                                  "client_id", "api", "api_version"))


@dataclass
class ReportData:
    """Small aggregates collected to the driver for report.html."""

    records: int
    first: Any
    last: Any
    census: list[Any]
    per_minute: list[Any]
    latency: list[Any]
    topics: list[Any]
    impact: list[Any] | None
    rules: RuleSet | None


def run_report(options: ReportOptions) -> ReportData:
    """Writes census/, traffic/, impact/ (with rules) and report.html under ``out``."""
    spark = spark_session(options)
    try:
        data = report(spark, options)
    finally:
        spark.stop()
    return data


def report(spark: Any, options: ReportOptions) -> ReportData:
    """``run_report`` in a running Spark session.  Passes over the records: the facts
    (materialized: the summary, census and impact read them), traffic/, and two columns
    for the latency per API; the page reads the small results."""
    from pyspark.sql import functions as F

    df = read_captures(spark, options)
    try:
        facts = facts_table(df, with_topics=rewrites_topics(options.rules),
                            with_groups=filters_groups(options.rules))
        summary = summarize(facts)
        if not summary.records:
            raise PipelineError(f"no capture records in {options.captures} for that period")
        out = options.out
        out.mkdir(parents=True, exist_ok=True)
        census = census_table(facts, summary.libraries)
        census.write.mode("overwrite").parquet(str(out / "census"))
        impact_rows = None
        if options.rules is not None:
            impact = impact_table(facts, options.rules)
            impact.write.mode("overwrite").parquet(str(out / "impact"))
            impact_rows = spark.read.parquet(str(out / "impact")).orderBy(
                "rule_index", "effect", F.desc("requests")).collect()
        traffic_table(df).write.mode("overwrite").parquet(str(out / "traffic"))
        latency = latency_table(df).limit(20).collect()
    finally:
        df.unpersist()
    traffic = spark.read.parquet(str(out / "traffic"))
    per_minute = (traffic.groupBy("minute", "api")
                  .agg(F.sum("records").alias("records"), F.sum("bytes").alias("bytes"),
                       F.sum("requests").alias("requests"))
                  .orderBy("minute").collect())
    topics = (traffic.where(F.col("topic").isNotNull() & F.col("api").isin(*RECORD_APIS))
              .groupBy("topic", "api").agg(F.sum("records").alias("records"),
                                           F.sum("bytes").alias("bytes"))
              .orderBy(F.desc("records")).limit(40).collect())
    data = ReportData(
        records=summary.records, first=summary.first, last=summary.last,
        census=spark.read.parquet(str(out / "census")).orderBy(F.desc("requests")).collect(),
        per_minute=per_minute, latency=latency, topics=topics, impact=impact_rows,
        rules=options.rules,
    )
    (out / "report.html").write_text(render_report(data), encoding="utf-8")
    return data
