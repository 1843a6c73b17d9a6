"""Typed view of the generated tables: APIs, messages, structs and fields.

``_schema.py`` is plain data written by the generator; this module turns it into small
frozen objects once, at import, and builds one immutable record class per struct (a
``tuple`` subclass: cheap to build in decoders, immutable, attribute access by name).
"""

from __future__ import annotations

import keyword
import re
import uuid
from collections import namedtuple
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final

from gatehouse.codecs import _schema

KAFKA_RELEASE: Final[str] = _schema.KAFKA_RELEASE
MAX_VERSION: Final = 0x7FFF

PRIMITIVES: Final = frozenset(
    {
        "bool", "int8", "int16", "uint16", "int32", "uint32", "int64", "float64",
        "uuid", "string", "bytes", "records",
    }
)  # fmt: skip

ZERO_UUID: Final = uuid.UUID(int=0)


@dataclass(frozen=True, slots=True)
class Versions:
    """An inclusive version range; ``Versions.NONE`` is empty."""

    lo: int
    hi: int

    NONE: ClassVar[Versions]
    ALL: ClassVar[Versions]

    @classmethod
    def parse(cls, text: str) -> Versions:
        text = text.strip()
        if text == "none":
            return cls.NONE
        if text.endswith("+"):
            return cls(int(text[:-1]), MAX_VERSION)
        if "-" in text:
            lo, hi = text.split("-", 1)
            return cls(int(lo), int(hi))
        return cls(int(text), int(text))

    def __contains__(self, version: object) -> bool:
        return isinstance(version, int) and self.lo <= version <= self.hi

    def __bool__(self) -> bool:
        return self.lo <= self.hi

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.lo, self.hi + 1))

    def intersect(self, other: Versions) -> Versions:
        return Versions(max(self.lo, other.lo), min(self.hi, other.hi))

    def __str__(self) -> str:
        if not self:
            return "none"
        if self.hi == MAX_VERSION:
            return f"{self.lo}+"
        return f"{self.lo}" if self.lo == self.hi else f"{self.lo}-{self.hi}"


Versions.NONE = Versions(0, -1)
Versions.ALL = Versions(0, MAX_VERSION)

_CAMEL_BOUNDARY = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")


def snake_case(name: str) -> str:
    """``ClientSoftwareName`` -> ``client_software_name``; ``ISRNodes`` -> ``isr_nodes``."""
    out = _CAMEL_BOUNDARY.sub("_", name).lower()
    return out + "_" if keyword.iskeyword(out) else out


@dataclass(frozen=True, slots=True, eq=False)
class FieldSpec:
    name: str  # as in the spec (CamelCase)
    attr: str  # snake_case: attribute and to_dict key
    type: str  # element type for arrays; struct name for structs
    is_array: bool
    struct: StructSpec | None
    versions: Versions
    nullable: Versions
    tag: int | None
    tagged: Versions
    default: Any
    entity: str | None
    ignorable: bool
    flexible_override: Versions | None  # only RequestHeader.ClientId ("none")
    map_key: bool = False  # the key of its struct within an array (``mapKey``)

    @property
    def is_struct(self) -> bool:
        return self.struct is not None

    def present_in(self, version: int) -> bool:
        return version in self.versions

    def tagged_in(self, version: int) -> bool:
        return self.tag is not None and version in self.tagged

    def nullable_in(self, version: int) -> bool:
        return version in self.nullable


@dataclass(eq=False)
class StructSpec:
    """One struct (or a message's root).  ``cls`` is its record class."""

    name: str
    message: str
    fields: tuple[FieldSpec, ...] = ()
    cls: type[Any] = field(init=False, repr=False)
    default: Any = field(init=False, repr=False)  # every field at its default

    def fields_in(self, version: int) -> tuple[FieldSpec, ...]:
        return tuple(f for f in self.fields if version in f.versions)

    def field(self, attr: str) -> FieldSpec:
        for f in self.fields:
            if f.attr == attr or f.name == attr:
                return f
        raise KeyError(f"{self.name} has no field {attr!r}")



@dataclass(frozen=True, slots=True, eq=False)
class MessageSpec:
    name: str  # e.g. "MetadataResponse"
    kind: str  # request | response | header | data
    api_key: int | None
    valid: Versions
    flexible: Versions
    latest_unstable: bool
    listeners: tuple[str, ...]
    root: StructSpec
    structs: Mapping[str, StructSpec]

    def is_flexible(self, version: int) -> bool:
        return version in self.flexible


