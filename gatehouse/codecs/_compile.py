"""Compile the tables into specialised Python decoders and encoders.

For each (message, version) pair we write the Python source of one decode and one
encode function per struct, with every version test, flexible/non-flexible choice and
type dispatch resolved at compile time, then ``exec`` it once and cache the result.
Runs of fixed-size fields become a single ``struct.unpack_from``.  That is what makes a
pure-Python codec fast: the per-frame work is straight-line code over a memoryview.

Generated decoders track the index of the field being read (one local store) so that
an error names the field path and byte offset without slowing the happy path.
"""

from __future__ import annotations

import functools
import struct
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from gatehouse.codecs.errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from gatehouse.codecs.primitives import read_uvarint, uvarint_bytes
from gatehouse.codecs.schema import ZERO_UUID, FieldSpec, MessageSpec, StructSpec

_FIXED: Final = {
    "bool": ("?", 1),
    "int8": ("b", 1),
    "int16": ("h", 2),
    "uint16": ("H", 2),
    "int32": ("i", 4),
    "uint32": ("I", 4),
    "int64": ("q", 8),
    "float64": ("d", 8),
    "uuid": ("16s", 16),
}
_HOLE_MIN: Final = 16 * 1024


class _Out(bytearray):
    """An encoder's output: bytes, plus large record sets kept by reference ("holes")
    as (position, buffer) pairs, so a 3 MB Fetch response is copied once, by ``finish``."""

    __slots__ = ("holes",)

    def __init__(self) -> None:
        super().__init__()
        self.holes: list[tuple[int, Any]] = []

    def finish(self) -> bytes:
        if not self.holes:
            return bytes(self)
        view = memoryview(self)
        parts: list[Any] = []
        at = 0
        for position, data in self.holes:
            parts.append(view[at:position])
            parts.append(data)
            at = position
        parts.append(view[at:])
        return b"".join(parts)


def _copy(out: bytearray, view: memoryview, start: int, end: int) -> None:
    """An untouched span of the original frame into ``out``: large ones by reference."""
    if end - start >= _HOLE_MIN and type(out) is _Out:
        out.holes.append((len(out), view[start:end]))
    else:
        out += view[start:end]


def new_output() -> _Out:
    """The buffer ``MessageCodec.encode`` writes into best (see ``_Out``)."""
    return _Out()


_ARRAY_STRUCTS: Final = 32
# Module-level names the generated functions use most, bound as default arguments so a
# use is a local load rather than a global lookup (the codec's inner loops).
_LOCALS: Final = ("K=K, _tnew=_tnew, _uv=_uv, _i16=_i16, _i32=_i32, _p16=_p16, _p32=_p32, "
                  "_uvb=_uvb, _Out=_Out")


@functools.cache
def _int_array_structs(code: str) -> tuple[struct.Struct, ...]:
    """Struct objects for arrays of 0.._ARRAY_STRUCTS-1 integers of one type."""
    return tuple(struct.Struct(f">{n}{code}") for n in range(_ARRAY_STRUCTS))


_INTS: Final = frozenset({"int8", "int16", "uint16", "int32", "uint32", "int64", "float64", "bool"})
_ZERO_UUID_BYTES: Final = bytes(16)
_new_uuid = object.__new__
_set = object.__setattr__
_SAFE_UNKNOWN = uuid.SafeUUID.unknown


def _uuid_from_bytes(raw: bytes) -> uuid.UUID:
    # uuid.UUID(bytes=...) validates and is slow; the wire gives exactly 16 bytes.
    if raw == _ZERO_UUID_BYTES:
        return ZERO_UUID
    u = _new_uuid(uuid.UUID)
    _set(u, "int", int.from_bytes(raw, "big"))
    _set(u, "is_safe", _SAFE_UNKNOWN)
    return u


def _uuid_to_bytes(value: uuid.UUID) -> bytes:
    return value.bytes


