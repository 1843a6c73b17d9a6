"""sasl.upstream with Amazon MSK IAM (``aws_msk_iam``): the config, the tokens AWS's
signer makes from botocore's credential chain, checked here as an MSK broker checks
them (tests/support/awssig.py), and the proxy's login with them."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import trio

from gatehouse import codecs
from gatehouse.cli import main
from gatehouse.codecs.sasl import parse_bearer_message
from gatehouse.codecs.scram import SaslError
from gatehouse.configfile import ConfigError
from gatehouse.proxy.config import config_from_text
from gatehouse.proxy.oauth import OAuthClient, TokenSource, fetch_token
from gatehouse.proxy.sasl import authenticate_upstream
from tests.support.awssig import TokenInvalid, no_aws_credentials, verify_msk_token

HEAD = "listen: 127.0.0.1:0\nupstream: [127.0.0.1:9092]\nsasl:\n"
KEY, SECRET = "AKIAGATEHOUSETEST", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    return no_aws_credentials(monkeypatch, tmp_path)


def test_the_config_takes_aws_msk_iam(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                      ) -> None:
    config = config_from_text(HEAD + "  upstream:\n    mechanism: OAUTHBEARER\n"
                              "    aws_msk_iam: {region: eu-west-1, profile: team}\n",
                              base=tmp_path)
    assert config.sasl_upstream == OAuthClient(aws_region="eu-west-1", aws_profile="team")
    for text, line, error in [
        ("    aws_msk_iam: {profile: team}\n", 6, r"aws_msk_iam needs region"),
        ("    aws_msk_iam: {region: eu-west-1, role: x}\n", 6,
         r"unknown key 'role' in config.sasl.upstream.aws_msk_iam"),
        ("    aws_msk_iam: {region: eu-west-1}\n    token_file: t.jwt\n", 5,
         "needs one of token_endpoint_url .* and aws_msk_iam"),
        ("    aws_msk_iam: {region: eu-west-1}\n    client_id: gh\n", 7,
         "unknown key 'client_id'"),
    ]:
        with pytest.raises(ConfigError, match=error) as caught:
            config_from_text(HEAD + "  upstream:\n    mechanism: OAUTHBEARER\n" + text,
                             "proxy.yaml", base=tmp_path)
        assert caught.value.line == line, (text, caught.value)
    path = tmp_path / "proxy.yaml"
    path.write_text(HEAD + "  upstream:\n    mechanism: OAUTHBEARER\n"
                    "    aws_msk_iam: {region: eu-west-1}\n"
                    "tls: {upstream: {}}\n")
    assert main(["check", "--config", str(path)]) == 0
    out, err = capsys.readouterr()
    assert ("sasl.upstream: the proxy authenticates to the brokers with OAUTHBEARER tokens "
            "of Amazon MSK IAM in eu-west-1, signed with the default AWS credentials") in out
    assert err == ""


def test_the_signer_missing_is_a_config_error_naming_the_extra(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("gatehouse.proxy.oauth.signer_installed", lambda: False)
    with pytest.raises(ConfigError, match=r"needs AWS's token signer: pip install "
                       r"'kafka-gatehouse\[aws\]'") as caught:
        config_from_text(HEAD + "  upstream:\n    mechanism: OAUTHBEARER\n"
                         "    aws_msk_iam: {region: eu-west-1}\n", "proxy.yaml", base=tmp_path)
    assert caught.value.line == 6


def test_a_token_signed_with_the_environments_credentials_passes_an_msk_brokers_check(
        aws_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_SESSION_TOKEN", "IQoJb3JpZ2luX2Vj/session+token=")
    token, lifetime = fetch_token(OAuthClient(aws_region="eu-west-1"))
    checked = verify_msk_token(token, {KEY: SECRET})
    assert (checked.access_key, checked.region, checked.action) == (
        KEY, "eu-west-1", "kafka-cluster:Connect")
    assert checked.session_token == "IQoJb3JpZ2luX2Vj/session+token="
    assert checked.expires - checked.signed_at == 900  # MSK's 15 minutes
    assert 898 < lifetime <= 900 and abs(checked.expires - (time.time() + lifetime)) < 2
    with pytest.raises(TokenInvalid, match="signature does not match"):
        verify_msk_token(token, {KEY: SECRET[:-1] + "X"})
    with pytest.raises(TokenInvalid, match="expired"):
        verify_msk_token(token, {KEY: SECRET}, now=checked.expires)
    # Another region: another host and scope, so another signature.
    other, _ = fetch_token(OAuthClient(aws_region="us-east-1"))
    assert verify_msk_token(other, {KEY: SECRET}).region == "us-east-1"


def test_a_profiles_credentials_sign_its_tokens(aws_env: Path) -> None:
    (aws_env / "credentials").write_text(
        f"[default]\naws_access_key_id = AKIADEFAULT\naws_secret_access_key = other\n\n"
        f"[team]\naws_access_key_id = {KEY}\naws_secret_access_key = {SECRET}\n")
    token, _ = fetch_token(OAuthClient(aws_region="eu-west-1", aws_profile="team"))
    checked = verify_msk_token(token, {KEY: SECRET})
    assert checked.access_key == KEY and checked.session_token is None
    token, _ = fetch_token(OAuthClient(aws_region="eu-west-1"))
    assert verify_msk_token(token, {"AKIADEFAULT": "other"}).access_key == "AKIADEFAULT"


def test_no_credentials_is_a_login_error_that_says_so(aws_env: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SaslError, match=r"no AWS credentials found for aws_msk_iam \(looked"):
        fetch_token(OAuthClient(aws_region="eu-west-1"))
    with pytest.raises(SaslError, match=r"cannot sign an MSK IAM token: .*\(nope\)"):
        fetch_token(OAuthClient(aws_region="eu-west-1", aws_profile="nope"))
    # Whatever else the signer raises is a login error too (reported, the proxy runs on).
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)

    def broken(*_: object) -> None:
        raise RuntimeError("clock skew")

    from aws_msk_iam_sasl_signer import MSKAuthTokenProvider
    monkeypatch.setattr(MSKAuthTokenProvider, "generate_auth_token_from_credentials_provider",
                        broken)
    with pytest.raises(SaslError, match="cannot sign an MSK IAM token: RuntimeError: clock skew"):
        fetch_token(OAuthClient(aws_region="eu-west-1"))


async def test_the_proxy_logs_in_to_an_msk_broker_with_one_token_for_its_connections(
        aws_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The token goes in the OAUTHBEARER message a broker gets; the source signs once for
    every login until 80% of the token's 15 minutes has passed."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    seen: list[str] = []

    async def broker(req: codecs.Request) -> codecs.Response:
        cls = codecs.api(req.api_key).response.root.cls
        if req.api_key == 17:
            body = cls(error_code=0, mechanisms=("OAUTHBEARER",))
        else:
            token = parse_bearer_message(bytes(req.body.auth_bytes)).token
            checked = verify_msk_token(token, {KEY: SECRET})
            seen.append(token)
            body = cls(auth_bytes=b"", session_lifetime_ms=round(
                (checked.expires - time.time()) * 1000))
        return codecs.Response.build(req.api_key, req.api_version, req.correlation_id, body)

    source = TokenSource(OAuthClient(aws_region="eu-west-1"))
    for _ in range(3):
        lifetime = await authenticate_upstream(broker, source, "b-1.msk.example")
        assert lifetime is not None and 890 < lifetime <= 900
    assert source.fetches == 1 and len(set(seen)) == 1
    source._renew_at = trio.current_time()  # as if 12 minutes had passed
    await authenticate_upstream(broker, source, "b-1.msk.example")
    assert source.fetches == 2
