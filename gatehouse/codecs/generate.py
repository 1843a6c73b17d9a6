"""Generate ``_schema.py`` (the codec tables) from Apache Kafka's JSON message specs.

Usage::

    python -m gatehouse.codecs.generate --kafka-clients-jar kafka-clients-4.4.0.jar \
        --older-kafka-clients-jar kafka-clients-3.9.2.jar
    python -m gatehouse.codecs.generate --specs DIR --release 4.0.0

The output holds facts only (names, types, version ranges, tags, defaults and entity
types); the specs' prose ("about") is dropped.  The tables are committed, and a test
re-runs this generator and fails when they are stale.

Kafka 4.0 removed old versions of many APIs from its specs (KIP-896: Produce v0-2,
Fetch v0-3, ...), which 3.x brokers still serve to old clients.  With an older release's
specs (``--older-kafka-clients-jar``), each message also gets the stable versions the
older release had below the newer's lowest: the newer spec's fields, which still name
those versions, plus the fields only those versions had, in their place.  Any other
difference in those versions (a field's presence, type or nullability) is an error.
"""

from __future__ import annotations

import argparse
import json
import pprint
import re
import sys
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

SPEC_DIR_IN_JAR = "common/message/"
DEFAULT_OUTPUT = Path(__file__).with_name("_schema.py")

# The field keys we keep, renamed to short table keys.  "about" and "zeroCopy" are
# dropped: prose, and a Java allocation hint.
_FIELD_KEYS = {
    "nullableVersions": "nullable",
    "tag": "tag",
    "taggedVersions": "tagged",
    "default": "default",
    "entityType": "entity",
    "ignorable": "ignorable",
    "mapKey": "map_key",
    "flexibleVersions": "flexible",
}


def strip_comments(text: str) -> str:
    """Remove ``//`` comments that lie outside JSON strings (the specs carry them)."""
    out: list[str] = []
    i, n = 0, len(text)
    in_string = False
    while i < n:
        ch = text[i]
        if in_string:
            out.append(ch)
            if ch == "\\" and i + 1 < n:
                out.append(text[i + 1])
                i += 2
                continue
            if ch == '"':
                in_string = False
            i += 1
        elif ch == '"':
            in_string = True
            out.append(ch)
            i += 1
        elif text.startswith("//", i):
            end = text.find("\n", i)
            i = n if end < 0 else end
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def _field_table(spec: Mapping[str, Any]) -> tuple[Any, ...]:
    """One field as ``(name, type, versions, {options}, (children...))``."""
    options: dict[str, Any] = {}
    for key, short in _FIELD_KEYS.items():
        if key in spec:
            value = spec[key]
            if key == "default":
                value = str(value)
            if key == "tag":  # a number; one 4.0 spec writes it as a string ("0")
                value = int(value)
            if key in ("ignorable", "mapKey"):
                value = bool(value)
                if not value:
                    continue
            options[short] = value
    children = tuple(_field_table(child) for child in spec.get("fields", ()))
    return (spec["name"], spec["type"], spec["versions"], options, children)


def _message_table(spec: Mapping[str, Any]) -> dict[str, Any]:
    table: dict[str, Any] = {
        "name": spec["name"],
        "type": spec["type"],
        "valid": spec["validVersions"],
        "flexible": spec.get("flexibleVersions", "none"),
    }
    if "apiKey" in spec:
        table["api_key"] = spec["apiKey"]
    if spec.get("latestVersionUnstable"):
        table["latest_unstable"] = True
    if "listeners" in spec:
        table["listeners"] = tuple(spec["listeners"])
    table["fields"] = tuple(_field_table(f) for f in spec.get("fields", ()))
    table["common"] = {
        c["name"]: (c["versions"], tuple(_field_table(f) for f in c["fields"]))
        for c in spec.get("commonStructs", ())
    }
    return table


