"""Schemas by id from Schema Registries, for ``validate_records``' ``registry`` checks.

A Produce request whose records name schema ids (the Schema Registry's framing: a zero
byte, then the id) is judged only once each id is known here: the proxy asks the
registry (``GET {url}/schemas/ids/{id}``, Confluent's REST API, also served by Apicurio's
``/apis/ccompat/v7``, Karapace and Redpanda) before it judges, while that connection's
later requests wait behind it, in order.  A schema never changes under its id, so a
found one is kept (at most ``max_schemas``, the oldest first out); an id the registry
does not know is remembered for ``miss_seconds`` (producers register before they
write, so an unknown id is a mistake, not a race worth asking again at once); a
registry that fails is not asked about that id again for ``error_seconds``, so an
outage costs each request one quick REQUEST_TIMED_OUT (retriable), not a timeout.

``lookup`` reads only what is kept (no I/O, no change: safe from ``offload``'s thread).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import math
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from typing import Any, Final

import trio

from gatehouse.logs import log_event
from gatehouse.rules.protobuf import parse_proto_schema
from gatehouse.rules.records import (
    NOT_REGISTERED,
    Lookup,
    RegisteredSchema,
    RegistryCheck,
    RegistryUnavailable,
    compile_json_schema,
)

logger = logging.getLogger("gatehouse.proxy")

MAX_SCHEMA_BYTES: Final = 8 * 1024 * 1024
MAX_REFERENCES: Final = 100  # schemas one schema refers to, all levels; more: its id only
_SCHEMA_NOT_FOUND: Final = frozenset({40403})  # the registry's error_code for an unknown id
_REFERENCE_NOT_FOUND: Final = frozenset({40401, 40402})  # no such subject, version
_ACCEPT: Final = "application/vnd.schemaregistry.v1+json, application/json"

# One fetch: what it found (the schema, the registry's "no such id", or why it could
# not say).
Fetch = Callable[[RegistryCheck, int], Lookup]


# A schema another refers to: (the name it is referred to by, its type, its text).
Referenced = tuple[str, str, str]


def fetch_schema(check: RegistryCheck, schema_id: int) -> Lookup:
    """Schema ``schema_id`` from ``check``'s registry, with the schemas it refers to and
    the subjects it is registered under when the check names one (blocking: run in a
    thread; all of it within ``check.timeout``)."""
    deadline = time.monotonic() + check.timeout
    data = _get(check, f"/schemas/ids/{schema_id}", schema_id)
    if not isinstance(data, bytes):
        return data
    body = _schema_body(data)
    if body is None:
        return _no_schema(check, f"schema {schema_id}")
    referenced = _referenced(check, schema_id, body, deadline, [], set())
    if isinstance(referenced, RegistryUnavailable):
        return referenced
    found = _registered(check, schema_id, body, referenced)
    if check.subject is None or not isinstance(found, RegisteredSchema):
        return found
    listed = _get(check, f"/schemas/ids/{schema_id}/subjects", schema_id,
                  timeout=deadline - time.monotonic())
    if not isinstance(listed, bytes):
        return listed
    try:
        subjects = json.loads(listed)
    except ValueError:
        subjects = None
    if not isinstance(subjects, list) or not all(isinstance(s, str) for s in subjects):
        return RegistryUnavailable(f"{check.shown} answered the subjects of schema "
                                   f"{schema_id} with no list of subjects")
    return dataclasses.replace(found, subjects=frozenset(subjects))


def _schema_body(data: bytes) -> dict[str, Any] | None:
    """The registry's answer as an object with a ``schema`` string (None: it is not)."""
    try:
        body = json.loads(data)
    except ValueError:
        return None
    if not isinstance(body, dict) or not isinstance(body.get("schema"), str):
        return None
    return body


def _no_schema(check: RegistryCheck, what: str) -> RegistryUnavailable:
    return RegistryUnavailable(f"{check.shown} answered {what} with no schema in it")


def _referenced(check: RegistryCheck, schema_id: int, body: dict[str, Any],
                deadline: float, found: list[Referenced], seen: set[tuple[str, str]]
                ) -> list[Referenced] | RegistryUnavailable:
    """The schemas ``body``'s references name (``{name, subject, version}``: GET
    ``{url}/subjects/{subject}/versions/{version}``), and theirs, into ``found``, each
    after those it refers to.  One the registry does not have, or past
    ``MAX_REFERENCES``, is left out: the schema then does not compile here (its id is
    still checked, and that is logged)."""
    references = body.get("references")
    for reference in references if isinstance(references, list) else ():
        if not isinstance(reference, dict):
            continue
        name, subject, version = (reference.get("name"), reference.get("subject"),
                                  reference.get("version"))
        if not (isinstance(name, str) and isinstance(subject, str)
                and isinstance(version, (int, str))):
            continue
        key = (subject, str(version))
        if key in seen or len(seen) >= MAX_REFERENCES:
            continue
        seen.add(key)
        path = (f"/subjects/{urllib.parse.quote(subject, safe='')}/versions/"
                f"{urllib.parse.quote(str(version), safe='')}")
        data = _get(check, path, schema_id, timeout=deadline - time.monotonic(),
                    not_found=_REFERENCE_NOT_FOUND)
        if data is NOT_REGISTERED:
            continue
        if not isinstance(data, bytes):
            assert isinstance(data, RegistryUnavailable)
            return data
        referred = _schema_body(data)
        if referred is None:
            return _no_schema(check, f"{subject} version {version}")
        deeper = _referenced(check, schema_id, referred, deadline, found, seen)
        if isinstance(deeper, RegistryUnavailable):
            return deeper
        found.append((name, _schema_type(referred), referred["schema"]))
    return found


