"""``workers: N``: one `gatehouse run` starts N proxy processes and supervises them.

One proxy process is one event loop on one core.  With ``workers`` above 1 the process
started by `gatehouse run` proxies nothing itself: it starts N workers (`gatehouse run`
again, with a hidden ``--worker-fd``) that listen on the same ports (SO_REUSEPORT: the
kernel spreads new connections over them), and it

- restarts a worker that dies (backoff 1 s doubling to 30 s, reset after a minute up),
  and stops everything with exit status 1 when a worker cannot start at all (a port in
  use, a file it cannot read: the worker's own log line says which);
- serves the config's metrics address for all of them: /metrics is every worker's
  exposition with a ``worker`` label (gatehouse.metrics.merge) plus its own
  ``gatehouse_workers`` and ``gatehouse_worker_restarts_total``; /readyz is ready when
  every worker is;
- passes SIGHUP on (each worker reloads its rules and certificates); on SIGTERM or SIGINT
  it tells each worker to drain, and waits for them; a second signal is passed on, so the
  workers stop at once.

Each worker holds one end of a socket pair with the supervisor: it reports its metrics
port and its readiness on it, and drains when told to or when the pair closes (the
supervisor is gone, even killed: no worker outlives it).  Workers run in their own
session, so a terminal's Ctrl-C reaches the supervisor alone and is not counted twice.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Final

import trio

from gatehouse.logs import log_event
from gatehouse.proxy import live
from gatehouse.proxy.config import ProxyConfig
from gatehouse.proxy.hostcounts import HostTable
from gatehouse.proxy.sharedquotas import SharedTable
from gatehouse.rules import cursors

logger = logging.getLogger("gatehouse.workers")

FIRST_BACKOFF: Final = 1.0
MAX_BACKOFF: Final = 30.0
STABLE_SECONDS: Final = 60.0  # up this long, a worker's next restart waits FIRST_BACKOFF again
SCRAPE_TIMEOUT: Final = 5.0
STOP: Final = b"stop\n"
CURSOR_KEY_ENV: Final = "GATEHOUSE_WORKER_CURSOR_KEY"  # hex; the supervisor's to its workers
_GONE: Final = (trio.BrokenResourceError, trio.ClosedResourceError)  # the other end closed


# -- the worker's end ---------------------------------------------------------------------

def take_cursor_key() -> None:
    """In a worker: seal cursors with the supervisor's key (``_run`` passes it), and
    leave it out of the environment of anything the worker starts."""
    key = os.environ.pop(CURSOR_KEY_ENV, None)
    if key:
        cursors.use_key(bytes.fromhex(key))


class SupervisorLink:
    """A worker's end of its socket pair with the supervisor."""

    def __init__(self, fd: int) -> None:
        os.set_inheritable(fd, False)
        sock = trio.socket.from_stdlib_socket(socket.socket(fileno=fd))
        self.stream = trio.SocketStream(sock)

    async def report(self, **fields: Any) -> None:
        """One JSON line to the supervisor (a supervisor already gone is not an error)."""
        with contextlib.suppress(*_GONE):
            await self.stream.send_all(json.dumps(fields).encode() + b"\n")

    async def watch(self, drain: Any) -> None:
        """Call ``drain()`` when the supervisor says stop or is gone."""
        try:
            while (data := await self.stream.receive_some(4096)) and STOP not in data:
                pass
            reason = "told to stop" if data else "supervisor gone"
        except _GONE:
            reason = "supervisor gone"
        log_event(logger, logging.INFO, "worker stopping", reason=reason)
        drain()


# -- the supervisor -----------------------------------------------------------------------

@dataclass
class _Worker:
    index: int
    process: trio.Process | None = None
    link: trio.SocketStream | None = None
    metrics_port: int | None = None
    running: bool = False  # started and not yet reaped
    ready: bool = False
    was_ready: bool = False  # ready at least once: a later death is a crash to restart


