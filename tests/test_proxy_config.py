"""The proxy config: the minimal file works, mistakes are reported with file:line."""

from __future__ import annotations

from pathlib import Path

import pytest

from gatehouse.cli import main
from gatehouse.configfile import ConfigError
from gatehouse.proxy.config import Address, config_from_text, load_config


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
    assert "ok" in capsys.readouterr().out
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
