"""``encrypt_records`` without a broker: the key file and the rule (errors with
file:line, never a key), values sealed and opened (tampering, unknown keys, data keys
renewed), batches in every codec rewritten with their offsets, timestamps and producer
fields kept, and the policy: Produce requests sealed, Fetch answers opened for the
rule's clients only, topics named by id, a tenant's prefix, large messages in a thread,
the key file reloaded."""

from __future__ import annotations

import base64
import dataclasses
import itertools
import os
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gatehouse import codecs
from gatehouse.codecs.primitives import read_varint
from gatehouse.codecs.records import (
    RecordBatch,
    encode_batch,
    iter_batches,
    iter_records,
    rebuilt_batch,
    records_section,
    rewrite_values,
)
from gatehouse.compression import compress_zstd, decompress
from gatehouse.configfile import ConfigError
from gatehouse.proxy.hooks import Close, Forward, Pending, Respond
from gatehouse.proxy.policy import Reloader, RulesPolicy, RulesSource
from gatehouse.rules import encryption as enc
from gatehouse.rules import error_response, load_rules_file
from gatehouse.rules.encryption import (
    HEADER,
    Kek,
    LocalKek,
    RecordCipher,
    RecordEncryption,
    Undecryptable,
    Unsealable,
    load_key_ring,
    local_keys,
    open_records,
    seal_records,
)
from gatehouse.rules.errors import UNKNOWN_TOPIC_ID
from tests.test_codec_records_native import record_bytes
from tests.test_rules import req
from tests.test_rules_records import TS, batch, legacy, partitions
from tests.test_rules_topic_filter import conn, metadata_answer


def sealing(encryption: RecordEncryption) -> LocalKek:
    """The key-file KEK an encryption seals under."""
    kek = local_keys(encryption).sealing
    assert isinstance(kek, LocalKek)
    return kek


def keys(found: dict[str, bytes]) -> Callable[[str], Kek | None]:
    """KEKs by name, as ``RecordCipher.open`` finds them."""
    return lambda name: LocalKek(name, found[name]) if name in found else None


SECRET = "the card number 4111 1111 1111 1111"
PAYMENTS_ID = uuid.UUID("0b7e3f0c-6a43-4d8c-b1f2-5c7d8e9fa0b1")
LIMIT = 1 << 20


def new_key() -> str:
    return base64.b64encode(os.urandom(32)).decode()


def key_file(tmp_path: Path, **keys: str) -> Path:
    path = tmp_path / "keys.yaml"
    path.write_text("keys:\n" + "".join(f"  {name}: {value}\n" for name, value in keys.items()))
    return path


def rules_file(tmp_path: Path, key: str = "pay-1", topics: str = "[payments, 'pay\\..*']",
               extra: str = "") -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text("rules:\n"
                    "  - name: payments-encrypted\n"
                    "    match: {client_id: '^app'}\n"
                    "    encrypt_records:\n"
                    f"      topics: {topics}\n"
                    "      key_file: keys.yaml\n"
                    f"      key: {key}\n" + extra)
    return path


@pytest.fixture
def policy(tmp_path: Path) -> RulesPolicy:
    key_file(tmp_path, **{"pay-1": new_key(), "pay-0": new_key()})
    return RulesPolicy(load_rules_file(rules_file(tmp_path)))


def encryption(tmp_path: Path) -> RecordEncryption:
    ring = load_key_ring(key_file(tmp_path, a=new_key()))
    return RecordEncryption(None, "a", ring, LIMIT)


def values(records: bytes) -> list[tuple[bytes | None, bytes | None, tuple[Any, ...]]]:
    """(key, value, headers) of every record of a records field's whole batches."""
    out = []
    for b in iter_batches(records):
        assert isinstance(b, RecordBatch) and b.crc_ok(records)
        section = records_section(records, b)
        if b.compression != "none":
            section = decompress(b.compression, section, LIMIT)  # type: ignore[assignment]
        out += [(r.key, r.value, r.headers) for r in iter_records(section, b.record_count)]
    return out


# -- the key file and the rule ---------------------------------------------------------------


def test_the_rule_and_its_key_file(tmp_path: Path) -> None:
    key_file(tmp_path, **{"pay-1": new_key()})
    [rule] = load_rules_file(rules_file(tmp_path)).rules
    encryption = rule.encrypt_records
    assert encryption is not None and encryption.key == "pay-1"
    assert encryption.applies_to("payments") and encryption.applies_to("pay.eu")
    assert not encryption.applies_to("orders")
    assert len(local_keys(encryption).sealing.key) == 32
    assert "keys" not in repr(encryption.ring) or "=b'" not in repr(encryption.ring)
    ruleset = load_rules_file(rules_file(tmp_path))
    assert ruleset.files == (tmp_path / "keys.yaml",)  # watched: a change reloads


@pytest.mark.parametrize(("keys", "rule_key", "extra", "error"), [
    ("keys:\n  pay-1: not-base64!\n", "pay-1", "", "keys.yaml:2: key 'pay-1' is not base64"),
    ("keys:\n  pay-1: " + base64.b64encode(b"short").decode() + "\n", "pay-1", "",
     "keys.yaml:2: key 'pay-1' is 5 bytes: an AES-256 key is 32"),
    ("keys: {}\n", "pay-1", "", "keys.yaml:1: the key file has no keys"),
    ("other: 1\n", "pay-1", "", "a key file holds `keys: {name: base64 of 32 bytes}`"),
    (None, "pay-2", "", "rules.yaml:7: encrypt_records.key: 'pay-2' is not a key of"),
    (None, "pay-1", "    mode: observe\n", "rules.yaml:4: encrypt_records cannot be observed"),
])
def test_a_bad_key_file_or_rule_is_refused_with_its_line(
        tmp_path: Path, keys: str | None, rule_key: str, extra: str, error: str) -> None:
    secret = new_key()
    (tmp_path / "keys.yaml").write_text(keys if keys is not None else f"keys:\n  pay-1: {secret}\n")
    path = rules_file(tmp_path, key=rule_key, extra=extra)
    with pytest.raises(ConfigError) as info:
        load_rules_file(path)
    assert error in str(info.value)
    assert secret not in str(info.value)  # never a key in an error


def test_a_missing_key_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"rules.yaml:6: encrypt_records.key_file: .*keys.yaml: "
                                          r"cannot read"):
        load_rules_file(rules_file(tmp_path))


# -- values ------------------------------------------------------------------------------------


