"""The generator of the codec tables (``python -m gatehouse.codecs.generate``).

The committed ``gatehouse/codecs/_schema.py`` was generated from the specs inside the
Kafka 4.4.0 kafka-clients jar, with the versions Kafka 4.0 removed from the 3.9.2 jar's;
re-running the generator on those jars must reproduce it
byte for byte (fails when the tables are stale or were edited by hand).  The jar comes
from ``scripts.fetch_kafka.kafka_clients_jar`` (Maven, cached).  The generator must
also handle the Kafka 4.0 specs shared at /work/shared/kafka-message-specs.
"""

from __future__ import annotations

import difflib
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gatehouse import codecs
from gatehouse.codecs import generate, schema
from gatehouse.codecs._compile import _Compiler
from scripts.fetch_kafka import PREVIOUS_KAFKA_VERSION
from tests.codec_strategies import random_body

KAFKA_RELEASE = "4.4.0"
REPO = Path(__file__).resolve().parents[1]
SHARED_SPECS = Path("/work/shared/kafka-message-specs")


@pytest.fixture(scope="module")
def clients_jar() -> Path:
    return _jar(KAFKA_RELEASE)


@pytest.fixture(scope="module")
def older_jar() -> Path:
    return _jar(PREVIOUS_KAFKA_VERSION)


def _jar(release: str) -> Path:
    from scripts.fetch_kafka import FetchError, kafka_clients_jar

    try:
        return kafka_clients_jar(release)
    except FetchError as exc:  # no silent skip: stale tables must not go unnoticed
        pytest.fail(f"cannot fetch kafka-clients {release} to check the tables: {exc}")


def _diff(expected: str, actual: str) -> str:
    lines = difflib.unified_diff(actual.splitlines(), expected.splitlines(),
                                 "committed _schema.py", "generated", lineterm="", n=1)
    return "\n".join(list(lines)[:60])


def test_committed_tables_are_fresh(clients_jar: Path, older_jar: Path) -> None:
    assert clients_jar.name == f"kafka-clients-{KAFKA_RELEASE}.jar"
    assert codecs.KAFKA_RELEASE == KAFKA_RELEASE
    sources = generate.read_spec_jar(clients_jar)
    release = generate.release_from_jar(clients_jar)
    origin = (f"org.apache.kafka:kafka-clients:{release} ({generate.SPEC_DIR_IN_JAR}*.json)"
              + generate.older_origin(older_jar))
    expected = generate.render(sources, release, origin, generate.read_spec_jar(older_jar))
    committed = generate.DEFAULT_OUTPUT.read_text("utf-8")
    assert committed == expected, "stale tables: run python -m gatehouse.codecs.generate " \
        f"--kafka-clients-jar {clients_jar} --older-kafka-clients-jar {older_jar}\n" \
        f"{_diff(expected, committed)}"


def test_the_tables_hold_the_versions_kafka_4_removed() -> None:
    """KIP-896's removed versions, from the 3.x specs: with the fields only they had, in
    their place (ListOffsets v0's MaxNumOffsets after Timestamp), and not the 3.x
    preview of share groups (unstable there)."""
    assert [(codecs.api(k).versions.lo, codecs.api(k).versions.hi) for k in (0, 1, 2, 8)] == [
        (0, 13), (0, 18), (0, 11), (0, 10)]
    partition = codecs.api(2).request.root.field("topics").struct.field("partitions").struct
    names = [f.name for f in partition.fields]
    assert names.index("MaxNumOffsets") == names.index("Timestamp") + 1
    assert partition.field("max_num_offsets").versions.hi == 0
    assert codecs.api(78).versions.lo == 1  # ShareFetch


def test_older_versions_that_differ_are_refused() -> None:
    def spec(versions: str, fields: list[dict[str, Any]]) -> dict[str, Any]:
        return {"apiKey": 0, "type": "request", "name": "ProduceRequest",
                "validVersions": versions, "flexibleVersions": "9+", "fields": fields}

    field = {"name": "Acks", "type": "int16", "versions": "0+"}
    newer = spec("3-13", [field])
    assert generate.with_older_versions(newer, spec("3-11", [field])) is newer  # none older
    merged = generate.with_older_versions(newer, spec("0-11", [field]))
    assert merged["validVersions"] == "0-13" and merged["fields"] == [field]
    with pytest.raises(ValueError, match=r"ProduceRequest.Acks: differs in v0"):
        generate.with_older_versions(newer, spec("0-11", [{**field, "type": "int32"}]))
    with pytest.raises(ValueError, match="in older versions only in the newer specs"):
        generate.with_older_versions(spec("3-13", [field, {**field, "name": "New"}]),
                                     spec("0-11", [field]))


