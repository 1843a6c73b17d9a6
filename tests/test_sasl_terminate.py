"""SASL at the proxy, without a broker: the SCRAM server against RFC 7677's exchange and
the proxy's own client, PLAIN, the users file (errors with file:line), the config, one
client's exchange (``ClientSasl``) and `gatehouse credential`."""

from __future__ import annotations

import base64
import subprocess
import sys
from pathlib import Path

import pytest

from gatehouse.cli import main
from gatehouse.codecs.scram import (
    SaslError,
    ScramClient,
    ScramCredential,
    ScramServer,
    parse_plain,
    plain_token,
)
from gatehouse.configfile import ConfigError
from gatehouse.proxy.config import config_from_text
from gatehouse.proxy.sasl import ClientSasl, SaslUsers, load_users

# RFC 7677's example: user "user", password "pencil".
RFC_SALT = base64.b64decode("W22ZaJ0SNY7soEsUEjb6gQ==")
RFC_CLIENT_FIRST = b"n,,n=user,r=rOprNGfwEbeRWgbNEkqO"
RFC_SERVER_NONCE = "%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0"
RFC_SERVER_FIRST = (b"r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,"
                    b"s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096")
RFC_CLIENT_FINAL = (b"c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,"
                    b"p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ=")
RFC_SERVER_FINAL = b"v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4="


def rfc_credential() -> ScramCredential:
    return ScramCredential.from_password("SCRAM-SHA-256", "pencil", salt=RFC_SALT,
                                         iterations=4096)


def test_the_scram_server_answers_rfc_7677s_exchange_byte_for_byte() -> None:
    server = ScramServer("SCRAM-SHA-256", {"user": rfc_credential()}.get,
                         nonce=RFC_SERVER_NONCE)
    assert server.first(RFC_CLIENT_FIRST) == RFC_SERVER_FIRST
    assert server.user is None  # not before the proof
    assert server.final(RFC_CLIENT_FINAL) == RFC_SERVER_FINAL
    assert server.user == "user"


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-256", "SCRAM-SHA-512"])
@pytest.mark.parametrize("name", ["alice", "a=b,c", "ünï"])
def test_the_proxys_client_and_server_agree(mechanism: str, name: str) -> None:
    credential = ScramCredential.from_password(mechanism, "s3cret")
    server = ScramServer(mechanism, {name: credential}.get)
    client = ScramClient(mechanism, name, "s3cret")
    final = client.final_message(server.first(client.first_message()))
    client.check_final(server.final(final))  # the server proved it holds the key too
    assert server.user == name


def failed_final(mechanism: str, users: dict[str, ScramCredential], name: str,
                 password: str) -> str:
    server = ScramServer(mechanism, users.get)
    client = ScramClient(mechanism, name, password)
    server_first = server.first(client.first_message())
    with pytest.raises(SaslError) as caught:
        server.final(client.final_message(server_first))
    assert server.user is None
    return str(caught.value)


def test_a_wrong_password_and_an_unknown_user_fail_alike() -> None:
    users = {"alice": ScramCredential.from_password("SCRAM-SHA-512", "right")}
    wrong = failed_final("SCRAM-SHA-512", users, "alice", "wrong")
    unknown = failed_final("SCRAM-SHA-512", users, "mallory", "right")
    assert wrong == unknown == "invalid credentials"
    assert "right" not in wrong and "wrong" not in wrong


@pytest.mark.parametrize(("client_first", "error"), [
    (b"p=tls-unique,,n=u,r=abc", "channel binding is not supported"),
    (b"n,,r=abc,n=u", "must be n=user,r=nonce"),
    (b"n,,n=u,r=abc,tokenauth=true", "extensions"),
    (b"n,a=other,n=u,r=abc", "authorization id"),
    (b"n,,n=a=Xb,r=abc", "bad escape"),
    (b"\xff", "not UTF-8"),
])
def test_client_first_messages_kafka_refuses(client_first: bytes, error: str) -> None:
    with pytest.raises(SaslError, match=error):
        ScramServer("SCRAM-SHA-256", {}.get).first(client_first)


def test_a_client_final_message_must_continue_the_same_exchange() -> None:
    server = ScramServer("SCRAM-SHA-256", {"user": rfc_credential()}.get,
                         nonce=RFC_SERVER_NONCE)
    with pytest.raises(SaslError, match="before the client-first"):
        server.final(RFC_CLIENT_FINAL)
    server.first(RFC_CLIENT_FIRST)
    with pytest.raises(SaslError, match="nonce does not match"):
        server.final(RFC_CLIENT_FINAL.replace(b"k0,p", b"k1,p"))
    with pytest.raises(SaslError, match="channel binding does not match"):
        server.final(RFC_CLIENT_FINAL.replace(b"c=biws", b"c=eSws"))
    with pytest.raises(SaslError, match="no proof"):
        server.final(b"c=biws,r=x")


