"""Bytes spoiled for property tests: a few bytes changed, some inserted, the end cut,
as hypothesis draws them (shrinking to the smallest spoiling that fails)."""

from __future__ import annotations

from hypothesis import strategies as st


def mutant(data: st.DataObject, original: bytes) -> bytes:
    """``original`` with one to three spoilings drawn from ``data``."""
    spoiled = bytearray(original)
    for _ in range(data.draw(st.integers(1, 3))):
        where = data.draw(st.integers(0, len(spoiled)))
        action = data.draw(st.sampled_from(["flip", "insert", "cut"]))
        if action == "flip" and where < len(spoiled):
            spoiled[where] ^= data.draw(st.integers(1, 255))
        elif action == "insert":
            spoiled[where:where] = data.draw(st.binary(min_size=1, max_size=3))
        else:
            del spoiled[where:]
    return bytes(spoiled)
