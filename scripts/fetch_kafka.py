"""Fetch an Apache Kafka distribution's jars from Maven Central for the real-broker tests.

    python -m scripts.fetch_kafka [--version 4.4.0]

Maven (``mvn dependency:copy-dependencies`` over a generated pom.xml) resolves
``org.apache.kafka:kafka_2.13`` (the broker, ``kafka.Kafka``, and ``kafka.tools.StorageTool``),
``kafka-clients``, ``kafka-tools`` (``org.apache.kafka.tools.ProducerPerformance`` and friends)
and a log4j2 binding into::

    ${GATEHOUSE_CACHE:-~/.cache/gatehouse}/kafka/<version>/libs

The directory is filled atomically (download into a temporary directory, rename, then write
``.complete``, beside a copy of the ``pom.xml`` it came from); when ``.complete`` exists
and the dependency list is the same, nothing is fetched.  Maven's own local repository
(``~/.m2``) caches the jars as well.  The libs path is printed on stdout.

Kafka Streams (for the streams-group test) goes to ``<cache>/kafka-streams/<version>/libs``
the same way, with the kafka-clients it was built with: see :func:`ensure_kafka_streams`;
a Kafka Connect worker with the file connectors and MirrorMaker 2 (for the Connect and
MirrorMaker tests) to ``<cache>/kafka-connect/<release>/libs``: see
:func:`ensure_kafka_connect`.

The version is ``--version``, else ``$GATEHOUSE_KAFKA_VERSION``, else 4.4.0; the last 3.x
release (``PREVIOUS_KAFKA_VERSION``) is fetched beside it, for the Kafka 3 broker test and
the codec tables' older versions.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

DEFAULT_KAFKA_VERSION = "4.4.0"
# The last 3.x release: its brokers serve the versions Kafka 4.0 removed (KIP-896), and
# its kafka-clients jar's specs hold them (the codec tables' older versions).
PREVIOUS_KAFKA_VERSION = "3.9.2"
SCALA_BINARY_VERSION = "2.13"
MAVEN_DEPENDENCY_PLUGIN = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1"

#: log4j2 version and SLF4J binding per Kafka version: the log4j-api/log4j-core version that
#: kafka-server depends on, and the binding for the slf4j-api that Kafka ships (Kafka 4.x is
#: still on slf4j-api 1.7.36, whose log4j2 binding is ``log4j-slf4j-impl``; slf4j 2.x would
#: need ``log4j-slf4j2-impl``).  Checked with ``mvn dependency:tree``.
_LOG4J_BY_KAFKA: dict[str, tuple[str, str]] = {
    "4.0": ("2.24.3", "log4j-slf4j-impl"),
    "4.4": ("2.25.5", "log4j-slf4j-impl"),
}
_LOG4J_DEFAULT = ("2.25.5", "log4j-slf4j-impl")

LOG4J2_CONFIG = Path(__file__).resolve().with_name("kafka-log4j2.properties")

MAVEN_ATTEMPTS = 3
_MARKER = ".complete"
_POM = "pom.xml"  # the dependency list the cached libs were fetched from


class FetchError(RuntimeError):
    """Kafka's jars could not be fetched."""


def kafka_version(version: str | None = None) -> str:
    return version or os.environ.get("GATEHOUSE_KAFKA_VERSION") or DEFAULT_KAFKA_VERSION