def test_plain_messages() -> None:
    assert parse_plain(plain_token("bob", "pw")) == ("bob", "pw")
    assert parse_plain(b"bob\0bob\0pw") == ("bob", "pw")
    for bad in (b"bob\0pw", b"\0\0pw", b"\0bob\0", b"x\0bob\0pw"):
        with pytest.raises(SaslError):
            parse_plain(bad)


def test_a_credential_checks_the_password_it_was_made_from() -> None:
    credential = ScramCredential.from_password("SCRAM-SHA-512", "pw", iterations=4096)
    assert credential.check_password("pw") and not credential.check_password("pW")
    again = ScramCredential.from_dict("SCRAM-SHA-512", credential.as_dict())
    assert again == credential
    assert "pw" not in repr(credential) and "salt" not in repr(credential)


# -- the users file -------------------------------------------------------------------------


def users_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "users.yaml"
    path.write_text(text)
    return path


def test_a_users_file_with_passwords_and_credentials(tmp_path: Path) -> None:
    (tmp_path / "carol.secret").write_text("from-a-file\n")
    hashed = ScramCredential.from_password("SCRAM-SHA-512", "bobs").as_dict()
    path = users_file(tmp_path, (
        "users:\n"
        "  alice: {password: alices}\n"
        f"  bob:\n    scram-sha-512: {hashed}\n"
        "  carol: {password_file: carol.secret}\n"))
    users = SaslUsers(path)
    assert len(users) == 3
    assert users.check_plain("alice", "alices") and not users.check_plain("alice", "x")
    assert users.check_plain("bob", "bobs") and not users.check_plain("bob", "alices")
    assert users.check_plain("carol", "from-a-file")
    assert not users.check_plain("nobody", "alices")
    # A password user has both SCRAM credentials; bob only the one he was given.
    assert users.scram("SCRAM-SHA-256", "alice") is not None
    assert users.scram("SCRAM-SHA-256", "bob") is None
    assert users.scram("SCRAM-SHA-512", "bob") is not None


@pytest.mark.parametrize(("text", "line", "error"), [
    ("users: {}\n", 1, "needs 'users:'"),
    ("people: {a: {password: x}}\n", 1, "needs 'users:'"),
    ("users:\n  a: {}\n", 2, "needs a password"),
    ("users:\n  a:\n    password: x\n    SCRAM-SHA-256: "
     f"{ScramCredential.from_password('SCRAM-SHA-256', 'x').as_dict()}\n", 3, "not both"),
    ("users:\n  a:\n    SCRAM-SHA-256: {salt: AA==, iterations: 10, stored_key: AA==, "
     "server_key: AA==}\n", 3, "iterations must be"),
    ("users:\n  a:\n    SCRAM-SHA-256: {salt: '!!', iterations: 4096, stored_key: AA==, "
     "server_key: AA==}\n", 3, "salt must be base64"),
    ("users:\n  a:\n    SCRAM-SHA-256: {salt: AA==, iterations: 4096, stored_key: AA==, "
     "server_key: AA==}\n", 3, "stored_key must be 32 bytes"),
    ("users:\n  a: {password: x, role: admin}\n", 2, "unknown key 'role'"),
    ("users:\n  a: {password_file: missing.secret}\n", 2, "cannot read"),
])
def test_a_bad_users_file_is_refused_with_its_line(tmp_path: Path, text: str, line: int,
                                                   error: str) -> None:
    path = users_file(tmp_path, text)
    with pytest.raises(ConfigError, match=error) as caught:
        load_users(path)
    assert caught.value.file == str(path) and caught.value.line == line


def test_a_bad_reload_keeps_the_users_before_it(tmp_path: Path) -> None:
    path = users_file(tmp_path, "users:\n  alice: {password: one}\n")
    users = SaslUsers(path)
    path.write_text("users:\n  alice: {password: one\n")  # broken YAML
    assert users.changed() and not users.reload()
    assert "users.yaml:" in (users.last_error or "")
    assert users.check_plain("alice", "one")
    path.write_text("users:\n  alice: {password: two}\n")
    assert users.reload() and users.check_plain("alice", "two")
    assert not users.check_plain("alice", "one")


