"""Coverage-guided fuzzing of the frame splitter and the request/response codecs (atheris).

    python -m tests.reliability.fuzz_codec CORPUS_DIR [-max_total_time=30] [libFuzzer flags]

An input is a mode byte, then bytes as they come off a socket:

    0x00 <request frames, size-prefixed>
    0x01 <api_key int16> <api_version int16> <response frames, size-prefixed>

The splitter gets the bytes in chunks whose sizes come from the input's length; every frame
is decoded (header, then body), turned into a plain dict and built again.  The codec may
refuse bytes only with its own ``ProtocolError``; any other exception is a crash.  The
hot path's byte readers read every Produce and Fetch frame too, in C and in Python, and
must agree (``check_readers``), and so must the C and Python decoders
(``check_decoders``).  A Produce request's records are read and checked as
``validate_records`` reads them, decompressed (``check_records``): a batch that does not
parse or decompress is a verdict, never an exception.
``check_input`` is also what tests/reliability/test_fuzz.py replays for each saved crash.
"""

from __future__ import annotations

import random
import struct
import sys
from typing import Any

from gatehouse import codecs
from gatehouse.codecs import fetch, produce, records
from gatehouse.codecs._native import speedups
from gatehouse.compression import DecompressionError, decompress
from gatehouse.rules.records import FieldCheck, RecordValidation, verdict
from tests.codec_strategies import exact

MAX_FRAME = 1 << 20
REQUEST, RESPONSE = 0, 1
_KEY_VERSION = struct.Struct(">hh")


def request_seed(wire: bytes) -> bytes:
    return bytes([REQUEST]) + wire


def response_seed(api_key: int, api_version: int, wire: bytes) -> bytes:
    return bytes([RESPONSE]) + _KEY_VERSION.pack(api_key, api_version) + wire


def _frames(stream: bytes) -> list[bytes]:
    """Split ``stream`` in input-determined chunks; the frames must be the stream itself."""
    reader = codecs.FrameReader(MAX_FRAME)
    chunks = random.Random(len(stream)).choices([1, 2, 3, 5, 64, 4096], k=len(stream) + 1)
    frames: list[bytes] = []
    pos = 0
    try:
        for size in chunks:
            if pos >= len(stream):
                break
            reader.feed(stream[pos:pos + size])
            pos += size
            while (wire := reader.next_wire_frame()) is not None:
                frames.append(wire)
    except codecs.ProtocolError:
        pass
    consumed = sum(len(f) for f in frames)
    assert b"".join(frames) == stream[:consumed], "the splitter changed the bytes"
    for wire in frames:
        assert struct.unpack(">i", wire[:4])[0] == len(wire) - 4
    return [wire[4:] for wire in frames]


def _python_or_none(read: Any, *args: Any) -> Any:
    """What a reader that raises on bytes it does not expect says, None for the raise
    (what its callers make of it)."""
    try:
        return read(*args)
    except (records.Uncounted, struct.error, IndexError, UnicodeDecodeError):
        return None


