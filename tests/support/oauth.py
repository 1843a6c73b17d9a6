"""An identity provider for the OAUTHBEARER tests: signing keys made in the test, their
JWKS, tokens signed with them, and a JWKS served over HTTP on a real socket."""

from __future__ import annotations

import base64
import hashlib
import hmac
import http.server
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from jwt.algorithms import ECAlgorithm, OKPAlgorithm, RSAAlgorithm

ISSUER = "https://idp.example.test"
AUDIENCE = "kafka"


@dataclass
class SigningKey:
    kid: str
    algorithm: str
    private: Any = field(repr=False)

    def jwk(self) -> dict[str, Any]:
        public = self.private.public_key()
        if self.algorithm.startswith(("RS", "PS")):
            entry = RSAAlgorithm.to_jwk(public, as_dict=True)
        elif self.algorithm == "EdDSA":
            entry = OKPAlgorithm.to_jwk(public, as_dict=True)
        else:
            entry = ECAlgorithm.to_jwk(public, as_dict=True)
        entry.pop("key_ops", None)
        return {**entry, "kid": self.kid, "use": "sig", "alg": self.algorithm}

    def token(self, subject: str | None = "alice", *, lifetime: float = 3600,
              issued: float | None = None, kid: str | bool | None = True,
              **claims: Any) -> str:
        """A token for ``subject`` signed with this key (``kid``: True its own id, a
        string another, None no id in the header)."""
        now = time.time() if issued is None else issued
        payload: dict[str, Any] = {"iss": ISSUER, "aud": AUDIENCE, "iat": int(now),
                                   "exp": int(now + lifetime), "scope": "kafka"}
        if subject is not None:
            payload["sub"] = subject
        payload.update(claims)
        payload = {k: v for k, v in payload.items() if v is not None}
        headers = {} if kid is None else {"kid": self.kid if kid is True else kid}
        return jwt.encode(payload, self.private, algorithm=self.algorithm, headers=headers)


def rsa_key(kid: str = "rsa-1", algorithm: str = "RS256") -> SigningKey:
    return SigningKey(kid, algorithm, rsa.generate_private_key(public_exponent=65537,
                                                               key_size=2048))


def ec_key(kid: str = "ec-1") -> SigningKey:
    return SigningKey(kid, "ES256", ec.generate_private_key(ec.SECP256R1()))


def ed_key(kid: str = "ed-1") -> SigningKey:
    return SigningKey(kid, "EdDSA", ed25519.Ed25519PrivateKey.generate())


def jwks(*keys: SigningKey) -> dict[str, Any]:
    return {"keys": [key.jwk() for key in keys]}


def write_jwks(path: Path, *keys: SigningKey) -> Path:
    path.write_text(json.dumps(jwks(*keys), indent=1))
    return path


class JwksServer:
    """A JWKS served at ``url`` from a real socket; ``keys`` may be changed (rotation),
    ``requests`` counts the fetches, ``down`` answers 503."""

    def __init__(self, *keys: SigningKey) -> None:
        self.keys = list(keys)
        self.requests = 0
        self.down = False
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.requests += 1
                if outer.down or self.path != "/jwks.json":
                    self.send_error(503 if outer.down else 404)
                    return
                body = json.dumps(jwks(*outer.keys)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/jwks.json"

    @contextmanager
    def running(self) -> Iterator[JwksServer]:
        thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._server.shutdown()
            self._server.server_close()
            thread.join()


def bearer_message(token: str, authzid: str | None = None, **extensions: str) -> bytes:
    """An OAUTHBEARER client's first message, as Kafka's clients write it."""
    header = "n,," if authzid is None else f"n,a={authzid},"
    pairs = "".join(f"\x01{k}={v}" for k, v in extensions.items())
    return f"{header}\x01auth=Bearer {token}{pairs}\x01\x01".encode()


def hmac_over_the_public_key(key: SigningKey, subject: str = "mallory") -> str:
    """The algorithm confusion attack: a token "signed" with HS256 keyed by the RSA
    public key's PEM (which anyone has), with ``key``'s id, claims otherwise good."""
    pem = key.private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)

    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    now = int(time.time())
    claims = {"sub": subject, "iat": now, "exp": now + 60, "iss": ISSUER, "aud": AUDIENCE}
    head = b64(json.dumps({"alg": "HS256", "kid": key.kid}).encode())
    body = f"{head}.{b64(json.dumps(claims).encode())}"
    return f"{body}.{b64(hmac.new(pem, body.encode(), hashlib.sha256).digest())}"