def _version_set(text: str) -> range:
    """A spec's version range ("0+", "3-5", "7", "none") as a range (``+``: up to 32767)."""
    if text == "none":
        return range(0)
    if text.endswith("+"):
        return range(int(text[:-1]), 32768)
    lo, _, hi = text.partition("-")
    return range(int(lo), int(hi or lo) + 1)


def _merged_fields(newer: list[dict[str, Any]], older: list[dict[str, Any]],
                   versions: range, where: str) -> list[dict[str, Any]]:
    """``newer``'s fields, with the ones only ``older`` has in ``versions`` put in their
    place (after the field before them in ``older``)."""
    by_name = {f["name"]: f for f in newer}
    merged = list(newer)
    previous: str | None = None
    for field in older:
        name, path = field["name"], f"{where}.{field['name']}"
        present = [v for v in versions if v in _version_set(field["versions"])]
        mine = by_name.get(name)
        if mine is None:
            if present:
                if present != list(_version_set(field["versions"])):
                    raise ValueError(f"{path}: only in the older specs, also in newer versions")
                at = 0 if previous is None else next(
                    i for i, f in enumerate(merged) if f["name"] == previous) + 1
                merged.insert(at, field)
                previous = name
            continue
        previous = name
        for v in versions:
            same = ((v in _version_set(field["versions"])) == (v in _version_set(mine["versions"]))
                    and field["type"] == mine["type"]
                    and (v in _version_set(field.get("nullableVersions", "none")))
                    == (v in _version_set(mine.get("nullableVersions", "none"))))
            if not same:
                raise ValueError(f"{path}: differs in v{v} between the older and newer specs")
        if "fields" in field or "fields" in mine:
            mine = {**mine, "fields": _merged_fields(list(mine.get("fields", ())),
                                                     list(field.get("fields", ())), versions, path)}
            merged[merged.index(by_name[name])] = mine
            by_name[name] = mine
    older_names = {f["name"] for f in older}
    for field in newer:
        if field["name"] not in older_names and any(
                v in _version_set(field["versions"]) for v in versions):
            raise ValueError(f"{where}.{field['name']}: in older versions only in the newer specs")
    return merged


def with_older_versions(spec: dict[str, Any], older: Mapping[str, Any] | None) -> dict[str, Any]:
    """``spec`` with the stable versions ``older`` (the same message in an older release)
    had below ``spec``'s lowest (see the module doc)."""
    # (Not a message whose flexible versions moved: its older versions' header and tag
    # sections would not be what the merged table says.)
    if (older is None or "apiKey" not in spec or spec["validVersions"] == "none"
            or older.get("flexibleVersions") != spec.get("flexibleVersions")):
        return spec
    newer_versions, older_versions = (_version_set(spec["validVersions"]),
                                      _version_set(older["validVersions"]))
    stable_top = older_versions.stop - (2 if older.get("latestVersionUnstable") else 1)
    versions = range(older_versions.start, min(newer_versions.start - 1, stable_top) + 1)
    if not versions:
        return spec
    where = spec["name"]
    merged = dict(spec)
    merged["validVersions"] = f"{versions.start}-{newer_versions.stop - 1}"
    merged["fields"] = _merged_fields(list(spec.get("fields", ())),
                                      list(older.get("fields", ())), versions, where)
    older_common = {c["name"]: c for c in older.get("commonStructs", ())}
    merged["commonStructs"] = [
        {**c, "fields": _merged_fields(list(c["fields"]),
                                       list(older_common.get(c["name"], {}).get("fields", ())),
                                       versions, f"{where}.{c['name']}")}
        if c["name"] in older_common else c
        for c in spec.get("commonStructs", ())]
    return merged


def _wanted(name: str) -> bool:
    return (
        name.endswith(("Request.json", "Response.json"))
        or name in ("RequestHeader.json", "ResponseHeader.json")
        or name.startswith("ConsumerProtocol")
    )


