"""Arrays of flat structs decoded in bulk: one ``Struct`` per element layout.

A struct is *flat* in a version when each of its fields is a fixed-size number (not a
UUID) or an array of numbers (fields absent from the version, or tagged, take their
defaults): Metadata's partitions (error code, index, leader, epoch, replicas, ISR,
offline replicas) are the case that matters.  The elements of such an array that all
have the same array lengths and no tagged fields have the same size, so one
``Struct.iter_unpack`` over the array reads them all, an ``itemgetter`` cuts each row
into the record's fields (array fields are slices of the row) and
``map(tuple.__new__, ...)`` makes the records, without a Python-level step per element.  The compiled ``b_<struct>`` functions (see
``_compile.gen_flat_decoder``) use this module's shapes; whether an array qualifies is
decided from its bytes, and when it does not, the element-by-element decoder runs.
"""

from __future__ import annotations

import itertools
import operator
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final, overload

from gatehouse.codecs._native import speedups
from gatehouse.codecs.schema import FieldSpec

# The records built in C (_speedups.c), where built: the same records (tests/
# test_codec_flat_records.py), left out of the cyclic collector's lists.
_C_FLAT_RECORDS: Final = None if speedups is None else speedups.flat_records

# Distinct layouts per struct and version (a real cluster has a few: replication
# factors, shrunk ISRs).  Past that, arrays of new layouts are read element by element:
# frames made to have a new layout in every array cannot make us build Structs forever.
MAX_SHAPES: Final = 256

# The number types of the tables: struct format code, size in bytes.
NUMBERS: Final = {
    "bool": ("?", 1),
    "int8": ("b", 1),
    "int16": ("h", 2),
    "uint16": ("H", 2),
    "int32": ("i", 4),
    "uint32": ("I", 4),
    "int64": ("q", 8),
    "float64": ("d", 8),
}


@dataclass(frozen=True)
class FlatItem:
    """One field of a flat struct, in field order."""

    kind: str  # "number", "array" (of numbers) or "default" (absent or tagged: its default)
    default: Any = None
    code: str = ""  # struct format code of the number(s)
    size: int = 0  # bytes of one number
    prefix: str = ""  # arrays: "B" (compact: count + 1 in one byte) or "i" (int32 count)


@dataclass(frozen=True)
class FlatLayout:
    items: tuple[FlatItem, ...]
    tagged: bool  # flexible version: each element ends with its tagged-field count


def flat_layout(fields: Iterable[FieldSpec], version: int, compact: Callable[[FieldSpec], bool],
                flexible: bool) -> FlatLayout | None:
    """The layout of a struct's fields in ``version`` if they are flat, else None.

    ``compact(field)`` says whether an array field has a compact (varint) length.
    """
    items: list[FlatItem] = []
    for f in fields:
        if version not in f.versions or f.tagged_in(version):
            items.append(FlatItem("default", f.default))
            continue
        if f.struct is not None or f.type not in NUMBERS:
            return None
        code, size = NUMBERS[f.type]
        if f.is_array:
            items.append(FlatItem("array", code=code, size=size, prefix="B" if compact(f) else "i"))
        else:
            items.append(FlatItem("number", code=code, size=size))
    if all(item.kind == "default" for item in items):
        return None
    return FlatLayout(tuple(items), flexible)


# Element counts up to this get a Struct that reads the checked bytes of all the elements
# at once (``flat_probe``); at most MAX_PROBES counts per shape keep theirs.  Longer
# arrays are checked with a strided comparison per checked byte.
MAX_PROBE_ELEMENTS: Final = 512
MAX_PROBES: Final = 64

Probe = tuple[Callable[[Any, int], tuple[Any, ...]], tuple[int, ...]]


class FlatChecks(dict[int, Probe]):
    """The bytes every element of a shape must hold, ``wanted``: (offset in the element,
    the byte), for each length prefix and the tagged-field count; and, by element count,
    the probes ``flat_probe`` made (a dict, so the decoder's lookup is one C call)."""

    __slots__ = ("plan", "size", "wanted")

    def __init__(self, wanted: tuple[tuple[int, bytes], ...], size: int,
                 plan: tuple[Any, ...] = ()) -> None:
        super().__init__()
        self.wanted = wanted
        self.size = size
        # For the C builder of the records (speedups.flat_records), field by field:
        # (0, code, size) a number, (1, code, size, prefix bytes, count) an array,
        # (2, value) a constant.
        self.plan = plan


