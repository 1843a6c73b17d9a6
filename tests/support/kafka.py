"""Real Apache Kafka (4.4, KRaft) clusters for the integration tests.

Every node is a combined broker+controller JVM (``process.roles=broker,controller``) on
127.0.0.1, with a PLAINTEXT client listener, a CONTROLLER listener and, with
``sasl_scram=True``, a SASL_PLAINTEXT (SCRAM-SHA-256) client listener.  The jars come from
:func:`scripts.fetch_kafka.ensure_kafka`; data and logs live in a temporary directory that
:meth:`KafkaCluster.close` removes.

    with KafkaCluster(n_nodes=3) as cluster:
        producer = confluent_kafka.Producer({"bootstrap.servers": cluster.bootstrap})
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from scripts.fetch_kafka import classpath, ensure_kafka, java_binary, log4j2_config
from tests.support.ports import LOCALHOST, free_port, port_is_listening

SCRAM_MECHANISM = "SCRAM-SHA-256"
SCRAM_USER = "admin"
SCRAM_PASSWORD = "admin-secret"

BROKER_MAIN = "kafka.Kafka"
STORAGE_TOOL_MAIN = "kafka.tools.StorageTool"

START_TIMEOUT = 90.0
BROKER_JVM_OPTS = (
    "-Xmx384m", "-Xms128m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
    "-XX:-UsePerfData", "-Djava.awt.headless=true",
)
# Java programs of the tests' own (Java's single-file source launcher runs them on the
# Kafka jars' classpath: run_java_tool(libs, str(JAVA_SOURCES / "X.java"), ...)).
JAVA_SOURCES = Path(__file__).resolve().parent / "java"
PERF = "org.apache.kafka.tools.ProducerPerformance"
CONSUMER_PERF = "org.apache.kafka.tools.ConsumerPerformance"
TOOL_JVM_OPTS = (
    "-Xmx256m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-XX:-UsePerfData",
    "-Djava.awt.headless=true",
)


def tls_files_for_loopback(directory: Path) -> dict[str, Path]:
    """A new CA and a certificate it issued for 127.0.0.1 and localhost, written to
    ``directory``: ``cert`` (the chain), ``key``, ``keystore`` (key and chain in one
    file, the key PKCS#8, as Kafka's PEM key store reads them: ``tls_keystore``) and
    ``ca``."""
    import trustme
    from cryptography.hazmat.primitives import serialization

    ca = trustme.CA()
    issued = ca.issue_cert("127.0.0.1", "localhost")
    files = {name: directory / f"{name}.pem" for name in ("cert", "key", "keystore", "ca")}
    chain = b"".join(blob.bytes() for blob in issued.cert_chain_pems)
    files["cert"].write_bytes(chain)
    issued.private_key_pem.write_to_path(str(files["key"]))
    pkcs8 = serialization.load_pem_private_key(issued.private_key_pem.bytes(), None)
    files["keystore"].write_bytes(pkcs8.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()) + chain)
    ca.cert_pem.write_to_path(str(files["ca"]))
    return files


def libs_with_plugin(libs: Path, source: Path, where: Path) -> Path:
    """A Kafka libs directory (its jars linked into ``where/libs``) with the tests' own
    Java ``source`` compiled into a jar beside them: a broker plugin (a SASL callback
    handler...) on a broker's classpath."""
    classes, jars = where / "classes", where / "libs"
    classes.mkdir(parents=True)
    jars.mkdir()
    javac = str(Path(java_binary()).with_name("javac"))
    subprocess.run([javac, "-cp", classpath(libs), "-d", str(classes), str(source)],
                   check=True, capture_output=True, timeout=120)
    subprocess.run([str(Path(javac).with_name("jar")), "cf", str(jars / f"{source.stem}.jar"),
                    "-C", str(classes), "."], check=True, capture_output=True, timeout=60)
    for jar in libs.glob("*.jar"):
        (jars / jar.name).symlink_to(jar)
    return jars


class BrokerStartError(RuntimeError):
    """A broker did not start, or did not become ready in time."""


# --- every broker process this test session started, killed at exit if still running, --------
# --- and the temporary directories still to remove ----------------------------------------

_live_lock = threading.Lock()
_live: set[subprocess.Popen[bytes]] = set()
_live_dirs: set[Path] = set()


def register_dir(path: Path) -> None:
    """Remove ``path`` when the interpreter exits, unless :func:`forget_dir` is called."""
    with _live_lock:
        _live_dirs.add(path)


def forget_dir(path: Path) -> None:
    with _live_lock:
        _live_dirs.discard(path)


def register_process(process: subprocess.Popen[bytes]) -> None:
    """Kill ``process`` when the interpreter exits, unless :func:`forget_process` is called."""
    with _live_lock:
        _live.add(process)


def forget_process(process: subprocess.Popen[bytes]) -> None:
    with _live_lock:
        _live.discard(process)


@atexit.register
def _kill_leftovers() -> None:
    with _live_lock:
        leftovers = list(_live)
        _live.clear()
        dirs = list(_live_dirs)
        _live_dirs.clear()
    for process in leftovers:
        if process.poll() is None:
            with contextlib.suppress(OSError):
                process.kill()
            with contextlib.suppress(Exception):
                process.wait(10)
    for path in dirs:
        shutil.rmtree(path, ignore_errors=True)


def stop_process(process: subprocess.Popen[bytes], timeout: float, *, kill: bool = False) -> None:
    """SIGTERM (or SIGKILL) ``process``, wake it if stopped, SIGKILL it after ``timeout``."""
    if process.poll() is None:
        with contextlib.suppress(OSError):
            if kill:
                process.kill()
            else:
                process.terminate()
                os.kill(process.pid, signal.SIGCONT)  # a paused JVM cannot act on SIGTERM
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                process.kill()
            process.wait()
    forget_process(process)


def log_tail(path: Path | None, lines: int = 40) -> str:
    if path is None or not path.exists():
        return "(no log)"
    text = path.read_text(errors="replace").splitlines()[-lines:]
    return "\n".join(text) if text else "(empty log)"


# --- metadata polling (librdkafka) ------------------------------------------------------------


def metadata_broker_ids(
    bootstrap: str, timeout: float, config: Mapping[str, Any] | None = None
) -> set[int] | None:
    """The broker ids a Metadata request to ``bootstrap`` returns, or None if none answered."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    conf: dict[str, Any] = {
        "bootstrap.servers": bootstrap,
        "log_level": 0,  # no "Connection refused" noise while the broker starts
        "reconnect.backoff.ms": 50,
        "reconnect.backoff.max.ms": 500,
        "socket.connection.setup.timeout.ms": max(1000, int(timeout * 1000)),
    }
    conf.update(config or {})
    admin = AdminClient(conf)
    try:
        metadata = admin.list_topics(timeout=timeout)
    except KafkaException:
        return None
    return {int(broker_id) for broker_id in metadata.brokers}


def wait_for_brokers(
    bootstrap: str,
    expected: Iterable[int] | int,
    deadline: float,
    *,
    alive: Callable[[], str | None] = lambda: None,
    port: int | None = None,
    config: Mapping[str, Any] | None = None,
    what: str = "broker",
    log: Path | None = None,
) -> set[int]:
    """Poll ``bootstrap`` with Metadata until it lists ``expected`` (ids, or at least a count).

    ``alive()`` returns an error text once the process has gone away; ``port`` is first
    awaited with plain TCP connects (cheaper than a client).  Raises BrokerStartError with
    the tail of ``log`` when ``deadline`` (a ``time.monotonic()`` value) passes.
    """
    want_ids = None if isinstance(expected, int) else set(expected)
    want_count = expected if isinstance(expected, int) else len(want_ids or ())
    last: set[int] | None = None

    def fail(reason: str) -> BrokerStartError:
        return BrokerStartError(f"{what} at {bootstrap}: {reason}; its log ends with:\n"
                                f"{log_tail(log)}")

    while True:
        gone = alive()
        if gone:
            raise fail(gone)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise fail(f"not ready in time (metadata listed brokers {sorted(last or ())}, "
                       f"expected {sorted(want_ids) if want_ids is not None else want_count})")
        if port is not None and not port_is_listening(port):
            time.sleep(min(0.1, remaining))
            continue
        last = metadata_broker_ids(bootstrap, min(2.0, max(0.2, remaining)), config)
        if last is not None:
            if want_ids is not None and want_ids <= last:
                return last
            if want_ids is None and len(last) >= want_count:
                return last
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


# --- the cluster ------------------------------------------------------------------------------


def _random_cluster_id() -> str:
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")


@dataclass
class KafkaNode:
    """One combined broker+controller JVM (or a broker only: ``KafkaCluster.add_broker``)."""

    node_id: int
    port: int  # PLAINTEXT client listener (also the inter-broker listener)
    controller_port: int | None  # None: a broker only
    sasl_port: int | None
    dir: Path
    ssl_port: int | None = None  # SSL listener: only with KafkaCluster(tls_keystore=...)
    process: subprocess.Popen[bytes] | None = None
    paused: bool = False
    _log_file: IO[bytes] | None = field(default=None, repr=False)

    @property
    def config_path(self) -> Path:
        return self.dir / "server.properties"

    @property
    def data_dir(self) -> Path:
        return self.dir / "data"

    @property
    def log_path(self) -> Path:
        return self.dir / "kafka.log"

    @property
    def bootstrap(self) -> str:
        return f"{LOCALHOST}:{self.port}"

    @property
    def sasl_bootstrap(self) -> str:
        if self.sasl_port is None:
            raise AttributeError("this cluster has no SASL listener (sasl_scram=False)")
        return f"{LOCALHOST}:{self.sasl_port}"

    @property
    def ssl_bootstrap(self) -> str:
        if self.ssl_port is None:
            raise AttributeError("this cluster has no SSL listener (tls_keystore=None)")
        return f"{LOCALHOST}:{self.ssl_port}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)


class KafkaCluster:
    """``n_nodes`` Kafka KRaft nodes on 127.0.0.1, each broker and controller.

    ``start()`` formats the storage and waits (``start_timeout`` seconds in all) until
    every node's Metadata lists every broker.  ``close()`` stops them and removes their
    directory.  Also a context manager.
    """

    def __init__(
        self,
        n_nodes: int = 1,
        sasl_scram: bool = False,
        *,
        version: str | None = None,
        libs: Path | None = None,
        extra_config: Mapping[str, object] | None = None,
        node_config: Mapping[int, Mapping[str, object]] | None = None,
        start_timeout: float = START_TIMEOUT,
        jvm_opts: Iterable[str] = BROKER_JVM_OPTS,
        log_level: str = "WARN",
        keep_dir: bool | None = None,
        tls_keystore: Path | None = None,
        relayed_listeners: Mapping[str, tuple[int, int]] | None = None,
    ) -> None:
        """``tls_keystore``: a PEM file with a private key (PKCS#8, unencrypted) and its
        certificate chain, for an SSL listener on each broker (``ssl_bootstrap``).
        ``relayed_listeners``: name -> (port, advertised port), more PLAINTEXT listeners
        whose clients are told the other port (a relay in front of them keeps them on
        it); one node only."""
        if n_nodes < 1:
            raise ValueError("n_nodes must be at least 1")
        self.n_nodes = n_nodes
        self.sasl_scram = sasl_scram
        self.tls_keystore = tls_keystore
        if relayed_listeners and n_nodes != 1:
            raise ValueError("relayed_listeners: one node only (one port each)")
        self.relayed_listeners = dict(relayed_listeners or {})
        self.version = version
        self._libs = libs
        self.extra_config = dict(extra_config or {})
        self.node_config = {node_id: dict(config) for node_id, config in
                            (node_config or {}).items()}  # a node's own (broker.rack...)
        self.start_timeout = start_timeout
        self.jvm_opts = tuple(jvm_opts)
        self.log_level = log_level
        self.keep_dir = (os.environ.get("GATEHOUSE_KEEP_KAFKA_DIRS") == "1"
                         if keep_dir is None else keep_dir)
        self.cluster_id = _random_cluster_id()
        self.base_dir: Path | None = None
        self.nodes: list[KafkaNode] = []

    # -- addresses --

    @property
    def bootstrap(self) -> str:
        """The PLAINTEXT listeners: ``127.0.0.1:port,...``."""
        return ",".join(node.bootstrap for node in self.nodes)

    @property
    def sasl_bootstrap(self) -> str:
        """The SASL_PLAINTEXT (SCRAM-SHA-256) listeners; only with ``sasl_scram=True``."""
        if not self.sasl_scram:
            raise AttributeError("this cluster has no SASL listener (sasl_scram=False)")
        return ",".join(node.sasl_bootstrap for node in self.nodes)

    @property
    def ssl_bootstrap(self) -> str:
        """The SSL listeners; only with ``tls_keystore``."""
        return ",".join(node.ssl_bootstrap for node in self.nodes)

    def client_config(self, sasl: bool = False, **extra: Any) -> dict[str, Any]:
        """A confluent-kafka config for this cluster (``sasl=True``: SCRAM as ``admin``)."""
        conf: dict[str, Any] = {"bootstrap.servers": self.sasl_bootstrap if sasl else self.bootstrap}
        if sasl:
            conf.update({
                "security.protocol": "SASL_PLAINTEXT",
                "sasl.mechanism": SCRAM_MECHANISM,
                "sasl.username": SCRAM_USER,
                "sasl.password": SCRAM_PASSWORD,
            })
        conf.update(extra)
        return conf

    @property
    def libs(self) -> Path:
        if self._libs is None:
            self._libs = ensure_kafka(self.version)
        return self._libs

    # -- lifecycle --

    def __enter__(self) -> KafkaCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> KafkaCluster:
        if self.nodes:
            raise RuntimeError("cluster already started")
        libs = self.libs
        self.base_dir = Path(tempfile.mkdtemp(prefix="gatehouse-kafka-"))
        if not self.keep_dir:
            register_dir(self.base_dir)
        for node_id in range(self.n_nodes):
            node_dir = self.base_dir / f"node{node_id}"
            node_dir.mkdir()
            self.nodes.append(KafkaNode(
                node_id=node_id,
                port=free_port(),
                controller_port=free_port(),
                sasl_port=free_port() if self.sasl_scram else None,
                dir=node_dir,
                ssl_port=free_port() if self.tls_keystore else None,
            ))
        try:
            for node in self.nodes:
                node.config_path.write_text(self._server_properties(node))
            self._format(libs)
            deadline = time.monotonic() + self.start_timeout
            for node in self.nodes:
                self._launch(node)
            for node in self.nodes:
                self._wait_ready(node, deadline)
        except BaseException:
            self.close()
            raise
        return self

    def close(self, timeout: float = 10.0) -> None:
        """Stop every node (SIGTERM, SIGKILL after ``timeout``) and remove the directory."""
        for node in self.nodes:
            if node.process is not None and node.process.poll() is None:
                with contextlib.suppress(OSError):
                    node.process.terminate()
                    os.kill(node.process.pid, signal.SIGCONT)
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            if node.process is not None:
                stop_process(node.process, max(0.1, deadline - time.monotonic()))
            node.paused = False
            self._close_log(node)
        if self.base_dir is not None and not self.keep_dir:
            shutil.rmtree(self.base_dir, ignore_errors=True)
            forget_dir(self.base_dir)
        self.base_dir = None
        self.nodes = []

    def stop_node(self, i: int, *, timeout: float = 30.0, kill: bool = False) -> None:
        """Stop node ``i`` (SIGTERM, a controlled shutdown; ``kill=True``: SIGKILL)."""
        node = self.nodes[i]
        if node.process is not None:
            stop_process(node.process, timeout, kill=kill)
        node.paused = False
        self._close_log(node)

    def start_node(self, i: int, *, timeout: float = START_TIMEOUT, libs: Path | None = None
                   ) -> None:
        """Start node ``i`` again with its data and ports; wait until it lists the live
        brokers.  ``libs``: another Kafka's, for this node and every node started after it
        (a rolling upgrade)."""
        node = self.nodes[i]
        if node.running:
            raise RuntimeError(f"node {i} is running")
        if libs is not None:
            self._libs = libs
        self._launch(node)
        self._wait_ready(node, time.monotonic() + timeout)

    def add_broker(self, *, timeout: float = START_TIMEOUT) -> KafkaNode:
        """A new broker (no controller) joins the running cluster under the next node id,
        as when a cluster is scaled out; started and waited for as the others were."""
        if self.base_dir is None:
            raise RuntimeError("the cluster is not running")
        node_id = max(node.node_id for node in self.nodes) + 1
        node = KafkaNode(node_id=node_id, port=free_port(), controller_port=None,
                         sasl_port=free_port() if self.sasl_scram else None,
                         dir=self.base_dir / f"node{node_id}",
                         ssl_port=free_port() if self.tls_keystore else None)
        node.dir.mkdir()
        self.nodes.append(node)
        node.config_path.write_text(self._server_properties(node))
        self._format(self.libs, [node])
        self._launch(node)
        self._wait_ready(node, time.monotonic() + timeout)
        return node

    def move_node(self, i: int) -> None:
        """Restart node ``i`` on another client port, its data and node id kept: a broker
        back at a new address, as a rescheduled pod comes back on a new IP."""
        self.stop_node(i)
        node = self.nodes[i]
        node.port = free_port()
        node.config_path.write_text(self._server_properties(node))
        self.start_node(i)

    def pause_node(self, i: int) -> None:
        """SIGSTOP node ``i``: it keeps its sockets but answers nothing."""
        node = self.nodes[i]
        if not node.running:
            raise RuntimeError(f"node {i} is not running")
        pid = node.process.pid  # type: ignore[union-attr]
        os.kill(pid, signal.SIGSTOP)
        # The signal is delivered asynchronously: return once the process has stopped.
        deadline = time.monotonic() + 10
        while process_state(pid) != "T":
            if time.monotonic() > deadline:
                raise RuntimeError(f"node {i} did not stop after SIGSTOP")
            time.sleep(0.01)
        node.paused = True

    def resume_node(self, i: int) -> None:
        """SIGCONT node ``i``."""
        node = self.nodes[i]
        if not node.running:
            raise RuntimeError(f"node {i} is not running")
        os.kill(node.process.pid, signal.SIGCONT)  # type: ignore[union-attr]
        node.paused = False

    # -- helpers for tests --

    def create_topic(
        self,
        name: str,
        partitions: int = 1,
        replication: int = 1,
        *,
        config: Mapping[str, str] | None = None,
        timeout: float = 30.0,
    ) -> None:
        """Create a topic and wait until every live node's metadata has a leader for each partition."""
        from confluent_kafka.admin import AdminClient, NewTopic

        admin = AdminClient(self.client_config(log_level=0))
        futures = admin.create_topics(
            [NewTopic(name, num_partitions=partitions, replication_factor=replication,
                      config=dict(config or {}))],
            operation_timeout=timeout, request_timeout=timeout,
        )
        futures[name].result(timeout=timeout)
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            if not node.running or node.paused:
                continue
            node_admin = AdminClient({"bootstrap.servers": node.bootstrap, "log_level": 0})
            while True:
                topic = node_admin.list_topics(topic=name, timeout=timeout).topics.get(name)
                if (topic is not None and topic.error is None
                        and len(topic.partitions) == partitions
                        and all(p.leader >= 0 for p in topic.partitions.values())):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"topic {name} has no leaders on node {node.node_id}")
                time.sleep(0.1)

    def delete_topics(self, names: Iterable[str], *, timeout: float = 30.0) -> None:
        """Delete topics (those already gone are no error) and wait until the controller
        has: their files go a second later (``log.segment.delete.delay.ms``).  Benchmarks
        delete each topic once measured, so that a long run's disk use stays bounded (a
        900,000-record peers run writes ~70 GB otherwise)."""
        from confluent_kafka import KafkaError, KafkaException
        from confluent_kafka.admin import AdminClient

        names = list(names)
        if not names:
            return
        admin = AdminClient(self.client_config(log_level=0))
        futures = admin.delete_topics(names, operation_timeout=timeout, request_timeout=timeout)
        for future in futures.values():
            try:
                future.result(timeout=timeout)
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                    raise

    def run_java_tool(
        self,
        main_class: str,
        *args: str,
        timeout: float = 120.0,
        jvm_opts: Iterable[str] = TOOL_JVM_OPTS,
        check: bool = False,
    ) -> subprocess.CompletedProcess[str]:
        """Run a Java main class on Kafka's classpath (``org.apache.kafka.tools.ProducerPerformance``...).

        Output is captured as text; ``subprocess.TimeoutExpired`` after ``timeout`` seconds.
        """
        return run_java_tool(self.libs, main_class, *args, timeout=timeout, jvm_opts=jvm_opts,
                             check=check, log_level=self.log_level)

    def consume_with_java(self, bootstrap: str, topic: str, messages: int, *options: str,
                          timeout: float = 120.0, jvm_opts: Iterable[str] = TOOL_JVM_OPTS,
                          ) -> subprocess.CompletedProcess[str]:
        """Kafka's ConsumerPerformance reading ``messages`` records of ``topic`` from
        ``bootstrap`` (``options``: more of its own, ``--command-config``, ``--group``...),
        within a minute of no records; fails the test unless it exited cleanly having
        read every one of them."""
        result = self.run_java_tool(
            CONSUMER_PERF, "--bootstrap-server", bootstrap, "--topic", topic, "--messages",
            str(messages), "--timeout", "60000", *options, timeout=timeout, jvm_opts=jvm_opts)
        assert result.returncode == 0, result.stderr[-2000:]
        rows = [line for line in result.stdout.splitlines() if line[:1].isdigit()]
        assert rows and int(rows[-1].split(",")[4]) == messages, result.stdout[-2000:]
        return result

    # -- internals --

    def _server_properties(self, node: KafkaNode) -> str:
        n = self.n_nodes
        voters = ",".join(f"{other.node_id}@{LOCALHOST}:{other.controller_port}"
                          for other in self.nodes if other.controller_port is not None)
        listeners = [f"PLAINTEXT://{LOCALHOST}:{node.port}"]
        advertised = [f"PLAINTEXT://{LOCALHOST}:{node.port}"]
        protocols = ["PLAINTEXT:PLAINTEXT", "CONTROLLER:PLAINTEXT"]
        if node.sasl_port is not None:
            listeners.append(f"SASL_PLAINTEXT://{LOCALHOST}:{node.sasl_port}")
            advertised.append(f"SASL_PLAINTEXT://{LOCALHOST}:{node.sasl_port}")
            protocols.append("SASL_PLAINTEXT:SASL_PLAINTEXT")
        if node.ssl_port is not None:
            listeners.append(f"SSL://{LOCALHOST}:{node.ssl_port}")
            advertised.append(f"SSL://{LOCALHOST}:{node.ssl_port}")
            protocols.append("SSL:SSL")
        for name, (port, advertised_port) in self.relayed_listeners.items():
            listeners.append(f"{name}://{LOCALHOST}:{port}")
            advertised.append(f"{name}://{LOCALHOST}:{advertised_port}")
            protocols.append(f"{name}:PLAINTEXT")
        if node.controller_port is not None:
            listeners.append(f"CONTROLLER://{LOCALHOST}:{node.controller_port}")
        props: dict[str, object] = {
            "process.roles": "broker" if node.controller_port is None else "broker,controller",
            "node.id": node.node_id,
            "controller.quorum.voters": voters,
            "controller.listener.names": "CONTROLLER",
            "listeners": ",".join(listeners),
            "advertised.listeners": ",".join(advertised),
            "listener.security.protocol.map": ",".join(protocols),
            "inter.broker.listener.name": "PLAINTEXT",
            "log.dirs": node.data_dir,
            # small and quick
            "num.partitions": 1,
            "default.replication.factor": min(3, n),
            "min.insync.replicas": 1,
            "offsets.topic.replication.factor": min(3, n),
            "offsets.topic.num.partitions": 5,
            "transaction.state.log.replication.factor": min(3, n),
            "transaction.state.log.min.isr": min(2, n),
            "transaction.state.log.num.partitions": 5,
            "share.coordinator.state.topic.replication.factor": min(3, n),
            "share.coordinator.state.topic.min.isr": min(2, n),
            "share.coordinator.state.topic.num.partitions": 5,
            "group.initial.rebalance.delay.ms": 0,
            "num.network.threads": 2,
            "num.io.threads": 4,
            "num.recovery.threads.per.data.dir": 1,
            "background.threads": 4,
            "log.cleaner.threads": 1,
            "log.cleaner.dedupe.buffer.size": 16 * 1024 * 1024,
            # failures are noticed (and shutdowns finish) in seconds
            "broker.heartbeat.interval.ms": 1000,
            "broker.session.timeout.ms": 6000,
            "controller.quorum.election.timeout.ms": 1000,
            "controller.quorum.fetch.timeout.ms": 2000,
            "replica.lag.time.max.ms": 10000,
            "leader.imbalance.check.interval.seconds": 5,
            # a deleted topic's files go a second later, not a minute (delete_topics)
            "log.segment.delete.delay.ms": 1000,
        }
        if node.sasl_port is not None:
            props.update({
                # OAUTHBEARER with Kafka's unsecured JWT validator (tests only): the
                # principal is the token's "sub" claim.
                "sasl.enabled.mechanisms": f"{SCRAM_MECHANISM},OAUTHBEARER",
                "listener.name.sasl_plaintext.scram-sha-256.sasl.jaas.config":
                    "org.apache.kafka.common.security.scram.ScramLoginModule required;",
                "listener.name.sasl_plaintext.oauthbearer.sasl.jaas.config":
                    "org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule"
                    " required;",
            })
        if node.ssl_port is not None:
            props.update({
                "listener.name.ssl.ssl.keystore.type": "PEM",
                "listener.name.ssl.ssl.keystore.location": self.tls_keystore,
            })
        props.update(self.extra_config)
        props.update(self.node_config.get(node.node_id, {}))
        return "".join(f"{key}={value}\n" for key, value in props.items())

    def _format(self, libs: Path, nodes: Iterable[KafkaNode] | None = None) -> None:
        extra: list[str] = []
        if self.sasl_scram:
            extra = ["--add-scram", f"{SCRAM_MECHANISM}=[name={SCRAM_USER},password={SCRAM_PASSWORD}]"]
        procs = []
        for node in self.nodes if nodes is None else nodes:
            cmd = java_command(libs, STORAGE_TOOL_MAIN, [
                "format", "--config", str(node.config_path),
                f"--cluster-id={self.cluster_id}",  # ids may start with "-"
                *(extra if node.controller_port is not None else ())],  # users: the quorum's
                log_level=self.log_level)
            procs.append((node, subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)))
        errors = []
        for node, proc in procs:
            try:
                out, _ = proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
            if proc.returncode != 0:
                errors.append(f"node {node.node_id}: exit {proc.returncode}:\n"
                              f"{out.decode(errors='replace')[-3000:]}")
        if errors:
            raise BrokerStartError("kafka storage format failed: " + "\n".join(errors))

    def _launch(self, node: KafkaNode) -> None:
        self._close_log(node)
        node._log_file = open(node.log_path, "ab")  # noqa: SIM115 (closed in _close_log)
        cmd = java_command(self.libs, BROKER_MAIN, [str(node.config_path)], self.jvm_opts,
                           self.log_level)
        node.process = subprocess.Popen(
            cmd, cwd=node.dir, stdin=subprocess.DEVNULL, stdout=node._log_file,
            stderr=subprocess.STDOUT, start_new_session=True,
        )
        node.paused = False
        register_process(node.process)

    def _wait_ready(self, node: KafkaNode, deadline: float) -> None:
        expected = {other.node_id for other in self.nodes
                    if other is node or (other.running and not other.paused)}

        def alive() -> str | None:
            if node.process is None or node.process.poll() is not None:
                code = None if node.process is None else node.process.returncode
                return f"Kafka node {node.node_id} exited with code {code}"
            return None

        wait_for_brokers(node.bootstrap, expected, deadline, alive=alive, port=node.port,
                         what=f"Kafka node {node.node_id}", log=node.log_path)
        if node.sasl_port is not None:
            while not port_is_listening(node.sasl_port):
                if alive() or time.monotonic() > deadline:
                    raise BrokerStartError(
                        f"Kafka node {node.node_id}: SASL listener {node.sasl_port} not up; "
                        f"log ends with:\n{node.log_tail()}")
                time.sleep(0.1)

    @staticmethod
    def _close_log(node: KafkaNode) -> None:
        if node._log_file is not None:
            node._log_file.close()
            node._log_file = None