def test_a_value_sealed_opens_only_as_it_was(tmp_path: Path) -> None:
    e = encryption(tmp_path)
    cipher = RecordCipher()
    value = (SECRET * 10).encode()
    sealed = cipher.seal(value, sealing(e), compress_zstd)
    assert SECRET.encode() not in sealed and sealed[1] == enc.ZSTD  # compressed first
    assert len(sealed) < len(value)
    assert cipher.open(sealed, local_keys(e).find, decompress, LIMIT) == value
    assert RecordCipher().open(sealed, local_keys(e).find, decompress, LIMIT) == value  # no state
    short = cipher.seal(b"x", sealing(e), compress_zstd)
    assert short[1] == 0 and cipher.open(short, local_keys(e).find, decompress, LIMIT) == b"x"
    # Every byte of it counts: the value, its flags, its key's name, its data key.
    for at in (len(sealed) - 1, len(sealed) - 20, 1, 10, 3):
        changed = bytearray(sealed)
        changed[at] ^= 0x01
        with pytest.raises(Undecryptable):
            RecordCipher().open(bytes(changed), local_keys(e).find, decompress, LIMIT)
    with pytest.raises(Undecryptable, match="KEK 'a' is not in the key file"):
        cipher.open(sealed, keys({"b": sealing(e).key}), decompress, LIMIT)
    with pytest.raises(Undecryptable, match="does not open under KEK 'a'"):
        RecordCipher().open(sealed, keys({"a": os.urandom(32)}), decompress, LIMIT)
    with pytest.raises(Undecryptable, match="not an envelope"):
        cipher.open(b"\x01\x00", local_keys(e).find, decompress, LIMIT)


