"""Capping the ApiVersions response to what the proxy can decode (pure).

The client must never pick a version the proxy cannot read, so each advertised range
becomes ``[broker min, min(broker max, codec max)]`` and API keys the codec does not
know are removed.  Minimums are left as the broker says: raising Produce's minimum
above 0 makes librdkafka switch compression off (KAFKA-18727, librdkafka #4956).  The
KIP-1022 feature fields are tagged fields of the same body and are carried through
untouched because only ``api_keys`` is replaced.
"""

from __future__ import annotations

from collections.abc import Callable

from gatehouse.codecs import APIS, Response

API_VERSIONS = 18

# (api_key, broker_min, broker_max) -> the range to advertise, or None to drop the key.
RangeAdjuster = Callable[[int, int, int], tuple[int, int] | None]


def codec_range(api_key: int, lo: int, hi: int) -> tuple[int, int] | None:
    spec = APIS.get(api_key)
    if spec is None:
        return None
    new_lo = lo
    new_hi = min(hi, spec.versions.hi)
    if new_lo > new_hi or new_hi < spec.versions.lo:
        return None
    return new_lo, new_hi


def adjust_api_versions(resp: Response, *adjusters: RangeAdjuster) -> Response:
    """Apply ``codec_range`` then each adjuster to every advertised API range."""
    if resp.api_key != API_VERSIONS:
        raise ValueError("not an ApiVersions response")
    body = resp.body
    entries = body.api_keys
    new_entries = []
    changed = False
    for entry in entries:
        rng = codec_range(entry.api_key, entry.min_version, entry.max_version)
        for adjust in adjusters:
            if rng is None:
                break
            rng = adjust(entry.api_key, rng[0], rng[1])
        if rng is None:
            changed = True
            continue
        if rng != (entry.min_version, entry.max_version):
            entry = entry.replace(min_version=rng[0], max_version=rng[1])
            changed = True
        new_entries.append(entry)
    if not changed:
        return resp
    return resp.replace(body=body.replace(api_keys=tuple(new_entries)))