def run_java_tool(
    libs: Path,
    main_class: str,
    *args: str,
    timeout: float = 120.0,
    jvm_opts: Iterable[str] = TOOL_JVM_OPTS,
    check: bool = False,
    log_level: str = "WARN",
) -> subprocess.CompletedProcess[str]:
    """Run ``main_class`` with ``libs/*`` as the classpath; output captured as text."""
    return subprocess.run(java_command(libs, main_class, args, jvm_opts, log_level),
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout, check=check)


def java_command(libs: Path, main_class: str, args: Iterable[str],
                 jvm_opts: Iterable[str] = TOOL_JVM_OPTS, log_level: str = "WARN") -> list[str]:
    """The command line of ``main_class`` with ``libs/*`` as the classpath, logging
    through the project's log4j2 configuration at ``log_level``."""
    return [java_binary(), *jvm_opts, f"-Dlog4j2.configurationFile={log4j2_config()}",
            f"-Dgatehouse.kafka.log.level={log_level}", "-cp", classpath(libs), main_class,
            *args]


def start_java_process(libs: Path, main_class: str, *args: str, log: Path
                       ) -> subprocess.Popen[bytes]:
    """``main_class`` started in the background with ``libs/*`` as the classpath (a
    Connect worker, MirrorMaker), its output to ``log``, killed at exit if still running
    (``register_process``)."""
    with open(log, "w") as out:
        process = subprocess.Popen(java_command(libs, main_class, args), stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    register_process(process)
    return process


def process_state(pid: int) -> str:
    """The one-letter state of a process (R running, S sleeping, T stopped...)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]