def test_the_sasl_config(tmp_path: Path) -> None:
    path = users_file(tmp_path, "users:\n  alice: {password: one}\n")
    (tmp_path / "proxy.secret").write_text("p\n")
    config = config_from_text(
        "listen: 127.0.0.1:0\nupstream: [127.0.0.1:9092]\nsasl:\n"
        f"  downstream: {{users_file: {path.name}, mechanisms: [SCRAM-SHA-256]}}\n"
        "  upstream: {mechanism: SCRAM-SHA-512, username: gh, password_file: proxy.secret}\n",
        base=tmp_path)
    assert config.sasl_downstream is not None
    assert config.sasl_downstream.mechanisms == ("SCRAM-SHA-256",)
    assert config.sasl_downstream.users_file == path
    assert config.sasl_downstream.session_lifetime is None
    assert config.sasl_upstream is not None and config.sasl_upstream.password == "p"
    assert "'p'" not in repr(config.sasl_upstream)
    for text, line, error in [
        (f"  downstream: {{users_file: {path.name}, mechanisms: [GSSAPI]}}\n", 4,
         "GSSAPI needs sasl.downstream.kerberos"),
        (f"  downstream: {{users_file: {path.name}, mechanisms: [KERBEROS]}}\n", 4,
         "'KERBEROS' is not one of PLAIN, SCRAM-SHA-256, SCRAM-SHA-512, OAUTHBEARER, GSSAPI"),
        ("  downstream: {mechanisms: [PLAIN]}\n", 4, "needs users_file"),
        (f"  downstream: {{users_file: {path.name}, session_lifetime: 0}}\n", 4,
         "session_lifetime must be positive"),
        ("  downstream: {users_file: nowhere.yaml}\n", 4, "does not exist"),
        ("  upstream: {mechanism: SCRAM-SHA-512, username: gh}\n", 4, "needs exactly one"),
        ("  upstream: {mechanism: OAUTHBEARER, username: gh, password: x}\n", 4,
         "needs one of token_endpoint_url"),
        ("  upstream: {mechanism: GSSAPI, username: gh, password: x}\n", 4,
         "needs 'principal'"),
        ("  upstream: {mechanism: KERBEROS, username: gh, password: x}\n", 4,
         "must be one of PLAIN, SCRAM-SHA-256, SCRAM-SHA-512, OAUTHBEARER, GSSAPI"),
    ]:
        with pytest.raises(ConfigError, match=error) as caught:
            config_from_text("listen: 127.0.0.1:0\nupstream: [127.0.0.1:9092]\nsasl:\n" + text,
                             "proxy.yaml", base=tmp_path)
        assert caught.value.line == line, (text, caught.value)


# -- one client's exchange ------------------------------------------------------------------


def test_one_clients_exchange(tmp_path: Path) -> None:
    users = SaslUsers(users_file(tmp_path, "users:\n  alice: {password: one}\n"))
    sasl = ClientSasl(users, ("SCRAM-SHA-256", "PLAIN"))
    assert sasl.handshake("SCRAM-SHA-512", 1) == 33  # UNSUPPORTED_SASL_MECHANISM
    assert sasl.handshake("plain", 1) == 33  # names compared exactly, as Kafka does
    assert sasl.handshake("SCRAM-SHA-256", 1) == 0 and not sasl.raw
    assert sasl.handshake("PLAIN", 1) == 34  # ILLEGAL_SASL_STATE: one handshake
    client = ScramClient("SCRAM-SHA-256", "alice", "one")
    answer, done = sasl.step(client.first_message())
    assert not done and sasl.claimed == "alice" and sasl.user is None
    answer, done = sasl.step(client.final_message(answer))
    client.check_final(answer)
    assert done and sasl.user == "alice"
    with pytest.raises(SaslError, match="already"):
        sasl.step(b"again")

    plain = ClientSasl(users, ("PLAIN",))
    with pytest.raises(SaslError, match="before a SaslHandshake"):
        plain.step(plain_token("alice", "one"))
    assert plain.handshake("PLAIN", 0) == 0 and plain.raw and plain.slow_step
    with pytest.raises(SaslError, match="invalid credentials"):
        plain.step(plain_token("alice", "two"))
    assert plain.claimed == "alice" and plain.user is None


def test_gatehouse_credential_prints_an_entry_the_proxy_takes(tmp_path: Path) -> None:
    made = subprocess.run([sys.executable, "-m", "gatehouse.cli", "credential", "dave",
                           "--iterations", "4096"], input="dav3's pw\n", capture_output=True,
                          text=True, check=True)
    assert "dav3" not in made.stdout
    users = SaslUsers(users_file(tmp_path, made.stdout))
    for mechanism in ("SCRAM-SHA-256", "SCRAM-SHA-512"):
        credential = users.scram(mechanism, "dave")
        assert credential is not None and credential.iterations == 4096
        server = ScramServer(mechanism, {"dave": credential}.get)
        client = ScramClient(mechanism, "dave", "dav3's pw")
        client.check_final(server.final(client.final_message(server.first(
            client.first_message()))))
    assert users.check_plain("dave", "dav3's pw")
    assert main(["credential", "dave", "--iterations", "100"]) == 1


