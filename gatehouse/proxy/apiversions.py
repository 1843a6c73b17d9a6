"""Capping the ApiVersions response to what the proxy can decode (pure).

The client must never pick a version the proxy cannot read, so each advertised range
becomes ``[broker min, min(broker max, codec max)]`` and API keys the codec does not
know are removed.  Minimums are left as the broker says: raising Produce's minimum
above 0 makes librdkafka switch compression off (KAFKA-18727, librdkafka #4956).  The
KIP-1022 feature fields are tagged fields of the same body and are carried through
untouched because only ``api_keys`` is replaced.

APIs the proxy answers itself whatever the broker offers (KIP-714's telemetry, with
``metrics.client_telemetry``) are ``added`` where the broker leaves them out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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


def _adjusted(api_key: int, lo: int, hi: int,
              adjusters: Sequence[RangeAdjuster]) -> tuple[int, int] | None:
    rng = codec_range(api_key, lo, hi)
    for adjust in adjusters:
        if rng is None:
            break
        rng = adjust(api_key, rng[0], rng[1])
    return rng


def adjust_api_versions(resp: Response, *adjusters: RangeAdjuster,
                        added: Sequence[tuple[int, int, int]] = ()) -> Response:
    """Apply ``codec_range`` then each adjuster to every advertised API range; each of
    ``added`` (api key, min, max) the broker does not offer is offered too (adjusted
    alike), unless the answer is an error."""
    if resp.api_key != API_VERSIONS:
        raise ValueError("not an ApiVersions response")
    body = resp.body
    entries = body.api_keys
    new_entries = []
    changed = False
    for entry in entries:
        rng = _adjusted(entry.api_key, entry.min_version, entry.max_version, adjusters)
        if rng is None:
            changed = True
            continue
        if rng != (entry.min_version, entry.max_version):
            entry = entry.replace(min_version=rng[0], max_version=rng[1])
            changed = True
        new_entries.append(entry)
    if added and body.error_code == 0:
        offered = {entry.api_key for entry in entries}
        entry_spec = resp.api.response.root.field("api_keys").struct
        assert entry_spec is not None
        entry_cls = entry_spec.cls
        for api_key, lo, hi in added:
            rng = None if api_key in offered else _adjusted(api_key, lo, hi, adjusters)
            if rng is not None:
                new_entries.append(entry_cls(api_key=api_key, min_version=rng[0],
                                             max_version=rng[1]))
                changed = True
    if not changed:
        return resp
    return resp.replace(body=body.replace(api_keys=tuple(new_entries)))
