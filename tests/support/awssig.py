"""What an Amazon MSK broker checks in an IAM token, written from AWS's SigV4 description
(not from a signer): the token is a base64url presigned GET of
``https://kafka.<region>.amazonaws.com/?Action=kafka-cluster:Connect``; its signature
is recomputed here from the secret key of the access key it names."""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import time
import urllib.parse
from calendar import timegm
from dataclasses import dataclass
from pathlib import Path

import pytest

UNSIGNED = ("X-Amz-Signature", "User-Agent")  # the user agent is added after signing


@dataclass(frozen=True)
class MskToken:
    access_key: str
    region: str
    action: str
    session_token: str | None
    signed_at: float  # seconds since the epoch
    expires: float  # seconds since the epoch
    user_agent: str | None


class TokenInvalid(Exception):
    pass


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


def _quote(text: str) -> str:
    return urllib.parse.quote(text, safe="-_.~")


def verify_msk_token(token: str, secrets: dict[str, str], now: float | None = None
                     ) -> MskToken:
    """The token's claims if its signature is right for the secret of the access key it
    names (``secrets``: access key -> secret) and it has not expired; TokenInvalid."""
    try:
        url = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
    except ValueError as exc:
        raise TokenInvalid(f"not base64url: {exc}") from None
    parts = urllib.parse.urlsplit(url)
    pairs = urllib.parse.parse_qsl(parts.query, keep_blank_values=True, strict_parsing=True)
    params = dict(pairs)
    if parts.scheme != "https" or parts.path not in ("", "/"):
        raise TokenInvalid(f"not an https URL of the service's root: {url.split('?')[0]}")
    if params.get("X-Amz-Algorithm") != "AWS4-HMAC-SHA256":
        raise TokenInvalid("not signed with AWS4-HMAC-SHA256")
    access_key, date, region, service, terminal = params["X-Amz-Credential"].split("/")
    if service != "kafka-cluster" or terminal != "aws4_request":
        raise TokenInvalid(f"a credential scope for {service}, not kafka-cluster")
    if parts.netloc != f"kafka.{region}.amazonaws.com":
        raise TokenInvalid(f"signed for {parts.netloc}, not the region's kafka host")
    if params.get("X-Amz-SignedHeaders") != "host":
        raise TokenInvalid("signs headers other than host")
    secret = secrets.get(access_key)
    if secret is None:
        raise TokenInvalid(f"an unknown access key {access_key}")
    amz_date = params["X-Amz-Date"]
    canonical_query = "&".join(f"{_quote(k)}={_quote(v)}"
                               for k, v in sorted(pairs) if k not in UNSIGNED)
    canonical_request = "\n".join(["GET", "/", canonical_query, f"host:{parts.netloc}", "",
                                   "host", hashlib.sha256(b"").hexdigest()])
    scope = f"{date}/{region}/{service}/{terminal}"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope,
                         hashlib.sha256(canonical_request.encode()).hexdigest()])
    key = _hmac(("AWS4" + secret).encode(), date)
    for part in (region, service, terminal):
        key = _hmac(key, part)
    expected = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected, params.get("X-Amz-Signature", "")):
        raise TokenInvalid("the signature does not match")
    signed_at = float(timegm(time.strptime(amz_date, "%Y%m%dT%H%M%SZ")))
    expires = signed_at + int(params["X-Amz-Expires"])
    if (time.time() if now is None else now) >= expires:
        raise TokenInvalid("expired")
    return MskToken(access_key, region, params.get("Action", ""),
                    params.get("X-Amz-Security-Token"), signed_at, expires,
                    params.get("User-Agent"))


def no_aws_credentials(monkeypatch: pytest.MonkeyPatch, where: Path) -> Path:
    """No AWS credentials for botocore but what a test gives: the environment's removed,
    the shared files moved to ``where/aws`` (returned), no instance metadata asked for."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    home = where / "aws"
    home.mkdir()
    monkeypatch.setenv("AWS_CONFIG_FILE", str(home / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(home / "credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return home
