"""The KMSs that hold ``encrypt_records``' key-encryption keys (``encrypt_records.kms``).

AWS KMS (``type: aws``), or any service that speaks its API: a DEK is made with
``GenerateDataKey`` (AES_256) under the rule's key, and opened with ``Decrypt``; the KEK
never leaves the KMS.  The EDEK is bound to the KEK's name by the encryption context
``{"gatehouse.kek": name}`` (which the KMS logs in CloudTrail beside the caller).  Calls
are botocore's (the ``aws`` extra), blocking: the cipher makes them in threads only.
Credentials come from botocore's chain (environment, shared files and profiles, web
identity on Kubernetes, container and instance roles), never from the rules file.

A Vault (or OpenBao) transit secrets engine (``type: vault``): a DEK is made with
``POST /v1/<mount>/datakey/plaintext/<key>`` (256 bits) and opened with
``POST /v1/<mount>/decrypt/<key>``; the EDEK is Vault's ciphertext (``vault:v1:...``),
which opens under that key alone.  The token is read for every call from ``token_file``
(where Vault Agent keeps a renewed one) or from VAULT_TOKEN, never from the rules file;
calls are the standard library's HTTP, blocking, in threads only.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import http.client
import json
import os
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gatehouse.configfile import FileState, file_state
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
        return AwsKek(name, name[len(self.spec.prefix):], self.where, self)


@dataclass(frozen=True)
class AwsKek:
    """A KEK held by AWS KMS, by the name envelopes give it (``aws-kms:<key>``)."""

    name: str
    key: str  # the key id, ARN or alias the name holds
    where: str  # the KMS's endpoint or region: an alias of that name elsewhere is another KEK
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


# What Vault's transit engine answers (HTTP 400) for a ciphertext that is not one of the
# key's (changed, or sealed under another key): the record is undecryptable.
_NOT_VAULTS_CIPHERTEXT = ("invalid ciphertext", "message authentication failed")
# Answers worth a second try (Vault standby, sealed for a moment, throttled).
_VAULT_RETRIED = frozenset({412, 429, 500, 502, 503, 504})


class VaultKms:
    """One Vault transit engine (address, mount, namespace, token, CA, timeout)."""

    def __init__(self, spec: KmsSpec) -> None:
        assert spec.endpoint is not None
        self.spec = spec
        self.base = (f"{spec.endpoint.rstrip('/')}/v1/"
                     f"{urllib.parse.quote(spec.mount.strip('/'))}/")
        self._context: ssl.SSLContext | None = None
        self._stamp: FileState = None  # ca_file's, as last read
        self._lock = threading.Lock()

    @property
    def where(self) -> str:
        return f"Vault {self.spec.endpoint} ({self.spec.mount})"

    def _token(self) -> str:
        """The token, read again for every call (Vault Agent renews it in place)."""
        path = self.spec.token_file
        if path is None:
            token = os.environ.get("VAULT_TOKEN", "")
            if not token:
                raise KmsUnavailable(f"{self.where}: no token: set encrypt_records.kms."
                                     "token_file or VAULT_TOKEN")
            return token
        try:
            with open(path, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as exc:
            raise KmsUnavailable(f"{self.where}: token_file {path}: {exc.strerror}"
                                 ) from None
        if not token:
            raise KmsUnavailable(f"{self.where}: token_file {path} is empty")
        return token

    def _ssl(self) -> ssl.SSLContext:
        """The TLS context, made again when ``ca_file`` changes (a rotated CA is used
        without a restart)."""
        cafile = self.spec.ca_file
        try:
            stamp = None if cafile is None else file_state(Path(cafile))
            with self._lock:
                if self._context is None or stamp != self._stamp:
                    self._context = ssl.create_default_context(cafile=cafile)
                    self._stamp = stamp
                return self._context
        except (OSError, ssl.SSLError) as exc:
            raise KmsUnavailable(f"{self.where}: ca_file {cafile}: "
                                 f"{getattr(exc, 'strerror', None) or exc}") from None

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """One call to the transit engine (a second try on a network failure or an
        answer worth retrying); its ``data``.  ``KmsUnavailable`` saying why it failed
        (or ``Undecryptable``), never the token."""
        headers = {"X-Vault-Token": self._token(), "Content-Type": "application/json"}
        if self.spec.namespace:
            headers["X-Vault-Namespace"] = self.spec.namespace
        request = urllib.request.Request(self.base + path, json.dumps(body).encode(),
                                         headers, method="POST")
        context = self._ssl() if self.base.startswith("https:") else None
        failure = ""
        for _attempt in range(2):
            try:
                with urllib.request.urlopen(request, timeout=self.spec.timeout / 2,
                                            context=context) as answer:
                    data = json.load(answer).get("data")
                if not isinstance(data, dict):
                    raise KmsUnavailable(f"{self.where}: an answer without data")
                return data
            except urllib.error.HTTPError as exc:
                failure = f"HTTP {exc.code}: {_vault_errors(exc)}"
                if exc.code == 400 and path.startswith("decrypt/") and any(
                        m in failure for m in _NOT_VAULTS_CIPHERTEXT):
                    raise Undecryptable(f"{self.where} does not open its data key "
                                        f"({failure})") from None
                if exc.code not in _VAULT_RETRIED:
                    break
            except (urllib.error.URLError, OSError, ValueError,
                    http.client.HTTPException) as exc:  # no route, timeouts, not HTTP
                reason = getattr(exc, "reason", exc)
                failure = str(reason) or type(reason).__name__
        raise KmsUnavailable(f"{self.where}: {failure}")

    def kek(self, name: str) -> VaultKek:
        return VaultKek(name, name[len(self.spec.prefix):], self.where, self)


def _vault_errors(exc: urllib.error.HTTPError) -> str:
    """The ``errors`` of a Vault error answer (its messages, short), or its reason."""
    try:
        errors = json.loads(exc.read(4096)).get("errors")
    except (ValueError, OSError, AttributeError):
        errors = None
    if isinstance(errors, list) and errors:
        return "; ".join(str(e) for e in errors)[:200]
    return str(exc.reason)[:200]


@dataclass(frozen=True)
class VaultKek:
    """A KEK held by a Vault transit engine, by the name envelopes give it
    (``vault-kms:<key>``)."""

    name: str
    key: str  # the transit key's name
    where: str  # the engine's address and mount: the same name elsewhere is another KEK
    kms: VaultKms = field(compare=False, repr=False)

    @property
    def remote(self) -> bool:
        return True

    def new_dek(self) -> tuple[bytes, bytes]:
        made = self.kms.call(f"datakey/plaintext/{urllib.parse.quote(self.key)}",
                             {"bits": 256})
        try:
            secret = base64.b64decode(made["plaintext"], validate=True)
            edek = str(made["ciphertext"]).encode("ascii")
        except (KeyError, TypeError, ValueError, binascii.Error):
            raise KmsUnavailable(f"{self.kms.where}: a data key answer without its "
                                 "plaintext and ciphertext") from None
        if len(secret) != 32:
            raise KmsUnavailable(f"{self.kms.where}: a data key of {len(secret)} bytes")
        return secret, edek

    def unwrap(self, edek: bytes) -> bytes:
        try:
            ciphertext = edek.decode("ascii")
        except UnicodeDecodeError:
            raise Undecryptable("not a Vault ciphertext") from None
        opened = self.kms.call(f"decrypt/{urllib.parse.quote(self.key)}",
                               {"ciphertext": ciphertext})
        try:
            secret = base64.b64decode(opened["plaintext"], validate=True)
        except (KeyError, TypeError, ValueError, binascii.Error):
            raise KmsUnavailable(f"{self.kms.where}: a decrypt answer without its "
                                 "plaintext") from None
        if len(secret) != 32:  # another use of the key's: not a data key of ours
            raise Undecryptable(f"it opens to {len(secret)} bytes, not a data key")
        return secret


class KmsClients:
    """The KMS clients of the rules' encryptions, one per KMS (kept across reloads:
    a reload does not make new connections), and each encryption's KEKs."""

    def __init__(self) -> None:
        self._clients: dict[KmsSpec, AwsKms | VaultKms] = {}
        self._lock = threading.Lock()

    def client(self, spec: KmsSpec) -> AwsKms | VaultKms:
        where = dataclasses.replace(spec, key="")  # one client for all its keys
        with self._lock:
            found = self._clients.get(where)
            if found is None:
                found = self._clients[where] = (AwsKms(spec) if spec.type == "aws"
                                                else VaultKms(spec))
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


__all__ = ["AwsKek", "AwsKms", "KmsClients", "VaultKek", "VaultKms", "probe_kms"]
