"""The sidecar pattern for real: a "pod" network namespace holding the application and
Gatehouse, a "cluster" namespace holding the broker (Tansu), a veth pair between them.

The pod runs exactly what deploy/kubernetes/base/sidecar renders: the proxy's config and
rules from the rendered ConfigMaps (a directory laid out like the projected volume), the
proxy as the container's user, the application as its own user with the bootstrap address
from its env. The pod's egress rule (nftables, as a mesh's init container would install)
lets only the proxy's user reach the cluster, so the application's traffic works only if
every broker address it is given points back at the proxy.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gatehouse.proxy.config import load_config
from tests.support.deploy import (
    ROOT,
    by_kind,
    config_path_of,
    gatehouse_container,
    render,
    volume_at,
    volume_files,
    write_volume,
)
from tests.support.netns import Netns, NetnsUnavailable, connect_veth, nft, unique_name
from tests.support.tansu import tansu_binary

POD_IP, CLUSTER_IP = "198.18.0.1", "198.18.0.2"
BROKER_NAME = "kafka-0.kafka-headless.kafka.svc.cluster.local"
COUNT = 20

APP = """
import json, os, socket, sys
import confluent_kafka as ck
from confluent_kafka.admin import AdminClient, NewTopic
from tests.support.clients import consume, produce

topic, broker_host, broker_port = sys.argv[1], sys.argv[2], int(sys.argv[3])
report = {"uid": os.getuid()}
try:
    socket.create_connection((broker_host, broker_port), timeout=5).close()
    report["direct"] = "connected"
except OSError as exc:
    report["direct"] = type(exc).__name__
conf = {"bootstrap.servers": os.environ["KAFKA_BOOTSTRAP_SERVERS"]}
sent = produce(conf, topic, count=int(sys.argv[4]), tag="sidecar")
got = consume(conf, topic, len(sent))
report["produced"], report["consumed_same"] = len(sent), sorted(got) == sorted(sent)
admin = AdminClient({**conf, "log_level": 3})
future = admin.create_topics(
    [NewTopic(topic + "-x", num_partitions=1, replication_factor=1)])[topic + "-x"]
try:
    future.result(timeout=30)
    report["create_topics"] = "created"
except ck.KafkaException as exc:
    report["create_topics"] = exc.args[0].name()
print(json.dumps(report))
"""

CREATE_TOPIC = """
import sys
from confluent_kafka.admin import AdminClient, NewTopic
admin = AdminClient({"bootstrap.servers": sys.argv[1]})
admin.create_topics([NewTopic(sys.argv[2], num_partitions=1, replication_factor=1)])[
    sys.argv[2]].result(timeout=30)
"""


@pytest.fixture
def pod_and_cluster() -> Iterator[tuple[Netns, Netns]]:
    pod, cluster = Netns(unique_name("ghpod")), Netns(unique_name("ghcl"))
    try:
        pod.create()
    except NetnsUnavailable as exc:
        pytest.skip(f"network namespaces cannot be created here: {exc}")
    try:
        cluster.create()
        connect_veth(pod, POD_IP, cluster, CLUSTER_IP)
        yield pod, cluster
    finally:
        pod.delete()
        cluster.delete()


def stop(processes: list[subprocess.Popen[Any]]) -> None:
    for process in reversed(processes):
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def test_application_reaches_the_cluster_only_through_the_sidecar(
        pod_and_cluster: tuple[Netns, Netns], tmp_path: Path) -> None:
    pod_ns, cluster_ns = pod_and_cluster
    objects = render("base/sidecar")
    [deployment] = by_kind(objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    proxy = gatehouse_container(pod)
    [app] = pod["containers"]
    app_env = {e["name"]: e["value"] for e in app["env"]}
    proxy_uid, app_uid = proxy["securityContext"]["runAsUser"], app["securityContext"]["runAsUser"]

    config_path = config_path_of(proxy)
    _, volume = volume_at(pod, proxy, config_path.parent)
    etc = tmp_path / "etc-gatehouse"
    write_volume(etc, volume_files(volume, objects, {}))
    config_file = etc / config_path.name
    config = load_config(config_file)
    [upstream] = config.upstream
    assert config.metrics_listen is not None

    # DNS as the pod sees it: the cluster's names point across the veth.
    pod_ns.write_hosts({upstream.host: CLUSTER_IP, BROKER_NAME: CLUSTER_IP})
    cluster_ns.write_hosts({BROKER_NAME: CLUSTER_IP})
    nft(pod_ns, f"""
