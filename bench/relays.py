"""Gatehouse beside relays that read nothing or the least, same broker, same run: what the
event loop costs a proxy of small requests.

    python -m bench.relays [--records 300000] [--rounds 5] [--round-trips 3000]

The relays forward bytes as they come, no frame parsed, no address rewritten: a trio relay
(trio's SocketStream, a task per direction), a raw trio relay (trio's readiness waits
around ``os.read``/``os.write``, as Gatehouse's own streams do) and a blocking relay (an
OS thread per direction, ``recv_into`` then ``sendall``); and the blocking relay again
with the least a proxy's inspection does, in Python (frames split, each request's header
decoded and counted, its answer matched by correlation id).  The broker advertises each
relay's own port on a listener of its own (``KafkaCluster(relayed_listeners=...)``), so
clients stay on the relay after Metadata, as they stay on Gatehouse.  Prints, against direct:

- Kafka's ProducerPerformance / ConsumerPerformance with 1 KiB records (acks=all), the
  targets rotated each round: throughput ratios and each proxy's CPU ms per MB;
- a loop of 40 KB Produce requests (three partitions' batches of 13 records, acks=1),
  one in flight, as a Java producer's 1 KiB records make them: added p50, and each
  proxy's user and system CPU microseconds per round trip (/proc).

What it shows: the CPU a proxy spends on a small request and its answer besides the
system's own work (which the blocking relay nearly is), and how much of that is the
event loop's (the raw trio relay) rather than the inspection's (Gatehouse minus it), and
what the inspection costs without an event loop (the inspecting thread relay).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable

import trio

from bench.proxy import (
    bench_cluster,
    compare_throughput,
    receive_frame,
    rotated,
    start_gatehouse,
    user_system_seconds,
)
from gatehouse import codecs
from gatehouse.codecs.peek import produce_acks
from gatehouse.codecs.records import encode_batch
from gatehouse.embedded import free_port, wait_for_port

RELAY_READ = 256 * 1024
_SIZE = struct.Struct(">i")
_HEAD_BYTES = 1024  # enough of a frame for its header (and a Produce request's acks)


# -- the relays (each its own process: ``python -m bench.relays serve KIND PORT UPSTREAM``) --


def serve_trio_relay(port: int, upstream: int) -> None:
    async def pump(source: trio.SocketStream, sink: trio.SocketStream) -> None:
        while data := await source.receive_some(RELAY_READ):
            await sink.send_all(data)

    async def handle(client: trio.SocketStream) -> None:
        broker = await trio.open_tcp_stream("127.0.0.1", upstream)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pump, client, broker)
            nursery.start_soon(pump, broker, client)

    trio.run(trio.serve_tcp, handle, port)


def serve_raw_trio_relay(port: int, upstream: int) -> None:
    """trio's loop at its leanest: its readiness waits around the system's reads and
    writes, none of SocketStream's checkpoints."""
    async def pump(source: int, sink: int) -> None:
        while True:
            try:
                data = os.read(source, RELAY_READ)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(source)
                continue
            if not data:
                return
            view = memoryview(data)
            while view:
                try:
                    view = view[os.write(sink, view):]
                except BlockingIOError:
                    await trio.lowlevel.wait_writable(sink)

    async def handle(client: trio.SocketStream) -> None:
        broker = await trio.open_tcp_stream("127.0.0.1", upstream)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pump, client.socket.fileno(), broker.socket.fileno())
            nursery.start_soon(pump, broker.socket.fileno(), client.socket.fileno())

    trio.run(trio.serve_tcp, handle, port)


def serve_thread_relay(port: int, upstream: int) -> None:
    def pump(source: socket.socket, sink: socket.socket) -> None:
        buffer = bytearray(RELAY_READ)
        view = memoryview(buffer)
        while n := source.recv_into(buffer):
            sink.sendall(view[:n])
        sink.shutdown(socket.SHUT_WR)

    def serve(client: socket.socket, broker: socket.socket) -> None:
        threading.Thread(target=pump, args=(client, broker), daemon=True).start()
        pump(broker, client)

    _serve_blocking(port, upstream, serve)


