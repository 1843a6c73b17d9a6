"""Protobuf records held to the schema registered under their id (pure, no dependency).

A Schema Registry keeps a Protobuf schema as ``.proto`` text (Java's serializers, the
registry's canonical form) or as a base64 ``FileDescriptorProto`` (what Confluent's
Python serializer registers).  Either is read here into ``ProtoSchema``: each message's
fields by number, with the wire type its declared type is written in.  A record framed
for the registry carries, after the schema id, the message indexes that pick the message
inside the file (zigzag varints: a count, then an index per level; a lone 0 for the
first message), then the message's bytes.

``ProtoSchema.problem`` walks those bytes as a parser does and says what is wrong: a
tag or length that runs past the end, a wire type 6 or 7, a known field written in a
wire type its declared type never uses (a parser would silently set it aside as an
unknown field: the reader of the topic then misses the value), a nested message that
does not read, a ``string`` that is not UTF-8 (proto3 and editions, as their parsers
refuse it), a proto2 ``required`` field missing.  Fields the schema does not declare
are allowed, as every parser allows them (a newer writer's fields).  The files a
schema imports are read with it when given (the registry's references) and the
well-known types are known here; a type of any other file is unknown: such a field is
held to being a varint or a length-delimited value, its content not read.  Errors name
fields by name and number, never by the values a record holds.

The walk runs in C where built (``_protowire.c``: about 1 us a 1 KiB message), which
only ever says "it reads"; anything else is walked again in Python, which says what is
wrong (tests/test_rules_protobuf.py holds the two to the same answers).
"""

from __future__ import annotations

import base64
import binascii
import os
import re
from array import array
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Final

# The walk in C (_protowire.c, built where a C compiler is found): it says only "it
# reads"; anything else is walked again here, which says what is wrong.
protowire: ModuleType | None = None
if not os.environ.get("GATEHOUSE_PURE_PYTHON"):
    try:
        from gatehouse.rules import _protowire as protowire
    except ImportError:  # not built here: the Python walk alone
        protowire = None

# Wire types (protobuf encoding).
VARINT: Final = 0
I64: Final = 1
LEN: Final = 2
SGROUP: Final = 3
EGROUP: Final = 4
I32: Final = 5

MAX_DEPTH: Final = 64  # nested messages and groups; deeper is refused, not recursed
MAX_FIELD_NUMBER: Final = (1 << 29) - 1

# A declared scalar type: the wire type it is written in.
_SCALAR_WIRE: Final = {
    "int32": VARINT, "int64": VARINT, "uint32": VARINT, "uint64": VARINT,
    "sint32": VARINT, "sint64": VARINT, "bool": VARINT,
    "fixed64": I64, "sfixed64": I64, "double": I64,
    "fixed32": I32, "sfixed32": I32, "float": I32,
    "string": LEN, "bytes": LEN,
}
# FieldDescriptorProto.Type numbers to the names above (10 group, 11 message, 14 enum).
_DESCRIPTOR_TYPES: Final = {
    1: "double", 2: "float", 3: "int64", 4: "uint64", 5: "int32", 6: "fixed64",
    7: "fixed32", 8: "bool", 9: "string", 12: "bytes", 13: "uint32", 15: "sfixed32",
    16: "sfixed64", 17: "sint32", 18: "sint64",
}
_WIRE_NAMES: Final = {VARINT: "a varint", I64: "8 bytes", LEN: "length-delimited",
                      SGROUP: "a group", I32: "4 bytes"}


class ProtoSchemaError(ValueError):
    """A schema this module cannot read (the record's id is then checked alone)."""


class _Bad(Exception):
    """What is wrong with a message's bytes (internal: becomes ``problem``'s text);
    ``placed``: not to be said with the fields it lies in."""

    def __init__(self, message: str, placed: bool = False) -> None:
        super().__init__(message)
        self.placed = placed
        self.where: list[str] = []  # the fields it lies in, innermost first


@dataclass(frozen=True, slots=True)
class ProtoField:
    name: str
    number: int
    type: str  # a scalar's name, or "message", "group", "enum", "unknown" (not in file)
    wire: int  # the wire type it is written in (unknown: VARINT or LEN both taken)
    repeated: bool = False
    required: bool = False
    message: str | None = None  # the full name of a message or group type

    @property
    def packable(self) -> bool:
        """A repeated scalar or enum: also taken packed (one length-delimited run)."""
        return self.repeated and self.wire in (VARINT, I64, I32)


