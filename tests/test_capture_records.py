"""The observation log's JSON lines from C (gatehouse/capture/_records.c) are the json
module's bytes, for capture records and for any tree the json encoder takes."""

from __future__ import annotations

import json
import math
import random
import struct
import tempfile
import time
import uuid
from itertools import count
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gatehouse import codecs
from gatehouse.capture import schema
from gatehouse.capture.observer import CaptureObserver
from gatehouse.capture.schema import FIELDS, encode_json
from gatehouse.capture.settings import CaptureSettings
from gatehouse.codecs import fetch, produce
from gatehouse.proxy.hooks import ConnectionInfo, Pending, scanned_response
from tests.codec_strategies import build_message, examples, message_body
from tests.support.slowcalls import CountsSlowCalls
from tests.test_fetch_scan import draw_response_frame
from tests.test_metrics_counting import (
    from_the_future,
    metadata_answer,
    produce_answer,
    request_of,
    walked_request_of,
)
from tests.test_metrics_produce import SETTINGS, batch, draw_request_frame

native = schema.native
_ids = count(1)


def test_built_here() -> None:
    # The image and `make test` build it (setup.py); the Python path is tested with
    # GATEHOUSE_PURE_PYTHON in tests/test_speedups.py.
    assert native is not None


def _python_lines(records: list[Any]) -> bytes:
    return "".join([encode_json(r) + "\n" for r in records]).encode()


class Text(str):
    pass


class Number(int):
    pass


_scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, 1e16, 1e-5, 1.0]),
    st.text(), st.text(alphabet=st.characters(max_codepoint=0x7F)),
    st.sampled_from(["\ud800", "\U0001f600", '"\\', "\x7f\x00\x1f", "é"]),
)
_trees = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(st.text(max_size=8), inner, max_size=4),
    ),
    max_leaves=30,
)
# What only the fallback writes: the record goes to json whole, so still its bytes.
_others = st.one_of(
    st.builds(Text, st.text(max_size=4)), st.builds(Number, st.integers()),
    st.dictionaries(st.one_of(st.integers(), st.booleans(), st.none(), st.floats()),
                    st.integers(), min_size=1, max_size=3),
)


@given(st.lists(st.one_of(_trees, st.dictionaries(st.text(max_size=5),
                                                     st.one_of(_trees, _others)))))
@settings(max_examples=examples(400))
def test_the_same_bytes_as_json(records: list[Any]) -> None:
    assert native.encode_lines(records, encode_json) == _python_lines(records)
    for record in records:
        assert native.encode_record(record, encode_json) == encode_json(record).encode()


@given(st.fixed_dictionaries({
    name: (st.none() | st.integers(-(2**63), 2**63 - 1) | st.floats() | st.text()
           | st.lists(st.integers(-(2**31), 2**31)) | st.lists(st.fixed_dictionaries({
               "name": st.text() | st.none(), "broker": st.text() | st.none(),
               "id": st.uuids().map(str) | st.none(),
               "partitions": st.lists(st.integers(0, 2**31 - 1)),
               "records": st.integers(0, 2**40) | st.none(),
               "bytes": st.integers(0, 2**40) | st.none()})))
    for name, _ in FIELDS}))
def test_capture_records(record: dict[str, Any]) -> None:
    assert native.encode_lines([record, record], encode_json) == _python_lines([record, record])
    assert json.loads(native.encode_record(record, encode_json)) == json.loads(encode_json(record)) \
        or any(isinstance(v, float) and math.isnan(v) for v in record.values())