def flat_probe(checks: FlatChecks, n: int) -> Probe | None:
    """For ``n`` elements: a reader of just their checked bytes (``unpack_from(buf,
    pos)``) and the values those must have, kept in ``checks``; None past
    MAX_PROBE_ELEMENTS (the caller compares strided slices instead).  One unpack of
    4n bytes costs about half as much as four strided slice comparisons."""
    if n > MAX_PROBE_ELEMENTS:
        return None
    fmt = []
    last = 0
    for offset, _ in checks.wanted:
        if offset > last:
            fmt.append(f"{offset - last}x")
        fmt.append("B")
        last = offset + 1
    if checks.size > last:
        fmt.append(f"{checks.size - last}x")
    probe: Probe = (struct.Struct(">" + "".join(fmt) * n).unpack_from,
                    tuple(byte[0] for _, byte in checks.wanted) * n)
    if len(checks) < MAX_PROBES:
        checks[n] = probe
    return probe


# (iter_unpack, element size, length-byte checks, row picker, constants)
Shape = tuple[Callable[[Any], Iterator[tuple[Any, ...]]], int, FlatChecks, Any, tuple[Any, ...]]


def flat_shape(layout: FlatLayout, counts: tuple[int, ...],
               cache: dict[tuple[int, ...], Shape]) -> Shape | None:
    """The shape of elements whose arrays hold ``counts`` numbers, remembered in
    ``cache`` (None once ``cache`` holds MAX_SHAPES others).

    The checks (``FlatChecks.wanted``) are ``(offset in the element, expected byte)``
    for every byte of every length prefix and the tagged-field count: equal in each
    element, they prove that every element has this layout.  The picker takes a row of the unpacked numbers
    followed by the constants (the defaults other than ``()``) and returns the record's
    values; arrays are slices of the row.
    """
    if len(cache) >= MAX_SHAPES:
        return None
    fmt = [">"]
    picks: list[Any] = []
    defaults: list[tuple[int, Any]] = []  # (position in picks, value)
    checks: list[tuple[int, bytes]] = []
    plan: list[tuple[Any, ...]] = []
    offset = index = 0
    arrays = iter(counts)
    for item in layout.items:
        if item.kind == "default":
            plan.append((2, item.default))
            if type(item.default) is tuple and not item.default:
                picks.append(slice(0, 0))  # () is any empty slice of the row
            else:
                defaults.append((len(picks), item.default))
                picks.append(None)
        elif item.kind == "number":
            plan.append((0, item.code, item.size))
            fmt.append(item.code)
            picks.append(index)
            index += 1
            offset += item.size
        else:
            count = next(arrays)
            plan.append((1, item.code, item.size, 1 if item.prefix == "B" else 4, count))
            if item.prefix == "B":
                checks.append((offset, bytes((count + 1,))))
                offset += 1
            else:
                checks.extend((offset + j, bytes((b,))) for j, b in enumerate(count.to_bytes(4, "big")))
                offset += 4
            fmt.append(f"{item.prefix}{count}{item.code}")
            index += 1
            picks.append(slice(index, index + count))
            index += count
            offset += count * item.size
    if layout.tagged:
        fmt.append("B")
        checks.append((offset, b"\x00"))
        offset += 1
        index += 1
    picks.append(slice(0, 0))  # unknown tagged fields: none
    for k, (at, _) in enumerate(defaults):
        picks[at] = index + k  # after the row's numbers
    unpack = struct.Struct("".join(fmt))
    assert unpack.size == offset
    consts = tuple(value for _, value in defaults)
    shape: Shape = (unpack.iter_unpack, offset, FlatChecks(tuple(checks), offset, tuple(plan)),
                    operator.itemgetter(*picks), consts)
    cache[counts] = shape
    return shape


