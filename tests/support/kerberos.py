"""A Kerberos realm for the tests: MIT's KDC (Debian's krb5-kdc, installed by
scripts/install_kerberos.sh) run on a loopback port from a directory of its own, with
principals and keytabs made by kadmin.local.  ``krb5_conf`` is the client configuration
both the proxy (``KRB5_CONFIG``) and Java (``-Djava.security.krb5.conf``) read."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import IO

from tests.support.kafka import (
    BrokerStartError,
    forget_process,
    log_tail,
    register_process,
    stop_process,
)
from tests.support.ports import LOCALHOST, free_port, port_is_listening

REALM = "GATEHOUSE.TEST"
START_TIMEOUT = 30.0


def _tool(name: str) -> str:
    for where in (shutil.which(name), f"/usr/sbin/{name}"):
        if where and os.access(where, os.X_OK):
            return where
    raise BrokerStartError(f"{name} not found: run `make kerberos` "
                           "(Debian's krb5-kdc and krb5-admin-server)")


def keytab_bytes(*principals: str, hole: bool = False) -> bytes:
    """A version 2 keytab holding a made-up AES key for each of ``principals``
    (``name/host@REALM``), as kadmin writes one (``hole``: a removed entry first)."""
    def counted(text: str) -> bytes:
        return len(text.encode()).to_bytes(2, "big") + text.encode()

    out = bytearray(b"\x05\x02")
    if hole:
        out += (-20).to_bytes(4, "big", signed=True) + bytes(20)
    for principal in principals:
        name, _, realm = principal.rpartition("@")
        names = name.split("/")
        entry = (len(names).to_bytes(2, "big") + counted(realm)
                 + b"".join(counted(n) for n in names)
                 + (1).to_bytes(4, "big")  # KRB5_NT_PRINCIPAL
                 + (0).to_bytes(4, "big") + b"\x01"  # timestamp, key version
                 + (18).to_bytes(2, "big") + (32).to_bytes(2, "big") + bytes(32)  # aes256
                 + (1).to_bytes(4, "big"))
        out += len(entry).to_bytes(4, "big") + entry
    return bytes(out)


class KerberosRealm:
    """``principal(name)`` adds a principal and writes its keytab.  A context manager."""

    def __init__(self) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="gatehouse-kdc-"))
        self.krb5_conf = self.dir / "krb5.conf"
        self.kdc_conf = self.dir / "kdc.conf"
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "KRB5_CONFIG": str(self.krb5_conf),
                "KRB5_KDC_PROFILE": str(self.kdc_conf)}

    def start(self) -> KerberosRealm:
        # Host names canonicalized as MIT's and Java's defaults do (127.0.0.1 is
        # localhost, by /etc/hosts); the KDC and the realm not looked up in DNS.
        self.krb5_conf.write_text(
            "[libdefaults]\n"
            f" default_realm = {REALM}\n"
            " dns_lookup_kdc = false\n dns_lookup_realm = false\n"
            " udp_preference_limit = 1\n"  # TCP (Java too)
            " forwardable = false\n"
            "[realms]\n"
            f" {REALM} = {{\n  kdc = {LOCALHOST}:{self.port}\n }}\n")
        self.kdc_conf.write_text(
            "[kdcdefaults]\n"
            f" kdc_ports = {self.port}\n kdc_tcp_ports = {self.port}\n"
            "[realms]\n"
            f" {REALM} = {{\n"
            f"  database_name = {self.dir}/principal\n"
            f"  key_stash_file = {self.dir}/stash\n"
            f"  acl_file = {self.dir}/kadm5.acl\n"
            "  supported_enctypes = aes256-cts-hmac-sha1-96:normal aes128-cts-hmac-sha1-96:normal\n"
            " }\n"
            "[logging]\n"
            f" kdc = FILE:{self.dir}/kdc.log\n")
        subprocess.run([_tool("kdb5_util"), "create", "-s", "-r", REALM, "-P", "master-key"],
                       env=self.env, check=True, capture_output=True, timeout=60)
        self._log = (self.dir / "kdc.out").open("wb")
        self.process = subprocess.Popen([_tool("krb5kdc"), "-n", "-r", REALM], env=self.env,
                                        stdin=subprocess.DEVNULL, stdout=self._log,
                                        stderr=subprocess.STDOUT)
        register_process(self.process)
        deadline = time.monotonic() + START_TIMEOUT
        while not port_is_listening(self.port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                log = log_tail(self.dir / "kdc.out")
                self.stop()
                raise BrokerStartError(f"the KDC did not start:\n{log}")
            time.sleep(0.1)
        return self

    def keytab_of(self, name: str) -> Path:
        return self.dir / (name.replace("/", "_") + ".keytab")

    def principal(self, name: str) -> Path:
        """``name`` (``kafka/localhost``) added with a random key, its keytab's path."""
        keytab = self.keytab_of(name)
        for query in (f"addprinc -randkey {name}", f"ktadd -k {keytab} {name}"):
            subprocess.run([_tool("kadmin.local"), "-r", REALM, "-q", query], env=self.env,
                           check=True, capture_output=True, timeout=60)
        return keytab

    def rotate_key(self, name: str) -> None:
        """A new random key for ``name`` (its version one up), added to its keytab beside
        the old ones, as a key rotation does: tickets issued from now on use it."""
        subprocess.run([_tool("kadmin.local"), "-r", REALM, "-q",
                        f"ktadd -k {self.keytab_of(name)} {name}"], env=self.env, check=True,
                       capture_output=True, timeout=60)

    def delete_principal(self, name: str) -> None:
        subprocess.run([_tool("kadmin.local"), "-r", REALM, "-q", f"delprinc -force {name}"],
                       env=self.env, check=True, capture_output=True, timeout=60)

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process, 10)
            forget_process(self.process)
            self.process = None
        if self._log is not None:
            self._log.close()
            self._log = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> KerberosRealm:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