def _serve_blocking(port: int, upstream: int,
                    serve: Callable[[socket.socket, socket.socket], None]) -> None:
    """Each client's connection and its own to the broker to ``serve``, in a thread."""
    server = socket.create_server(("127.0.0.1", port))
    while True:
        client, _ = server.accept()
        broker = socket.create_connection(("127.0.0.1", upstream))
        for sock in (client, broker):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=serve, args=(client, broker), daemon=True).start()


def serve_inspecting_thread_relay(port: int, upstream: int) -> None:
    """The blocking relay with the least a proxy's inspection does, in Python: frames
    split, each request's header decoded (gatehouse.codecs) and counted by API, version
    and client, its answer owed (unless acks=0) and matched by correlation id."""
    counts: Counter[tuple[object, ...]] = Counter()

    def frames(source: socket.socket, sink: socket.socket,
               each: Callable[[memoryview], None]) -> None:
        """Bytes from source to sink as they come, ``each`` called with every frame's
        bytes after its size (or its first ones in hand, at least _HEAD_BYTES, for a
        frame longer than that not yet all in: its rest then goes on as it comes)."""
        buffer = bytearray(RELAY_READ)
        view = memoryview(buffer)
        held = 0  # bytes in the buffer
        passing = 0  # bytes of a frame already seen, still to come
        while n := source.recv_into(view[held:]):
            held += n
            at = 0
            while at < held:
                if passing:
                    step = min(passing, held - at)
                    passing -= step
                    at += step
                    continue
                if held - at < 4:
                    break
                size = _SIZE.unpack_from(buffer, at)[0]
                in_hand = min(held - at - 4, size)
                if in_hand < min(size, _HEAD_BYTES):
                    break
                each(view[at + 4:at + 4 + in_hand])
                passing = size - in_hand
                at += 4 + in_hand
            sink.sendall(view[:at])
            view[:held - at] = view[at:held]
            held -= at
        sink.shutdown(socket.SHUT_WR)

    def serve(client: socket.socket, broker: socket.socket) -> None:
        owed: deque[tuple[int, int]] = deque()

        def request(frame: memoryview) -> None:
            req = codecs.decode_request(frame)
            header = req.header
            counts[header.api_key, header.api_version, header.client_id] += 1
            if header.api_key != 0 or produce_acks(req) != 0:
                owed.append((header.correlation_id, header.api_key))

        def answer(frame: memoryview) -> None:
            correlation_id, api_key = owed.popleft()
            if _SIZE.unpack_from(frame)[0] != correlation_id:
                raise RuntimeError("an answer out of order")
            counts["answers", api_key] += 1

        threading.Thread(target=frames, args=(client, broker, request), daemon=True).start()
        frames(broker, client, answer)

    _serve_blocking(port, upstream, serve)


RELAYS = {"trio-relay": serve_trio_relay, "raw-trio-relay": serve_raw_trio_relay,
          "thread-relay": serve_thread_relay,
          "inspecting-thread-relay": serve_inspecting_thread_relay}


def start_relay(kind: str, port: int, upstream: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-m", "bench.relays", "serve", kind, str(port),
                             str(upstream)], stdin=subprocess.DEVNULL)
    wait_for_port("127.0.0.1", port, 30, proc)
    return proc


# -- the round-trip loop ------------------------------------------------------------------


def produce_frame(topic: str, partitions: int = 3, records: int = 13) -> bytes:
    """One Produce v9 request as a Java producer's 1 KiB records make them (~40 KB)."""
    batch = encode_batch([(int(time.time() * 1000), None, bytes(1000))] * records)
    frame = bytes(codecs.request_from_dict({
        "header": {"api_key": 0, "api_version": 9, "correlation_id": 1, "client_id": "bench"},
        "body": {"transactional_id": None, "acks": 1, "timeout_ms": 5000, "topic_data": [
            {"name": topic, "partition_data": [{"index": p, "records": batch}
                                               for p in range(partitions)]}]},
    }).encode())
    return struct.pack(">i", len(frame)) + frame


