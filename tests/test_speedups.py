"""The C byte readers (gatehouse/codecs/_speedups.c) against the Python readers they
mirror: the same answer for every frame, valid or not, or NotImplemented (left to the
Python reader).  Frames come from the codec's Hypothesis strategies (as in the tests that
hold the Python readers to the full decoder), then are cut, flipped and spliced; the fuzz
harness (tests/reliability/fuzz_codec.py) runs the same check on mutated real frames."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gatehouse import codecs
from gatehouse.codecs import fetch, produce
from gatehouse.codecs._native import speedups
from gatehouse.codecs._scan import StepWalk
from tests.codec_strategies import build_message, header_tags, message_body
from tests.reliability.fuzz_codec import check_readers, mutate
from tests.test_fetch_scan import draw_response_frame
from tests.test_metrics_produce import RECORDS, SETTINGS, draw_request_frame

ROOT = Path(__file__).resolve().parents[1]
PRODUCE_VERSIONS = [v for v in codecs.api(0).request.valid if v >= produce.FIRST_VERSION]
FETCH_VERSIONS = [v for v in codecs.api(1).response.valid if v >= fetch.FIRST_VERSION]


def test_the_c_readers_are_built_and_used() -> None:
    # `pip install -e .` builds them wherever a C compiler is (CI has one); a missing
    # compiler must not go unnoticed here.
    assert speedups is not None
    assert produce._C_REQUEST_TOPICS is speedups.produce_request_topics
    assert fetch._C_WALK is speedups.fetch_walk
    assert produce._C_WALK_FEED is speedups.produce_walk_feed
    from gatehouse.proxy import fastio

    assert fastio._C_PEEK_WALK is not None  # Linux with SO_PEEK_OFF's number in its headers


def _info(registry: Any) -> dict[str, str]:
    [sample] = [s for m in registry.collect() if m.name == "gatehouse_info" for s in m.samples]
    assert sample.value == 1
    return dict(sample.labels)


def test_the_metrics_say_which_readers_run() -> None:
    from gatehouse import __version__
    from gatehouse.metrics import ProxyMetrics

    assert _info(ProxyMetrics().registry) == {"version": __version__, "byte_readers": "c"}


def test_gatehouse_pure_python_turns_them_off(tmp_path: Path) -> None:
    code = ("from gatehouse.codecs import _native, produce, fetch, records\n"
            "from gatehouse.metrics import ProxyMetrics\n"
            "from tests.test_speedups import _info\n"
            "assert _native.speedups is None\n"
            "assert produce._C_REQUEST_TOPICS is None and fetch._C_WALK is None\n"
            "assert records._C_COUNT_RECORDS is None and produce._C_WALK_FEED is None\n"
            "from gatehouse.proxy import fastio\n"
            "assert fastio._C_PEEK_WALK is None\n"
            "from gatehouse.codecs import _flat\n"
            "assert _flat._C_FLAT_RECORDS is None\n"
            "assert _info(ProxyMetrics().registry)['byte_readers'] == 'python'\n"
            "from gatehouse.metrics import tally\n"  # the metrics count in Python too
            "assert tally.counting is None\n"
            "assert type(ProxyMetrics().requests.labels('a', 'b', 'c', 'd')) is tally.Tally\n"
            "from gatehouse.capture import schema\n"  # and the log's records are json's
            "assert schema.native is None\n"
            "assert schema.encode_lines([{'a': 1}]) == b'{\"a\":1}\\n'\n"
            "from gatehouse.rules import encryption\n"  # records opened by AESGCM
            "assert encryption._gcm_opener is None and encryption._gcm_sealer is None\n")
    env = {**os.environ, "GATEHOUSE_PURE_PYTHON": "1"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=ROOT)
    config = tmp_path / "gatehouse.yaml"
    config.write_text("listen: 127.0.0.1:9192\nupstream: [127.0.0.1:9092]\n")
    checked = subprocess.run([sys.executable, "-m", "gatehouse.cli", "check", "--config",
                              str(config)], env=env, check=True, capture_output=True, text=True)
    assert "byte readers: python (GATEHOUSE_PURE_PYTHON is set)" in checked.stdout
    assert "metrics counting: python" in checked.stdout
    assert "capture records: python" in checked.stdout


def _mutations(frame: bytes, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [frame, frame[:-1], frame + b"\x00", *(mutate(frame, rng) for _ in range(12))]


def _check_all(frame: bytes, api_key: int, version: int, request: bool, seed: int) -> None:
    for mutated in _mutations(frame, seed):
        check_readers(mutated, api_key, version, request)


def _distinct_codes(scan: Any) -> int:
    return len(scan[0]) if scan is not None else 0


@pytest.mark.parametrize("version", PRODUCE_VERSIONS)
@SETTINGS
@given(data=st.data(), seed=st.integers(0, 2**32))
def test_produce_requests(version: int, data: st.DataObject, seed: int) -> None:
    frame = draw_request_frame(data, version)
    assert speedups is not None
    # A valid frame is always the C reader's own, and every kind of buffer reads alike.
    c = speedups.produce_request_topics(frame, version >= 9, version >= 13)
    assert c is not NotImplemented
    spans: list[tuple[int, int]] = []
    uncounted = speedups.produce_request_topics(frame, version >= 9, version >= 13, False, spans)
    if c is not None:  # names and partitions as counted, the records skipped
        assert uncounted == [(key, indexes, 0, 0) for key, indexes, _, _ in c]
        assert len(spans) == (0 if version >= 13 else len(c))
    padded = b"pad" + frame
    for buffer in (bytearray(frame), memoryview(padded)[3:]):
        assert speedups.produce_request_topics(buffer, version >= 9, version >= 13) == c
    _check_all(frame, 0, version, True, seed)


@pytest.mark.parametrize("version", PRODUCE_VERSIONS)
@SETTINGS
@given(data=st.data(), seed=st.integers(0, 2**32))
def test_produce_responses(version: int, data: st.DataObject, seed: int) -> None:
    body = data.draw(message_body(codecs.api(0).response, version))
    frame = bytes(build_message(0, version, "response", body,
                                tags=data.draw(header_tags(version >= 9))).encode())
    assert speedups is not None
    c = speedups.produce_response_scan(frame, version)
    python = produce._response_scan(frame, version, None)
    assert c == python or (c is NotImplemented and _distinct_codes(python) > 32)
    names: list[tuple[int, int, str]] = []
    if speedups.produce_response_scan(frame, version, names) == python and version < 13:
        # Where each topic's name is (what a rename rewrites in place).
        assert [name for _, _, name in names] == [t.name for t in body.responses]
        assert all(frame[end - len(name.encode()):end] == name.encode()
                   for _, end, name in names)
    _check_all(frame, 0, version, False, seed)


@pytest.mark.parametrize("version", FETCH_VERSIONS)
@SETTINGS
@given(data=st.data(), seed=st.integers(0, 2**32))
def test_fetch_responses(version: int, data: st.DataObject, seed: int) -> None:
    frame = draw_response_frame(data, version)
    assert speedups is not None
    c = speedups.fetch_walk(frame, version >= 13, True)
    python = fetch.response_scan(frame, version)  # the public reader, on the C walk
    if c is not None and c is not NotImplemented:
        assert python is not None and (c[0], c[2]) == (python[0], python[2])
    _check_all(frame, 1, version, False, seed)


@SETTINGS
@given(data=RECORDS, noise=st.binary(max_size=80), seed=st.integers(0, 2**32))
def test_record_counts(data: bytes | None, noise: bytes, seed: int) -> None:
    for records in _mutations((data or b"") + noise, seed):
        # check_readers compares count_records over the whole buffer and a tail of it.
        check_readers(records, 99, 0, True)


@pytest.mark.parametrize("frame", [b"", b"\x00", b"\xff" * 9, b"\x00" * 12,
                                   b"\x00" * 10 + b"\x80" * 8, b"\x00" * 10 + b"\xff" * 64])
def test_short_and_hostile_frames(frame: bytes) -> None:
    assert speedups is not None
    with pytest.raises(TypeError):
        speedups.produce_request_topics(frame, True, False, True, ())  # spans: a list
    with pytest.raises(TypeError):
        speedups.produce_response_scan(frame, 9, {})
    for version in (3, 8, 9, 12, 13):
        check_readers(frame, 0, version, True)
        check_readers(frame, 0, version, False)
        check_readers(frame, 1, max(version, 12), False)


_WALK_SLOTS = ("opaque", "finished", "_at", "_size", "_state", "_topics", "_partitions",
               "_left", "_key", "_indexes", "_records", "_bytes", "_out", "_held")


def _walk_state(walk: produce.RequestWalk) -> tuple[Any, ...]:
    return tuple(getattr(walk, slot) for slot in _WALK_SLOTS)


def _feed_alike(walks: tuple[produce.RequestWalk, produce.RequestWalk], piece: bytes
                ) -> int | None:
    """``piece`` to both walks, the first through RequestWalk.feed (C where it can), the
    second through the Python steps alone: the same bytes taken, the same state after,
    the same refusal.  How many they took; None once they refused."""
    outcomes = []
    for walk, feed in zip(walks, (produce.RequestWalk.feed, StepWalk.feed), strict=True):
        try:
            outcomes.append(feed(walk, piece))
        except produce.Unexpected:
            outcomes.append("refused")
    assert outcomes[0] == outcomes[1]
    if outcomes[0] == "refused":
        return None  # a refused walk is dropped, whatever state it was left in
    assert _walk_state(walks[0]) == _walk_state(walks[1])
    return int(outcomes[0])


@pytest.mark.parametrize("version", PRODUCE_VERSIONS)
@SETTINGS
@given(data=st.data(), seed=st.integers(0, 2**32), lie=st.sampled_from([0, 0, 0, -1, 1, -70]))
def test_request_walks_in_c_move_as_in_python(version: int, data: st.DataObject, seed: int,
                                              lie: int) -> None:
    """A Produce request (as drawn, cut, flipped, its size misstated) fed in random pieces,
    records skipped at random, to a walk that reads its usual parts in C and to one that
    reads every part in Python: after every piece the two are in the same state."""
    for frame in _mutations(draw_request_frame(data, version), seed)[:4]:
        size = max(len(frame) + lie, 0)
        walks = (produce.RequestWalk(version, size), produce.RequestWalk(version, size))
        pos = 0
        while pos < len(frame) and (walks[0].opaque or not walks[0].finished):
            if walks[0].opaque and data.draw(st.booleans()):
                n = data.draw(st.integers(1, min(walks[0].opaque, len(frame) - pos)))
                for walk in walks:
                    walk.skip(n)
                pos += n
                continue
            piece = frame[pos:pos + data.draw(st.sampled_from([1, 7, 70, 512, 1 << 20]))]
            taken = _feed_alike(walks, piece)
            if taken is None or (not taken and pos + len(piece) == len(frame)):
                break  # refused, or waiting for bytes past the frame's end (a size misstated)
            pos += taken
        assert walks[0].topics() == walks[1].topics()


def test_a_usual_request_is_walked_in_c() -> None:
    """One batch per partition, empty tag sections: every part read in C, as one piece
    and in the pieces a proxy peeks at."""
    from tests.test_metrics_produce import batch

    for version in (8, 9, 12, 13):
        topic = ({"topic_id": "00000000-0000-0000-0000-000000000005"} if version >= 13
                 else {"name": "orders"})
        frame = bytes(codecs.request_from_dict({
            "header": {"api_key": 0, "api_version": version, "correlation_id": 1,
                       "client_id": "app"},
            "body": {"transactional_id": None, "acks": -1, "timeout_ms": 1000,
                     "topic_data": [{**topic, "partition_data": [
                         {"index": i, "records": batch(3, payload=100_000)}
                         for i in range(3)]}]},
        }).encode())
        walk = produce.RequestWalk(version, len(frame))
        assert speedups.produce_walk_feed(walk, frame) == len(frame)
        assert walk.finished and walk.topics() == produce.request_topics(frame, version)
        walk = produce.RequestWalk(version, len(frame))
        pos = 0
        while not walk.finished:
            if walk.opaque:
                pos += walk.opaque
                walk.skip(walk.opaque)
                continue
            taken = speedups.produce_walk_feed(walk, frame[pos:pos + 512])
            assert taken == len(frame[pos:pos + 512])  # all in C
            pos += taken
        assert walk.topics() == produce.request_topics(frame, version)
