"""``encrypt_records.kms``: data keys made and opened by AWS KMS (moto's KMS server on a
real socket, tests/support/kms.py), the KEK never at the proxy; the KMS asked only in
threads, ahead of need; a KMS that hangs or refuses answered retriably, never with
records in the clear or ciphertext handed over as values."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from gatehouse import codecs
from gatehouse.compression import compress_zstd, decompress
from gatehouse.proxy.hooks import Forward, Pending, Respond
from gatehouse.proxy.kms import AwsKek, KmsClients
from gatehouse.proxy.policy import RulesPolicy
from gatehouse.rules import error_response, load_rules_file
from gatehouse.rules.encryption import (
    KMS_BACKOFF_SECONDS,
    KmsNeeded,
    KmsSpec,
    KmsUnavailable,
    RecordCipher,
    RecordEncryption,
    Undecryptable,
    open_answer,
    open_records,
    seal_records,
)
from gatehouse.rules.errors import REQUEST_TIMED_OUT, UNKNOWN_SERVER_ERROR, UNKNOWN_TOPIC_ID
from tests.support.kms import CREDENTIALS, REGION, KmsServer, kms_server
from tests.test_rules import req
from tests.test_rules_encryption import (
    LIMIT,
    PAYMENTS_ID,
    SECRET,
    fetch,
    fetch_answer,
    fetched,
    key_file,
    new_key,
    produce,
    sent_records,
    values,
)
from tests.test_rules_records import batch, partitions
from tests.test_rules_topic_filter import conn


@pytest.fixture(scope="module")
def kms(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KmsServer]:
    with kms_server(tmp_path_factory.mktemp("kms") / "moto.log") as server:
        yield server


@pytest.fixture(autouse=True)
def aws_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)


@pytest.fixture(scope="module")
def alias(kms: KmsServer) -> str:
    kms.new_key("alias/payments")
    return "alias/payments"


class Clock:
    """The cipher's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def spec(kms: KmsServer, key: str, timeout: float = 5.0) -> KmsSpec:
    return KmsSpec("aws", key, REGION, kms.endpoint, timeout)


def encryption_under(made: KmsSpec) -> RecordEncryption:
    """Every topic's values sealed under a key of the KMS ``made`` says."""
    return RecordEncryption(None, made.kek_name, None, LIMIT, made)


def kms_encryption(kms: KmsServer, key: str, timeout: float = 5.0) -> RecordEncryption:
    return encryption_under(spec(kms, key, timeout))


def kms_rules(tmp_path: Path, kms: KmsServer, key: str, timeout: float = 5.0,
              key_file_line: str = "") -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text("rules:\n"
                    "  - name: payments-encrypted\n"
                    "    match: {principal: '^app'}\n"
                    "    encrypt_records:\n"
                    "      topics: [payments]\n"
                    "      kms:\n"
                    "        type: aws\n"
                    f"        key: {key}\n"
                    f"        region: {REGION}\n"
                    f"        endpoint: {kms.endpoint}\n"
                    f"        timeout_seconds: {timeout}\n" + key_file_line)
    return path


def app_conn() -> object:
    c = conn()
    c.principal = "app-1"  # type: ignore[attr-defined]
    return c


# -- the KMS's KEK --------------------------------------------------------------------------


def test_a_data_key_made_by_the_kms_opens_only_under_its_name(kms: KmsServer,
                                                              alias: str) -> None:
    clients = KmsClients()
    kek = clients.keys_of(kms_encryption(kms, alias)).sealing
    assert isinstance(kek, AwsKek) and kek.remote and kek.name == f"aws-kms:{alias}"
    secret, edek = kek.new_dek()
    assert len(secret) == 32 and secret not in edek
    assert kek.unwrap(edek) == secret
    # The EDEK is bound to the name it travels under (the encryption context).
    other = clients.client(spec(kms, alias)).kek("aws-kms:" + kms.new_key())
    with pytest.raises((Undecryptable, KmsUnavailable)):
        other.unwrap(edek)
    changed = bytearray(edek)
    changed[-1] ^= 1
    with pytest.raises(Undecryptable, match="does not open its data key"):
        kek.unwrap(bytes(changed))
    with pytest.raises(KmsUnavailable, match="NotFoundException"):
        clients.client(spec(kms, "alias/none")).kek("aws-kms:alias/none").new_dek()
    # The alias of that name in another region (or behind another endpoint) is another
    # KEK: the DEKs one opened are not the other's to use.
    elsewhere = KmsSpec("aws", alias, "us-east-1", None, 5.0)
    assert clients.client(elsewhere).kek(kek.name) != kek
    assert clients.client(spec(kms, alias)).kek(kek.name) == kek