def round_trips(bootstrap: str, frame: bytes, n: int) -> list[float]:
    """Seconds per request and its answer, one in flight."""
    host, port = bootstrap.rsplit(":", 1)
    out = []
    with socket.create_connection((host, int(port))) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(n):
            start = time.perf_counter()
            sock.sendall(frame)
            answer = receive_frame(sock)
            out.append(time.perf_counter() - start)
            errors = {part.error_code for topic in codecs.decode_response(answer, 0, 9).body
                      .responses for part in topic.partition_responses}
            if errors != {0}:
                raise RuntimeError(f"Produce request answered with errors {errors}")
    return out


def main() -> None:
    if sys.argv[1:2] == ["serve"]:
        kind, port, upstream = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
        RELAYS[kind](port, upstream)
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=300_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--round-trips", type=int, default=3000)
    args = parser.parse_args()
    os.environ.setdefault("GATEHOUSE_KAFKA_VERSION", "4.4.0")
    ports = {kind: (free_port(), free_port()) for kind in RELAYS}  # broker's, relay's
    listeners = {f"RELAY{i}": pair for i, pair in enumerate(ports.values())}
    with bench_cluster(relayed_listeners=listeners) as kafka:
        gate, gate_addr = start_gatehouse(kafka.bootstrap)
        procs = {"gatehouse": gate}
        targets = {"direct": kafka.bootstrap, "gatehouse": gate_addr}
        try:
            for kind, (broker_port, port) in ports.items():
                procs[kind] = start_relay(kind, port, broker_port)
                targets[kind] = f"127.0.0.1:{port}"
            cpu: dict[str, dict[str, list[float]]] = {}
            results = compare_throughput(kafka, targets, records=args.records,
                                         rounds=args.rounds, cpu=cpu,
                                         pids={k: p.pid for k, p in procs.items()})
            kafka.create_topic("bench-round-trips", partitions=3)
            frame = produce_frame("bench-round-trips")
            trips: dict[str, list[float]] = {name: [] for name in targets}
            spent = {name: [0.0, 0.0] for name in procs}
            for addr in targets.values():  # warmed: first answers are slower
                round_trips(addr, frame, 200)
            for r in range(len(targets)):
                for name, addr in rotated(list(targets.items()), r):
                    before = user_system_seconds(procs[name].pid) if name in procs else None
                    trips[name] += round_trips(addr, frame, args.round_trips)
                    if before is not None:
                        after = user_system_seconds(procs[name].pid)
                        spent[name][0] += after[0] - before[0]
                        spent[name][1] += after[1] - before[1]
        finally:
            for proc in procs.values():
                proc.terminate()
                proc.wait(15)
    print(f"{'metric':<22}{'direct':>10}" + "".join(f"{n:>36}" for n in procs))
    for metric, direct_values in results["direct"].items():
        direct = statistics.median(direct_values)
        cells = []
        for name in procs:
            values = results[name][metric]
            cells.append(f"{statistics.median(values) / direct:.3f} "
                         f"({min(values) / direct:.2f}-{max(values) / direct:.2f}) "
                         f"{1000 * statistics.median(cpu[name][metric]):.2f}ms/MB")
        print(f"{metric:<22}{direct:>10.1f}" + "".join(f"{c:>36}" for c in cells))
    direct_p50 = statistics.median(trips["direct"])
    print(f"40 KB Produce round trip, one in flight ({len(targets) * args.round_trips} each): "
          f"direct p50 {1000 * direct_p50:.3f} ms")
    for name in procs:
        count = len(trips[name])
        print(f"  {name:<24} added p50 {1000 * (statistics.median(trips[name]) - direct_p50):+.3f}"
              f" ms, CPU per round trip: user {1e6 * spent[name][0] / count:.0f} us, "
              f"system {1e6 * spent[name][1] / count:.0f} us")


if __name__ == "__main__":
    main()
