"""deploy/systemd: the unit verifies and scores as hardened (systemd-analyze), and its
commands, expanded from the environment file as systemd expands them, run the proxy:
ExecStartPre checks the config, ExecStart serves, ExecReload reloads the rules, the stop
signal drains and exits 0 within TimeoutStopSec."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gatehouse.proxy.config import Limits
from tests.integration.test_reload_configmap import create_topic, listening, reloads_ok
from tests.support.deploy import ROOT
from tests.support.ports import free_port
from tests.support.tansu import TansuBroker

UNIT = ROOT / "deploy" / "systemd" / "gatehouse.service"
ENV_FILE = ROOT / "deploy" / "systemd" / "gatehouse.env"
INSTALLED = "/opt/gatehouse/bin/gatehouse"


def unit_settings() -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


def env_file() -> dict[str, str]:
    return dict(line.split("=", 1) for line in ENV_FILE.read_text().splitlines()
                if line and not line.startswith("#"))


def expand(command: str, env: dict[str, str]) -> list[str]:
    """systemd's rules: ${VAR} is one word, a lone $VAR splits into words at whitespace."""
    words: list[str] = []
    for word in shlex.split(command):
        if re.fullmatch(r"\$\w+", word):
            words += env.get(word[1:], "").split()
        else:
            words.append(re.sub(r"\$\{(\w+)\}", lambda m: env.get(m.group(1), ""), word))
    return words


def analyze() -> str:
    found = shutil.which("systemd-analyze")
    if found is None:
        pytest.fail("no systemd-analyze: run `sh scripts/install_deploy_tools.sh`")
    return found


def test_unit_verifies(tmp_path: Path) -> None:
    unit = tmp_path / "gatehouse.service"
    unit.write_text(UNIT.read_text().replace(INSTALLED, str(Path(sys.executable).parent
                                                             / "gatehouse")))
    result = subprocess.run([analyze(), "verify", "--man=no", str(unit)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    broken = tmp_path / "broken.service"
    broken.write_text(unit.read_text().replace("ProtectSystem=strict", "ProtectSystm=strict"))
    result = subprocess.run([analyze(), "verify", "--man=no", str(broken)],
                            capture_output=True, text=True, timeout=60)
    assert "Unknown key 'ProtectSystm'" in result.stderr


def test_unit_is_hardened() -> None:
    result = subprocess.run([analyze(), "security", "--offline=yes", str(UNIT)],
                            capture_output=True, text=True, timeout=60)
    found = re.search(r"Overall exposure level for gatehouse.service: ([\d.]+)", result.stdout)
    assert found is not None, result.stdout + result.stderr
    assert float(found.group(1)) <= 2.0, result.stdout  # 10 = unprotected, "OK" below 4


def test_limits_fit_the_proxy() -> None:
    settings = unit_settings()
    assert float(settings["TimeoutStopSec"][0]) > Limits.shutdown_grace
    assert int(settings["LimitNOFILE"][0]) > 2 * Limits.max_connections
    assert settings["User"] == ["gatehouse"] and settings["CapabilityBoundingSet"] == [""]


def test_the_units_commands_run_the_proxy(tansu: TansuBroker, tmp_path: Path) -> None:
    settings = unit_settings()
    env = env_file()
    port, metrics_port = free_port(), free_port()
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules: []\n")
    config = tmp_path / "gatehouse.yaml"
    config.write_text(f"listen: 127.0.0.1:{port}\nupstream: [{tansu.bootstrap}]\n"
                      f"brokers: {{start_port: 0}}\nmetrics: {{listen: 127.0.0.1:{metrics_port}}}\n"
                      "rules_file: rules.yaml\n")
    env["GATEHOUSE_CONFIG"] = str(config)  # the one line an operator edits
    gatehouse = str(Path(sys.executable).parent / "gatehouse")
    [pre] = settings["ExecStartPre"]
    [start] = settings["ExecStart"]
    [reload] = settings["ExecReload"]
    pre_argv = [gatehouse if w == INSTALLED else w for w in expand(pre, env)]
    start_argv = [gatehouse if w == INSTALLED else w for w in expand(start, env)]
    assert start_argv[1:] == ["run", "--config", str(config), "--log-json"]
    assert subprocess.run(pre_argv, capture_output=True, timeout=60).returncode == 0

    proc = subprocess.Popen(start_argv, text=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env={**os.environ, **env})
    try:
        deadline = time.monotonic() + 30
        while not (listening(port) and listening(metrics_port)):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        bootstrap = f"127.0.0.1:{port}"
        assert create_topic(bootstrap, f"unit-a-{os.getpid()}-{time.time_ns()}") is None

        # ExecReload, with $MAINPID: the rules file now refuses CreateTopics.
        rules.write_text("rules:\n  - name: ro\n    deny_apis: [CreateTopics]\n")
        reload_argv = expand(reload.replace("$MAINPID", str(proc.pid)), env)
        assert subprocess.run(reload_argv, timeout=30).returncode == 0
        while reloads_ok(metrics_port) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        error = create_topic(bootstrap, f"unit-b-{os.getpid()}-{time.time_ns()}")
        assert error is not None and error.name() == "CLUSTER_AUTHORIZATION_FAILED"

        assert settings["KillSignal"] == ["SIGTERM"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(float(settings["TimeoutStopSec"][0])) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