def check_readers(frame: bytes, api_key: int, api_version: int, request: bool) -> None:
    """The C readers of gatehouse/codecs/_speedups.c say what the Python readers say of
    ``frame`` (a request from its api key on, a response from its correlation id on), or
    leave it to them (NotImplemented)."""
    if speedups is None:
        return
    c: Any = NotImplemented  # stays so for frames no C reader reads
    python: Any = None
    if request and api_key == 0 and api_version >= produce.FIRST_VERSION:
        flexible, ids = (api_version >= produce.FLEXIBLE_SINCE,
                         api_version >= produce.TOPIC_IDS_SINCE)
        for count in (True, False):  # and with each name's place (topic renames)
            c_spans: list[tuple[int, int]] = []
            python_spans: list[tuple[int, int]] = []
            c = speedups.produce_request_topics(frame, flexible, ids, count, c_spans)
            python = produce._request_topics(frame, api_version, python_spans, count)
            assert c is NotImplemented or (c, c_spans) == (python, python_spans), \
                "C and Python Produce request readers differ"
        c = speedups.produce_request_topics(frame, flexible, ids)
        python = produce._request_topics(frame, api_version, None, True)
    elif not request and api_key == 0 and api_version >= produce.FIRST_VERSION:
        c_names: list[tuple[int, int, str]] = []
        python_names: list[tuple[int, int, str]] = []
        c = speedups.produce_response_scan(frame, api_version, c_names)
        python = produce._response_scan(frame, api_version, python_names)
        assert c is NotImplemented or (c, c_names) == (python, python_names), \
            "C and Python Produce answer readers differ"
        c = speedups.produce_response_scan(frame, api_version)
        python = produce._response_scan(frame, api_version, None)
    elif not request and api_key == 1 and api_version >= fetch.FIRST_VERSION:
        view = memoryview(frame)
        for count in (True, False):
            c = speedups.fetch_walk(frame, api_version >= fetch.TOPIC_IDS_SINCE, count)
            python = _python_or_none(fetch._walk_python, view, api_version, count)
            assert c is NotImplemented or c == python, "C and Python Fetch walks differ"
        return
    assert c is NotImplemented or c == python, "C and Python readers differ"
    for start, end in ((0, len(frame)), (len(frame) // 3, len(frame))):
        c = speedups.count_records(frame, start, end)
        assert c == _python_or_none(records.count_records, memoryview(frame), start, end), \
            "C and Python record counts differ"


def check_decoders(msg: codecs.Request | codecs.Response) -> None:
    """The C decoder (gatehouse/codecs/_decoder.c) reads the body as the generated Python
    decoder does, or refuses (None) what that one refuses."""
    codec = msg._codec()
    if codec.decode_native is None or msg._frame is None:
        return
    view = memoryview(msg._frame)[msg._body_offset:]
    c = codec.decode_native(view)
    try:
        body, end, spans = codec.decode(view)
    except codecs.ProtocolError:
        assert c is None, "the C decoder reads a body the Python decoder refuses"
        return
    assert c is not None and (exact(c[0]), *c[1:]) == (exact(body), end, spans), \
        "the C and Python decoders differ"


# Every record read and every check run: key UTF-8, value JSON, a header looked for.
_VALIDATION = RecordValidation(key=FieldCheck(format="utf8"), value=FieldCheck(format="json"),
                               headers=("trace-id",), max_decompressed_bytes=MAX_FRAME)


def check_records(req: codecs.Request) -> None:
    """Each partition's records judged as ``validate_records`` judges them."""
    for topic in req.body.topic_data:
        for partition in topic.partition_data:
            verdict(_VALIDATION, partition.records, decompress, (DecompressionError,))


def _request(frame: bytes) -> None:
    if len(frame) >= 4:
        api_key, api_version = _KEY_VERSION.unpack_from(frame)
        check_readers(frame, api_key, api_version, True)
    try:
        req = codecs.decode_request(frame)
        if not req.known:
            return
        check_decoders(req)
        req.body  # noqa: B018 - the full decode is the test
    except codecs.ProtocolError:
        return
    if req.api_key == 0:
        check_records(req)
    assert bytes(codecs.encode_request(req)) == frame, "an unchanged request re-encodes as is"
    plain = codecs.to_dict(req)
    again = codecs.request_from_dict(plain)
    rebuilt = bytes(codecs.encode_request(again))
    assert repr(codecs.to_dict(codecs.decode_request(rebuilt))) == repr(plain), "dict round trip"


def _response(frame: bytes, api_key: int, api_version: int) -> None:
    check_readers(frame, api_key, api_version, False)
    try:
        resp = codecs.decode_response(frame, api_key, api_version)
        if not resp.known:
            return
        check_decoders(resp)
        resp.body  # noqa: B018
    except codecs.ProtocolError:
        return
    assert bytes(codecs.encode_response(resp)) == frame, "an unchanged response re-encodes as is"
    plain = codecs.to_dict(resp)
    again = codecs.response_from_dict(plain, api_key=api_key, api_version=resp.api_version)
    rebuilt = bytes(codecs.encode_response(again))
    back = codecs.decode_response(rebuilt, api_key, resp.api_version)
    assert repr(codecs.to_dict(back)) == repr(plain), "dict round trip"  # NaN-safe


def check_input(data: bytes) -> None:
    if not data:
        return
    mode = data[0] & 1
    if mode == REQUEST:
        for frame in _frames(data[1:]):
            _request(frame)
    elif len(data) >= 5:
        api_key, api_version = _KEY_VERSION.unpack_from(data, 1)
        for frame in _frames(data[5:]):
            _response(frame, api_key, api_version)


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One blind mutation (the fallback where atheris has no wheel): flip, cut, splice."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        choice = rng.randrange(4)
        if choice == 0 and out:
            out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
        elif choice == 1 and out:
            del out[rng.randrange(len(out)):]
        elif choice == 2:
            at = rng.randrange(len(out) + 1)
            out[at:at] = rng.choice([b"\x00", b"\xff", b"\x7f\xff\xff\xff", b"\x80"])
        elif out:
            at = rng.randrange(len(out))
            out[at:at + 4] = rng.randbytes(4)
    return bytes(out)


def _blind(argv: list[str]) -> None:
    """Same flags as libFuzzer's where they matter: CORPUS -max_total_time= -artifact_prefix=."""
    import hashlib
    import time
    from pathlib import Path

    flags = dict(a[1:].split("=", 1) for a in argv[1:] if a.startswith("-") and "=" in a)
    corpus = [p.read_bytes() for d in argv[1:] if not d.startswith("-")
              for p in sorted(Path(d).iterdir())]
    deadline = time.monotonic() + float(flags.get("max_total_time", 30))
    rng = random.Random(0)
    runs = 0
    while time.monotonic() < deadline:
        data = mutate(rng.choice(corpus), rng)
        runs += 1
        try:
            check_input(data)
        except Exception:
            name = flags.get("artifact_prefix", "") + "crash-" + hashlib.sha1(data).hexdigest()
            Path(name).write_bytes(data)
            raise
    print(f"Done {runs} runs (blind mutation, cov: n/a)", file=sys.stderr)


def main(argv: list[str]) -> None:
    try:
        import atheris
    except ImportError:
        _blind(argv)
        return
    instrument_ours(atheris)
    atheris.Setup(argv, check_input)
    atheris.Fuzz()


def instrument_ours(atheris: Any) -> None:
    """Coverage feedback from the project's own functions loaded so far (the codecs, the
    rules' readers): atheris.instrument_all also took the standard library's and the test
    tools' (15,000 functions against some 1,100), minutes of start-up on a 2-core host
    before the first input, and coverage signal from code the inputs never reach."""
    import gc
    import types

    ours = [obj for obj in gc.get_objects() if isinstance(obj, types.FunctionType)
            and (obj.__module__ or "").partition(".")[0] == "gatehouse"]
    for func in ours:
        atheris.instrument_func(func)
    print(f"INFO: instrumented {len(ours)} functions of gatehouse", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv)