def test_a_kms_that_hangs_is_given_up_within_its_timeout(kms: KmsServer, alias: str) -> None:
    kek = KmsClients().keys_of(kms_encryption(kms, alias, timeout=1.0)).sealing
    assert kek is not None
    kek.new_dek()  # the client made, the connection open
    with kms.paused():
        started = time.monotonic()
        with pytest.raises(KmsUnavailable, match=r"timeout|timed out"):
            kek.new_dek()
        assert time.monotonic() - started < 5


def test_values_sealed_under_the_kms_open_at_another_proxy(kms: KmsServer, alias: str) -> None:
    e = kms_encryption(kms, alias)
    keys = KmsClients().keys_of(e)
    cipher = RecordCipher()
    records = batch(*[(None, SECRET.encode() * 3)] * 5)
    with pytest.raises(Exception, match="no data key of aws-kms:alias/payments"):
        seal_records(records, e, cipher, decompress, compress_zstd, keys.sealing, block=False)
    sealed, count = seal_records(records, e, cipher, decompress, compress_zstd,
                                 keys.sealing, block=True)
    assert count == 5 and SECRET.encode() not in sealed and cipher.kms_calls == 1
    assert b"aws-kms:alias/payments" in sealed
    # Another proxy (its own cipher and client): not on the event loop, then in a thread.
    elsewhere = RecordCipher()
    find = KmsClients().keys_of(e).find
    with pytest.raises(KmsNeeded):
        open_records(sealed, find, elsewhere, decompress, LIMIT, block=False)
    opened = open_records(sealed, find, elsewhere, decompress, LIMIT, block=True)
    assert opened.records is not None and elsewhere.kms_calls == 1
    assert [v for _, v, _ in values(opened.records)] == [SECRET.encode() * 3] * 5
    # Its DEK kept: the next answer opens without the KMS, on the event loop.
    again = open_records(sealed, find, elsewhere, decompress, LIMIT, block=False)
    assert again.opened == 5 and elsewhere.kms_calls == 1


def test_an_answer_waiting_for_the_kms_holds_its_partitions_back(kms: KmsServer,
                                                                  alias: str) -> None:
    e = kms_encryption(kms, alias, timeout=1.0)
    clients = KmsClients()
    cipher = RecordCipher()
    sealed, _ = seal_records(batch((None, SECRET.encode())), e, cipher, decompress,
                             compress_zstd, clients.keys_of(e).sealing)
    encryptions = (("payments-encrypted", e),)
    clock = Clock()
    fresh = RecordCipher(clock)
    on_loop = open_answer(fetch_answer(sealed), encryptions, lambda _: None, fresh,
                          decompress, keys_of=clients.keys_of, block=False)
    assert on_loop.kms_needed
    with kms.paused():
        held = open_answer(fetch_answer(sealed), encryptions, lambda _: None, fresh,
                           decompress, keys_of=clients.keys_of, block=True)
    assert not held.kms_needed and held.opened == {}
    [(where, (count, reason))] = held.withheld.items()
    assert where == ("payments-encrypted", "payments") and count == 1 and "timeout" in reason
    answer = codecs.decode_response(memoryview(bytes(held.response.encode())), 1, 12)
    [partition] = answer.body.responses[0].partitions
    assert partition.error_code == UNKNOWN_SERVER_ERROR and not partition.records
    assert partition.high_watermark == 10
    assert SECRET.encode() not in bytes(held.response.encode())
    # For a while the KMS is not asked again: answered at once, even on the event loop.
    calls = fresh.kms_calls
    again = open_answer(fetch_answer(sealed), encryptions, lambda _: None, fresh,
                        decompress, keys_of=clients.keys_of, block=False)
    assert not again.kms_needed and "not asked again yet" in again.withheld[where][1]
    assert fresh.kms_calls == calls
    # The KMS back (and the while over): the same answer opens.
    clock.advance(KMS_BACKOFF_SECONDS)
    opened = open_answer(fetch_answer(sealed), encryptions, lambda _: None, fresh,
                         decompress, keys_of=clients.keys_of, block=True)
    assert opened.opened == {("payments-encrypted", "payments"): 1}


# -- the rule and the policy ----------------------------------------------------------------


