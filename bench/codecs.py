"""Codec benchmark: gatehouse.codecs against kio, in the same process.

Run from the repository root::

    .venv/bin/python bench/codecs.py             # the table (markdown)
    .venv/bin/python bench/codecs.py --quick     # fewer repeats
    .venv/bin/python bench/codecs.py --profile   # + cProfile of our side of each case
    .venv/bin/python bench/codecs.py --no-gc     # cyclic GC off while timing
    .venv/bin/python bench/codecs.py --freeze    # gc.freeze() the imported modules first
    .venv/bin/python bench/codecs.py --cpu-time  # CPU time (a machine shared with others)

Cases:

1. header-only decode of a Produce request frame (latest version).  Ours:
   ``codecs.decode_request(frame).header`` (the body stays undecoded).  kio has no
   header-only decode: its ``RequestHeader`` v2 entity reader over the frame.
2. Metadata response (latest version), 1,000 topics x 10 partitions: body decode, body
   decode then a read of every partition, and full body encode.
3. Fetch response (latest version), 50 partitions of 64 KiB of records: decode, encode.

"Decode" is frame -> objects: ours ``decode_response(frame, ...).body`` (the compiled
decoder builds the record tree on that first access, every byte checked; records stay
memoryview slices of the frame, and arrays of three or more number-only structs of one
layout, Metadata's partitions, stay ``FlatRecords``: their records are built when first
read), kio's ``ResponseHeader`` + payload entity readers.  Because of that laziness the
Metadata case is also timed as "decode, then read every partition" (the leader of each:
every record built, on both sides).  "Encode" is objects -> frame, forced to re-encode
everything: ours ``Response.build(...).encode()`` of a body whose arrays are all tuples of
records (a message built in code has no cached frame and nothing undecoded, so there is
no byte splicing), kio's header + payload entity writers into a ``BytesIO``.

Timing: ``time.perf_counter`` (``--cpu-time``: ``time.process_time``) around a loop of
N calls, repeated R times, ours and kio's repeats interleaved; the table shows the best
repeat (and the median).  The cyclic garbage collector stays enabled,
as in the proxy (``--no-gc`` disables it, as ``timeit`` does: that isolates codec work
from collection work, which both sides' object trees trigger).  Speed-up = kio time /
our time (above 1: we are faster).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import gc
import io
import os
import platform
import pstats
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kio.index import load_response_schema
from kio.schema.request_header.v2.header import RequestHeader as KioRequestHeaderV2
from kio.schema.response_header.v1.header import ResponseHeader as KioResponseHeaderV1
from kio.serial import entity_reader, entity_writer

from gatehouse import codecs

PRODUCE, FETCH, METADATA = 0, 1, 3
CORRELATION_ID = 0x01020304

# -- frames ---------------------------------------------------------------------------


def produce_request_frame() -> bytes:
    version = codecs.APIS[PRODUCE].versions.hi
    body = {
        "transactional_id": None,
        "acks": -1,
        "timeout_ms": 30_000,
        "topic_data": [
            {
                "topic_id": str(uuid.UUID(int=0x1234)),
                # Opaque to the header decode, so any bytes do: 1 KiB.
                "partition_data": [{"index": 0, "records": bytes(1024)}],
            }
        ],
    }
    header = {
        "api_key": PRODUCE,
        "api_version": version,
        "correlation_id": CORRELATION_ID,
        "client_id": "bench-producer-1",
    }
    req = codecs.request_from_dict({"header": header, "body": body})
    return bytes(codecs.encode_request(req))


def metadata_response_frame(topics: int = 1000, partitions: int = 10) -> tuple[bytes, int]:
    version = codecs.APIS[METADATA].versions.hi
    body = {
        "throttle_time_ms": 0,
        "brokers": [
            {
                "node_id": n,
                "host": f"broker-{n}.kafka.internal",
                "port": 9092,
                "rack": f"rack-{n % 3}",
            }
            for n in range(6)
        ],
        "cluster_id": "Yk9mC3RfQk2mJ0r3bE4x1A",
        "controller_id": 1,
        "topics": [
            {
                "error_code": 0,
                "name": f"orders.events.{t:05d}",
                "topic_id": str(uuid.UUID(int=(t + 1) * 0x9E3779B97F4A7C15)),
                "is_internal": False,
                "partitions": [
                    {
                        "error_code": 0,
                        "partition_index": p,
                        "leader_id": (t + p) % 6,
                        "leader_epoch": 7,
                        "replica_nodes": [(t + p + i) % 6 for i in range(3)],
                        "isr_nodes": [(t + p + i) % 6 for i in range(3)],
                        "offline_replicas": [],
                    }
                    for p in range(partitions)
                ],
                "topic_authorized_operations": -2147483648,
            }
            for t in range(topics)
        ],
        "error_code": 0,
    }
    resp = codecs.response_from_dict(
        {"header": {"correlation_id": CORRELATION_ID}, "body": body},
        api_key=METADATA,
        api_version=version,
    )
    return bytes(codecs.encode_response(resp)), version


def fetch_response_frame(partitions: int = 50, records_size: int = 64 * 1024) -> tuple[bytes, int]:
    version = codecs.APIS[FETCH].versions.hi
    payload = bytes(range(256)) * (records_size // 256)
    body = {
        "throttle_time_ms": 0,
        "error_code": 0,
        "session_id": 0,
        "responses": [
            {
                "topic_id": str(uuid.UUID(int=0xABCDEF)),
                "partitions": [
                    {
                        "partition_index": p,
                        "error_code": 0,
                        "high_watermark": 1_000_000 + p,
                        "last_stable_offset": 1_000_000 + p,
                        "log_start_offset": 0,
                        "aborted_transactions": [],
                        "preferred_read_replica": -1,
                        "records": payload,
                    }
                    for p in range(partitions)
                ],
            }
        ],
        "node_endpoints": [],
    }
    resp = codecs.response_from_dict(
        {"header": {"correlation_id": CORRELATION_ID}, "body": body},
        api_key=FETCH,
        api_version=version,
    )
    return bytes(codecs.encode_response(resp)), version


# -- the two sides --------------------------------------------------------------------


def ours_header(frame: bytes) -> Callable[[], Any]:
    decode = codecs.decode_request

    def run() -> Any:
        return decode(frame).header

    return run


def kio_header(frame: bytes) -> Callable[[], Any]:
    read = entity_reader(KioRequestHeaderV2)

    def run() -> Any:
        return read(frame, 0)[0]

    return run


def ours_decode(frame: bytes, api_key: int, version: int) -> Callable[[], Any]:
    decode = codecs.decode_response

    def run() -> Any:
        return decode(frame, api_key, version).body

    return run


def kio_decode(frame: bytes, api_key: int, version: int) -> Callable[[], Any]:
    read_header = entity_reader(KioResponseHeaderV1)
    read_body = entity_reader(load_response_schema(api_key, version))

    def run() -> Any:
        header, size = read_header(frame, 0)
        body, _ = read_body(frame, size)
        return header, body

    return run


def _read_partitions(topics: Any) -> int:
    leaders = 0
    for topic in topics:
        for partition in topic.partitions:
            leaders += partition.leader_id
    return leaders


def ours_decode_read(frame: bytes, api_key: int, version: int) -> Callable[[], Any]:
    decode = codecs.decode_response

    def run() -> Any:
        return _read_partitions(decode(frame, api_key, version).body.topics)

    return run


def kio_decode_read(frame: bytes, api_key: int, version: int) -> Callable[[], Any]:
    decode = kio_decode(frame, api_key, version)

    def run() -> Any:
        return _read_partitions(decode()[1].topics)

    assert run() == ours_decode_read(frame, api_key, version)()
    return run


def _built(value: Any) -> Any:
    """``value`` with every array a tuple of records, as in a message made in code (a
    decoded body's undecoded arrays, ``FlatRecords``, would be written back as bytes)."""
    if isinstance(value, codecs.FlatRecords):
        return tuple(_built(item) for item in value.records())
    if isinstance(value, codecs.Record):
        return value._make(_built(item) for item in value)
    if type(value) is tuple:
        return tuple(_built(item) for item in value)
    return value


def ours_encode(frame: bytes, api_key: int, version: int) -> Callable[[], Any]:
    body = _built(codecs.decode_response(frame, api_key, version).body)
    build = codecs.Response.build

    def run() -> Any:
        return build(api_key, version, CORRELATION_ID, body).encode()

    assert run() == frame  # a real, complete re-encode
    return run


def kio_encode(frame: bytes, api_key: int, version: int) -> Callable[[], Any]:
    header, body = kio_decode(frame, api_key, version)()
    write_header = entity_writer(KioResponseHeaderV1)
    write_body = entity_writer(load_response_schema(api_key, version))

    def run() -> Any:
        buf = io.BytesIO()
        write_header(buf, header)
        write_body(buf, body)
        return buf.getvalue()

    assert run() == frame
    return run


# -- timing ---------------------------------------------------------------------------


@dataclass
class Timing:
    best: float  # seconds per call
    median: float
    number: int
    repeat: int


def _calibrate(fn: Callable[[], Any], clock: Callable[[], float], target: float) -> int:
    """How many calls of ``fn`` take about ``target`` seconds."""
    fn()  # warm up (compiles our codec, fills kio's caches)
    number = 1
    while True:
        start = clock()
        for _ in range(number):
            fn()
        elapsed = clock() - start
        if elapsed >= target / 5 or number >= 1 << 24:
            break
        number *= 2
    return max(1, int(number * target / max(elapsed, 1e-9)))


def measure_pair(
    ours: Callable[[], Any], theirs: Callable[[], Any], repeat: int,
    clock: Callable[[], float] = time.perf_counter, target: float = 0.25,
) -> tuple[Timing, Timing]:
    """Time both sides, their repeats interleaved (ours, kio, ours, kio...), so that a
    busy neighbour on a shared machine slows both rather than one."""
    numbers = [_calibrate(fn, clock, target) for fn in (ours, theirs)]
    times: list[list[float]] = [[], []]
    for _ in range(repeat):
        for side, fn in enumerate((ours, theirs)):
            gc.collect()  # the same starting heap for every repeat (also with --no-gc)
            start = clock()
            for _ in range(numbers[side]):
                fn()
            times[side].append((clock() - start) / numbers[side])
    ours_t, theirs_t = (
        Timing(min(t), statistics.median(t), n, repeat) for t, n in zip(times, numbers, strict=True)
    )
    return ours_t, theirs_t


def fmt_time(seconds: float) -> str:
    if seconds < 1e-6:
        return f"{seconds * 1e9:.0f} ns"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.2f} µs"
    return f"{seconds * 1e3:.2f} ms"


