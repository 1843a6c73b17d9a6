"""The observation log without sockets: records, schema v1, secrets, writer, config."""

from __future__ import annotations

import gzip
import json
import os
import threading
import time
from pathlib import Path
from typing import IO, Any

import pytest

from gatehouse import codecs
from gatehouse.capture.observer import CaptureObserver
from gatehouse.capture.schema import FIELDS, OUTCOMES, RULE_FIELDS, SCHEMA_VERSION, TOPIC_FIELDS
from gatehouse.capture.settings import CaptureSettings
from gatehouse.capture.writer import CaptureWriter
from gatehouse.configfile import ConfigError, load_yaml_text
from gatehouse.metrics import ProxyMetrics
from gatehouse.proxy.config import config_from_text
from gatehouse.proxy.hooks import ConnectionInfo, Pending
from gatehouse.proxy.policy import RulesPolicy
from gatehouse.rules import parse_rules
from tests.support.fakebroker import request
from tests.test_codec_records import batch_v2, record_v2

SECRET_PAYLOAD = b"card-4111-1111-1111-1111"
SECRET_PASSWORD = b"hunter2-very-secret"
PYTHON_TYPES = {"string": str, "int": int, "long": int, "double": (float, int)}


def wire(req: codecs.Request) -> codecs.Request:
    """The request as the proxy sees it: decoded from its bytes."""
    return codecs.decode_request(bytes(req.encode()))


def response_frame(api_key: int, version: int, correlation_id: int, **body: Any) -> bytes:
    resp = codecs.response_from_dict({"header": {"correlation_id": correlation_id},
                                      "body": body}, api_key=api_key, api_version=version)
    return bytes(resp.encode())


def check_value(kind: str, value: Any, where: str) -> None:
    if value is None:
        assert not kind.startswith("array<"), f"{where}: arrays are never null"
        return
    if kind.startswith("array<"):
        assert isinstance(value, list), where
        for i, item in enumerate(value):
            check_value(kind[6:-1], item, f"{where}[{i}]")
    elif kind in ("topic", "rule"):
        fields = TOPIC_FIELDS if kind == "topic" else RULE_FIELDS
        assert isinstance(value, dict), where
        assert set(value) == {n for n, _ in fields}, f"{where}: {sorted(value)}"
        for name, sub in fields:
            check_value(sub, value[name], f"{where}.{name}")
    else:
        assert isinstance(value, PYTHON_TYPES[kind]) and not isinstance(value, bool), (
            f"{where}: {value!r} is not {kind}")


def check_schema(record: dict[str, Any]) -> None:
    assert set(record) == {name for name, _ in FIELDS}, sorted(set(record) ^ {
        n for n, _ in FIELDS})
    for name, kind in FIELDS:
        check_value(kind, record[name], name)
    assert record["v"] == SCHEMA_VERSION
    assert record["outcome"] in OUTCOMES