def test_the_rule_names_its_kms_and_takes_no_credentials(tmp_path: Path, kms: KmsServer,
                                                         alias: str) -> None:
    [rule] = load_rules_file(kms_rules(tmp_path, kms, alias)).rules
    e = rule.encrypt_records
    assert e is not None and e.ring is None and e.key == f"aws-kms:{alias}"
    assert e.kms == KmsSpec("aws", alias, REGION, kms.endpoint, 5.0)
    key_file(tmp_path, **{"pay-0": new_key()})
    path = kms_rules(tmp_path, kms, alias, key_file_line="      key_file: keys.yaml\n")
    [rule] = load_rules_file(path).rules
    assert rule.encrypt_records is not None and rule.encrypt_records.ring is not None
    assert load_rules_file(path).files == (tmp_path / "keys.yaml",)


@pytest.mark.parametrize(("change", "error"), [
    (("type: aws", "type: gcp"), "rules.yaml:7: encrypt_records.kms.type: 'gcp' is not "
     "one of aws"),
    (("        key: alias/payments\n", ""), "rules.yaml:7: encrypt_records.kms needs 'key'"),
    (("endpoint: http://", "endpoint: ftp://"), "rules.yaml:10: encrypt_records.kms.endpoint"),
    (("timeout_seconds: 5.0", "timeout_seconds: 0"), "rules.yaml:11: encrypt_records.kms."
     "timeout_seconds: more than 0"),
    (("        type: aws\n", "        type: aws\n        secret_access_key: x\n"),
     "encrypt_records.kms takes no credentials"),
    (("      kms:\n", "      key: pay-1\n      kms:\n"), "rules.yaml:6: encrypt_records.key "
     "names a key of the key file; with kms, the key is kms.key"),
])
def test_a_bad_kms_part_is_refused_with_its_line(tmp_path: Path, kms: KmsServer,
                                                 change: tuple[str, str], error: str) -> None:
    from gatehouse.configfile import ConfigError

    path = kms_rules(tmp_path, kms, "alias/payments")
    assert change[0] in path.read_text()
    path.write_text(path.read_text().replace(*change))
    with pytest.raises(ConfigError) as caught:
        load_rules_file(path)
    assert error in str(caught.value)


async def test_produce_waits_for_a_data_key_once_then_never(tmp_path: Path, kms: KmsServer,
                                                            alias: str) -> None:
    policy = RulesPolicy(load_rules_file(kms_rules(tmp_path, kms, alias)))
    connection = app_conn()
    request = produce(batch((b"k", SECRET.encode())), client_id="app-1")
    made = policy.cipher.kms_calls
    fetch_key = policy.lookups(connection, request)  # type: ignore[arg-type]
    assert fetch_key is not None
    await fetch_key()
    assert policy.cipher.kms_calls == made + 1
    decision = policy.on_request(connection, request)  # type: ignore[arg-type]
    stored = sent_records(decision)
    assert SECRET.encode() not in stored and b"aws-kms:alias/payments" in stored
    # The DEK is made: the next requests are sealed without asking.
    assert policy.lookups(connection, request) is None  # type: ignore[arg-type]
    # Its consumers: the answer opened here (the DEK this proxy made is kept).
    fetch_request = fetch(client_id="app-1")
    decision = policy.on_request(connection, fetch_request)  # type: ignore[arg-type]
    assert isinstance(decision, Forward)
    pending = Pending(1, 1, 12, 0.0, context=decision.context)
    assert policy.offload_response(connection, pending, fetch_answer(stored)) is None  # type: ignore[arg-type]
    answer = policy.on_response(connection, pending, fetch_answer(stored))  # type: ignore[arg-type]
    assert [v for _, v, _ in fetched(answer)] == [SECRET.encode()]
    assert policy.cipher.kms_calls == made + 1


async def test_an_answer_from_another_proxy_is_opened_in_a_thread(tmp_path: Path,
                                                                  kms: KmsServer,
                                                                  alias: str) -> None:
    e = kms_encryption(kms, alias)
    stored, _ = seal_records(batch((None, SECRET.encode())), e, RecordCipher(), decompress,
                             compress_zstd, KmsClients().keys_of(e).sealing)
    policy = RulesPolicy(load_rules_file(kms_rules(tmp_path, kms, alias)))
    connection = app_conn()
    decision = policy.on_request(connection, fetch(client_id="app-1"))  # type: ignore[arg-type]
    assert isinstance(decision, Forward)
    pending = Pending(1, 1, 12, 0.0, context=decision.context)
    broker = fetch_answer(stored)
    work = policy.offload_response(connection, pending, broker)  # type: ignore[arg-type]
    assert work is not None and policy.cipher.kms_calls == 0  # nothing asked on the loop
    await trio.to_thread.run_sync(work)
    answer = policy.on_response(connection, pending, broker)  # type: ignore[arg-type]
    assert [v for _, v, _ in fetched(answer)] == [SECRET.encode()]
    assert policy.cipher.kms_calls == 1