def _decode_reason(exc: BaseException) -> str:
    if isinstance(exc, (IndexError, struct.error)):
        return "truncated: the frame ends inside this field"
    if isinstance(exc, UnicodeDecodeError):
        return "string is not valid UTF-8"
    return str(exc) or type(exc).__name__


def _fail_decode(exc: BaseException, struct_name: str, field_name: str, pos: int) -> ProtocolError:
    if isinstance(exc, ProtocolError):
        return exc.within(field_name)
    return RemoteProtocolError(_decode_reason(exc), path=(field_name,), offset=pos)


def _rebase(exc: BaseException, base: int, pos: int) -> ProtocolError:
    """An error raised while decoding a tagged field from its own slice of the buffer,
    with the offset made relative to the enclosing buffer again."""
    if isinstance(exc, ProtocolError):
        if exc.offset is not None:
            exc.offset += base
        return exc
    return RemoteProtocolError(_decode_reason(exc), offset=base + pos)


def _fail_encode(exc: BaseException, struct_name: str, field_name: str) -> ProtocolError:
    if isinstance(exc, ProtocolError):
        return exc.within(field_name)
    return LocalProtocolError(
        f"cannot encode {struct_name}.{field_name}: {exc}", path=(field_name,)
    )


class _Short(RemoteProtocolError):
    pass


def _short(what: str, pos: int) -> RemoteProtocolError:
    return RemoteProtocolError(f"{what} runs past the end of the frame", offset=pos)


def _null(field: str, pos: int) -> RemoteProtocolError:
    return RemoteProtocolError("null in a non-nullable field", offset=pos)


def _tag_order(tag: int, last: int, pos: int) -> RemoteProtocolError:
    what = "repeated" if tag == last else f"out of order (after tag {last})"
    return RemoteProtocolError(f"tagged field {tag} {what}", offset=pos)


def _bad_length(n: int, pos: int) -> RemoteProtocolError:
    return RemoteProtocolError(f"negative length {n}", offset=pos)


def _not_in_version(name: str, version: int) -> LocalProtocolError:
    return LocalProtocolError(
        f"field {name} has a non-default value but does not exist in version {version}"
        " (and is not ignorable)"
    )


def _encode_null(name: str, version: int) -> LocalProtocolError:
    return LocalProtocolError(f"field {name} is null but not nullable in version {version}")


def _first(item: tuple[int, Any]) -> int:
    return item[0]


class _Src:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.depth = 0
        self.counter = 0

    def __call__(self, line: str) -> None:
        self.lines.append("    " * self.depth + line)

    def tmp(self, prefix: str = "t") -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def indent(self) -> _Indent:
        return _Indent(self)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


class _Indent:
    def __init__(self, src: _Src) -> None:
        self.src = src

    def __enter__(self) -> None:
        self.src.depth += 1

    def __exit__(self, *exc: object) -> None:
        self.src.depth -= 1


@dataclass
class MessageCodec:
    """The compiled functions of one message at one version."""

    message: MessageSpec
    version: int
    # decode(buf) -> (root record, end position, spans of the root's fields)
    decode: Callable[[memoryview], tuple[Any, int, tuple[int, ...]]]
    # encode(out, root record)
    encode: Callable[[bytearray, Any], None]
    # encode_spliced(out, new root, original root, original body view, spans)
    encode_spliced: Callable[[bytearray, Any, Any, memoryview, tuple[int, ...]], None]


