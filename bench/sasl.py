"""SCRAM logins a second, as in a reconnect storm: a broker's SCRAM listener directly vs
Gatehouse authenticating the clients itself (``sasl.downstream``, in front of the
broker's plain listener), same run, same broker.

    python bench/sasl.py [--rounds 3] [--seconds 5] [--clients 4]

Each client thread opens a connection, authenticates (SaslHandshake v1, then
SaslAuthenticate twice: SCRAM-SHA-256, 4096 iterations on both servers), asks for
ApiVersions, closes, and again, for ``--seconds``.  The clients keep the salted password
per salt (a real client derives it once per login; here that work, the same in both
arms, would hide the servers'), so what differs is the server side: the broker's SCRAM
and ApiVersions directly, or the proxy's SCRAM, its connection to the broker and the
broker's ApiVersions.  Reported per round: logins a second, the ratio proxied/direct,
and the servers' CPU per login (the broker JVM directly; the proxy and the broker
behind it proxied).  The arms alternate which goes first.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import hmac
import os
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.proxy import bench_cluster, cpu_seconds, receive_frame, start_gatehouse
from gatehouse import codecs
from tests.support.kafka import SCRAM_PASSWORD, SCRAM_USER

_SALTED: dict[bytes, bytes] = {}  # salt -> salted password (the clients' cache)


def _hmac(key: bytes, message: bytes) -> bytes:
    return hmac.new(key, message, hashlib.sha256).digest()


def _call(sock: socket.socket, api_key: int, version: int, correlation_id: int,
          **fields: object) -> object:
    body = codecs.api(api_key).request.root.cls(**fields)
    frame = codecs.Request.build(api_key, version, correlation_id, "bench", body).encode()
    sock.sendall(struct.pack(">i", len(frame)) + bytes(frame))
    return codecs.decode_response(receive_frame(sock), api_key, version).body


def login(address: tuple[str, int]) -> None:
    """One connection: SCRAM-SHA-256 as the broker's user, ApiVersions, close."""
    with socket.create_connection(address, timeout=10) as sock:
        answer = _call(sock, 17, 1, 1, mechanism="SCRAM-SHA-256")
        assert answer.error_code == 0, answer  # type: ignore[attr-defined]
        nonce = base64.b64encode(os.urandom(18)).decode()
        first_bare = f"n={SCRAM_USER},r={nonce}"
        first = _call(sock, 36, 1, 2, auth_bytes=f"n,,{first_bare}".encode())
        server_first = bytes(first.auth_bytes).decode()  # type: ignore[attr-defined]
        attrs = dict(part.split("=", 1) for part in server_first.split(","))
        salt = base64.b64decode(attrs["s"])
        salted = _SALTED.get(salt)
        if salted is None:
            salted = _SALTED[salt] = hashlib.pbkdf2_hmac(
                "sha256", SCRAM_PASSWORD.encode(), salt, int(attrs["i"]))
        client_key = _hmac(salted, b"Client Key")
        without_proof = f"c=biws,r={attrs['r']}"
        auth_message = f"{first_bare},{server_first},{without_proof}".encode()
        signature = _hmac(hashlib.sha256(client_key).digest(), auth_message)
        proof = bytes(a ^ b for a, b in zip(client_key, signature, strict=True))
        final = _call(sock, 36, 1, 3,
                      auth_bytes=f"{without_proof},p={base64.b64encode(proof).decode()}".encode())
        assert final.error_code == 0, final  # type: ignore[attr-defined]
        versions = _call(sock, 18, 3, 4, client_software_name="bench",
                         client_software_version="1")
        assert versions.error_code == 0  # type: ignore[attr-defined]


def storm(address: tuple[str, int], clients: int, seconds: float) -> int:
    """Logins by ``clients`` threads, one after another each, for ``seconds``."""
    counts = [0] * clients
    deadline = time.monotonic() + seconds
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            while time.monotonic() < deadline:
                login(address)
                counts[i] += 1
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return sum(counts)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--clients", type=int, default=4)
    args = parser.parse_args()
    with bench_cluster(sasl_scram=True) as kafka:
        users = Path(tempfile.mkdtemp()) / "users.yaml"
        users.write_text(f"users:\n  {SCRAM_USER}: {{password: {SCRAM_PASSWORD}}}\n")
        proxy, bootstrap = start_gatehouse(
            kafka.bootstrap, f"sasl:\n  downstream: {{users_file: {users}, "
            "mechanisms: [SCRAM-SHA-256]}\n")
        try:
            broker_pid = kafka.nodes[0].process.pid  # type: ignore[union-attr]
            host, port = kafka.sasl_bootstrap.split(":")
            targets = {"direct": (host, int(port)),
                       "gatehouse": ("127.0.0.1", int(bootstrap.split(":")[1]))}
            for target in targets.values():  # warm up: JIT, the clients' salted password
                storm(target, args.clients, 1.0)
            rates: dict[str, list[float]] = {name: [] for name in targets}
            cpu: dict[str, list[float]] = {name: [] for name in targets}
            print(f"# SCRAM-SHA-256 logins, {args.clients} client threads, "
                  f"{args.seconds:g} s per arm, {os.cpu_count()} CPUs")
            for round_ in range(args.rounds):
                order = list(targets) if round_ % 2 == 0 else list(reversed(targets))
                for name in order:
                    pids = [broker_pid] + ([proxy.pid] if name == "gatehouse" else [])
                    before = sum(cpu_seconds(pid) for pid in pids)
                    started = time.monotonic()
                    logins = storm(targets[name], args.clients, args.seconds)
                    elapsed = time.monotonic() - started
                    used = sum(cpu_seconds(pid) for pid in pids) - before
                    rates[name].append(logins / elapsed)
                    cpu[name].append(used / logins * 1000)
                    print(f"  round {round_ + 1} {name:9}: {logins / elapsed:8.1f} logins/s, "
                          f"servers' CPU {used / logins * 1000:.3f} ms per login")
            ratios = [g / d for g, d in zip(rates["gatehouse"], rates["direct"], strict=True)]
            print()
            print("| | direct (broker's SCRAM) | Gatehouse (sasl.downstream) |")
            print("|---|---:|---:|")
            print(f"| logins/s, median | {statistics.median(rates['direct']):.1f} | "
                  f"{statistics.median(rates['gatehouse']):.1f} |")
            print(f"| servers' CPU ms per login, median | {statistics.median(cpu['direct']):.3f}"
                  f" | {statistics.median(cpu['gatehouse']):.3f} |")
            print(f"\nproxied/direct logins a second, paired median: {statistics.median(ratios):.2f}"
                  f" (rounds {min(ratios):.2f}-{max(ratios):.2f})")
        finally:
            proxy.terminate()
            proxy.wait(30)


if __name__ == "__main__":
    main()
