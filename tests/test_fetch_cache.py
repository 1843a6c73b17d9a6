"""The caches of the test set-up: scripts/fetch_kafka.py's Maven libraries (fetched once per
dependency list) and scripts/build_test_clients.py's builds (once per source)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import pytest

from scripts import fetch_kafka


def _pom(*artifacts: str) -> str:
    return "".join(f"<artifactId>{a}</artifactId>\n" for a in artifacts)


def test_a_cache_is_reused_for_its_pom_and_refetched_for_another(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs: list[list[str]] = []

    def fake_maven(workdir: Path, out_dir: Path, attempt: int) -> None:
        # What Maven's copy-dependencies does: one jar per artifact of the pom.
        artifacts = re.findall(r"<artifactId>(.*?)</artifactId>", (workdir / "pom.xml").read_text())
        runs.append(artifacts)
        out_dir.mkdir(parents=True)
        for artifact in artifacts:
            (out_dir / f"{artifact}-1.0.jar").write_bytes(b"PK")

    monkeypatch.setattr(fetch_kafka, "_run_maven", fake_maven)
    home = tmp_path / "peer"
    first = fetch_kafka.ensure_maven_libs(home, _pom("runtime"), "runtime-*.jar", "peer")
    again = fetch_kafka.ensure_maven_libs(home, _pom("runtime"), "runtime-*.jar", "peer")
    assert first == again and runs == [["runtime"]]

    # A new dependency (a filter) in the list: the old cache lacks its jar, so it is fetched.
    libs = fetch_kafka.ensure_maven_libs(home, _pom("runtime", "filter"), "runtime-*.jar", "peer")
    assert runs == [["runtime"], ["runtime", "filter"]]
    assert sorted(p.name for p in libs.iterdir()) == ["filter-1.0.jar", "runtime-1.0.jar"]


def test_a_cache_from_before_the_pom_was_kept_is_refetched(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "peer"
    (home / "libs").mkdir(parents=True)
    (home / "libs" / "runtime-0.9.jar").write_bytes(b"PK")
    (home / ".complete").write_text("runtime-0.9.jar\n")  # marker, but no pom.xml
    monkeypatch.setattr(fetch_kafka, "_run_maven", lambda workdir, out_dir, attempt: (
        out_dir.mkdir(parents=True), (out_dir / "runtime-1.0.jar").write_bytes(b"PK")))
    libs = fetch_kafka.ensure_maven_libs(home, _pom("runtime"), "runtime-*.jar", "peer")
    assert [p.name for p in libs.iterdir()] == ["runtime-1.0.jar"]


def test_the_kafka_pom_leaves_out_connect_runtime_and_its_jetty() -> None:
    # connect-runtime's Jetty closure is not always served by the registry; nothing the
    # tests run needs it, and the fetch of the brokers must not depend on it.
    ns = {"m": "http://maven.apache.org/POM/4.0.0"}
    root = ElementTree.fromstring(fetch_kafka.pom_xml("4.4.0"))
    deps = {d.findtext("m:artifactId", namespaces=ns): d
            for d in root.iterfind("m:dependencies/m:dependency", ns)}
    assert {"kafka_2.13", "kafka-clients", "kafka-tools"} <= deps.keys()
    excluded = {(e.findtext("m:groupId", namespaces=ns), e.findtext("m:artifactId", namespaces=ns))
                for e in deps["kafka-tools"].iterfind("m:exclusions/m:exclusion", ns)}
    assert excluded == {("org.apache.kafka", "connect-runtime")}
    assert deps["kafka_2.13"].find("m:exclusions", ns) is None


def test_the_other_language_clients_are_built_once_per_source_and_retried(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """scripts/build_test_clients.py: the Go client's build is cached by the hash of its
    sources (a changed source builds again); a failing download is retried, then
    reported with what the tool said."""
    import subprocess

    from scripts import build_test_clients as build

    source = tmp_path / "gokafka"
    source.mkdir()
    for name in ("go.mod", "go.sum", "main.go"):
        (source / name).write_text(name)
    (source / "README").write_text("not a source")
    monkeypatch.setattr(build, "GO_SOURCE", source)
    monkeypatch.setenv("GATEHOUSE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(fetch_kafka.time, "sleep", lambda _s: None)
    calls: list[list[str]] = []
    failures = [2]  # the first two downloads fail

    def fake_run(cmd: list[str], cwd: Path, env: dict[str, str]) -> Any:
        calls.append(cmd[1:2])
        if cmd[1] == "mod" and failures[0] > 0:
            failures[0] -= 1
            return subprocess.CompletedProcess(cmd, 1, "", "proxy.golang.org: timeout")
        if cmd[1] == "build":
            Path(cmd[cmd.index("-o") + 1]).write_text("binary")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(build, "_run", fake_run)
    monkeypatch.setattr(build, "go_binary", lambda: "go")
    first = build.ensure_gokafka()
    assert first.read_text() == "binary"
    assert calls == [["mod"], ["mod"], ["mod"], ["build"]]
    assert build.ensure_gokafka() == first and len(calls) == 4  # cached
    (source / "README").write_text("changed, still not a source")
    assert build.ensure_gokafka() == first and len(calls) == 4
    (source / "main.go").write_text("changed")
    second = build.ensure_gokafka()
    assert second != first and calls[4:] == [["mod"], ["build"]]

    failures[0] = build.ATTEMPTS
    (source / "main.go").write_text("changed again")
    with pytest.raises(fetch_kafka.FetchError, match=r"failed 4 times: proxy\.golang\.org: timeout"):
        build.ensure_gokafka()