def _get(check: RegistryCheck, path: str, schema_id: int, timeout: float | None = None,
         not_found: frozenset[int] = _SCHEMA_NOT_FOUND) -> bytes | Lookup:
    """The registry's answer at ``path`` under ``check.url``, or what it means when
    there is none (its "no such schema", an error code of ``not_found``, or why it
    could not say); ``timeout``: what is left of the lookup's (else ``check.timeout``)."""
    timeout = check.timeout if timeout is None else timeout
    if timeout <= 0:
        return RegistryUnavailable(f"{check.shown} did not answer for schema {schema_id} "
                                   f"in {check.timeout:g} s")
    parts = urllib.parse.urlsplit(check.url)
    headers = {"Accept": _ACCEPT}
    if parts.username is not None:
        # Credentials in the URL (Confluent Cloud's API key and secret): sent as basic
        # authentication, never in the URL the request names.
        secret = f"{urllib.parse.unquote(parts.username)}:" \
                 f"{urllib.parse.unquote(parts.password or '')}"
        headers["Authorization"] = "Basic " + base64.b64encode(secret.encode()).decode()
        parts = parts._replace(netloc=parts.netloc.rpartition("@")[2])
    url = f"{urllib.parse.urlunsplit(parts)}{path}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                    timeout=timeout) as answer:
            data: bytes = answer.read(MAX_SCHEMA_BYTES + 1)
    except urllib.error.HTTPError as exc:
        if exc.code == 404 and _error_code(exc) in not_found:
            return NOT_REGISTERED
        return RegistryUnavailable(f"{check.shown} answered HTTP {exc.code} {exc.reason} "
                                   f"for schema {schema_id}")
    except (OSError, ValueError) as exc:  # URLError, timeouts, refused connections
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, TimeoutError):
            return RegistryUnavailable(f"{check.shown} did not answer for schema "
                                       f"{schema_id} in {check.timeout:g} s")
        return RegistryUnavailable(f"{check.shown} could not be reached: {reason}")
    if len(data) > MAX_SCHEMA_BYTES:
        return RegistryUnavailable(f"{check.shown}: schema {schema_id} is larger than "
                                   f"{MAX_SCHEMA_BYTES} bytes")
    return data


def _error_code(exc: urllib.error.HTTPError) -> int | None:
    try:
        body = json.loads(exc.read(65536))
    except (OSError, ValueError):
        return None
    code = body.get("error_code") if isinstance(body, dict) else None
    return code if isinstance(code, int) else None


def parse_schema(check: RegistryCheck, schema_id: int, data: bytes,
                 referenced: Iterable[Referenced] = ()) -> Lookup:
    """The registry's answer for ``schema_id`` (``{"schema": ..., "schemaType": ...}``;
    no type: Avro), a JSON Schema compiled, an Avro or Protobuf schema parsed, with the
    schemas it refers to (``referenced``, each after those it refers to)."""
    body = _schema_body(data)
    if body is None:
        return _no_schema(check, f"schema {schema_id}")
    return _registered(check, schema_id, body, referenced)


def _schema_type(body: dict[str, Any]) -> str:
    return str(body.get("schemaType") or "AVRO").upper()  # none: Avro


def _registered(check: RegistryCheck, schema_id: int, body: dict[str, Any],
                referenced: Iterable[Referenced]) -> Lookup:
    """``parse_schema`` of the answer already parsed."""
    text = body["schema"]
    schema_type = _schema_type(body)
    others = [(name, source) for name, kind, source in referenced if kind == schema_type]
    try:
        if schema_type == "JSON":
            return RegisteredSchema(schema_id, schema_type, json=compile_json_schema(
                json.loads(text), f"schema {schema_id} of {check.shown}",
                label=f"schema {schema_id}",
                references={name: json.loads(source) for name, source in others}))
        if schema_type == "AVRO":
            import fastavro

            named: dict[str, Any] = {}  # the named types of the schemas it refers to
            for _, source in others:
                fastavro.parse_schema(json.loads(source), named_schemas=named)
            return RegisteredSchema(schema_id, schema_type, avro=fastavro.parse_schema(
                json.loads(text), named_schemas=named))
        if schema_type == "PROTOBUF":
            return RegisteredSchema(schema_id, schema_type,
                                    protobuf=parse_proto_schema(text, dict(others)))
    except Exception as exc:  # any schema this proxy cannot read
        # A reference the registry does not have, a draft it does not know: the id is
        # still checked.
        log_event(logger, logging.WARNING, f"a registered {schema_type} schema does not "
                  "compile here: records naming it are checked for its id only",
                  registry=check.shown, schema_id=schema_id,
                  error=(str(exc).splitlines() or [type(exc).__name__])[0])
    return RegisteredSchema(schema_id, schema_type)


