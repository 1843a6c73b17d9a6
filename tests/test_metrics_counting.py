"""The metrics' counting of the usual exchange in C (gatehouse/metrics/_counting.c),
held to the Python methods it stands in for: the same exchanges through a ProxyMetrics
that counts in C and through one left to its Python ``request`` and ``response`` give
the same samples, and the C path is the one that runs for the usual exchange."""

from __future__ import annotations

import struct
import uuid
from itertools import count

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gatehouse import codecs
from gatehouse.codecs import fetch, produce
from gatehouse.metrics import ProxyMetrics
from gatehouse.metrics.tally import counting
from gatehouse.proxy.hooks import ConnectionInfo, Pending, scanned_response
from tests.codec_strategies import build_message, message_body
from tests.support.fakebroker import response_body
from tests.support.slowcalls import CountsSlowCalls
from tests.test_fetch_scan import draw_response_frame
from tests.test_metrics_produce import SETTINGS, batch, draw_request_frame

pytestmark = pytest.mark.skipif(counting is None, reason="not built: nothing to compare")

PRODUCE_VERSIONS = [v for v in codecs.api(0).request.valid if v >= produce.FIRST_VERSION]
# Kafka 4.0 removed these (3.x brokers serve them): no transactional id, read in Python.
OLD_PRODUCE_VERSIONS = [v for v in codecs.api(0).request.valid if v < produce.FIRST_VERSION]
FETCH_VERSIONS = [v for v in codecs.api(1).response.valid if v >= fetch.FIRST_VERSION]
_ids = count(1)


def python_only(metrics: ProxyMetrics) -> ProxyMetrics:
    """``metrics`` with the Python methods only (the C functions are instance attributes
    over the class's methods)."""
    del metrics.request, metrics.response  # type: ignore[method-assign]
    return metrics


def samples(metrics: ProxyMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in metrics.registry.collect() if family.name.startswith("gatehouse_")
            for s in family.samples if not s.name.endswith("_created")}  # when, not what


def request_of(frame: bytes, decode_body: bool) -> codecs.Request:
    req = codecs.decode_request(frame)
    if decode_body and req.known:
        req.body  # noqa: B018 - as a rule that reads it leaves it
    return req


def from_the_future(frame: bytes) -> bytes:
    """The same request under a Produce version the codec does not know."""
    return frame[:2] + struct.pack(">h", max(PRODUCE_VERSIONS) + 1) + frame[4:]


def produce_answer(data: st.DataObject, version: int, correlation_id: int) -> bytes:
    body = data.draw(message_body(codecs.api(0).response, version))
    resp = build_message(0, version, "response", body)
    return struct.pack(">i", correlation_id) + bytes(resp.encode())[4:]


def metadata_answer(topic_id: uuid.UUID, name: str) -> bytes:
    """A Metadata v12 answer naming ``topic_id`` (the metrics learn ids from them)."""
    plain = {"header": {"correlation_id": 0}, "body": {
        "throttle_time_ms": 0, "brokers": [], "cluster_id": None, "controller_id": 0,
        "topics": [{"error_code": 0, "name": name, "topic_id": str(topic_id),
                    "is_internal": False, "partitions": [],
                    "topic_authorized_operations": 0}]}}
    return bytes(codecs.response_from_dict(plain, api_key=3, api_version=12).encode())


def walked_request_of(frame: bytes) -> codecs.Request:
    """The request as the proxy's observers get one whose records went by spliced: its
    first bytes, with what the walk counted (``request_topics`` of the whole frame)."""
    req = codecs.decode_request(frame[:-1])
    produce.remember_request_topics(req, produce.request_topics(frame, req.api_version))
    return req


EXCHANGE = st.sampled_from(["produce", "produce", "produce-decoded", "produce-future",
                            "produce-walked", "produce-old",
                            "metadata", "api-versions", "fetch", "fetch", "local", "raw",
                            "unread", "no-frame"])


