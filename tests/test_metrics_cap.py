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