@dataclass(frozen=True, slots=True)
class ProtoMessage:
    name: str  # full name, package included
    fields: dict[int, ProtoField]
    nested: tuple[str, ...] = ()  # full names of nested messages, in declaration order
    required: tuple[ProtoField, ...] = ()
    checks_utf8: bool = True  # its strings must be UTF-8 (proto3, editions: not proto2)


@dataclass(frozen=True)
class ProtoSchema:
    """A ``.proto`` file's messages, as ``problem`` needs them."""

    syntax: str  # "proto2", "proto3" or "editions"
    top: tuple[str, ...]  # full names of the file's messages, in order
    messages: dict[str, ProtoMessage] = field(repr=False)
    # Per message: what each tag its declared fields are written with calls for (a tag
    # not in it is read on the slow path); and the same for the C walk, when it goes.
    _tables: dict[str, dict[int, tuple[int, ProtoField]]] = field(
        init=False, repr=False, compare=False)
    _native: tuple[bytes, dict[str, int]] | None = field(
        init=False, repr=False, compare=False)

    def message_at(self, indexes: tuple[int, ...]) -> ProtoMessage | None:
        """The message the registry framing's indexes pick (None: no such message)."""
        names = self.top
        message = None
        for index in indexes:
            if not 0 <= index < len(names):
                return None
            message = self.messages[names[index]]
            names = message.nested
        return message

    def __post_init__(self) -> None:
        tables = {name: _actions(message) for name, message in self.messages.items()}
        object.__setattr__(self, "_tables", tables)
        object.__setattr__(self, "_native", _native_tables(self.messages, tables)
                           if protowire is not None else None)

    def problem(self, data: bytes, start: int = 0) -> str | None:
        """What is wrong with ``data[start:]`` (the message indexes, then the message),
        None when it reads as the message they name."""
        try:
            indexes, pos = _message_indexes(data, start)
        except _Bad as exc:
            return f"its message indexes do not read: {exc}"
        message = self.message_at(indexes)
        if message is None:
            return f"it names message {list(indexes)}, which the schema does not have"
        return self.message_problem(message.name, data, pos)

    def message_problem(self, name: str, data: bytes, start: int = 0) -> str | None:
        """What is wrong with ``data[start:]`` as message ``name`` (its full name) of this
        schema; None when it reads as one."""
        message = self.messages[name]
        pos = start
        native = self._native
        if native is not None and protowire is not None and protowire.reads(
                data, pos, native[0], native[1][message.name]):
            return None
        try:
            self._read(message, data, pos, len(data), 0, None)
        except _Bad as exc:
            where = f"in {'.'.join(reversed(exc.where))}: " if exc.where else ""
            return f"as {message.name}: {where}{exc}"
        return None

    def _walk(self, name: str, spec: ProtoField, data: bytes, pos: int, end: int,
              depth: int, group: int | None) -> int:
        try:
            return self._read(self.messages[name], data, pos, end, depth, group)
        except _Bad as exc:
            if not exc.placed:
                exc.where.append(spec.name)
            raise

    def _read(self, message: ProtoMessage, data: bytes, pos: int, end: int, depth: int,
              group: int | None) -> int:
        if depth > MAX_DEPTH:
            raise _Bad(f"messages nested more than {MAX_DEPTH} deep", placed=True)
        lookup = self._tables[message.name].get
        seen: set[int] | None = set() if message.required else None
        while pos < end:
            key = data[pos]
            if key < 0x80:
                pos += 1
            else:
                key, pos = _varint(data, pos, end)
            action = lookup(key)
            if action is None:
                if key & 7 == EGROUP and key >> 3 == group:
                    _required(message, seen)
                    return pos
                pos = _other(message, key, data, pos, end, depth)
                continue
            code, spec = action
            if code == _VARINT:
                if pos < end and data[pos] < 0x80:
                    pos += 1
                else:
                    pos = _varint(data, pos, end)[1]
            elif code <= _PACKED:  # length-delimited
                if pos < end and data[pos] < 0x80:
                    stop = pos + 1 + data[pos]
                    pos += 1
                else:
                    length, pos = _varint(data, pos, end)
                    stop = pos + length
                if stop > end:
                    raise _Bad(f"field {spec.name!r} ({spec.number}) runs past the end")
                if code == _MESSAGE:
                    assert spec.message is not None
                    self._walk(spec.message, spec, data, pos, stop, depth + 1, None)
                elif code == _STRING:
                    try:
                        str(data[pos:stop], "utf-8")
                    except UnicodeDecodeError as exc:
                        raise _Bad(f"field {spec.name!r} ({spec.number}) is not UTF-8 "
                                   f"text (byte {exc.start})") from None
                elif code == _PACKED:
                    _packed(data, pos, stop, spec)
                pos = stop
            elif code == _GROUP:
                assert spec.message is not None
                pos = self._walk(spec.message, spec, data, pos, end, depth + 1,
                                 spec.number)
            else:
                pos += 8 if code == _I64 else 4
                if pos > end:
                    raise _Bad(f"field {spec.name!r} ({spec.number}) runs past the end")
            if seen is not None:
                seen.add(spec.number)
        if group is not None:
            raise _Bad("a group that does not end")
        _required(message, seen)
        return pos