def cache_root() -> Path:
    root = os.environ.get("GATEHOUSE_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "gatehouse"


def kafka_home(version: str | None = None) -> Path:
    """``<cache>/kafka/<version>``: holds ``libs/`` and the ``.complete`` marker."""
    return cache_root() / "kafka" / kafka_version(version)


def log4j2_config() -> Path:
    """The log4j2 configuration the brokers and tools use (WARN and up, to stderr)."""
    return LOG4J2_CONFIG


def java_binary() -> str:
    """``$JAVA_HOME/bin/java`` when JAVA_HOME is set, else ``java`` on PATH."""
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").is_file():
        return str(Path(home) / "bin" / "java")
    found = shutil.which("java")
    if not found:
        raise FetchError("no java on PATH (Kafka 4 needs Java 17 or newer); set JAVA_HOME")
    return found


def classpath(libs: Path) -> str:
    """A JVM classpath with every jar of ``libs``."""
    return str(libs / "*")


def _log4j_for(version: str) -> tuple[str, str]:
    major_minor = ".".join(version.split(".")[:2])
    return _LOG4J_BY_KAFKA.get(major_minor, _LOG4J_DEFAULT)


def _log4j_deps(version: str) -> list[Dependency]:
    """log4j2 and the binding Kafka ``version``'s jars log through."""
    log4j_version, binding = _log4j_for(version)
    return [("org.apache.logging.log4j", "log4j-api", log4j_version),
            ("org.apache.logging.log4j", "log4j-core", log4j_version),
            ("org.apache.logging.log4j", binding, log4j_version)]


def _tools_version_spec(version: str) -> str:
    # kafka-tools is not on Maven Central for every release (4.4.0's was missing for a
    # while, when kafka_2.13 and kafka-clients 4.4.0 were there).  A range picks the requested version
    # when it exists, else the newest earlier release of the same major version; the
    # broker and clients jars stay at ``version`` because direct dependencies win.
    major = version.split(".")[0]
    if not major.isdigit():
        return version
    return f"[{major}.0.0,{version}]"


def pom_xml(version: str) -> str:
    # Kafka 3.x logs through reload4j (log4j 1): left out, so that the log4j2 binding is
    # the only one and the brokers and tools log as 4.x's do (log4j2_config).
    reload4j = ((("org.slf4j", "slf4j-reload4j"), ("ch.qos.reload4j", "reload4j"))
                if version.split(".")[0] in ("2", "3") else ())
    deps: list[Dependency] = [
        ("org.apache.kafka", f"kafka_{SCALA_BINARY_VERSION}", version, reload4j),
        ("org.apache.kafka", "kafka-clients", version),
        # connect-runtime serves only ConnectPluginPath, which no test runs, and brings
        # Jetty, whose exact versions the registry does not always serve (4.4.0's
        # jetty-ee10-servlets 12.0.39 was refused on 2026-11-24)
        ("org.apache.kafka", "kafka-tools", _tools_version_spec(version),
         (("org.apache.kafka", "connect-runtime"), *reload4j)),
        *_log4j_deps(version),
    ]
    return _pom("kafka-libs", version, deps)


# (groupId, artifactId, version[, ((groupId, artifactId) to exclude, ...)])
Dependency = tuple[str, str, str] | tuple[str, str, str, tuple[tuple[str, str], ...]]


def _dependency_xml(dep: Dependency) -> str:
    g, a, v = dep[:3]
    excluded = dep[3] if len(dep) == 4 else ()
    exclusions = "".join(
        f"<exclusion><groupId>{eg}</groupId><artifactId>{ea}</artifactId></exclusion>"
        for eg, ea in excluded)
    if exclusions:
        exclusions = f"<exclusions>{exclusions}</exclusions>"
    return (f"    <dependency><groupId>{g}</groupId><artifactId>{a}</artifactId>"
            f"<version>{v}</version>{exclusions}</dependency>")


def _pom(artifact: str, version: str, deps: list[Dependency]) -> str:
    lines = "\n".join(map(_dependency_xml, deps))
    return f"""<?xml version="1.0" encoding="UTF-8"?>
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>gatehouse.tests</groupId>
  <artifactId>{artifact}</artifactId>
  <version>{version}</version>
  <packaging>pom</packaging>
  <dependencies>
{lines}
  </dependencies>
</project>
"""


def _mvn_binary() -> str:
    found = os.environ.get("MVN") or shutil.which("mvn")
    if not found:
        raise FetchError("no mvn on PATH: install Maven 3 (apt-get install maven)")
    return found


def _run_maven(workdir: Path, out_dir: Path, attempt: int) -> None:
    cmd = [
        _mvn_binary(), "-B", "-q", "-Dstyle.color=never", "-f", str(workdir / "pom.xml"),
        f"{MAVEN_DEPENDENCY_PLUGIN}:copy-dependencies",
        f"-DoutputDirectory={out_dir}",
        "-DincludeScope=runtime",
    ]
    if attempt > 1:
        cmd.insert(3, "-U")  # re-check artifacts whose earlier failure Maven has cached
    proc = subprocess.run(
        cmd, cwd=workdir, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, check=False,
    )
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-40:])
        raise FetchError(f"mvn exited with {proc.returncode}:\n{tail}")


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


