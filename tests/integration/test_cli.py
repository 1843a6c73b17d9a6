"""The `gatehouse` command as users run it: demo, run with SIGTERM/SIGHUP, check."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tests.support.clients import consume, produce, unique
from tests.support.kafka import KafkaCluster
from tests.support.ports import free_port, wait_listening

GATEHOUSE = [sys.executable, "-m", "gatehouse.cli"]


@contextlib.contextmanager
def gatehouse_run(config: Path) -> Iterator[subprocess.Popen[str]]:
    """`gatehouse run --config CONFIG` as a user runs it, its output piped (unbuffered);
    killed on the way out if it is still running."""
    proc = subprocess.Popen([*GATEHOUSE, "run", "--config", str(config)], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_demo_runs_on_the_embedded_broker() -> None:
    result = subprocess.run([*GATEHOUSE, "demo", "--duration", "12", "--every", "4"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    final = re.search(r"produced (\d+), consumed (\d+) through the proxy", result.stdout)
    assert final is not None, result.stdout[-2000:]
    assert int(final.group(1)) > 0 and int(final.group(2)) > 0
    for api in ("Produce", "Fetch", "Metadata", "JoinGroup"):
        assert re.search(rf"^{api}\s+demo-", result.stdout, re.M), api
    assert "client software (KIP-511): confluent-kafka-python" in result.stdout
    # The observe-mode rule counts the librdkafka 2.x clients' requests, refusing none
    # (the workload above went through).
    refused = re.findall(r"^rule librdkafka-3-or-newer: would_refuse (\d+) requests "
                         r"\(observe mode: nothing refused\)$", result.stdout, re.M)
    assert refused and int(refused[-1]) > 0
    # So does the observe-mode quota, holding nothing back.
    held = re.findall(r"^rule two-requests-a-second: would_throttle (\d+) requests "
                      r"\(observe mode: nothing held back\)$", result.stdout, re.M)
    assert held and int(held[-1]) > 0, result.stdout[-2000:]
    # The clients authenticated with the proxy, and the writer's ACL (observed) would
    # refuse its writes to the demo topic.
    logins = re.findall(r"^authenticated with the proxy \(SASL\): (.*)$", result.stdout, re.M)
    assert logins and "orders-writer x" in logins[-1] and "orders-reader x" in logins[-1]
    acl = re.findall(r"^rule writer-acl: would_refuse (\d+) requests", result.stdout, re.M)
    assert acl and int(acl[-1]) > 0, result.stdout[-2000:]
    # The connections open at a summary, each as the proxy knows it (/connections).
    for client, user in (("demo-producer", "orders-writer"), ("demo-consumer", "orders-reader")):
        assert re.search(rf"^  #\d+ {client} \({user}, SCRAM-SHA-256\) on broker-\d+: "
                         r"[1-9]\d* requests, [1-9]\d* bytes in, .* owed; .*\b"
                         rf"{'Produce' if client == 'demo-producer' else 'Fetch'} [1-9]",
                         result.stdout, re.M), client
    # The clients pushed their own metrics to the proxy (KIP-714; Tansu has no part).
    final_summary = result.stdout.rsplit("=== gatehouse demo", 1)[1]
    # Every value went to Tansu encrypted and came back decrypted (the consumer counted
    # only records it read without an error); Tansu holds ciphertext, under the header.
    sealed = re.search(r"^rule encrypted-orders: (\d+) values encrypted on their way to "
                       r"the broker, (\d+) decrypted on their way back$", final_summary, re.M)
    assert sealed is not None, final_summary
    # (Records sent as the workload stopped may be encrypted but not yet acknowledged,
    # and fetched but not yet polled.)
    assert int(sealed.group(1)) >= int(final.group(1)) > 0
    assert int(sealed.group(2)) >= int(final.group(2)) > 0
    stored = re.search(r"^a record as the broker stores it: headers \[gatehouse\.encryption\], "
                       r"value 01000464656d6f[0-9a-f]{18}\.\.\. \((\d+) bytes\)$",
                       final_summary, re.M)
    assert stored is not None, final_summary
    assert int(stored.group(1)) > len("order 0") + 60  # an envelope, not the order
    assert "the clients' own metrics (KIP-714)" in final_summary, final_summary
    assert re.search(r"^  demo-producer \(orders-writer\): .*record queue time avg "
                     r"\d+\.\d ms", final_summary, re.M), final_summary
    assert re.search(r"^  demo-consumer \(orders-reader\): .*fetch latency avg "
                     r"\d+\.\d ms", final_summary, re.M), final_summary


def test_run_reload_and_sigterm(kafka: KafkaCluster, tmp_path: Path) -> None:
    port, metrics_port = free_port(), free_port()
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - name: no-metadata-v0\n    min_api_version: {Metadata: 1}\n")
    config = tmp_path / "gatehouse.yaml"
    config.write_text(f"listen: 127.0.0.1:{port}\nupstream: [{kafka.bootstrap}]\n"
                      f"brokers: {{start_port: 0}}\nmetrics: {{listen: 127.0.0.1:{metrics_port}}}\n"
                      f"rules_file: {rules}\nlog: {{json: true}}\n")
    assert subprocess.run([*GATEHOUSE, "check", "--config", str(config)],
                          capture_output=True, timeout=60).returncode == 0
    with gatehouse_run(config) as proc:
        wait_listening(port, proc)
        wait_listening(metrics_port, proc)
        topic = unique("cli")
        kafka.create_topic(topic)
        conf = {"bootstrap.servers": f"127.0.0.1:{port}"}
        sent = produce(conf, topic, count=10)
        assert sorted(consume(conf, topic, 10)) == sorted(sent)
        with socket.create_connection(("127.0.0.1", metrics_port)) as s:
            s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            text = b""
            while chunk := s.recv(65536):
                text += chunk
        assert b'gatehouse_topic_records_total{direction="produce",topic="' + topic.encode() \
            + b'"} 10.0' in text
        assert b'gatehouse_rules_reloads_total{outcome="failed"} 0.0' in text
        # A bad rules file on SIGHUP: rejected with file:line, the old rules stay.
        rules.write_text("rules:\n  - name: x\n    deny_apis: [Nope]\n")
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with socket.create_connection(("127.0.0.1", metrics_port)) as s:
                s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
                text = b""
                while chunk := s.recv(65536):
                    text += chunk
            if b'gatehouse_rules_reloads_total{outcome="failed"} 0.0' not in text:
                break
            time.sleep(0.1)
        assert b'gatehouse_rules_reloads_total{outcome="failed"} 0.0' not in text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    log = proc.stderr.read() if proc.stderr else ""
    assert f"{rules}:3: unknown API name 'Nope'" in log
    assert '"event": "shutting down: draining connections"' in log


def test_run_advises_cluster_acls_where_the_brokers_see_one_user(tmp_path: Path) -> None:
    """`gatehouse run` logs what `gatehouse check` prints: with sasl.upstream, a rule whose
    acls say nothing of the cluster leaves every client the proxy's user's rights there."""
    port = free_port()
    (tmp_path / "proxy.secret").write_text("p\n")
    config = tmp_path / "gatehouse.yaml"
    config.write_text(f"listen: 127.0.0.1:{port}\nupstream: [127.0.0.1:{free_port()}]\n"
                      "brokers: {start_port: 0}\nlog: {json: true}\nsasl:\n"
                      "  upstream: {mechanism: SCRAM-SHA-512, username: gh,"
                      " password_file: proxy.secret}\n"
                      "rules:\n  - name: team-a\n    match: {principal: '^a$'}\n    acls:\n"
                      "      - {allow: [read], topics: ['a\\\\..*']}\n")
    with gatehouse_run(config) as proc:
        wait_listening(port, proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    log = proc.stderr.read() if proc.stderr else ""
    advice = [line for line in log.splitlines() if '"event": "rules advice"' in line]
    assert len(advice) == 1 and "rule team-a: its acls say nothing of the cluster" in advice[0]


def test_check_probe_reaches_every_broker_as_the_proxy_would(
        kafka_cluster: KafkaCluster, kafka_scram: KafkaCluster, tmp_path: Path) -> None:
    """`gatehouse check --probe`: each bootstrap server and each broker the cluster lists,
    connected to (and logged in to) as the proxy's connections are, one line each, with
    the address clients are told; exit 1 naming what does not answer."""
    config = tmp_path / "proxy.yaml"
    dead = free_port()
    config.write_text(f"listen: 127.0.0.1:9192\nupstream: [{kafka_cluster.bootstrap}]\n"
                      "brokers: {start_port: 19300}\n")

    def probe() -> subprocess.CompletedProcess[str]:
        return subprocess.run([*GATEHOUSE, "check", "--config", str(config), "--probe"],
                              capture_output=True, text=True, timeout=120)

    result = probe()
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.split("probe:\n", 1)[1].splitlines()
    servers = kafka_cluster.bootstrap.split(",")
    assert lines[:3] == [f"  bootstrap {server}: connected" for server in servers]
    assert re.fullmatch(r"  cluster \S+: 3 brokers, controller \d+", lines[3]), lines
    # Kafka 4.4, the release the tables come from: every API known, none newer.
    assert re.fullmatch(r"  broker APIs: (\d+), \1 known to this proxy's tables", lines[4])
    nodes = {node.node_id: node for node in kafka_cluster.nodes}
    assert lines[5:] == [f"  broker {n} (clients: 127.0.0.1:{19300 + n}) "
                         f"127.0.0.1:{nodes[n].port}: connected" for n in sorted(nodes)]

    # A bootstrap server that is not there: said, and the exit status says so.  (The
    # proxy receives the clients' own metrics: Kafka, with no receiver, offers none.)
    config.write_text(f"listen: 127.0.0.1:9192\nupstream: [127.0.0.1:{dead}, "
                      f"{servers[0]}]\nmetrics: {{client_telemetry: {{}}}}\n")
    result = probe()
    assert result.returncode == 1
    assert ("  client telemetry: the proxy receives the clients' metrics (the brokers "
            "have no receiver)") in result.stdout, result.stdout
    assert (f"  bootstrap 127.0.0.1:{dead}: all attempts to connect to 127.0.0.1:{dead} "
            "failed") in result.stdout, result.stdout
    assert "3 brokers" in result.stdout
    assert "cannot reach or log in to" in result.stderr

    # The proxy's own SASL login, and a password the broker refuses.
    from tests.support.kafka import SCRAM_MECHANISM, SCRAM_PASSWORD, SCRAM_USER

    for password, status in ((SCRAM_PASSWORD, 0), ("wrong", 1)):
        config.write_text(
            f"listen: 127.0.0.1:9192\nupstream: [{kafka_scram.sasl_bootstrap}]\n"
            f"sasl:\n  upstream: {{mechanism: {SCRAM_MECHANISM}, username: {SCRAM_USER}, "
            f"password: {password}}}\n")
        result = probe()
        assert result.returncode == status, result.stdout + result.stderr
        if status == 0:
            assert (f"  bootstrap {kafka_scram.sasl_bootstrap}: connected, logged in as "
                    f"{SCRAM_USER!r} ({SCRAM_MECHANISM})") in result.stdout, result.stdout
        else:
            assert (f"  bootstrap {kafka_scram.sasl_bootstrap}: SASL authentication failed: "
                    f"the broker refused {SCRAM_USER!r}") in result.stdout, result.stdout
            assert "wrong" not in result.stdout + result.stderr
