"""Harness pieces for the reliability tests: proxies in threads and processes, raw sockets,
a log tap, and the proxy's memory and file descriptors as the kernel counts them.

Short runs by default (CI); ``GATEHOUSE_SOAK=1`` selects the long variants.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import trio

from gatehouse import codecs
from gatehouse.logs import FIELDS_ATTR, JsonFormatter, TextFormatter
from gatehouse.proxy.hooks import Observer, Policy
from tests.support.fakebroker import FakeBroker, Handler, frame_bytes, request
from tests.support.ports import LOCALHOST
from tests.support.proxythread import ProxyThread

GATEHOUSE = [sys.executable, "-m", "gatehouse.cli"]
SIZE = struct.Struct(">i")


def soak() -> bool:
    """Long variants (``GATEHOUSE_SOAK=1``); CI runs the short ones."""
    return os.environ.get("GATEHOUSE_SOAK") == "1"


def scaled(short: int, long: int) -> int:
    return long if soak() else short


# --- the kernel's view of a process ------------------------------------------------------------


def rss_bytes(pid: int | None = None) -> int:
    """Resident set size of ``pid`` (default: this process), from /proc."""
    status = Path(f"/proc/{pid or os.getpid()}/status").read_text()
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc status")


def fd_count(pid: int | None = None) -> int:
    return len(os.listdir(f"/proc/{pid or os.getpid()}/fd"))


def wait_until(predicate: Callable[[], bool], timeout: float, what: str,
               interval: float = 0.05) -> None:
    """Poll ``predicate`` (the state lives in another process or thread: nothing to await)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


# --- the proxy's log ----------------------------------------------------------------------------


class LogTap(logging.Handler):
    """Every record of the ``gatehouse`` loggers, at DEBUG, kept for assertions.

    Attached to the ``gatehouse`` logger itself so it sees records even when an earlier
    test called ``setup_logging`` (which stops propagation to the root logger).
    """

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self._lock_records = threading.Lock()
        self._logger = logging.getLogger("gatehouse")
        self._old_level = self._logger.level

    def emit(self, record: logging.LogRecord) -> None:
        with self._lock_records:
            self.records.append(record)

    def __enter__(self) -> LogTap:
        self._logger.addHandler(self)
        self._logger.setLevel(logging.DEBUG)
        return self

    def __exit__(self, *exc: object) -> None:
        self._logger.removeHandler(self)
        self._logger.setLevel(self._old_level)

    def snapshot(self) -> list[logging.LogRecord]:
        with self._lock_records:
            return list(self.records)

    def about(self, client: str, min_level: int = logging.INFO) -> list[logging.LogRecord]:
        """Records at ``min_level`` or above that name ``client`` (host:port)."""
        return [r for r in self.snapshot() if r.levelno >= min_level
                and (getattr(r, FIELDS_ATTR, None) or {}).get("client") == client]

    def about_latest(self, client: str, min_level: int = logging.INFO) -> list[logging.LogRecord]:
        """Like ``about``, for the newest connection from ``client`` only: over a long run
        the kernel hands an ephemeral port out again, so an address can name an earlier,
        long-closed connection too (the proxy numbers its connections in order)."""
        every = self.about(client, logging.DEBUG)
        if not every:
            return []
        newest = max(fields(r)["conn"] for r in every)
        return [r for r in every if r.levelno >= min_level and fields(r)["conn"] == newest]

    def text(self) -> str:
        """Every record as the proxy would print it, in text and in JSON."""
        text, jsonl = TextFormatter(), JsonFormatter()
        return "\n".join(f"{text.format(r)}\n{jsonl.format(r)}" for r in self.snapshot())


def fields(record: logging.LogRecord) -> dict[str, Any]:
    return dict(getattr(record, FIELDS_ATTR, None) or {})


# --- a proxy in a thread, with a config of our choosing ------------------------------------------


class ProxyRunner(ProxyThread):
    """A ProxyThread made from the whole config text (fixed ports: a restarted proxy comes
    back where its clients left it)."""

    def __init__(self, config_text: str, *, policy: Policy | None = None,
                 observers: Sequence[Observer] = ()) -> None:
        super().__init__(config_text=config_text, policy=policy, observers=observers)


# --- a fake broker on a real socket, in a thread -------------------------------------------------


def _discovery_answer(req: codecs.Request) -> Any:
    """ApiVersions without Metadata: the proxy's start-up discovery stops there."""
    from tests.support.fakebroker import response_body

    return response_body(18, req.api_version, api_keys=[])


class FakeBrokerServer:
    """``FakeBroker`` on 127.0.0.1 (trio in a thread): every frame it received is kept."""

    def __init__(self, handler: Handler, ssl_context: ssl.SSLContext | None = None) -> None:
        self.handler = handler
        self.ssl_context = ssl_context
        self.received: list[bytes] = []
        self.port = 0
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._cancel: trio.CancelScope | None = None
        self._thread = threading.Thread(target=lambda: trio.run(self._main), daemon=True)

    def _answer(self, req: codecs.Request) -> Any:
        if req.api_key == 18 and req.known:
            return _discovery_answer(req)
        return self.handler(req)

    async def _main(self) -> None:
        async def serve(socket_stream: trio.SocketStream) -> None:
            stream: trio.abc.Stream = socket_stream
            if self.ssl_context is not None:
                stream = trio.SSLStream(socket_stream, self.ssl_context, server_side=True)
            broker = FakeBroker(stream, self._answer)
            broker.received = self.received  # one list for all connections
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await broker.serve()
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await stream.aclose()

        with trio.CancelScope() as self._cancel:
            listeners = await trio.open_tcp_listeners(0, host=LOCALHOST)
            self.port = listeners[0].socket.getsockname()[1]
            self._token = trio.lowlevel.current_trio_token()
            self._ready.set()
            await trio.serve_listeners(serve, listeners)

    @property
    def address(self) -> str:
        return f"{LOCALHOST}:{self.port}"

    def __enter__(self) -> FakeBrokerServer:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._cancel is not None and self._token is not None:
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(self._cancel.cancel, trio_token=self._token)
        self._thread.join(10)