def read_spec_dir(directory: Path) -> dict[str, str]:
    return {p.name: p.read_text("utf-8") for p in sorted(directory.glob("*.json")) if _wanted(p.name)}


def read_spec_jar(jar: Path) -> dict[str, str]:
    with zipfile.ZipFile(jar) as archive:
        return {
            Path(member).name: archive.read(member).decode("utf-8")
            for member in sorted(archive.namelist())
            if member.startswith(SPEC_DIR_IN_JAR) and _wanted(Path(member).name)
        }


def release_from_jar(jar: Path) -> str:
    match = re.search(r"kafka-clients-([0-9][^/]*?)\.jar$", jar.name)
    if not match:
        raise SystemExit(f"cannot tell the Kafka release from the jar name {jar.name!r}; pass --release")
    return match.group(1)


def render(sources: Mapping[str, str], release: str, origin: str,
           older: Mapping[str, str] | None = None) -> str:
    """The tables of ``sources`` (with the versions ``older``'s specs had below theirs,
    see the module doc)."""
    messages = []
    for name in sorted(sources):
        spec = json.loads(strip_comments(sources[name]))
        if spec.get("type") in ("request", "response") and spec.get("validVersions") == "none":
            continue  # removed APIs (LeaderAndIsr, ...): nothing to decode
        if older is not None and name in older:
            spec = with_older_versions(spec, json.loads(strip_comments(older[name])))
        messages.append(_message_table(spec))
    body = pprint.pformat(tuple(messages), width=100, sort_dicts=False)
    return (
        "# Generated by gatehouse.codecs.generate from Apache Kafka's JSON message specs.\n"
        "# Facts only (names, types, versions, tags, defaults, entity types). Do not edit.\n"
        f"# Source: {origin}\n"
        "# fmt: off\n"
        f"KAFKA_RELEASE = {release!r}\n"
        f"MESSAGES = {body}\n"
    )


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gatehouse.codecs.generate", description=__doc__)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--specs", type=Path, help="a directory of *.json message specs")
    source.add_argument("--kafka-clients-jar", type=Path, help="a kafka-clients jar from Maven Central")
    parser.add_argument("--older-kafka-clients-jar", type=Path,
                        help="an older release's kafka-clients jar: the versions its specs "
                             "had below the newer's (Kafka 4.0 removed some, KIP-896)")
    parser.add_argument("--release", help="the Kafka release the specs belong to")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--check", action="store_true", help="exit 1 if OUTPUT differs from what would be written")
    args = parser.parse_args(None if argv is None else list(argv))

    if args.kafka_clients_jar is not None:
        sources = read_spec_jar(args.kafka_clients_jar)
        release = args.release or release_from_jar(args.kafka_clients_jar)
        origin = f"org.apache.kafka:kafka-clients:{release} ({SPEC_DIR_IN_JAR}*.json)"
    else:
        sources = read_spec_dir(args.specs)
        if not args.release:
            parser.error("--release is required with --specs")
        release = args.release
        origin = f"Apache Kafka {release} message specs"
    if not sources:
        parser.error("no message specs found")
    older = None
    if args.older_kafka_clients_jar is not None:
        older = read_spec_jar(args.older_kafka_clients_jar)
        origin += older_origin(args.older_kafka_clients_jar)
    return write_or_check(args.output, render(sources, release, origin, older), args.check,
                          f"{len(sources)} specs, Kafka {release}")


def older_origin(jar: Path) -> str:
    """The tables' source line's words for the older release's specs."""
    return f"; versions below those from kafka-clients:{release_from_jar(jar)}"


def write_or_check(output: Path, text: str, check: bool, what: str) -> int:
    """Write a generated table, or with ``check`` exit 1 when the committed one differs."""
    if check:
        current = output.read_text("utf-8") if output.exists() else ""
        if current != text:
            print(f"{output} is stale: regenerate it with this generator", file=sys.stderr)
            return 1
        return 0
    output.write_text(text, "utf-8")
    print(f"wrote {output} ({what})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