def test_data_keys_are_renewed_by_use_and_by_age(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    e = encryption(tmp_path)
    now = [0.0]
    cipher = RecordCipher(clock=lambda: now[0])
    monkeypatch.setattr(enc, "DEK_USES", 3)
    edeks = {cipher.seal(b"v", sealing(e))[4:64] for _ in range(7)}
    assert len(edeks) == 3 == cipher.deks_made  # 3 + 3 + 1 values
    now[0] += enc.DEK_SECONDS
    cipher.seal(b"v", sealing(e))
    assert cipher.deks_made == 4


# -- batches -------------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["none", "gzip", "snappy", "lz4", "zstd"])
def test_batches_of_every_codec_sealed_and_opened(tmp_path: Path, codec: str) -> None:
    e = encryption(tmp_path)
    cipher = RecordCipher()
    records = batch((b"k1", SECRET.encode() * 3), (b"k2", None), (None, b"short"),
                    compression=codec, headers=[("trace", b"t")])
    sealed, count = seal_records(records, e, cipher, decompress, compress_zstd)
    assert count == 2  # the tombstone stays a tombstone
    assert SECRET.encode() not in sealed
    [b] = iter_batches(sealed)
    assert isinstance(b, RecordBatch) and b.compression == "none" and b.crc_ok(sealed)
    [original] = iter_batches(records)
    assert isinstance(original, RecordBatch)
    for field in ("base_offset", "last_offset_delta", "base_timestamp", "max_timestamp",
                  "producer_id", "producer_epoch", "base_sequence", "record_count"):
        assert getattr(b, field) == getattr(original, field)
    got = values(sealed)
    assert [(k, h) for k, _, h in got] == [
        (b"k1", (("trace", b"t"), (HEADER, b"\x01"))), (b"k2", (("trace", b"t"),)),
        (None, (("trace", b"t"), (HEADER, b"\x01")))]
    assert got[1][1] is None
    opened = open_records(sealed, local_keys(e).find, RecordCipher(), decompress, LIMIT)
    assert opened.opened == 2 and opened.failed == 0 and opened.records is not None
    assert values(opened.records) == [
        (b"k1", SECRET.encode() * 3, (("trace", b"t"),)), (b"k2", None, (("trace", b"t"),)),
        (None, b"short", (("trace", b"t"),))]


def test_offsets_and_timestamps_of_every_record_kept(tmp_path: Path) -> None:
    """A compacted topic's batch has gaps between offsets: every record's deltas stay,
    and the batch opens to the very bytes the producer sent."""
    e = encryption(tmp_path)
    plain = encode_batch([(TS, b"a", b"1"), (TS + 7, b"b", b"2")], base_offset=40,
                         producer_id=9, producer_epoch=2, base_sequence=11)
    [b] = iter_batches(plain)
    assert isinstance(b, RecordBatch)
    gapped = record_bytes(0, 0, b"a", b"1", []) + record_bytes(7, 5, b"b", b"2", [])
    records = rebuilt_batch(b, gapped)
    sealed, _ = seal_records(records, e, RecordCipher(), decompress, compress_zstd)
    [s] = iter_batches(sealed)
    assert isinstance(s, RecordBatch)
    # Each record begins: its length, attributes, timestamp delta, offset delta.
    section = bytes(records_section(sealed, s))
    deltas, pos = [], 0
    for _ in range(2):
        length, at = read_varint(section, pos)
        timestamp_delta, after = read_varint(section, at + 1)
        deltas.append((timestamp_delta, read_varint(section, after)[0]))
        pos = at + length
    assert deltas == [(0, 0), (7, 5)] and pos == len(section)
    opened = open_records(sealed, local_keys(e).find, RecordCipher(), decompress, LIMIT)
    assert opened.records == records  # byte for byte the batch the producer sent


def test_records_that_cannot_be_sealed(tmp_path: Path) -> None:
    e = encryption(tmp_path)
    cipher = RecordCipher()
    with pytest.raises(Unsealable) as info:
        seal_records(legacy(None, b"v"), e, cipher, decompress, compress_zstd)
    assert info.value.code == enc.UNSUPPORTED_FOR_MESSAGE_FORMAT
    whole = batch((None, b"v"))
    with pytest.raises(Unsealable, match="partial record batch") as info:
        seal_records(whole + whole[:30], e, cipher, decompress, compress_zstd)
    assert info.value.code == enc.CORRUPT_MESSAGE
    broken = bytearray(batch((None, b"v"), compression="zstd"))
    broken[61:65] = bytes(4)  # no zstd frame
    with pytest.raises(Unsealable, match="cannot be read") as info:
        seal_records(bytes(broken), e, cipher, decompress, compress_zstd)
    assert info.value.code == enc.CORRUPT_MESSAGE


def test_what_opening_leaves_as_it_was(tmp_path: Path) -> None:
    """Batches with nothing sealed keep their bytes (compression too); a partial batch
    at the end (the broker's cut) stays; a value under an unknown key stays sealed and
    is counted; a value sealed twice (ciphertext produced again) opens twice."""
    e = encryption(tmp_path)
    cipher = RecordCipher()
    plain = batch((b"k", b"in the clear"), compression="lz4")
    sealed, _ = seal_records(batch((b"k", SECRET.encode())), e, cipher, decompress,
                             compress_zstd)
    twice, _ = seal_records(sealed, e, cipher, decompress, compress_zstd)
    records = plain + sealed + twice + plain[:40]
    opened = open_records(records, local_keys(e).find, cipher, decompress, LIMIT)
    assert opened.opened == 2 and opened.records is not None
    assert opened.records.startswith(plain) and opened.records.endswith(plain[:40])
    assert [v for _, v, _ in values(opened.records)] == [b"in the clear", SECRET.encode(),
                                                         SECRET.encode()]
    assert open_records(plain + plain[:40], local_keys(e).find, cipher, decompress,
                        LIMIT).records is None  # nothing to open: the same bytes go on
    unknown = open_records(sealed, keys({}), cipher, decompress, LIMIT)
    assert unknown.failed == 1 and unknown.records is None
    assert "not in the key file" in (unknown.reason or "")


# -- the policy --------------------------------------------------------------------------------


def produce(records: bytes, topic: str = "payments", version: int = 9, acks: int = -1,
            client_id: str = "app-1", others: bytes | None = None) -> codecs.Request:
    named = {"topic_id": PAYMENTS_ID} if version >= 13 else {"name": topic}
    topics = [{**named, "partition_data": [{"index": 0, "records": records}]}]
    if others is not None:
        topics.append({"name": "orders", "partition_data": [{"index": 1, "records": others}]})
    return req(0, version, client_id, acks=acks, timeout_ms=1000, topic_data=topics)


def fetch(version: int = 12, client_id: str = "app-1", topic: str | None = "payments",
          session: tuple[int, int] = (0, -1)) -> codecs.Request:
    """A Fetch of partition 0 of ``topic`` (None: of nothing), in fetch session
    ``session`` (id, epoch; (0, -1): none)."""
    named = {"topic_id": PAYMENTS_ID} if version >= 13 else {"topic": topic}
    topics = [] if topic is None else [{**named, "partitions": [
        {"partition": 0, "fetch_offset": 0, "partition_max_bytes": 1 << 20}]}]
    rack = {"rack_id": ""} if version >= 11 else {}
    return req(1, version, client_id, replica_id=-1, max_wait_ms=500, min_bytes=1,
               max_bytes=1 << 20, isolation_level=0, session_id=session[0],
               session_epoch=session[1], topics=topics, forgotten_topics_data=[], **rack)


def fetch_answer(records: bytes, version: int = 12, topic: str = "payments"
                 ) -> codecs.Response:
    named = {"topic_id": PAYMENTS_ID} if version >= 13 else {"topic": topic}
    body = {"responses": [{**named, "partitions": [
        {"partition_index": 0, "high_watermark": 10, "records": records}]}]}
    frame = bytes(codecs.response_from_dict({"header": {"correlation_id": 1}, "body": body},
                                            api_key=1, api_version=version).encode())
    return codecs.decode_response(memoryview(frame), 1, version)


def fetched(resp: codecs.Response) -> list[Any]:
    answer = codecs.decode_response(memoryview(bytes(resp.encode())), 1, resp.api_version)
    [topic] = answer.body.responses
    [partition] = topic.partitions
    return values(bytes(partition.records))


def sent_records(decision: Any, topic: int = 0) -> bytes:
    assert isinstance(decision, Forward)
    sent = codecs.decode_request(bytes(decision.request.encode()))  # as the broker reads it
    return bytes(sent.body.topic_data[topic].partition_data[0].records)


def through(policy: RulesPolicy, request: codecs.Request, answer: codecs.Response) -> Any:
    decision = policy.on_request(conn(), request)
    assert isinstance(decision, Forward)
    if not decision.wants_response:
        return answer
    return policy.on_response(conn(), Pending(1, request.api_key, request.api_version, 0.0,
                                              context=decision.context), answer)


def test_produced_values_reach_the_broker_sealed_and_come_back_open(
        policy: RulesPolicy) -> None:
    heard: list[tuple[str, str, str, int]] = []
    policy.encryption_listeners.append(lambda *args: heard.append(args))
    request = produce(batch((b"k", SECRET.encode()), (None, b"2")),
                      others=batch((None, b"orders in the clear")))
    decision = policy.on_request(conn(), request)
    stored = sent_records(decision)
    assert SECRET.encode() not in stored
    assert [v for _, v, _ in values(sent_records(decision, 1))] == [b"orders in the clear"]
    assert heard == [("payments-encrypted", "payments", "encrypted", 2)]
    # The rule's consumers read it in the clear; its topic's other partitions too.
    answer = through(policy, fetch(), fetch_answer(stored))
    assert [v for _, v, _ in fetched(answer)] == [SECRET.encode(), b"2"]
    assert heard[-1] == ("payments-encrypted", "payments", "decrypted", 2)
    # Clients the rule does not match get what the broker holds.
    other = through(policy, fetch(client_id="analytics"), fetch_answer(stored))
    assert SECRET.encode() not in bytes(other.encode())
    decision = policy.on_request(conn(), produce(batch((None, b"x")), client_id="batch-job"))
    assert isinstance(decision, Forward) and sent_records(decision) == batch((None, b"x"))


def test_topics_the_rule_does_not_hold_pass_untouched(policy: RulesPolicy) -> None:
    request = produce(batch((None, b"plain")), topic="orders")
    decision = policy.on_request(conn(), request)
    assert isinstance(decision, Forward) and decision.request is request
    # A Fetch of other topics only: its answer goes on unread.
    decision = policy.on_request(conn(), fetch(topic="orders"))
    assert isinstance(decision, Forward) and not decision.wants_response
    answer = fetch_answer(batch((None, b"plain")), topic="orders")
    assert through(policy, fetch(topic="orders"), answer) is answer


def test_a_fetch_in_a_session_is_answered_for_topics_it_does_not_name(
        policy: RulesPolicy) -> None:
    """KIP-227: past its first request, a fetch session's requests name only what
    changed (often nothing), and the broker answers for every topic of the session."""
    stored = sent_records(policy.on_request(conn(), produce(batch((None, SECRET.encode())))))
    for session in ((7, 1), (7, 12)):
        request = fetch(topic=None, session=session)
        decision = policy.on_request(conn(), request)
        assert isinstance(decision, Forward) and decision.wants_response
        assert [v for _, v, _ in fetched(through(policy, request, fetch_answer(stored)))] == [
            SECRET.encode()]
    # Its first request names every topic of the session.
    decision = policy.on_request(conn(), fetch(topic="orders", session=(0, 0)))
    assert isinstance(decision, Forward) and not decision.wants_response


def test_a_partition_that_cannot_be_sealed_is_refused_and_never_sent(
        policy: RulesPolicy) -> None:
    request = produce(legacy(None, SECRET.encode()), others=batch((None, b"o")))
    decision = policy.on_request(conn(), request)
    assert isinstance(decision, Forward)
    assert [t.name for t in decision.request.body.topic_data] == ["orders"]
    answer = policy.on_response(conn(), Pending(1, 0, 9, 0.0, context=decision.context),
                                error_response(decision.request, 0))
    codes = {k: p.error_code for k, p in partitions(answer).items()}
    assert codes == {("payments", 0): enc.UNSUPPORTED_FOR_MESSAGE_FORMAT, ("orders", 1): 0}
    alone = policy.on_request(conn(), produce(legacy(None, SECRET.encode())))
    assert isinstance(alone, Respond)
    closed = policy.on_request(conn(), produce(legacy(None, SECRET.encode()), acks=0))
    assert isinstance(closed, Close) and "acks=0" in closed.reason


def test_topics_named_by_id_are_sealed_once_their_ids_are_learned(policy: RulesPolicy) -> None:
    request = produce(batch((None, SECRET.encode())), version=13)
    refused = policy.on_request(conn(), request)
    assert isinstance(refused, Respond)  # not sent in the clear to what may be payments
    assert {p.error_code for p in partitions(refused.response).values()} == {UNKNOWN_TOPIC_ID}
    metadata = req(3, 12, "app-1", topics=None, allow_auto_topic_creation=False,
                   include_topic_authorized_operations=False)
    learned = policy.on_request(conn(), metadata)
    assert isinstance(learned, Forward) and learned.wants_response
    policy.on_response(conn(), Pending(1, 3, 12, 0.0, context=learned.context),
                       metadata_answer(("payments", PAYMENTS_ID)))
    stored = sent_records(policy.on_request(conn(), request))
    assert SECRET.encode() not in stored
    answer = through(policy, fetch(version=13), fetch_answer(stored, version=13))
    assert [v for _, v, _ in fetched(answer)] == [SECRET.encode()]


def test_a_fetch_of_an_unknown_id_opens_with_every_key(tmp_path: Path) -> None:
    """Opening needs no topic: a value names its key, and an id not learned yet may be
    a topic the rule holds."""
    key_file(tmp_path, **{"pay-1": new_key()})
    policy = RulesPolicy(load_rules_file(rules_file(tmp_path)))
    warm = RulesPolicy(load_rules_file(rules_file(tmp_path)))
    warm.on_response(conn(), Pending(1, 3, 12, 0.0, context=warm.on_request(
        conn(), req(3, 12, "app-1", topics=None, allow_auto_topic_creation=False,
                    include_topic_authorized_operations=False)).context),  # type: ignore[union-attr]
        metadata_answer(("payments", PAYMENTS_ID)))
    stored = sent_records(warm.on_request(conn(), produce(batch((None, SECRET.encode())),
                                                          version=13)))
    answer = through(policy, fetch(version=13), fetch_answer(stored, version=13))
    assert [v for _, v, _ in fetched(answer)] == [SECRET.encode()]


def test_under_a_tenant_prefix_the_rule_names_topics_as_the_client_does(
        tmp_path: Path) -> None:
    key_file(tmp_path, **{"pay-1": new_key()})
    path = rules_file(tmp_path, extra="    topic_prefix: tenant-a.\n")
    policy = RulesPolicy(load_rules_file(path))
    decision = policy.on_request(conn(), produce(batch((None, SECRET.encode()))))
    assert isinstance(decision, Forward)
    assert decision.request.body.topic_data[0].name == "tenant-a.payments"
    stored = sent_records(decision)
    assert SECRET.encode() not in stored
    answer = through(policy, fetch(), fetch_answer(stored, topic="tenant-a.payments"))
    body = codecs.decode_response(memoryview(bytes(answer.encode())), 1, 12).body
    assert body.responses[0].topic == "payments"
    assert [v for _, v, _ in fetched(answer)] == [SECRET.encode()]


def test_large_messages_are_sealed_and_opened_in_a_thread(
        policy: RulesPolicy, monkeypatch: pytest.MonkeyPatch) -> None:
    import gatehouse.proxy.policy as policy_module

    calls: list[str] = []
    for name in ("seal_request", "open_answer"):
        real = getattr(policy_module, name)
        monkeypatch.setattr(policy_module, name, lambda *a, _r=real, _n=name, **k: (
            calls.append(_n), _r(*a, **k))[1])
    big = batch(*[(None, SECRET.encode() * 40)] * 200)
    request = produce(big)
    assert len(request.frame or b"") >= 64 * 1024
    connection = conn()
    work = policy.offload(connection, request)
    assert work is not None
    work()
    made = policy.cipher.deks_made
    decision = policy.on_request(connection, request)
    stored = sent_records(decision)
    assert SECRET.encode() not in stored and policy.cipher.deks_made == made
    assert calls == ["seal_request"]  # sealed once, in the work
    assert not [k for k in connection.state if k.startswith("encrypt")]  # nothing held
    assert policy.offload(conn(), produce(batch((None, b"x")))) is None  # small: inline
    fetch_request = fetch()
    decision = policy.on_request(connection, fetch_request)
    assert isinstance(decision, Forward)
    broker = fetch_answer(stored)
    pending = Pending(1, 1, 12, 0.0, context=decision.context)
    work = policy.offload_response(connection, pending, broker)
    assert work is not None
    work()
    answer = policy.on_response(connection, pending, broker)
    assert [v for _, v, _ in fetched(answer)] == [SECRET.encode() * 40] * 200
    assert calls == ["seal_request", "open_answer"]
    assert not [k for k in connection.state if k.startswith("encrypt")]


def test_a_new_key_in_the_key_file_reloads_the_rules_and_old_records_still_open(
        tmp_path: Path) -> None:
    old = new_key()
    key_file(tmp_path, **{"pay-1": old})
    path = rules_file(tmp_path)
    policy = RulesPolicy(load_rules_file(path))
    reloader = Reloader(policy, RulesSource(None, path))
    stored = sent_records(policy.on_request(conn(), produce(batch((None, b"before"))), ))
    # Rotation: a new key, the rule switched to it, the old one kept for what it sealed.
    key_file(tmp_path, **{"pay-1": old, "pay-2": new_key()})
    path.write_text(path.read_text().replace("key: pay-1", "key: pay-2"))
    assert reloader.changed() and reloader.reload()
    after = sent_records(policy.on_request(conn(), produce(batch((None, b"after")))))
    assert b"pay-2" in after and b"pay-1" in stored
    for records, value in ((stored, b"before"), (after, b"after")):
        assert [v for _, v, _ in fetched(through(policy, fetch(), fetch_answer(records)))] == [
            value]
    # A broken key file keeps the rules (and keys) in force.
    (tmp_path / "keys.yaml").write_text("keys:\n  pay-2: nope\n")
    assert reloader.changed() and not reloader.reload()
    assert "keys.yaml:2" in (reloader.last_error or "")
    assert [v for _, v, _ in fetched(through(policy, fetch(), fetch_answer(after)))] == [
        b"after"]


def test_the_readme_rules_example_parses(tmp_path: Path) -> None:
    """The rules block of the README's Rules section, as a user copies it (with the key
    file it names beside it)."""
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    section = readme.split("## Rules", 1)[1]
    block = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "rules.yaml").write_text(block)
    key_file(tmp_path, **{"pay-2026": new_key()})
    ruleset = load_rules_file(tmp_path / "rules.yaml")
    [encrypting] = [r for r in ruleset.rules if r.encrypt_records is not None]
    assert encrypting.encrypt_records is not None
    assert encrypting.encrypt_records.applies_to("payments.eu")