table inet pod_egress {{
    chain output {{
        type filter hook output priority 0; policy accept;
        ip daddr {CLUSTER_IP} meta skuid != {proxy_uid} reject
    }}
}}
""")

    processes: list[subprocess.Popen[Any]] = []
    try:
        listener = f"tcp://{CLUSTER_IP}:{upstream.port}"
        processes.append(cluster_ns.popen(
            [str(tansu_binary()), "broker", "--listener-url", listener,
             "--advertised-listener-url", f"tcp://{BROKER_NAME}:{upstream.port}",
             "--storage-engine", "memory://tansu/"], cwd=tmp_path,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        topic = f"sidecar-{int(time.time() * 1000)}"
        deadline = time.monotonic() + 30
        while (created := cluster_ns.run(
                [sys.executable, "-c", CREATE_TOPIC, f"{CLUSTER_IP}:{upstream.port}", topic],
                cwd=ROOT)).returncode != 0:
            assert processes[0].poll() is None, "tansu exited"
            assert time.monotonic() < deadline, created.stderr[-2000:]
            time.sleep(0.2)

        gatehouse = pod_ns.popen(
            [sys.executable, "-m", "gatehouse.cli", "run", "--config", str(config_file)],
            uid=proxy_uid, cwd=ROOT, text=True, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE)
        processes.append(gatehouse)
        deadline = time.monotonic() + 30
        metrics = f"http://127.0.0.1:{config.metrics_listen.port}"
        readyz = ("import sys, urllib.request\n"
                  "urllib.request.urlopen(sys.argv[1], timeout=3)\n")
        while pod_ns.run([sys.executable, "-c", readyz, metrics + "/readyz"]).returncode != 0:
            assert gatehouse.poll() is None, gatehouse.stderr.read() if gatehouse.stderr else ""
            assert time.monotonic() < deadline, "the sidecar never became ready"
            time.sleep(0.2)

        # The proxy's user may cross to the cluster; the egress rule is per user.
        probe = ("import socket, sys\n"
                 "socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5).close()\n")
        direct_as_proxy = pod_ns.run([sys.executable, "-c", probe, upstream.host,
                                      str(upstream.port)], uid=proxy_uid)
        assert direct_as_proxy.returncode == 0, direct_as_proxy.stderr

        result = pod_ns.run([sys.executable, "-c", APP, topic, upstream.host,
                             str(upstream.port), str(COUNT)],
                            uid=app_uid, cwd=ROOT, timeout=180,
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), **app_env})
        assert result.returncode == 0, result.stderr[-3000:]
        report = json.loads(result.stdout.strip().splitlines()[-1])
        assert report == {"uid": app_uid, "direct": "ConnectionRefusedError",
                          "produced": COUNT, "consumed_same": True,
                          "create_topics": "CLUSTER_AUTHORIZATION_FAILED"}

        scraped = pod_ns.run([sys.executable, "-c",
                              "import sys, urllib.request\n"
                              "print(urllib.request.urlopen(sys.argv[1]).read().decode())",
                              metrics + "/metrics"])
        produced = re.search(rf'^gatehouse_topic_records_total\{{direction="produce",'
                             rf'topic="{topic}"\}} (\S+)$', scraped.stdout, re.M)
        assert produced is not None and float(produced.group(1)) == COUNT
        # The application's own client metrics (KIP-714) beside the proxy's: the
        # sidecar's config receives them, the broker (Tansu) has no part in it.
        pushed = re.search(r'^kafka_client_producer_record_queue_time_avg\{.*'
                           r'client_software_name="confluent-kafka-python".*\} \S+$',
                           scraped.stdout, re.M)
        assert pushed is not None, [line for line in scraped.stdout.splitlines()
                                    if "telemetry" in line]
    finally:
        stop(processes)
        for process in processes:
            if process.stderr is not None:
                process.stderr.close()
