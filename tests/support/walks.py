"""Feeding a codec walk (``StepWalk``: ``fetch.AnswerWalk``, ``produce.RequestWalk``) as a
proxy does, for the tests that hold the walks to the whole-frame readers."""

from __future__ import annotations

from hypothesis import strategies as st

from gatehouse.codecs._scan import StepWalk


def feed_in_pieces(walk: StepWalk, frame: bytes, data: st.DataObject
                   ) -> tuple[int, list[tuple[int, int]]]:
    """``frame`` fed to ``walk`` in random pieces, records skipped or fed at random, as a
    proxy would (splicing some, reading others), until the walk is done with it or the
    bytes end; how many bytes it took, and the skipped spans."""
    pos = 0
    skipped = []
    while pos < len(frame) and (walk.opaque or not walk.finished):
        if walk.opaque and data.draw(st.booleans()):
            n = data.draw(st.integers(1, min(walk.opaque, len(frame) - pos)))
            skipped.append((pos, pos + n))
            walk.skip(n)
            pos += n
            continue
        piece = frame[pos:pos + data.draw(st.integers(1, 300))]
        taken = walk.feed(piece)
        assert taken == len(piece) or walk.finished
        pos += taken
    return pos, skipped
