"""``encrypt_records.kms: {type: vault}``: data keys made and opened by a Vault transit
secrets engine (Vault's own engine behind Vault's HTTP API on a real socket,
tests/support/kms.py), the KEK never at the proxy; the token read from its file for every
call and never shown; https with the rule's CA; a namespace; a Vault that hangs or
refuses is a KMS unavailable, a changed ciphertext an undecryptable record."""

from __future__ import annotations

import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme

from gatehouse.compression import compress_zstd, decompress
from gatehouse.configfile import ConfigError
from gatehouse.proxy.kms import KmsClients, VaultKek, probe_kms
from gatehouse.rules import load_rules_file
from gatehouse.rules.encryption import (
    KmsNeeded,
    KmsSpec,
    KmsUnavailable,
    RecordCipher,
    RecordEncryption,
    Undecryptable,
    open_records,
    seal_records,
)
from tests.support.kms import VAULT_TOKEN, VaultServer, vault_server
from tests.test_rules_encryption import LIMIT, SECRET, values
from tests.test_rules_encryption_kms import encryption_under
from tests.test_rules_records import batch


@pytest.fixture(scope="module")
def vault(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VaultServer]:
    with vault_server(tmp_path_factory.mktemp("vault") / "vault.log") as server:
        server.new_key("payments")
        yield server


@pytest.fixture(autouse=True)
def vault_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VAULT_TOKEN", VAULT_TOKEN)


def spec(address: str, key: str, timeout: float = 5.0, **parts: Any) -> KmsSpec:
    return KmsSpec("vault", key, None, address, timeout, **parts)


def vault_encryption(address: str, key: str, timeout: float = 5.0, **parts: Any
                     ) -> RecordEncryption:
    return encryption_under(spec(address, key, timeout, **parts))


def sealing(encryption: RecordEncryption) -> VaultKek:
    kek = KmsClients().keys_of(encryption).sealing
    assert isinstance(kek, VaultKek)
    return kek


def test_a_data_key_made_by_vault_opens_under_its_key_alone(vault: VaultServer) -> None:
    clients = KmsClients()
    kek = clients.keys_of(vault_encryption(vault.address, "payments")).sealing
    assert isinstance(kek, VaultKek) and kek.remote and kek.name == "vault-kms:payments"
    secret, edek = kek.new_dek()
    assert len(secret) == 32 and edek.startswith(b"vault:v1:") and secret not in edek
    assert kek.unwrap(edek) == secret
    # Another key's, or changed: undecryptable (the record, not the KMS, is at fault).
    other = clients.client(spec(vault.address, "payments")).kek(
        "vault-kms:" + vault.new_key("other"))
    with pytest.raises(Undecryptable, match="does not open its data key"):
        other.unwrap(edek)
    changed = edek[:20] + (b"A" if edek[20:21] != b"A" else b"B") + edek[21:]
    with pytest.raises(Undecryptable, match="HTTP 400"):
        kek.unwrap(changed)
    with pytest.raises(Undecryptable, match="not a Vault ciphertext"):
        kek.unwrap(b"\xff\xfe")
    # Something else the key encrypted (transit/encrypt), not a data key.
    other_use = vault.call("POST", "transit/encrypt/payments", {"plaintext": "aGVsbG8="})
    with pytest.raises(Undecryptable, match="opens to 5 bytes, not a data key"):
        kek.unwrap(other_use["data"]["ciphertext"].encode())
    # A key Vault does not have: the KMS cannot serve it (its records wait, retried).
    missing = clients.client(spec(vault.address, "payments")).kek("vault-kms:none")
    with pytest.raises(KmsUnavailable, match="HTTP 400: encryption key not found"):
        missing.new_dek()
    with pytest.raises(KmsUnavailable, match="encryption key not found"):
        missing.unwrap(edek)


