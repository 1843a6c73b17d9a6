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
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

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


class _JsonHandler(http.server.BaseHTTPRequestHandler):
    """A request handler that answers JSON and logs nothing."""

    def answer(self, status: int, document: Any) -> None:
        body = json.dumps(document).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


class _Served:
    """An HTTP service of the test's at ``url`` on a real socket, served from a thread
    while ``running``."""

    def __init__(self, handler: type[_JsonHandler], path: str) -> None:
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}{path}"

    @contextmanager
    def running(self) -> Iterator[Self]:
        thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._server.shutdown()
            self._server.server_close()
            thread.join()


class JwksServer(_Served):
    """A JWKS served at ``url`` from a real socket; ``keys`` may be changed (rotation),
    ``requests`` counts the fetches, ``down`` answers 503."""

    def __init__(self, *keys: SigningKey) -> None:
        self.keys = list(keys)
        self.requests = 0
        self.down = False
        outer = self

        class Handler(_JsonHandler):
            def do_GET(self) -> None:
                outer.requests += 1
                if outer.down or self.path != "/jwks.json":
                    self.send_error(503 if outer.down else 404)
                    return
                self.answer(200, jwks(*outer.keys))

        super().__init__(Handler, "/jwks.json")


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


class TokenEndpoint(_Served):
    """An identity provider's token endpoint (the client credentials grant, RFC 6749
    section 4.4) on a real socket: ``client_id``/``client_secret`` get a token of
    ``subject`` signed with ``key``, lasting ``lifetime`` seconds; others get 401.
    ``issued`` counts the tokens given; ``claims`` are added to each."""

    def __init__(self, key: SigningKey, client_id: str, client_secret: str, *,
                 subject: str = "gatehouse", lifetime: float = 3600, **claims: Any) -> None:
        self.key, self.subject, self.lifetime, self.claims = key, subject, lifetime, claims
        self.issued: list[str] = []
        self.scopes: list[str | None] = []
        expected = "Basic " + base64.b64encode(f"{client_id}:{client_secret}".encode()).decode()
        outer = self

        class Handler(_JsonHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                form = dict(urllib.parse.parse_qsl(self.rfile.read(length).decode()))
                if self.headers.get("Authorization") != expected:
                    self.answer(401, {"error": "invalid_client",
                                      "error_description": "bad client credentials"})
                    return
                if form.get("grant_type") != "client_credentials":
                    self.answer(400, {"error": "unsupported_grant_type"})
                    return
                token = outer.key.token(outer.subject, lifetime=outer.lifetime, **outer.claims)
                outer.issued.append(token)
                outer.scopes.append(form.get("scope"))
                self.answer(200, {"access_token": token, "token_type": "Bearer",
                                  "expires_in": int(outer.lifetime)})

        super().__init__(Handler, "/oauth2/token")