@dataclass(frozen=True, slots=True, eq=False)
class ApiSpec:
    key: int
    name: str  # e.g. "Metadata", as in the protocol guide
    request: MessageSpec
    response: MessageSpec

    @property
    def versions(self) -> Versions:
        return self.request.valid

    def is_flexible(self, version: int) -> bool:
        return version in self.request.flexible

    def request_header_version(self, version: int) -> int:
        if self.key == 7 and version == 0:  # ControlledShutdown v0 predates ClientId
            return 0
        return 2 if version in self.request.flexible else 1

    def response_header_version(self, version: int) -> int:
        if self.key == API_VERSIONS_KEY:  # clients must read it before knowing versions
            return 0
        return 1 if version in self.response.flexible else 0


API_VERSIONS_KEY: Final = 18


def _parse_default(type_name: str, is_array: bool, text: str | None, nullable: Versions) -> Any:
    if text is not None and text == "null":
        return None
    if is_array:
        return ()
    if type_name in ("bool",):
        return (text or "false").lower() == "true"
    if type_name in ("int8", "int16", "uint16", "int32", "uint32", "int64"):
        return int(text, 0) if text else 0
    if type_name == "float64":
        return float(text) if text else 0.0
    if type_name == "string":
        return text if text is not None else ""
    if type_name == "bytes":
        return b""
    if type_name == "uuid":
        return ZERO_UUID
    if type_name == "records":
        return b""  # empty, not null: null is valid only where the spec says so
    return _STRUCT_DEFAULT  # resolved to the struct's default record once classes exist


_STRUCT_DEFAULT: Final = object()


class _Builder:
    def __init__(self, table: Mapping[str, Any]) -> None:
        self.table = table
        self.message = table["name"]
        self.structs: dict[str, StructSpec] = {}
        self.common = dict(table.get("common", {}))

    def build_struct(self, name: str, fields: tuple[Any, ...]) -> StructSpec:
        struct = StructSpec(name=name, message=self.message)
        self.structs[name] = struct
        struct.fields = tuple(self.build_field(f) for f in fields)
        return struct

    def build_field(self, row: tuple[Any, ...]) -> FieldSpec:
        name, type_text, versions_text, options, children = row
        is_array = type_text.startswith("[]")
        type_name = type_text[2:] if is_array else type_text
        struct: StructSpec | None = None
        if type_name not in PRIMITIVES:
            if children:
                struct = self.build_struct(type_name, children)
            elif type_name in self.structs:
                struct = self.structs[type_name]
            elif type_name in self.common:
                struct = self.build_struct(type_name, self.common[type_name][1])
            else:
                raise ValueError(f"{self.message}: unknown type {type_text!r} for field {name}")
        nullable = Versions.parse(options.get("nullable", "none"))
        default = _parse_default(type_name, is_array, options.get("default"), nullable)
        return FieldSpec(
            name=name,
            attr=snake_case(name),
            type=type_name,
            is_array=is_array,
            struct=struct,
            versions=Versions.parse(versions_text),
            nullable=nullable,
            tag=options.get("tag"),
            tagged=Versions.parse(options.get("tagged", "none")),
            default=default,
            entity=options.get("entity"),
            ignorable=bool(options.get("ignorable", False)),
            flexible_override=(
                Versions.parse(options["flexible"]) if "flexible" in options else None
            ),
            map_key=bool(options.get("map_key", False)),
        )

    def build(self) -> MessageSpec:
        t = self.table
        root = self.build_struct(self.message, t["fields"])
        done: set[str] = set()
        for struct in list(self.structs.values()):
            _finish_struct(struct, done)
        return MessageSpec(
            name=self.message,
            kind=t["type"],
            api_key=t.get("api_key"),
            valid=Versions.parse(t["valid"]),
            flexible=Versions.parse(t["flexible"]),
            latest_unstable=bool(t.get("latest_unstable", False)),
            listeners=tuple(t.get("listeners", ())),
            root=root,
            structs=dict(self.structs),
        )