def test_the_token_is_read_from_its_file_for_every_call_and_never_shown(
        vault: VaultServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VAULT_TOKEN")
    token = tmp_path / "token"
    token.write_text("s.not-the-token\n")
    kek = sealing(vault_encryption(vault.address, "payments", token_file=str(token)))
    with pytest.raises(KmsUnavailable) as caught:
        kek.new_dek()
    assert "HTTP 403: permission denied" in str(caught.value)
    assert "not-the-token" not in str(caught.value)
    token.write_text(VAULT_TOKEN + "\n")  # as Vault Agent renews it, in place
    secret, edek = kek.new_dek()
    assert kek.unwrap(edek) == secret
    token.unlink()
    with pytest.raises(KmsUnavailable, match=re.escape(f"token_file {token}: No such file")):
        kek.new_dek()
    with pytest.raises(KmsUnavailable, match=r"no token: set encrypt_records\.kms\."
                       r"token_file or VAULT_TOKEN"):
        sealing(vault_encryption(vault.address, "payments")).new_dek()


def test_a_vault_that_hangs_is_given_up_within_its_timeout(vault: VaultServer) -> None:
    kek = sealing(vault_encryption(vault.address, "payments", timeout=1.0))
    kek.new_dek()
    with vault.paused():
        started = time.monotonic()
        with pytest.raises(KmsUnavailable, match="timed out"):
            kek.new_dek()
        assert time.monotonic() - started < 3
    gone = sealing(vault_encryption("http://127.0.0.1:9", "payments", timeout=1.0))
    with pytest.raises(KmsUnavailable, match="Connection refused"):
        gone.new_dek()


def test_something_that_is_not_vault_is_a_kms_unavailable() -> None:
    """What answers at the address but not in HTTP (a misnamed port) is said, not an
    exception the opening thread cannot handle."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        def answer() -> None:
            for _ in range(2):  # both attempts
                peer, _ = server.accept()
                with peer:
                    peer.recv(65536)
                    peer.sendall(b"\x00\x00\x00\x10not http at all\r\n\r\n")
        thread = threading.Thread(target=answer, daemon=True)
        thread.start()
        port = server.getsockname()[1]
        kek = sealing(vault_encryption(f"http://127.0.0.1:{port}", "payments", timeout=2.0))
        with pytest.raises(KmsUnavailable, match=f"Vault http://127.0.0.1:{port} "):
            kek.new_dek()
        thread.join(5)


def test_values_sealed_under_vault_open_at_another_proxy(vault: VaultServer) -> None:
    e = vault_encryption(vault.address, "payments")
    cipher = RecordCipher()
    records = batch(*[(None, SECRET.encode() * 3)] * 5)
    sealed, count = seal_records(records, e, cipher, decompress, compress_zstd,
                                 KmsClients().keys_of(e).sealing, block=True)
    assert count == 5 and SECRET.encode() not in sealed and cipher.kms_calls == 1
    assert b"vault-kms:payments" in sealed and b"vault:v1:" in sealed
    elsewhere = RecordCipher()
    find = KmsClients().keys_of(e).find
    with pytest.raises(KmsNeeded):
        open_records(sealed, find, elsewhere, decompress, LIMIT, block=False)
    opened = open_records(sealed, find, elsewhere, decompress, LIMIT, block=True)
    assert opened.records is not None and elsewhere.kms_calls == 1
    assert [v for _, v, _ in values(opened.records)] == [SECRET.encode() * 3] * 5
    # A Vault elsewhere with a key of the same name is another KEK: it opens nothing here.
    assert KmsClients().keys_of(vault_encryption("http://127.0.0.1:9", "payments")).find(
        "vault-kms:payments") != find("vault-kms:payments")


def test_https_is_verified_against_the_rules_ca(tmp_path: Path) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    files = (tmp_path / "vault.pem", tmp_path / "vault.key", tmp_path / "ca.pem")
    cert.cert_chain_pems[0].write_to_path(str(files[0]))
    cert.private_key_pem.write_to_path(str(files[1]))
    ca.cert_pem.write_to_path(str(files[2]))
    with vault_server(tmp_path / "vault.log", tls=files) as server:
        server.new_key("payments")
        assert server.address.startswith("https://")
        with pytest.raises(KmsUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
            sealing(vault_encryption(server.address, "payments")).new_dek()
        kek = sealing(vault_encryption(server.address, "payments", ca_file=str(files[2])))
        secret, edek = kek.new_dek()
        assert kek.unwrap(edek) == secret
        # The CA file read again when it changes (the same client: rotated in place).
        right = files[2].read_bytes()
        trustme.CA().cert_pem.write_to_path(str(files[2]))
        os.utime(files[2], ns=(1, 1))
        with pytest.raises(KmsUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
            kek.new_dek()
        files[2].write_bytes(right)
        os.utime(files[2], ns=(2, 2))
        assert kek.unwrap(edek) == secret
        files[2].write_text("not a certificate\n")
        os.utime(files[2], ns=(3, 3))
        with pytest.raises(KmsUnavailable, match=re.escape(f"ca_file {files[2]}: ")):
            kek.new_dek()
        files[2].unlink()
        with pytest.raises(KmsUnavailable, match=re.escape(f"ca_file {files[2]}: No such")):
            kek.new_dek()


def test_a_namespace_goes_with_every_call(tmp_path: Path) -> None:
    with vault_server(tmp_path / "vault.log", namespace="team-a") as server:
        server.new_key("payments")
        with pytest.raises(KmsUnavailable, match="HTTP 403: permission denied"):
            sealing(vault_encryption(server.address, "payments")).new_dek()
        kek = sealing(vault_encryption(server.address, "payments", namespace="team-a"))
        secret, edek = kek.new_dek()
        assert kek.unwrap(edek) == secret


def test_each_topic_under_its_own_transit_key(vault: VaultServer) -> None:
    vault.new_key("pay-refunds")
    keys = KmsClients().keys_of(vault_encryption(vault.address, "pay-{topic}"))
    assert keys.sealing is None
    kek = keys.sealing_for("refunds")
    assert kek is not None and kek.name == "vault-kms:pay-refunds"
    secret, edek = kek.new_dek()
    found = keys.find("vault-kms:pay-refunds")
    assert found is not None and found.unwrap(edek) == secret
    ledger = keys.sealing_for("ledger")
    assert ledger is not None
    with pytest.raises(KmsUnavailable, match="encryption key not found"):
        ledger.new_dek()


def test_check_probe_makes_and_opens_a_data_key(vault: VaultServer) -> None:
    line, usable = probe_kms(vault_encryption(vault.address, "payments"))
    assert usable and line.startswith("vault-kms:payments: a data key made and opened in ")
    line, usable = probe_kms(vault_encryption(vault.address, "nowhere"))
    assert not usable
    assert line == (f"vault-kms:nowhere: Vault {vault.address} (transit): HTTP 400: "
                    "encryption key not found")


# -- the rule ------------------------------------------------------------------------------


def vault_rules(tmp_path: Path, vault: VaultServer, key: str = "payments") -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text("rules:\n"
                    "  - name: payments-encrypted\n"
                    "    match: {principal: '^app'}\n"
                    "    encrypt_records:\n"
                    "      topics: [payments]\n"
                    "      kms:\n"
                    "        type: vault\n"
                    f"        key: {key}\n"
                    f"        address: {vault.address}\n"
                    "        mount: team-a/transit\n"
                    "        token_file: secrets/token\n"
                    "        namespace: ops\n"
                    "        ca_file: /etc/vault/ca.pem\n"
                    "        timeout_seconds: 2\n")
    return path


def test_the_rule_names_its_vault_and_takes_no_token(tmp_path: Path,
                                                     vault: VaultServer) -> None:
    [rule] = load_rules_file(vault_rules(tmp_path, vault)).rules
    e = rule.encrypt_records
    assert e is not None and e.ring is None and e.key == "vault-kms:payments"
    assert e.kms == KmsSpec("vault", "payments", None, vault.address, 2.0, "team-a/transit",
                            str(tmp_path / "secrets" / "token"), "ops", "/etc/vault/ca.pem")
    [rule] = load_rules_file(vault_rules(tmp_path, vault, "'pay-{topic}'")).rules
    assert rule.encrypt_records is not None and rule.encrypt_records.kms is not None
    assert rule.encrypt_records.kms.per_topic


@pytest.mark.parametrize(("change", "error"), [
    ((f"        address: {'{'}address{'}'}\n", ""), "rules.yaml:7: encrypt_records.kms."
     "address: Vault's address (https://vault.example:8200) is required with type vault"),
    (("address: http://", "address: ftp://"), "rules.yaml:9: encrypt_records.kms.address: "
     "'ftp://"),
    (("        type: vault\n", "        type: vault\n        region: eu-west-1\n"),
     "rules.yaml:8: encrypt_records.kms.region is for type aws, not vault"),
    (("        type: vault\n", "        type: vault\n        token: s.abc\n"),
     "rules.yaml:7: encrypt_records.kms takes no credentials: Vault's token is read from "
     "token_file (Vault Agent's sink) or VAULT_TOKEN"),
    (("key: payments", "key: pay/ments"), "rules.yaml:8: encrypt_records.kms.key: "
     "'pay/ments': a transit key's name"),
    (("key: payments", "key: pay-{name}"), "rules.yaml:8: encrypt_records.kms.key: "
     "'pay-{name}': a transit key's name"),
    (("mount: team-a/transit", "mount: 'a b'"), "rules.yaml:10: encrypt_records.kms.mount: "
     "'a b' is not a mount path"),
    (("timeout_seconds: 2", "timeout_seconds: 61"), "rules.yaml:14: encrypt_records.kms."
     "timeout_seconds: more than 0 and at most 60"),
])
def test_a_bad_vault_part_is_refused_with_its_line(tmp_path: Path, vault: VaultServer,
                                                   change: tuple[str, str], error: str
                                                   ) -> None:
    path = vault_rules(tmp_path, vault)
    old = change[0].replace("{address}", vault.address)
    assert old in path.read_text()
    path.write_text(path.read_text().replace(old, change[1]))
    with pytest.raises(ConfigError) as caught:
        load_rules_file(path)
    assert error in str(caught.value)
    assert VAULT_TOKEN not in str(caught.value) and "s.abc" not in str(caught.value)


def test_check_says_where_the_token_comes_from_and_warns_without_one(
        tmp_path: Path, vault: VaultServer, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from gatehouse.cli import main

    rules = vault_rules(tmp_path, vault)
    config = tmp_path / "gatehouse.yaml"
    config.write_text(f"listen: 127.0.0.1:9192\nupstream: [127.0.0.1:9092]\n"
                      f"rules_file: {rules}\n")
    assert main(["check", "--config", str(config)]) == 0
    out, err = capsys.readouterr()
    assert ("encrypt_records (rule payments-encrypted): values of topics matching payments "
            f"encrypted under data keys made by the Vault transit engine at {vault.address}"
            f"/v1/team-a/transit under its key 'payments' (token from "
            f"{tmp_path / 'secrets' / 'token'}, namespace ops, CA /etc/vault/ca.pem), each "
            "KMS call bounded by 2 s") in out
    assert "VAULT_TOKEN" not in err
    rules.write_text(rules.read_text().replace("        token_file: secrets/token\n", ""))
    monkeypatch.delenv("VAULT_TOKEN")
    assert main(["check", "--config", str(config)]) == 0
    out, err = capsys.readouterr()
    assert "(token from VAULT_TOKEN, namespace ops" in out
    assert ("warning: rule payments-encrypted: encrypt_records.kms has no token_file and "
            "VAULT_TOKEN is not set") in err
