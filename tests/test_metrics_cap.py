"""The cardinality cap: `metrics.label_cap` in the config, and what folds into `other`."""

from __future__ import annotations

import pytest

from gatehouse import codecs
from gatehouse.configfile import ConfigError
from gatehouse.metrics import ProxyMetrics
from gatehouse.proxy.config import config_from_text
from gatehouse.proxy.hooks import ConnectionInfo, Policy
from gatehouse.proxy.setup import build_observers

BASE = "listen: 127.0.0.1:0\nupstream: [127.0.0.1:9092]\n"


def test_label_cap_from_the_config() -> None:
    config = config_from_text(BASE + "metrics: {listen: 127.0.0.1:0, label_cap: 2}\n")
    assert config.metrics_label_cap == 2
    observers = build_observers(config, Policy(), None)
    metrics = next(o for o in observers if isinstance(o, ProxyMetrics))
    assert metrics.topic_label.cap == 2
    assert config_from_text(BASE + "metrics: {listen: 9464}\n").metrics_label_cap == 500


@pytest.mark.parametrize("value", ["0", "-3", "many", "true"])
def test_bad_label_cap_names_the_line(value: str) -> None:
    with pytest.raises(ConfigError, match=r":5:.*label_cap"):
        config_from_text(BASE + f"metrics:\n  listen: 9464\n  label_cap: {value}\n")


def produce(metrics: ProxyMetrics, topic: str) -> None:
    batch = one_record_batch()
    plain = {"header": {"api_key": 0, "api_version": 9, "correlation_id": 1,
                        "client_id": "app"},
             "body": {"transactional_id": None, "acks": -1, "timeout_ms": 1000,
                      "topic_data": [{"name": topic, "partition_data": [
                          {"index": 0, "records": batch}]}]}}
    req = codecs.decode_request(bytes(codecs.request_from_dict(plain).encode()))
    conn = ConnectionInfo(id=1, client="127.0.0.1:1", listener="bootstrap")
    metrics.request(conn, req, 100)


def one_record_batch() -> bytes:
    import struct

    body = struct.pack(">hiqqqhii", 0, 0, 0, 0, -1, -1, -1, 1) + b"\x00" * 8
    return struct.pack(">qii", 0, 9 + len(body), 0) + b"\x02" + struct.pack(">I", 0) + body


def test_topics_past_the_cap_fold_into_other_and_are_counted() -> None:
    metrics = ProxyMetrics(label_cap=2)
    for topic in ("a", "b", "c", "d", "a", "d"):
        produce(metrics, topic)

    def records(topic: str) -> float:
        return metrics.registry.get_sample_value(
            "gatehouse_topic_records_total", {"topic": topic, "direction": "produce"}) or 0.0

    assert (records("a"), records("b"), records("other")) == (2, 1, 3)
    assert records("c") == 0
    # Two distinct names were folded (d twice: counted once).
    assert metrics.registry.get_sample_value("gatehouse_label_values_folded_total",
                                             {"label": "topic"}) == 2


def test_made_up_api_keys_and_versions_fold_into_other() -> None:
    """Requests pass through whatever their key and version; the labels of keys and
    versions no broker speaks are bounded, and one connection's keys stay apart."""
    import struct

    metrics = ProxyMetrics()
    conn = ConnectionInfo(id=1, client="127.0.0.1:1", listener="bootstrap")
    metrics.connection_opened(conn)

    def send(key: int, version: int) -> None:
        frame = struct.pack(">hhih", key, version, 7, 1) + b"c\x00"  # (empty header tags)
        metrics.request(conn, codecs.decode_request(frame), len(frame))

    for key, version in [(0, -1), (1, -1), (0, 3), (0, 500), (0, 501), (300, 1),
                         (-5, 1), (200, 3), (200, 900)]:
        send(key, version)

    def count(api: str, version: str) -> float:
        return metrics.registry.get_sample_value("gatehouse_requests_total", {
            "api": api, "version": version, "client_software": "unknown",
            "listener": "bootstrap"}) or 0.0

    assert count("Produce", "other") == 3  # -1, 500 and 501
    assert count("Fetch", "other") == 1
    assert count("Produce", "3") == 1
    assert count("other", "other") == 2  # keys 300 and -5
    assert count("api-200", "3") == 1 and count("api-200", "other") == 1


def test_produce_requests_of_versions_the_codec_does_not_know_are_not_counted() -> None:
    """A Produce version newer than the codec's passes through, but its records are not
    read as if it had the newest known layout."""
    from tests.test_metrics_produce import batch

    metrics = ProxyMetrics()
    conn = ConnectionInfo(id=1, client="127.0.0.1:1", listener="bootstrap")
    newest = max(codecs.api(0).request.valid)
    body = {"transactional_id": None, "acks": -1, "timeout_ms": 1000, "topic_data": [
        {"topic_id": "00000000-0000-0000-0000-0000000000aa",
         "partition_data": [{"index": 0, "records": batch(5)}]}]}
    frame = bytearray(codecs.request_from_dict(
        {"header": {"api_key": 0, "api_version": newest, "correlation_id": 1,
                    "client_id": "c"}, "body": body}).encode())

    def records() -> float:
        return metrics.registry.get_sample_value(
            "gatehouse_topic_records_total", {"topic": "unknown", "direction": "produce"}) or 0.0

    metrics.request(conn, codecs.decode_request(bytes(frame)), len(frame))
    assert records() == 5
    frame[2:4] = (newest + 1).to_bytes(2, "big")  # the same bytes, a version from the future
    future = codecs.decode_request(bytes(frame))
    assert not future.known
    metrics.request(conn, future, len(frame))
    assert records() == 5
