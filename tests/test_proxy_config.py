"""The proxy config: the minimal file works, mistakes are reported with file:line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gatehouse.cli import main
from gatehouse.configfile import ConfigError
from gatehouse.proxy.config import Address, config_from_text, load_config, usable_cpus


def test_minimal_config() -> None:
    config = config_from_text("listen: 127.0.0.1:9192\nupstream: [127.0.0.1:9092]\n")
    assert config.listen == Address("127.0.0.1", 9192)
    assert config.upstream == (Address("127.0.0.1", 9092),)
    assert config.advertise_host == "127.0.0.1"
    assert config.brokers.port_for(1) == 9194  # port-per-broker from listen + 1
    assert config.limits.max_frame_bytes == 100 * 1024 * 1024


def test_full_config(tmp_path: Path) -> None:
    (tmp_path / "c.pem").write_text("x")
    (tmp_path / "k.pem").write_text("x")
    text = """
listen: 0.0.0.0:9192
upstream: "b1:9092, b2:9092"
advertise_host: kafka.example.com
brokers:
  start_port: 20000
  ports: {7: 30007}
limits: {max_frame_bytes: 1048576, idle_timeout: 60, connect_timeout: 2.5,
         max_buffered_request_bytes: 33554432, max_buffered_response_bytes: 67108864}
tls:
  downstream: {cert: c.pem, key: k.pem}
  upstream: {verify: false, server_hostname: kafka.internal}