def test_generator_cli_check(clients_jar: Path, older_jar: Path, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "gatehouse.codecs.generate", "--kafka-clients-jar", str(clients_jar),
           "--older-kafka-clients-jar", str(older_jar)]
    result = subprocess.run([*cmd, "--check"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    # --check on a stale (or missing) file fails; writing it makes --check pass.
    out = tmp_path / "schema.py"
    out.write_text(generate.DEFAULT_OUTPUT.read_text("utf-8").replace("'0-13'", "'0-12'", 1))
    args = ["--kafka-clients-jar", str(clients_jar), "--older-kafka-clients-jar", str(older_jar),
            "--output", str(out)]
    assert generate.main([*args, "--check"]) == 1
    assert generate.main([*args, "--check", "--output", str(tmp_path / "missing.py")]) == 1
    assert generate.main(args) == 0
    assert generate.main([*args, "--check"]) == 0
    assert out.read_text("utf-8") == generate.DEFAULT_OUTPUT.read_text("utf-8")


def test_release_from_jar_name() -> None:
    assert generate.release_from_jar(Path("/x/kafka-clients-4.4.0.jar")) == "4.4.0"
    assert generate.release_from_jar(Path("kafka-clients-3.9.1-rc2.jar")) == "3.9.1-rc2"
    with pytest.raises(SystemExit):
        generate.release_from_jar(Path("clients.jar"))


def test_strip_comments() -> None:
    cases = {
        '{"a": 1} // tail': '{"a": 1} ',
        '// only\n{"a": "//x"}': '\n{"a": "//x"}',
        '{"a": "q\\"//still a string"} // c': '{"a": "q\\"//still a string"} ',
        '{"url": "http://h/p"}': '{"url": "http://h/p"}',
        '{\n  // "b": 2,\n  "a": 1\n}': '{\n  \n  "a": 1\n}',
        '{"a": "\\\\"} // after an escaped backslash': '{"a": "\\\\"} ',
    }
    for text, expected in cases.items():
        assert generate.strip_comments(text) == expected, text


# -- the shared Kafka 4.0 specs -----------------------------------------------------------


def _tables(text: str) -> dict[str, Any]:
    namespace: dict[str, Any] = {}
    exec(compile(text, "<generated>", "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def specs_40(tmp_path_factory: pytest.TempPathFactory) -> dict[str, schema.MessageSpec]:
    if not SHARED_SPECS.is_dir():
        pytest.skip(f"{SHARED_SPECS} is not here")
    out = tmp_path_factory.mktemp("gen") / "schema40.py"
    result = subprocess.run(
        [sys.executable, "-m", "gatehouse.codecs.generate", "--specs", str(SHARED_SPECS),
         "--release", "4.0.0", "--output", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "wrote" in result.stdout
    tables = _tables(out.read_text("utf-8"))
    assert tables["KAFKA_RELEASE"] == "4.0.0"
    return {t["name"]: schema._Builder(t).build() for t in tables["MESSAGES"]}


def test_shared_40_specs_have_fewer_apis_and_lower_versions(
        specs_40: dict[str, schema.MessageSpec]) -> None:
    apis_40 = {m.api_key: m for m in specs_40.values() if m.kind == "request"}
    assert len(apis_40) == 88 < len(codecs.APIS)
    assert set(codecs.APIS) - set(apis_40) >= {88, 89, 90, 91, 92}
    # The snapshot (trunk, Oct 2024) still had the ZooKeeper-era APIs 4-7.
    assert {4, 5, 6, 7} <= set(apis_40) and not {4, 5, 6, 7} & set(codecs.APIS)
    for key, request in apis_40.items():
        if key in codecs.APIS:
            assert request.valid.hi <= codecs.APIS[key].versions.hi, request.name
    newer = {codecs.APIS[k].name for k, r in apis_40.items()
             if k in codecs.APIS and r.valid.hi < codecs.APIS[k].versions.hi}
    assert {"Produce", "Fetch", "ApiVersions"} <= newer
    assert (apis_40[0].valid.hi, apis_40[1].valid.hi) == (11, 17)
    # The snapshot still had the versions KIP-896 removed (Produce v0-2, Fetch v0-3),
    # which the tables take from the 3.x specs.
    assert apis_40[0].valid.lo == 0 == codecs.api(0).versions.lo


def test_shared_40_tables_compile_and_round_trip(specs_40: dict[str, schema.MessageSpec]) -> None:
    rng = random.Random(40)
    compiled = 0
    for message in specs_40.values():
        for version in message.valid:
            codec = _Compiler(message, version).compile()  # not cached: the names clash with 4.4
            body = random_body(message, version, rng)
            out = bytearray()
            codec.encode(out, body)
            decoded, end, _ = codec.decode(memoryview(bytes(out)))
            assert decoded == body and end == len(out), (message.name, version)
            compiled += 1
    assert compiled > 600


def test_a_message_without_fields() -> None:
    """A request with no fields at all (4.0's ListClientMetricsResourcesRequest v0 was one)."""
    spec_text = ('// comment\n{"apiKey": 200, "type": "request", "name": "EmptyRequest",\n'
                 ' "validVersions": "0-1", "flexibleVersions": "1+", "fields": []}')
    tables = _tables(generate.render({"EmptyRequest.json": spec_text}, "0.0.0", "test"))
    message = schema._Builder(tables["MESSAGES"][0]).build()
    for version, tags, wire in ((0, (), b""), (1, (), b"\x00"), (1, ((3, b"x"),), b"\x01\x03\x01x")):
        codec = _Compiler(message, version).compile()
        body = message.root.cls(unknown_tags=tags)
        out = bytearray()
        codec.encode(out, body)
        assert bytes(out) == wire
        decoded, end, _ = codec.decode(memoryview(wire))
        assert decoded == body and decoded.unknown_tags == tags and end == len(wire)


def test_committed_error_codes_are_fresh(clients_jar: Path) -> None:
    """The error code table is Kafka's own Errors enum, read from the same jar by Java."""
    from gatehouse.codecs import _error_codes, generate_errors

    codes = generate_errors.read_errors(clients_jar)
    assert codes[0] == "NONE" and codes[35] == "UNSUPPORTED_VERSION" and codes[-1] == \
        "UNKNOWN_SERVER_ERROR"
    expected = generate_errors.render(codes, generate.release_from_jar(clients_jar))
    assert generate_errors.DEFAULT_OUTPUT.read_text("utf-8") == expected, (
        "stale error codes: run python -m gatehouse.codecs.generate_errors "
        f"--kafka-clients-jar {clients_jar}")
    assert _error_codes.KAFKA_RELEASE == codecs.KAFKA_RELEASE
