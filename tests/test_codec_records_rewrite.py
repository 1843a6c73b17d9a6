"""``rewrite_values`` (record encryption's rewriting of a batch's values) in C and in
Python: the same records section and the same count on generated records (null and
empty values, headers with null values, the marking header in several places, a
function that declines some values), and for records that do not parse, the C version
steps aside and the Python one says what is wrong."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gatehouse.codecs import records
from gatehouse.codecs.errors import RemoteProtocolError
from tests.codec_strategies import examples
from tests.support.mutants import mutant
from tests.test_codec_records_native import record_bytes

MARK = b"gatehouse.encryption"


def rewritten(section: bytes, count: int, fn: Any, **how: Any) -> tuple[Any, ...]:
    try:
        return records.rewrite_values(section, count, fn, **how)
    except RemoteProtocolError as exc:
        return ("error", str(exc))


def both(section: bytes, count: int, fn: Any, **how: Any) -> tuple[Any, Any]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(records, "_C_REWRITE", None)
        python = rewritten(section, count, fn, **how)
    return rewritten(section, count, fn, **how), python


def test_the_c_version_is_built() -> None:
    assert records._C_REWRITE is not None


def reverse_unless_x(value: bytes) -> bytes | None:
    """Declines values that start with x (as an opener declines one it cannot open)."""
    return None if value.startswith(b"x") else value[::-1] + b"!"


header_names = st.sampled_from([b"trace", MARK, b"a", b""])
a_record = st.builds(
    record_bytes, st.integers(-(2**40), 2**40), st.integers(0, 2**31 - 1),
    st.one_of(st.none(), st.binary(max_size=8)),
    st.one_of(st.none(), st.just(b""), st.binary(max_size=40), st.just(b"x1")),
    st.lists(st.tuples(header_names, st.one_of(st.none(), st.binary(max_size=4))),
             max_size=6))


def joined_unless_bad(first: bytes, rest: bytes, head: bytes) -> bytes:
    """A ``fast`` call: raises for a value whose rest starts with "bad" (so ``fn`` gets
    it after all)."""
    if rest.startswith(b"bad"):
        raise ValueError("bad")
    return b"<" + head + b"|" + first + b"|" + rest + b">"


FAST = (b"\x01\x00", 2, joined_unless_bad)  # values beginning \x01\x00: 2 bytes, the rest

a_value = st.one_of(st.none(), st.just(b""), st.binary(max_size=40), st.just(b"x1"),
                    st.binary(max_size=10).map(lambda b: b"\x01\x00" + b),
                    st.binary(max_size=4).map(lambda b: b"\x01\x00" + b + b"bad"))
a_fast_record = st.builds(
    record_bytes, st.integers(-(2**40), 2**40), st.integers(0, 2**31 - 1),
    st.one_of(st.none(), st.binary(max_size=8)), a_value,
    st.lists(st.tuples(header_names, st.one_of(st.none(), st.binary(max_size=4))),
             max_size=6))


@settings(max_examples=examples(400), deadline=None)
@given(parts=st.lists(a_fast_record, max_size=10))
def test_the_fast_call_the_same_in_c_and_python(parts: list[bytes]) -> None:
    section = b"".join(parts)
    for how in ({"add": (MARK, b"\x01")}, {"strip": MARK}):
        c, python = both(section, len(parts), reverse_unless_x, fast=FAST, **how)
        assert c == python and c[0] != "error"


def test_the_fast_call_takes_what_begins_with_its_head() -> None:
    values = [b"\x01\x00ab-cd", b"\x01\x00abbad", b"\x01\x00a", b"other"]
    section = b"".join(record_bytes(0, i, None, v, [(MARK, None)])
                       for i, v in enumerate(values))
    opened, count = records.rewrite_values(section, 4, lambda v: b"fn:" + v, strip=MARK,
                                           fast=FAST)
    assert count == 4
    got = [r.value for r in records.iter_records(opened, 4)]
    assert got == [b"<\x01\x00|ab|-cd>", b"fn:\x01\x00abbad", b"fn:\x01\x00a", b"fn:other"]
    with pytest.raises(TypeError, match="fast is"):
        records.rewrite_values(section, 4, bytes, strip=MARK,
                               fast=("no", 2, bytes))  # type: ignore[arg-type]


@settings(max_examples=examples(400), deadline=None)
@given(parts=st.lists(a_record, max_size=10), data=st.data())
def test_the_same_section_from_c_and_python(parts: list[bytes], data: st.DataObject) -> None:
    section = b"".join(parts)
    for how in ({"add": (MARK, b"\x01")}, {"strip": MARK}):
        c, python = both(section, len(parts), reverse_unless_x, **how)
        assert c == python
        assert c[0] != "error"
    # Records that do not parse: the same error (the C version leaves them to Python).
    broken = mutant(data, section)
    for how in ({"add": (MARK, b"\x01")}, {"strip": MARK}):
        c, python = both(broken, len(parts), reverse_unless_x, **how)
        assert c == python


def test_adding_then_stripping_gives_the_records_back() -> None:
    section = b"".join(record_bytes(i, i, b"k", b"v%d" % i, [(b"h", None)]) for i in range(5))
    sealed, count = records.rewrite_values(section, 5, lambda v: v.upper(), add=(MARK, b"\x01"))
    assert count == 5 and sealed != section
    twice, _ = records.rewrite_values(sealed, 5, lambda v: v + b"+", add=(MARK, b"\x01"))
    opened, count = records.rewrite_values(twice, 5, lambda v: v.removesuffix(b"+").lower(),
                                           strip=MARK)
    assert count == 5 and opened == section  # both layers off
    # A function that declines: the record as it was.
    same, count = records.rewrite_values(sealed, 5, lambda v: None, strip=MARK)
    assert (same, count) == (sealed, 0)
    with pytest.raises(ValueError, match="add a header or strip one"):
        records.rewrite_values(section, 5, bytes)
