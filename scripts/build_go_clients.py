"""Build the Go Kafka clients of the integration tests (tests/support/go/gokafka:
franz-go and Sarama), once per source, with their modules from the Go module proxy.

    python -m scripts.build_go_clients

The binary is cached under ``${GATEHOUSE_CACHE:-~/.cache/gatehouse}/go-clients/<hash>``
(the hash of the program's go.mod, go.sum and sources): built again only when they
change.  The module download is retried with back-off; a build that fails says why.
Needs Go (``go`` on the PATH, or /usr/local/go/bin/go)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.fetch_kafka import FetchError, _locked, cache_root

SOURCE = Path(__file__).resolve().parent.parent / "tests" / "support" / "go" / "gokafka"
ATTEMPTS = 4


def go_binary() -> str:
    found = shutil.which("go") or ("/usr/local/go/bin/go"
                                   if Path("/usr/local/go/bin/go").is_file() else None)
    if found is None:
        raise FetchError("Go is not installed (no `go` on the PATH or in /usr/local/go/bin)")
    return found


def source_hash() -> str:
    digest = hashlib.sha256()
    for path in sorted(SOURCE.iterdir()):
        if path.is_file() and (path.name in ("go.mod", "go.sum") or path.suffix == ".go"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _go(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([go_binary(), *args], cwd=SOURCE, env=env, capture_output=True,
                          text=True, timeout=600)


def ensure_gokafka(*, log: bool = False) -> Path:
    """The gokafka binary for the current sources: built once, cached."""
    home = cache_root() / "go-clients" / source_hash()
    binary = home / "gokafka"
    if binary.is_file():
        return binary
    with _locked(home / ".lock"):
        if binary.is_file():  # another process built it while we waited
            return binary
        env = {**os.environ, "GOFLAGS": "-mod=readonly", "CGO_ENABLED": "0"}
        for attempt in range(1, ATTEMPTS + 1):
            if log:
                print(f"downloading the Go clients' modules (attempt {attempt})", file=sys.stderr)
            done = _go(["mod", "download"], env)
            if done.returncode == 0:
                break
            if attempt == ATTEMPTS:
                raise FetchError(f"go mod download failed {attempt} times: "
                                 f"{done.stderr.strip()[-2000:]}")
            time.sleep(2.0 * 2 ** (attempt - 1))
        tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=home))
        try:
            built = _go(["build", "-o", str(tmp / "gokafka"), "."], env)
            if built.returncode != 0:
                raise FetchError(f"go build failed: {built.stderr.strip()[-2000:]}")
            os.rename(tmp / "gokafka", binary)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if log:
        print(f"built {binary}", file=sys.stderr)
    return binary


def main() -> None:
    try:
        print(ensure_gokafka(log=True))
    except FetchError as exc:
        sys.exit(f"build_go_clients: {exc}")


if __name__ == "__main__":
    main()