# What a declared field's tag calls for (``ProtoSchema._read``).
_VARINT, _BYTES, _STRING, _MESSAGE, _PACKED, _I64, _I32, _GROUP = range(8)


def _actions(message: ProtoMessage) -> dict[int, tuple[int, ProtoField]]:
    table: dict[int, tuple[int, ProtoField]] = {}
    for spec in message.fields.values():
        tag = spec.number << 3
        if spec.type == "unknown":  # an enum or a message of another file
            table[tag | VARINT] = (_VARINT, spec)
            table[tag | LEN] = (_BYTES, spec)
        elif spec.wire == VARINT:
            table[tag | VARINT] = (_VARINT, spec)
        elif spec.wire == I64:
            table[tag | I64] = (_I64, spec)
        elif spec.wire == I32:
            table[tag | I32] = (_I32, spec)
        elif spec.wire == SGROUP:
            table[tag | SGROUP] = (_GROUP, spec)
        elif spec.type == "message":
            table[tag | LEN] = (_MESSAGE, spec)
        else:
            table[tag | LEN] = (_STRING if message.checks_utf8 and spec.type == "string"
                                else _BYTES, spec)
        if spec.packable:
            table[tag | LEN] = (_PACKED, spec)
    return table


# _protowire.c's codes for the actions above (a packed run by its values' size).
_NATIVE_CODES: Final = {_VARINT: 1, _BYTES: 2, _STRING: 3, _MESSAGE: 4, _I64: 8, _I32: 9,
                        _GROUP: 10}
_NATIVE_PACKED: Final = {VARINT: 5, I64: 6, I32: 7}
_NATIVE_MISMATCH: Final = 15
_NATIVE_MAX_NUMBER: Final = 4096  # a larger declared number: the Python walk alone
_NATIVE_MAX_BYTES: Final = 4 * 1024 * 1024  # all of a schema's tables; more: the same


def _native_tables(messages: dict[str, ProtoMessage],
                   tables: dict[str, dict[int, tuple[int, ProtoField]]]
                   ) -> tuple[bytes, dict[str, int]] | None:
    """The tables for _protowire.c, in one bytes object of uint32s: the number of
    messages, each message's (start, length), then per message an action per tag up to
    its largest declared number; and each message's index.  None where the C walk does
    not go: proto2 ``required`` fields (it keeps no count of the fields seen), very large
    field numbers or tables."""
    if any(message.required for message in messages.values()):
        return None
    index = {name: i for i, name in enumerate(messages)}
    words = array("I", [len(messages)] + [0] * (2 * len(messages)))
    if words.itemsize != 4:
        return None
    for name, message in messages.items():
        largest = max(message.fields, default=0)
        size = (largest + 1) << 3
        if largest > _NATIVE_MAX_NUMBER or 4 * (len(words) + size) > _NATIVE_MAX_BYTES:
            return None
        at = len(words)
        words[1 + 2 * index[name]], words[2 + 2 * index[name]] = at, size
        words.frombytes(bytes(4 * size))
        for number in message.fields:
            for wire in (VARINT, I64, LEN, SGROUP, I32, 6, 7):
                words[at + (number << 3 | wire)] = _NATIVE_MISMATCH
        for tag, (code, spec) in tables[name].items():
            native = (_NATIVE_PACKED[spec.wire] if code == _PACKED
                      else _NATIVE_CODES[code])
            if spec.message is not None and code in (_MESSAGE, _GROUP):
                native |= index[spec.message] << 4
            words[at + tag] = native
    return words.tobytes(), index


