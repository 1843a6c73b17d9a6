"""Build the Kafka clients of the integration tests written in other languages, once per
source:

- tests/support/go/gokafka: franz-go and Sarama, with their modules from the Go module
  proxy (needs Go: ``go`` on the PATH, or /usr/local/go/bin/go);
- tests/support/go/vaulttransit: Vault's transit secrets engine behind Vault's HTTP API
  (the KMS of encrypt_records' ``kms: {type: vault}`` tests), likewise;
- tests/support/node/kafkajs: KafkaJS, installed from the npm registry by its lock file
  (needs Node.js and npm).

    python -m scripts.build_test_clients

Each is cached under ``${GATEHOUSE_CACHE:-~/.cache/gatehouse}/<name>/<hash>`` (the hash
of its sources and lock files): built again only when they change.  Downloads are
retried with back-off; a build that fails says why."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from scripts.fetch_kafka import FetchError, _locked, cache_root, retried

SUPPORT = Path(__file__).resolve().parent.parent / "tests" / "support"
GO_SOURCE = SUPPORT / "go" / "gokafka"
VAULT_SOURCE = SUPPORT / "go" / "vaulttransit"
KAFKAJS_SOURCE = SUPPORT / "node" / "kafkajs"
ATTEMPTS = 4


def go_binary() -> str:
    found = shutil.which("go") or ("/usr/local/go/bin/go"
                                   if Path("/usr/local/go/bin/go").is_file() else None)
    if found is None:
        raise FetchError("Go is not installed (no `go` on the PATH or in /usr/local/go/bin)")
    return found


def source_files(source: Path) -> list[Path]:
    """A client's sources and lock files (what its build depends on)."""
    return sorted(p for p in source.iterdir() if p.is_file() and (
        p.name in ("go.mod", "go.sum", "package.json", "package-lock.json")
        or p.suffix in (".go", ".js")))


def source_hash(source: Path) -> str:
    digest = hashlib.sha256()
    for path in source_files(source):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def _download(what: str, cmd: list[str], cwd: Path, env: dict[str, str], log: bool) -> None:
    """``cmd`` (a download) until it succeeds, ATTEMPTS times at most (``retried``)."""
    def once(_attempt: int) -> None:
        done = _run(cmd, cwd, env)
        if done.returncode != 0:
            raise FetchError(done.stderr.strip()[-2000:])

    retried(what, once, ATTEMPTS, log=log)


def ensure_go_program(source: Path, name: str, cache: str, *, log: bool = False) -> Path:
    """The binary ``name`` of the Go program in ``source`` for its current sources: built
    once, cached under ``cache``."""
    home = cache_root() / cache / source_hash(source)
    binary = home / name
    if binary.is_file():
        return binary
    with _locked(home / ".lock"):
        if binary.is_file():  # another process built it while we waited
            return binary
        env = {**os.environ, "GOFLAGS": "-mod=readonly", "CGO_ENABLED": "0"}
        go = go_binary()
        _download(f"downloading the modules of {name}", [go, "mod", "download"], source,
                  env, log)
        tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=home))
        try:
            built = _run([go, "build", "-o", str(tmp / name), "."], source, env)
            if built.returncode != 0:
                raise FetchError(f"go build of {name} failed: {built.stderr.strip()[-2000:]}")
            os.rename(tmp / name, binary)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if log:
        print(f"built {binary}", file=sys.stderr)
    return binary


def ensure_gokafka(*, log: bool = False) -> Path:
    """The gokafka binary (franz-go and Sarama) for the current sources."""
    return ensure_go_program(GO_SOURCE, "gokafka", "go-clients", log=log)


def ensure_vault_transit(*, log: bool = False) -> Path:
    """The vaulttransit binary (Vault's transit engine over Vault's HTTP API)."""
    return ensure_go_program(VAULT_SOURCE, "vaulttransit", "vaulttransit", log=log)


def ensure_kafkajs(*, log: bool = False) -> Path:
    """A directory holding tenant.js with KafkaJS installed beside it (``npm ci`` of the
    lock file): made once per source, cached."""
    home = cache_root() / "kafkajs" / source_hash(KAFKAJS_SOURCE)
    ready = home / "app"
    if (ready / "node_modules" / "kafkajs").is_dir():
        return ready
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        raise FetchError("Node.js is not installed (no `node` and `npm` on the PATH)")
    with _locked(home / ".lock"):
        if (ready / "node_modules" / "kafkajs").is_dir():
            return ready
        tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=home))
        try:
            for path in source_files(KAFKAJS_SOURCE):
                shutil.copy2(path, tmp / path.name)
            _download("installing KafkaJS from the npm registry",
                     [npm, "ci", "--no-audit", "--no-fund"], tmp, dict(os.environ), log)
            shutil.rmtree(ready, ignore_errors=True)
            os.rename(tmp, ready)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if log:
        print(f"installed {ready}", file=sys.stderr)
    return ready


def main() -> None:
    try:
        print(ensure_gokafka(log=True))
        print(ensure_vault_transit(log=True))
        print(ensure_kafkajs(log=True))
    except FetchError as exc:
        sys.exit(f"build_test_clients: {exc}")


if __name__ == "__main__":
    main()
