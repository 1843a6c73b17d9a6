"""The principal of a TLS client: its verified certificate's subject, written as Kafka's
default principal builder writes an SSL client's (RFC 2253), held to the
``cryptography`` package's RFC 4514 writer over certificates made for the test and read
back by Python's ssl module, as the proxy reads them; and Kafka's principal mapping
rules (``tls.downstream.principal_mapping_rules``)."""

from __future__ import annotations

import datetime
import ssl
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gatehouse.configfile import ConfigError
from gatehouse.proxy.config import config_from_text
from gatehouse.proxy.principal import (
    PrincipalMappingError,
    certificate_principal,
    mapped_principal,
    parse_principal_mapping,
)
from tests.codec_strategies import examples

_KEY = ec.generate_private_key(ec.SECP256R1())
_TEXT_ATTRIBUTES = [NameOID.COMMON_NAME, NameOID.ORGANIZATION_NAME,
                    NameOID.ORGANIZATIONAL_UNIT_NAME, NameOID.LOCALITY_NAME,
                    NameOID.STATE_OR_PROVINCE_NAME, NameOID.STREET_ADDRESS, NameOID.USER_ID]
_VALUE = st.text(alphabet=st.sampled_from('ab Z09-._,+"\\<>;#=\0'), min_size=1, max_size=12)
_ATTRIBUTE = st.one_of(
    st.tuples(st.sampled_from(_TEXT_ATTRIBUTES), _VALUE),
    st.tuples(st.just(NameOID.COUNTRY_NAME), st.sampled_from(["DE", "US", "NZ"])),
    st.tuples(st.just(NameOID.DOMAIN_COMPONENT), st.sampled_from(["example", "com"])),
)


def read_back(subject: x509.Name, tmp: Path) -> tuple[dict[str, Any], str]:
    """A certificate with ``subject``, as ``SSLObject.getpeercert()`` gives it, and its
    subject as ``cryptography`` writes it when it reads the certificate (the attributes
    of a multi-valued part in their encoded order, as every reader sees them)."""
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(_KEY.public_key()).serial_number(1).not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(days=1)).sign(_KEY, hashes.SHA256()))
    path = tmp / "cert.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    decoded: dict[str, Any] = ssl._ssl._test_decode_cert(str(path))  # type: ignore[attr-defined]
    return decoded, x509.load_pem_x509_certificate(path.read_bytes()).subject.rfc4514_string()


@settings(max_examples=examples(150), deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(_ATTRIBUTE, min_size=1, max_size=2), min_size=1, max_size=4))
@example([[(NameOID.COUNTRY_NAME, "DE")], [(NameOID.ORGANIZATION_NAME, "corp")],
          [(NameOID.ORGANIZATIONAL_UNIT_NAME, "team-a")], [(NameOID.COMMON_NAME, "app, 1")]])
@example([[(NameOID.COMMON_NAME, "#lead and trail ")]])
@example([[(NameOID.COMMON_NAME, "x\\ ")]])
def test_the_principal_is_the_subject_as_rfc_2253_writes_it(
        tmp_path: Path, rdns: list[list[tuple[x509.ObjectIdentifier, str]]]) -> None:
    subject = x509.Name([x509.RelativeDistinguishedName(
        [x509.NameAttribute(oid, value) for oid, value in dict(rdn).items()])
        for rdn in rdns])
    decoded, expected = read_back(subject, tmp_path)
    assert certificate_principal(decoded) == expected


def test_the_most_specific_part_comes_first(tmp_path: Path) -> None:
    subject = x509.Name([x509.NameAttribute(NameOID.COUNTRY_NAME, "DE"),
                         x509.NameAttribute(NameOID.ORGANIZATION_NAME, "corp"),
                         x509.NameAttribute(NameOID.COMMON_NAME, "team-a")])
    assert certificate_principal(read_back(subject, tmp_path)[0]) == "CN=team-a,O=corp,C=DE"


def test_a_value_of_one_space_is_escaped_once() -> None:
    # cryptography writes "\\\ " here (both its leading and trailing rules fire).
    assert certificate_principal({"subject": ((("commonName", " "),),)}) == "CN=\\ "


def test_no_certificate_no_principal() -> None:
    assert certificate_principal(None) is None
    assert certificate_principal({}) is None  # what getpeercert() gives when none was asked
    assert certificate_principal({"subject": ()}) is None


def test_attributes_without_a_keyword_keep_their_names() -> None:
    cert = {"subject": ((("commonName", "a"), ("emailAddress", "a@example.com")),)}
    assert certificate_principal(cert) == "CN=a+emailAddress=a@example.com"


