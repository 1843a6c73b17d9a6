"""Sealed cursors: where a listing of every topic under a topic filter goes on (pure).

DescribeTopicPartitions of every topic (KIP-966) pages through the cluster in name
order; each answer's cursor names the topic the next page starts at.  Under
``allow_topics`` / ``deny_topics`` that topic may be one the client must not see, and a
cursor of the client's own choosing would tell, page by page, whether hidden topics lie
between two names.  So under a filter the proxy gives its clients sealed cursors only
(the broker's topic name encrypted and authenticated with a key of the proxy process's)
and takes back only those: the listing goes on past hidden topics, nothing of them is
shown, and a cursor the proxy did not give is refused.

The seal is deterministic authenticated encryption (SIV-style): an HMAC-SHA256 tag of
the name, padded to a fixed length so a token's length says nothing of the name, and
the padded name XORed with SHAKE-256 keyed by the tag.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets

# '~' sorts after every character a topic name may hold, so a sealed cursor handed to a
# broker by mistake names no topic and starts no page.
SEALED_MARK = "~gatehouse:"
_PADDED = 256  # topic names are at most 249 characters
_TAG = 16
KEY_BYTES = 32

_key = secrets.token_bytes(KEY_BYTES)


def use_key(key: bytes) -> None:
    """Seal with ``key`` from now on (the workers of one ``gatehouse run`` share one, so
    a client that reconnects to another worker goes on with its listing)."""
    global _key
    if len(key) != KEY_BYTES:
        raise ValueError(f"a cursor key is {KEY_BYTES} bytes, not {len(key)}")
    _key = key


def current_key() -> bytes:
    return _key


def _keystream(tag: bytes, size: int) -> bytes:
    return hashlib.shake_256(b"stream" + _key + tag).digest(size)


def _tag(padded: bytes) -> bytes:
    return hmac.new(_key, b"tag" + padded, hashlib.sha256).digest()[:_TAG]


def _xor(data: bytes, stream: bytes) -> bytes:
    return (int.from_bytes(data) ^ int.from_bytes(stream)).to_bytes(len(data))


def seal(name: str) -> str:
    """``name`` (a broker-side topic name) as a cursor only this key opens."""
    raw = name.encode()
    padded = raw + b"\0" * max(_PADDED - len(raw), 0)
    tag = _tag(padded)
    sealed = tag + _xor(padded, _keystream(tag, len(padded)))
    return SEALED_MARK + base64.urlsafe_b64encode(sealed).decode().rstrip("=")


def unseal(token: str) -> str | None:
    """The name ``seal`` sealed in ``token``; None for anything else (a name, a token
    tampered with, one of another key's: an earlier proxy process's)."""
    if not token.startswith(SEALED_MARK):
        return None
    text = token[len(SEALED_MARK):]
    try:
        sealed = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        return None
    if len(sealed) <= _TAG:
        return None
    tag, body = sealed[:_TAG], sealed[_TAG:]
    padded = _xor(body, _keystream(tag, len(body)))
    if not hmac.compare_digest(tag, _tag(padded)):
        return None
    try:
        return padded.rstrip(b"\0").decode()
    except UnicodeDecodeError:
        return None