log: {level: debug, json: true}
"""
    config = config_from_text(text, "proxy.yaml", tmp_path)
    assert [str(a) for a in config.upstream] == ["b1:9092", "b2:9092"]
    assert config.advertise_host == "kafka.example.com"
    assert config.brokers.port_for(7) == 30007
    assert config.brokers.port_for(3) == 20003
    assert config.limits.idle_timeout == 60.0
    assert config.limits.max_buffered_request_bytes == 32 * 1024 * 1024
    assert config.limits.max_buffered_response_bytes == 64 * 1024 * 1024
    assert config.tls_downstream is not None and config.tls_downstream.cert == tmp_path / "c.pem"
    assert config.tls_upstream is not None and not config.tls_upstream.verify
    assert config.log_level == "DEBUG" and config.log_json


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        ("listen: 127.0.0.1:9192\n", 1, "needs 'upstream'"),
        ("listen: 127.0.0.1:9192\nupstream: [x:1]\nlimts: {}\n", 3, "unknown key 'limts'"),
        ("listen: 127.0.0.1:9192\nupstream: [x:1]\nlimits:\n  idle_timeout: -1\n", 4,
         "must be positive"),
        ("listen: 127.0.0.1:9192\nupstream:\n  - x:1\n  - nonsense\n", 4, "'host:port'"),
        ("listen: 127.0.0.1:9192\nupstream: [x:1]\nlimits: {max_connections: yes}\n", 3,
         "not a boolean"),
        ("listen: 127.0.0.1:9192\nupstream: [x:1]\nlimits:\n  max_buffered_request_bytes: 0\n",
         4, "must be positive"),
        ("listen: 127.0.0.1:9192\nupstream: [x:1]\nlimits:\n  max_connections_per_ip: 0\n",
         4, "must be positive"),
        ("listen: 127.0.0.1:9192\nupstream: [x:1]\nlimits:\n  max_connection_age: soon\n",
         4, "must be an integer or a number"),
        ("listen: 1.2.3.4:5\nupstream: [x:1]\nadvertise_host: kafka.example.com\n"
         "brokers: {sni: {bootstrap: b, broker: b-$(nodeId)}}\n", 3,
         "advertise_host has no effect with brokers.sni"),
        ("listen: 127.0.0.1:0\nupstream: [x:1]\nreuse_port: true\n", 3,
         "reuse_port needs a fixed listen port"),
        ("listen: 127.0.0.1:9192\nupstream: [x:1]\nbrokers: {start_port: 0}\n"
         "reuse_port: true\n", 4, "reuse_port needs fixed broker ports"),
        ("listen: 127.0.0.1:0\nupstream: [x:1]\nworkers: 2\n", 3,
         "workers above 1 need a fixed listen port"),
        ("listen: 127.0.0.1:9192\nupstream: [x:1]\nbrokers: {start_port: 0}\n"
         "workers: 4\n", 4, "workers above 1 need fixed broker ports"),
        ("listen: 127.0.0.1:9192\nupstream: [x:1]\nworkers: 0\n", 3,
         "workers must be a number from 1 to 256 or 'auto', not 0"),
        ("listen: 127.0.0.1:9192\nupstream: [x:1]\nworkers: many\n", 3,
         "not 'many'"),
        ("listen: 127.0.0.1:9192\nupstream: [x:1]\nworkers: true\n", 3, "not a boolean"),
        ("listen: [unclosed\n", 2, "not valid YAML"),
        ("listen: 1.2.3.4:5\nlisten: 1.2.3.4:6\nupstream: [x:1]\n", 2, "duplicate key"),
        ("listen: 1.2.3.4:5\nupstream: [x:1]\ntls:\n  downstream: {cert: nope.pem, key: k}\n",
         4, "does not exist"),
    ],
)
def test_errors_say_file_and_line(text: str, line: int, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_text(text, "proxy.yaml")
    assert info.value.file == "proxy.yaml"
    assert info.value.line == line, str(info.value)
    assert message in str(info.value)
    assert str(info.value).startswith(f"proxy.yaml:{line}: ")


def test_check_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("listen: 127.0.0.1:9192\nupstream: [127.0.0.1:9092]\n")
    assert main(["check", "--config", str(good)]) == 0
    out = capsys.readouterr().out
    assert "ok" in out and "byte readers: c\n" in out  # built here (tests/test_speedups.py)
    assert "metrics counting: c\n" in out
    assert "capture records: c\n" in out
    assert "metrics.listen" not in out  # no metrics endpoint configured
    for said, told in (("", "to loopback clients only (metrics.connections: local)"),
                       (", connections: any", "to whoever reaches it (metrics.connections: any)"),
                       (", connections: off", "not served (metrics.connections: off)")):
        good.write_text("listen: 127.0.0.1:9192\nupstream: [127.0.0.1:9092]\n"
                        f"metrics: {{listen: 9464{said}}}\n")
        assert main(["check", "--config", str(good)]) == 0
        assert ("metrics.listen 127.0.0.1:9464: /metrics, /healthz, /readyz; /connections "
                f"(who is connected) {told}\n") in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("listen: 127.0.0.1:9192\nupstream: [127.0.0.1:9092]\nrulez: []\n")
    assert main(["check", "--config", str(bad)]) == 1
    assert f"{bad}:3: unknown key 'rulez'" in capsys.readouterr().err
    assert main(["check", "--config", str(tmp_path / "missing.yaml")]) == 1
    assert "cannot read" in capsys.readouterr().err


def test_load_config_resolves_paths_next_to_the_file(tmp_path: Path) -> None:
    (tmp_path / "ca.pem").write_text("x")
    path = tmp_path / "proxy.yaml"
    path.write_text("listen: 127.0.0.1:1\nupstream: [a:1]\ntls: {upstream: {ca: ca.pem}}\n")
    config = load_config(path)
    assert config.tls_upstream is not None and config.tls_upstream.ca == tmp_path / "ca.pem"


def test_a_deeply_nested_file_is_a_config_error(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "gatehouse.yaml"
    path.write_text("listen: 127.0.0.1:9192\nupstream: [127.0.0.1:9092]\nrules: "
                    + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ConfigError, match="nested too deeply") as info:
        load_config(path)
    assert str(path) in str(info.value)
    assert main(["check", "--config", str(path)]) == 1
    assert "nested too deeply" in capsys.readouterr().err


def test_check_advises_on_tenant_rules_that_do_not_keep_tenants_apart(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A prefix that hides other tenants but tells tenants apart by their client id (any
    client may claim one), or leaves their groups and transactional ids shared: still
    valid, but `gatehouse check` says so, with the rule's line."""
    path = tmp_path / "proxy.yaml"
    path.write_text(
        "listen: 127.0.0.1:9192\nupstream: [127.0.0.1:9092]\nrules:\n"
        "  - name: claimed\n    match: {client_id: '^a-'}\n"
        "    topic_prefix: {broker: a., hide_others: true}\n"
        "  - name: proven\n    match: {principal: '^b$'}\n"
        "    topic_prefix: {broker: b., hide_others: true, groups: true,"
        " transactional_ids: true}\n"
        "  - name: open\n    match: {client_id: '^c-'}\n    topic_prefix: c.\n")
    assert main(["check", "--config", str(path)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2, err
    assert err[0].startswith(f"warning: {path}:4: rule claimed: keeps tenants apart")
    assert "match on principal (SASL or a client certificate) or source" in err[0]
    assert err[1] == (f"warning: {path}:4: rule claimed: hides other tenants' topics but "
                      "their groups and transactional ids stay shared: add groups: true, "
                      "transactional_ids: true")


def test_workers_imply_shared_ports_and_auto_is_one_per_cpu() -> None:
    base = "listen: 127.0.0.1:9192\nupstream: [x:1]\n"
    assert config_from_text(base).workers == 1
    assert not config_from_text(base).reuse_port
    two = config_from_text(base + "workers: 2\n")
    assert (two.workers, two.reuse_port) == (2, True)
    assert config_from_text(base + "workers: auto\n").workers == usable_cpus()


@pytest.mark.parametrize("cpu_max, expected", [
    ("max 100000\n", None),  # no limit: every CPU it may run on
    ("100000 100000\n", 1),
    ("150000 100000\n", 2),  # 1.5 CPUs: a second worker for the half
    ("5000 100000\n", 1),
    ("garbage\n", None),
])
def test_auto_workers_follow_the_containers_cpu_limit(tmp_path: Path, cpu_max: str,
                                                      expected: int | None) -> None:
    path = tmp_path / "cpu.max"
    path.write_text(cpu_max)
    cpus = len(os.sched_getaffinity(0))
    assert usable_cpus(path) == (cpus if expected is None else min(cpus, expected))
    assert usable_cpus(tmp_path / "absent") == cpus


def test_run_refuses_workers_on_ports_the_os_picks(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "proxy.yaml"
    path.write_text("listen: 127.0.0.1:0\nupstream: [x:1]\n")
    assert main(["run", "--config", str(path), "--workers", "2"]) == 1
    assert capsys.readouterr().err == (
        "error: --workers: more than one worker needs a fixed listen port (processes "
        "sharing ports must agree on them), not 0\n")
    assert main(["run", "--config", str(path), "--workers", "0"]) == 1
    assert "error: --workers: must be from 1 to 256" in capsys.readouterr().err


def test_a_worker_keeps_its_share_of_the_observation_logs_disk(tmp_path: Path) -> None:
    from gatehouse.cli import _as_worker

    config = config_from_text("listen: 127.0.0.1:9192\nupstream: [x:1]\nworkers: 4\n"
                              f"capture: {{dir: {tmp_path}, max_total_bytes: 1000000, "
                              "rotate_bytes: 400000}\n")
    worker = _as_worker(config, 4)
    assert (worker.workers, worker.reuse_port) == (1, True)
    assert worker.capture.max_total_bytes == 250_000
    assert worker.capture.rotate_bytes == 250_000  # a file is at most the budget
    assert worker.capture.dir == config.capture.dir


def test_check_advises_cluster_acls_where_the_brokers_see_one_user(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With sasl.upstream every client reaches the brokers as the proxy's user: a rule
    whose acls keep a client to some topics but say nothing of the cluster leaves it
    that user's rights on the cluster, which `gatehouse check` says, with the line."""
    (tmp_path / "proxy.secret").write_text("p\n")
    rules = ("rules:\n"
             "  - name: team-a\n    match: {principal: '^a$'}\n    acls:\n"
             "      - {allow: [read, write], topics: ['a\\\\..*']}\n"
             "  - name: team-b\n    match: {principal: '^b$'}\n    acls:\n"
             "      - {allow: [read, write], topics: ['b\\\\..*']}\n"
             "      - {allow: [describe], cluster: true}\n")
    path = tmp_path / "proxy.yaml"
    path.write_text("listen: 127.0.0.1:9192\nupstream: [127.0.0.1:9092]\nsasl:\n"
                    "  upstream: {mechanism: SCRAM-SHA-512, username: gh,"
                    " password_file: proxy.secret}\n" + rules)
    assert main(["check", "--config", str(path)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == [f"warning: {path}:6: rule team-a: its acls say nothing of the cluster, "
                   "and with sasl.upstream the brokers see the proxy's user for every "
                   "client: the cluster's APIs (ACLs, SCRAM credentials, quotas, the "
                   "brokers' configs) are whatever that user may do; add an entry with "
                   "cluster: true (allow: [describe], say)"], err
    # Without sasl.upstream the brokers tell the clients apart themselves: no warning.
    path.write_text("listen: 127.0.0.1:9192\nupstream: [127.0.0.1:9092]\n" + rules)
    assert main(["check", "--config", str(path)]) == 0
    assert capsys.readouterr().err == ""


def test_the_probe_says_what_of_a_brokers_apis_the_proxy_does_not_know() -> None:
    """`gatehouse check --probe` on a broker newer than the proxy's tables: the versions
    and API keys it will not offer clients, by name."""
    from gatehouse.codecs import APIS
    from gatehouse.proxy.probe import versions_line

    ranges = {key: (spec.versions.lo, spec.versions.hi) for key, spec in APIS.items()}
    assert versions_line(ranges) == (f"broker APIs: {len(ranges)}, {len(ranges)} known to "
                                     "this proxy's tables")
    produce_hi, fetch_hi = APIS[0].versions.hi, APIS[1].versions.hi
    ranges[0] = (0, produce_hi + 2)
    ranges[1] = (4, fetch_hi + 1)
    ranges[9999] = (0, 1)
    assert versions_line(ranges) == (
        f"broker APIs: {len(ranges)}, {len(ranges) - 1} known to this proxy's tables; "
        f"versions newer than its tables (not offered to clients): Produce "
        f"v{produce_hi + 1}-{produce_hi + 2}, Fetch v{fetch_hi + 1}-{fetch_hi + 1}; API keys "
        "it does not know (not offered to clients): 9999")