@given(st.data())
@SETTINGS
def test_the_same_samples_as_the_python_methods(data: st.DataObject) -> None:
    in_c, in_python = ProxyMetrics(), python_only(ProxyMetrics())
    # Each connection twice, one for each (the metrics keep a tally on it).
    conns = [tuple(ConnectionInfo(id=conn_id, client="127.0.0.1:1", listener="bootstrap",
                                  software_name="app", software_version="1")
                   for _ in range(2))
             for conn_id in [next(_ids) for _ in range(data.draw(st.integers(1, 3)))]]
    for _ in range(data.draw(st.integers(1, 12))):
        pair = data.draw(st.sampled_from(conns))
        kind = data.draw(EXCHANGE)
        correlation_id = data.draw(st.integers(0, 1000))
        elapsed = data.draw(st.sampled_from([0.0, 0.0001, 0.00025, 0.0003, 0.7, 31.0]))
        if kind.startswith("produce"):
            version = data.draw(st.sampled_from(
                OLD_PRODUCE_VERSIONS if kind == "produce-old" else PRODUCE_VERSIONS))
            frame = draw_request_frame(data, version)
            if kind == "produce-future" and version >= produce.FLEXIBLE_SINCE:
                frame = from_the_future(frame)  # a header of the same layout
            for metrics, conn in zip((in_c, in_python), pair, strict=True):
                req = (walked_request_of(frame) if kind == "produce-walked"
                       else request_of(frame, kind == "produce-decoded"))
                metrics.request(conn, req, len(frame))
            answer = memoryview(produce_answer(data, version, correlation_id))
            for metrics, conn in zip((in_c, in_python), pair, strict=True):
                pending = Pending(correlation_id, 0, version, 0.0)
                scanned_response(pending, answer)  # as the proxy reads it first
                metrics.response(conn, pending, len(answer), elapsed, answer)
        elif kind in ("fetch", "unread"):
            version = data.draw(st.sampled_from(FETCH_VERSIONS))
            answer = memoryview(draw_response_frame(data, version))
            for metrics, conn in zip((in_c, in_python), pair, strict=True):
                pending = Pending(correlation_id, 1, version, 0.0)
                if kind == "fetch":
                    scanned_response(pending, answer)
                metrics.response(conn, pending, len(answer), elapsed, answer)
        elif kind == "metadata":
            answer = memoryview(metadata_answer(uuid.UUID(int=data.draw(st.integers(1, 3))),
                                                data.draw(st.sampled_from(["a", "b"]))))
            for metrics, conn in zip((in_c, in_python), pair, strict=True):
                metrics.response(conn, Pending(0, 3, 12, 0.0), len(answer), elapsed, answer)
        elif kind == "api-versions":
            plain = {"header": {"api_key": 18, "api_version": 3, "correlation_id": 1,
                                "client_id": "app"},
                     "body": {"client_software_name": "app", "client_software_version": "1"}}
            frame = bytes(codecs.request_from_dict(plain).encode())
            for metrics, conn in zip((in_c, in_python), pair, strict=True):
                metrics.request(conn, codecs.decode_request(frame), len(frame))
        else:  # the proxy's own answer, a SASL v0 token, an answer gone by unread
            version = data.draw(st.sampled_from(PRODUCE_VERSIONS))
            answer = memoryview(produce_answer(data, version, correlation_id))
            for metrics, conn in zip((in_c, in_python), pair, strict=True):
                pending = Pending(correlation_id, 0, version, 0.0,
                                  local=bytes(answer) if kind == "local" else None,
                                  raw=kind == "raw")
                scanned_response(pending, answer)
                metrics.response(conn, pending, len(answer), elapsed,
                                 None if kind == "no-frame" else answer)
    got, expected = samples(in_c), samples(in_python)
    assert {k: v for k, v in got.items() if expected.get(k) != v} == {
        k: v for k, v in expected.items() if got.get(k) != v}
    # And the same tallies on each connection (/connections).
    for c_conn, python_conn in conns:
        assert (c_conn.produced, c_conn.fetched, c_conn.errors) == (
            python_conn.produced, python_conn.fetched, python_conn.errors)


class SlowCalls(CountsSlowCalls, ProxyMetrics):
    """Counts the calls that reach the Python methods."""


def produce_request(topic: str, records: int) -> bytes:
    plain = {"header": {"api_key": 0, "api_version": 9, "correlation_id": 1,
                        "client_id": "app"},
             "body": {"transactional_id": None, "acks": -1, "timeout_ms": 1000,
                      "topic_data": [{"name": topic, "partition_data": [
                          {"index": 0, "records": batch(records)}]}]}}
    return bytes(codecs.request_from_dict(plain).encode())