class FakeSession:
    def __init__(self, user: str) -> None:
        self.sasl_user: str | None = user
        self.revoked: list[str] = []

    def revoke(self, reason: str) -> None:
        self.revoked.append(reason)


def test_a_reload_ends_the_sessions_of_removed_users_and_changed_passwords(
        tmp_path: Path) -> None:
    bob = ScramCredential.from_password("SCRAM-SHA-512", "b1").as_dict()
    path = users_file(tmp_path, "users:\n  alice: {password: a1}\n"
                                f"  bob: {{SCRAM-SHA-512: {bob}}}\n  carol: {{password: c1}}\n")
    users = SaslUsers(path)
    sessions = {name: FakeSession(name) for name in ("alice", "bob", "carol")}
    for session in sessions.values():
        users.sessions.add(session)
    # The same file again: password users get new salts, but nothing changed.
    assert users.reload() and not any(s.revoked for s in sessions.values())
    new_bob = ScramCredential.from_password("SCRAM-SHA-512", "b2").as_dict()
    path.write_text(f"users:\n  alice: {{password: a2}}\n  bob: {{SCRAM-SHA-512: {new_bob}}}\n")
    assert users.reload()
    assert sessions["alice"].revoked == ["SASL user 'alice' has new credentials"]
    assert sessions["bob"].revoked == ["SASL user 'bob' has new credentials"]
    assert sessions["carol"].revoked == ["SASL user 'carol' removed from the users file"]
    assert not users.sessions  # each ended once


def test_gatehouse_credential_keeps_a_users_file(tmp_path: Path) -> None:
    path = tmp_path / "users.yaml"

    def credential(user: str, password: str, *more: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "gatehouse.cli", "credential", user,
                               "--iterations", "4096", "--file", str(path), *more],
                              input=password + "\n", capture_output=True, text=True)

    assert credential("team-a", "pw-a").returncode == 0
    assert path.stat().st_mode & 0o777 == 0o600  # credentials: the owner's only
    assert credential("team-b", "pw-b").returncode == 0
    replaced = credential("team-a", "pw-a2", "--mechanism", "SCRAM-SHA-512")
    assert replaced.returncode == 0 and "2 user(s)" in replaced.stdout
    users = SaslUsers(path)
    assert users.check_plain("team-a", "pw-a2") and not users.check_plain("team-a", "pw-a")
    assert users.scram("SCRAM-SHA-256", "team-a") is None  # replaced whole
    assert users.check_plain("team-b", "pw-b")
    assert "pw-" not in path.read_text()
    path.write_text("users: [\n")  # a file the proxy would refuse is left alone
    broken = credential("team-c", "pw-c")
    assert broken.returncode == 1 and "users.yaml:2" in broken.stderr
    assert path.read_text() == "users: [\n"


def test_gatehouse_check_says_what_the_proxy_does_with_sasl(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    users_file(tmp_path, "users:\n  alice: {password: a}\n  bob: {password: b}\n")
    (tmp_path / "proxy.secret").write_text("p\n")
    path = tmp_path / "gatehouse.yaml"
    path.write_text("listen: 127.0.0.1:9192\nupstream: [127.0.0.1:9092]\nsasl:\n"
                    "  downstream: {users_file: users.yaml, session_lifetime: 600}\n"
                    "  upstream: {mechanism: SCRAM-SHA-512, username: gh, "
                    "password_file: proxy.secret}\n")
    assert main(["check", "--config", str(path)]) == 0
    out, err = capsys.readouterr()
    assert (f"sasl.downstream: clients authenticate with the proxy as one of 2 users of "
            f"{tmp_path / 'users.yaml'} (SCRAM-SHA-512, SCRAM-SHA-256, PLAIN, session "
            "lifetime 600 s)") in out
    assert "sasl.upstream: the proxy authenticates to the brokers as 'gh' (SCRAM-SHA-512)" in out
    assert "'p'" not in out
    assert "alice, bob keep their password in the file itself" in err  # password: a / b
    assert "offers PLAIN without tls.downstream" in err
    (tmp_path / "alice.secret").write_text("a\n")
    users_file(tmp_path, "users:\n  alice: {password_file: alice.secret}\n")
    path.write_text(path.read_text().replace("session_lifetime: 600",
                                             "mechanisms: [SCRAM-SHA-256]"))
    assert main(["check", "--config", str(path)]) == 0
    assert capsys.readouterr().err == ""  # nothing to warn of
    (tmp_path / "users.yaml").write_text("users:\n  alice: {}\n")
    assert main(["check", "--config", str(path)]) == 1
    assert "users.yaml:2: users.alice needs a password" in capsys.readouterr().err
