"""The global memory cap: many connections sending large frames to a broker that stopped
reading cost the proxy its byte budget, not one frame per connection (`gatehouse run` as
deployed; its peak RSS read from /proc)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from gatehouse import codecs
from tests.reliability.support import (
    FakeBrokerServer,
    GatehouseProcess,
    connect,
    metric_value,
    read_frame,
    rss_bytes,
    scrape,
    wait_until,
)
from tests.support.fakebroker import frame_bytes, request, response_body
from tests.support.ports import free_port

MiB = 2**20
CLIENTS = 16
FRAME = 16 * MiB  # 256 MiB in all: what the proxy would hold without the cap
BUDGET = 32 * MiB


def _peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc status")


def test_large_frames_to_a_stalled_broker_wait_for_the_shared_budget(tmp_path: Path) -> None:
    stalled = threading.Event()
    release = threading.Event()

    def handler(req: codecs.Request) -> Any:
        if req.api_key == 0:
            stalled.set()
            release.wait(120)  # the whole fake broker stops reading: a stalled broker
            return response_body(0, req.api_version)
        return None

    produce = frame_bytes(request(0, 9, 1, acks=1, timeout_ms=30_000, topic_data=[
        {"name": "big", "partition_data": [{"index": 0, "records": b"r" * FRAME}]}]).encode())
    with FakeBrokerServer(handler) as broker:
        port, metrics_port = free_port(), free_port()
        config = tmp_path / "gatehouse.yaml"
        config.write_text(
            f"listen: 127.0.0.1:{port}\nupstream: [{broker.address}]\n"
            f"brokers: {{start_port: 0}}\nmetrics: {{listen: 127.0.0.1:{metrics_port}}}\n"
            f"limits: {{max_buffered_request_bytes: {BUDGET}}}\nlog: {{level: WARNING}}\n")
        with GatehouseProcess(config, port, tmp_path / "gatehouse.log") as proxy:
            baseline = rss_bytes(proxy.pid)
            socks = [connect(port, timeout=60) for _ in range(CLIENTS)]
            senders = [threading.Thread(target=sock.sendall, args=(produce,), daemon=True)
                       for sock in socks]
            try:
                for sender in senders:
                    sender.start()
                assert stalled.wait(60), "no Produce reached the broker"
                # Every client that is not being carried waits for the budget.
                wait_until(lambda: metric_value(scrape(metrics_port),
                                                'gatehouse_buffer_waits_total{direction="request"}')
                           >= CLIENTS - BUDGET // FRAME - 1, 60, "the readers to wait")
                page = scrape(metrics_port)
                held = metric_value(page, 'gatehouse_buffered_bytes{direction="request"}')
                assert 0 < held <= BUDGET
                grown = _peak_rss(proxy.pid) - baseline
                assert grown < BUDGET + 48 * MiB, f"peak RSS grew by {grown / MiB:.0f} MiB"

                release.set()  # nothing was lost: every frame reaches the broker whole
                for sender in senders:
                    sender.join(120)
                for sock in socks:
                    answer = read_frame(sock)
                    assert answer is not None
                    assert codecs.decode_response(answer, 0, 9).body.responses == ()
                produced = [f for f in broker.received if len(f) == len(produce) - 4]
                assert len(produced) == CLIENTS
                wait_until(lambda: metric_value(
                    scrape(metrics_port), 'gatehouse_buffered_bytes{direction="request"}') == 0,
                    30, "the budget to be whole again")
            finally:
                release.set()
                for sock in socks:
                    sock.close()
            proxy.check_alive()

