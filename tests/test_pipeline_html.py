"""The report's HTML, from rows as the Spark job collects them (no Spark here)."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace

from gatehouse.pipeline.html import _traffic_section


def test_records_of_every_api_that_carries_them_are_charted_and_listed() -> None:
    minute = datetime(2026, 11, 29, 9, 0, tzinfo=UTC)
    per_minute = [SimpleNamespace(minute=minute, api=api, records=n, requests=1)
                  for api, n in (("Produce", 10), ("Fetch", 7), ("ShareFetch", 3),
                                 ("Metadata", None))]
    topics = [SimpleNamespace(topic="jobs", api="ShareFetch", records=3, bytes=300)]
    html = _traffic_section(SimpleNamespace(per_minute=per_minute, topics=topics))
    for series in ("produced", "fetched", "fetched by share groups"):
        assert f">{series}<" in html, series
    assert "<td>jobs</td><td>ShareFetch</td><td class=n>3</td>" in html