def test_check_warns_of_a_rule_that_decrypts_for_whoever_claims_a_client_id(
        tmp_path: Path) -> None:
    key_file(tmp_path, **{"pay-1": new_key()}).chmod(0o600)
    [advice] = load_rules_file(rules_file(tmp_path)).advice()
    assert advice.startswith(f"{tmp_path / 'rules.yaml'}:2: rule payments-encrypted: decrypts "
                             "records for the clients it matches")
    by_principal = rules_file(tmp_path).read_text().replace(
        "match: {client_id: '^app'}", "match: {principal: '^app'}")
    (tmp_path / "rules.yaml").write_text(by_principal)
    assert load_rules_file(tmp_path / "rules.yaml").advice() == []


def recompressed(records: bytes, codec: str) -> bytes:
    """A batch as a broker writes it under a topic's compression.type."""
    import cramjam

    [b] = iter_batches(records)
    assert isinstance(b, RecordBatch)
    section = bytes(records_section(records, b))
    packed = bytes({"lz4": cramjam.lz4.compress, "zstd": cramjam.zstd.compress}[codec](section))
    return rebuilt_batch(b, packed, codec)


def test_a_batch_the_broker_compressed_goes_out_compressed(tmp_path: Path) -> None:
    e = encryption(tmp_path)
    sealed, _ = seal_records(batch(*[(None, SECRET.encode())] * 50), e, RecordCipher(),
                             decompress, compress_zstd)
    stored = recompressed(sealed, "lz4")
    opened = open_records(stored, local_keys(e).find, RecordCipher(), decompress, LIMIT,
                          ("zstd", compress_zstd))
    assert opened.records is not None
    [b] = iter_batches(opened.records)
    assert isinstance(b, RecordBatch) and b.compression == "zstd"
    assert len(opened.records) < len(batch(*[(None, SECRET.encode())] * 50))
    assert [v for _, v, _ in values(opened.records)] == [SECRET.encode()] * 50