def test_what_the_fallback_writes() -> None:
    seen: list[Any] = []

    def fallback(record: Any) -> str:
        seen.append(record)
        return encode_json(record)

    plain, odd, deep = {"a": [1, 2.5, None]}, {"a": Text("x")}, [[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]
    assert native.encode_lines([plain, odd, deep, {1: 2}], fallback) == _python_lines(
        [plain, odd, deep, {1: 2}])
    assert seen == [odd, deep, {1: 2}]  # the plain one was written in C


def test_errors_are_the_json_modules() -> None:
    with pytest.raises(TypeError, match="not JSON serializable"):
        native.encode_lines([{"a": object()}], encode_json)
    with pytest.raises(TypeError, match="not str"):
        native.encode_lines([{"a": object()}], lambda record: b"bytes")
    with pytest.raises(TypeError):
        native.encode_lines(({"a": 1},), encode_json)  # a list of records


def test_the_writer_writes_them(tmp_path: Any) -> None:
    from gatehouse.capture.settings import CaptureSettings
    from gatehouse.capture.writer import CaptureWriter

    writer = CaptureWriter(CaptureSettings(dir=tmp_path, instance="t"))
    records = [{"v": 1, "client": "é\n", "n": i, "t": i / 3} for i in range(100)]
    for record in records:
        assert writer.offer(dict(record))
    assert writer.close()
    [path] = tmp_path.glob("*.jsonl")
    assert path.read_bytes() == _python_lines(records)


# -- the records built in C, held to the Python methods --------------------------------

PRODUCE_VERSIONS = [v for v in codecs.api(0).request.valid if v >= produce.FIRST_VERSION]
FETCH_REQUEST_VERSIONS = list(codecs.api(1).request.valid)
FETCH_VERSIONS = [v for v in codecs.api(1).response.valid if v >= fetch.FIRST_VERSION]
EXCHANGE = st.sampled_from(["produce", "produce", "produce-decoded", "produce-future",
                            "produce-walked", "fetch", "fetch", "fetch-unread", "fetch-decoded", "metadata",
                            "local", "no-frame", "unrecorded", "closed"])


class Collected:
    """A writer that keeps what it is offered."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def offer(self, record: dict[str, Any]) -> bool:
        self.records.append(record)
        return True

    def close(self, timeout: float | None = None) -> bool:
        return True


def observer(tmp: Any, sample: dict[int, float], python: bool = False) -> CaptureObserver:
    capture = CaptureObserver(CaptureSettings(dir=tmp, instance="t", sample=sample),
                              writer=Collected())  # type: ignore[arg-type]
    if python:  # the C functions are instance attributes over the class's methods
        del capture.request, capture.response  # type: ignore[method-assign]
    return capture


def fetch_request(data: st.DataObject, version: int) -> bytes:
    body = data.draw(message_body(codecs.api(1).request, version))
    return bytes(build_message(1, version, "request", body).encode())


def without_time(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for record in records:
        assert isinstance(record["time"], float) and abs(record["time"] - time.time()) < 600
    return [{k: v for k, v in r.items() if k not in ("time", "run")} for r in records]


@pytest.mark.skipif(native is None, reason="not built: nothing to compare")
@given(st.data())
@SETTINGS
def test_the_same_records_as_the_python_methods(data: st.DataObject) -> None:
    sample = data.draw(st.sampled_from([{}, {1: 0.5}, {0: 1.0, 1: 1.0}, {0: 1}]))
    with tempfile.TemporaryDirectory() as tmp:
        pair = (observer(Path(tmp), sample), observer(Path(tmp), sample, python=True))
        conns = [ConnectionInfo(id=next(_ids), client="127.0.0.1:1", listener="bootstrap",
                                software_name="app", software_version="1",
                                principal=data.draw(st.sampled_from([None, "alice"])))
                 for _ in range(data.draw(st.integers(1, 3)))]
        for step in range(data.draw(st.integers(1, 12))):
            conn = data.draw(st.sampled_from(conns))
            kind = data.draw(EXCHANGE)
            correlation_id = data.draw(st.integers(0, 1000))
            elapsed = data.draw(st.sampled_from([0.0, 0.0001234, 0.0004995, 0.7, 31.0]))

            def both(method: str, *args: Any, seed: int = step) -> None:
                for capture in pair:
                    random.seed(seed)  # the same draws for sampled APIs
                    getattr(capture, method)(*args)

            if kind.startswith("produce"):
                version = data.draw(st.sampled_from(PRODUCE_VERSIONS))
                frame = draw_request_frame(data, version)
                if kind == "produce-future" and version >= produce.FLEXIBLE_SINCE:
                    frame = from_the_future(frame)
                frame = struct.pack(">hhi", 0, *struct.unpack_from(">h", frame, 2),
                                    correlation_id) + frame[8:]
                for capture in pair:
                    random.seed(step)
                    req = (walked_request_of(frame) if kind == "produce-walked"
                           else request_of(frame, kind == "produce-decoded"))
                    capture.request(conn, req, len(frame))
                answer = memoryview(produce_answer(data, version, correlation_id))
                for capture in pair:
                    pending = Pending(correlation_id, 0, version, 0.0)
                    scanned_response(pending, answer)  # as the proxy reads it first
                    capture.response(conn, pending, len(answer), elapsed, answer)
            elif kind.startswith("fetch"):
                version = data.draw(st.sampled_from(FETCH_VERSIONS))
                request_version = min(version, max(FETCH_REQUEST_VERSIONS))
                frame = fetch_request(data, request_version)
                frame = frame[:4] + struct.pack(">i", correlation_id) + frame[8:]
                for capture in pair:
                    random.seed(step)
                    capture.request(conn, request_of(frame, kind == "fetch-decoded"),
                                    len(frame))
                answer = memoryview(draw_response_frame(data, version))
                for capture in pair:
                    pending = Pending(correlation_id, 1, version, 0.0)
                    if kind == "fetch":
                        scanned_response(pending, answer)
                    elif kind == "fetch-decoded":
                        pending.decoded = codecs.decode_response(answer, 1, version)
                    capture.response(conn, pending, len(answer), elapsed, answer)
            elif kind == "metadata":  # topic ids learned, for the next Fetch answers
                frame = metadata_request(correlation_id)
                both("request", conn, codecs.decode_request(frame), len(frame))
                answer = memoryview(struct.pack(">i", correlation_id) + metadata_answer(
                    uuid.UUID(int=data.draw(st.integers(1, 3))),
                    data.draw(st.sampled_from(["a", "b"])))[4:])
                both("response", conn, Pending(correlation_id, 3, 12, 0.0), len(answer),
                     elapsed, answer)
            elif kind == "closed":
                both("connection_closed", conn, "client closed")
            else:  # the proxy's own answer, no frame, an answer to nothing recorded
                version = data.draw(st.sampled_from(PRODUCE_VERSIONS))
                answer = memoryview(produce_answer(data, version, correlation_id))
                for capture in pair:
                    pending = Pending(correlation_id, 0, version, 0.0,
                                      local=bytes(answer) if kind == "local" else None)
                    capture.response(conn, pending, len(answer), elapsed,
                                     None if kind == "no-frame" else answer)
        for capture in pair:
            capture.close()
        in_c, in_python = (without_time(c.writer.records) for c in pair)  # type: ignore[attr-defined]
        assert in_c == in_python


class SlowCalls(CountsSlowCalls, CaptureObserver):
    """Counts the calls that reach the Python methods."""


@pytest.mark.skipif(native is None, reason="not built: nothing to check")
def test_the_usual_exchange_is_recorded_in_c(tmp_path: Path) -> None:
    capture = SlowCalls(CaptureSettings(dir=tmp_path, instance="t"), writer=Collected())
    conn = ConnectionInfo(id=next(_ids), client="127.0.0.1:1", listener="broker-1",
                          software_name="app", software_version="1")
    topic_id = uuid.UUID(int=7)
    # Its name is learned from a Metadata answer (through the Python methods).
    frame = metadata_request(1)
    capture.request(conn, codecs.decode_request(frame), len(frame))
    capture.response(conn, Pending(1, 3, 12, 0.0), 0, 0.001,
                     memoryview(metadata_answer(topic_id, "orders")))
    plain = {"header": {"api_key": 0, "api_version": 13, "correlation_id": 2,
                        "client_id": "app"},
             "body": {"transactional_id": None, "acks": -1, "timeout_ms": 1000,
                      "topic_data": [{"topic_id": str(topic_id), "partition_data": [
                          {"index": 4, "records": batch(5)}]}]}}
    frame = bytes(codecs.request_from_dict(plain).encode())
    answer = memoryview(struct.pack(">i", 2) + bytes(build_message(
        0, 13, "response", codecs.response_from_dict({"header": {"correlation_id": 2}, "body": {
            "responses": [{"topic_id": str(topic_id), "partition_responses": [
                {"index": 4, "error_code": 6}]}]}}, api_key=0, api_version=13).body
    ).encode())[4:])
    for walked in (False, False, False, True):  # the last one's records went by spliced
        capture.request(conn, walked_request_of(frame) if walked
                        else codecs.decode_request(frame), len(frame))
        pending = Pending(2, 0, 13, 0.0)
        capture.response(conn, pending, len(answer), 0.0012345, answer)
    assert capture.slow == {"request": 1, "response": 1}  # the Metadata exchange
    record = capture.writer.records[-1]  # type: ignore[attr-defined]
    assert {k: record[k] for k in ("api", "api_version", "correlation_id", "listener",
                                   "client_id", "software_name", "outcome", "latency_ms",
                                   "errors", "error_count", "topics", "request_bytes")} == {
        "api": "Produce", "api_version": 13, "correlation_id": 2, "listener": "broker-1",
        "client_id": "app", "software_name": "app", "outcome": "answered",
        "latency_ms": 1.234, "errors": [6], "error_count": 1, "request_bytes": len(frame),
        "topics": [{"name": "orders", "broker": "orders", "id": str(topic_id),
                    "partitions": [4], "records": 5, "bytes": len(batch(5))}]}
    assert native.encode_record(record, encode_json) == encode_json(record).encode()


def metadata_request(correlation_id: int) -> bytes:
    plain = {"header": {"api_key": 3, "api_version": 12, "correlation_id": correlation_id,
                        "client_id": "app"},
             "body": {"topics": None, "allow_auto_topic_creation": False,
                      "include_topic_authorized_operations": False}}
    return bytes(codecs.request_from_dict(plain).encode())