# The example of Kafka's documentation for ssl.principal.mapping.rules, as brokers take it.
KAFKA_DOCS_RULES = ("RULE:^CN=(.*?),OU=ServiceUsers.*$/$1/,"
                    "RULE:^CN=(.*?),OU=(.*?),O=(.*?),L=(.*?),ST=(.*?),C=(.*?)$/$1@$2/L,"
                    "RULE:^.*[Cc][Nn]=([a-zA-Z0-9.]*).*$/$1/L,"
                    "DEFAULT")


@pytest.mark.parametrize(("subject", "principal"), [
    ("CN=serviceuser,OU=ServiceUsers,O=Unknown,L=Unknown,ST=Unknown,C=Unknown", "serviceuser"),
    ("CN=adminUser,OU=Admin,O=Unknown,L=Unknown,ST=Unknown,C=Unknown", "adminuser@admin"),
    ("OU=x,cn=Duke.Of.Earl,O=y", "duke.of.earl"),
    ("OU=no-common-name", "OU=no-common-name"),  # DEFAULT: the whole subject
])
def test_kafkas_documented_rules_give_kafkas_principals(subject: str, principal: str) -> None:
    assert mapped_principal(parse_principal_mapping(KAFKA_DOCS_RULES), subject) == principal


def test_the_first_matching_rule_wins_and_no_match_is_none() -> None:
    rules = parse_principal_mapping("RULE:^CN=([^,]*),OU=tenants,.*$/$1/U\n"
                                    "RULE:^CN=([^,]*),.*$/other-$1/")
    assert mapped_principal(rules, "CN=team-a,OU=tenants,O=corp") == "TEAM-A"
    assert mapped_principal(rules, "CN=ops,OU=staff,O=corp") == "other-ops"
    assert mapped_principal(rules, "O=corp") is None  # no DEFAULT: refused


def test_escapes_in_patterns_and_replacements() -> None:
    # "\/" is a slash in either; "\$" a dollar in the replacement; ${name} a named group.
    rules = parse_principal_mapping(r"RULE:^CN=(?<who>[^,\/]*)\/(.*)$/${who}\/\$$2/")
    assert mapped_principal(rules, "CN=a/b") == "a/$b"


@pytest.mark.parametrize(("text", "message"), [
    ("RULE:^CN=(.*$/$1/", "pattern"),
    ("RULE:^CN=.*$/x", "not a principal mapping rule"),
    ("DEFAULT,NONSENSE", "not a principal mapping rule"),
    ("  ", "no principal mapping rules"),
])
def test_bad_rules_say_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(PrincipalMappingError, match=message):
        parse_principal_mapping(text)


def _tls_config(tmp_path: Path, extra: str) -> str:
    for name in ("cert.pem", "key.pem", "ca.pem"):
        (tmp_path / name).write_text("")
    return ("listen: 127.0.0.1:9192\nupstream: [x:1]\ntls:\n  downstream:\n"
            f"    cert: {tmp_path}/cert.pem\n    key: {tmp_path}/key.pem\n{extra}")


def test_the_config_takes_kafkas_string_or_a_list(tmp_path: Path) -> None:
    one = config_from_text(_tls_config(tmp_path, f"    client_ca: {tmp_path}/ca.pem\n"
                                       f"    principal_mapping_rules: '{KAFKA_DOCS_RULES}'\n"))
    assert one.tls_downstream is not None and len(one.tls_downstream.principal_mapping) == 4
    listed = config_from_text(_tls_config(tmp_path, f"    client_ca: {tmp_path}/ca.pem\n"
                                          "    principal_mapping_rules:\n"
                                          "      - RULE:^CN=([^,]*),.*$/$1/\n"
                                          "      - DEFAULT\n"))
    assert listed.tls_downstream is not None
    assert mapped_principal(listed.tls_downstream.principal_mapping, "CN=a,O=b") == "a"


@pytest.mark.parametrize(("extra", "line", "message"), [
    ("    client_ca: {d}/ca.pem\n    principal_mapping_rules:\n      - DEFAULT\n"
     "      - RULE:^CN=(/$1/\n", 10, "pattern"),
    ("    client_ca: {d}/ca.pem\n    principal_mapping_rules: [7]\n", 8, "each rule is a string"),
    ("    principal_mapping_rules: DEFAULT\n", 7, "needs client_ca"),
])
def test_bad_rules_in_the_config_say_file_and_line(tmp_path: Path, extra: str, line: int,
                                                   message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        config_from_text(_tls_config(tmp_path, extra.format(d=tmp_path)), "proxy.yaml")
    assert str(info.value).startswith(f"proxy.yaml:{line}: ")