@pytest.mark.parametrize(("version", "codec"), [(9, "gzip"), (12, "zstd")])
def test_fetch_answers_keep_a_codec_the_client_reads(policy: RulesPolicy, version: int,
                                                     codec: str) -> None:
    """zstd only from Fetch v10 (as brokers hold to: older clients cannot read it)."""
    stored = recompressed(sent_records(policy.on_request(
        conn(), produce(batch(*[(None, SECRET.encode())] * 20)))), "lz4")
    answer = through(policy, fetch(version=version), fetch_answer(stored, version=version))
    body = codecs.decode_response(memoryview(bytes(answer.encode())), 1, version).body
    records = bytes(body.responses[0].partitions[0].records)
    [b] = iter_batches(records)
    assert isinstance(b, RecordBatch) and b.compression == codec
    assert [v for _, v, _ in values(records)] == [SECRET.encode()] * 20


def test_check_says_what_is_encrypted_and_warns(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from gatehouse.cli import main

    key_file(tmp_path, **{"pay-1": new_key(), "pay-0": new_key()})
    rules = rules_file(tmp_path)
    config = tmp_path / "gatehouse.yaml"
    config.write_text(f"listen: 127.0.0.1:9192\nupstream: [127.0.0.1:9092]\n"
                      f"rules_file: {rules}\n")
    assert main(["check", "--config", str(config)]) == 0
    out, err = capsys.readouterr()
    assert (f"encrypt_records (rule payments-encrypted): values of topics matching payments, "
            f"pay\\..* encrypted under key 'pay-1' of {tmp_path / 'keys.yaml'} (2 keys, any "
            "of which decrypts), for the clients the rule matches") in out
    assert "decrypts records for the clients it matches, but tells clients apart" in err
    (tmp_path / "keys.yaml").write_text("keys:\n  pay-1: short\n")
    assert main(["check", "--config", str(config)]) == 1
    assert "keys.yaml:2: key 'pay-1' is not base64" in capsys.readouterr().err


def test_check_warns_of_a_key_file_others_may_read(tmp_path: Path) -> None:
    keys = key_file(tmp_path, **{"pay-1": new_key()})
    path = rules_file(tmp_path, extra="")
    path.write_text(path.read_text().replace("    match: {client_id: '^app'}\n", ""))
    keys.chmod(0o644)
    [advice] = load_rules_file(path).advice()
    assert advice.endswith(f"its key file {keys} is readable by other users: chmod 600 it "
                           "(a Kubernetes Secret: defaultMode: 0400)")
    keys.chmod(0o640)
    assert load_rules_file(path).advice() == []


def test_records_that_do_not_decrypt_are_counted_and_logged_once_a_minute(
        policy: RulesPolicy, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    other = tmp_path / "other"
    other.mkdir()
    foreign = encryption(other)  # a key this proxy does not have
    stored, _ = seal_records(batch((None, SECRET.encode()), (None, b"2")), foreign,
                             RecordCipher(), decompress, compress_zstd)
    heard: list[tuple[str, str, str, int]] = []
    policy.encryption_listeners.append(lambda *args: heard.append(args))
    caplog.set_level(logging.WARNING, logger="gatehouse.rules")
    for _ in range(3):
        answer = through(policy, fetch(), fetch_answer(stored))
        assert SECRET.encode() not in bytes(answer.encode())  # passed on as stored
    assert heard == [("payments-encrypted", "payments", "undecryptable", 2)] * 3
    lines = [r.gatehouse_fields for r in caplog.records  # type: ignore[attr-defined]
             if r.getMessage() == "records not decrypted: passed on encrypted"]
    assert lines == [{"rule": "payments-encrypted", "topic": "payments", "records": 2,
                      "reason": "KEK 'a' is not in the key file"}]
    assert SECRET not in caplog.text


def test_a_changed_value_in_a_later_batch_is_caught_on_the_fast_path(tmp_path: Path) -> None:
    """From a batch's second on, values under the DEK of the one before go straight to
    the AES; one that was changed still fails its tag, and is counted, not opened."""
    e = encryption(tmp_path)
    cipher = RecordCipher()
    first, _ = seal_records(batch(*[(None, b"first %d" % i) for i in range(3)]), e, cipher,
                            decompress, compress_zstd)
    second, _ = seal_records(batch(*[(None, b"second %d" % i) for i in range(3)]), e, cipher,
                             decompress, compress_zstd)
    [b] = iter_batches(second)
    assert isinstance(b, RecordBatch)
    section = bytearray(records_section(second, b))
    value = [v for _, v, _ in values(second)][1]
    assert value is not None and section.count(value) == 1
    section[section.index(value) + len(value) - 1] ^= 1  # its tag's last byte
    changed = rebuilt_batch(b, bytes(section))
    value = value[:-1] + bytes((value[-1] ^ 1,))
    opened = open_records(first + changed, local_keys(e).find, RecordCipher(), decompress, LIMIT)
    assert (opened.opened, opened.failed) == (5, 1)
    assert opened.reason == "the value does not open under its DEK (changed?)"
    assert opened.records is not None
    assert [v for _, v, _ in values(opened.records)][3:] == [b"second 0", bytes(value),
                                                            b"second 2"]


def test_values_open_in_c_as_they_do_in_python(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The AES-256-GCM opening in C (rules/_aead.c, built here with OpenSSL's headers)
    writes the records the Python AESGCM path writes, byte for byte: values of every
    size, empty ones, other headers kept, a tombstone, a value sealed twice."""
    assert enc._gcm_opener is not None, "gatehouse.rules._aead was not built"
    e = encryption(tmp_path)
    cipher = RecordCipher()
    sizes = [0, 1, 15, 16, 17, 100, 1024, 5000]
    batches = [seal_records(batch(*[(b"k%d" % n, os.urandom(n)) for n in sizes],
                                  (b"gone", None)), e, cipher, decompress, compress_zstd)[0]
               for _ in range(3)]
    twice, _ = seal_records(batches[0], e, cipher, decompress, compress_zstd)
    records = b"".join(batches) + twice
    in_c = open_records(records, local_keys(e).find, RecordCipher(), decompress, LIMIT)
    monkeypatch.setattr(enc, "_gcm_opener", None)
    in_python = open_records(records, local_keys(e).find, RecordCipher(), decompress, LIMIT)
    assert in_c.records is not None and in_c.records == in_python.records
    assert (in_c.opened, in_c.failed) == (in_python.opened, in_python.failed) == (
        len(sizes) * 4, 0)
    assert all(HEADER not in [k for k, _ in h] for _, _, h in values(in_c.records))


def count_c_calls(monkeypatch: pytest.MonkeyPatch, name: str
                  ) -> tuple[list[tuple[int, int]], Callable[..., Any]]:
    """``gatehouse.codecs.records``' C function ``name`` (``_C_OPEN_BATCHES``,
    ``_C_SEAL_BATCHES``) put behind one that notes each call's (at, next_at); the notes
    and that function."""
    from gatehouse.codecs import records as records_module

    calls: list[tuple[int, int]] = []
    real = getattr(records_module, name)
    assert real is not None, "gatehouse.codecs._speedups was not built"

    def counted(data: Any, at: int, *args: Any) -> Any:
        done = real(data, at, *args)
        calls.append((at, done[1]))
        return done

    monkeypatch.setattr(records_module, name, counted)
    return calls, counted


def test_whole_batches_open_in_c_as_they_do_batch_by_batch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``open_batches`` (batch after batch in C, no GIL) writes the records field that
    ``rewrite_values`` batch by batch writes, and hands back each batch it does not
    take: another data key, a plain batch amid sealed ones, a compressed batch, a value
    changed on the way (counted, left sealed), a value sealed twice, the partial batch
    the broker cut at the end."""
    from gatehouse.codecs import records as records_module

    e = encryption(tmp_path)
    first, second = RecordCipher(), RecordCipher()  # two data keys

    def sealed(cipher: RecordCipher, *values: bytes | None, compression: str = "none"
               ) -> bytes:
        plain = batch(*[(b"k%d" % i if i % 2 else None, v) for i, v in enumerate(values)],
                      compression=compression)
        return seal_records(plain, e, cipher, decompress, compress_zstd)[0] or b""

    tampered = bytearray(sealed(first, b"one", b"two", b"three"))
    tampered[-40] ^= 1  # inside the last value's ciphertext
    parts = [sealed(first, b"a", b"b"), sealed(first, b"c" * 500, None, b"", b"d"),
             batch((None, b"plain"), (b"k", b"text")), sealed(first, b"e"),
             sealed(second, b"f", b"g"), sealed(second, b"h" * 3000),
             sealed(first, b"i" * 2000, b"j", compression="zstd"), sealed(first, b"k"),
             bytes(tampered), sealed(first, b"l"),
             seal_records(sealed(first, b"twice"), e, first, decompress, compress_zstd)[0]
             or b"", sealed(first, b"m", b"n")]
    records = b"".join(parts) + sealed(first, b"cut")[:40]
    calls, counted = count_c_calls(monkeypatch, "_C_OPEN_BATCHES")
    whole = open_records(records, local_keys(e).find, RecordCipher(), decompress, LIMIT)
    monkeypatch.setattr(records_module, "_C_OPEN_BATCHES", None)
    by_batch = open_records(records, local_keys(e).find, RecordCipher(), decompress, LIMIT)
    assert whole.records is not None and whole.records == by_batch.records
    assert (whole.opened, whole.failed, whole.reason) == (
        by_batch.opened, by_batch.failed, by_batch.reason) == (
        18, 1, "the value does not open under its DEK (changed?)")
    # What C took: from the first batch (its data key learnt from its first value) to
    # the first of another key, the second key's second batch alone (a compressed one
    # next), from "k" to the changed value, and so on, the last run with the batch cut
    # at the end (kept as it came); a batch C hands back is never half taken.
    starts = [0]
    for part in parts:
        starts.append(starts[-1] + len(part))
    assert calls == [(starts[0], starts[4]), (starts[5], starts[6]), (starts[7], starts[8]),
                     (starts[9], starts[10]), (starts[11], len(records))]
    # A tail that is no cut batch (a negative length) is not kept: both ways refuse it.
    for c_version in (counted, None):
        monkeypatch.setattr(records_module, "_C_OPEN_BATCHES", c_version)
        with pytest.raises(codecs.errors.RemoteProtocolError, match="negative length"):
            open_records(records[:starts[12]] + b"\xff" * 20, local_keys(e).find,
                         RecordCipher(), decompress, LIMIT)
    opened = [v for _, v, _ in values(whole.records)]
    assert opened[:4] == [b"a", b"b", b"c" * 500, None]
    assert b"twice" in opened and b"m" in opened and b"n" in opened


def test_a_field_opened_whole_in_c_is_the_field_opened_batch_by_batch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every batch of a field under one data key, opened by one ``open_batches`` call
    (its bytes given back as they are, not joined again), and batch by batch."""
    from gatehouse.codecs import records as records_module

    e = encryption(tmp_path)
    cipher = RecordCipher()
    records = b"".join(seal_records(batch(*[(b"k", b"v%d.%d" % (n, i) * 30) for i in range(8)]),
                                    e, cipher, decompress, compress_zstd)[0] or b""
                       for n in range(5))
    whole = open_records(records, local_keys(e).find, RecordCipher(), decompress, LIMIT)
    monkeypatch.setattr(records_module, "_C_OPEN_BATCHES", None)
    by_batch = open_records(records, local_keys(e).find, RecordCipher(), decompress, LIMIT)
    assert isinstance(whole.records, bytes) and whole.records == by_batch.records
    assert whole.opened == by_batch.opened == 40
    assert [v for _, v, _ in values(whole.records)][-1] == b"v4.7" * 30


def test_whole_batches_seal_in_c_as_they_do_batch_by_batch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``seal_batches`` (a partition's batches sealed in C in one call, no GIL, under one
    run of nonces) writes, byte for byte, what the batch-by-batch sealing writes under
    the same data key and nonces (its uses rewound here): keys, headers, values of every
    size."""
    from gatehouse.codecs import records as records_module

    e = encryption(tmp_path)
    cipher = RecordCipher()
    sizes = [1, 15, 16, 17, 100, 1024, 5000]
    records = b"".join(batch(*[(b"k%d" % n, os.urandom(n)) for n in sizes]) for _ in range(4))
    calls, _ = count_c_calls(monkeypatch, "_C_SEAL_BATCHES")
    whole, count = seal_records(records, e, cipher, decompress, compress_zstd)
    assert calls == [(0, len(records))] and count == 4 * len(sizes)
    [dek] = cipher._deks.values()
    dek.uses = 0  # the same nonces again (never done outside this test)
    monkeypatch.setattr(records_module, "_C_SEAL_BATCHES", None)
    by_batch, again = seal_records(records, e, cipher, decompress, compress_zstd)
    assert again == count and whole == by_batch


def test_sealing_in_c_hands_back_what_it_does_not_take_and_never_reuses_a_nonce(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compressed batch amid plain ones is sealed its own way and C goes on after it;
    null values stay null; every value opens to what was produced, and no two carry the
    same nonce."""

    e = encryption(tmp_path)
    cipher = RecordCipher()
    parts = [batch((None, b"a"), (b"k", None), (None, b"b")),
             batch((None, b"c" * 3000), (None, b"d"), compression="zstd"),
             batch((b"k", b"e"), (None, b"f")), batch((None, None)),
             batch((None, b"g" * 100))]
    records = b"".join(parts)
    calls, _ = count_c_calls(monkeypatch, "_C_SEAL_BATCHES")
    sealed, count = seal_records(records, e, cipher, decompress, compress_zstd)
    starts = list(itertools.accumulate(len(p) for p in parts))
    assert calls == [(0, starts[0]), (starts[1], starts[4])] and count == 7
    envelopes = [v for _, v, _ in values(sealed or b"") if v is not None]
    assert len(envelopes) == 7
    nonces = []
    for envelope in envelopes:  # version, flags, KEK name, EDEK, then the nonce
        at = 3 + envelope[2]
        assert not envelope[1] & enc.WIDE
        at += 1 + envelope[at]
        nonces.append(envelope[at : at + 12])
    assert len(set(nonces)) == 7
    opened = open_records(sealed, local_keys(e).find, RecordCipher(), decompress, LIMIT)
    assert opened.records is not None
    assert [v for _, v, _ in values(opened.records)] == [
        v for _, v, _ in values(records)]


def test_values_sealed_in_c_as_they_are_in_python(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The AES-256-GCM sealing in C (rules/_aead.c) writes, byte for byte, the batch the
    Python sealer writes under the same data key and nonces (its uses rewound here to
    seal the batch again): values of every size, empty ones, a tombstone, headers."""
    assert enc._gcm_sealer is not None, "gatehouse.rules._aead was not built"
    e = encryption(tmp_path)
    cipher = RecordCipher()
    sizes = [0, 1, 15, 16, 17, 100, 1024, 5000]
    plain = batch(*[(b"k%d" % n, os.urandom(n)) for n in sizes], (b"gone", None))
    in_c, count = seal_records(plain, e, cipher, decompress, compress_zstd)
    [dek] = cipher._deks.values()
    dek.uses = 0  # the same nonces again (never done outside this test)
    monkeypatch.setattr(enc, "_gcm_sealer", None)
    in_python, again = seal_records(plain, e, cipher, decompress, compress_zstd)
    assert (count, again) == (len(sizes), len(sizes)) and in_c == in_python
    opened = open_records(in_c, local_keys(e).find, RecordCipher(), decompress, LIMIT)
    assert opened.records is not None
    assert values(opened.records) == values(plain)
    # A sealer runs out of nonces rather than reuse one.
    from gatehouse.rules._aead import gcm_sealer

    sealer = gcm_sealer(os.urandom(32), b"salt", 0, 1)
    with pytest.raises(RuntimeError, match="no nonce left"):
        rewrite_values(records_section(plain, next(iter_batches(plain))), len(sizes) + 1,
                       bytes, add=(b"h", b"1"), sealer=(b"head", sealer))


def _longest_stall(call: Callable[[], Any]) -> tuple[float, float]:
    """The longest another Python thread went without going round its loop while
    ``call`` ran, and how long that was: about all of it where ``call`` holds the GIL
    throughout, no more than a switch interval or two (5 ms each) where it lets go."""
    ticks: list[float] = []
    done = threading.Event()

    def tick() -> None:
        while not done.is_set():
            ticks.append(time.perf_counter())

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        while not ticks:  # the ticker running first
            time.sleep(0)
        began = time.perf_counter()
        call()
        ended = time.perf_counter()
    finally:
        done.set()
        ticker.join()
    during = [began] + [t for t in ticks if began < t < ended] + [ended]
    return max(b - a for a, b in itertools.pairwise(during)), ended - began


@pytest.mark.parametrize("way", ["open", "seal", "open_batches", "seal_batches"])
def test_values_are_opened_and_sealed_in_c_without_the_gil(tmp_path: Path, way: str) -> None:
    """A batch's values opened (or sealed) in C, by ``rewrite_values`` or a partition's
    at once, let the GIL go meanwhile: the event loop goes on while a worker thread
    opens a large Fetch answer.  Another thread's loop goes round while one batch of
    64 MB is done (about 80 ms here)."""
    from gatehouse.codecs.records import open_batches, seal_batches

    count = 1024
    assert enc._gcm_opener is not None, "gatehouse.rules._aead was not built"
    e = encryption(tmp_path)
    cipher = RecordCipher()
    plain = batch(*[(None, os.urandom(64 * 1024)) for _ in range(count)])
    sealed, _ = seal_records(plain, e, cipher, decompress, compress_zstd)
    if way == "open":
        [b] = iter_batches(sealed)
        assert isinstance(b, RecordBatch)
        section = records_section(sealed, b)
        opener = cipher.opener(local_keys(e).find, decompress, LIMIT)
        opener.learn(next(v for _, v, _ in values(sealed)))
        fast = opener.fast()
        assert fast is not None and fast[3] is not None  # the C opener

        def work() -> None:
            _, opened = rewrite_values(section, count, opener, strip=HEADER.encode(),
                                       fast=fast)
            assert opened == count
    elif way == "open_batches":
        opener = cipher.opener(local_keys(e).find, decompress, LIMIT)
        opener.learn(next(v for _, v, _ in values(sealed)))
        fast = opener.fast()
        assert fast is not None

        def work() -> None:
            done = open_batches(sealed, 0, fast, HEADER.encode())
            assert done is not None and done[1:] == (len(sealed), count)
    elif way == "seal_batches":

        def work() -> None:
            done = seal_batches(plain, 0, in_c, (HEADER.encode(), b"1"))
            assert done is not None and done[1:] == (len(plain), count)

        _, in_c = cipher.batch_sealer(sealing(e), count)
        assert in_c is not None
    else:
        [b] = iter_batches(plain)
        assert isinstance(b, RecordBatch)
        section = records_section(plain, b)

        def work() -> None:
            _, sealed_count = rewrite_values(section, count, seal,
                                             add=(HEADER.encode(), b"1"), sealer=in_c)
            assert sealed_count == count

        seal, in_c = cipher.batch_sealer(sealing(e), count)
        assert in_c is not None  # the C sealer
    stall, took = _longest_stall(work)
    assert stall < took / 4, (stall, took)


@dataclasses.dataclass(frozen=True)
class WideKek(LocalKek):
    """A KEK whose EDEKs are longer than 255 bytes (as a KMS's may be)."""

    def new_dek(self) -> tuple[bytes, bytes]:
        secret, edek = super().new_dek()
        return secret, edek + bytes(300)

    def unwrap(self, edek: bytes) -> bytes:
        assert edek.endswith(bytes(300))
        return super().unwrap(edek[:-300])


@pytest.mark.parametrize("in_c", [True, False])
def test_a_long_edek_is_carried_with_a_two_byte_length(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_c: bool) -> None:
    if not in_c:
        monkeypatch.setattr(enc, "_gcm_opener", None)
        monkeypatch.setattr(enc, "_gcm_sealer", None)
    e = encryption(tmp_path)
    kek = WideKek("a", sealing(e).key)
    sent = [(None, b"v%d" % i * 40) for i in range(5)]
    sealed, _ = seal_records(batch(*sent), e, RecordCipher(), decompress, compress_zstd, kek)
    [first, *_] = [v for _, v, _ in values(sealed)]
    assert first is not None and first[1] == enc.WIDE and len(first) > 300
    opened = open_records(sealed, lambda name: kek if name == "a" else None, RecordCipher(),
                          decompress, LIMIT)
    assert opened.records is not None and values(opened.records) == values(batch(*sent))


def test_a_null_records_field_stays_null(policy: RulesPolicy) -> None:
    """A Produce partition with no records (null) goes on as it came, for the broker to
    answer as it answers one (not turned into an empty records field)."""
    decision = policy.on_request(conn(), produce(None))  # type: ignore[arg-type]
    assert isinstance(decision, Forward)
    sent = codecs.decode_request(bytes(decision.request.encode()))
    assert sent.body.topic_data[0].partition_data[0].records is None


def test_a_data_key_opened_for_one_key_is_not_served_to_another_of_its_name(
        tmp_path: Path) -> None:
    """Two rules whose key files each hold a key named ``a`` (different keys), one
    proxy: records sealed under the first open for its clients, and still not for the
    second's, though the proxy keeps the data key it opened."""
    e = encryption(tmp_path)
    cipher = RecordCipher()
    sealed, _ = seal_records(batch((None, SECRET.encode())), e, cipher, decompress,
                             compress_zstd)
    mine = open_records(sealed, local_keys(e).find, cipher, decompress, LIMIT)
    assert mine.opened == 1
    theirs = open_records(sealed, keys({"a": os.urandom(32)}), cipher, decompress, LIMIT)
    assert (theirs.opened, theirs.failed, theirs.records) == (0, 1, None)
    assert "does not open under KEK 'a'" in (theirs.reason or "")
