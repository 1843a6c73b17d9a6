"""Compile the tables into specialised Python decoders and encoders.

For each (message, version) pair we write the Python source of one decode and one
encode function per struct, with every version test, flexible/non-flexible choice and
type dispatch resolved at compile time, then ``exec`` it once and cache the result.
Runs of fixed-size fields become a single ``struct.unpack_from``.  That is what makes a
pure-Python codec fast: the per-frame work is straight-line code over a memoryview.

Decoders go further: the elements of struct arrays are decoded inline, in the array's
loop; arrays of flat structs (numbers and number arrays: Metadata's partitions) whose
elements share a layout are read by one ``Struct.iter_unpack`` (``_flat``); fixed
fields around an array that is usually empty are read by one unpack.  Each of these
falls back to the plain field-by-field code when the bytes are anything else, and the
tests compare them with it (``fast_paths=False``).

Generated decoders keep the path of the field being read in a local (one store per
field) so that an error names the field path and byte offset.
"""

from __future__ import annotations

import functools
import itertools
import operator
import re
import struct
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from gatehouse.codecs._flat import (
    NUMBERS,
    FlatLayout,
    FlatRecords,
    flat_layout,
    flat_probe,
    flat_shape,
)
from gatehouse.codecs._native import decoder as _c_decoder
from gatehouse.codecs.errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from gatehouse.codecs.primitives import read_uvarint, uvarint_bytes
from gatehouse.codecs.primitives import write_tag_section as _write_tags
from gatehouse.codecs.schema import ZERO_UUID, FieldSpec, MessageSpec, StructSpec

_FIXED: Final = {**NUMBERS, "uuid": ("16s", 16)}
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
# Arrays of structs nested this deep in one decoder function are decoded inline.
_INLINE_DEPTH: Final = 3
# Module-level names the generated functions use most, bound as default arguments so a
# use is a local load rather than a global lookup (the codec's inner loops).
_LOCALS: Final = ("K=K, _tnew=_tnew, _uv=_uv, _i16=_i16, _i32=_i32, _p16=_p16, _p32=_p32, "
                  "_uvb=_uvb, _pb2=_pb2, _pb3=_pb3, _Out=_Out")


@functools.cache
def _int_array_structs(code: str) -> tuple[struct.Struct, ...]:
    """Struct objects for arrays of 0.._ARRAY_STRUCTS-1 integers of one type."""
    return tuple(struct.Struct(f">{n}{code}") for n in range(_ARRAY_STRUCTS))


_INTS: Final = frozenset(NUMBERS)
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


def _fail_decode(exc: BaseException, path: tuple[str, ...], pos: int) -> ProtocolError:
    """The error of a generated decoder: ``path`` leads from its struct to the field."""
    if isinstance(exc, ProtocolError):
        exc.path = (*path, *exc.path)
        return exc
    return RemoteProtocolError(_decode_reason(exc), path=path, offset=pos)


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
    # the generated functions by name (d_<struct>, e_<struct>, b_<struct>...), for tests
    functions: dict[str, Any]
    # The same decoder in C (_decoder.c) where built: like ``decode``, or None where the
    # bytes are not a valid message (``decode`` then says why).
    decode_native: Callable[[memoryview], tuple[Any, int, tuple[int, ...]] | None] | None = None

    # The same encoder in C where built: like ``encode``, or NotImplemented (``out`` as it
    # was) for values it leaves to ``encode`` (which writes them, or says what is wrong).
    encode_native: Callable[[bytearray, Any], Any] | None = None

    def write(self, out: bytearray, body: Any) -> None:
        """``encode`` by the C encoder where built and it takes the values, else the
        Python one."""
        if self.encode_native is None or self.encode_native(out, body) is NotImplemented:
            self.encode(out, body)

    def read(self, buf: memoryview) -> tuple[Any, int, tuple[int, ...]]:
        """``decode`` by the C decoder where built; where it refuses the bytes, the Python
        one reads them again and raises the error with its field path and offset."""
        decoded = None if self.decode_native is None else self.decode_native(buf)
        return self.decode(buf) if decoded is None else decoded