class Supervisor:
    """Starts, watches and stops ``config.workers`` worker processes."""

    def __init__(self, config: ProxyConfig, worker_args: Sequence[str]) -> None:
        """``worker_args``: `gatehouse run` arguments for a worker (the config, the log
        options), to which each worker's own are added."""
        self.config = config
        self.worker_args = list(worker_args)
        self.workers = [_Worker(index) for index in range(config.workers)]
        # Quota buckets every worker spends from (rules' quotas are the whole proxy's);
        # kept open here so that a restarted worker finds the same table.
        self.quota_table = SharedTable.create() if SharedTable.supported() else None
        # Connections per client address, counted over all workers (each its own column,
        # zeroed before a worker is started again).
        self.host_table = (HostTable.create(config.workers)
                           if HostTable.supported() and config.workers > 1 else None)
        self.stopping = trio.Event()
        self.failure: str | None = None
        self.restarts = 0

    async def serve(self) -> int:
        """Run until stopped; the exit status (1: a worker could not start)."""
        log_event(logger, logging.INFO, "starting workers", workers=len(self.workers),
                  listen=str(self.config.listen))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._handle_signals)
            if self.config.metrics_listen is not None:
                from gatehouse.metrics import ConnectionsEndpoint, serve_endpoints

                await nursery.start(partial(
                    serve_endpoints, self.config.metrics_listen, self.render_metrics,
                    self.readiness, connections=ConnectionsEndpoint(
                        self.connections, self.config.metrics_connections)))
            async with trio.open_nursery() as keepers:
                for worker in self.workers:
                    keepers.start_soon(self._keep, worker)
            nursery.cancel_scope.cancel()
        log_event(logger, logging.INFO, "workers stopped", restarts=self.restarts)
        return 1 if self.failure is not None else 0

    async def stop(self) -> None:
        """Every worker drains (limits.shutdown_grace) and exits; none is restarted."""
        self.stopping.set()
        for worker in self.workers:
            if worker.link is not None:
                with contextlib.suppress(*_GONE):
                    await worker.link.send_all(STOP)

    def signal_workers(self, signum: int) -> None:
        for worker in self.workers:
            if worker.process is not None and worker.running:
                worker.process.send_signal(signum)

    async def _handle_signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            async for signum in signals:
                if signum == signal.SIGHUP:
                    # Only to workers that are ready: a worker still starting has no
                    # handler yet (SIGHUP would end it), and reads the files as it starts.
                    for worker in self.workers:
                        if worker.ready and worker.process is not None:
                            worker.process.send_signal(signum)
                elif self.stopping.is_set():
                    # The second: the workers, already draining, stop at once.
                    self.signal_workers(signum)
                else:
                    log_event(logger, logging.INFO, "shutting down: workers draining",
                              signal=signal.Signals(signum).name,
                              grace_seconds=self.config.limits.shutdown_grace)
                    await self.stop()

    async def _keep(self, worker: _Worker) -> None:
        """Run one worker, again after each death, until the supervisor stops."""
        backoff = FIRST_BACKOFF
        while True:
            started = trio.current_time()
            status = await self._run(worker)
            if self.stopping.is_set():
                log_event(logger, logging.INFO if status == 0 else logging.WARNING,
                          "worker stopped", worker=worker.index, status=status)
                return
            if not worker.was_ready:
                self.failure = f"worker {worker.index} exited with status {status} at start"
                log_event(logger, logging.ERROR, "worker failed to start: stopping",
                          worker=worker.index, status=status)
                await self.stop()
                return
            if trio.current_time() - started >= STABLE_SECONDS:
                backoff = FIRST_BACKOFF
            self.restarts += 1
            log_event(logger, logging.ERROR, "worker exited: restarting", worker=worker.index,
                      status=status, restart_in_seconds=backoff)
            with trio.move_on_after(backoff):
                await self.stopping.wait()
            if self.stopping.is_set():
                return
            backoff = min(backoff * 2, MAX_BACKOFF)

    async def _run(self, worker: _Worker) -> int:
        """Start the worker, follow its reports until it exits; its exit status."""
        ours, theirs = socket.socketpair()
        command = [sys.executable, "-m", "gatehouse.cli", "run", *self.worker_args,
                   "--worker-fd", str(theirs.fileno()),
                   "--worker-index", str(worker.index),
                   "--worker-count", str(len(self.workers))]
        if self.config.metrics_listen is not None:
            command += ["--metrics-listen", "127.0.0.1:0"]
        passed = [theirs.fileno()]
        if self.quota_table is not None:
            command += ["--quota-fd", str(self.quota_table.fd)]
            passed.append(self.quota_table.fd)
        if self.host_table is not None:
            self.host_table.forget(worker.index)  # what a dead one held is closed
            command += ["--connections-fd", str(self.host_table.fd)]
            passed.append(self.host_table.fd)
        try:
            # One key seals every worker's cursors (rules.cursors): a client that
            # reconnects to another worker goes on with its listing.  Not on the command
            # line, which every user of the host can read.
            env = {**os.environ, CURSOR_KEY_ENV: cursors.current_key().hex()}
            process = await trio.lowlevel.open_process(
                command, stdin=subprocess.DEVNULL, pass_fds=tuple(passed),
                start_new_session=True, env=env)
        finally:
            theirs.close()
        worker.process, worker.running = process, True
        worker.link = link = trio.SocketStream(trio.socket.from_stdlib_socket(ours))
        log_event(logger, logging.INFO, "worker started", worker=worker.index,
                  pid=process.pid)
        try:
            if self.stopping.is_set():  # stopped while it was starting
                await self.stop()
            await self._follow(worker, link)
            return await process.wait()
        finally:
            worker.link, worker.ready, worker.metrics_port = None, False, None
            with trio.CancelScope(shield=True):
                if process.returncode is None:  # the supervisor itself is failing
                    process.kill()
                    await process.wait()
                worker.running = False
                await link.aclose()

    async def _follow(self, worker: _Worker, link: trio.SocketStream) -> None:
        """Read the worker's JSON lines until its end closes (it exited)."""
        pending = b""
        try:
            while data := await link.receive_some(4096):
                pending += data
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    report = json.loads(line)
                    if "metrics_port" in report:
                        worker.metrics_port = int(report["metrics_port"])
                    if report.get("ready"):
                        worker.ready = worker.was_ready = True
                        log_event(logger, logging.INFO, "worker ready", worker=worker.index)
        except (*_GONE, ValueError):
            pass  # a broken line or a broken pair: the worker's exit is what counts

    # -- the endpoints: every worker's numbers as one ----------------------------------

    def render_metrics(self) -> bytes:
        """All workers' /metrics, each sample labelled ``worker`` (runs in a thread)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        from gatehouse.metrics.merge import merge_by_worker

        texts = []
        for worker in list(self.workers):
            port = worker.metrics_port
            if port is None:
                continue
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                            timeout=SCRAPE_TIMEOUT) as answer:
                    texts.append((str(worker.index), answer.read().decode()))
            except (OSError, urllib.error.URLError) as exc:
                log_event(logger, logging.WARNING, "worker metrics unavailable",
                          worker=worker.index, error=str(exc))
        states = GaugeMetricFamily("gatehouse_workers", "Worker processes by state "
                                   "(configured: workers; running: started and not exited; "
                                   "ready: serving)", labels=["state"])
        states.add_metric(["configured"], len(self.workers))
        states.add_metric(["running"], sum(w.running for w in self.workers))
        states.add_metric(["ready"], sum(w.ready for w in self.workers))
        restarts = CounterMetricFamily("gatehouse_worker_restarts", "Worker processes "
                                       "restarted after they died")
        restarts.add_metric([], self.restarts)
        return merge_by_worker(texts, own=[states, restarts])

    def render_connections(self) -> bytes:
        """Every worker's /connections as one document, each connection with its
        ``worker`` (runs in a thread); ``workers_unavailable`` names those that did not
        answer (starting, restarting), so a short list is never taken for the whole."""
        entries: list[dict[str, Any]] = []
        unavailable: list[int] = []
        for worker in list(self.workers):
            port = worker.metrics_port
            try:
                if port is None:
                    raise OSError("not started")
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/connections",
                                            timeout=SCRAPE_TIMEOUT) as answer:
                    listed = json.loads(answer.read())["connections"]
            except (OSError, urllib.error.URLError, ValueError, KeyError, TypeError) as exc:
                unavailable.append(worker.index)
                log_event(logger, logging.WARNING, "worker connections unavailable",
                          worker=worker.index, error=str(exc))
                continue
            entries.extend({"worker": worker.index, **item} for item in listed)
        return live.encode(live.document(entries, workers=len(self.workers),
                                         workers_unavailable=unavailable))

    async def connections(self) -> bytes:
        return await trio.to_thread.run_sync(self.render_connections)

    async def readiness(self) -> tuple[bool, str]:
        """Ready when every worker is (each one's own /readyz)."""
        for worker in self.workers:
            port = worker.metrics_port
            if not worker.ready or port is None:
                return False, f"worker {worker.index} not started"
            ok, why = await trio.to_thread.run_sync(_worker_ready, port)
            if not ok:
                return False, f"worker {worker.index}: {why}"
        return True, ""


def _worker_ready(port: int) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz",
                                    timeout=SCRAPE_TIMEOUT) as answer:
            return answer.status == 200, ""
    except urllib.error.HTTPError as exc:
        return False, exc.read().decode(errors="replace").strip().removeprefix("not ready: ")
    except (OSError, urllib.error.URLError) as exc:
        return False, str(exc)


def serve_workers(config: ProxyConfig, worker_args: Sequence[str]) -> int:
    """Run the supervisor of ``config.workers`` workers; its exit status."""
    return trio.run(Supervisor(config, worker_args).serve)