def read_records(directory: Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted(directory.iterdir()):
        assert not path.name.startswith("."), f"{path.name}: a file left unfinished"
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rt") as f:
            out.extend(json.loads(line) for line in f)
    return out


@pytest.fixture
def conn() -> ConnectionInfo:
    return ConnectionInfo(id=7, client="10.1.2.3:50123", listener="bootstrap",
                          software_name="confluent-kafka-python",
                          software_version="2.6.0-rdkafka-2.6.0")


def exchange(capture: CaptureObserver, policy: RulesPolicy | None, conn: ConnectionInfo,
             req: codecs.Request, frame: bytes | None, *, local: bool = False) -> None:
    """What ProxyConnection does: observer, then the policy, then the response."""
    req = wire(req)
    capture.request(conn, req, len(bytes(req.encode())))
    if policy is not None:
        policy.on_request(conn, req)
    if frame is not None:
        pending = Pending(req.correlation_id, req.api_key, req.api_version, 0.0,
                          local=frame if local else None)
        capture.response(conn, pending, len(frame), 0.0042, frame)


def test_records_follow_schema_v1_and_carry_the_exchange(tmp_path: Path,
                                                          conn: ConnectionInfo) -> None:
    rules = parse_rules(load_yaml_text(
        "- name: modern-produce\n  min_api_version: {Produce: 9}\n"
        "- name: orders-alias\n  rename_topics: {orders: prod.orders}\n", "r.yaml"), "r.yaml")
    policy = RulesPolicy(rules)
    capture = CaptureObserver(CaptureSettings(dir=tmp_path, instance="edge-1"))
    capture.attach(policy)
    batch = batch_v2(record_v2(0, 0, b"k", SECRET_PAYLOAD) + record_v2(1, 0, None,
                                                                       SECRET_PAYLOAD), 2)
    produce = request(0, 9, 11, acks=-1, timeout_ms=1000, topic_data=[
        {"name": "orders", "partition_data": [{"index": 3, "records": batch}]}])
    exchange(capture, policy, conn, produce, response_frame(0, 9, 11, responses=[
        {"name": "prod.orders", "partition_responses": [{"index": 3, "error_code": 6}]}]))
    old_produce = request(0, 8, 12, acks=1, timeout_ms=1000, topic_data=[
        {"name": "orders", "partition_data": [{"index": 0, "records": batch}]}])
    exchange(capture, policy, conn, old_produce, response_frame(0, 8, 12, responses=[]),
             local=True)
    fetch = request(1, 12, 13, max_wait_ms=500, topics=[])
    exchange(capture, policy, conn, fetch, response_frame(1, 12, 13, responses=[
        {"topic": "orders", "partitions": [{"partition_index": 1, "records": batch}]}]))
    join = request(11, 5, 14, group_id="billing", session_timeout_ms=6000,
                   rebalance_timeout_ms=6000, member_id="", protocol_type="consumer",
                   protocols=[{"name": "range", "metadata": b""}])
    exchange(capture, policy, conn, join, response_frame(11, 5, 14, error_code=79))
    sasl = request(36, 2, 15, auth_bytes=b"\x00alice\x00" + SECRET_PASSWORD)
    exchange(capture, policy, conn, sasl, response_frame(36, 2, 15, auth_bytes=b"x" * 8))
    no_ack = request(0, 9, 16, acks=0, timeout_ms=1000, topic_data=[
        {"name": "clicks", "partition_data": [{"index": 0, "records": batch}]}])
    exchange(capture, policy, conn, no_ack, None)
    in_flight = request(3, 12, 17, topics=[{"name": "orders"}])
    exchange(capture, policy, conn, in_flight, None)
    capture.connection_closed(conn, "client closed")
    assert capture.close(10)

    raw = b"".join(p.read_bytes() for p in tmp_path.iterdir())
    assert SECRET_PAYLOAD not in raw and SECRET_PASSWORD not in raw and b"alice" not in raw
    records = read_records(tmp_path)
    for record in records:
        check_schema(record)
    by_id = {r["correlation_id"]: r for r in records}
    assert sorted(by_id) == [11, 12, 13, 14, 15, 16, 17]
    first = by_id[11]
    assert (first["proxy"], first["conn"], first["client"], first["listener"]) == (
        "edge-1", 7, "10.1.2.3:50123", "bootstrap")
    assert (first["software_name"], first["software_version"], first["client_id"]) == (
        "confluent-kafka-python", "2.6.0-rdkafka-2.6.0", "test-client")
    assert (first["api"], first["api_key"], first["api_version"]) == ("Produce", 0, 9)
    assert first["latency_ms"] == 4.2 and first["outcome"] == "answered"
    assert first["topics"] == [{"name": "orders", "broker": "prod.orders", "id": None,
                                "partitions": [3], "records": 2, "bytes": len(batch)}]
    assert first["errors"] == [6] and first["error_count"] == 1
    assert {(d["rule"], d["effect"], d["mode"]) for d in first["rules"]} == {
        ("modern-produce", "pass", "enforce"), ("orders-alias", "rewrite", "enforce")}
    refused = by_id[12]
    assert refused["outcome"] == "refused"
    assert {"rule": "modern-produce", "action": "min_api_version", "effect": "refuse",
            "mode": "enforce"} in refused["rules"]
    fetched = by_id[13]
    assert fetched["topics"][0]["name"] == "orders"
    assert fetched["topics"][0]["broker"] == "prod.orders"
    assert (fetched["topics"][0]["records"], fetched["topics"][0]["partitions"]) == (2, [1])
    joined = by_id[14]
    assert (joined["group_id"], joined["protocol_type"], joined["protocol_name"]) == (
        "billing", "consumer", "range")
    assert joined["errors"] == [79]
    assert by_id[16]["outcome"] == "no_response" and by_id[16]["latency_ms"] is None
    assert by_id[16]["topics"][0]["records"] == 2
    assert by_id[17]["outcome"] == "unanswered"


def test_a_listings_cursor_is_no_topic_of_its_record(tmp_path: Path,
                                                     conn: ConnectionInfo) -> None:
    """A DescribeTopicPartitions of every topic names no topic: its cursor is where
    the page starts (sealed by the proxy under a filter), left out of the record; one
    by name has its topics."""
    capture = CaptureObserver(CaptureSettings(dir=tmp_path))
    every = request(75, 0, 21, topics=[], response_partition_limit=5,
                    cursor={"topic_name": "~gatehouse:AAAA", "partition_index": 2})
    exchange(capture, None, conn, every, response_frame(75, 0, 21, topics=[]))
    named = request(75, 0, 22, topics=[{"name": "orders"}], response_partition_limit=5,
                    cursor={"topic_name": "orders", "partition_index": 2})
    exchange(capture, None, conn, named, response_frame(75, 0, 22, topics=[]))
    assert capture.close(10)
    by_id = {r["correlation_id"]: r for r in read_records(tmp_path)}
    assert by_id[21]["topics"] == []
    assert {t["name"] for t in by_id[22]["topics"]} == {"orders"}


def test_sampling_per_api(tmp_path: Path, conn: ConnectionInfo) -> None:
    capture = CaptureObserver(CaptureSettings(dir=tmp_path, sample={3: 0.0, 12: 0.5}))
    for i in range(400):
        exchange(capture, None, conn, request(3, 12, i, topics=[]),
                 response_frame(3, 12, i, brokers=[], topics=[]))
        exchange(capture, None, conn, request(18, 3, 1000 + i), response_frame(18, 3, 1000 + i))
        exchange(capture, None, conn, request(12, 4, 2000 + i, group_id="g",
                                              generation_id=1, member_id="m"),
                 response_frame(12, 4, 2000 + i))
    capture.close(10)
    records = read_records(tmp_path)
    apis = [r["api"] for r in records]
    assert "Metadata" not in apis and apis.count("ApiVersions") == 400
    assert 120 < apis.count("Heartbeat") < 280
    assert {r["sample"] for r in records if r["api"] == "Heartbeat"} == {0.5}
    assert capture.statistics().sampled_out == 400 + 400 - apis.count("Heartbeat")


def test_rotation_budget_and_close_lose_nothing(tmp_path: Path) -> None:
    settings = CaptureSettings(dir=tmp_path, rotate_bytes=20_000, max_total_bytes=100_000,
                               instance="edge/1")
    writer = CaptureWriter(settings)
    for i in range(5_000):
        assert writer.offer({"n": i, "pad": "x" * 60})
        if i % 500 == 0:
            time.sleep(0.01)  # let rotation happen in between
    assert writer.close(10)
    stats = writer.statistics()
    files = sorted(tmp_path.iterdir())
    assert all(p.name.startswith("gatehouse-edge_1-") and p.suffix == ".jsonl" for p in files)
    assert sum(p.stat().st_size for p in files) <= 100_000
    assert stats.files_deleted >= 1 and stats.written == 5_000 and stats.dropped == 0
    kept = [json.loads(line)["n"] for p in files for line in p.read_text().splitlines()]
    assert kept == sorted(kept) and kept[-1] == 4_999  # the newest are kept, in order
    assert stats.files_written == stats.files_deleted + len(files)


def test_gzip_files_are_whole_after_close(tmp_path: Path) -> None:
    writer = CaptureWriter(CaptureSettings(dir=tmp_path, gzip=True))
    for i in range(1000):
        writer.offer({"n": i})
    assert writer.close(10)
    (path,) = tmp_path.iterdir()
    assert path.name.endswith(".jsonl.gz")
    assert [json.loads(x)["n"] for x in gzip.decompress(path.read_bytes()).splitlines()] == list(
        range(1000))


class StalledDisk:
    """Files whose writes block until ``release`` is set: a hung disk."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()

    def open(self, path: Path) -> IO[bytes]:
        disk = self
        real = open(path, "xb")  # noqa: SIM115

        class Stalling:
            def write(self, data: bytes) -> int:
                disk.entered.set()
                disk.release.wait()
                return real.write(data)

            def __getattr__(self, name: str) -> Any:
                return getattr(real, name)

        return Stalling()  # type: ignore[return-value]


def test_a_stalled_disk_drops_and_counts_never_blocks(tmp_path: Path) -> None:
    disk = StalledDisk()
    metrics = ProxyMetrics()
    settings = CaptureSettings(dir=tmp_path, queue=100)
    capture = CaptureObserver(settings, CaptureWriter(settings, opener=disk.open),
                              registry=metrics.registry)
    capture.writer.offer({"n": -1})
    assert disk.entered.wait(10)  # the writer thread is now stuck in write()
    began = time.perf_counter()
    accepted = sum(capture.writer.offer({"n": i}) for i in range(20_000))
    elapsed = time.perf_counter() - began
    assert accepted == 100 and elapsed < 1.0  # ~µs each: never waits for the disk
    assert metrics.registry.get_sample_value("gatehouse_capture_records_total",
                                             {"outcome": "dropped"}) == 19_900
    assert metrics.registry.get_sample_value("gatehouse_capture_queue_depth") == 100
    disk.release.set()
    assert capture.close(10)
    assert len(read_records(tmp_path)) == 101
    assert metrics.registry.get_sample_value("gatehouse_capture_records_total",
                                             {"outcome": "written"}) == 101


def test_capture_config(tmp_path: Path) -> None:
    config = config_from_text(
        "listen: 127.0.0.1:0\nupstream: [127.0.0.1:9092]\n"
        "capture:\n  dir: cap\n  gzip: true\n  rotate_seconds: 60\n  instance: edge-1\n"
        "  sample: {Fetch: 0.25, default: 0.5}\n", base=tmp_path)
    settings = config.capture
    assert isinstance(settings, CaptureSettings)
    assert settings.dir == tmp_path / "cap" and settings.gzip and settings.instance == "edge-1"
    assert settings.sample_rate(1) == 0.25 and settings.sample_rate(0) == 0.5
    bad = {
        "capture: {gzip: true}\n": "capture needs 'dir'",
        "capture: {dir: c, sample: {Fetchh: 1}}\n": "unknown API name 'Fetchh'",
        "capture: {dir: c, sample: {Fetch: 2}}\n": "from 0 to 1",
        "capture: {dir: c, rotate_bytes: 10, max_total_bytes: 5}\n": "at least",
        "capture: {dir: c, kafka: {acks: 0}}\n": "capture.kafka.acks must be 'all' or 1",
        "capture: {dir: c, colour: red}\n": "unknown key 'colour'",
    }
    for text, message in bad.items():
        with pytest.raises(ConfigError, match=message) as info:
            config_from_text("listen: 1\nupstream: [a:1]\n" + text, "g.yaml", base=tmp_path)
        assert str(info.value).startswith("g.yaml:3")


def _wait_for(condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_time_rotation_closes_idle_files_without_empty_ones(tmp_path: Path) -> None:
    writer = CaptureWriter(CaptureSettings(dir=tmp_path, rotate_seconds=0.2))
    writer.offer({"n": 1})
    _wait_for(lambda: any(not p.name.startswith(".") for p in tmp_path.iterdir()))
    time.sleep(0.5)  # idle for more than rotate_seconds: no new (empty) file appears
    writer.offer({"n": 2})
    assert writer.close(10)
    files = sorted(tmp_path.iterdir())
    assert [p.read_text() for p in files] == ['{"n":1}\n', '{"n":2}\n']


def test_leftovers_of_dead_writers_are_recovered_live_ones_left(tmp_path: Path) -> None:
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    prefix = ".gatehouse-edge-20260101T000000Z"
    (tmp_path / f"{prefix}-{dead.pid}-000001.jsonl.open").write_text('{"n":1}\n')
    (tmp_path / f"{prefix}-{dead.pid}-000002.jsonl.gz.open").write_bytes(b"\x1f\x8b")
    live = tmp_path / f"{prefix}-{os.getppid()}-000001.jsonl.open"
    live.write_text('{"n":2}\n')
    writer = CaptureWriter(CaptureSettings(dir=tmp_path, instance="edge"))
    assert writer.close(10)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted([live.name, f"{prefix[1:]}-{dead.pid}-000001.jsonl",
                            f"{prefix[1:]}-{dead.pid}-000002.jsonl.gz.truncated"])


def capture_knowing(directory: Path, conn: ConnectionInfo, name: str,
                    topic_id: str) -> CaptureObserver:
    """A capture that has seen a Metadata response naming ``topic_id``."""
    capture = CaptureObserver(CaptureSettings(dir=directory))
    capture.request(conn, wire(request(3, 12, 20, topics=None)), 10)
    capture.response(conn, Pending(20, 3, 12, 0.0), 0, 0.001, response_frame(
        3, 12, 20, topics=[{"name": name, "topic_id": topic_id, "partitions": []}]))
    return capture


@pytest.mark.parametrize("version", [3, 9, 12, 13])
def test_produce_topics_read_from_the_bytes_match_the_decoded_body(
        tmp_path: Path, conn: ConnectionInfo, version: int) -> None:
    """Produce requests are logged from their bytes (no body decode): the same topics,
    partitions, record counts and bytes as from the decoded body; topic ids (v13) named
    from a Metadata response seen before."""
    orders_id = "6f1c2f57-1e1c-4c7a-9d0c-3a2b1c0d9e8f"
    batch = batch_v2(record_v2(0, 0, b"k", b"v") + record_v2(1, 0, None, b"w"), 2)
    topic = {"topic_id": orders_id} if version >= 13 else {"name": "orders"}
    produce = request(0, version, 21, acks=-1, timeout_ms=1000, topic_data=[
        {**topic, "partition_data": [{"index": 3, "records": batch},
                                     {"index": 5, "records": batch + batch}]}])
    logged = []
    for decode_first in (False, True):
        capture = capture_knowing(tmp_path / str(decode_first), conn, "orders", orders_id)
        req = wire(produce)
        if decode_first:
            assert req.body is not None  # as when a rule has read it
        capture.request(conn, req, len(bytes(req.encode())))
        assert req.body_decoded == decode_first  # the log did not decode it
        capture.response(conn, Pending(21, 0, version, 0.0), 0, 0.001, None)
        assert capture.close(10)
        logged.append(next(r for r in read_records(tmp_path / str(decode_first))
                           if r["correlation_id"] == 21)["topics"])
    assert logged[0] == logged[1] == [{
        "name": "orders", "broker": "orders", "id": orders_id if version >= 13 else None,
        "partitions": [3, 5], "records": 6, "bytes": 3 * len(batch)}]


@pytest.mark.parametrize("version", [12, 13, 17])
def test_fetch_topics_read_from_the_bytes_match_the_decoded_response(
        tmp_path: Path, conn: ConnectionInfo, version: int) -> None:
    """Fetch responses are logged from their bytes (no decode): the same topics,
    partitions, record counts, bytes and error codes as from the decoded response."""
    orders_id = "6f1c2f57-1e1c-4c7a-9d0c-3a2b1c0d9e8f"
    batch = batch_v2(record_v2(0, 0, b"k", b"v") + record_v2(1, 0, None, b"w"), 2)
    topic = {"topic_id": orders_id} if version >= 13 else {"topic": "orders"}

    def partition(index: int, code: int, records: bytes | None) -> dict[str, Any]:
        return {"partition_index": index, "error_code": code, "high_watermark": 9,
                "last_stable_offset": 9, "log_start_offset": 0, "aborted_transactions": [],
                "preferred_read_replica": -1, "records": records}

    frame = response_frame(1, version, 21, throttle_time_ms=0, error_code=0, session_id=0,
                           responses=[{**topic, "partitions": [
                               partition(3, 0, batch), partition(5, 0, batch + batch),
                               partition(7, 1, None)]}])
    fetch = request(1, version, 21, max_wait_ms=500, min_bytes=1, max_bytes=1 << 20,
                    isolation_level=0, session_id=0, session_epoch=-1, topics=[],
                    forgotten_topics_data=[], rack_id="")
    logged = []
    for decode_first in (False, True):
        capture = capture_knowing(tmp_path / str(decode_first), conn, "orders", orders_id)
        capture.request(conn, wire(fetch), 50)
        pending = Pending(21, 1, version, 0.0)
        if decode_first:  # as when the proxy decoded it (a rewrite or a rule)
            pending.decoded = codecs.decode_response(frame, 1, version)
        capture.response(conn, pending, len(frame), 0.001, frame)
        assert (pending.scan is None) == decode_first  # the scanned path was taken
        assert capture.close(10)
        logged.append({k: v for k, v in next(
            r for r in read_records(tmp_path / str(decode_first)) if r["correlation_id"] == 21
        ).items() if k in ("topics", "errors", "error_count")})
    assert logged[0] == logged[1] == {"errors": [1], "error_count": 1, "topics": [{
        "name": "orders", "broker": "orders", "id": orders_id if version >= 13 else None,
        "partitions": [3, 5, 7], "records": 6, "bytes": 3 * len(batch)}]}


def test_a_share_fetch_is_logged_with_the_records_it_carried(
        tmp_path: Path, conn: ConnectionInfo) -> None:
    """A share consumer's ShareFetch (KIP-932) is logged as a Fetch is: its group, and
    the topics of its answer with their record counts and bytes."""
    jobs_id = "6f1c2f57-1e1c-4c7a-9d0c-3a2b1c0d9e8f"
    batch = batch_v2(record_v2(0, 0, b"k", b"v") + record_v2(1, 0, None, b"w"), 2)
    capture = capture_knowing(tmp_path, conn, "jobs", jobs_id)
    share_fetch = request(78, 1, 21, group_id="workers", member_id="m", share_session_epoch=0,
                          max_wait_ms=500, min_bytes=1, max_bytes=1 << 20, max_records=500,
                          batch_size=500, topics=[{"topic_id": jobs_id, "partitions": [
                              {"partition_index": 0, "acknowledgement_batches": []}]}],
                          forgotten_topics_data=[])
    capture.request(conn, wire(share_fetch), 60)
    frame = response_frame(78, 1, 21, error_code=0, acquisition_lock_timeout_ms=30000,
                           responses=[{"topic_id": jobs_id, "partitions": [
                               {"partition_index": 0, "error_code": 0,
                                "acknowledge_error_code": 0,
                                "current_leader": {"leader_id": 1, "leader_epoch": 0},
                                "records": batch, "acquired_records": [
                                    {"first_offset": 0, "last_offset": 1,
                                     "delivery_count": 1}]}]}])
    capture.response(conn, Pending(21, 78, 1, 0.0), len(frame), 0.001, frame)
    assert capture.close(10)
    [logged] = [r for r in read_records(tmp_path) if r["correlation_id"] == 21]
    assert logged["api"] == "ShareFetch" and logged["group_id"] == "workers"
    assert logged["topics"] == [{"name": "jobs", "broker": "jobs", "id": jobs_id,
                                 "partitions": [0], "records": 2, "bytes": len(batch)}]