@dataclass
class Row:
    case: str
    ours: Timing
    kio: Timing
    unit: str  # what one call is, for the rate column
    size: int  # frame bytes

    @property
    def speedup(self) -> float:
        return self.kio.best / self.ours.best


def machine() -> str:
    model = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (
        f"{model}, {os.cpu_count()} cores; Python {platform.python_version()} "
        f"({platform.python_implementation()}); kio {_kio_version()}; "
        f"Kafka specs {codecs.KAFKA_RELEASE}; {datetime.date.today().isoformat()}"
    )


def _kio_version() -> str:
    from kio import _version

    return _version.version


def settle_malloc() -> None:
    """Free one 16 MiB block, so that glibc keeps freed memory of up to that size.

    kio's Fetch decode copies 3.2 MB of records into 50 new ``bytes`` per call.  Whether
    glibc returns that memory to the system after each call (and takes page faults to
    get it back on the next) depends on its dynamic mmap threshold, that is on what the
    process freed before: kio's time was 110 µs in some runs and 720 µs in others.
    Freeing a large mapped block first raises the threshold, so every run times both
    sides with the allocator in its fast state.
    """
    block = bytearray(16 << 20)
    del block


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="3 repeats instead of 9")
    parser.add_argument("--profile", action="store_true", help="cProfile our side of each case")
    parser.add_argument(
        "--no-gc", action="store_true", help="disable the cyclic GC while timing (as timeit does)"
    )
    parser.add_argument(
        "--freeze", action="store_true",
        help="gc.freeze() after the set-up: collections then skip the objects of the "
             "modules imported (kio's schemas are ~40,000 of them, which every full "
             "collection walks, for both sides, in one process)",
    )
    parser.add_argument(
        "--cpu-time", action="store_true",
        help="time with the process's CPU clock (time.process_time): on a shared machine "
             "the time other processes hold the CPU is not counted",
    )
    args = parser.parse_args()
    repeat = 3 if args.quick else 9
    clock = time.process_time if args.cpu_time else time.perf_counter

    settle_malloc()
    produce = produce_request_frame()
    metadata, mv = metadata_response_frame()
    fetch, fv = fetch_response_frame()
    pv = codecs.APIS[PRODUCE].versions.hi

    # Each case's functions (and the decoded objects the encode cases hold) are made just
    # before the case is timed and dropped after it: a heap holding the other cases'
    # object trees would make every collection slower, for both sides.
    Factory = Callable[[], Callable[[], Any]]
    cases: list[tuple[str, str, int, Factory, Factory]] = [
        (
            f"Produce v{pv} request: header-only decode",
            "frames",
            len(produce),
            partial(ours_header, produce),
            partial(kio_header, produce),
        ),
        (
            f"Metadata v{mv} response (1,000 topics x 10 partitions): decode body",
            "frames",
            len(metadata),
            partial(ours_decode, metadata, METADATA, mv),
            partial(kio_decode, metadata, METADATA, mv),
        ),
        (
            f"Metadata v{mv} response: decode body, then read every partition",
            "frames",
            len(metadata),
            partial(ours_decode_read, metadata, METADATA, mv),
            partial(kio_decode_read, metadata, METADATA, mv),
        ),
        (
            f"Metadata v{mv} response (1,000 topics x 10 partitions): encode body",
            "frames",
            len(metadata),
            partial(ours_encode, metadata, METADATA, mv),
            partial(kio_encode, metadata, METADATA, mv),
        ),
        (
            f"Fetch v{fv} response (50 partitions x 64 KiB): decode body",
            "frames",
            len(fetch),
            partial(ours_decode, fetch, FETCH, fv),
            partial(kio_decode, fetch, FETCH, fv),
        ),
        (
            f"Fetch v{fv} response (50 partitions x 64 KiB): encode body",
            "frames",
            len(fetch),
            partial(ours_encode, fetch, FETCH, fv),
            partial(kio_encode, fetch, FETCH, fv),
        ),
    ]
    # Both sides must agree on what the header says.
    theirs = kio_header(produce)()
    ours = ours_header(produce)()
    assert (
        theirs.request_api_key,
        theirs.request_api_version,
        theirs.correlation_id,
        theirs.client_id,
    ) == (ours.api_key, ours.api_version, ours.correlation_id, ours.client_id)

    print(f"Machine: {machine()}")
    if args.no_gc:
        gc.disable()
    if args.freeze:
        gc.collect()
        gc.freeze()
    collector = "disabled" if args.no_gc else "enabled" + (", set-up frozen" if args.freeze else "")
    print(
        f"Best of {repeat} repeats (median in brackets), ours and kio interleaved; "
        f"cyclic GC {collector}; {'CPU time' if args.cpu_time else 'wall-clock time'}.\n"
    )
    print("| Case | Frame | Ours | kio | Ours/s | kio/s | Speed-up (kio time / ours) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    rows = []
    for name, unit, size, make_ours, make_kio in cases:
        row = Row(name, *measure_pair(make_ours(), make_kio(), repeat, clock), unit, size)
        rows.append(row)
        print(
            f"| {name} | {size:,} B "
            f"| {fmt_time(row.ours.best)} ({fmt_time(row.ours.median)}) "
            f"| {fmt_time(row.kio.best)} ({fmt_time(row.kio.median)}) "
            f"| {1 / row.ours.best:,.0f} | {1 / row.kio.best:,.0f} | {row.speedup:.2f}x |",
            flush=True,
        )

    header_rate = 1 / rows[0].ours.best
    print()
    print(
        f"Goal: header decode >= 1,000,000 frames/s: {header_rate:,.0f}/s "
        f"-> {'met' if header_rate >= 1e6 else 'NOT met'}"
    )
    for row in rows[1:]:
        print(
            f"Goal: >= 3x kio: {row.case}: {row.speedup:.2f}x "
            f"-> {'met' if row.speedup >= 3 else 'NOT met'}"
        )

    if args.profile:
        for name, _, _, make_ours, _ in cases:
            ours_fn = make_ours()
            print(f"\n== cProfile, ours: {name} ==")
            profiler = cProfile.Profile()
            deadline = time.perf_counter() + 1.0
            profiler.enable()
            while time.perf_counter() < deadline:
                ours_fn()
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