class _Compiler:
    def __init__(self, message: MessageSpec, version: int) -> None:
        self.message = message
        self.version = version
        self.flexible = message.is_flexible(version)
        self.consts: list[Any] = []
        self.const_ids: dict[int, int] = {}
        self.structs: dict[str, StructSpec] = {}
        self.src = _Src()

    # -- helpers -------------------------------------------------------------------

    def const(self, value: Any) -> str:
        key = id(value)
        if key not in self.const_ids:
            self.const_ids[key] = len(self.consts)
            self.consts.append(value)
        return f"K[{self.const_ids[key]}]"

    def flexible_for(self, f: FieldSpec) -> bool:
        if f.flexible_override is not None:
            return self.flexible and self.version in f.flexible_override
        return self.flexible

    def collect(self, struct: StructSpec) -> None:
        if struct.name in self.structs:
            return
        self.structs[struct.name] = struct
        for f in struct.fields:
            if f.struct is not None and (self.version in f.versions):
                self.collect(f.struct)

    # -- decoding ------------------------------------------------------------------

    def read_uvarint(self, target: str) -> None:
        s = self.src
        s(f"{target} = buf[pos]")
        s(f"if {target} > 127:")
        s(f"    {target}, pos = _uv(buf, pos)")
        s("else:")
        s("    pos += 1")

    def read_length(self, target: str, flexible: bool, wide: bool) -> None:
        """A length prefix into ``target``; -1 means null."""
        if flexible:
            self.read_uvarint(target)
            self.src(f"{target} -= 1")
        elif wide:
            self.src(f"{target} = _i32(buf, pos)[0]")
            self.src("pos += 4")
        else:
            self.src(f"{target} = _i16(buf, pos)[0]")
            self.src("pos += 2")

    def read_scalar(self, target: str, type_name: str, flexible: bool, nullable: bool, label: str) -> None:
        """One non-struct value (primitive or string/bytes/records) into ``target``."""
        s = self.src
        if type_name in _FIXED:
            code, size = _FIXED[type_name]
            s(f"{target}, = {self.const(struct_cls('>' + code).unpack_from)}(buf, pos)")
            if type_name == "uuid":
                s(f"{target} = _uuid({target})")
            s(f"pos += {size}")
            return
        if type_name not in ("string", "bytes", "records"):
            raise AssertionError(type_name)
        n = s.tmp("n")
        self.read_length(n, flexible, wide=type_name != "string")
        s(f"if {n} < 0:")
        with s.indent():
            if nullable:
                s(f"{target} = None")
            else:  # as Kafka: null only in the versions the spec lists as nullable
                s(f"if {n} != -1: raise _bad_length({n}, pos)")
                s(f"raise _null({label!r}, pos)")
        s("else:")
        with s.indent():
            e = s.tmp("e")
            s(f"{e} = pos + {n}")
            s(f"if {e} > end: raise _short({type_name!r}, pos)")
            if type_name == "string":
                s(f"{target} = str(buf[pos:{e}], 'utf-8')")
            elif type_name == "bytes":
                s(f"{target} = bytes(buf[pos:{e}])")
            else:
                s(f"{target} = buf[pos:{e}]")
            s(f"pos = {e}")

    def read_field(self, target: str, f: FieldSpec, flexible: bool) -> None:
        s = self.src
        nullable = f.nullable_in(self.version)
        if f.is_array:
            n = s.tmp("n")
            self.read_length(n, flexible, wide=True)
            s(f"if {n} < 0:")
            with s.indent():
                if nullable:
                    s(f"{target} = None")
                else:
                    s(f"if {n} != -1: raise _bad_length({n}, pos)")
                    s(f"raise _null({f.name!r}, pos)")
            # Each element takes at least one byte, except structs with no fields in
            # this version; a count beyond the bytes left is a lie, not an allocation.
            s(f"elif {n} > end - pos: raise _short('array of ' + str({n}), pos)")
            s("else:")
            with s.indent():
                if f.struct is not None:
                    lst, i = s.tmp("l"), s.tmp("i")
                    s(f"{lst} = []")
                    s(f"for {i} in range({n}):")
                    s(f"    x, pos = d_{f.struct.name}(buf, pos)")
                    s(f"    {lst}.append(x)")
                    s(f"{target} = tuple({lst})")
                elif f.type in _INTS:
                    code, size = _FIXED[f.type]
                    # Short arrays (replicas, ISR...) use a Struct made once per length.
                    arrays = self.const(_int_array_structs(code))
                    s(f"if {n} < {_ARRAY_STRUCTS}: {target} = {arrays}[{n}].unpack_from(buf, pos)")
                    s(f"else: {target} = _st.unpack_from('>%d{code}' % {n}, buf, pos)")
                    s(f"pos += {size} * {n}")
                else:
                    lst, i = s.tmp("l"), s.tmp("i")
                    s(f"{lst} = []")
                    s(f"for {i} in range({n}):")
                    with s.indent():
                        self.read_scalar("x", f.type, flexible, False, f.name)
                        s(f"{lst}.append(x)")
                    s(f"{target} = tuple({lst})")
        elif f.struct is not None:
            if nullable:
                s("if buf[pos] > 127:")
                s(f"    {target} = None")
                s("    pos += 1")
                s("else:")
                s(f"    {target}, pos = d_{f.struct.name}(buf, pos + 1)")
            else:
                s(f"{target}, pos = d_{f.struct.name}(buf, pos)")
        else:
            self.read_scalar(target, f.type, flexible, nullable, f.name)

    def gen_decoder(self, struct: StructSpec, is_root: bool) -> None:
        s = self.src
        v = self.version
        fields = struct.fields
        names = [f.name for f in fields] + ["_tagged_fields"]
        s(f"def d_{struct.name}(buf, pos, {_LOCALS}):")
        with s.indent():
            s("end = len(buf)")
            s("f = 0")
            # Values of fields absent from this version: their defaults.
            for idx, f in enumerate(fields):
                if v not in f.versions or f.tagged_in(v):
                    s(f"v{idx} = {self.const(f.default)}")
            s("unk = ()")
            s("try:")
            with s.indent():
                s("pass")
                regular = [(i, f) for i, f in enumerate(fields) if v in f.versions and not f.tagged_in(v)]
                spans: list[str] = []
                k = 0
                while k < len(regular):
                    idx, f = regular[k]
                    s(f"f = {idx}")
                    if is_root:
                        spans.append(f"s{idx}")
                        s(f"s{idx} = pos")
                    if not f.is_array and f.struct is None and f.type in _FIXED:
                        # Merge a run of fixed-size fields into one unpack.
                        run = [(idx, f)]
                        while (
                            k + len(run) < len(regular)
                            and not regular[k + len(run)][1].is_array
                            and regular[k + len(run)][1].struct is None
                            and regular[k + len(run)][1].type in _FIXED
                        ):
                            run.append(regular[k + len(run)])
                        fmt = ">" + "".join(_FIXED[g.type][0] for _, g in run)
                        size = sum(_FIXED[g.type][1] for _, g in run)
                        targets = ", ".join(f"v{i}" for i, _ in run)
                        if is_root:  # each field of the run still gets its span
                            offset = 0
                            for (i, _), (_, prev) in zip(run[1:], run, strict=False):
                                offset += _FIXED[prev.type][1]
                                spans.append(f"s{i}")
                                s(f"s{i} = pos + {offset}")
                        s(f"{targets}, = {self.const(struct_cls(fmt).unpack_from)}(buf, pos)")
                        s(f"pos += {size}")
                        for i, g in run:
                            if g.type == "uuid":
                                s(f"v{i} = _uuid(v{i})")
                        k += len(run)
                        continue
                    self.read_field(f"v{idx}", f, self.flexible_for(f))
                    k += 1
                if self.flexible:
                    s(f"f = {len(fields)}")
                    if is_root:
                        spans.append("st")
                        s("st = pos")
                    self.read_tagged(struct)
            s("except Exception as exc:")
            s(f"    raise _fail_decode(exc, {struct.name!r}, {self.const(tuple(names))}[f], pos) from None")
            values = ", ".join(f"v{i}" for i in range(len(fields)))
            record = f"_tnew({self.const(struct.cls)}, ({values}{', ' if values else ''}unk,))"
            if is_root:
                span_list = ", ".join([*spans, "pos"])
                s(f"return {record}, pos, ({span_list},)")
            else:
                s(f"return {record}, pos")

    def read_tagged(self, struct: StructSpec) -> None:
        s = self.src
        v = self.version
        tagged = [(i, f) for i, f in enumerate(struct.fields) if f.tagged_in(v)]
        self.read_uvarint("nt")
        s("if nt:")
        with s.indent():
            s("ul = []")
            s("lt = -1")
            s("for _ in range(nt):")
            with s.indent():
                self.read_uvarint("tag")
                # Tags are written sorted and unique (RawTaggedFieldWriter): anything else
                # could not be written back, so it is refused here rather than on encode.
                s("if tag <= lt: raise _tag_order(tag, lt, pos)")
                s("lt = tag")
                self.read_uvarint("sz")
                s("te = pos + sz")
                s("if te > end: raise _short('tagged field', pos)")
                first = True
                for idx, f in tagged:
                    s(f"{'if' if first else 'elif'} tag == {f.tag}:")
                    first = False
                    with s.indent():
                        # Decode the value from exactly its own bytes; errors inside get
                        # their offsets rebased onto the enclosing buffer.
                        s(f"f = {idx}")
                        s("outer, outer_end, outer_pos = buf, end, pos")
                        s("buf, end, pos = buf[pos:te], sz, 0")
                        s("try:")
                        with s.indent():
                            self.read_field(f"v{idx}", f, True)
                        s("except Exception as exc:")
                        s("    raise _rebase(exc, outer_pos, pos) from None")
                        s("if pos != sz: raise RemoteProtocolError("
                          "f'tagged field size {sz} but its value took {pos} bytes', offset=outer_pos)")
                        s("buf, end, pos = outer, outer_end, te")
                        s(f"f = {len(struct.fields)}")
                s(f"{'if' if first else 'elif'} True:" if first else "else:")
                s("    ul.append((tag, bytes(buf[pos:te])))")
                s("    pos = te")
            s("unk = tuple(ul)")

    # -- encoding ------------------------------------------------------------------

    def write_uvarint(self, out: str, value: str) -> None:
        s = self.src
        s(f"if {value} < 128: {out}.append({value})")
        s(f"else: {out} += _uvb({value})")

    def write_length(self, out: str, value: str, flexible: bool, wide: bool) -> None:
        """Write a length; ``value`` may be the expression -1 for null."""
        s = self.src
        if flexible:
            t = s.tmp("c")
            s(f"{t} = {value} + 1")
            self.write_uvarint(out, t)
        elif wide:
            s(f"{out} += _p32({value})")
        else:
            s(f"{out} += _p16({value})")

    def write_scalar(self, out: str, value: str, type_name: str, flexible: bool, nullable: bool, label: str) -> None:
        s = self.src
        if type_name in _FIXED:
            if type_name == "uuid":
                s(f"{out} += {value}.bytes")
            else:
                s(f"{out} += {self.const(struct_cls('>' + _FIXED[type_name][0]).pack)}({value})")
            return
        s(f"if {value} is None:")
        with s.indent():
            if nullable:
                self.write_length(out, "-1", flexible, wide=type_name != "string")
            else:
                s(f"raise _encode_null({label!r}, {self.version})")
        s("else:")
        with s.indent():
            if type_name == "string":
                b = s.tmp("b")
                s(f"{b} = {value}.encode()")
            else:
                b = value
            self.write_length(out, f"len({b})", flexible, wide=type_name != "string")
            if type_name == "records":
                # Large record sets are referenced, not copied: joined once at the end.
                s(f"if len({b}) >= {_HOLE_MIN} and type({out}) is _Out: "
                  f"{out}.holes.append((len({out}), {b}))")
                s(f"else: {out} += {b}")
            else:
                s(f"{out} += {b}")

    def write_field(self, out: str, value: str, f: FieldSpec, flexible: bool) -> None:
        s = self.src
        nullable = f.nullable_in(self.version)
        if f.is_array:
            s(f"if {value} is None:")
            with s.indent():
                if nullable:
                    self.write_length(out, "-1", flexible, wide=True)
                else:
                    s(f"raise _encode_null({f.name!r}, {self.version})")
            s("else:")
            with s.indent():
                self.write_length(out, f"len({value})", flexible, wide=True)
                if f.struct is not None:
                    s(f"for x in {value}:")
                    s(f"    e_{f.struct.name}({out}, x)")
                elif f.type in _INTS:
                    arrays = self.const(_int_array_structs(_FIXED[f.type][0]))
                    s(f"if len({value}) < {_ARRAY_STRUCTS}: {out} += {arrays}[len({value})].pack(*{value})")
                    s(f"else: {out} += _st.pack('>%d{_FIXED[f.type][0]}' % len({value}), *{value})")
                else:
                    s(f"for x in {value}:")
                    with s.indent():
                        self.write_scalar(out, "x", f.type, flexible, False, f.name)
        elif f.struct is not None:
            if nullable:
                s(f"if {value} is None: {out}.append(255)")
                s("else:")
                s(f"    {out}.append(1)")
                s(f"    e_{f.struct.name}({out}, {value})")
            else:
                s(f"e_{f.struct.name}({out}, {value})")
        else:
            self.write_scalar(out, value, f.type, flexible, nullable, f.name)

    def gen_encoder(self, struct: StructSpec, splice: bool) -> None:
        s = self.src
        v = self.version
        fields = struct.fields
        names = [f.name for f in fields] + ["_tagged_fields"]
        if splice:
            s(f"def es_{struct.name}(out, r, o, fv, sp, {_LOCALS}):")
        else:
            s(f"def e_{struct.name}(out, r, {_LOCALS}):")
        with s.indent():
            targets = ", ".join(f"v{i}" for i in range(len(fields)))
            s("f = 0")
            s("try:")
            with s.indent():
                s(f"{targets}{', ' if targets else ''}unk, = r")
                for idx, f in enumerate(fields):
                    if v not in f.versions and not f.ignorable:
                        s(f"f = {idx}")
                        s(f"if v{idx} != {self.const(f.default)}: raise _not_in_version({f.name!r}, {v})")
                regular = [(i, f) for i, f in enumerate(fields) if v in f.versions and not f.tagged_in(v)]
                for j, (idx, f) in enumerate(regular):
                    s(f"f = {idx}")
                    if splice:
                        s(f"if v{idx} is o[{idx}]: _copy(out, fv, sp[{j}], sp[{j + 1}])")
                        s("else:")
                        with s.indent():
                            self.write_field("out", f"v{idx}", f, self.flexible_for(f))
                    else:
                        self.write_field("out", f"v{idx}", f, self.flexible_for(f))
                s(f"f = {len(fields)}")
                if self.flexible:
                    tagged = [(i, f) for i, f in enumerate(fields) if f.tagged_in(v)]
                    if splice:
                        same = " and ".join([f"v{i} is o[{i}]" for i, _ in tagged] + [f"unk is o[{len(fields)}]"])
                        s(f"if {same}: out += fv[sp[{len(regular)}]:sp[{len(regular) + 1}]]")
                        s("else:")
                        with s.indent():
                            self.write_tagged(tagged)
                    else:
                        self.write_tagged(tagged)
                else:
                    s(f"if unk: raise LocalProtocolError('tagged fields in a non-flexible version {v}')")
            s("except Exception as exc:")
            s(f"    raise _fail_encode(exc, {struct.name!r}, {self.const(tuple(names))}[f]) from None")

    def write_tagged(self, tagged: list[tuple[int, FieldSpec]]) -> None:
        s = self.src
        if not tagged:
            s("if not unk: out.append(0)")
            s("else: _write_tags(out, list(unk))")
            return
        s("tg = list(unk)")
        for idx, f in tagged:
            s(f"if v{idx} != {self.const(f.default)}:")
            with s.indent():
                s("t = bytearray()")
                self.write_field("t", f"v{idx}", f, True)
                s(f"tg.append(({f.tag}, t))")
        s("if not tg: out.append(0)")
        s("else: _write_tags(out, tg)")

    # -- assembly ------------------------------------------------------------------

    def compile(self) -> MessageCodec:
        root = self.message.root
        self.collect(root)
        for spec in self.structs.values():
            self.gen_decoder(spec, is_root=False)
            self.gen_encoder(spec, splice=False)
        self.gen_decoder(_RootAlias(root), is_root=True)  # type: ignore[arg-type]
        self.gen_encoder(_RootAlias(root), splice=True)  # type: ignore[arg-type]
        namespace: dict[str, Any] = {
            "K": self.consts,
            "_st": struct,
            "_Out": _Out,
            "_copy": _copy,
            "_i16": struct_cls(">h").unpack_from,
            "_i32": struct_cls(">i").unpack_from,
            "_p16": struct_cls(">h").pack,
            "_p32": struct_cls(">i").pack,
            "_uv": read_uvarint,
            "_uvb": uvarint_bytes,
            "_uuid": _uuid_from_bytes,
            "_tnew": tuple.__new__,
            "_short": _short,
            "_null": _null,
            "_bad_length": _bad_length,
            "_fail_decode": _fail_decode,
            "_rebase": _rebase,
            "_tag_order": _tag_order,
            "_fail_encode": _fail_encode,
            "_not_in_version": _not_in_version,
            "_encode_null": _encode_null,
            "_write_tags": _write_tags,
            "RemoteProtocolError": RemoteProtocolError,
            "LocalProtocolError": LocalProtocolError,
        }
        source = self.src.text()
        code = compile(source, f"<gatehouse.codecs {self.message.name} v{self.version}>", "exec")
        exec(code, namespace)
        root_decoder = namespace[f"d_{_ROOT}"]

        def decode(buf: Any) -> Any:
            return root_decoder(buf, 0)

        return MessageCodec(
            message=self.message,
            version=self.version,
            decode=decode,
            encode=namespace[f"e_{root.name}"],
            encode_spliced=namespace[f"es_{_ROOT}"],
        )