def _other(message: ProtoMessage, key: int, data: bytes, pos: int, end: int,
           depth: int) -> int:
    """Past a tag no declared field is written with: an undeclared field (allowed, as
    every parser allows it); else what is wrong."""
    number = key >> 3
    wire = key & 7
    if not 0 < number <= MAX_FIELD_NUMBER:
        raise _Bad(f"a field numbered {number}")
    if wire == EGROUP:
        raise _Bad(f"a group's end (field {number}) with no group open")
    spec = message.fields.get(number)
    if spec is not None:
        expected = ("a varint or length-delimited (an enum or a message of another file)"
                    if spec.type == "unknown" else _WIRE_NAMES[spec.wire])
        raise _Bad(f"field {spec.name!r} ({number}) is written as "
                   f"{_WIRE_NAMES.get(wire, f'wire type {wire}')}, and its type "
                   f"({spec.type}) is {expected}")
    return _skip(data, pos, end, wire, number, depth)


def _required(message: ProtoMessage, seen: set[int] | None) -> None:
    if seen is None:
        return
    missing = [f.name for f in message.required if f.number not in seen]
    if missing:
        raise _Bad(f"it has no required field "
                   f"{', '.join(repr(name) for name in missing)}")


def _varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        if pos >= end:
            raise _Bad("it ends inside a varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise _Bad("a varint longer than 10 bytes")


def _packed(data: bytes, pos: int, stop: int, spec: ProtoField) -> None:
    """A packed run's bytes, ``data[pos:stop]``: whole values of the field's type."""
    if spec.wire == VARINT:
        while pos < stop:
            pos = _varint(data, pos, stop)[1]
    elif (stop - pos) % (8 if spec.wire == I64 else 4):
        raise _Bad(f"packed field {spec.name!r} ({spec.number}) is {stop - pos} "
                   f"bytes, not a whole number of {spec.type} values")


def _skip(data: bytes, pos: int, end: int, wire: int, number: int, depth: int) -> int:
    """Past an undeclared field's value (a group: through its end)."""
    if wire == VARINT:
        return _varint(data, pos, end)[1]
    if wire in (I64, I32):
        stop = pos + (8 if wire == I64 else 4)
    elif wire == LEN:
        length, pos = _varint(data, pos, end)
        stop = pos + length
    elif wire == SGROUP:
        if depth >= MAX_DEPTH:
            raise _Bad(f"groups nested more than {MAX_DEPTH} deep")
        while True:
            key, pos = _varint(data, pos, end)
            if not 0 < key >> 3 <= MAX_FIELD_NUMBER:
                raise _Bad(f"a field numbered {key >> 3}")
            if key & 7 == EGROUP:
                if key >> 3 != number:
                    raise _Bad(f"group {number} ends as {key >> 3}")
                return pos
            pos = _skip(data, pos, end, key & 7, key >> 3, depth + 1)
    else:
        raise _Bad(f"field {number} has wire type {wire}, which no field has")
    if stop > end:
        raise _Bad(f"field {number} runs past the end")
    return stop


def _zigzag(value: int) -> int:
    return (value >> 1) ^ -(value & 1)


def _message_indexes(data: bytes, pos: int) -> tuple[tuple[int, ...], int]:
    end = len(data)
    count, pos = _varint(data, pos, end)
    count = _zigzag(count)
    if count == 0:  # the first message: one zero byte (Java's serializer)
        return (0,), pos
    if not 0 < count <= 100:
        raise _Bad(f"a count of {count}")
    indexes = []
    for _ in range(count):
        index, pos = _varint(data, pos, end)
        indexes.append(_zigzag(index))
    return tuple(indexes), pos


# --- reading a schema --------------------------------------------------------------------

def parse_proto_schema(text: str, imports: Mapping[str, str] | None = None) -> ProtoSchema:
    """A registered Protobuf schema: ``.proto`` text, or a base64 ``FileDescriptorProto``
    (``ProtoSchemaError`` when it is neither).  ``imports``: the files it imports (the
    registry's references: the name it imports, that file's schema, in either form)."""
    return _complete(_files_of(text), imports)


def _files_of(text: str) -> _Files:
    stripped = text.strip()
    if stripped and not re.search(r"[\s{};]", stripped):
        try:
            raw = base64.b64decode(stripped, validate=True)
        except (binascii.Error, ValueError):
            pass
        else:
            return _descriptor_files(raw)
    return _TextParser(text).read()


def _complete(files: _Files, imports: Mapping[str, str] | None) -> ProtoSchema:
    """``files`` with what it imports, and what they import, from ``imports`` or the
    well-known types this module holds; the types of any other file stay unknown."""
    pending = list(files.imports)
    done: set[str] = set()
    while pending:
        name = pending.pop()
        if name in done:
            continue
        done.add(name)
        source = (imports.get(name) if imports is not None else None) or WELL_KNOWN.get(name)
        if source is None:
            continue
        try:
            imported = _files_of(source)
        except ProtoSchemaError as exc:
            raise ProtoSchemaError(f"{name} (imported): {exc}") from None
        pending.extend(imported.imports)
        files.absorb(imported)
    return files.schema()


@dataclass(frozen=True, eq=False)
class ProtoFile:
    """``protobuf``: a key or value must be one message of a local ``.proto`` file, as
    its bytes are (no registry framing)."""

    path: Path
    message: str  # its full name
    schema: ProtoSchema
    files: tuple[Path, ...]  # the file and those it imports: a change reloads the rules

    def problem(self, data: bytes, what: str) -> str | None:
        found = self.schema.message_problem(self.message, data)
        if found is None:
            return None
        return f"its {what} is not Protobuf of {self.path.name} ({found})"


class _Beside(Mapping[str, str]):
    """The files a ``.proto`` file imports, read from beside it when asked for."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.read: list[Path] = []

    def __getitem__(self, name: str) -> str:
        path = self.folder / name
        if not path.is_file():
            raise KeyError(name)
        self.read.append(path)
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ProtoSchemaError(f"{path} cannot be read: {exc}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


def load_proto_file(path: Path, message: str | None = None) -> ProtoFile:
    """``path`` read with the files it imports (beside it; the well-known types are known
    here), and ``message`` (a full name; None: the file's first) found in it;
    ``ProtoSchemaError`` saying what is wrong, and where."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ProtoSchemaError(f"{path} cannot be read: {getattr(exc, 'strerror', exc)}"
                               ) from None
    beside = _Beside(path.parent)
    try:
        schema = parse_proto_text(text, beside)
    except ProtoSchemaError as exc:
        raise ProtoSchemaError(f"{path}: {exc}") from None
    if message is None:
        if not schema.top:
            raise ProtoSchemaError(f"{path} declares no message")
        message = schema.top[0]
    elif message not in schema.messages:
        raise ProtoSchemaError(f"{path} has no message {message!r} (its messages: "
                               f"{', '.join(schema.top) or 'none'}; name one with its "
                               "package)")
    return ProtoFile(path, message, schema, (path, *dict.fromkeys(beside.read)))


# The well-known types' messages (google/protobuf/*.proto, their fields as published),
# so a Timestamp or a StringValue is read, not taken on trust, without a reference.
WELL_KNOWN: Final = {
    "google/protobuf/timestamp.proto": 'syntax = "proto3"; package google.protobuf; '
    "message Timestamp { int64 seconds = 1; int32 nanos = 2; }",
    "google/protobuf/duration.proto": 'syntax = "proto3"; package google.protobuf; '
    "message Duration { int64 seconds = 1; int32 nanos = 2; }",
    "google/protobuf/empty.proto": 'syntax = "proto3"; package google.protobuf; '
    "message Empty {}",
    "google/protobuf/any.proto": 'syntax = "proto3"; package google.protobuf; '
    "message Any { string type_url = 1; bytes value = 2; }",
    "google/protobuf/field_mask.proto": 'syntax = "proto3"; package google.protobuf; '
    "message FieldMask { repeated string paths = 1; }",
    "google/protobuf/wrappers.proto": 'syntax = "proto3"; package google.protobuf; '
    + " ".join(f"message {name}Value {{ {kind} value = 1; }}" for name, kind in (
        ("Double", "double"), ("Float", "float"), ("Int64", "int64"),
        ("UInt64", "uint64"), ("Int32", "int32"), ("UInt32", "uint32"), ("Bool", "bool"),
        ("String", "string"), ("Bytes", "bytes"))),
    "google/protobuf/struct.proto": 'syntax = "proto3"; package google.protobuf; '
    "message Struct { map<string, Value> fields = 1; } "
    "message Value { oneof kind { NullValue null_value = 1; double number_value = 2; "
    "string string_value = 3; bool bool_value = 4; Struct struct_value = 5; "
    "ListValue list_value = 6; } } "
    "enum NullValue { NULL_VALUE = 0; } "
    "message ListValue { repeated Value values = 1; }",
}


@dataclass
class _Draft:
    """A message as read, before its field types are resolved."""

    name: str
    fields: list[tuple[str, int, str, str, bool]] = field(default_factory=list)
    # (name, number, type as written or a scalar, label, is a group)
    nested: list[str] = field(default_factory=list)
    utf8: bool = True  # its file is not proto2


class _Files:
    """What a file declares, then resolved into a ``ProtoSchema``."""

    def __init__(self) -> None:
        self.syntax = "proto2"
        self.package = ""
        self.top: list[str] = []
        self.drafts: dict[str, _Draft] = {}
        self.enums: set[str] = set()
        self.imports: list[str] = []

    def draft(self, full: str, fields: list[tuple[str, int, str, str, bool]] | None = None
              ) -> _Draft:
        draft = self.drafts[full] = _Draft(full, fields or [], utf8=self.syntax != "proto2")
        return draft

    def absorb(self, other: _Files) -> None:
        """An imported file's messages and enums, to resolve names against."""
        for full, draft in other.drafts.items():
            self.drafts.setdefault(full, draft)
        self.enums |= other.enums

    def schema(self) -> ProtoSchema:
        messages = {}
        for full, draft in self.drafts.items():
            fields: dict[int, ProtoField] = {}
            for name, number, written, label, is_group in draft.fields:
                fields[number] = self._field(full, name, number, written, label, is_group)
            messages[full] = ProtoMessage(
                full, fields, tuple(draft.nested),
                tuple(f for f in fields.values() if f.required), draft.utf8)
        return ProtoSchema(self.syntax, tuple(self.top), messages)

    def _field(self, scope: str, name: str, number: int, written: str, label: str,
               is_group: bool) -> ProtoField:
        repeated = label == "repeated"
        required = label == "required"
        if written in _SCALAR_WIRE:
            return ProtoField(name, number, written, _SCALAR_WIRE[written], repeated,
                              required)
        full = self._resolve(scope, written)
        if full in self.drafts:
            kind = "group" if is_group else "message"
            return ProtoField(name, number, kind, SGROUP if is_group else LEN, repeated,
                              required, full)
        if full in self.enums:
            return ProtoField(name, number, "enum", VARINT, repeated, required)
        return ProtoField(name, number, "unknown", VARINT, repeated, required)

    def _resolve(self, scope: str, written: str) -> str | None:
        if written.startswith("."):
            return written[1:]
        parts = scope.split(".")
        while parts:  # innermost scope first, as protoc looks names up
            candidate = ".".join(parts) + "." + written
            if candidate in self.drafts or candidate in self.enums:
                return candidate
            parts.pop()
        return written if written in self.drafts or written in self.enums else None


_TOKEN = re.compile(r"""
    (?P<skip>\s+|//[^\n]*|/\*.*?\*/)
  | (?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')
  | (?P<number>[-+]?(?:0[xX][0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][-+]?\d+)?))
  | (?P<ident>\.?[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)
  | (?P<symbol>[{}\[\]()<>;=,:.\-+/])
""", re.S | re.X)


class _TextParser:
    """``.proto`` text (proto2, proto3, editions) to a ``_Files``: messages, nested
    messages, groups, maps, oneofs and enums; options, services, extensions and
    reserved ranges are read past."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens: list[tuple[str, int]] = []
        pos = 0
        while pos < len(text):
            match = _TOKEN.match(text, pos)
            if match is None:
                raise self._error(pos, f"an unexpected character {text[pos]!r}")
            if match.lastgroup != "skip":
                self.tokens.append((match.group(), pos))
            pos = match.end()
        self.index = 0
        self.files = _Files()

    def _error(self, pos: int, what: str) -> ProtoSchemaError:
        line = self.text.count("\n", 0, pos) + 1
        return ProtoSchemaError(f"line {line}: {what}")

    def _peek(self, ahead: int = 0) -> str:
        index = self.index + ahead
        return self.tokens[index][0] if index < len(self.tokens) else ""

    def _next(self) -> str:
        if self.index >= len(self.tokens):
            raise self._error(len(self.text), "it ends early")
        token = self.tokens[self.index][0]
        self.index += 1
        return token

    def _expect(self, wanted: str) -> None:
        token = self._next()
        if token != wanted:
            raise self._error(self.tokens[self.index - 1][1],
                              f"{wanted!r} expected, found {token!r}")

    def _name(self) -> str:
        token = self._next()
        if not re.fullmatch(r"\.?[A-Za-z_][\w.]*", token):
            raise self._error(self.tokens[self.index - 1][1],
                              f"a name expected, found {token!r}")
        return token

    def _skip_statement(self) -> None:
        """Through the next ``;`` outside brackets, or a ``{...}`` block."""
        depth = 0
        while True:
            token = self._next()
            if token in ("{", "[", "(", "<"):
                depth += 1
            elif token in ("}", "]", ")", ">"):
                depth -= 1
                if depth == 0 and token == "}" and self._peek() != ";":
                    return
            elif token == ";" and depth == 0:
                return

    def _skip_block(self) -> None:
        while self._next() != "{":
            pass
        depth = 1
        while depth:
            token = self._next()
            depth += {"{": 1, "}": -1}.get(token, 0)

    def _string(self) -> str:
        token = self._next()
        if token[:1] not in ("'", '"'):
            raise self._error(self.tokens[self.index - 1][1],
                              f"a quoted name expected, found {token!r}")
        return token[1:-1]

    def read(self) -> _Files:
        files = self.files
        while self.index < len(self.tokens):
            token = self._next()
            if token in ("syntax", "edition"):
                self._expect("=")
                value = self._next().strip("\"'")
                files.syntax = "editions" if token == "edition" else value
                self._expect(";")
            elif token == "package":
                files.package = self._name()
                self._expect(";")
            elif token == "import":
                if self._peek() in ("public", "weak"):
                    self._next()
                files.imports.append(self._string())
                self._expect(";")
            elif token == "option":
                self._skip_statement()
            elif token == "message":
                files.top.append(self._message(files.package))
            elif token == "enum":
                self._enum(files.package)
            elif token in ("service", "extend"):
                self._skip_block()
            elif token != ";":
                raise self._error(self.tokens[self.index - 1][1],
                                  f"{token!r} where a declaration belongs")
        return files

    def _message(self, scope: str, name: str | None = None) -> str:
        name = name or self._name()
        full = f"{scope}.{name}" if scope else name
        draft = self.files.draft(full)
        self._expect("{")
        self._body(full, draft, "}")
        return full

    def _body(self, full: str, draft: _Draft, closing: str) -> None:
        while True:
            token = self._peek()
            declares = self._peek(2) == "{"  # "message Name {": not a field's type
            if token == closing:
                self._next()
                return
            if token == "message" and declares:
                self._next()
                draft.nested.append(self._message(full))
            elif token == "enum" and declares:
                self._next()
                self._enum(full)
            elif token == "oneof" and declares:
                self._next()
                self._name()
                self._expect("{")
                self._body(full, draft, "}")
            elif token in ("option", "reserved", "extensions"):
                self._skip_statement()
            elif token == "extend":
                self._skip_block()
            elif token == ";":
                self._next()
            else:
                self._field(full, draft)

    def _field(self, scope: str, draft: _Draft) -> None:
        label = ""
        if self._peek() in ("optional", "required", "repeated") and self._peek(1) != "=":
            label = self._next()
        written = self._name()
        if written == "map" and self._peek() == "<":
            self._next()
            key = self._name()
            self._expect(",")
            value = self._name()
            self._expect(">")
            name = self._name()
            number = self._number()
            self._options()
            entry = "".join(part[:1].upper() + part[1:] for part in name.split("_"))
            entry_full = f"{scope}.{entry}Entry"
            self.files.draft(entry_full, [("key", 1, key, "", False),
                                          ("value", 2, value, "", False)])
            draft.nested.append(entry_full)
            draft.fields.append((name, number, entry_full[len(scope) + 1:], "repeated",
                                 False))
            return
        if written == "group":  # proto2: "optional group Result = 1 { ... }"
            group = self._name()
            number = self._number()
            self._options()
            draft.nested.append(self._message(scope, group))
            draft.fields.append((group.lower(), number, group, label, True))
            return
        name = self._name()
        number = self._number()
        self._options()
        self._expect(";")
        draft.fields.append((name, number, written, label, False))

    def _number(self) -> int:
        self._expect("=")
        token = self._next()
        try:
            if re.fullmatch(r"0[0-7]+", token):
                return int(token, 8)
            number = int(token, 0)
        except ValueError:
            raise self._error(self.tokens[self.index - 1][1],
                              f"a field number expected, found {token!r}") from None
        if not 0 < number <= MAX_FIELD_NUMBER:
            raise self._error(self.tokens[self.index - 1][1],
                              f"field number {number} out of range")
        return number

    def _options(self) -> None:
        if self._peek() == "[":
            depth = 0
            while True:
                token = self._next()
                depth += {"[": 1, "]": -1, "{": 1, "}": -1}.get(token, 0)
                if depth == 0:
                    return

    def _enum(self, scope: str) -> None:
        name = self._name()
        self.files.enums.add(f"{scope}.{name}" if scope else name)
        self._expect("{")
        depth = 1
        while depth:
            token = self._next()
            depth += {"{": 1, "}": -1}.get(token, 0)


def parse_proto_text(text: str, imports: Mapping[str, str] | None = None) -> ProtoSchema:
    """``.proto`` text as a ``ProtoSchema`` (``ProtoSchemaError`` with its line)."""
    return _complete(_TextParser(text).read(), imports)


# --- a FileDescriptorProto, read with the same wire walk ---------------------------------

def _entries(data: bytes, start: int, end: int) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, a varint's value or a length-delimited value's bytes)."""
    pos = start
    while pos < end:
        key, pos = _varint(data, pos, end)
        number, wire = key >> 3, key & 7
        if wire == VARINT:
            value, pos = _varint(data, pos, end)
            yield number, wire, value
        elif wire == LEN:
            length, pos = _varint(data, pos, end)
            if pos + length > end:
                raise _Bad("a length past the end")
            yield number, wire, data[pos:pos + length]
            pos += length
        else:
            pos = _skip(data, pos, end, wire, number, 0)


def read_file_descriptor(raw: bytes, imports: Mapping[str, str] | None = None
                         ) -> ProtoSchema:
    """A serialized ``google.protobuf.FileDescriptorProto`` as a ``ProtoSchema``."""
    return _complete(_descriptor_files(raw), imports)


def _descriptor_files(raw: bytes) -> _Files:
    files = _Files()
    fields: list[tuple[str, str, str, int, int, str]] = []
    # (message, name, type_name, number, type, label): resolved once all are read

    def text(value: int | bytes) -> str:
        if not isinstance(value, bytes):
            raise _Bad("a number where a name belongs")
        return value.decode("utf-8")

    def message(body: bytes, scope: str) -> str:
        entries = list(_entries(body, 0, len(body)))
        name = next((text(v) for n, w, v in entries if n == 1 and w == LEN), "")
        full = f"{scope}.{name}" if scope else name
        draft = files.draft(full)
        for number, wire, value in entries:
            if wire != LEN:
                continue
            assert isinstance(value, bytes)
            if number == 2:
                fields.append(_descriptor_field(value, full))
            elif number == 3:
                draft.nested.append(message(value, full))
            elif number == 4:
                enum(value, full)
        return full

    def enum(body: bytes, scope: str) -> None:
        name = next((text(v) for n, w, v in _entries(body, 0, len(body))
                     if n == 1 and w == LEN), "")
        files.enums.add(f"{scope}.{name}" if scope else name)

    try:
        entries = list(_entries(raw, 0, len(raw)))
        for number, wire, value in entries:
            if number == 2 and wire == LEN:
                files.package = text(value)
            elif number == 12 and wire == LEN:
                files.syntax = text(value) or "proto2"
            elif number == 3 and wire == LEN:
                files.imports.append(text(value))
        for number, wire, value in entries:
            if number == 4 and wire == LEN:
                assert isinstance(value, bytes)
                files.top.append(message(value, files.package))
            elif number == 5 and wire == LEN:
                assert isinstance(value, bytes)
                enum(value, files.package)
    except (_Bad, UnicodeDecodeError) as exc:
        raise ProtoSchemaError(f"not a FileDescriptorProto: {exc}") from None
    for scope, name, type_name, number, type_code, label in fields:
        written = _DESCRIPTOR_TYPES.get(type_code, type_name)
        files.drafts[scope].fields.append((name, number, written, label, type_code == 10))
    return files


def _descriptor_field(body: bytes, scope: str) -> tuple[str, str, str, int, int, str]:
    """A ``FieldDescriptorProto``: its name, type name, number, type and label."""
    name = type_name = ""
    number = type_code = label_code = 0
    for key, wire, value in _entries(body, 0, len(body)):
        if key == 1 and isinstance(value, bytes):
            name = value.decode("utf-8")
        elif key == 3 and wire == VARINT:
            assert isinstance(value, int)
            number = value
        elif key == 4 and wire == VARINT:
            assert isinstance(value, int)
            label_code = value
        elif key == 5 and wire == VARINT:
            assert isinstance(value, int)
            type_code = value
        elif key == 6 and isinstance(value, bytes):
            type_name = value.decode("utf-8")
    label = {2: "required", 3: "repeated"}.get(label_code, "")
    return scope, name, type_name, number, type_code, label
