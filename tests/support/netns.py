"""Network namespaces for the deployment tests: a "pod" or a "cluster" on this machine.

Each namespace gets loopback up, optionally an address on a veth pair to another
namespace, and optionally its own /etc/hosts (``ip netns exec`` bind-mounts
/etc/netns/<name>/hosts over /etc/hosts for the commands it runs), so a config that names
``kafka-0.kafka-headless.kafka.svc.cluster.local`` resolves inside it exactly as written.
Addresses come from 198.18.0.0/15 (RFC 2544, benchmarking), never used on a real network.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

ETC_NETNS = Path("/etc/netns")


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be created here (not root, no iproute2, no kernel support)."""


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


def unique_name(prefix: str) -> str:
    """A short name (interface names are at most 15 bytes) unique to this process."""
    return f"{prefix}{os.getpid() % 100000}"


class Netns:
    def __init__(self, name: str) -> None:
        self.name = name
        self.created = False

    def create(self) -> Netns:
        if shutil.which("ip") is None:
            raise NetnsUnavailable("iproute2's `ip` is not installed "
                                   "(scripts/install_deploy_tools.sh installs it)")
        try:
            _ip("netns", "add", self.name)
        except RuntimeError as exc:
            raise NetnsUnavailable(f"cannot create a network namespace: {exc}") from exc
        self.created = True
        _ip("-n", self.name, "link", "set", "lo", "up")
        return self

    def add_address(self, address: str) -> None:
        """A second local address (the pod IP): a listener bound to 127.0.0.1 does not get
        connections made to it, one bound to 0.0.0.0 does."""
        _ip("-n", self.name, "addr", "add", f"{address}/32", "dev", "lo")

    def write_hosts(self, names: Mapping[str, str]) -> None:
        """/etc/hosts as seen by commands run in this namespace: name -> address."""
        directory = ETC_NETNS / self.name
        directory.mkdir(parents=True, exist_ok=True)
        lines = ["127.0.0.1 localhost", *(f"{addr} {name}" for name, addr in names.items())]
        (directory / "hosts").write_text("\n".join(lines) + "\n")

    def command(self, argv: Sequence[str], uid: int | None = None) -> list[str]:
        """``argv`` run in this namespace, as ``uid`` if given.

        A non-root ``uid`` keeps CAP_DAC_READ_SEARCH (ambient): this machine's Python lives
        under /root, which other users cannot enter; nothing else is granted.
        """
        prefix = ["ip", "netns", "exec", self.name]
        if uid is not None and uid != 0:
            prefix += ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                       "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
        return [*prefix, *argv]

    def popen(self, argv: Sequence[str], uid: int | None = None,
              **kwargs: Any) -> subprocess.Popen[Any]:
        return subprocess.Popen(self.command(argv, uid), **kwargs)

    def run(self, argv: Sequence[str], uid: int | None = None, timeout: float = 60,
            **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.command(argv, uid), capture_output=True, text=True,
                              timeout=timeout, **kwargs)

    def delete(self) -> None:
        if self.created:
            subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)
            self.created = False
        shutil.rmtree(ETC_NETNS / self.name, ignore_errors=True)

    def __enter__(self) -> Netns:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.delete()


def connect_veth(a: Netns, a_address: str, b: Netns, b_address: str, prefix: int = 30) -> None:
    """A veth pair between two namespaces, ``a_address`` in ``a`` and ``b_address`` in ``b``."""
    a_dev, b_dev = f"{a.name[:11]}-v", f"{b.name[:11]}-v"
    _ip("link", "add", a_dev, "type", "veth", "peer", "name", b_dev)
    for ns, dev, address in ((a, a_dev, a_address), (b, b_dev, b_address)):
        _ip("link", "set", dev, "netns", ns.name)
        _ip("-n", ns.name, "addr", "add", f"{address}/{prefix}", "dev", dev)
        _ip("-n", ns.name, "link", "set", dev, "up")


def nft(ns: Netns, ruleset: str) -> None:
    """Load an nftables ruleset into the namespace (the pod's egress policy)."""
    result = subprocess.run(ns.command(["nft", "-f", "-"]), input=ruleset, capture_output=True,
                            text=True, timeout=30)
    if result.returncode != 0:
        raise RuntimeError(f"nft in {ns.name}: {result.stderr.strip()}")


def namespace_or_skip(prefix: str) -> Iterator[Netns]:
    """A fresh namespace for a pytest fixture to yield from, deleted afterwards; the test is
    skipped, with the reason, only where namespaces cannot be created at all."""
    import pytest

    ns = Netns(unique_name(prefix))
    try:
        ns.create()
    except NetnsUnavailable as exc:
        pytest.skip(f"network namespaces unavailable: {exc}")
    try:
        yield ns
    finally:
        ns.delete()
