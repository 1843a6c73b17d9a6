"""The dashboard and the alert rules, proven against a real Prometheus.

Four `gatehouse run` processes serve /metrics: one in front of Kafka 4.4 carrying real
traffic (librdkafka producer, consumer group, refused admin requests, a garbage frame, a
rules reload that fails; the clients push their own metrics to it, KIP-714), one whose upstream is a dead port (a client keeps trying), one
in front of a SASL listener with TLS for its clients (a certificate reload that fails),
and one that allows one connection per client address (a second one is refused).  A
real Prometheus (Debian package, installed by `make prometheus`) scrapes them every
second and evaluates deploy/dashboards/alerts.yaml.  Then every PromQL expression of the
dashboard and of the alert rules must return data, and every alert must become active.
"""

from __future__ import annotations

import base64
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import confluent_kafka as ck
import pytest
import yaml
from confluent_kafka.admin import AdminClient, ConfigResource

from tests.support.clients import unique
from tests.support.kafka import KafkaCluster
from tests.support.oauth import rsa_key, write_jwks
from tests.support.ports import free_port, wait_listening

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "dashboards" / "gatehouse.json"
ALERTS = ROOT / "deploy" / "dashboards" / "alerts.yaml"
GATEHOUSE = [sys.executable, "-m", "gatehouse.cli"]
# What Grafana puts in place of the dashboard's variables ("All" is the regex .*).
VARIABLES = {"$job": ".*", "$instance": ".*", "$__rate_interval": "15s"}
DEADLINE = 120.0  # seconds for every expression to return data


def tool(name: str) -> str:
    path = shutil.which(name)
    assert path is not None, f"{name} not found: run `make prometheus` (scripts/install_debian.sh)"
    return path