T = TypeVar("T")


def retried(what: str, once: Callable[[int], T], attempts: int = MAVEN_ATTEMPTS, *,
            log: bool = False) -> T:
    """``once(attempt)``, a download that raises FetchError when it fails, until it
    succeeds: ``attempts`` times at most, with back-off between; the last failure is
    raised with ``what`` (what was being done) before it."""
    for attempt in range(1, attempts + 1):
        if log:
            print(f"{what} (attempt {attempt})", file=sys.stderr)
        try:
            return once(attempt)
        except FetchError as exc:
            if attempt == attempts:
                raise FetchError(f"{what} failed {attempt} times: {exc}") from None
            if log:
                print(str(exc), file=sys.stderr)
            time.sleep(2.0 * 2 ** (attempt - 1))
    raise AssertionError("unreachable")


def _is_complete(home: Path, pom: str) -> bool:
    """A finished fetch of exactly ``pom``: a cache made from another dependency list
    (an older version of this script) is fetched again, not used without its new jars."""
    return ((home / _MARKER).is_file() and (home / "libs").is_dir()
            and (home / _POM).is_file() and (home / _POM).read_text() == pom)


def ensure_kafka(version: str | None = None, *, log: bool = False) -> Path:
    """The libs directory of Kafka ``version`` (default: see module doc), fetched if needed."""
    version = kafka_version(version)
    return ensure_maven_libs(kafka_home(version), pom_xml(version),
                             f"kafka_{SCALA_BINARY_VERSION}-{version}.jar",
                             f"Apache Kafka {version}", log=log)


def ensure_kafka_streams(version: str | None = None, *, log: bool = False) -> Path:
    """A libs directory with Kafka Streams and the kafka-clients it was built with (for a
    Streams application run against the brokers of Kafka ``version``).

    Like kafka-tools, kafka-streams is not on Maven Central for every release (4.4.0's is
    missing): the newest release of the same major version up to ``version`` is used, with
    its own kafka-clients, in a directory apart from the broker's jars (the two clients
    versions must not meet on one classpath)."""
    version = kafka_version(version)
    deps: list[Dependency] = [("org.apache.kafka", "kafka-streams", _tools_version_spec(version)),
                              *_log4j_deps(version)]
    return ensure_maven_libs(cache_root() / "kafka-streams" / version,
                             _pom("kafka-streams-libs", version, deps),
                             "kafka-streams-*.jar", f"Kafka Streams for Kafka {version}",
                             log=log)


def ensure_kafka_connect(version: str | None = None, *, log: bool = False) -> Path:
    """A libs directory with a Kafka Connect worker (connect-runtime), the file
    connectors (connect-file) and MirrorMaker 2 (connect-mirror) of one release, for a
    worker run against the brokers of Kafka ``version``.  connect-file is not on Maven
    Central for every release (4.4.0's is missing): the newest of the same major version
    up to ``version`` is found first, and the worker is taken from that same release (a
    connector needs its own release's kafka-clients)."""
    version = kafka_version(version)
    found = ensure_maven_libs(cache_root() / "kafka-connect-file" / version,
                              _pom("kafka-connect-file", version, [
                                  ("org.apache.kafka", "connect-file",
                                   _tools_version_spec(version))]),
                              "connect-file-*.jar", f"connect-file for Kafka {version}",
                              log=log)
    [jar] = found.glob("connect-file-*.jar")
    release = jar.name.removeprefix("connect-file-").removesuffix(".jar")
    deps: list[Dependency] = [("org.apache.kafka", "connect-runtime", release),
                              ("org.apache.kafka", "connect-file", release),
                              ("org.apache.kafka", "connect-mirror", release),
                              *_log4j_deps(release)]
    return ensure_maven_libs(cache_root() / "kafka-connect" / release,
                             _pom("kafka-connect-libs", release, deps),
                             f"connect-runtime-{release}.jar", f"Kafka Connect {release}",
                             log=log)


