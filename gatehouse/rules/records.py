"""``validate_records``: what the records a client produces must hold (pure).

The brokers take any bytes as a key or a value; a platform team wants the ``orders``
topic to hold JSON, every record of ``payments`` to carry a key and a ``trace-id``
header, values framed for the Schema Registry.  A rule says so per topic, and the proxy
reads each Produce request's records (decompressing its batches: the caller's
``decompress``) and holds each record to it.

A partition whose batch holds a record that breaks the rule is answered as a broker
answers a record it will not take (KIP-467): INVALID_RECORD, with ``record_errors``
naming each bad record by its index in the batch and saying what is wrong (never what
the record holds: payloads stay out of errors and logs), and none of its records is
written.  The request's other partitions go on to the broker; their answers and the
refusals are merged into one response.  A batch that does not parse or decompress is
answered CORRUPT_MESSAGE, as the broker would.

Topics are matched by the names the client uses; a request naming a topic by its id
(Produce v13) is matched through the names the proxy learned from the answers that pair
ids with names (``rules.topicids.TopicIds``); an id not learned yet is answered
UNKNOWN_TOPIC_ID on its partitions, which makes the client refresh its metadata (through
the proxy, which learns the id) and try again.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

from gatehouse.codecs import Request, Response
from gatehouse.codecs.errors import ProtocolError, RemoteProtocolError
from gatehouse.codecs.primitives import Buffer
from gatehouse.codecs.records import (
    Record,
    RecordBatch,
    iter_batches,
    iter_records,
    legacy_key_value,
    records_section,
)
from gatehouse.rules.errors import (
    CORRUPT_MESSAGE,
    INVALID_RECORD,
    REQUEST_TIMED_OUT,
    array_entry,
    error_response,
    has_field,
)
from gatehouse.rules.produce import in_scope, topic_key
from gatehouse.rules.protobuf import ProtoFile, ProtoSchema

FORMATS: Final = ("json", "utf8", "schema_registry")
MAX_RECORD_ERRORS: Final = 100  # listed per partition; the count says how many more
DEFAULT_MAX_DECOMPRESSED: Final = 64 * 1024 * 1024

Format = Literal["json", "utf8", "schema_registry", "protobuf"]
Decompress = Callable[[str, Buffer, int], bytes]


@functools.cache
def _orjson() -> Any:
    """orjson (strict RFC 8259: no NaN, no numbers past a double's range, UTF-8 checked;
    twice as fast as Python's json: bench/records.py), imported for the rules that parse
    records."""
    import orjson

    return orjson


@dataclass(frozen=True, eq=False)
class JsonSchema:
    """A JSON Schema a key or value must match, read from ``path`` (or from a Schema
    Registry: ``label`` says which schema): ``schema`` as written, ``validator``
    compiled for the schema's own draft (2020-12 when it names none) by
    ``jsonschema_rs``."""

    path: Path | None
    schema: Mapping[str, Any]
    validator: Any
    label: str = ""
    # The documents its $refs name outside it (a registry's references), by name.
    documents: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.label or (self.path.name if self.path is not None else "the schema")

    def problem(self, document: Any, what: str) -> str | None:
        try:
            if self.validator.is_valid(document):
                return None
            error = next(iter(self.validator.iter_errors(document)))
        except (RecursionError, ValueError, OverflowError):
            return f"its {what} is nested too deeply to check against {self.name}"
        # Where in the document and which keyword of the schema, with the keyword's
        # value (the schema's, found by the error's schema path; a $ref is reported at
        # the place it points to): never the record's own values, which the library's
        # messages quote.
        keyword = error.schema_path[-1] if error.schema_path else "schema"
        if self.documents:  # its path may lie in another document: followed from here
            found = _evaluated(self.schema, error.evaluation_path, self.documents)
        else:
            found = _schema_at(self.schema, error.schema_path)
        expected = json.dumps(found, separators=(",", ":"))
        if len(expected) > 80:
            expected = expected[:77] + "..."
        return (f"its {what} does not match {self.name}: at "
                f"{json_path(error.instance_path)}, {keyword} {expected}")


def _schema_at(schema: Any, schema_path: Iterable[str | int]) -> Any:
    for step in schema_path:
        try:
            schema = schema[step]
        except (KeyError, IndexError, TypeError):
            return None
    return schema


def _evaluated(schema: Any, path: Iterable[str | int], documents: Mapping[str, Any]) -> Any:
    """The keyword an error's evaluation path ends at, following each ``$ref`` into the
    document it names (``documents``, else this one) and the JSON pointer after ``#``."""
    root = node = schema
    for step in path:
        target = node.get(step) if isinstance(node, dict) and step in ("$ref",
                                                                         "$dynamicRef") else None
        if isinstance(target, str):
            name, _, pointer = target.partition("#")
            if name:
                root = documents.get(name)
            node = root
            for part in pointer.split("/")[1:] if pointer else ():
                node = _schema_at(node, [urllib.parse.unquote(part).replace("~1", "/")
                                         .replace("~0", "~")])
            continue
        node = _schema_at(node, [step])
    return node


_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def json_path(path: Iterable[str | int]) -> str:
    """``$.items[3].sku``: a place in a JSON document, as JSONPath writes it."""
    parts = ["$"]
    for step in path:
        if isinstance(step, int):
            parts.append(f"[{step}]")
        elif _NAME.fullmatch(step):
            parts.append(f".{step}")
        else:
            parts.append(f"[{json.dumps(step)}]")
    return "".join(parts)


_DRAFTS: Final = frozenset(f"http://json-schema.org/{name}/schema" for name in (
    "draft-04", "draft-06", "draft-07", "draft/2019-09", "draft/2020-12"))


def load_json_schema(path: Path) -> JsonSchema:
    """The schema in ``path`` (JSON, or YAML for .yaml/.yml), checked against its draft's
    meta-schema; ``ValueError`` saying what is wrong."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            schema = yaml.safe_load(text)
        else:
            schema = json.loads(text)
    except ValueError as exc:  # json's and yaml's errors say where
        raise ValueError(f"{path} is not JSON: {exc}") from None
    except Exception as exc:
        raise ValueError(f"{path} is not YAML: {exc}") from None
    return compile_json_schema(schema, str(path), path=path)


def compile_json_schema(schema: Any, source: str, path: Path | None = None,
                        label: str = "", references: Mapping[str, Any] | None = None
                        ) -> JsonSchema:
    """``schema`` (a parsed document, from ``source``: a file or a registry) checked
    against its draft's meta-schema and compiled; ``ValueError`` saying what is wrong.
    ``references``: the documents its ``$ref``s name (a registry's references: each by
    the name it is referred to by), held here, never fetched."""
    # Imported here: 8 MiB of every proxy's memory, for the rules that use a schema.
    import jsonschema_rs

    if not isinstance(schema, dict):
        raise ValueError(f"{source} holds no JSON Schema (an object)")
    draft = schema.get("$schema")
    if draft is not None and (not isinstance(draft, str)
                              or draft.rstrip("#").replace("https:", "http:") not in _DRAFTS):
        # The library would fetch a meta-schema it does not hold: no requests at load.
        raise ValueError(f"{source} is not a valid JSON Schema: its $schema {draft!r} is not "
                         "a draft this proxy knows (4, 6, 7, 2019-09, 2020-12)")
    try:
        jsonschema_rs.meta.validate(schema)
        # Offline: a $ref to another document is an error at load, never a request the
        # proxy makes.
        validator = jsonschema_rs.validator_for(
            schema, offline=True, registry=_referred(jsonschema_rs, schema, references))
    except jsonschema_rs.ValidationError as exc:
        where = f" (at {json_path(exc.instance_path)})" if exc.instance_path else ""
        message = exc.message.splitlines()[0] if exc.message else str(exc)
        raise ValueError(f"{source} is not a valid JSON Schema: {message}{where}") from None
    except (jsonschema_rs.ReferencingError, ValueError, TypeError) as exc:
        message = str(exc).splitlines()[0]
        raise ValueError(f"{source} is not a valid JSON Schema: {message}") from None
    return JsonSchema(path, schema, validator, label, _documents(schema, references))


def _documents(schema: Any, references: Mapping[str, Any] | None) -> dict[str, Any]:
    """``references`` each under its name and, where ``schema`` has an ``$id``, under
    the name resolved against it (as a ``$ref`` in it may name it)."""
    documents = dict(references or {})
    base = schema.get("$id") if isinstance(schema, dict) else None
    if isinstance(base, str):
        for name, document in references.items() if references else ():
            documents.setdefault(urllib.parse.urljoin(base, name), document)
    return documents


def _referred(jsonschema_rs: Any, schema: dict[str, Any],
              references: Mapping[str, Any] | None) -> Any:
    """A registry of ``references`` for ``schema``'s ``$ref``s (``_documents``)."""
    if not references:
        return None
    return jsonschema_rs.Registry(list(_documents(schema, references).items()))


@dataclass(frozen=True)
class RegistryCheck:
    """``registry``: the schema ids of a ``schema_registry`` key or value looked up in a
    Schema Registry (Confluent's REST API, which Apicurio, Karapace and Redpanda also
    serve): an id the registry does not know is refused, and with ``validate`` a key or
    value must read by its registered JSON Schema, Avro or Protobuf schema (with the
    schemas it refers to).  The proxy fetches each id once (``lookup`` in
    ``FieldCheck.problem``), before it judges the request."""

    url: str  # the API's base: .../schemas/ids/{id} lies under it
    validate: bool = True
    timeout: float = 5.0  # seconds for one lookup; then the partition is answered
    # REQUEST_TIMED_OUT (retriable), never let through unchecked
    # The subject the schema must be registered under, "{topic}" standing for the topic
    # as the client names it ("{topic}-value": the serializers' TopicNameStrategy); the
    # proxy then also fetches the subjects of each id (.../schemas/ids/{id}/subjects).
    subject: str | None = None

    @property
    def shown(self) -> str:
        """``url`` as logs and errors may show it."""
        return shown_url(self.url)


def shown_url(url: str) -> str:
    """``url`` with any password in it hidden."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{parts.username}:***@{host}"))


@dataclass(frozen=True, eq=False)
class RegisteredSchema:
    """A schema the registry knows: its type (AVRO, JSON or PROTOBUF) and, for a JSON
    Schema, the schema compiled, for an Avro schema, the schema parsed by ``fastavro``,
    for a Protobuf schema, its messages (``rules.protobuf``); None when it does not
    compile here: only the id is held."""

    schema_id: int
    schema_type: str
    json: JsonSchema | None = None
    avro: Any = None
    protobuf: ProtoSchema | None = None
    subjects: frozenset[str] | None = None  # fetched for a check with ``subject``

    def avro_problem(self, data: Buffer, what: str) -> str | None:
        """What is wrong with ``data`` (after the framing) as Avro binary of this
        schema: it must read as one datum and end there.  Never the record's values."""
        import io

        import fastavro

        stream = io.BytesIO(data)
        try:
            fastavro.schemaless_reader(stream, self.avro, None)
        except EOFError:
            return f"its {what} is not Avro of schema {self.schema_id} (it ends early)"
        except Exception:  # a union or enum index, a string, a length out of range
            return (f"its {what} is not Avro of schema {self.schema_id} (its bytes do not "
                    "read as the schema's types)")
        extra = len(data) - stream.tell()
        if extra:
            return (f"its {what} is not Avro of schema {self.schema_id} ({extra} "
                    f"byte{'s' if extra > 1 else ''} after the datum)")
        return None

    def protobuf_problem(self, data: bytes, what: str) -> str | None:
        """What is wrong with ``data`` (framed: the message indexes from byte 5 on) as
        Protobuf of this schema.  Never the record's values."""
        assert self.protobuf is not None
        problem = self.protobuf.problem(data, 5)
        if problem is None:
            return None
        return f"its {what} is not Protobuf of schema {self.schema_id} ({problem})"


class _NotRegistered:
    def __repr__(self) -> str:
        return "NOT_REGISTERED"


NOT_REGISTERED: Final = _NotRegistered()  # the registry answered: no such id


@dataclass(frozen=True)
class RegistryUnavailable:
    """The registry could not say (unreachable, an error, too slow): ``reason``."""

    reason: str


Lookup = RegisteredSchema | _NotRegistered | RegistryUnavailable
SchemaLookup = Callable[[RegistryCheck, int], Lookup]


class SchemaRegistryUnavailable(Exception):
    """A record's schema could not be looked up: its partition cannot be judged now."""


def schema_id_of(data: Buffer) -> int | None:
    """The schema id of a key or value in the Schema Registry's framing (a zero byte,
    then the id in 4 bytes, big-endian); None when ``data`` is not so framed."""
    if len(data) < 5 or data[0] != 0:
        return None
    return int.from_bytes(data[1:5], "big")


def _parse_json(data: Buffer, what: str) -> tuple[Any, str | None]:
    """``data`` parsed as JSON, or what is wrong with it (the parser's reason and place,
    never the text it read)."""
    try:
        return _orjson().loads(data), None
    except ValueError as exc:  # orjson.JSONDecodeError
        reason = getattr(exc, "msg", str(exc))
        if reason.startswith("str is not valid UTF-8"):
            return None, f"its {what} is not JSON (not UTF-8 text)"
        if reason.startswith("depth limit"):
            return None, f"its {what} is not JSON this proxy reads (nested too deeply)"
        return None, f"its {what} is not JSON ({reason} at character {getattr(exc, 'pos', 0)})"


@dataclass(frozen=True)
class FieldCheck:
    """What a record's key or its value must be."""

    required: bool = False  # not null
    format: Format | None = None  # of a value that is not null
    max_bytes: int | None = None
    schema: JsonSchema | None = None  # format json, matching this schema
    registry: RegistryCheck | None = None  # format schema_registry, ids looked up
    protobuf: ProtoFile | None = None  # format protobuf: a message of a local .proto

    def problem(self, data: bytes | None, what: str, lookup: SchemaLookup | None = None,
                topic: str | None = None,
                headers: Iterable[tuple[str, bytes | None]] = ()) -> str | None:
        """What is wrong with ``data`` (None: nothing).  ``lookup``: the schemas the
        proxy fetched, for ``registry``; ``SchemaRegistryUnavailable`` when it has none
        to say.  ``topic``: the record's, as the client names it (for ``subject``);
        ``headers``: the record's (a schema named in one is said in the refusal)."""
        if data is None:
            return f"its {what} is null" if self.required else None
        if self.max_bytes is not None and len(data) > self.max_bytes:
            return f"its {what} is {len(data)} bytes, above {self.max_bytes}"
        if self.format == "json":
            document, problem = _parse_json(data, what)
            if problem is None and self.schema is not None:
                return self.schema.problem(document, what)
            return problem
        if self.format == "protobuf" and self.protobuf is not None:
            return self.protobuf.problem(data, what)
        if self.format == "utf8":
            try:
                data.decode("utf-8")
            except UnicodeDecodeError as exc:
                return f"its {what} is not UTF-8 text (byte {exc.start})"
        elif self.format == "schema_registry":
            schema_id = schema_id_of(data)
            if schema_id is None:
                problem = (f"its {what} is not in the Schema Registry's framing (a zero "
                           "byte, then a 4-byte schema id)")
                header = f"__{what}_schema_id"
                if any(name == header for name, _ in headers):
                    # Newer serializers can put the schema's GUID in a header instead.
                    problem += (f"; its schema is named by a {header} header (a schema "
                                "GUID), which this proxy does not look up: configure the "
                                f"serializer to frame the id in the {what}")
                return problem
            if self.registry is not None:
                return self._registered(schema_id, data, what, lookup, topic)
        return None

    def _registered(self, schema_id: int, data: bytes, what: str,
                    lookup: SchemaLookup | None, topic: str | None) -> str | None:
        assert self.registry is not None
        found = (lookup(self.registry, schema_id) if lookup is not None
                 else RegistryUnavailable("no lookup"))
        if isinstance(found, RegistryUnavailable):
            raise SchemaRegistryUnavailable(found.reason)
        if found is NOT_REGISTERED:
            return f"its {what}'s schema id {schema_id} is not in the Schema Registry"
        if not isinstance(found, RegisteredSchema):
            return None
        wanted = self.registry.subject
        if wanted is not None and found.subjects is not None:
            if topic is None:
                # A topic named by an id the proxy has not learned yet: not judged now.
                raise SchemaRegistryUnavailable("the topic's name is not known yet")
            subject = wanted.replace("{topic}", topic)
            if subject not in found.subjects:
                return (f"its {what}'s schema {schema_id} is not registered under subject "
                        f"{subject!r}")
        if not self.registry.validate:
            return None
        if found.json is not None:
            document, problem = _parse_json(memoryview(data)[5:], what)
            if problem is None:
                return found.json.problem(document, what)
            return f"{problem}, but schema {schema_id} is a JSON Schema"
        if found.avro is not None:
            return found.avro_problem(memoryview(data)[5:], what)
        if found.protobuf is not None:
            return found.protobuf_problem(data, what)
        return None


@dataclass(frozen=True)
class RecordValidation:
    """``validate_records`` of one rule."""

    topics: tuple[re.Pattern[str], ...] | None = None  # whole client-side names; None: all
    key: FieldCheck = FieldCheck()
    value: FieldCheck = FieldCheck()
    headers: tuple[str, ...] = ()  # header keys every record must carry
    max_decompressed_bytes: int = DEFAULT_MAX_DECOMPRESSED

    def applies_to(self, topic: str) -> bool:
        return in_scope(self.topics, topic)

    @property
    def looks_up_schemas(self) -> bool:
        """Whether its key or value is checked against a Schema Registry."""
        return self.key.registry is not None or self.value.registry is not None

    def problem(self, record: Record, lookup: SchemaLookup | None = None,
                topic: str | None = None) -> str | None:
        """What is wrong with ``record`` (None: nothing); ``SchemaRegistryUnavailable``
        when a schema it names could not be looked up."""
        found = (self.key.problem(record.key, "key", lookup, topic, record.headers)
                 or self.value.problem(record.value, "value", lookup, topic, record.headers))
        if found is None and self.headers:
            present = {name for name, _ in record.headers}
            missing = [name for name in self.headers if name not in present]
            if missing:
                found = f"it has no {', '.join(repr(m) for m in missing)} header"
        return found


@dataclass(frozen=True)
class PartitionVerdict:
    """Why one partition's records are refused: its error code, message and the bad
    records ((index in the batch, what is wrong), at most ``MAX_RECORD_ERRORS``)."""

    code: int
    message: str
    record_errors: tuple[tuple[int, str], ...] = ()
    invalid: int = 0  # records found invalid (record_errors lists the first 100)


def read_records(records: Buffer | None, decompress: Decompress, limit: int
                 ) -> Iterator[Record]:
    """Every record of a Produce partition's records field, in order (control batches
    left out: clients never send them); ``RemoteProtocolError`` for bytes that are not
    whole batches.  A legacy message set's records are indexed in
    the order they come, a compressed wrapper's inner messages included."""
    if records is None:
        return
    index = covered = 0
    for batch in iter_batches(records):
        covered = batch.position + batch.size
        if isinstance(batch, RecordBatch):
            if batch.is_control:
                continue
            data: Buffer = records_section(records, batch)
            if batch.compression != "none":
                data = decompress(batch.compression, data, limit)
            yield from iter_records(data, batch.record_count)
            continue
        key, value = legacy_key_value(records, batch)
        if batch.compression == "none":
            yield Record(index, key, value, ())
            index += 1
            continue
        inner = decompress(batch.compression, value or b"", limit)
        for message in iter_batches(inner):
            if not isinstance(message, RecordBatch):
                key, value = legacy_key_value(inner, message)
                yield Record(index, key, value, ())
                index += 1
    if covered != len(records):
        # A Fetch answer may end inside a batch; a Produce request may not (and what
        # the proxy did not read, it must not send on).
        raise RemoteProtocolError(f"the records end inside a batch ({len(records) - covered} "
                                  "bytes after the last whole one)", offset=covered)


def verdict(validation: RecordValidation, records: Buffer | None, decompress: Decompress,
            unreadable: tuple[type[Exception], ...] = (),
            lookup: SchemaLookup | None = None, topic: str | None = None
            ) -> PartitionVerdict | None:
    """Why ``validation`` refuses one partition's ``records`` (None: it takes them all).
    ``unreadable``: the exceptions of ``decompress`` that mean the batch cannot be read;
    ``lookup``: the schemas fetched for ``registry`` checks; ``topic``: the partition's,
    as the client names it (None: named by an id not learned).  A schema that could not
    be looked up leaves the partition unjudged: REQUEST_TIMED_OUT, which clients retry."""
    errors: list[tuple[int, str]] = []
    bad = 0
    cannot_read: tuple[type[Exception], ...] = (ProtocolError, *unreadable)
    try:
        for record in read_records(records, decompress, validation.max_decompressed_bytes):
            problem = validation.problem(record, lookup, topic)
            if problem is not None:
                bad += 1
                if len(errors) < MAX_RECORD_ERRORS:
                    errors.append((record.batch_index, problem))
    except cannot_read as exc:
        return PartitionVerdict(CORRUPT_MESSAGE, f"the records cannot be read: {exc}")
    except SchemaRegistryUnavailable as exc:
        return PartitionVerdict(REQUEST_TIMED_OUT, f"the records' schemas cannot be looked "
                                f"up now (the Schema Registry: {exc}); try again")
    if not errors:
        return None
    first_index, first = errors[0]
    more = f" ({bad} records in all)" if bad > 1 else ""
    return PartitionVerdict(INVALID_RECORD, f"record {first_index}: {first}{more}",
                            tuple(errors), bad)


PartitionKey = tuple[Any, int]  # (topic name or id bytes, partition index)


def without(req: Request, withheld: Mapping[PartitionKey, Any]) -> Request | None:
    """``req`` without the ``withheld`` partitions (topics left empty dropped); None
    when nothing is left to send."""
    topics = []
    for topic in req.body.topic_data:
        key = topic_key(topic)
        kept = tuple(p for p in topic.partition_data if (key, p.index) not in withheld)
        if len(kept) == len(topic.partition_data):
            topics.append(topic)
        elif kept:
            topics.append(topic.replace(partition_data=kept))
    if not topics:
        return None
    return req.replace(body=req.body.replace(topic_data=tuple(topics)))


def withheld_answer(req: Request, withheld: Mapping[PartitionKey, PartitionVerdict]
                    ) -> Response:
    """The Produce response answering ``req``'s ``withheld`` partitions (and only them)
    with their verdicts: the code, at v8+ the message and the bad records' indexes."""
    topics = []
    for topic in req.body.topic_data:
        key = topic_key(topic)
        mine = tuple(p for p in topic.partition_data if (key, p.index) in withheld)
        if mine:
            topics.append(topic.replace(partition_data=mine))
    answer = error_response(req.replace(body=req.body.replace(topic_data=tuple(topics))), 0)
    version = req.api_version
    root = req.api.response.root
    topic_struct = array_entry(root, "responses", version)
    partition_struct = array_entry(topic_struct, "partition_responses", version)
    has_message = has_field(partition_struct, "error_message", version)
    error_struct = (array_entry(partition_struct, "record_errors", version)
                    if has_field(partition_struct, "record_errors", version) else None)
    out = []
    for topic in answer.body.responses:
        key = topic_key(topic)
        partitions = []
        for partition in topic.partition_responses:
            found = withheld[(key, partition.index)]
            changes: dict[str, Any] = {"error_code": found.code}
            if has_message:
                changes["error_message"] = found.message
            if error_struct is not None and found.record_errors:
                changes["record_errors"] = tuple(
                    error_struct.default.replace(batch_index=index,
                                                 batch_index_error_message=text)
                    for index, text in found.record_errors)
            partitions.append(partition.replace(**changes))
        out.append(topic.replace(partition_responses=tuple(partitions)))
    return answer.replace(body=answer.body.replace(responses=tuple(out)))


def merged(resp: Response, answer: Response) -> Response:
    """The broker's Produce response ``resp`` with the proxy's ``answer`` for the
    partitions it withheld added (into the same topic entry where the broker answered
    others of that topic)."""
    topics = list(resp.body.responses)
    where = {topic_key(t): i for i, t in enumerate(topics)}
    for topic in answer.body.responses:
        i = where.get(topic_key(topic))
        if i is None:
            where[topic_key(topic)] = len(topics)
            topics.append(topic)
        else:
            topics[i] = topics[i].replace(partition_responses=(
                *topics[i].partition_responses, *topic.partition_responses))
    return resp.replace(body=resp.body.replace(responses=tuple(topics)))


__all__ = [
    "DEFAULT_MAX_DECOMPRESSED",
    "FORMATS",
    "MAX_RECORD_ERRORS",
    "NOT_REGISTERED",
    "FieldCheck",
    "JsonSchema",
    "Lookup",
    "PartitionVerdict",
    "RecordValidation",
    "RegisteredSchema",
    "RegistryCheck",
    "RegistryUnavailable",
    "SchemaLookup",
    "SchemaRegistryUnavailable",
    "compile_json_schema",
    "load_json_schema",
    "merged",
    "read_records",
    "schema_id_of",
    "shown_url",
    "verdict",
    "withheld_answer",
    "without",
]