async def test_a_kms_outage_is_answered_retriably_logged_and_counted(
        tmp_path: Path, kms: KmsServer, alias: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="gatehouse.rules")
    policy = RulesPolicy(load_rules_file(kms_rules(tmp_path, kms, alias, timeout=1.0)))
    clock = Clock()
    policy.cipher.clock = clock
    heard: list[tuple[str, str, str, int]] = []
    policy.encryption_listeners.append(lambda *args: heard.append(args))
    connection = app_conn()
    request = produce(batch((None, SECRET.encode()), (None, b"2")), client_id="app-1",
                      others=batch((None, b"orders")))
    with kms.paused():
        fetch_key = policy.lookups(connection, request)  # type: ignore[arg-type]
        assert fetch_key is not None
        await fetch_key()
        decision = policy.on_request(connection, request)  # type: ignore[arg-type]
    # The other topic goes on; the encrypted one's partition is answered retriably.
    assert isinstance(decision, Forward)
    assert [t.name for t in decision.request.body.topic_data] == ["orders"]
    answer = policy.on_response(connection, Pending(1, 0, 9, 0.0, context=decision.context),  # type: ignore[arg-type]
                                error_response(decision.request, 0))
    codes = {k: p.error_code for k, p in partitions(answer).items()}
    assert codes == {("payments", 0): REQUEST_TIMED_OUT, ("orders", 1): 0}
    assert ("payments-encrypted", "payments", "kms_unavailable", 2) in heard
    lines = [r.gatehouse_fields for r in caplog.records  # type: ignore[attr-defined]
             if r.getMessage().startswith("records not encrypted: the KMS made no data key")]
    assert lines and lines[0]["key"] == "aws-kms:alias/payments"
    assert SECRET not in caplog.text
    # Alone, the request is answered by the proxy, at once for a while (the KMS not
    # asked again); after that, the KMS back, it is sealed.
    alone = produce(batch((None, SECRET.encode())), client_id="app-1")
    assert policy.lookups(connection, alone) is None  # type: ignore[arg-type]
    refused = policy.on_request(connection, alone)  # type: ignore[arg-type]
    assert isinstance(refused, Respond)
    clock.advance(KMS_BACKOFF_SECONDS)
    fetch_key = policy.lookups(connection, alone)  # type: ignore[arg-type]
    assert fetch_key is not None
    await fetch_key()
    stored = sent_records(policy.on_request(connection, alone))  # type: ignore[arg-type]
    assert SECRET.encode() not in stored


def test_a_share_fetch_waiting_for_the_kms_acquires_nothing(kms: KmsServer,
                                                            alias: str) -> None:
    """A ShareFetch partition held back gives up its acquired records too: the share
    group's broker hands them out again when their acquisition lock runs out."""
    e = kms_encryption(kms, alias, timeout=1.0)
    clients = KmsClients()
    sealed, _ = seal_records(batch((None, SECRET.encode())), e, RecordCipher(), decompress,
                             compress_zstd, clients.keys_of(e).sealing)
    version = max(codecs.APIS[78].versions)
    body = {"responses": [{"topic_id": PAYMENTS_ID, "partitions": [{
        "partition_index": 0, "records": sealed,
        "acquired_records": [{"first_offset": 0, "last_offset": 0, "delivery_count": 1}]}]}]}
    frame = bytes(codecs.response_from_dict({"header": {"correlation_id": 1}, "body": body},
                                            api_key=78, api_version=version).encode())
    broker = codecs.decode_response(memoryview(frame), 78, version)
    names = {PAYMENTS_ID.bytes: "payments"}
    with kms.paused():
        held = open_answer(broker, (("payments-encrypted", e),), names.get, RecordCipher(),
                           decompress, keys_of=clients.keys_of, block=True)
    answer = codecs.decode_response(memoryview(bytes(held.response.encode())), 78, version)
    [partition] = answer.body.responses[0].partitions
    assert partition.error_code == UNKNOWN_SERVER_ERROR
    assert not partition.records and list(partition.acquired_records) == []
    opened = open_answer(broker, (("payments-encrypted", e),), names.get, RecordCipher(),
                         decompress, keys_of=clients.keys_of, block=True)
    [partition] = opened.response.body.responses[0].partitions
    assert list(partition.acquired_records) != [] and opened.opened == {
        ("payments-encrypted", "payments"): 1}