# --- raw Kafka frames over plain sockets ----------------------------------------------------------


def api_versions_request(correlation_id: int, client_id: str = "raw") -> bytes:
    return frame_bytes(request(18, 3, correlation_id, client_id=client_id,
                               client_software_name="raw-socket",
                               client_software_version="1.0").encode())


def connect(port: int, timeout: float = 10.0) -> socket.socket:
    sock = socket.create_connection((LOCALHOST, port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def local_address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"{host}:{port}"


def read_frame(sock: socket.socket) -> bytes | None:
    """One response frame (without its size prefix), or None at end of stream."""
    head = read_exactly(sock, 4)
    if head is None:
        return None
    (size,) = SIZE.unpack(head)
    return read_exactly(sock, size)


def read_exactly(sock: socket.socket, n: int) -> bytes | None:
    parts, need = [], n
    while need:
        try:
            chunk = sock.recv(min(need, 1 << 20))
        except ConnectionResetError:
            return None
        if not chunk:
            return None
        parts.append(chunk)
        need -= len(chunk)
    return b"".join(parts)


def wait_closed(sock: socket.socket, timeout: float) -> float:
    """Seconds until the peer closes ``sock`` (reading and dropping whatever comes)."""
    started = time.monotonic()
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(f"the proxy kept the connection open for {timeout}s") from None
    return time.monotonic() - started


# --- `gatehouse run` as users run it --------------------------------------------------------------


class GatehouseProcess:
    """``gatehouse run --config <file>`` in a subprocess; stderr (the log) goes to a file."""

    def __init__(self, config: Path, port: int, log: Path) -> None:
        self.config = config
        self.port = port
        self.log = log
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self) -> GatehouseProcess:
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                [*GATEHOUSE, "run", "--config", str(self.config)], stdin=subprocess.DEVNULL,
                stdout=log, stderr=log, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 30
        while True:
            self.check_alive()
            with contextlib.suppress(OSError):
                socket.create_connection((LOCALHOST, self.port), timeout=0.5).close()
                return self
            if time.monotonic() > deadline:
                raise AssertionError(f"gatehouse not listening on {self.port}:\n{self.log_text()}")
            time.sleep(0.05)

    def check_alive(self) -> None:
        assert self.process is not None
        code = self.process.poll()
        assert code is None, f"gatehouse exited with {code}:\n{self.log_text()[-4000:]}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def signal(self, signum: int) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    def stop(self) -> int:
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                raise AssertionError("gatehouse did not stop on SIGTERM") from None
        return self.process.returncode

    def __enter__(self) -> GatehouseProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def scrape(port: int) -> str:
    """The proxy's /metrics page."""
    with socket.create_connection((LOCALHOST, port), timeout=10) as sock:
        sock.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data.decode(errors="replace")


def metric_value(page: str, line_prefix: str) -> float:
    for line in page.splitlines():
        if line.startswith(line_prefix + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@contextlib.contextmanager
def background(fn: Callable[[threading.Event], None]) -> Iterator[threading.Event]:
    """Run ``fn(stop)`` in a thread until the block ends; its exception fails the test."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn(stop)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield stop
    finally:
        stop.set()
        thread.join(120)
    if errors:
        raise errors[0]


class Traffic:
    """A well-behaved producer and consumer (librdkafka) running through the proxy.

    ``wait_progress(n)`` waits until both have moved ``n`` more messages: the proof that
    other connections keep working while an attack is under way.
    """

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.delivered = 0
        self.consumed = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._produce, daemon=True),
                         threading.Thread(target=self._consume, daemon=True)]

    def _produce(self) -> None:
        import confluent_kafka as ck

        producer = ck.Producer({"bootstrap.servers": self.bootstrap, "acks": "all",
                                "linger.ms": 0, "client.id": "well-behaved", "log_level": 3})

        def on_delivery(err: Any, msg: Any) -> None:
            if err is not None:
                self.errors.append(f"delivery: {err}")
            else:
                self.delivered += 1

        i = 0
        while not self._stop.is_set():
            producer.produce(self.topic, value=f"v{i}".encode(), on_delivery=on_delivery)
            i += 1
            producer.poll(0.01)
        producer.flush(30)

    def _consume(self) -> None:
        import confluent_kafka as ck

        consumer = ck.Consumer({"bootstrap.servers": self.bootstrap, "group.id": self.topic,
                                "auto.offset.reset": "earliest", "client.id": "well-behaved",
                                "fetch.wait.max.ms": 100, "log_level": 3})
        consumer.subscribe([self.topic])
        try:
            while not self._stop.is_set():
                msg = consumer.poll(0.1)
                if msg is None:
                    continue
                if msg.error() is not None:
                    self.errors.append(f"consume: {msg.error()}")
                else:
                    self.consumed += 1
        finally:
            consumer.close()

    def wait_progress(self, n: int = 20, timeout: float = 30.0) -> None:
        delivered, consumed = self.delivered, self.consumed
        wait_until(lambda: self.delivered >= delivered + n and self.consumed >= consumed + n,
                   timeout, f"{n} messages produced and consumed by the well-behaved client "
                   f"(now {self.delivered - delivered} and {self.consumed - consumed})")
        assert self.errors == []

    def __enter__(self) -> Traffic:
        for thread in self._threads:
            thread.start()
        self.wait_progress(5, timeout=60)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)
