"""The codec's errors.  It raises nothing else (struct and index errors are wrapped).

Like h11: ``ProtocolError`` is the base; ``RemoteProtocolError`` means the bytes we were
given are bad (the peer's fault: close that connection), ``LocalProtocolError`` means
we were asked to encode something that is not a valid message (our caller's fault).
"""

from __future__ import annotations


class ProtocolError(Exception):
    """Base of every error the codec raises."""

    def __init__(
        self,
        reason: str,
        *,
        api_key: int | None = None,
        api_version: int | None = None,
        api_name: str | None = None,
        path: tuple[str, ...] = (),
        offset: int | None = None,
    ) -> None:
        self.reason = reason
        self.api_key = api_key
        self.api_version = api_version
        self.api_name = api_name
        self.path = path
        self.offset = offset
        super().__init__(reason)

    def within(self, field: str) -> ProtocolError:
        """The same error, one struct further out (the path grows from the inside)."""
        self.path = (field, *self.path)
        return self

    def at_api(self, api_key: int | None, api_version: int | None, api_name: str | None) -> ProtocolError:
        if self.api_key is None:
            self.api_key, self.api_version, self.api_name = api_key, api_version, api_name
        return self

    def __str__(self) -> str:
        where = []
        if self.api_name is not None or self.api_key is not None:
            name = self.api_name or f"api_key={self.api_key}"
            where.append(f"{name} v{self.api_version}" if self.api_version is not None else name)
        if self.path:
            where.append("field " + ".".join(self.path))
        if self.offset is not None:
            where.append(f"byte {self.offset}")
        return f"{self.reason} ({', '.join(where)})" if where else self.reason


class RemoteProtocolError(ProtocolError):
    """The bytes received are not a valid Kafka message (malformed, truncated, too big)."""


class LocalProtocolError(ProtocolError):
    """A message given to the encoder cannot be written in the requested version."""


class FrameTooLarge(RemoteProtocolError):
    """A size prefix above the configured maximum frame size (or negative)."""


class UnknownApi(RemoteProtocolError):
    """An API key or version the codec's tables do not know.

    Not necessarily the peer's fault: newer brokers and clients speak newer versions.
    A proxy forwards such frames untouched; it only cannot look inside them.
    """