class FlatRecords(Sequence[Any]):
    """An array of flat-struct records kept as its bytes until an element is read.

    What a decoded array of three or more flat elements of one layout is (Metadata's
    partitions): the decoder has already checked every byte of it (the layout of every
    element, see ``flat_shape``), so building the records later cannot fail and gives
    what an eager decode would.  It is a read-only sequence equal to the tuple of its
    records (and hashes like it); ``column`` reads one field of every element without
    making records, and an encoder of the same struct and version writes ``raw`` back
    as it is.  ``records()`` is that tuple.

    The C decoder (_decoder.c) makes these with the records already built (``_items``
    set, ``_shape`` None, ``raw`` a copy of the bytes), for arrays of any layouts.
    """

    __slots__ = ("_items", "_n", "_shape", "kind", "raw")

    def __init__(self, raw: Any, n: int, shape: Shape, kind: tuple[Any, FlatLayout]) -> None:
        self.raw = raw  # the elements' bytes (a read-only view of the frame, or a copy)
        self._n = n
        self._shape = shape
        self.kind = kind  # (record class, layout): the same object for one struct and version
        self._items: tuple[Any, ...] | None = None

    def _rows(self) -> Iterator[tuple[Any, ...]]:
        unpack, _, _, pick, consts = self._shape
        rows: Iterator[tuple[Any, ...]] = unpack(self.raw)
        if consts:
            rows = map(operator.add, rows, itertools.repeat(consts, self._n))
        return map(pick, rows)

    def records(self) -> tuple[Any, ...]:
        """The records (built on the first call)."""
        items = self._items
        if items is None:
            cls, layout = self.kind
            if _C_FLAT_RECORDS is not None:
                _, size, checks, _, _ = self._shape
                items = _C_FLAT_RECORDS(self.raw, self._n, size, checks.plan, layout.tagged, cls)
            else:
                items = tuple(map(tuple.__new__, itertools.repeat(cls, self._n), self._rows()))
            self._items = items
        return items

    def column(self, name: str) -> list[Any]:
        """Field ``name`` of every element, in order, without building the records."""
        index = self.kind[0]._fields.index(name)
        rows = self._items if self._items is not None else self._rows()
        return list(map(operator.itemgetter(index), rows))

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, index: int) -> Any: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[Any, ...]: ...
    def __getitem__(self, index: int | slice) -> Any:
        return self.records()[index]

    def __iter__(self) -> Iterator[Any]:
        items = self._items  # built (always, after the C decoder): no call to records()
        return iter(items if items is not None else self.records())

    def __reversed__(self) -> Iterator[Any]:
        return iter(self.records()[::-1])

    def __contains__(self, value: object) -> bool:
        return value in self.records()

    def _other(self, other: object) -> tuple[Any, ...] | None:
        if isinstance(other, FlatRecords):
            return other.records()
        return other if isinstance(other, tuple) else None

    def __eq__(self, other: object) -> bool:
        items = self._other(other)
        return NotImplemented if items is None else self.records() == items

    def __ne__(self, other: object) -> bool:
        items = self._other(other)
        return NotImplemented if items is None else self.records() != items

    def __lt__(self, other: object) -> bool:
        items = self._other(other)
        return NotImplemented if items is None else self.records() < items

    def __le__(self, other: object) -> bool:
        items = self._other(other)
        return NotImplemented if items is None else self.records() <= items

    def __gt__(self, other: object) -> bool:
        items = self._other(other)
        return NotImplemented if items is None else self.records() > items

    def __ge__(self, other: object) -> bool:
        items = self._other(other)
        return NotImplemented if items is None else self.records() >= items

    def __hash__(self) -> int:
        return hash(self.records())

    def __add__(self, other: object) -> tuple[Any, ...]:
        items = self._other(other)
        return NotImplemented if items is None else self.records() + items

    def __radd__(self, other: object) -> tuple[Any, ...]:
        items = self._other(other)
        return NotImplemented if items is None else items + self.records()

    def __repr__(self) -> str:
        return repr(self.records())

    def __reduce__(self) -> tuple[Any, ...]:
        # Copies and pickles are plain tuples (the view of the frame does not pickle).
        return (tuple, (self.records(),))
