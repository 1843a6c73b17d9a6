"""Parquet capture files (``capture.format: parquet``): the same records and the same
guarantees as JSON Lines (whole files only, rotation, budget, drops counted)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from gatehouse.capture.observer import CaptureObserver
from gatehouse.capture.schema import FIELDS, SCHEMA_VERSION
from gatehouse.capture.settings import CaptureSettings
from gatehouse.capture.writer import ROW_GROUP_ROWS, CaptureWriter
from gatehouse.configfile import ConfigError, load_yaml_text
from gatehouse.metrics import ProxyMetrics
from gatehouse.proxy.config import config_from_text
from gatehouse.proxy.hooks import ConnectionInfo
from gatehouse.proxy.policy import RulesPolicy
from gatehouse.rules import parse_rules
from tests.support.fakebroker import request
from tests.test_capture import (
    SECRET_PASSWORD,
    SECRET_PAYLOAD,
    StalledDisk,
    check_schema,
    exchange,
    read_records,
    response_frame,
)
from tests.test_codec_records import batch_v2, record_v2


def read_parquet(directory: Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted(directory.iterdir()):
        assert not path.name.startswith("."), f"{path.name}: a file left unfinished"
        assert path.suffix == ".parquet", path.name
        out.extend(pq.read_table(path).to_pylist())
    return out


def observe(directory: Path, capture_format: str) -> list[dict[str, Any]]:
    """A run of exchanges of every kind through a ``CaptureObserver`` with rules."""
    conn = ConnectionInfo(id=7, client="10.1.2.3:50123", listener="bootstrap",
                          software_name="confluent-kafka-python",
                          software_version="2.6.0-rdkafka-2.6.0")
    rules = parse_rules(load_yaml_text(
        "- name: modern-produce\n  min_api_version: {Produce: 9}\n"
        "- name: orders-alias\n  rename_topics: {orders: prod.orders}\n"
        "- name: legacy-watch\n  mode: observe\n  min_api_version: {Fetch: 13}\n",
        "r.yaml"), "r.yaml")
    policy = RulesPolicy(rules)
    capture = CaptureObserver(CaptureSettings(dir=directory, instance="edge-1",
                                              format=capture_format))
    capture.attach(policy)
    batch = batch_v2(record_v2(0, 0, b"k", SECRET_PAYLOAD), 1)
    exchange(capture, policy, conn, request(0, 9, 11, acks=-1, timeout_ms=1000, topic_data=[
        {"name": "orders", "partition_data": [{"index": 3, "records": batch},
                                              {"index": 4, "records": batch}]}]),
        response_frame(0, 9, 11, responses=[{"name": "prod.orders", "partition_responses": [
            {"index": 3, "error_code": 6}, {"index": 4, "error_code": 0}]}]))
    exchange(capture, policy, conn, request(0, 8, 12, acks=1, timeout_ms=1000, topic_data=[
        {"name": "orders", "partition_data": [{"index": 0, "records": batch}]}]),
        response_frame(0, 8, 12, responses=[]), local=True)
    exchange(capture, policy, conn, request(1, 12, 13, max_wait_ms=500, topics=[]),
             response_frame(1, 12, 13, responses=[{"topic": "orders", "partitions": [
                 {"partition_index": 1, "records": batch}]}]))
    exchange(capture, policy, conn, request(11, 5, 14, group_id="billing",
                                            session_timeout_ms=6000,
                                            rebalance_timeout_ms=6000, member_id="",
                                            protocol_type="consumer",
                                            protocols=[{"name": "range", "metadata": b""}]),
             response_frame(11, 5, 14, error_code=79))
    exchange(capture, policy, conn, request(36, 2, 15, auth_bytes=b"\x00alice\x00" +
                                            SECRET_PASSWORD),
             response_frame(36, 2, 15, auth_bytes=b"x" * 8))
    exchange(capture, policy, conn, request(0, 9, 16, acks=0, timeout_ms=1000, topic_data=[
        {"name": "clicks", "partition_data": [{"index": 0, "records": batch}]}]), None)
    exchange(capture, policy, conn, request(3, 12, 17, topics=[{"name": "orders"}]), None)
    capture.connection_closed(conn, "client closed")
    assert capture.close(10)
    raw = b"".join(p.read_bytes() for p in directory.iterdir())
    assert SECRET_PAYLOAD not in raw and SECRET_PASSWORD not in raw and b"alice" not in raw
    return read_parquet(directory) if capture_format == "parquet" else read_records(directory)


def test_parquet_holds_the_same_records_as_jsonl(tmp_path: Path) -> None:
    as_parquet = observe(tmp_path / "parquet", "parquet")
    as_jsonl = observe(tmp_path / "jsonl", "jsonl")
    for record in as_parquet:
        check_schema(record)
    assert len(as_parquet) == 7

    def comparable(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        # Each observer stamps its own arrival times and run id; the rest is the exchange.
        return [{k: v for k, v in r.items() if k not in ("time", "run")} for r in records]

    assert comparable(as_parquet) == comparable(as_jsonl)
    by_id = {r["correlation_id"]: r for r in as_parquet}
    assert by_id[11]["topics"] == [{"name": "orders", "broker": "prod.orders", "id": None,
                                    "partitions": [3, 4], "records": 2,
                                    "bytes": 2 * len(batch_v2(record_v2(
                                        0, 0, b"k", SECRET_PAYLOAD), 1))}]
    assert by_id[11]["errors"] == [6] and by_id[16]["latency_ms"] is None
    assert by_id[17]["outcome"] == "unanswered" and by_id[17]["response_bytes"] is None
    (path,) = (tmp_path / "parquet").iterdir()
    schema = pq.read_schema(path)
    assert schema.names == [name for name, _ in FIELDS]
    assert schema.metadata[b"gatehouse.capture.v"] == str(SCHEMA_VERSION).encode()
    assert str(schema.field("topics").type) == (
        "list<element: struct<name: string, broker: string, id: string, partitions: "
        "list<element: int32>, records: int64, bytes: int64>>")


def records(n: int, start: int = 0) -> list[dict[str, Any]]:
    """Schema-shaped records, numbered by ``conn``."""
    base = {name: [] if kind.startswith("array<") else None for name, kind in FIELDS}
    return [{**base, "v": SCHEMA_VERSION, "time": 1.0 + i, "conn": i, "api": "Fetch",
             "client": "10.0.0.1:4000", "topics": [{"name": f"t{i % 7}", "broker": None,
                                                   "id": None, "partitions": [i % 3],
                                                   "records": i, "bytes": 10 * i}]}
            for i in range(start, start + n)]


def test_a_parquet_file_is_hidden_until_closed_then_whole(tmp_path: Path) -> None:
    writer = CaptureWriter(CaptureSettings(dir=tmp_path, instance="edge", format="parquet"))
    for record in records(1000):
        assert writer.offer(record)
    deadline = time.monotonic() + 10
    while not list(tmp_path.iterdir()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    (hidden,) = tmp_path.iterdir()
    assert hidden.name.startswith(".gatehouse-edge-") and hidden.name.endswith(
        ".parquet.open")  # rows wait for a whole row group; no footer yet: not readable
    assert writer.close(10)
    assert [r["conn"] for r in read_parquet(tmp_path)] == list(range(1000))
    stats = writer.statistics()
    assert (stats.written, stats.files_written, stats.dropped, stats.write_errors) == (
        1000, 1, 0, 0)
    assert 0 < stats.bytes_written <= sum(p.stat().st_size for p in tmp_path.iterdir())


def test_parquet_row_groups_rotation_and_budget(tmp_path: Path) -> None:
    # rotate_bytes bounds the Arrow memory held for a row group too: small files here.
    settings = CaptureSettings(dir=tmp_path, format="parquet", rotate_bytes=60_000,
                               max_total_bytes=300_000, instance="edge")
    writer = CaptureWriter(settings)
    total = 20_000
    for start in range(0, total, 1000):
        for record in records(1000, start):
            assert writer.offer(record)
        time.sleep(0.01)  # the writer thread takes them batch by batch
    assert writer.close(10)
    stats = writer.statistics()
    files = sorted(tmp_path.iterdir())
    assert sum(p.stat().st_size for p in files) <= 300_000
    assert stats.written == total and stats.dropped == 0 and stats.files_deleted >= 1
    assert stats.files_written == stats.files_deleted + len(files)
    kept = [r["conn"] for r in read_parquet(tmp_path)]
    assert kept == list(range(total - len(kept), total))  # the newest, in order, no gaps
    assert all(pq.ParquetFile(p).metadata.num_row_groups >= 1 for p in files)


def test_big_row_groups_when_the_files_are_big(tmp_path: Path) -> None:
    writer = CaptureWriter(CaptureSettings(dir=tmp_path, format="parquet", queue=200_000))
    for record in records(ROW_GROUP_ROWS + 10):
        assert writer.offer(record)
    assert writer.close(30)
    (path,) = tmp_path.iterdir()
    meta = pq.ParquetFile(path).metadata
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [
        ROW_GROUP_ROWS, 10]


@pytest.mark.parametrize("sizes", [[ROW_GROUP_ROWS - 500, 510],
                                   [3 * ROW_GROUP_ROWS + 7], [ROW_GROUP_ROWS, 10]])
def test_row_groups_are_whole_however_the_batches_fall(tmp_path: Path,
                                                       sizes: list[int]) -> None:
    """The writer thread takes records in batches of any size: rows past a whole row
    group wait for the next one instead of making it bigger (or the next one tiny)."""
    import io

    from gatehouse.capture.writer import ParquetEncoder

    encoder = ParquetEncoder(max_pending_bytes=1 << 40)
    out = io.BytesIO()
    encoder.open(out)
    start = 0
    for size in sizes:
        if encoder.add(encoder.encode(records(size, start))):
            encoder.flush()
        start += size
    encoder.flush(final=True)
    encoder.close()
    meta = pq.ParquetFile(io.BytesIO(out.getvalue())).metadata
    groups = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
    assert groups == [ROW_GROUP_ROWS] * (start // ROW_GROUP_ROWS) + [start % ROW_GROUP_ROWS]
    table = pq.read_table(io.BytesIO(out.getvalue()))
    assert table.column("conn").to_pylist() == list(range(start))  # in order, no gaps


def test_idle_parquet_files_close_on_time_without_empty_ones(tmp_path: Path) -> None:
    writer = CaptureWriter(CaptureSettings(dir=tmp_path, format="parquet",
                                           rotate_seconds=0.2))
    writer.offer(records(1)[0])
    deadline = time.monotonic() + 10
    while not any(not p.name.startswith(".") for p in tmp_path.iterdir()):
        assert time.monotonic() < deadline, "the idle file was not closed"
        time.sleep(0.01)
    time.sleep(0.5)  # idle for more than rotate_seconds: no new (empty) file appears
    writer.offer(records(1, 1)[0])
    assert writer.close(10)
    files = sorted(tmp_path.iterdir())
    assert [[r["conn"] for r in pq.read_table(p).to_pylist()] for p in files] == [[0], [1]]


def test_a_stalled_disk_drops_and_counts_parquet_too(tmp_path: Path) -> None:
    disk = StalledDisk()
    metrics = ProxyMetrics()
    settings = CaptureSettings(dir=tmp_path, queue=100, format="parquet")
    capture = CaptureObserver(settings, CaptureWriter(settings, opener=disk.open),
                              registry=metrics.registry)
    batch = records(20_001)
    capture.writer.offer(batch[0])
    assert disk.entered.wait(10)  # the writer thread is stuck writing the file's header
    began = time.perf_counter()
    accepted = sum(capture.writer.offer(r) for r in batch[1:])
    assert accepted == 100 and time.perf_counter() - began < 1.0
    assert metrics.registry.get_sample_value("gatehouse_capture_records_total",
                                             {"outcome": "dropped"}) == 19_900
    disk.release.set()
    assert capture.close(10)
    assert [r["conn"] for r in read_parquet(tmp_path)] == list(range(101))
    assert metrics.registry.get_sample_value("gatehouse_capture_records_total",
                                             {"outcome": "written"}) == 101


def test_records_the_schema_cannot_hold_are_counted_not_fatal(tmp_path: Path) -> None:
    writer = CaptureWriter(CaptureSettings(dir=tmp_path, format="parquet"))
    writer.offer({**records(1)[0], "conn": "not a number"})
    deadline = time.monotonic() + 10
    while writer.statistics().write_errors == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    for record in records(3, 1):
        writer.offer(record)
    assert writer.close(10)
    assert [r["conn"] for r in read_parquet(tmp_path)] == [1, 2, 3]
    assert writer.statistics().write_errors == 1


def test_a_dead_writers_parquet_file_is_named_truncated(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    name = f"gatehouse-edge-20260101T000000Z-{dead.pid}-000001.parquet"
    (tmp_path / f".{name}.open").write_bytes(b"PAR1 no footer")
    closed = tmp_path / f"gatehouse-edge-20260101T000000Z-{dead.pid}-000000.jsonl"
    closed.write_bytes(b"x" * 150_000)
    writer = CaptureWriter(CaptureSettings(dir=tmp_path, instance="edge", format="parquet",
                                           rotate_bytes=50_000, max_total_bytes=100_000))
    writer.offer(records(1)[0])
    assert writer.close(10)
    names = sorted(p.name for p in tmp_path.iterdir())
    # The jsonl file of before the switch counts in the budget: it went first.
    assert closed.name not in names and f"{name}.truncated" in names
    assert writer.statistics().files_deleted == 1
    assert os.path.getsize(tmp_path / f"{name}.truncated") == 14


def test_capture_format_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def capture(text: str) -> Any:
        return config_from_text("listen: 1\nupstream: [a:1]\n" + text, "g.yaml",
                                base=tmp_path).capture

    assert capture("capture: {dir: c}\n").format == "jsonl"
    assert capture("capture: {dir: c, format: parquet}\n").format == "parquet"
    bad = {
        "capture: {dir: c, format: avro}\n": "capture.format must be one of jsonl, parquet",
        "capture: {dir: c, format: parquet, gzip: true}\n": "capture.gzip is for jsonl",
    }
    for text, message in bad.items():
        with pytest.raises(ConfigError, match=message) as info:
            capture(text)
        assert str(info.value).startswith("g.yaml:3")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow: ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ConfigError, match=r"needs pyarrow.*kafka-gatehouse\[parquet\]") as info:
        capture("capture:\n  dir: c\n  format: parquet\n")
    assert str(info.value).startswith("g.yaml:5")
    assert capture("capture: {dir: c, format: jsonl}\n").format == "jsonl"
