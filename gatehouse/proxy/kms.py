"""The KMSs that hold ``encrypt_records``' key-encryption keys (``encrypt_records.kms``).

AWS KMS (``type: aws``), or any service that speaks its API: a DEK is made with
``GenerateDataKey`` (AES_256) under the rule's key, and opened with ``Decrypt``; the KEK
never leaves the KMS.  The EDEK is bound to the KEK's name by the encryption context
``{"gatehouse.kek": name}`` (which the KMS logs in CloudTrail beside the caller).  Calls
are botocore's (the ``aws`` extra), blocking: the cipher makes them in threads only.
Credentials come from botocore's chain (environment, shared files and profiles, web
identity on Kubernetes, container and instance roles), never from the rules file.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from gatehouse.proxy.awsiam import EXTRA_HINT
from gatehouse.rules.encryption import (
    EncryptionKeys,
    Kek,
    KmsSpec,
    KmsUnavailable,
    RecordEncryption,
    Undecryptable,
    local_keys,
)

# What AWS KMS answers for an EDEK that is not one of the key's (changed, or sealed
# under another key): the record is undecryptable, not the KMS unavailable.
_NOT_ITS_CIPHERTEXT = frozenset({"InvalidCiphertextException", "IncorrectKeyException"})
_CONTEXT_KEY = "gatehouse.kek"


class AwsKms:
    """One AWS KMS client (region, endpoint, timeout), made on its first call."""

    def __init__(self, spec: KmsSpec) -> None:
        self.spec = spec
        self._client: Any = None
        self._lock = threading.Lock()

    @property
    def where(self) -> str:
        return self.spec.endpoint or f"AWS KMS ({self.spec.region or 'the default region'})"

    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                try:
                    import botocore.config
                    import botocore.session
                except ImportError:
                    raise KmsUnavailable(f"encrypt_records.kms needs botocore: {EXTRA_HINT}"
                                         ) from None
                timeout = self.spec.timeout
                self._client = botocore.session.Session().create_client(
                    "kms", region_name=self.spec.region, endpoint_url=self.spec.endpoint,
                    config=botocore.config.Config(
                        connect_timeout=timeout / 2, read_timeout=timeout / 2,
                        retries={"mode": "standard", "total_max_attempts": 2}))
            return self._client

    def call(self, operation: str, **kwargs: Any) -> dict[str, Any]:
        """One KMS call; ``KmsUnavailable`` (or ``Undecryptable``) saying why it failed,
        never a secret."""
        try:
            import botocore.exceptions
        except ImportError:
            raise KmsUnavailable(f"encrypt_records.kms needs botocore: {EXTRA_HINT}") from None
        try:
            return getattr(self.client(), operation)(**kwargs)  # type: ignore[no-any-return]
        except botocore.exceptions.ClientError as exc:
            error = exc.response.get("Error", {})
            code, message = error.get("Code", "?"), str(error.get("Message", ""))[:200]
            if code in _NOT_ITS_CIPHERTEXT:
                raise Undecryptable(f"{self.where} does not open its data key ({code})"
                                    ) from None
            raise KmsUnavailable(f"{self.where}: {code}: {message}") from None
        except botocore.exceptions.BotoCoreError as exc:  # no route, timeouts, no credentials
            raise KmsUnavailable(f"{self.where}: {exc}") from None

    def kek(self, name: str) -> AwsKek:
        return AwsKek(name, name[len(self.spec.prefix):], self)


@dataclass(frozen=True)
class AwsKek:
    """A KEK held by AWS KMS, by the name envelopes give it (``aws-kms:<key>``)."""

    name: str
    key: str  # the key id, ARN or alias the name holds
    kms: AwsKms = field(compare=False, repr=False)

    @property
    def remote(self) -> bool:
        return True

    def new_dek(self) -> tuple[bytes, bytes]:
        made = self.kms.call("generate_data_key", KeyId=self.key, KeySpec="AES_256",
                             EncryptionContext={_CONTEXT_KEY: self.name})
        return bytes(made["Plaintext"]), bytes(made["CiphertextBlob"])

    def unwrap(self, edek: bytes) -> bytes:
        opened = self.kms.call("decrypt", CiphertextBlob=edek, KeyId=self.key,
                               EncryptionContext={_CONTEXT_KEY: self.name})
        return bytes(opened["Plaintext"])


class KmsClients:
    """The KMS clients of the rules' encryptions, one per KMS (kept across reloads:
    a reload does not make new connections), and each encryption's KEKs."""

    def __init__(self) -> None:
        self._clients: dict[tuple[str, str | None, str | None, float], AwsKms] = {}
        self._lock = threading.Lock()

    def client(self, spec: KmsSpec) -> AwsKms:
        where = (spec.type, spec.region, spec.endpoint, spec.timeout)
        with self._lock:
            found = self._clients.get(where)
            if found is None:
                found = self._clients[where] = AwsKms(spec)
            return found

    def keys_of(self, encryption: RecordEncryption) -> EncryptionKeys:
        """The KEKs of an encryption: its key file's, and every key of its KMS."""
        local = local_keys(encryption)
        spec = encryption.kms
        if spec is None:
            return local
        kms = self.client(spec)
        prefix = spec.prefix

        def find(name: str) -> Kek | None:
            if name.startswith(prefix) and len(name) > len(prefix):
                return kms.kek(name)
            return local.find(name)

        if spec.per_topic:
            return EncryptionKeys(None, find, lambda topic: kms.kek(spec.kek_name_for(topic)))
        return EncryptionKeys(kms.kek(spec.kek_name), find)


def probe_kms(encryption: RecordEncryption) -> tuple[str, bool]:
    """``gatehouse check --probe``: a data key made under an encryption's KMS key and
    opened again, as the proxy would (blocking); a line saying how it went, and whether
    it did."""
    spec = encryption.kms
    assert spec is not None
    if spec.per_topic:
        return (f"{spec.kek_name}: one key per topic, named by the topic: none probed (a "
                "topic without one is answered REQUEST_TIMED_OUT and logged)"), True
    kek = KmsClients().keys_of(encryption).sealing
    assert kek is not None
    started = time.monotonic()
    try:
        secret, edek = kek.new_dek()
        if kek.unwrap(edek) != secret:
            return f"{kek.name}: the data key it made opened to another", False
    except (KmsUnavailable, Undecryptable) as exc:
        return f"{kek.name}: {exc}", False
    return (f"{kek.name}: a data key made and opened in "
            f"{(time.monotonic() - started) * 1000:.0f} ms"), True


__all__ = ["AwsKek", "AwsKms", "KmsClients", "probe_kms"]