def test_the_usual_exchange_is_counted_in_c() -> None:
    metrics = SlowCalls()
    conn = ConnectionInfo(id=next(_ids), client="127.0.0.1:1", listener="bootstrap")
    frame = produce_request("orders", 5)
    answer = memoryview(struct.pack(">i", 1) + bytes(build_message(
        0, 9, "response", codecs.api(0).response.root.cls(responses=(), throttle_time_ms=0)
    ).encode())[4:])
    for _ in range(10):
        metrics.request(conn, codecs.decode_request(frame), len(frame))
        pending = Pending(1, 0, 9, 0.0)
        scanned_response(pending, answer)
        metrics.response(conn, pending, len(answer), 0.002, answer)
    # The first of each: the connection's counter, the topic's and the answer's made.
    assert metrics.slow == {"request": 1, "response": 1}
    value = metrics.registry.get_sample_value
    assert value("gatehouse_topic_records_total", {"topic": "orders",
                                                   "direction": "produce"}) == 50
    assert value("gatehouse_requests_total", {"api": "Produce", "version": "9",
                                              "client_software": "unknown",
                                              "listener": "bootstrap"}) == 10
    assert value("gatehouse_responses_total", {"api": "Produce", "error": "NONE"}) == 10
    assert value("gatehouse_request_duration_seconds_count",
                 {"api": "Produce", "kind": "request"}) == 10
    # A request whose records went by spliced (its first bytes, the walk's counts).
    for _ in range(3):
        metrics.request(conn, walked_request_of(frame), len(frame))
    assert metrics.slow == {"request": 1, "response": 1}
    assert value("gatehouse_topic_records_total", {"topic": "orders",
                                                   "direction": "produce"}) == 65
    # A new topic goes to Python once, then is counted in C too.
    for topic in ("payments", "payments"):
        new = produce_request(topic, 2)
        metrics.request(conn, codecs.decode_request(new), len(new))
    assert metrics.slow["request"] == 2
    # The connection's own tally, as /connections lists it, counted either way.
    assert conn.produced == {"orders": [65, 13 * len(batch(5))],
                             "payments": [4, 2 * len(batch(2))]}
    # Another connection's first of a topic the proxy knows: its tally made in Python.
    other = ConnectionInfo(id=next(_ids), client="127.0.0.1:2", listener="bootstrap")
    for _ in range(2):
        metrics.request(other, codecs.decode_request(frame), len(frame))
    assert metrics.slow["request"] == 3  # its first request (its counters), then C
    assert other.produced == {"orders": [10, 2 * len(batch(5))]}
    # An answer carrying an error goes to Python, which counts it on the connection too.
    failing = memoryview(bytes(codecs.Response.build(0, 9, 1, response_body(
        0, 9, throttle_time_ms=0, responses=[{"name": "orders", "partition_responses": [
            {"index": 0, "error_code": 6, "base_offset": -1}]}])).encode()))
    slow_before = metrics.slow["response"]
    for _ in range(2):
        pending = Pending(1, 0, 9, 0.0)
        scanned_response(pending, failing)
        metrics.response(conn, pending, len(failing), 0.002, failing)
    assert metrics.slow["response"] == slow_before + 2
    assert conn.errors == {"Produce NOT_LEADER_OR_FOLLOWER": 2}
    assert conn.last_error is not None and conn.last_error[:2] == ("Produce",
                                                                   "NOT_LEADER_OR_FOLLOWER")
    assert value("gatehouse_responses_total", {"api": "Produce",
                                               "error": "NOT_LEADER_OR_FOLLOWER"}) == 2
    pending = Pending(1, 0, 9, 0.0)
    scanned_response(pending, answer)
    metrics.response(conn, pending, len(answer), 0.002, answer)  # clean again: in C
    assert metrics.slow["response"] == slow_before + 2


def test_a_produce_version_kafka_4_removed_is_counted_in_python() -> None:
    """Produce v2 (a 3.x broker's old client): its topics read by the decoder, every
    time (the byte readers do not read it)."""
    metrics = SlowCalls()
    conn = ConnectionInfo(id=next(_ids), client="127.0.0.1:1", listener="bootstrap")
    plain = {"header": {"api_key": 0, "api_version": 2, "correlation_id": 1,
                        "client_id": "old"},
             "body": {"acks": 1, "timeout_ms": 1000, "topic_data": [
                 {"name": "orders", "partition_data": [{"index": 0, "records": batch(4)}]}]}}
    frame = bytes(codecs.request_from_dict(plain).encode())
    for _ in range(3):
        metrics.request(conn, codecs.decode_request(frame), len(frame))
    assert metrics.slow == {"request": 3, "response": 0}
    assert metrics.registry.get_sample_value("gatehouse_topic_records_total", {
        "topic": "orders", "direction": "produce"}) == 12


def test_the_children_are_the_c_ones_and_behave_as_the_python_ones() -> None:
    metrics = ProxyMetrics()
    tally = metrics.requests.labels(api="Produce", version="9", client_software="x",
                                    listener="bootstrap")
    assert type(tally) is counting.Tally  # type: ignore[union-attr]
    tally.inc()
    tally.inc(2.5)
    tally.value += 1
    assert tally.value == 4.5
    with pytest.raises(ValueError, match="only go up"):
        tally.inc(-1)
    histogram = metrics.duration.labels(api="Produce", kind="request")
    for value in (0.0001, 0.0002, 0.0001, 100.0):
        histogram.observe(value)
    assert histogram.counts[:3] == [2, 1, 0] and histogram.counts[-1] == 1
    assert histogram.sum == pytest.approx(100.0004)
    assert value_of(metrics, "gatehouse_request_duration_seconds_bucket",
                     {"api": "Produce", "kind": "request", "le": "0.00025"}) == 3


def value_of(metrics: ProxyMetrics, name: str, labels: dict[str, str]) -> float | None:
    return metrics.registry.get_sample_value(name, labels)