def start_gatehouse(tmp: Path, name: str, upstream: str, rules: str, extra: str = "",
                    brokers: str = "{start_port: 0}", metrics: str = ""
                    ) -> tuple[subprocess.Popen[bytes], int, int, Path]:
    """``metrics``: more of the metrics section (``, client_telemetry: {}``)."""
    port, metrics_port = free_port(), free_port()
    rules_file = tmp / f"{name}-rules.yaml"
    rules_file.write_text(rules)
    config = tmp / f"{name}.yaml"
    config.write_text(f"listen: 127.0.0.1:{port}\nupstream: [{upstream}]\n"
                      f"brokers: {brokers}\nmetrics: {{listen: 127.0.0.1:{metrics_port}{metrics}}}\n"
                      f"rules_file: {rules_file}\nlog: {{level: WARNING}}\n{extra}")
    proc = subprocess.Popen([*GATEHOUSE, "run", "--config", str(config)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=(tmp / f"{name}.log").open("wb"))
    wait_listening(port, proc)
    wait_listening(metrics_port, proc)
    return proc, port, metrics_port, rules_file


def worker_pids(supervisor: int) -> list[int]:
    """The processes a supervisor (workers: N) started (from any of its threads: trio
    starts processes from a worker thread)."""
    return [int(pid) for task in Path(f"/proc/{supervisor}/task").iterdir()
            for pid in (task / "children").read_text().split()]


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    try:
        yield started
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.terminate()
        for proc in started:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class PrometheusApi:
    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"

    def get(self, path: str, **params: str) -> Any:
        url = f"{self.base}{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=10) as response:
            payload = json.load(response)
        assert payload["status"] == "success", payload
        return payload["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.get("/api/v1/query", query=expr)
        assert data["resultType"] == "vector", (expr, data["resultType"])
        return list(data["result"])

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base}/-/ready", timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return False


def has_data(result: list[dict[str, Any]]) -> bool:
    """At least one series with a finite value (NaN is what an empty panel shows)."""
    return any(math.isfinite(float(series["value"][1])) for series in result)


def dashboard_expressions(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    found = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            for target in panel.get("targets", []):
                found.append((panel["title"], target["expr"]))
            walk(panel.get("panels", []))

    walk(dashboard["panels"])
    return found


def substitute(expr: str) -> str:
    for name in sorted(VARIABLES, key=len, reverse=True):
        expr = expr.replace(name, VARIABLES[name])
    assert "$" not in expr, f"unknown variable in {expr}"
    return expr


def test_dashboard_is_importable() -> None:
    """The JSON Grafana imports: a datasource variable every query uses, unique ids,
    panels on the grid, and the rows the issue names."""
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids: list[int] = []
    rows = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            ids.append(panel["id"])
            assert {"h", "w", "x", "y"} <= set(panel["gridPos"])
            assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
            if panel["type"] == "row":
                rows.append(panel["title"])
            else:
                assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
                assert panel["targets"]
                for target in panel["targets"]:
                    assert target["datasource"]["uid"] == "${datasource}"
            walk(panel.get("panels", []))

    walk(dashboard["panels"])
    assert len(ids) == len(set(ids))
    for wanted in ("Throughput by API and topic", "Latency by API", "Errors by code",
                   "Client census", "Rule decisions", "Connections",
                   "Clients' own metrics (KIP-714)"):
        assert wanted in rows
    assert "__inputs" not in dashboard  # no hard-wired datasource to map on import


def test_alert_rules_parse_with_promtool() -> None:
    result = subprocess.run([tool("promtool"), "check", "rules", str(ALERTS)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 13 rules found" in result.stdout


def keep_traffic_flowing(bootstrap: str, dead_bootstrap: str, topic: str,
                         stop: threading.Event, errors: list[BaseException],
                         refused: list[int], broker: str, kms_topic: str) -> None:
    """Real clients until ``stop``: produce, consume in a group, get refused, and a client
    that keeps trying a proxy whose broker is gone; one that writes round the proxy
    (to ``broker``) records it cannot decrypt; and one whose records (of ``kms_topic``)
    wait for a KMS that is down."""
    conf = {"bootstrap.servers": bootstrap, "log_level": 0}
    producer = ck.Producer({**conf, "linger.ms": 5})
    forger = ck.Producer({"bootstrap.servers": broker, "log_level": 0})
    consumer = ck.Consumer({**conf, "group.id": unique("dash"), "auto.offset.reset":
                            "earliest", "session.timeout.ms": 6000})
    admin = AdminClient(conf)
    stranded = ck.Producer({"bootstrap.servers": dead_bootstrap, "log_level": 0,
                            "reconnect.backoff.ms": 100, "reconnect.backoff.max.ms": 500})
    try:
        consumer.subscribe([topic])
        i = 0
        while not stop.is_set():
            for _ in range(20):
                producer.produce(topic, value=f"v-{i}".encode())
                i += 1
            producer.produce(topic, value=b"\x00\x00\x00\x00\x07{}")  # schema 7
            producer.poll(0)
            forger.produce(topic, value=b"not sealed", headers=[("gatehouse.encryption", b"\x01")])
            forger.poll(0)
            if i % 200 == 0:  # retried by the producer until the KMS answers (never)
                producer.produce(kms_topic, value=b"waits for the KMS")
            consumer.poll(0.05)
            stranded.poll(0)
            # Refused by the `no-describe-configs` rule: an error response every time.
            future = admin.describe_configs([ConfigResource("topic", topic)],
                                            request_timeout=10)[ConfigResource("topic", topic)]
            try:
                future.result(10)
                errors.append(AssertionError("DescribeConfigs was not refused"))
            except ck.KafkaException as exc:
                refused.append(exc.args[0].code())
        producer.flush(10)
    except BaseException as exc:  # surfaced by the test
        errors.append(exc)
    finally:
        consumer.close()


def send_garbage(port: int) -> None:
    """A frame no Kafka client would send: the proxy closes that connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"\x00\x00\x00\x08garbage!")
        sock.settimeout(10)
        while sock.recv(4096):
            pass


def test_every_dashboard_and_alert_expression_returns_data(
        kafka: KafkaCluster, kafka_scram: KafkaCluster, tmp_path: Path,
        processes: list[subprocess.Popen[bytes]], tls_files: dict[str, str]) -> None:
    prometheus = tool("prometheus")
    topic = unique("dash")
    kafka.create_topic(topic, partitions=2)
    kms_topic = unique("kms")
    kafka.create_topic(kms_topic)
    # Every proxy refuses DescribeConfigs, and counts the values that are not JSON (an
    # observe-mode validate_records: written all the same).
    # Values in the Schema Registry's framing are looked up in a registry that is down
    # (observe mode: written all the same; each failure counted).
    # Its records are encrypted (a key file beside the rules files); records written
    # round the proxy under its header do not decrypt; those of kms_topic would be
    # encrypted under a KMS key, but nothing listens where the KMS should.
    (tmp_path / "keys.yaml").write_text("keys: {dash: " + base64.b64encode(os.urandom(32))
                                        .decode() + "}\n")
    rules = ("rules:\n  - name: no-describe-configs\n    deny_apis: [DescribeConfigs]\n"
             "  - name: kms-down\n    encrypt_records: {topics: [" + kms_topic + "], kms: "
             "{type: aws, key: alias/x, region: eu-west-1, endpoint: 'http://127.0.0.1:"
             f"{free_port()}', timeout_seconds: 1}}}}\n"
             "  - name: sealed\n    encrypt_records: {key_file: keys.yaml, key: dash}\n"
             "  - name: json-values\n    mode: observe\n    validate_records: {value: json}\n"
             "  - name: registered\n    mode: observe\n    validate_records:\n"
             f"      value: {{registry: {{url: 'http://127.0.0.1:{free_port()}', timeout: 1}}}}\n")
    # Its clients push their own metrics to it (KIP-714) every second.
    live, port, live_metrics, rules_file = start_gatehouse(
        tmp_path, "live", kafka.bootstrap, rules,
        metrics=", client_telemetry: {push_interval: 1}")
    processes.append(live)
    dead_upstream = f"127.0.0.1:{free_port()}"  # nothing listens there
    dead, dead_port, dead_metrics, _ = start_gatehouse(tmp_path, "dead", dead_upstream, rules)
    processes.append(dead)
    # In front of a SASL listener, with TLS for its clients: the principals' census, and
    # a certificate reload that fails.
    tls = tls_files
    sasl, sasl_port, sasl_metrics, _ = start_gatehouse(
        tmp_path, "sasl", kafka_scram.sasl_bootstrap, rules,
        f"tls: {{downstream: {{cert: {tls['cert']}, key: {tls['key']}}}}}\n")
    processes.append(sasl)
    # One connection per client address: a second one is refused.  Its clients would
    # log in with OAUTHBEARER tokens: a reload of the keys will fail.
    jwks = write_jwks(tmp_path / "jwks.json", rsa_key())
    crowded, crowded_port, crowded_metrics, _ = start_gatehouse(
        tmp_path, "crowded", kafka.bootstrap, rules,
        "limits: {max_connections_per_ip: 1}\n"
        f"sasl:\n  downstream:\n    oauthbearer: {{jwks_file: {jwks}}}\n")
    processes.append(crowded)
    # A supervisor of two workers (one endpoint for both): one of them will die.
    # ... whose clients have a quota of two requests a second.
    workers, workers_port, workers_metrics, _ = start_gatehouse(
        tmp_path, "workers", kafka.bootstrap,
        rules + "  - name: two-a-second\n    quota: {requests_per_second: 2}\n",
        "workers: 2\n", brokers=f"{{start_port: {free_port()}}}")
    processes.append(workers)

    prom_port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s",
                   "scrape_timeout": "1s"},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [{"job_name": "gatehouse", "static_configs": [{"targets": [
            f"127.0.0.1:{live_metrics}", f"127.0.0.1:{dead_metrics}",
            f"127.0.0.1:{sasl_metrics}", f"127.0.0.1:{crowded_metrics}",
            f"127.0.0.1:{workers_metrics}"]}]}],
    }))
    prom = subprocess.Popen(
        [prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "prometheus.log").open("wb"))
    processes.append(prom)
    api = PrometheusApi(prom_port)
    deadline = time.monotonic() + 60
    while not api.ready():
        assert prom.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "Prometheus did not become ready"
        time.sleep(0.1)
    # Both targets scraped once before the events the alerts watch for, so their
    # counters have a "before" sample.
    while len([s for s in api.query('up{job="gatehouse"} == 1')]) < 5 or not api.query(
            'gatehouse_workers{state="ready"} == 2'):
        assert time.monotonic() < deadline, api.get("/api/v1/targets")
        time.sleep(0.2)

    stop = threading.Event()
    errors: list[BaseException] = []
    refused: list[int] = []
    traffic = threading.Thread(target=keep_traffic_flowing,
                               args=(f"127.0.0.1:{port}", f"127.0.0.1:{dead_port}", topic,
                                     stop, errors, refused, kafka.bootstrap, kms_topic),
                               daemon=True)
    traffic.start()
    # An authenticated client that stays connected (SCRAM over TLS, as the broker's user).
    authenticated = AdminClient({**kafka_scram.client_config(sasl=True), "log_level": 0,
                                 "bootstrap.servers": f"127.0.0.1:{sasl_port}",
                                 "security.protocol": "SASL_SSL",
                                 "ssl.ca.location": tls["ca"]})
    assert authenticated.list_topics(timeout=30).topics is not None
    crowd = [socket.create_connection(("127.0.0.1", crowded_port), timeout=10)
             for _ in range(2)]
    try:
        send_garbage(port)
        # A rules reload that fails: the old rules stay, the alert must fire.
        rules_file.write_text("rules:\n  - name: broken\n    deny_apis: [NoSuchApi]\n")
        live.send_signal(signal.SIGHUP)
        # A certificate rotation that goes wrong: the old certificate stays, the alert fires.
        Path(tls["cert"]).write_text("-----BEGIN CERTIFICATE-----\nhalf written\n")
        sasl.send_signal(signal.SIGHUP)
        # The identity provider's keys replaced by something that is not a JWKS.
        jwks.write_text('{"keys": "half written')
        crowded.send_signal(signal.SIGHUP)
        # Clients with a wrong password: the broker refuses each (SASL passed through).
        # One first, scraped, so that the next ones are an increase of a known counter.
        for attempt in range(7):
            if attempt == 1:
                while not api.query('gatehouse_responses_total{api="SaslAuthenticate", '
                                    'error="SASL_AUTHENTICATION_FAILED"}'):
                    assert time.monotonic() < deadline + DEADLINE, "never scraped"
                    time.sleep(0.2)
            failures: list[ck.KafkaError] = []
            guessing = ck.Producer({**kafka_scram.client_config(sasl=True), "log_level": 0,
                                    "bootstrap.servers": f"127.0.0.1:{sasl_port}",
                                    "security.protocol": "SASL_SSL",
                                    "ssl.ca.location": tls["ca"], "sasl.password": "guess",
                                    "error_cb": failures.append})
            deadline_guess = time.monotonic() + 30
            while not failures and time.monotonic() < deadline_guess:
                guessing.poll(0.1)
            assert failures and failures[0].code() == ck.KafkaError._AUTHENTICATION, failures
            del guessing
        # A client over its quota: held back.
        held = AdminClient({"bootstrap.servers": f"127.0.0.1:{workers_port}", "log_level": 0})
        for _ in range(8):
            assert held.list_topics(timeout=30).topics is not None
        # A worker dies (as at the OOM killer's hand); the supervisor restarts it.
        os.kill(worker_pids(workers.pid)[0], signal.SIGKILL)

        dashboard = json.loads(DASHBOARD.read_text())
        expressions = [(title, substitute(expr))
                       for title, expr in dashboard_expressions(dashboard)]
        alert_rules = yaml.safe_load(ALERTS.read_text())["groups"][0]["rules"]
        expressions += [(f"alert {r['alert']}", r["expr"]) for r in alert_rules]
        assert len(expressions) >= 30

        pending = dict.fromkeys(expr for _, expr in expressions)
        deadline = time.monotonic() + DEADLINE
        while pending and time.monotonic() < deadline:
            assert not errors, errors
            for expr in list(pending):
                if has_data(api.query(expr)):
                    del pending[expr]
            if pending:
                time.sleep(0.5)
        empty = [f"{title}: {expr}" for title, expr in expressions if expr in pending]
        assert not empty, "no data from:\n" + "\n".join(empty)

        # The template variables' own queries (label_values) find both proxies.
        for label in ("job", "instance"):
            values = api.get(f"/api/v1/label/{label}/values",
                             **{"match[]": "gatehouse_requests_total"})
            assert values, label
        assert {"gatehouse"} <= set(api.get("/api/v1/label/job/values"))

        # Prometheus loaded the rules file and every alert went active (pending/firing).
        groups = api.get("/api/v1/rules")["groups"]
        loaded = {r["name"]: r for g in groups for r in g["rules"]}
        assert set(loaded) == {r["alert"] for r in alert_rules}
        assert all(r["health"] == "ok" for r in loaded.values()), loaded
        wanted = set(loaded)
        deadline = time.monotonic() + 30
        active: set[str] = set()
        while not wanted <= active and time.monotonic() < deadline:
            active = {a["labels"]["alertname"] for a in api.get("/api/v1/alerts")["alerts"]}
            if not wanted <= active:
                time.sleep(0.5)
        assert wanted <= active, f"never active: {wanted - active}"
        firing: dict[str, set[str]] = {}
        for alert in api.get("/api/v1/alerts")["alerts"]:
            firing.setdefault(alert["labels"]["alertname"], set()).add(
                alert["labels"]["instance"])
        # Each alert points at the right proxy (the error ratio: the live one, and the
        # SASL one, whose broker refused the clients guessing passwords).
        live_instance = f"127.0.0.1:{live_metrics}"
        sasl_instance = f"127.0.0.1:{sasl_metrics}"
        assert firing["GatehouseBrokerUnreachable"] == {f"127.0.0.1:{dead_metrics}"}
        assert live_instance in firing["GatehouseHighErrorRatio"]
        for name in ("GatehouseRefusalsSpike", "GatehouseRulesReloadFailed"):
            assert firing[name] == {live_instance}, name
        assert firing["GatehouseTlsReloadFailed"] == {sasl_instance}
        assert firing["GatehouseConnectionsRefused"] == {f"127.0.0.1:{crowded_metrics}"}
        assert firing["GatehouseJwksLoadFailed"] == {f"127.0.0.1:{crowded_metrics}"}
        assert firing["GatehouseWorkerRestarted"] == {f"127.0.0.1:{workers_metrics}"}
        assert firing["GatehouseSaslAuthenticationFailures"] == {sasl_instance}
        assert live_instance in firing["GatehouseInvalidRecords"]
        assert live_instance in firing["GatehouseUndecryptableRecords"]
        # The authenticated client's connection, and new ones, still work.
        assert authenticated.list_topics(timeout=30).topics is not None
    finally:
        for held in crowd:
            held.close()
        stop.set()
        traffic.join(60)
    assert not errors, errors
    # The clients saw the refusals the counters count.
    assert set(refused) == {ck.KafkaError.CLUSTER_AUTHORIZATION_FAILED}, set(refused)