KROXYLICIOUS_VERSION = "0.12.0"  # the newest kroxylicious-runtime on Maven Central


def ensure_kroxylicious(version: str = KROXYLICIOUS_VERSION, *, log: bool = False) -> Path:
    """The libs directory of the Kroxylicious proxy runtime (a peer in bench/peers.py)."""
    deps: list[Dependency] = [("io.kroxylicious", "kroxylicious-runtime", version),
            # the filter of its "filter-comparable" run in bench/peers.py
            ("io.kroxylicious", "kroxylicious-multitenant", version),
            # its record encryption and in-memory KMS, for bench/encryption.py
            ("io.kroxylicious", "kroxylicious-record-encryption", version),
            ("io.kroxylicious", "kroxylicious-kms-provider-kroxylicious-inmemory", version),
            ("org.apache.logging.log4j", "log4j-slf4j2-impl", "2.24.3"),
            ("org.apache.logging.log4j", "log4j-core", "2.24.3")]
    return ensure_maven_libs(cache_root() / "kroxylicious" / version,
                             _pom("kroxylicious-libs", version, deps),
                             f"kroxylicious-runtime-{version}.jar", f"Kroxylicious {version}",
                             log=log)


def ensure_maven_libs(home: Path, pom: str, expected_jar: str, what: str, *,
                      log: bool = False) -> Path:
    """``home/libs`` holding ``pom``'s runtime dependencies: fetched once with Maven
    (retried with back-off), cached, and safe against concurrent fetches.
    ``expected_jar`` (a glob pattern) must be among them."""
    libs = home / "libs"
    if _is_complete(home, pom):
        return libs
    with _locked(home / ".lock"):
        if _is_complete(home, pom):  # another process finished while we waited
            return libs
        (home / _MARKER).unlink(missing_ok=True)  # a stale cache: complete only once refetched
        tmp = Path(tempfile.mkdtemp(prefix=".fetch-", dir=home))
        try:
            (tmp / "pom.xml").write_text(pom)
            out = tmp / "libs"

            def fetch(attempt: int) -> None:
                shutil.rmtree(out, ignore_errors=True)
                _run_maven(tmp, out, attempt)

            retried(f"fetching {what} with Maven", fetch, log=log)
            if not any(out.glob(expected_jar)):
                raise FetchError(f"Maven finished but {expected_jar} is not in {out}")
            if libs.exists():  # a partial directory from an interrupted run (no marker)
                shutil.rmtree(libs)
            os.rename(out, libs)
            jars = sorted(p.name for p in libs.glob("*.jar"))
            (home / _POM).write_text(pom)
            (home / _MARKER).write_text("".join(f"{name}\n" for name in jars))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return libs


def kafka_clients_jar(version: str | None = None) -> Path:
    """The kafka-clients jar in Kafka ``version``'s libs directory (fetched if needed)."""
    version = kafka_version(version)
    jar = ensure_kafka(version) / f"kafka-clients-{version}.jar"
    if not jar.is_file():
        raise FetchError(f"{jar} is missing")
    return jar


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--version", default=None,
        help=f"Kafka version (default: $GATEHOUSE_KAFKA_VERSION or {DEFAULT_KAFKA_VERSION})")
    args = parser.parse_args(argv)
    try:
        libs = ensure_kafka(args.version, log=True)
        ensure_kafka(PREVIOUS_KAFKA_VERSION, log=True)
        ensure_kafka_streams(args.version, log=True)
        ensure_kafka_connect(args.version, log=True)
    except FetchError as exc:
        print(f"fetch_kafka: {exc}", file=sys.stderr)
        return 1
    print(libs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