class _Compiler:
    def __init__(self, message: MessageSpec, version: int, *, fast_paths: bool = True) -> None:
        self.message = message
        self.version = version
        # Bulk flat arrays and speculative unpacks; off, the plain field-by-field decoder
        # that the tests compare them against.
        self.fast_paths = fast_paths
        self.speculated = 0  # speculative unpacks written (see speculate_empty_array)
        self.flexible = message.is_flexible(version)
        self.consts: list[Any] = []
        self.const_ids: dict[int, int] = {}
        self.structs: dict[str, StructSpec] = {}
        self.flat: dict[str, FlatLayout] = {}  # structs decoded in bulk in arrays
        self.flat_kinds: dict[str, tuple[Any, FlatLayout]] = {}
        self.src = _Src()

    # -- helpers -------------------------------------------------------------------

    def flat_kind(self, struct: StructSpec) -> str:
        """The constant ``(record class, layout)`` that marks this struct's FlatRecords."""
        kind = self.flat_kinds.get(struct.name)
        if kind is None:
            kind = self.flat_kinds[struct.name] = (struct.cls, self.flat[struct.name])
        return self.const(kind)

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

    def collect(self, struct: StructSpec, in_array: bool = False) -> None:
        if in_array and self.fast_paths and struct.name not in self.flat:
            layout = flat_layout(struct.fields, self.version, self.flexible_for, self.flexible)
            if layout is not None:
                self.flat[struct.name] = layout
        if struct.name in self.structs:
            return
        self.structs[struct.name] = struct
        for f in struct.fields:
            if f.struct is not None and (self.version in f.versions):
                self.collect(f.struct, f.is_array)

    # -- decoding ------------------------------------------------------------------
    #
    # A struct is decoded by straight-line code in the function of the struct that holds
    # it: the elements of an array of structs are decoded inside the array's loop (down
    # to _INLINE_DEPTH levels), which saves a call, a result tuple and the set-up of a
    # frame per element.  Locals of an inlined struct carry its depth (v1_3, u1...).
    # ``f`` holds the spec names from the function's struct down to the field being
    # read (a constant tuple: one store per field), which an error reports as its path.

    def read_uvarint(self, target: str, inline: int = 1) -> None:
        """An unsigned varint into ``target``; its first ``inline`` bytes are read here."""
        s = self.src
        s(f"{target} = buf[pos]")
        s(f"if {target} < 128: pos += 1")
        if inline >= 2:
            b1 = s.tmp("b")
            s(f"elif ({b1} := buf[pos + 1]) < 128:")
            s(f"    {target} = ({target} & 127) | ({b1} << 7)")
            s("    pos += 2")
            if inline >= 3:  # record sets of 16 KiB..2 MiB: a 3-byte length
                b2 = s.tmp("b")
                s(f"elif ({b2} := buf[pos + 2]) < 128:")
                s(f"    {target} = ({target} & 127) | (({b1} & 127) << 7) | ({b2} << 14)")
                s("    pos += 3")
        s(f"else: {target}, pos = _uv(buf, pos)")

    def read_prefetched_uvarint(self, target: str, first: str, inline: int) -> None:
        """A varint whose first bytes a speculative unpack may have read into the locals
        ``first``, ``first_1``, ``first_2`` (``first`` is -1 where it did not)."""
        s = self.src
        b = [first, f"{first}_1", f"{first}_2"]
        s(f"if {first} < 0:")
        with s.indent():
            self.read_uvarint(target, inline)
        s(f"elif {first} < 128:")
        s(f"    {target} = {first}")
        s("    pos += 1")
        s(f"elif {b[1]} < 128:")
        s(f"    {target} = ({first} & 127) | ({b[1]} << 7)")
        s("    pos += 2")
        s(f"elif {b[2]} < 128:")
        s(f"    {target} = ({first} & 127) | (({b[1]} & 127) << 7) | ({b[2]} << 14)")
        s("    pos += 3")
        s(f"else: {target}, pos = _uv(buf, pos)")

    def _compact_sized(self, f: FieldSpec) -> bool:
        """A string, bytes or records field with a varint length (not an array)."""
        return (not f.is_array and f.struct is None and f.type in ("string", "bytes", "records")
                and self.flexible_for(f))

    def read_length(self, target: str, flexible: bool, wide: bool, inline: int = 2) -> None:
        """A length prefix into ``target``; -1 means null."""
        if flexible:
            self.read_uvarint(target, inline)
            self.src(f"{target} -= 1")
        elif wide:
            self.src(f"{target} = _i32(buf, pos)[0]")
            self.src("pos += 4")
        else:
            self.src(f"{target} = _i16(buf, pos)[0]")
            self.src("pos += 2")

    def read_scalar(self, target: str, type_name: str, flexible: bool, nullable: bool, label: str,
                    prefetched: str | None = None) -> None:
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
        inline = 2 if type_name == "string" else 3
        if prefetched is not None:
            assert flexible
            self.read_prefetched_uvarint(n, prefetched, inline)
            s(f"{n} -= 1")
        else:
            self.read_length(n, flexible, wide=type_name != "string", inline=inline)
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

    def read_field(self, target: str, f: FieldSpec, flexible: bool, depth: int,
                   path: tuple[str, ...], prefetched: str | None = None) -> None:
        """The value of field ``f`` into ``target``; ``f`` (the local) already names it.

        ``prefetched``: see ``speculate_empty_array`` (strings, bytes and records only)."""
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
            s(f"elif not {n}: {target} = ()")  # common (aborted transactions, offline replicas)
            if f.struct is not None and f.struct.name in self.flat:
                # Several elements of one layout: built at C speed (see gen_flat_decoder).
                bt = s.tmp("bt")
                s(f"elif {n} > 2 and ({bt} := b_{f.struct.name}(buf, pos, {n})) is not None:")
                s(f"    {target}, pos = {bt}")
            s("else:")
            with s.indent():
                if f.struct is not None:
                    lst, i = s.tmp("l"), s.tmp("i")
                    s(f"{lst} = []")
                    s(f"for {i} in range({n}):")
                    with s.indent():
                        x = f"x{depth + 1}"
                        if depth < _INLINE_DEPTH:
                            self.decode_struct(f.struct, x, depth + 1, (*path, f.name))
                        else:
                            s(f"{x}, pos = d_{f.struct.name}(buf, pos)")
                        s(f"{lst}.append({x})")
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
                        x = s.tmp("x")
                        self.read_scalar(x, f.type, flexible, False, f.name)
                        s(f"{lst}.append({x})")
                    s(f"{target} = tuple({lst})")
        elif f.struct is not None:
            if nullable:
                s("if buf[pos] > 127:")
                s(f"    {target} = None")
                s("    pos += 1")
                s("else:")
                s(f"    {target}, pos = d_{f.struct.name}(buf, pos + 1)")
            elif depth < _INLINE_DEPTH:
                self.decode_struct(f.struct, target, depth + 1, (*path, f.name))
            else:
                s(f"{target}, pos = d_{f.struct.name}(buf, pos)")
        else:
            self.read_scalar(target, f.type, flexible, nullable, f.name, prefetched)

    def decode_struct(
        self, struct: StructSpec, target: str, depth: int, path: tuple[str, ...],
        spans: list[str] | None = None,
    ) -> None:
        """Code that decodes ``struct`` at ``pos`` into the local ``target``.

        ``spans`` (the root only) collects the names of the locals holding the start of
        each top-level field, for splicing on re-encode.
        """
        s = self.src
        v = self.version
        fields = struct.fields
        value = [f"v{depth}_{idx}" for idx in range(len(fields))]
        unk = f"u{depth}"
        # Fields absent from this version, and tagged fields not sent (the usual case):
        # their defaults go straight into the record.
        absent = {idx: self.const(f.default) for idx, f in enumerate(fields) if v not in f.versions}
        unsent = {idx: self.const(f.default) for idx, f in enumerate(fields) if f.tagged_in(v)}
        regular = [(i, f) for i, f in enumerate(fields) if v in f.versions and not f.tagged_in(v)]
        k = 0
        prefetched: str | None = None  # the next field's length bytes, read by a speculation
        while k < len(regular):
            idx, f = regular[k]
            s(f"f = {(*path, f.name)!r}")
            run = _fixed_run(regular, k)
            after = k + len(run)
            if (run and spans is None and self.fast_paths and after < len(regular)
                    and regular[after][1].is_array):
                run2 = _fixed_run(regular, after + 1)
                if run2:
                    k = after + 1 + len(run2)
                    following = regular[k][1] if k < len(regular) else None
                    prefetched = self.speculate_empty_array(
                        run, regular[after], run2, value, depth, path,
                        prefetch=following is not None and self._compact_sized(following))
                    continue
            if spans is not None:
                spans.append(f"s{idx}")
                s(f"s{idx} = pos")
            if run:
                self.read_fixed_run(run, value, spans)
                k = after
                continue
            self.read_field(value[idx], f, self.flexible_for(f), depth, path, prefetched)
            prefetched = None
            k += 1
        cls = self.const(struct.cls)
        plain = "".join(f"{absent.get(idx, unsent.get(idx, name))}, " for idx, name in enumerate(value))
        if not self.flexible:
            s(f"{target} = _tnew({cls}, ({plain}(),))")
            return
        s(f"f = {(*path, '_tagged_fields')!r}")
        if spans is not None:
            spans.append("st")
            s("st = pos")
        s("if not buf[pos]:")  # no tagged fields: the usual case
        s("    pos += 1")
        s(f"    {target} = _tnew({cls}, ({plain}(),))")
        s("else:")
        with s.indent():
            for idx, default in unsent.items():
                s(f"{value[idx]} = {default}")
            s(f"{unk} = ()")
            self.read_tagged(struct, value, unk, depth, path)
            tagged = "".join(f"{absent.get(idx, name)}, " for idx, name in enumerate(value))
            s(f"{target} = _tnew({cls}, ({tagged}{unk},))")

    def read_fixed_run(self, run: list[tuple[int, FieldSpec]], value: list[str],
                       spans: list[str] | None) -> None:
        """A run of fixed-size fields: one unpack (``f`` names the first)."""
        s = self.src
        fmt = ">" + "".join(_FIXED[g.type][0] for _, g in run)
        size = sum(_FIXED[g.type][1] for _, g in run)
        if spans is not None:  # each field of the run still gets its span
            offset = 0
            for (i, _), (_, prev) in zip(run[1:], run, strict=False):
                offset += _FIXED[prev.type][1]
                spans.append(f"s{i}")
                s(f"s{i} = pos + {offset}")
        s(f"{', '.join(value[i] for i, _ in run)}, = {self.const(struct_cls(fmt).unpack_from)}(buf, pos)")
        s(f"pos += {size}")
        self.convert_uuids(run, value)

    def convert_uuids(self, run: list[tuple[int, FieldSpec]], value: list[str]) -> None:
        """The unpacked 16 bytes of each UUID field of ``run`` become a ``uuid.UUID``."""
        for i, g in run:
            if g.type == "uuid":
                self.src(f"{value[i]} = _uuid({value[i]})")

    def speculate_empty_array(
        self, run: list[tuple[int, FieldSpec]], array: tuple[int, FieldSpec],
        run2: list[tuple[int, FieldSpec]], value: list[str], depth: int, path: tuple[str, ...],
        prefetch: bool = False,
    ) -> str | None:
        """Fixed fields, an array, fixed fields: one unpack if the array is empty or null.

        Fetch's partitions (offsets, then aborted transactions, then the preferred read
        replica) are the case: that array is nearly always empty.  The unpack reads the
        array's length and the fields after it too; for any other length they are read
        again after the array (the first fields are kept).  With too few bytes left, all
        are read field by field, so that errors still name the field they are in.

        With ``prefetch`` (the next field is a string, bytes or records with a varint
        length: Fetch's records), the unpack also reads the three bytes after ``run2``
        into locals, and the name of the first is returned: the length of that field is
        then read from locals, not from three one-byte subscripts of the buffer.  They
        are only valid when the array was empty; the first is -1 otherwise.
        """
        s = self.src
        self.speculated += 1
        idx, f = array
        compact = self.flexible_for(f)
        code, empty, null = ("B", 1, 0) if compact else ("i", 0, -1)
        both = [*run, (-1, f), *run2]
        fmt = ">" + "".join(code if i < 0 else _FIXED[g.type][0] for i, g in both)
        size = sum(_FIXED[g.type][1] for _, g in [*run, *run2]) + (1 if compact else 4)
        size1 = sum(_FIXED[g.type][1] for _, g in run)
        length = s.tmp("n")
        targets = ", ".join(length if i < 0 else value[i] for i, _ in both)
        ahead = s.tmp("c") if prefetch else None
        if ahead is not None:
            fmt += "BBB"
            targets += f", {ahead}, {ahead}_1, {ahead}_2"
        s(f"if pos + {size + (3 if ahead else 0)} <= end:")
        with s.indent():
            s(f"{targets}, = {self.const(struct_cls(fmt).unpack_from)}(buf, pos)")
            s(f"pos += {size1}")
            self.convert_uuids(run, value)
        s("else:")
        with s.indent():
            self.read_fixed_run(run, value, None)
            s(f"{length} = None")
            if ahead is not None:
                s(f"{ahead} = -1")
        cases = [(empty, "()")]
        if f.nullable_in(self.version):
            cases.append((null, "None"))
        for case, (count, empty_value) in enumerate(cases):
            s(f"{'elif' if case else 'if'} {length} == {count}:")
            with s.indent():
                s(f"{value[idx]} = {empty_value}")
                s(f"pos += {size - size1}")
                self.convert_uuids(run2, value)
        s("else:")
        with s.indent():
            s(f"f = {(*path, f.name)!r}")
            self.read_field(value[idx], f, compact, depth, path)
            s(f"f = {(*path, run2[0][1].name)!r}")
            self.read_fixed_run(run2, value, None)
            if ahead is not None:
                s(f"{ahead} = -1")
        return ahead

    def gen_decoder(self, struct: StructSpec, is_root: bool) -> None:
        s = self.src
        start = len(s.lines)
        s(f"def d_{struct.name}(buf, pos, {_LOCALS}):")
        with s.indent():
            s("end = len(buf)")
            s("f = ()")
            s("try:")
            with s.indent():
                spans: list[str] | None = [] if is_root else None
                self.decode_struct(struct, "r", 0, (), spans)
            s("except Exception as exc:")
            s("    raise _fail_decode(exc, f, pos) from None")
            if spans is not None:
                s(f"return r, pos, ({', '.join([*spans, 'pos'])},)")
            else:
                s("return r, pos")
        _bind_consts(s.lines, start)

    def read_tagged(self, struct: StructSpec, value: list[str], unk: str, depth: int, path: tuple[str, ...]) -> None:
        s = self.src
        v = self.version
        tagged = [(i, f) for i, f in enumerate(struct.fields) if f.tagged_in(v)]
        nt = f"nt{depth}"
        # buf[pos] is not 0 (decode_struct took that case): a count of tagged fields.
        self.read_uvarint(nt)
        s(f"if {nt}:")
        with s.indent():
            self.read_tags(tagged, value, unk, depth, path)

    def read_tags(self, tagged: list[tuple[int, FieldSpec]], value: list[str], unk: str,
                  depth: int, path: tuple[str, ...]) -> None:
        """The ``nt{depth}`` tagged fields of a struct: known ones decoded, others kept."""
        s = self.src
        nt, ul, lt, tag, sz, te = (f"{name}{depth}" for name in ("nt", "ul", "lt", "tag", "sz", "te"))
        s(f"{ul} = []")
        s(f"{lt} = -1")
        s(f"for _ in range({nt}):")
        with s.indent():
            self.read_uvarint(tag)
            # Tags are written sorted and unique (RawTaggedFieldWriter): anything else
            # could not be written back, so it is refused here rather than on encode.
            s(f"if {tag} <= {lt}: raise _tag_order({tag}, {lt}, pos)")
            s(f"{lt} = {tag}")
            self.read_uvarint(sz)
            s(f"{te} = pos + {sz}")
            s(f"if {te} > end: raise _short('tagged field', pos)")
            first = True
            for idx, f in tagged:
                s(f"{'if' if first else 'elif'} {tag} == {f.tag}:")
                first = False
                with s.indent():
                    # Decode the value from exactly its own bytes; errors inside get
                    # their offsets rebased onto the enclosing buffer.
                    ob, oe, op = f"ob{depth}", f"oe{depth}", f"op{depth}"
                    s(f"f = {(*path, f.name)!r}")
                    s(f"{ob}, {oe}, {op} = buf, end, pos")
                    s(f"buf, end, pos = buf[pos:{te}], {sz}, 0")
                    s("try:")
                    with s.indent():
                        self.read_field(value[idx], f, True, depth, path)
                    s("except Exception as exc:")
                    s(f"    raise _rebase(exc, {op}, pos) from None")
                    s(f"if pos != {sz}: raise RemoteProtocolError("
                      f"f'tagged field size {{{sz}}} but its value took {{pos}} bytes', offset={op})")
                    s(f"buf, end, pos = {ob}, {oe}, {te}")
                    s(f"f = {(*path, '_tagged_fields')!r}")
            s(f"{'if' if first else 'elif'} True:" if first else "else:")
            s(f"    {ul}.append(({tag}, bytes(buf[pos:{te}])))")
            s(f"    pos = {te}")
        s(f"{unk} = tuple({ul})")

    def gen_flat_decoder(self, struct: StructSpec) -> None:
        """``b_<name>(buf, pos, n)``: ``n`` elements of a flat struct in one go, or None.

        A flat struct (see ``_flat.flat_layout``) whose ``n`` elements all have the layout of
        the first (same array lengths, no tagged fields) is a run of ``n`` equal-sized
        records: one ``Struct.iter_unpack`` reads them and ``map`` builds the records,
        all in C.  The first element's array lengths are read here; the rest are checked
        by reading the length bytes of every element with one Struct made for that
        count (``_flat.flat_probe``; a strided slice per checked byte for long arrays).  Anything else (null arrays, long varints, tags, a short buffer) returns
        None and the caller decodes element by element.
        """
        s = self.src
        layout = self.flat[struct.name]
        s(f"def b_{struct.name}(buf, pos, n, K=K, _lazy=_lazy, _flat_shape=_flat_shape, "
          "_flat_probe=_flat_probe):")
        with s.indent():
            s("try:")
            with s.indent():
                s("p = pos")
                counts: list[str] = []
                fixed = 0
                for item in layout.items:
                    if item.kind == "number":
                        fixed += item.size
                    elif item.kind == "array":
                        c = f"c{len(counts)}"
                        counts.append(c)
                        if fixed:
                            s(f"p += {fixed}")
                            fixed = 0
                        if item.prefix == "B":  # compact: count + 1 in one byte
                            s(f"{c} = buf[p] - 1")
                            s(f"if not 0 <= {c} < 127: return None")
                            s(f"p += 1 + {item.size} * {c}")
                        else:
                            s(f"{c} = _i32(buf, p)[0]")
                            s(f"if {c} < 0: return None")
                            s(f"p += 4 + {item.size} * {c}")
                if fixed:
                    s(f"p += {fixed}")
                if layout.tagged:
                    s("if buf[p]: return None")
                else:
                    s("if p > len(buf): return None")
            s("except (IndexError, _st.error):")
            s("    return None")
            key = f"({', '.join(counts)},)" if counts else "()"
            cache = self.const({})
            s(f"shape = {cache}.get({key})")
            s("if shape is None:")
            s(f"    shape = _flat_shape({self.const(layout)}, {key}, {cache})")
            s("    if shape is None: return None")
            s("unpack, size, checks, pick, consts = shape")
            s("e = pos + n * size")
            s("if e > len(buf): return None")
            s("probe = checks.get(n) or _flat_probe(checks, n)")
            s("if probe is not None:")
            s("    if probe[0](buf, pos) != probe[1]: return None")
            s("else:")
            s("    for offset, byte in checks.wanted:")
            s("        if buf[pos + offset:e:size] != byte * n: return None")
            # Checked: the records are built when first read (see _flat.FlatRecords).
            s(f"return _lazy(buf[pos:e], n, shape, {self.flat_kind(struct)}), e")

    # -- encoding ------------------------------------------------------------------

    def write_uvarint(self, out: str, value: str, inline: int = 1) -> None:
        """An unsigned varint; values of up to ``inline`` bytes are written here."""
        s = self.src
        s(f"if {value} < 128: {out}.append({value})")
        if inline >= 2:
            s(f"elif {value} < 16384: {out} += _pb2({value} & 127 | 128, {value} >> 7)")
        if inline >= 3:  # record sets of 16 KiB..2 MiB
            s(f"elif {value} < 2097152: "
              f"{out} += _pb3({value} & 127 | 128, {value} >> 7 & 127 | 128, {value} >> 14)")
        s(f"else: {out} += _uvb({value})")

    def write_length(self, out: str, value: str, flexible: bool, wide: bool, inline: int = 2) -> None:
        """Write a length; ``value`` may be the expression -1 for null."""
        s = self.src
        if flexible:
            if value == "-1":
                s(f"{out}.append(0)")
                return
            t = s.tmp("c")
            s(f"{t} = {value} + 1")
            self.write_uvarint(out, t, inline)
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
            self.write_length(out, f"len({b})", flexible, wide=type_name != "string",
                              inline=2 if type_name == "string" else 3)
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
                if f.struct is not None and f.struct.name in self.flat:
                    # Undecoded elements of this struct and version: their bytes as they came.
                    kind = self.flat_kind(f.struct)
                    s(f"if type({value}) is _lazy and {value}.kind is {kind}: {out} += {value}.raw")
                    s("else:")
                    s(f"    for x in {value}:")
                    s(f"        e_{f.struct.name}({out}, x)")
                elif f.struct is not None:
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
                j = 0
                while j < len(regular):
                    idx, f = regular[j]
                    s(f"f = {idx}")
                    run = [] if splice else _fixed_run(regular, j, NUMBERS)
                    if len(run) > 1:
                        self.write_number_run(run)
                        j += len(run)
                        continue
                    j += 1
                    if splice:
                        s(f"if v{idx} is o[{idx}]: _copy(out, fv, sp[{j - 1}], sp[{j}])")
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

    def write_number_run(self, run: list[tuple[int, FieldSpec]]) -> None:
        """Consecutive number fields: one pack (``f`` names the first).  A value the
        pack refuses is found again field by field, so the error names its field."""
        s = self.src
        fmt = ">" + "".join(NUMBERS[g.type][0] for _, g in run)
        values = ", ".join(f"v{i}" for i, _ in run)
        singles = tuple(struct_cls(">" + NUMBERS[g.type][0]).pack for _, g in run)
        s("try:")
        s(f"    out += {self.const(struct_cls(fmt).pack)}({values})")
        s("except Exception:")
        s(f"    f = _refused({self.const(singles)}, ({values},), {self.const(tuple(i for i, _ in run))})")
        s("    raise")

    def write_tagged(self, tagged: list[tuple[int, FieldSpec]]) -> None:
        s = self.src
        if not tagged:
            s("if not unk: out.append(0)")
            s("else: _write_tags(out, list(unk))")
            return
        # Nearly always: no tagged field set (the decoder leaves the defaults' own objects).
        same = " and ".join(f"v{idx} is {self.const(f.default)}" for idx, f in tagged)
        s(f"if not unk and {same}: out.append(0)")
        s("else:")
        with s.indent():
            self.write_tags_slow(tagged)

    def write_tags_slow(self, tagged: list[tuple[int, FieldSpec]]) -> None:
        s = self.src
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
            if spec.name in self.flat:
                self.gen_flat_decoder(spec)
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
            "_pb2": struct_cls(">BB").pack,
            "_pb3": struct_cls(">BBB").pack,
            "_uuid": _uuid_from_bytes,
            "_tnew": tuple.__new__,
            "_repeat": itertools.repeat,
            "_add": operator.add,
            "_flat_shape": flat_shape,
            "_flat_probe": flat_probe,
            "_lazy": FlatRecords,
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
            "_refused": _refused,
            "RemoteProtocolError": RemoteProtocolError,
            "LocalProtocolError": LocalProtocolError,
        }
        source = self.src.text()
        code = compile(source, f"<gatehouse.codecs {self.message.name} v{self.version}>", "exec")
        exec(code, namespace)
        root_decoder = namespace[f"d_{_ROOT}"]
        # The same in C, from a program per struct made of the same tables.
        decode_native: Callable[[memoryview], Any] | None = None
        encode_native: Callable[[bytearray, Any], Any] | None = None
        if _c_decoder is not None and self.fast_paths:
            program = self.native_program(root, {})
            decode_native = functools.partial(_c_decoder.decode, program)
            encode_native = functools.partial(_c_decoder.encode, program)

        def decode(buf: Any) -> Any:
            return root_decoder(buf, 0)

        return MessageCodec(
            message=self.message,
            version=self.version,
            decode=decode,
            encode=namespace[f"e_{root.name}"],
            encode_spliced=namespace[f"es_{_ROOT}"],
            functions=namespace,
            decode_native=decode_native,
            encode_native=encode_native,
        )

    # -- the C decoder's and encoder's programs (_decoder.c) ---------------------------

    def native_program(self, struct: StructSpec, made: dict[str, Any]) -> Any:
        """The program of ``struct`` in this version (see _decoder.c: make_program)."""
        assert _c_decoder is not None
        program = made.get(struct.name)
        if program is not None:
            return program
        v = self.version
        ops: list[tuple[Any, ...]] = []
        tags: list[tuple[Any, ...]] = []
        for slot, f in enumerate(struct.fields):
            if v not in f.versions:
                continue
            if f.tagged_in(v):  # a tagged value is read as in a flexible version
                tags.append((*self.native_op(slot, f, True, made), f.tag))
            else:
                ops.append(self.native_op(slot, f, self.flexible_for(f), made))
        # Fields absent from the version that an encoder refuses to drop unless default.
        absent = tuple(slot for slot, f in enumerate(struct.fields)
                       if v not in f.versions and not f.ignorable)
        program = made[struct.name] = _c_decoder.program(
            struct.cls, tuple(f.default for f in struct.fields), self.flexible, tuple(ops), tuple(tags),
            absent)
        return program

    def native_op(self, slot: int, f: FieldSpec, compact: bool, made: dict[str, Any]) -> tuple[Any, ...]:
        """(slot, kind, nullable, compact, element kind, code or program, bulk kind)."""
        if f.struct is not None:
            kind, arg = _NATIVE_STRUCT, self.native_program(f.struct, made)
        elif f.type == "uuid":
            kind, arg = _NATIVE_KINDS["uuid"], None
        elif f.type in _INTS:
            kind, arg = _NATIVE_KINDS["number"], _FIXED[f.type][0]
        else:
            kind, arg = _NATIVE_KINDS[f.type], None
        nullable = f.nullable_in(self.version)
        if not f.is_array:
            return (slot, kind, nullable, compact, 0, arg, None)
        flat = None
        if f.struct is not None and f.struct.name in self.flat:
            self.flat_kind(f.struct)
            flat = self.flat_kinds[f.struct.name]
        return (slot, _NATIVE_ARRAY, nullable, compact, kind, arg, flat)