async def test_each_topic_sealed_under_its_own_kms_key(tmp_path: Path, kms: KmsServer,
                                                       caplog: pytest.LogCaptureFixture
                                                       ) -> None:
    """``kms.key: alias/pay-{topic}``: each topic's values under its own key (deleting
    it makes that topic alone unreadable); a topic without a key is answered
    retriably, logged with the key it wants; a topic named by an id not learned yet is
    asked to look again (UNKNOWN_TOPIC_ID), as no key can be named for it."""
    caplog.set_level(logging.WARNING, logger="gatehouse.rules")
    kms.new_key("alias/pay-payments")
    kms.new_key("alias/pay-refunds")
    path = kms_rules(tmp_path, kms, "alias/pay-{topic}")
    path.write_text(path.read_text().replace("topics: [payments]",
                                             "topics: [payments, refunds, ledger]"))
    policy = RulesPolicy(load_rules_file(path))
    connection = app_conn()
    both = req(0, 9, "app-1", acks=-1, timeout_ms=1000, topic_data=[
        {"name": topic, "partition_data": [{"index": 0, "records": batch(
            (None, SECRET.encode() + topic.encode()))}]} for topic in ("payments", "refunds")])
    prepare = policy.lookups(connection, both)  # type: ignore[arg-type]
    assert prepare is not None
    await prepare()
    assert policy.cipher.kms_calls == 2  # a data key for each topic's key
    decision = policy.on_request(connection, both)  # type: ignore[arg-type]
    assert isinstance(decision, Forward)
    sent = codecs.decode_request(bytes(decision.request.encode()))
    stored = {t.name: bytes(t.partition_data[0].records) for t in sent.body.topic_data}
    assert b"aws-kms:alias/pay-payments" in stored["payments"]
    assert b"aws-kms:alias/pay-refunds" in stored["refunds"]
    assert b"pay-refunds" not in stored["payments"] and SECRET.encode() not in b"".join(
        stored.values())
    # Each opens through another proxy (its own data keys, the KMS's).
    other = RulesPolicy(load_rules_file(path))
    for topic, records in stored.items():
        decision = other.on_request(connection, fetch(client_id="app-1", topic=topic))  # type: ignore[arg-type]
        assert isinstance(decision, Forward)
        pending = Pending(1, 1, 12, 0.0, context=decision.context)
        broker = fetch_answer(records, topic=topic)
        work = other.offload_response(connection, pending, broker)  # type: ignore[arg-type]
        assert work is not None
        await trio.to_thread.run_sync(work)
        answer = other.on_response(connection, pending, broker)  # type: ignore[arg-type]
        assert [v for _, v, _ in fetched(answer)] == [SECRET.encode() + topic.encode()]
    # A topic whose key the KMS does not have: refused retriably, and said.
    ledger = produce(batch((None, SECRET.encode())), topic="ledger", client_id="app-1")
    prepare = policy.lookups(connection, ledger)  # type: ignore[arg-type]
    assert prepare is not None
    await prepare()
    refused = policy.on_request(connection, ledger)  # type: ignore[arg-type]
    assert isinstance(refused, Respond)
    [(_, partition)] = partitions(refused.response).items()
    assert partition.error_code == REQUEST_TIMED_OUT
    [line] = [r.gatehouse_fields for r in caplog.records  # type: ignore[attr-defined]
              if r.getMessage().startswith("records not encrypted: the KMS made no data")]
    assert line["key"] == "aws-kms:alias/pay-ledger" and "NotFoundException" in line["reason"]
    # By id, not learned yet: no key can be named.
    by_id = produce(batch((None, SECRET.encode())), version=13, client_id="app-1")
    refused = policy.on_request(connection, by_id)  # type: ignore[arg-type]
    assert isinstance(refused, Respond)
    [(_, partition)] = partitions(refused.response).items()
    assert partition.error_code == UNKNOWN_TOPIC_ID


def test_a_per_topic_key_is_an_alias(tmp_path: Path, kms: KmsServer) -> None:
    from gatehouse.configfile import ConfigError

    for key, error in (("pay-{topic}", "the one placeholder is {topic}"),
                       ("alias/pay-{name}", "the one placeholder is {topic}")):
        with pytest.raises(ConfigError) as caught:
            load_rules_file(kms_rules(tmp_path, kms, key))
        assert "rules.yaml:8: encrypt_records.kms.key" in str(caught.value)
        assert error in str(caught.value)
    [rule] = load_rules_file(kms_rules(tmp_path, kms, "alias/pay-{topic}")).rules
    assert rule.encrypt_records is not None and rule.encrypt_records.kms is not None
    assert rule.encrypt_records.kms.kek_name_for("orders") == "aws-kms:alias/pay-orders"