class SchemaRegistries:
    """The schemas the proxy has fetched, by (registry URL, id); see the module."""

    def __init__(self, fetch: Fetch = fetch_schema, *, max_schemas: int = 10_000,
                 miss_seconds: float = 10.0, error_seconds: float = 2.0,
                 concurrency: int = 4) -> None:
        self._fetch = fetch
        self._max = max_schemas
        self._miss_seconds = miss_seconds
        self._error_seconds = error_seconds
        # By (registry URL, id, whether its subjects were fetched).
        self._found: dict[tuple[str, int, bool], RegisteredSchema] = {}
        # An unknown id or a failure, until when (trio's clock).
        self._refused: dict[tuple[str, int, bool], tuple[float, Lookup]] = {}
        self._fetching: dict[tuple[str, int, bool], trio.Event] = {}
        self._limiter = trio.CapacityLimiter(concurrency)
        # Who hears of each fetch: (registry as shown, outcome: found, not_found, error).
        self.listeners: list[Callable[[str, str], None]] = []

    def lookup(self, check: RegistryCheck, schema_id: int) -> Lookup:
        """What is known of ``schema_id``, however old a refusal (no I/O)."""
        found = self.known(check, schema_id, -math.inf)
        if found is None:
            return RegistryUnavailable(f"schema {schema_id} of {check.shown} was not fetched")
        return found

    def known(self, check: RegistryCheck, schema_id: int, now: float) -> Lookup | None:
        """What is known of ``schema_id`` at ``now`` (trio's clock); None: it is to be
        fetched (never asked, or its refusal is over).  No I/O: safe from a thread."""
        key = _key(check, schema_id)
        found = self._found.get(key)
        if found is not None:
            return found
        refused = self._refused.get(key)
        return None if refused is None or refused[0] <= now else refused[1]

    async def fetch(self, wanted: Iterable[tuple[RegistryCheck, int]]) -> None:
        """Every schema of ``wanted`` not known yet fetched (at most ``concurrency`` at
        once over all connections; one fetch per id however many ask)."""
        now = trio.current_time()
        todo = [(check, schema_id) for check, schema_id in wanted
                if self.known(check, schema_id, now) is None]
        if not todo:
            return
        async with trio.open_nursery() as nursery:
            for check, schema_id in todo:
                nursery.start_soon(self._fetch_one, check, schema_id)

    async def _fetch_one(self, check: RegistryCheck, schema_id: int) -> None:
        key = _key(check, schema_id)
        running = self._fetching.get(key)
        if running is not None:
            await running.wait()
            return
        done = self._fetching[key] = trio.Event()
        try:
            async with self._limiter:
                with trio.move_on_after(check.timeout + 1) as scope:
                    found = await trio.to_thread.run_sync(self._fetch, check, schema_id,
                                                          abandon_on_cancel=True)
            if scope.cancelled_caught:
                found = RegistryUnavailable(f"{check.shown} did not answer for schema "
                                            f"{schema_id} in {check.timeout:g} s")
            self._keep(check, schema_id, found)
        finally:
            del self._fetching[key]
            done.set()

    def _keep(self, check: RegistryCheck, schema_id: int, found: Lookup) -> None:
        key = _key(check, schema_id)
        if isinstance(found, RegisteredSchema):
            if len(self._found) >= self._max:
                del self._found[next(iter(self._found))]
            self._found[key] = found
            self._refused.pop(key, None)
            outcome = "found"
        else:
            if len(self._refused) >= self._max:
                del self._refused[next(iter(self._refused))]
            seconds = self._miss_seconds if found is NOT_REGISTERED else self._error_seconds
            self._refused[key] = (trio.current_time() + seconds, found)
            outcome = "not_found" if found is NOT_REGISTERED else "error"
            if isinstance(found, RegistryUnavailable):
                log_event(logger, logging.WARNING, "Schema Registry lookup failed: records "
                          "naming the schema are answered REQUEST_TIMED_OUT (retriable) for "
                          f"{self._error_seconds:g} s", registry=check.shown,
                          schema_id=schema_id, error=found.reason)
        for listener in self.listeners:
            listener(check.shown, outcome)


def _key(check: RegistryCheck, schema_id: int) -> tuple[str, int, bool]:
    return check.url, schema_id, check.subject is not None


__all__ = ["MAX_SCHEMA_BYTES", "SchemaRegistries", "fetch_schema", "parse_schema"]
