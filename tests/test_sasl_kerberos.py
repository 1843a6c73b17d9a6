"""``sasl.upstream`` / ``capture.kafka.sasl`` with GSSAPI: the config (file:line errors,
the keytab read, the GSS-API library looked for), what ``gatehouse check`` says, and the
RFC 4752 security-layer answer.  The logins themselves, against a real KDC and a real
broker: tests/integration/test_kerberos.py."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest

from gatehouse.codecs.scram import SaslError
from gatehouse.configfile import ConfigError
from gatehouse.proxy import kerberos
from gatehouse.proxy.config import config_from_text, security_warnings
from gatehouse.proxy.kerberos import (
    KerberosCredentials,
    KerberosLogin,
    kerberos_identity,
    keytab_principals,
    parse_principal_rules,
    short_name,
)
from tests.support.kerberos import keytab_bytes

HEAD = "listen: 127.0.0.1:0\nupstream: [127.0.0.1:9092]\nsasl:\n"


def test_the_upstream_gssapi_config(tmp_path: Path) -> None:
    (tmp_path / "proxy.keytab").write_bytes(
        keytab_bytes("gatehouse/edge@EXAMPLE.COM", "gh@EXAMPLE.COM"))
    (tmp_path / "notes.txt").write_text("not a keytab\n")
    config = config_from_text(
        HEAD + "  upstream: {mechanism: gssapi, principal: 'gatehouse/edge@EXAMPLE.COM', "
        "keytab: proxy.keytab}\n", base=tmp_path)
    assert config.sasl_upstream == KerberosCredentials(
        "gatehouse/edge@EXAMPLE.COM", tmp_path / "proxy.keytab", "kafka")
    assert config.sasl_upstream.mechanism == "GSSAPI"
    assert security_warnings(config) == []  # no secret crosses the network
    config = config_from_text(
        HEAD + "  upstream: {mechanism: GSSAPI, principal: gh, keytab: proxy.keytab, "
        "service_name: kafka-prod}\n", base=tmp_path)
    assert isinstance(config.sasl_upstream, KerberosCredentials)
    assert config.sasl_upstream.service_name == "kafka-prod"
    for text, error in [
        ("{mechanism: GSSAPI, keytab: proxy.keytab}", "needs 'principal'"),
        ("{mechanism: GSSAPI, principal: '', keytab: proxy.keytab}",
         "principal must name the proxy's Kerberos principal"),
        ("{mechanism: GSSAPI, principal: gh}", "needs 'keytab'"),
        ("{mechanism: GSSAPI, principal: gh, keytab: nowhere.keytab}",
         "sasl.upstream.keytab: cannot read '.*nowhere.keytab': No such file"),
        ("{mechanism: GSSAPI, principal: gh, keytab: proxy.keytab, service_name: ''}",
         "service_name must name the brokers' Kerberos service"),
        ("{mechanism: GSSAPI, principal: gh, keytab: proxy.keytab, password: x}",
         "unknown key 'password'"),
        ("{mechanism: GSSAPI, principal: gh@OTHER.COM, keytab: proxy.keytab}",
         r"principal: keytab '.*proxy.keytab' holds no key for 'gh@OTHER.COM' \(it holds: "
         r"gatehouse/edge@EXAMPLE.COM, gh@EXAMPLE.COM\)"),
        ("{mechanism: GSSAPI, principal: gatehouse, keytab: proxy.keytab}",
         "holds no key for 'gatehouse'"),
        ("{mechanism: GSSAPI, principal: gh, keytab: notes.txt}",
         r"keytab: '.*notes.txt': not a keytab \(version 2 keytabs start with 0x05 0x02\)"),
    ]:
        with pytest.raises(ConfigError, match=error) as caught:
            config_from_text(HEAD + f"  upstream: {text}\n", "proxy.yaml", base=tmp_path)
        assert caught.value.line == 4, (text, caught.value)


def test_the_principals_a_keytab_holds() -> None:
    assert keytab_principals(keytab_bytes("a@R", "kafka/b.example.com@R", "a@R", hole=True)
                             ) == ["a@R", "kafka/b.example.com@R"]
    assert keytab_principals(b"\x05\x02") == []
    whole = keytab_bytes("a@R")
    for bad, error in [(b"", "not a keytab"), (b"\x05\x01" + whole[2:], "not a keytab"),
                       (whole[:-3], "runs past the end"),
                       (whole[:6] + b"\x00\x09" + whole[8:], "runs past the entry")]:
        with pytest.raises(ValueError, match=error):
            keytab_principals(bad)


def test_without_the_gss_api_library_the_config_says_what_to_install(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "proxy.keytab").write_bytes(keytab_bytes("gh@R"))
    monkeypatch.setattr(kerberos, "_library", None)
    monkeypatch.setattr(kerberos.ctypes.util, "find_library", lambda name: None)
    monkeypatch.setattr(kerberos.ctypes, "CDLL", _no_library)
    with pytest.raises(ConfigError, match="needs MIT Kerberos's GSS-API library, "
                       r"libgssapi_krb5.so.2 \(Debian: libgssapi-krb5-2") as caught:
        config_from_text(HEAD + "  upstream: {mechanism: GSSAPI, principal: gh, "
                         "keytab: proxy.keytab}\n", "proxy.yaml", base=tmp_path)
    assert caught.value.line == 4


def _no_library(name: str) -> ctypes.CDLL:
    raise OSError(f"{name}: cannot open shared object file")


def test_the_capture_sink_takes_gssapi_too(tmp_path: Path) -> None:
    (tmp_path / "proxy.keytab").write_bytes(keytab_bytes("gh@R"))
    config = config_from_text(
        "listen: 127.0.0.1:0\nupstream: [127.0.0.1:9092]\ncapture:\n  dir: caps\n"
        "  kafka: {sasl: {mechanism: GSSAPI, principal: gh@R, keytab: proxy.keytab}}\n",
        base=tmp_path)
    assert config.capture is not None and config.capture.kafka is not None
    assert config.capture.kafka.sasl == KerberosCredentials("gh@R", tmp_path / "proxy.keytab")


def test_gatehouse_check_names_the_principal(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from gatehouse.cli import main

    (tmp_path / "proxy.keytab").write_bytes(keytab_bytes("gatehouse@EXAMPLE.COM"))
    path = tmp_path / "proxy.yaml"
    path.write_text(HEAD + "  upstream: {mechanism: GSSAPI, principal: 'gatehouse@EXAMPLE.COM', "
                    "keytab: proxy.keytab}\n")
    assert main(["check", "--config", str(path)]) == 0
    assert ("sasl.upstream: the proxy authenticates to the brokers as "
            "'gatehouse@EXAMPLE.COM' (GSSAPI)") in capsys.readouterr().out


def test_the_security_layer_offer_is_answered_none_or_refused(tmp_path: Path) -> None:
    """RFC 4752: once the context is established the broker offers security layers
    (wrapped); the proxy takes "none" (bit 0) and says so, wrapped, once; a broker that
    does not offer "none" is refused with what it offered."""
    identity = kerberos_identity(KerberosCredentials("gh@R", tmp_path / "k.keytab"))
    wrapped: list[bytes] = []

    class Established(KerberosLogin):
        def _unwrap(self, data: bytes) -> bytes:
            return data

        def _wrap(self, data: bytes) -> bytes:
            wrapped.append(data)
            return b"wrapped:" + data

    login = Established(identity, "broker-1.example.com")
    assert login.target == "kafka@broker-1.example.com"
    login._established = True
    assert login.step(b"\x07\x00\x10\x00") == b"wrapped:\x01\x00\x00\x00"
    assert wrapped == [b"\x01\x00\x00\x00"]
    assert login.step(b"") is None  # the broker's last answer: over
    refusing = Established(identity, "b")
    refusing._established = True
    with pytest.raises(SaslError, match=r"kafka@b offered no SASL security layer the proxy "
                       r"takes \(offer 04000000\)"):
        refusing.step(b"\x04\x00\x00\x00")
    with pytest.raises(SaslError, match="offer 0100"):
        refusing.step(b"\x01\x00")


# -- sasl.downstream.kerberos: clients log in to the proxy ---------------------------------


def names(rules: list[str], principal: str, realm: str = "EXAMPLE.COM") -> str:
    return short_name(principal, parse_principal_rules(rules), lambda: realm)


def test_principals_become_names_as_kafkas_rules_make_them() -> None:
    # DEFAULT: the first component, for principals of the default realm only.
    assert names(["DEFAULT"], "alice@EXAMPLE.COM") == "alice"
    assert names(["DEFAULT"], "kafka/broker-1.example.com@EXAMPLE.COM") == "kafka"
    with pytest.raises(SaslError, match=r"no principal rule applies to alice@OTHER.ORG "
                       r"\(rules: DEFAULT\)"):
        names(["DEFAULT"], "alice@OTHER.ORG")
    # Kafka's documented examples.
    rule = "RULE:[1:$1@$0](.*@MYDOMAIN.COM)s/@.*//"
    assert names([rule], "alice@MYDOMAIN.COM") == "alice"
    assert names([rule, "DEFAULT"], "bob@EXAMPLE.COM") == "bob"  # the next rule's
    assert names(["RULE:[2:$1@$0](.*@MYDOMAIN.COM)s/@.*//"],
                 "kafka/host.mydomain.com@MYDOMAIN.COM") == "kafka"
    assert names(["RULE:[1:$1@$0](.*@MYDOMAIN.COM)s/@.*//L"], "Alice@MYDOMAIN.COM") == "alice"
    assert names(["RULE:[1:$1](.*)s/a/X/g/U"], "banana@R") == "BXNXNX"
    assert names(["RULE:[1:$1](.*)s/a/X/"], "banana@R") == "bXnana"
    assert names(["RULE:[2:$2-$1]"], "etl/host@R") == "host-etl"
    assert names([r"RULE:[1:$1](svc-.*)s/svc-(.*)/app-$1/"], "svc-orders@R") == "app-orders"
    # A rule that leaves a / or an @ names no one: the login fails, as on a broker.
    with pytest.raises(SaslError, match="turns the principal into 'alice@R', not a simple"):
        names(["RULE:[1:$1@$0]"], "alice@R")
    for bad in ["RULE:[x:$1]", "RULE:[1:$1](unclosed", "RULE:[0:$1]", "OTHER",
                "RULE:[1:$1](a[)"]:
        with pytest.raises(ValueError):
            parse_principal_rules([bad])


def test_the_downstream_kerberos_config(tmp_path: Path) -> None:
    (tmp_path / "service.keytab").write_bytes(keytab_bytes("kafka/edge-1@EXAMPLE.COM"))
    (tmp_path / "empty.keytab").write_bytes(keytab_bytes())
    config = config_from_text(
        HEAD + "  downstream:\n    kerberos:\n      keytab: service.keytab\n"
        "      principal_to_local_rules: ['RULE:[1:$1@$0](.*@EXAMPLE.COM)s/@.*//', DEFAULT]\n",
        base=tmp_path)
    down = config.sasl_downstream
    assert down is not None and down.mechanisms == ("GSSAPI",)
    assert down.kerberos is not None and down.kerberos.keytab == tmp_path / "service.keytab"
    assert [r.text for r in down.kerberos.rules] == ["RULE:[1:$1@$0](.*@EXAMPLE.COM)s/@.*//",
                                                     "DEFAULT"]
    assert down.kerberos.replay_cache is None  # MIT's default: /var/tmp here
    (tmp_path / "cache").mkdir()
    config = config_from_text(
        HEAD + "  downstream:\n    kerberos: {keytab: service.keytab, "
        "replay_cache: cache/tickets}\n", base=tmp_path)
    assert config.sasl_downstream is not None and config.sasl_downstream.kerberos is not None
    assert config.sasl_downstream.kerberos.replay_cache == f"file2:{tmp_path}/cache/tickets"
    for text, line, error in [
        ("    kerberos: {}\n", 5, "needs keytab"),
        ("    kerberos: {keytab: service.keytab, replay_cache: cache}\n", 5,
         "replay_cache: '.*cache' must be a file in a directory the proxy can write"),
        ("    kerberos: {keytab: service.keytab, replay_cache: nowhere/tickets}\n", 5,
         "must be a file in a directory the proxy can write"),
        ("    kerberos: {keytab: empty.keytab}\n", 5, "holds no keys"),
        ("    kerberos: {keytab: nowhere.keytab}\n", 5, "does not exist"),
        ("    kerberos:\n      keytab: service.keytab\n      principal_to_local_rules:\n"
         "        - DEFAULT\n        - 'RULE:[1:$1'\n", 9, "is not a principal rule"),
        ("    users_file: nowhere.yaml\n", 5, "does not exist"),
        ("    mechanisms: [GSSAPI]\n    oauthbearer: {jwks_url: 'https://idp/jwks'}\n", 5,
         "GSSAPI needs sasl.downstream.kerberos"),
    ]:
        with pytest.raises(ConfigError, match=error) as caught:
            config_from_text(HEAD + "  downstream:\n" + text, "proxy.yaml", base=tmp_path)
        assert caught.value.line == line, (text, caught.value)


def test_gatehouse_check_names_the_service_principals(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from gatehouse.cli import main

    (tmp_path / "service.keytab").write_bytes(keytab_bytes("kafka/edge-1@EXAMPLE.COM",
                                                           "kafka/edge-2@EXAMPLE.COM"))
    (tmp_path / "krb5.conf").write_text("[libdefaults]\n default_realm = EXAMPLE.COM\n")
    monkeypatch.setenv("KRB5_CONFIG", str(tmp_path / "krb5.conf"))
    path = tmp_path / "proxy.yaml"
    path.write_text(HEAD + "  downstream: {kerberos: {keytab: service.keytab}, "
                    "session_lifetime: 3600}\n")
    assert main(["check", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert ("sasl.downstream.kerberos: GSSAPI clients log in to kafka/edge-1@EXAMPLE.COM, "
            f"kafka/edge-2@EXAMPLE.COM (keys of {tmp_path / 'service.keytab'}); principals "
            "named by DEFAULT; tickets seen kept in Kerberos's default replay cache, "
            "session lifetime 3600 s") in out
    assert "sasl.downstream.kerberos: the default realm (krb5.conf) is EXAMPLE.COM" in out
    (tmp_path / "krb5.conf").write_text("[libdefaults]\n")
    assert main(["check", "--config", str(path)]) == 0
    assert ("warning: sasl.downstream.kerberos: Kerberos: krb5.conf names no default_realm: "
            "the DEFAULT rule names no one") in capsys.readouterr().err
    path.write_text(HEAD + "  passthrough_kerberos:\n    keytab: service.keytab\n"
                    "    principal_to_local_rules: ['RULE:[1:$1](svc-.*)s/svc-//', DEFAULT]\n")
    assert main(["check", "--config", str(path)]) == 0
    assert ("sasl.passthrough_kerberos: GSSAPI clients passing through named from their "
            "tickets for kafka/edge-1@EXAMPLE.COM, kafka/edge-2@EXAMPLE.COM (keys of "
            f"{tmp_path / 'service.keytab'}); principals named by RULE:[1:$1](svc-.*)s/svc-//, "
            "DEFAULT\n") in capsys.readouterr().out


def test_the_passthrough_kerberos_config(tmp_path: Path) -> None:
    """The brokers' keys, to name clients whose GSSAPI logins pass through: no replay
    cache of the proxy's (the brokers check replays), and only where logins pass."""
    (tmp_path / "brokers.keytab").write_bytes(keytab_bytes("kafka/b-1@EXAMPLE.COM"))
    config = config_from_text(HEAD + "  passthrough_kerberos: {keytab: brokers.keytab}\n",
                              base=tmp_path)
    keys = config.sasl_passthrough_kerberos
    assert keys is not None and keys.keytab == tmp_path / "brokers.keytab"
    assert [r.text for r in keys.rules] == ["DEFAULT"] and keys.replay_cache == "none:"
    assert config.sasl_downstream is None and config.sasl_upstream is None
    (tmp_path / "proxy.keytab").write_bytes(keytab_bytes("gatehouse@EXAMPLE.COM"))
    for text, line, error in [
        ("  passthrough_kerberos: {}\n", 4, "sasl.passthrough_kerberos needs keytab: the "
         "brokers' service keys"),
        ("  passthrough_kerberos: {keytab: brokers.keytab, replay_cache: x}\n", 4,
         "unknown key 'replay_cache'"),
        ("  passthrough_kerberos: {keytab: brokers.keytab, principal_to_local_rules: "
         "['RULE:[1:$1']}\n", 4, "sasl.passthrough_kerberos.principal_to_local_rules"),
        ("  passthrough_kerberos: {keytab: brokers.keytab}\n  upstream: {mechanism: GSSAPI, "
         "principal: gatehouse, keytab: proxy.keytab}\n", 4,
         "with sasl.upstream, the proxy logs in to the brokers for its clients: none pass"),
        ("  downstream: {kerberos: {keytab: brokers.keytab}}\n"
         "  passthrough_kerberos: {keytab: brokers.keytab}\n", 5,
         "with sasl.downstream, clients log in to the proxy: none pass through"),
    ]:
        with pytest.raises(ConfigError, match=error) as caught:
            config_from_text(HEAD + text, "proxy.yaml", base=tmp_path)
        assert caught.value.line == line, (text, caught.value)


def test_a_read_only_default_replay_cache_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MIT keeps the tickets a service accepted in $KRB5RCACHEDIR (or /var/tmp): in a
    container with a read-only root file system every login would fail there."""
    (tmp_path / "service.keytab").write_bytes(keytab_bytes("kafka/edge-1@EXAMPLE.COM"))
    (tmp_path / "readonly").mkdir(mode=0o555)
    monkeypatch.setenv("KRB5RCACHEDIR", str(tmp_path / "readonly"))
    text = HEAD + "  downstream:\n    kerberos: {keytab: service.keytab}\n"
    if os.access(tmp_path / "readonly", os.W_OK):  # root writes anywhere: no such check
        monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != tmp_path / "readonly")
    with pytest.raises(ConfigError, match=f"Kerberos's replay cache directory "
                       f"'{tmp_path}/readonly' is not writable .* set replay_cache") as caught:
        config_from_text(text, "proxy.yaml", base=tmp_path)
    assert caught.value.line == 5
    config = config_from_text(text.replace("}", ", replay_cache: tickets}"), base=tmp_path)
    assert config.sasl_downstream is not None and config.sasl_downstream.kerberos is not None
    assert config.sasl_downstream.kerberos.replay_cache == f"file2:{tmp_path}/tickets"