def _finish_struct(struct: StructSpec, done: set[str]) -> None:
    """Build the record class, children first, so struct defaults can nest."""
    if struct.name in done:
        return
    done.add(struct.name)
    fields = []
    for f in struct.fields:
        if f.struct is not None:
            _finish_struct(f.struct, done)
            if f.default is _STRUCT_DEFAULT:
                f = _with_default(f, f.struct.default)
        fields.append(f)
    struct.fields = tuple(fields)
    _make_record_class(struct)
    struct.default = struct.cls()


def _with_default(f: FieldSpec, default: Any) -> FieldSpec:
    values = {name: getattr(f, name) for name in FieldSpec.__slots__}
    values["default"] = default
    return FieldSpec(**values)


class Record(tuple):  # type: ignore[type-arg]
    """Base of every generated struct class: an immutable record of one struct.

    Records are tuples (fast to build and compare), with named attributes.  The last
    slot, ``unknown_tags``, keeps tagged fields this codec does not know, as
    ``((tag, bytes), ...)``, so that they survive decode and encode byte for byte.
    """

    __slots__ = ()
    _fields: ClassVar[tuple[str, ...]]
    _spec: ClassVar[StructSpec]

    def replace(self, **changes: Any) -> Any:
        """A copy with some fields changed (``dataclasses.replace`` style)."""
        return self._replace(**changes)  # type: ignore[attr-defined]


_RESERVED_ATTRS: Final = frozenset({"replace", "unknown_tags"})


def _make_record_class(struct: StructSpec) -> None:
    names = [f.attr for f in struct.fields]
    if _RESERVED_ATTRS.intersection(names):
        raise ValueError(f"{struct.message}.{struct.name}: a field name clashes with {_RESERVED_ATTRS}")
    defaults = [f.default for f in struct.fields] + [()]
    base = namedtuple(struct.name, [*names, "unknown_tags"], defaults=defaults)  # type: ignore[misc]
    qualname = struct.name if struct.name == struct.message else f"{struct.message}.{struct.name}"
    namespace = {"__slots__": (), "_spec": struct, "__module__": "gatehouse.codecs.messages",
                 "__qualname__": qualname}
    struct.cls = type(struct.name, (base, Record), namespace)


def _load() -> tuple[dict[int, ApiSpec], dict[str, MessageSpec]]:
    messages: dict[str, MessageSpec] = {}
    for table in _schema.MESSAGES:
        messages[str(table["name"])] = _Builder(table).build()
    apis: dict[int, ApiSpec] = {}
    for message in messages.values():
        if message.kind != "request":
            continue
        assert message.api_key is not None
        name = message.name[: -len("Request")]
        apis[message.api_key] = ApiSpec(
            key=message.api_key,
            name=name,
            request=message,
            response=messages[name + "Response"],
        )
    return dict(sorted(apis.items())), messages


APIS, MESSAGES = _load()
API_KEYS_BY_NAME: Final = {api.name: key for key, api in APIS.items()}
REQUEST_HEADER: Final = MESSAGES["RequestHeader"]
RESPONSE_HEADER: Final = MESSAGES["ResponseHeader"]


def api_name(api_key: int) -> str:
    """The API's name for a key (``"Metadata"``), ``api-<key>`` for a key the tables
    do not know (logs and labels name every request)."""
    spec = APIS.get(api_key)
    return spec.name if spec is not None else f"api-{api_key}"


def api(key_or_name: int | str) -> ApiSpec:
    """The API for a key (``3``) or a name as in the protocol guide (``"Metadata"``)."""
    if isinstance(key_or_name, str):
        try:
            return APIS[API_KEYS_BY_NAME[key_or_name]]
        except KeyError:
            raise KeyError(f"unknown Kafka API name {key_or_name!r}") from None
    try:
        return APIS[key_or_name]
    except KeyError:
        raise KeyError(f"unknown Kafka API key {key_or_name}") from None


def iter_fields(struct: StructSpec, version: int) -> Iterator[tuple[tuple[str, ...], FieldSpec]]:
    """Every field of a struct (recursively) present in ``version``, with its path."""

    def walk(s: StructSpec, prefix: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], FieldSpec]]:
        for f in s.fields:
            if version not in f.versions:
                continue
            path = (*prefix, f.attr)
            yield path, f
            if f.struct is not None:
                yield from walk(f.struct, path)

    return walk(struct, ())