# The kinds of _decoder.c's ops.
_NATIVE_KINDS: Final = {"number": 0, "uuid": 1, "string": 2, "bytes": 3, "records": 4}
_NATIVE_ARRAY: Final = 5
_NATIVE_STRUCT: Final = 6
if _c_decoder is not None:
    _c_decoder.configure(uuid.UUID, _SAFE_UNKNOWN, ZERO_UUID, FlatRecords, _Out)


_CONST_REF: Final = re.compile(r"\bK\[(\d+)\]")


def _bind_consts(lines: list[str], start: int) -> None:
    """Bind the constants the function at ``lines[start]`` uses as default arguments:
    ``K[12]`` becomes the local ``k12``, one load instead of three (a load, a constant, a
    subscript) in the loops that build records and unpack numbers."""
    used: dict[str, None] = {}  # in order of first use

    def local(match: re.Match[str]) -> str:
        name = f"k{match.group(1)}"
        used[name] = None
        return name

    for i in range(start + 1, len(lines)):
        lines[i] = _CONST_REF.sub(local, lines[i])
    if used:
        head = lines[start]
        assert head.endswith("):")
        lines[start] = head[:-2] + "".join(f", {name}=K[{name[1:]}]" for name in used) + "):"


def _refused(packs: tuple[Callable[[Any], bytes], ...], values: tuple[Any, ...],
             fields: tuple[int, ...]) -> int:
    """The index of the first field of a run whose value its own pack refuses."""
    for pack, value, field in zip(packs, values, fields, strict=True):
        try:
            pack(value)
        except Exception:
            return field
    return fields[0]


def _fixed_run(regular: list[tuple[int, FieldSpec]], k: int,
               types: Mapping[str, Any] = _FIXED) -> list[tuple[int, FieldSpec]]:
    """The fields of ``types`` (fixed-size ones by default) from ``regular[k]`` on
    (none if that one is not)."""
    run = []
    for idx, f in regular[k:]:
        if f.is_array or f.struct is not None or f.type not in types:
            break
        run.append((idx, f))
    return run


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
