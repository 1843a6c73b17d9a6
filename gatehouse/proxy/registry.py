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
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from typing import Final

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
_SCHEMA_NOT_FOUND: Final = 40403  # the registry's error_code for an unknown id
_ACCEPT: Final = "application/vnd.schemaregistry.v1+json, application/json"

# One fetch: what it found (the schema, the registry's "no such id", or why it could
# not say).
Fetch = Callable[[RegistryCheck, int], Lookup]


def fetch_schema(check: RegistryCheck, schema_id: int) -> Lookup:
    """Schema ``schema_id`` from ``check``'s registry, with the subjects it is registered
    under when the check names one (blocking: run in a thread)."""
    data = _get(check, f"/schemas/ids/{schema_id}", schema_id)
    if not isinstance(data, bytes):
        return data
    found = parse_schema(check, schema_id, data)
    if check.subject is None or not isinstance(found, RegisteredSchema):
        return found
    listed = _get(check, f"/schemas/ids/{schema_id}/subjects", schema_id)
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


def _get(check: RegistryCheck, path: str, schema_id: int) -> bytes | Lookup:
    """The registry's answer at ``path`` under ``check.url``, or what it means when
    there is none (its "no such schema", or why it could not say)."""
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
                                    timeout=check.timeout) as answer:
            data: bytes = answer.read(MAX_SCHEMA_BYTES + 1)
    except urllib.error.HTTPError as exc:
        if exc.code == 404 and _error_code(exc) == _SCHEMA_NOT_FOUND:
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


def parse_schema(check: RegistryCheck, schema_id: int, data: bytes) -> Lookup:
    """The registry's answer for ``schema_id`` (``{"schema": ..., "schemaType": ...}``;
    no type: Avro), a JSON Schema compiled, an Avro or Protobuf schema parsed."""
    try:
        body = json.loads(data)
    except ValueError:
        body = None
    text = body.get("schema") if isinstance(body, dict) else None
    if not isinstance(text, str):
        return RegistryUnavailable(f"{check.shown} answered schema {schema_id} with no "
                                   "schema in it")
    assert isinstance(body, dict)
    schema_type = str(body.get("schemaType") or "AVRO").upper()
    try:
        if schema_type == "JSON":
            return RegisteredSchema(schema_id, schema_type, json=compile_json_schema(
                json.loads(text), f"schema {schema_id} of {check.shown}",
                label=f"schema {schema_id}"))
        if schema_type == "AVRO":
            import fastavro

            return RegisteredSchema(schema_id, schema_type,
                                    avro=fastavro.parse_schema(json.loads(text)))
        if schema_type == "PROTOBUF":
            return RegisteredSchema(schema_id, schema_type,
                                    protobuf=parse_proto_schema(text))
    except Exception as exc:  # any schema this proxy cannot read
        # References to other schemas, a draft it does not know: the id is still checked.
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
