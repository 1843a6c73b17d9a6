"""The principal of a TLS client: its verified certificate's subject, written as Kafka's
default principal builder writes an SSL client's (RFC 2253), held to the
``cryptography`` package's RFC 4514 writer over certificates made for the test and read
back by Python's ssl module, as the proxy reads them."""

from __future__ import annotations

import datetime
import ssl
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gatehouse.proxy.tls import certificate_principal

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


@settings(max_examples=150, deadline=None, database=None,
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
