"""deploy/kubernetes: rendered with kustomize, validated against Kubernetes' own schemas
(kubernetes-validate, strict) and the prometheus-operator CRD schemas (npm
@kubernetes-models/prometheus-operator), wired consistently with the gatehouse config it
carries, and that config run for real (in a network namespace, so the exact ports can be
used) to show the probes hit endpoints that answer."""

from __future__ import annotations

import copy
import ipaddress
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import trustme

from gatehouse.proxy.config import ProxyConfig, load_config
from gatehouse.rules import load_rules_file
from tests.support.deploy import (
    KUSTOMIZATIONS,
    by_kind,
    config_path_of,
    gatehouse_container,
    image_user,
    render,
    tools_dir,
    volume_at,
    volume_files,
    write_volume,
)
from tests.support.netns import Netns, namespace_or_skip
from tests.support.tansu import tansu_binary

KUBERNETES_VERSION = "1.33.0"  # the schemas' version (kubernetes-validate ships 1.25-1.37)
CRD_KINDS = {"PodMonitor", "ServiceMonitor"}
POD_IP = "198.18.7.1"


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {name: render(name) for name in KUSTOMIZATIONS}


@pytest.fixture(scope="module")
def tls_secret() -> dict[str, bytes]:
    ca = trustme.CA()
    cert = ca.issue_cert("kafka.example.com", "kafka.prod.example.com")
    return {"tls.crt": cert.cert_chain_pems[0].bytes(), "tls.key": cert.private_key_pem.bytes()}


def secrets(tls_secret: dict[str, bytes]) -> dict[str, dict[str, bytes]]:
    """The Secrets the overlays' comments tell the operator to create."""
    made = subprocess.run([sys.executable, "-m", "gatehouse.cli", "credential", "team-a",
                           "--iterations", "4096"], input="a-password\n", text=True,
                          capture_output=True, check=True)
    return {"gatehouse-edge-tls": tls_secret,
            "gatehouse-edge-users": {"users.yaml": made.stdout.encode()}}


# -- schemas ---------------------------------------------------------------------------------

def validate_core(obj: dict[str, Any]) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


VALIDATE_CRDS_JS = """
const dir = process.argv[1] + "/node_modules/@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/";
const kinds = {
  PodMonitor: (await import(dir + "PodMonitor.js")).PodMonitor,
  ServiceMonitor: (await import(dir + "ServiceMonitor.js")).ServiceMonitor,
};
let input = "";
for await (const chunk of process.stdin) input += chunk;
const results = JSON.parse(input).map((obj) => {
  try { new kinds[obj.kind](obj).validate(); return null; } catch (e) { return String(e.message); }
});
console.log(JSON.stringify(results));
"""