_ROOT: Final = "_root"


class _RootAlias:
    """The root struct under another function name, for the span-recording variants."""

    def __init__(self, root: StructSpec) -> None:
        self.name = _ROOT
        self.fields = root.fields
        self.cls = root.cls


def struct_cls(fmt: str) -> struct.Struct:
    return _STRUCTS.setdefault(fmt, struct.Struct(fmt))


_STRUCTS: dict[str, struct.Struct] = {}


def _write_tags(out: bytearray, tags: list[tuple[int, Any]]) -> None:
    tags.sort(key=_first)
    out += uvarint_bytes(len(tags))
    last = -1
    for tag, payload in tags:
        if tag == last:
            raise LocalProtocolError(f"tagged field {tag} appears twice")
        last = tag
        out += uvarint_bytes(tag)
        out += uvarint_bytes(len(payload))
        out += payload


_CODECS: dict[tuple[str, int], MessageCodec] = {}


def message_codec(message: MessageSpec, version: int) -> MessageCodec:
    """The compiled codec of ``message`` at ``version`` (compiled on first use)."""
    key = (message.name, version)
    codec = _CODECS.get(key)
    if codec is None:
        codec = _CODECS[key] = _Compiler(message, version).compile()
    return codec


def generated_source(message: MessageSpec, version: int) -> str:
    """The Python source the compiler writes for a message version (for debugging)."""
    compiler = _Compiler(message, version)
    compiler.compile()
    return compiler.src.text()
