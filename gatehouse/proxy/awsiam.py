"""Amazon MSK IAM logins: the proxy's OAUTHBEARER token for brokers that take AWS IAM
(``sasl.upstream: {mechanism: OAUTHBEARER, aws_msk_iam: {region: ...}}``).

MSK's token is a presigned ``kafka-cluster:Connect`` URL for the cluster's region
(SigV4, 15 minutes), base64url-encoded, sent as an OAUTHBEARER token.  AWS's own signer
(``aws-msk-iam-sasl-signer-python``, the ``aws`` extra) makes it, from botocore's
credential chain: environment, shared files and profiles (role_arn + source_profile
included), web identity (EKS IRSA), container and instance credentials.  Imported only
when a config asks for it."""

from __future__ import annotations

import importlib.util
import time
from typing import Any

from gatehouse.codecs.scram import SaslError

EXTRA_HINT = "pip install 'kafka-gatehouse[aws]'"


def signer_installed() -> bool:
    """Whether AWS's MSK token signer can be imported (the ``aws`` extra)."""
    return importlib.util.find_spec("aws_msk_iam_sasl_signer") is not None


def msk_iam_token(region: str, profile: str | None) -> tuple[str, float]:
    """A token for the brokers of an MSK cluster in ``region`` signed with the
    credentials of ``profile`` (None: botocore's default chain), and the seconds it
    lasts (blocking: run in a thread); SaslError saying why there is none, never a
    secret."""
    try:
        import botocore.exceptions
        import botocore.session
        from aws_msk_iam_sasl_signer import MSKAuthTokenProvider
    except ImportError:
        raise SaslError(f"aws_msk_iam needs AWS's token signer: {EXTRA_HINT}") from None
    try:
        credentials = botocore.session.Session(profile=profile).get_credentials()
    except botocore.exceptions.BotoCoreError as exc:  # a profile not found...
        raise SaslError(f"cannot sign an MSK IAM token: {exc}") from None
    if credentials is None:
        raise SaslError("no AWS credentials found for aws_msk_iam"
                        + (f" in profile {profile!r}" if profile else "")
                        + " (looked in: the environment, the shared credentials and config "
                        "files, web identity, container and instance credentials)")
    try:
        token, expires_ms = MSKAuthTokenProvider.generate_auth_token_from_credentials_provider(
            region, _resolved(credentials))
    except Exception as exc:  # whatever the signer says is a login error, reported
        raise SaslError(f"cannot sign an MSK IAM token: {type(exc).__name__}: {exc}") from None
    return token, expires_ms / 1000 - time.time()


def _resolved(credentials: Any) -> Any:
    """The credentials already found, as the signer's credentials-provider argument."""
    from botocore.credentials import CredentialProvider

    class Resolved(CredentialProvider):  # type: ignore[misc]
        METHOD = "gatehouse-resolved"

        def load(self) -> Any:
            return credentials

    return Resolved()