def validate_crds(objects: list[dict[str, Any]]) -> list[str | None]:
    """One error (or None) per object, from the CRD schemas' generated validators."""
    prefix = tools_dir() / "node"
    if not (prefix / "node_modules" / "@kubernetes-models" / "prometheus-operator").is_dir():
        pytest.fail(f"@kubernetes-models/prometheus-operator is not in {prefix}: "
                    "run `sh scripts/install_deploy_tools.sh` (make test does)")
    result = subprocess.run(["node", "--input-type=module", "-e", VALIDATE_CRDS_JS,
                             str(prefix)], input=json.dumps(objects), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    errors: list[str | None] = json.loads(result.stdout)
    return errors


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_object_validates(rendered: dict[str, list[dict[str, Any]]],
                                kustomization: str) -> None:
    objects = rendered[kustomization]
    kinds = sorted({o["kind"] for o in objects})
    assert {"ConfigMap", "Deployment"} <= set(kinds)
    assert CRD_KINDS & set(kinds), "a PodMonitor or ServiceMonitor for Prometheus"
    for obj in objects:
        if obj["kind"] not in CRD_KINDS:
            validate_core(obj)
    crds = [o for o in objects if o["kind"] in CRD_KINDS]
    assert validate_crds(crds) == [None] * len(crds)


def test_the_validators_reject_broken_objects(rendered: dict[str, list[dict[str, Any]]]
                                              ) -> None:
    import kubernetes_validate

    deployment = copy.deepcopy(by_kind(rendered["base/edge"], "Deployment")[0])
    deployment["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "x"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_core(deployment)
    typo = copy.deepcopy(by_kind(rendered["base/edge"], "Deployment")[0])
    typo["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_core(typo)  # strict: unknown fields are errors
    monitor = copy.deepcopy(by_kind(rendered["base/sidecar"], "PodMonitor")[0])
    monitor["spec"]["podMetricsEndpoints"][0]["port"] = 9464  # must be a port *name*
    no_selector = copy.deepcopy(by_kind(rendered["base/edge"], "ServiceMonitor")[0])
    del no_selector["spec"]["selector"]
    errors = validate_crds([monitor, no_selector])
    assert errors[0] is not None and "port" in errors[0]
    assert errors[1] is not None and "selector" in errors[1]


# -- wiring ------------------------------------------------------------------------------------

def is_loopback(host: str) -> bool:
    return host == "localhost" or ipaddress.ip_address(host).is_loopback


def materialize(objects: list[dict[str, Any]], deployment: dict[str, Any],
                tls_secret: dict[str, bytes], directory: Path) -> tuple[Path, PurePosixPath]:
    """The gatehouse volume of ``deployment``'s pod, written out as the kubelet would;
    returns (the config file there, the config path in the container)."""
    pod = deployment["spec"]["template"]["spec"]
    container = gatehouse_container(pod)
    config_path = config_path_of(container)
    mount, volume = volume_at(pod, container, config_path.parent)
    assert mount.get("readOnly") is True
    assert "subPath" not in mount, "subPath mounts never see ConfigMap updates"
    files = volume_files(volume, objects, secrets(tls_secret))
    write_volume(directory, files)
    return directory / config_path.name, config_path


def container_ports(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def resolve_port(port: int | str, container: dict[str, Any]) -> int:
    return container_ports(container)[port] if isinstance(port, str) else port


def config_ports(config: ProxyConfig) -> dict[str, int]:
    """The ports the config listens on where other pods (or kubelet) can reach them."""
    ports: dict[str, int] = {}
    if not is_loopback(config.listen.host):
        ports["bootstrap"] = config.listen.port
    broker_host = config.brokers.listen_host or config.listen.host
    if config.brokers.sni is None and not is_loopback(broker_host):
        assert config.brokers.start_port is None, \
            "reachable broker ports must be pinned (brokers.ports) to be declared"
        for node, port in config.brokers.ports.items():
            ports[f"broker-{node}"] = port
    assert config.metrics_listen is not None
    ports["metrics"] = config.metrics_listen.port
    return ports


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_wiring(rendered: dict[str, list[dict[str, Any]]], kustomization: str,
                tls_secret: dict[str, bytes], tmp_path: Path) -> None:
    objects = rendered[kustomization]
    [deployment] = by_kind(objects, "Deployment")
    template = deployment["spec"]["template"]
    pod, labels = template["spec"], template["metadata"]["labels"]
    assert selects(deployment["spec"]["selector"]["matchLabels"], labels)
    container = gatehouse_container(pod)

    # The ConfigMap keys the volume names exist and land where the config says: loading the
    # config checks that rules_file and the TLS files exist (paths relative to the config).
    config_file, _ = materialize(objects, deployment, tls_secret, tmp_path / "etc-gatehouse")
    config = load_config(config_file)
    assert config.rules_file is not None
    assert config.rules_file.parent == config_file.parent
    assert load_rules_file(config.rules_file).rules
    if config.tls_downstream is not None:
        assert config.tls_downstream.cert.read_bytes() == tls_secret["tls.crt"]
    if config.sasl_downstream is not None:  # the users Secret lands where it is read
        assert config.sasl_downstream.users_file.parent.parent == config_file.parent
        assert "team-a" in config.sasl_downstream.users_file.read_text()

    # Container ports are exactly the config's reachable listeners.
    assert config.metrics_listen is not None and not is_loopback(config.metrics_listen.host)
    assert container_ports(container) == config_ports(config)

    # Probes: the metrics port, the endpoints serve_metrics answers.
    metrics_port = config.metrics_listen.port
    probes = {kind: container[kind]["httpGet"] for kind in
              ("startupProbe", "livenessProbe", "readinessProbe")}
    assert {kind: (resolve_port(p["port"], container), p["path"]) for kind, p in probes.items()} \
        == {"startupProbe": (metrics_port, "/healthz"), "livenessProbe": (metrics_port, "/healthz"),
            "readinessProbe": (metrics_port, "/readyz")}

    # The container runs as the image's user, read-only.
    security = container["securityContext"]
    assert security["runAsUser"] == image_user()
    assert security["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod.get("terminationGracePeriodSeconds", 30) > config.limits.shutdown_grace

    # Sidecar: the application's only Kafka address is the proxy on loopback.
    if is_loopback(config.listen.host):
        assert container in pod.get("initContainers", []) \
            and container.get("restartPolicy") == "Always", "a native sidecar"
        apps = [c for c in pod["containers"] if c is not container]
        assert apps
        for app in apps:
            env = {e["name"]: e.get("value") for e in app.get("env", [])}
            assert env["KAFKA_BOOTSTRAP_SERVERS"] == f"localhost:{config.listen.port}"
            assert app["securityContext"]["runAsUser"] != security["runAsUser"]

    # Services: each selects this pod, carries a declared port, and the externally
    # advertised ports (bootstrap, broker-N) keep their numbers: clients dial what the proxy
    # advertises, advertise_host:port (with brokers.sni, every broker's name on the
    # advertised port).
    services = [s for s in by_kind(objects, "Service") if selects(s["spec"]["selector"], labels)]
    if not is_loopback(config.listen.host):
        served = {p["name"]: p for s in services for p in s["spec"]["ports"]}
        sni = config.brokers.sni
        for name, port in config_ports(config).items():
            assert name in served, f"no Service port for {name}"
            assert resolve_port(served[name]["targetPort"], container) == port
            if name != "metrics":
                told = sni.advertise_port if sni is not None else None
                assert served[name]["port"] == (told or port)

    # At the edge: replicas spread over nodes and zones, and evicted one at a time (a
    # budget that selects them and always leaves one serving).
    if not is_loopback(config.listen.host):
        replicas = deployment["spec"]["replicas"]
        assert replicas >= 2
        spread = pod["topologySpreadConstraints"]
        assert {c["topologyKey"] for c in spread} == {"kubernetes.io/hostname",
                                                      "topology.kubernetes.io/zone"}
        assert all(selects(c["labelSelector"]["matchLabels"], labels) for c in spread)
        [budget] = [b for b in by_kind(objects, "PodDisruptionBudget")
                    if selects(b["spec"]["selector"]["matchLabels"], labels)]
        assert 1 <= budget["spec"]["maxUnavailable"] < replicas

    # Prometheus: the monitor selects this pod (or a Service of it) and its metrics port.
    for monitor in by_kind(objects, "PodMonitor"):
        assert selects(monitor["spec"]["selector"]["matchLabels"], labels)
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            assert resolve_port(endpoint["port"], container) == metrics_port
            assert endpoint["path"] == "/metrics"
    for monitor in by_kind(objects, "ServiceMonitor"):
        [service] = [s for s in services
                     if selects(monitor["spec"]["selector"]["matchLabels"],
                                s["metadata"].get("labels", {}))]
        [port] = [p for p in service["spec"]["ports"]
                  if p["name"] == monitor["spec"]["endpoints"][0]["port"]]
        assert resolve_port(port["targetPort"], container) == metrics_port
        assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"


def test_rules_reload_in_place_and_config_rolls(rendered: dict[str, list[dict[str, Any]]]
                                                ) -> None:
    """Rules ConfigMaps keep their name (updated in place: hot reload); config ConfigMaps
    carry a content hash (a change rolls the pods: listeners need a restart)."""
    for name in KUSTOMIZATIONS:
        names = [o["metadata"]["name"] for o in by_kind(rendered[name], "ConfigMap")]
        assert sorted(n for n in names if "-rules" in n) == [
            f"gatehouse-{name.split('/')[1].split('-')[0]}-rules"]
        [config_map] = [n for n in names if "-config" in n]
        assert config_map.rsplit("-", 1)[1].isalnum() and config_map.count("-") == 3


# -- the probes, against the exact config -------------------------------------------------------

def get_status(ns: Netns, url: str) -> int:
    script = ("import sys, urllib.request, urllib.error\n"
              "try:\n"
              "    print(urllib.request.urlopen(sys.argv[1], timeout=3).status)\n"
              "except urllib.error.HTTPError as e:\n"
              "    print(e.code)\n"
              "except OSError:\n"
              "    print(0)\n")
    result = ns.run([sys.executable, "-c", script, url], timeout=30)
    assert result.returncode == 0, result.stderr
    return int(result.stdout)


@pytest.fixture
def netns() -> Iterator[Netns]:
    yield from namespace_or_skip("ghprobe")


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_probes_answer_on_the_exact_config(rendered: dict[str, list[dict[str, Any]]],
                                           kustomization: str, tls_secret: dict[str, bytes],
                                           netns: Netns, tmp_path: Path) -> None:
    """The rendered config, unchanged, in a namespace of its own: its upstream names resolve
    to a Tansu broker there; the probes' URLs (pod IP, probe port, probe path) answer."""
    objects = rendered[kustomization]
    [deployment] = by_kind(objects, "Deployment")
    container = gatehouse_container(deployment["spec"]["template"]["spec"])
    config_file, _ = materialize(objects, deployment, tls_secret, tmp_path / "etc-gatehouse")
    config = load_config(config_file)
    netns.add_address(POD_IP)
    netns.write_hosts({a.host: "127.0.0.1" for a in config.upstream})
    [upstream_port] = {a.port for a in config.upstream}
    url = f"tcp://127.0.0.1:{upstream_port}"
    processes: list[subprocess.Popen[bytes]] = []
    try:
        processes.append(netns.popen(
            [str(tansu_binary()), "broker", "--listener-url", url, "--advertised-listener-url",
             url, "--storage-engine", "memory://tansu/"], cwd=tmp_path,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        processes.append(netns.popen(
            [sys.executable, "-m", "gatehouse.cli", "run", "--config", str(config_file)],
            uid=container["securityContext"]["runAsUser"], stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE))
        probes = {kind: container[kind]["httpGet"] for kind in
                  ("startupProbe", "livenessProbe", "readinessProbe")}
        deadline = time.monotonic() + 30
        for kind, probe in probes.items():
            port = resolve_port(probe["port"], container)
            while (status := get_status(netns, f"http://{POD_IP}:{port}{probe['path']}")) != 200:
                gatehouse = processes[1]
                assert gatehouse.poll() is None, gatehouse.stderr.read() if gatehouse.stderr \
                    else ""
                assert time.monotonic() < deadline, f"{kind}: {probe['path']} answered {status}"
                time.sleep(0.2)
        assert config.metrics_listen is not None
        assert get_status(netns, f"http://{POD_IP}:{config.metrics_listen.port}/metrics") == 200
        assert get_status(netns, f"http://{POD_IP}:{config.metrics_listen.port}/nope") == 404
    finally:
        for process in reversed(processes):
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            if process.stderr is not None:
                process.stderr.close()
